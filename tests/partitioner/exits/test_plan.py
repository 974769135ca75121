"""Planning with early exits: expected costs, where exits fall, and a plan the tiers run."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import torch
from onnx import helper
from torch import nn

from tierflow.cli.main import main
from tierflow.device.client import DeviceClient
from tierflow.edge.forwarding import Forwarding
from tierflow.errors import PlanError
from tierflow.link.spec import LinkSpec
from tierflow.onnxrt.inference import open_session
from tierflow.options import RuntimeOptions
from tierflow.partitioner.cost import ExitPoint, Problem, build_tables, estimate
from tierflow.partitioner.exits.add import add_exits
from tierflow.partitioner.exits.calibration import NEVER
from tierflow.partitioner.exits.metadata import METADATA_KEY, ExitedModel
from tierflow.partitioner.exits.plan import exit_points, graph_exits, load_planning_graph
from tierflow.partitioner.graph import load_model
from tierflow.partitioner.profile import load_profile, profile_model, save_profile
from tierflow.partitioner.report import exits_cell, plan_table
from tierflow.partitioner.search import search
from tierflow.plan import load_plan, save_plan
from tierflow.runtime.server import TierServer
from tierflow.zoo.models import export_onnx

from ..conftest import MakeProfile

RAW = {"raw": (1.0, 0.0, 0.0)}


def _links(de: tuple[float, float], ec: tuple[float, float]) -> dict[str, LinkSpec]:
    return {"device-edge": LinkSpec(*de), "edge-cloud": LinkSpec(*ec)}


# --- the cost model ---------------------------------------------------------------------


def test_expected_latency_matches_the_hand_computed_value(profile_factory: MakeProfile) -> None:
    """Plan (1, 3), exit at cut 2 on the edge answering 60%: every term by hand."""
    cut_bytes = [1000, 800, 400, 200, 40]

    def tier(units: list[float]) -> Any:
        made = profile_factory(units, cut_bytes, overhead_s=0.002, codecs=RAW)
        return dataclasses.replace(made, output_s_per_byte=1e-6)

    problem = Problem(
        profiles={
            "device": tier([0.010, 0.020, 0.030, 0.040]),
            "edge": tier([0.005, 0.010, 0.015, 0.020]),
            "cloud": tier([0.001, 0.002, 0.003, 0.004]),
        },
        links=_links((8e6, 0.010), (8e6, 0.100)),
        exits=(ExitPoint("exit0_probs", 2, 0.6),),
    )
    got = estimate(build_tables(problem), 1, 3, {"device-edge": "raw", "edge-cloud": "raw"})
    # reach after cuts 0..4: 1, 1, 0.4, 0.4, 0.4
    device = 0.010 + 0.002 + 1e-6 * 800
    edge = (
        0.010 * 1.0  # unit 1
        + 0.015 * 0.4  # unit 2, after the exit
        + 0.002  # call overhead
        + 1e-6 * 200 * 0.4  # output at cut 3, by the chance of computing it
        + 1e-6 * 400  # the head: one pass over the feature, every request arrives
        + 0.002
        + 1e-6 * 400  # the extra segment boundary at the exit
    )
    cloud = (0.004 + 0.002 + 1e-6 * 40) * 0.4
    device_edge = 800 * 8 / 8e6 + 0.010 + 40 * 8 / 8e6
    edge_cloud = (200 * 8 / 8e6 + 0.100 + 40 * 8 / 8e6) * 0.4
    assert got.compute_s["device"] == pytest.approx(device)
    assert got.compute_s["edge"] == pytest.approx(edge)
    assert got.compute_s["cloud"] == pytest.approx(cloud)
    assert got.links["edge-cloud"].reach == pytest.approx(0.4)
    assert got.links["edge-cloud"].bytes == 200  # what one crossing request sends
    assert got.latency_s == pytest.approx(device + edge + cloud + device_edge + edge_cloud)
    assert [(e.name, e.tier, e.rate) for e in got.exits] == [("exit0_probs", "edge", 0.6)]
    assert got.to_dict()["exits"] == [
        {"name": "exit0_probs", "cut": 2, "tier": "edge", "rate": 0.6}
    ]


def test_an_exit_that_never_answers_costs_nothing_without_overheads(
    profile_factory: MakeProfile,
) -> None:
    """Rate 0, no call overhead, no output cost: the same figures as without the exit."""
    profile = profile_factory([0.01, 0.02, 0.03, 0.04], [100, 80, 60, 40, 10])
    profiles = {"device": profile.emulate(4.0), "edge": profile.emulate(2.0), "cloud": profile}
    links = _links((1e6, 0.01), (1e7, 0.02))
    plain = build_tables(Problem(profiles, links, codecs=("raw", "zstd")))
    exited = build_tables(
        Problem(profiles, links, codecs=("raw", "zstd"), exits=(ExitPoint("e", 2, 0.0),))
    )
    for tier in ("device", "edge", "cloud"):
        np.testing.assert_allclose(exited.segment_s[tier], plain.segment_s[tier])
    for name in ("device-edge", "edge-cloud"):
        np.testing.assert_allclose(exited.links[name].total_s, plain.links[name].total_s)


def _slow_cloud_link(profile_factory: MakeProfile, rate: float, objective: str) -> Problem:
    """A slow device, an edge with costly late layers, a fast cloud behind a slow link.

    Features take 0.8 s on the edge-cloud link, so it bounds both latency and throughput.
    """
    cut_bytes = [100_000, 100_000, 100_000, 100_000, 40]
    edge = profile_factory([0.01, 0.01, 0.5, 0.5], cut_bytes)
    return Problem(
        profiles={
            "device": edge.emulate(100.0),
            "edge": edge,
            "cloud": profile_factory([0.001] * 4, cut_bytes),
        },
        links=_links((1e9, 0.001), (1e6, 0.050)),
        objective=objective,
        codecs=("raw", "zstd"),
        exits=(ExitPoint("exit0_probs", 2, rate),) if rate else (),
    )


@pytest.mark.parametrize("objective", ["latency", "throughput"])
def test_a_likely_exit_moves_the_split_so_the_edge_answers(
    profile_factory: MakeProfile, objective: str
) -> None:
    without = search(_slow_cloud_link(profile_factory, 0.0, objective)).best
    assert without.cuts[1] < 2  # the cloud does the work; an exit at cut 2 would be there
    best = search(_slow_cloud_link(profile_factory, 0.9, objective)).best
    assert best.cuts[1] >= 2 and best.exits[0].tier == "edge"
    assert best.score(objective) < without.score(objective)
    if best.cuts[1] < best.last:  # the link is used by the 10% that go on, and only by them
        assert best.links["edge-cloud"].reach == pytest.approx(0.1)
    assert exits_cell(best) == "edge:exit0(90%)"
    table = plan_table(search(_slow_cloud_link(profile_factory, 0.9, objective)), {})
    assert "exp. latency ms" in table and "edge:exit0(90%)" in table


def test_an_exit_on_the_device_spares_both_links(profile_factory: MakeProfile) -> None:
    """Behind a slow first link the device runs up to a likely exit and answers itself."""
    cut_bytes = [100_000, 100_000, 100_000, 100_000, 40]
    device = profile_factory([0.01, 0.01, 0.5, 0.5], cut_bytes)
    problem = Problem(
        profiles={"device": device, "edge": device.emulate(0.1), "cloud": device.emulate(0.1)},
        links=_links((1e6, 0.050), (1e9, 0.001)),
        exits=(ExitPoint("exit0_probs", 2, 0.9),),
    )
    best = search(problem).best
    assert best.cuts[0] >= 2 and best.exits[0].tier == "device"
    if best.cuts[0] < best.last:
        assert best.links["device-edge"].reach == pytest.approx(0.1)


def test_exits_are_checked(profile_factory: MakeProfile) -> None:
    profile = profile_factory([0.01, 0.02, 0.03], [10, 10, 10, 10])
    profiles = {"device": profile, "edge": profile, "cloud": profile}
    links = _links((1e6, 0.0), (1e6, 0.0))
    with pytest.raises(PlanError, match="interior cut"):
        Problem(profiles, links, exits=(ExitPoint("e", 3, 0.5),))
    with pytest.raises(PlanError, match="distinct cuts in order"):
        Problem(profiles, links, exits=(ExitPoint("e", 2, 0.1), ExitPoint("f", 1, 0.1)))
    with pytest.raises(PlanError, match="more than every request"):
        Problem(profiles, links, exits=(ExitPoint("e", 1, 0.7), ExitPoint("f", 2, 0.7)))


# --- a real model with exits, planned and served ----------------------------------------


class _Tiny(nn.Module):
    """Three conv stages on 8x8 inputs (random weights: the tests need no accuracy)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Sequential(nn.Conv2d(1, 8, 3, 1, 1), nn.ReLU())
        self.b = nn.Sequential(nn.Conv2d(8, 16, 3, 2, 1), nn.ReLU())
        self.c = nn.Sequential(nn.Conv2d(16, 16, 3, 2, 1), nn.ReLU())
        self.fc = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.c(self.b(self.a(x))).mean(dim=(2, 3)))


