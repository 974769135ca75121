"""Early exits: heads grafted without touching the original, thresholds that hold on new data."""

from __future__ import annotations

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
from tierflow.errors import InputError, ModelError, PlanError, UsageError
from tierflow.partitioner.exits.add import add_exits, simulate_exits
from tierflow.partitioner.exits.calibration import NEVER, calibrate, lowest_threshold
from tierflow.partitioner.exits.commands import parse_fraction
from tierflow.partitioner.exits.cost import (
    exit_cut_indices,
    exit_skips,
    expected_compute,
    expected_compute_fraction,
)
from tierflow.partitioner.exits.heads import run_model, train_head
from tierflow.partitioner.exits.metadata import ExitedModel, ExitInfo, read_exit_summary, read_exits
from tierflow.partitioner.exits.plan import attach_exits
from tierflow.partitioner.exits.points import exit_candidates
from tierflow.partitioner.graph import load_model
from tierflow.partitioner.split import split_model, write_segments
from tierflow.plan import Plan, SegmentSpec
from tierflow.runtime.segment_runner import TierRunner
from tierflow.zoo.models import export_onnx

# The calibration target in these tests and how far a fresh split may exceed it: the
# heads are fit on 360 rows and the thresholds on 240 others, then checked on 497 rows
# used for neither, where one request more or less is 0.2%. (Measured: 1.2% at a 65%
# exit rate.)
TARGET = 0.02
SLACK = 0.02


class _TinyNet(nn.Module):
    """Three conv stages on 8x8 digits: one-tensor cuts at 8x8, 4x4 and 2x2."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Sequential(nn.Conv2d(1, 8, 3, 1, 1), nn.ReLU())
        self.b = nn.Sequential(nn.Conv2d(8, 16, 3, 2, 1), nn.ReLU())
        self.c = nn.Sequential(nn.Conv2d(16, 32, 3, 2, 1), nn.ReLU())
        self.fc = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.c(self.b(self.a(x))).mean(dim=(2, 3)))


@pytest.fixture(scope="module")
def digits8() -> dict[str, np.ndarray]:
    """sklearn's 8x8 digits, normalised, shuffled with seed 0: [N,1,8,8] and labels."""
    from sklearn.datasets import load_digits

    data = load_digits()
    order = np.random.default_rng(0).permutation(len(data.target))
    images = (np.asarray(data.images, dtype=np.float32)[order, None] / 16.0 - 0.3) / 0.4
    return {"image": images, "labels": np.asarray(data.target, dtype=np.int64)[order]}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory, digits8: dict[str, np.ndarray]) -> Path:
    """A tiny CNN trained for a second on the first 700 digits, exported with a dynamic batch."""
    torch.manual_seed(0)
    net = _TinyNet()
    images = torch.from_numpy(digits8["image"][:700])
    labels = torch.from_numpy(digits8["labels"][:700])
    optimizer = torch.optim.Adam(net.parameters(), lr=0.02)
    for _ in range(60):
        loss = nn.functional.cross_entropy(net(images), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    net.eval()
    path = tmp_path_factory.mktemp("exits") / "tiny.onnx"
    export_onnx(net, (images[:1],), path, dynamo=False, dynamic_batch=True)
    return path


def _requests(images: np.ndarray, labels: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """Rows -> the IN.npz layout: a request axis, then the model's [1,1,8,8]."""
    arrays = {"input": images[:, None]}
    if labels is not None:
        arrays["labels"] = labels
    return arrays


@pytest.fixture(scope="module")
def exited(tiny: Path, digits8: dict[str, np.ndarray]) -> ExitedModel:
    """Exits calibrated on digits 700..1300 with labels withheld (the model's own answers)."""
    calib = _requests(digits8["image"][700:1300])
    return add_exits(tiny, calib, exits=2, max_disagreement=TARGET)


@pytest.mark.integration
def test_original_outputs_are_bit_for_bit_unchanged(
    tiny: Path, exited: ExitedModel, digits8: dict[str, np.ndarray]
) -> None:
    rows = {"input": digits8["image"][1300:]}
    before = run_model(onnx.load(str(tiny)), rows, ["output"])["output"]
    after = run_model(exited.model, rows, ["output"])["output"]
    assert before.dtype == after.dtype
    assert np.array_equal(before, after)
    original = onnx.load(str(tiny))
    outputs = [o.name for o in exited.model.graph.output]
    assert outputs == ["output", "exit0_probs", "exit1_probs"]
    assert original.graph.node[:] == exited.model.graph.node[: len(original.graph.node)]
    onnx.checker.check_model(exited.model)


@pytest.mark.integration
def test_thresholds_that_never_exit_reproduce_the_full_model(
    tiny: Path, exited: ExitedModel, digits8: dict[str, np.ndarray]
) -> None:
    rows = {"input": digits8["image"][1300:]}
    never = [ExitInfo(e.name, e.at, NEVER) for e in exited.exits]
    taken, predicted, outputs = simulate_exits(exited.model, rows, never)
    full = run_model(onnx.load(str(tiny)), rows, ["output"])["output"]
    assert (taken == -1).all()
    assert np.array_equal(outputs["output"], full)
    assert np.array_equal(predicted, full.argmax(axis=1))


@pytest.mark.integration
def test_calibration_meets_its_target_on_unseen_data(
    tiny: Path, exited: ExitedModel, digits8: dict[str, np.ndarray]
) -> None:
    candidates = exit_candidates(load_model(tiny))
    points = [e.at for e in exited.exits]
    assert points == sorted(set(points), key=candidates.index)
    assert exited.summary["disagreement"] <= TARGET
    for info in exited.exits:
        assert info.calibration["achieved"] <= TARGET
        assert info.calibration["target"] == TARGET
    # A third split, used neither for the heads nor for the thresholds.
    rows = {"input": digits8["image"][1300:]}
    taken, predicted, outputs = simulate_exits(exited.model, rows)
    disagreement = float((predicted != outputs["output"].argmax(axis=1)).mean())
    exit_rate = float((taken >= 0).mean())
    assert disagreement <= TARGET + SLACK, (disagreement, exit_rate)
    assert exit_rate > 0.3  # the exits do take work off the model


@pytest.mark.integration
def test_exits_are_recorded_in_the_metadata(exited: ExitedModel, tmp_path: Path) -> None:
    path = exited.save(tmp_path / "with-exits.onnx")
    recorded = read_exits(path)
    assert recorded == list(exited.exits)
    assert read_exit_summary(path)["target"] == TARGET
    first = recorded[0]
    assert first.name == "exit0_probs" and 0.0 < first.threshold <= 1.0
    spec = SegmentSpec("edge", "seg1.onnx", ("input",), ("relu", first.name), (first.to_spec(),))
    again = SegmentSpec.from_dict(json.loads(json.dumps(spec.to_dict())))
    assert again.exits[0].name == first.name and again.exits[0].threshold == first.threshold
    assert again.exits[0].calibration["at"] == first.at


@pytest.mark.integration
def test_labels_train_heads_and_bound_the_accuracy_drop(
    tiny: Path, digits8: dict[str, np.ndarray]
) -> None:
    calib = _requests(digits8["image"][700:1300], digits8["labels"][700:1300])
    second = exit_candidates(load_model(tiny))[1]
    result = add_exits(tiny, calib, at=[second], max_accuracy_drop=0.01, pool_grid=1)
    assert [e.at for e in result.exits] == [second]
    assert result.summary["metric"] == "accuracy_drop"
    assert result.summary["achieved"] <= 0.01
    assert result.summary["accuracy_full"] - result.summary["accuracy_with_exits"] <= 0.01
    kinds = {node.op_type for node in result.model.graph.node}
    assert "GlobalAveragePool" in kinds and "AveragePool" not in kinds


@pytest.mark.integration
def test_declared_exits_are_calibrated(
    exited: ExitedModel, tmp_path: Path, digits8: dict[str, np.ndarray]
) -> None:
    bare = onnx.ModelProto()
    bare.CopyFrom(exited.model)
    del bare.metadata_props[:]
    path = tmp_path / "declared.onnx"
    onnx.save(bare, str(path))
    calib = _requests(digits8["image"][700:1300])
    result = add_exits(path, calib, at=[], exits=0, declare=["exit1_probs"])
    assert [(e.name, e.at) for e in result.exits] == [("exit1_probs", exited.exits[1].at)]
    with pytest.raises(UsageError, match="not an output"):
        add_exits(path, calib, exits=0, declare=["nope"])


def test_lowest_threshold_keeps_the_leavers_within_target() -> None:
    confidence = np.array([0.99, 0.95, 0.9, 0.9, 0.8, 0.6])
    wrong = np.array([0.0, 0.0, 1.0, 0.0, 0.0, 1.0])
    # With one pseudo-miss, leaving at >= 0.99 costs 1/2, >= 0.95 1/3, >= 0.9 2/5,
    # >= 0.8 2/6, >= 0.6 3/7; ties (0.9) leave together.
    assert lowest_threshold(confidence, wrong, 0.34) == 0.8
    assert lowest_threshold(confidence[:2], wrong[:2], 0.34) == 0.95
    assert lowest_threshold(confidence, wrong, 0.45) == 0.6
    assert lowest_threshold(confidence, wrong, 0.4) == 0.8
    assert lowest_threshold(confidence, wrong, 0.3) == NEVER
    assert lowest_threshold(np.ones(99), np.zeros(99), 0.01) == 1.0
    assert lowest_threshold(np.ones(98), np.zeros(98), 0.01) == NEVER


def test_calibrate_takes_exits_in_order() -> None:
    reference = np.array([0, 1, 2, 0])
    first = np.array([[0.9, 0.1, 0.0], [0.2, 0.8, 0.0], [0.6, 0.4, 0.0], [0.3, 0.3, 0.4]])
    second = np.eye(3)[[1, 1, 2, 0]] * 0.98 + 0.01
    infos, summary = calibrate([first, second], reference, None, target=0.34)
    # Rows 0 and 1 leave first: (0 misses + 1) / (2 + 1) <= 0.34; adding row 2 costs 2/4.
    assert infos[0]["threshold"] == pytest.approx(0.8)
    assert infos[0]["calibration"]["exit_rate"] == 0.5
    assert infos[1]["calibration"]["exited"] == 2  # rows 2 and 3: row 0's miss is not counted
    assert summary["disagreement"] == 0.0 and summary["exit_rate"] == 1.0


def test_expected_compute_counts_the_chance_of_leaving() -> None:
    units = [1.0, 2.0, 3.0, 4.0]
    assert expected_compute(units, []) == 10.0
    # 30% leave after unit 0, 50% after unit 2: 1 + 0.7*2 + 0.7*3 + 0.2*4.
    assert expected_compute(units, [(1, 0.3), (3, 0.5)]) == pytest.approx(5.3)
    assert expected_compute_fraction(units, [(1, 0.3), (3, 0.5)]) == pytest.approx(0.53)
    with pytest.raises(PlanError, match="more than 1"):
        expected_compute(units, [(1, 0.7), (2, 0.6)])


@pytest.mark.integration
def test_exit_cut_indices_name_the_cuts(tiny: Path, exited: ExitedModel) -> None:
    graph = load_model(tiny)
    indices = exit_cut_indices(graph, exited.exits)
    for info in exited.exits:
        assert graph.cuts[indices[info.name]].tensors == (info.at,)
    skips = exit_skips(graph, exited.exits)
    assert skips == [(indices[e.name], e.exit_rate) for e in exited.exits]
    # The planner's figure: with per-unit costs of 1, the expected number of units run.
    units = [1.0] * graph.unit_count()
    expected = expected_compute(units, skips)
    assert expected < graph.unit_count()
    assert expected == pytest.approx(
        sum(rate * first for first, rate in skips)
        + (1 - sum(rate for _, rate in skips)) * graph.unit_count()
    )


def _image_output_model(path: Path) -> Path:
    image = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 1, 4, 4])
    out = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 1, 4, 4])
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [image], [out])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