def _with_exits(exited: ExitedModel, threshold: float, rate: float) -> onnx.ModelProto:
    """The model with its exits' threshold and recorded exit rate replaced."""
    model = onnx.ModelProto()
    model.CopyFrom(exited.model)
    records = [
        dict(e.to_dict(), threshold=threshold, calibration=dict(e.calibration, exit_rate=rate))
        for e in exited.exits
    ]
    props = {p.key: p.value for p in model.metadata_props}
    props[METADATA_KEY] = json.dumps(records)
    helper.set_model_props(model, props)
    return model


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The plain model and one exit at its middle, recorded as answering 95% (threshold 0)."""
    directory = tmp_path_factory.mktemp("exit-plan")
    torch.manual_seed(0)
    net = _Tiny().eval()
    example = torch.zeros(1, 1, 8, 8)
    plain = export_onnx(net, (example,), directory / "tiny.onnx", dynamo=False, dynamic_batch=True)
    rows = np.random.default_rng(0).standard_normal((120, 1, 1, 8, 8)).astype(np.float32)
    exited = add_exits(plain, {"input": rows}, exits=1, max_disagreement=0.5)
    always = directory / "tiny-exits.onnx"
    onnx.save_model(_with_exits(exited, 0.0, 0.95), str(always))
    return {"plain": plain, "always": always}


@pytest.mark.integration
def test_the_trunk_is_planned_and_the_exit_found(models: dict[str, Path], tmp_path: Path) -> None:
    graph = load_planning_graph(models["always"])
    plain = load_model(models["plain"])
    assert [(c.position, c.tensors) for c in graph.cuts] == [
        (c.position, c.tensors) for c in plain.cuts
    ]
    assert graph.path == str(models["always"]) and graph.sha256 != plain.sha256
    assert [e.name for e in graph_exits(graph)] == ["exit0_probs"]
    points, notes = exit_points(graph)
    assert not notes and [(p.name, p.rate) for p in points] == [("exit0_probs", 0.95)]
    assert not graph_exits(plain)  # a plain model plans as before
    profile = tmp_path / "profile.json"
    assert main(["profile", str(models["always"]), "-o", str(profile), "--time-budget", "0.1"]) == 0
    load_profile(profile).check_model(graph)  # profiles time the trunk too


def _serve(plan_dir: Path, feeds: list[dict[str, np.ndarray]]) -> list[Any]:
    cloud = TierServer.from_plan(
        "cloud", plan_dir, "127.0.0.1:0", options=RuntimeOptions(workers=2)
    )
    cloud.start()
    edge = TierServer.from_plan(
        "edge",
        plan_dir,
        "127.0.0.1:0",
        forwarder=Forwarding(cloud.address),
        options=RuntimeOptions(workers=2),
    )
    try:
        edge.start()
        with DeviceClient(plan_dir, edge.address, window=4) as device:
            return [r.unwrap() for r in device.run_stream(feeds)]
    finally:
        edge.stop(0.5)
        cloud.stop(0.5)


@pytest.mark.integration
def test_planned_exit_answers_on_the_edge_and_never_exit_reproduces_the_model(
    models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    graph = load_planning_graph(models["always"])
    base = profile_model(graph, time_budget_s=0.3)
    # A slow device that serialises as fast as the edge: the edge, not the device, should
    # take the exit, and the slow edge-cloud link makes taking it there pay.
    device = dataclasses.replace(base.emulate(1000.0), cuts=base.cuts)
    for tier, profile in (("device", device), ("edge", base), ("cloud", base)):
        save_profile(profile, tmp_path / f"{tier}.json")
    plan_dir = tmp_path / "plan"
    argv = ["plan", str(models["always"]), "-o", str(plan_dir), "--codec", "raw"]
    argv += [f"--profile={t}={tmp_path / t}.json" for t in ("device", "edge", "cloud")]
    argv += ["--link", "device-edge=10gbit,0ms", "--link", "edge-cloud=1mbit,100ms"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "edge:exit0(95%)" in printed and "expected (with early exits)" in printed

    plan = load_plan(plan_dir)
    with_exit = [s for s in plan.segments if s.exits]
    assert [(s.tier, [e.name for e in s.exits]) for s in with_exit] == [("edge", ["exit0_probs"])]
    assert plan.estimate["exits"][0]["tier"] == "edge"
    assert plan.estimate["verified"]["bitwise_equal"] is True

    rng = np.random.default_rng(1)
    feeds = [{"input": rng.standard_normal((1, 1, 8, 8)).astype(np.float32)} for _ in range(6)]
    whole = open_session(models["always"])
    for feed, result in zip(feeds, _serve(plan_dir, feeds), strict=True):
        assert (result.answered_by, result.exit) == ("edge", "exit0_probs")
        assert result.bytes["edge-cloud"] == 0 and result.bytes["device-edge"] > 0
        (want,) = whole.run(["exit0_probs"], feed)  # the exit's answer, from the whole model
        assert result.outputs["exit0_probs"].tobytes() == want.tobytes()

    _check_never_exits(plan_dir, models["plain"], feeds)


def _check_never_exits(plan_dir: Path, model: Path, feeds: list[dict[str, np.ndarray]]) -> None:
    """The plan with thresholds no probability reaches gives the whole model's answers."""
    plan = load_plan(plan_dir)
    never = [
        dataclasses.replace(
            s, exits=tuple(dataclasses.replace(e, threshold=NEVER) for e in s.exits)
        )
        for s in plan.segments
    ]
    save_plan(dataclasses.replace(plan, segments=tuple(never)), plan_dir)
    session = open_session(model)
    last_tier = plan.segments[-1].tier
    for feed, result in zip(feeds, _serve(plan_dir, feeds), strict=True):
        (want,) = session.run(["output"], feed)
        assert (result.answered_by, result.exit) == (last_tier, None)
        assert result.outputs["output"].tobytes() == want.tobytes()


@pytest.mark.integration
def test_plan_with_exits_splits_each_tier_at_its_exits(
    models: dict[str, Path], tmp_path: Path
) -> None:
    """A three-tier plan with the exit inside the edge's stretch: two edge segments."""
    from tierflow.partitioner.plan_options import PlanOptions
    from tierflow.partitioner.plan_writing import write_plan

    graph = load_planning_graph(models["always"])
    base = profile_model(graph, time_budget_s=0.2)
    (point,), _ = exit_points(graph)
    problem = Problem(
        profiles={"device": base, "edge": base, "cloud": base},
        links=_links((1e9, 0.0), (1e9, 0.0)),
        exits=(point,),
    )
    last = len(graph.cuts) - 1
    assert 1 < point.cut < last - 1
    chosen = estimate(
        build_tables(problem),
        point.cut - 1,
        point.cut + 1,
        {"device-edge": "raw", "edge-cloud": "raw"},
    )
    options = PlanOptions(links=problem.links, codec="raw")
    written = write_plan(graph, problem.profiles, options, chosen, tmp_path / "plan")
    tiers = [(s.tier, [e.name for e in s.exits]) for s in written.plan.segments]
    assert tiers == [("device", []), ("edge", ["exit0_probs"]), ("edge", []), ("cloud", [])]
    assert written.verified_bitwise is True

    rng = np.random.default_rng(2)
    feeds = [{"input": rng.standard_normal((1, 1, 8, 8)).astype(np.float32)} for _ in range(4)]
    for result in _serve(tmp_path / "plan", feeds):  # threshold 0: every request leaves
        assert (result.answered_by, result.exit) == ("edge", "exit0_probs")
        assert result.bytes["edge-cloud"] == 0
    _check_never_exits(tmp_path / "plan", models["plain"], feeds)