@pytest.mark.integration
def test_bad_inputs_raise_typed_errors(
    tiny: Path, tmp_path: Path, digits8: dict[str, np.ndarray]
) -> None:
    calib = _requests(digits8["image"][:50])
    with pytest.raises(ModelError, match="classifier"):
        add_exits(
            _image_output_model(tmp_path / "img.onnx"), {"x": np.zeros((4, 1, 1, 4, 4), np.float32)}
        )
    with pytest.raises(InputError, match="input"):
        add_exits(tiny, {"image": digits8["image"][:50, None]})
    with pytest.raises(InputError):
        add_exits(tiny, {"input": digits8["image"][:50]})  # no request axis
    with pytest.raises(InputError, match="labels"):
        add_exits(tiny, calib, max_accuracy_drop=0.01)
    with pytest.raises(UsageError, match="not both"):
        add_exits(tiny, calib, max_accuracy_drop=0.01, max_disagreement=0.01)
    with pytest.raises(UsageError, match="cannot carry an exit"):
        add_exits(tiny, calib, at=["output"])
    with pytest.raises(InputError, match="does not exist"):
        add_exits(tiny, tmp_path / "missing.npz")
    with pytest.raises(InputError, match="class indices"):
        add_exits(tiny, {**calib, "labels": np.full(50, 10)})


def test_heads_match_softmax_regression_in_the_graph_layout() -> None:
    """The folded weights give sklearn's probabilities, also for two classes of three."""
    from sklearn.linear_model import LogisticRegression

    rng = np.random.default_rng(0)
    features = rng.normal(size=(200, 3)) * [1.0, 5.0, 0.1] + [0.0, 3.0, -1.0]
    targets = (features[:, 0] + 0.3 * rng.normal(size=200) > 0).astype(np.int64)
    weight, bias = train_head(features, targets, 3)
    logits = features @ weight + bias
    probs = np.exp(logits - logits.max(axis=1, keepdims=True))
    probs /= probs.sum(axis=1, keepdims=True)
    scaled = (features - features.mean(axis=0)) / (features.std(axis=0) + 1e-6)
    reference = LogisticRegression(max_iter=2000).fit(scaled, targets).predict_proba(scaled)
    np.testing.assert_allclose(probs[:, :2], reference, atol=1e-5)
    assert probs[:, 2].max() < 1e-9  # a class never seen gets no probability


def test_parse_fraction() -> None:
    assert parse_fraction("1%") == pytest.approx(0.01)
    assert parse_fraction("0.5 %") == pytest.approx(0.005)
    assert parse_fraction("0.02") == pytest.approx(0.02)
    for bad in ("abc", "100%", "-1%", "2"):
        with pytest.raises(UsageError):
            parse_fraction(bad)


@pytest.mark.integration
def test_cli_adds_and_shows_exits(
    tiny: Path, tmp_path: Path, digits8: dict[str, np.ndarray], capsys: Any
) -> None:
    data = tmp_path / "calib.npz"
    np.savez(data, input=digits8["image"][700:1300, None], labels=digits8["labels"][700:1300])
    out = tmp_path / "out.onnx"
    argv = ["exits", "add", str(tiny), "--data", str(data), "-o", str(out), "--exits", "1"]
    assert main([*argv, "--max-disagreement", "2%"]) == 0
    printed = capsys.readouterr().out
    assert "exit0_probs" in printed and "overall" in printed
    assert len(read_exits(out)) == 1
    assert main(["exits", "show", str(out), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["exits"][0]["name"] == "exit0_probs"
    assert (
        main(["exits", "add", str(tiny), "--data", str(tmp_path / "nope.npz"), "-o", str(out)]) == 2
    )
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.integration
def test_split_plan_with_exits_runs_on_the_tier_runtime(
    tiny: Path, exited: ExitedModel, digits8: dict[str, np.ndarray], tmp_path: Path
) -> None:
    """Cut at the exits, attach the heads, and let the runtime's TierRunner take them."""
    graph = load_model(tiny)
    at = exit_cut_indices(graph, exited.exits)
    cuts = [at[e.name] for e in exited.exits]
    plain = split_model(graph, cuts, ("device", "edge", "edge"))

    def answers(infos: list[ExitInfo], directory: Path) -> tuple[list[Any], np.ndarray]:
        segments = attach_exits(plain, exited.model, infos)
        assert [len(spec.exits) for spec, _ in segments] == [1, 1, 0]
        write_segments(segments, directory)
        plan = Plan(tiny.name, graph.sha256, ("input",), ("output",), tuple(s for s, _ in segments))
        device = TierRunner(plan, directory, "device")
        edge = TierRunner(plan, directory, "edge")
        taken: list[Any] = []
        scores = []
        for image in digits8["image"][1300:1400]:
            outcome = device.run({"input": image[None]})
            if not outcome.final:
                outcome = edge.run(outcome.tensors)
            taken.append(outcome.exit)
            scores.append(next(iter(outcome.tensors.values()))[0])
        return taken, np.array(scores)

    rows = {"input": digits8["image"][1300:1400]}
    full = run_model(onnx.load(str(tiny)), rows, ["output"])["output"]
    never = [ExitInfo(e.name, e.at, NEVER) for e in exited.exits]
    taken, scores = answers(never, tmp_path / "never")
    assert taken == [None] * 100
    np.testing.assert_allclose(scores, full, rtol=1e-5, atol=1e-5)

    taken, scores = answers(list(exited.exits), tmp_path / "calibrated")
    expected_exit, expected_class, _ = simulate_exits(exited.model, rows)
    names = [None, *(e.name for e in exited.exits)]
    assert taken == [names[k + 1] for k in expected_exit]
    assert np.array_equal(scores.argmax(axis=1), expected_class)
    assert any(t is not None for t in taken)
