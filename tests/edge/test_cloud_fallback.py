"""Losing the cloud mid-stream: the edge answers what it can, the device finishes the rest.

See [Note: answering without the next tier] in tierflow/runtime/pipeline.py and [Note:
losing a tier] in device/fallback.py. The tiers run in process ([Note: the next tier in
process] in tierflow/runtime/upstream.py), the cloud gone when it stops or is
closed; killing a cloud process mid-stream proves the same over gRPC.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnx.utils
import pytest

from tierflow.cache.memory import MemoryCache
from tierflow.device.client import DeviceClient, Result
from tierflow.edge.forwarding import Forwarding
from tierflow.errors import RemoteError
from tierflow.onnxrt.inference import open_session
from tierflow.options import RuntimeOptions
from tierflow.plan import Plan, PlanSet, SegmentSpec, load_plan, save_plan_set
from tierflow.rpc import tier_pb2
from tierflow.runtime.server import TierServer
from tierflow.runtime.tier import Tier
from tierflow.runtime.upstream import LocalUpstream

OPTIONS = RuntimeOptions(workers=2)


def _with_plan(split: Any, *segments: SegmentSpec) -> tuple[Plan, Plan]:
    """The split's plan and one more of ``segments``, saved as a set (split's first)."""
    split_plan = load_plan(split.plan_dir)
    other = Plan(
        split_plan.model_file,
        split_plan.model_sha256,
        split_plan.inputs,
        split_plan.outputs,
        segments,
        codec=split_plan.codec,
    )
    save_plan_set(PlanSet((split_plan, other)), split.plan_dir)
    return split_plan, other


def _killing(samples: list[dict[str, np.ndarray]], at: int, kill: Any) -> Iterator[Any]:
    """The samples, calling ``kill`` before the one at index ``at`` is sent."""
    for i, feeds in enumerate(samples):
        if i == at:
            kill()
        yield feeds


def _until_cloud(device: DeviceClient, feeds: dict[str, np.ndarray]) -> Result:
    """Requests until the cloud answers one (within 10 s); that answer."""
    for _ in range(200):
        result = device.submit(feeds).result()
        if result.answered_by == "cloud":
            return result
        time.sleep(0.05)
    raise AssertionError(f"the cloud did not answer again: {result.to_dict()}")


@pytest.mark.integration
def test_killing_the_cloud_mid_stream_turns_the_rest_into_device_answers(
    tmp_path: Path, rt: Any
) -> None:
    split = rt.cnn(tmp_path / "plan", {"device-edge": "raw", "edge-cloud": "raw"})
    model = load_plan(split.plan_dir)
    normal, alone = _with_plan(
        split, SegmentSpec("device", model.model_file, model.inputs, model.outputs)
    )
    samples = split.sample(seed=51, count=30)
    with rt.processes() as start:
        cloud = start("cloud", split.plan_dir)
        edge = start("edge", split.plan_dir, "--upstream", cloud.address)
        with DeviceClient(
            split.plan_dir, edge.address, window=4, deadline_s=10.0, retry_s=0.2
        ) as device:
            results = list(device.run_stream(_killing(samples, 10, cloud.kill)))
            start("cloud", split.plan_dir, listen=cloud.address)  # restarted, same port
            back = _until_cloud(device, samples[0])
    assert len({r.id for r in results}) == len(samples)  # one answer each, none twice
    for feeds, result in zip(samples, results, strict=True):
        result.unwrap()
        np.testing.assert_array_equal(result.outputs["y"], split.reference(feeds)["y"])
    assert all(r.answered_by == "cloud" and not r.fallback for r in results[:6])
    fallbacks = [r for r in results if r.fallback]
    assert all(r.fallback for r in results[10:])  # those in flight at the kill may be too
    for result in fallbacks:
        assert result.answered_by == "device" and result.plan == alone.plan_id
        assert result.fallback_reason is not None and "cloud" in result.fallback_reason
        assert result.bytes["edge-cloud"] == 0
        line = result.to_dict()
        assert line["fallback"] is True and "cloud" in line["fallback_reason"]
    switches = [r.switch for r in results if r.switch]
    assert switches and "does not need the cloud" in switches[0]
    assert not back.fallback and back.plan == normal.plan_id
    np.testing.assert_array_equal(back.outputs["y"], split.reference(samples[0])["y"])


@pytest.mark.parametrize("how", ["stopping", "closed"])
def test_with_an_exit_on_the_edge_the_edge_answers_from_it_in_process(
    tmp_path: Path, rt: Any, how: str
) -> None:
    # Threshold 1: the exit is never confident enough, so normally the cloud answers.
    split = rt.cnn(tmp_path / "plan", {"device-edge": "raw", "edge-cloud": "raw"}, 1.0)
    plan = load_plan(split.plan_dir)
    device_seg = open_session(split.plan_dir / plan.segments[0].file)
    edge_seg = open_session(split.plan_dir / plan.segments[1].file)
    samples = split.sample(seed=52, count=6)
    cache = MemoryCache(1 << 20)
    with rt.in_process(split.plan_dir) as tiers, tiers.device(window=2, cache=cache) as device:

        def gone() -> None:
            if how == "stopping":  # answers UNAVAILABLE ("stopping") from now on
                assert tiers.cloud.drain(0.0)
            else:  # known down: the edge sends nothing
                tiers.cloud.close()

        results = list(device.run_stream(_killing(samples, 2, gone)))
        again = device.infer(samples[4])  # a fallback answer is never cached
    assert all(r.answered_by == "cloud" and not r.fallback for r in results[:2])
    for feeds, result in zip(samples[2:], results[2:], strict=True):
        result.unwrap()
        assert (result.answered_by, result.exit, result.fallback) == ("edge", "exit_edge", True)
        assert result.fallback_reason is not None
        assert result.fallback_reason.startswith("the cloud is unavailable (")
        assert result.fallback_reason.endswith("); answered at the edge's exit")
        (h1,) = device_seg.run(["h1"], feeds)
        scores = edge_seg.run(["exit_edge"], {"h1": h1})[0]
        np.testing.assert_array_equal(result.outputs["exit_edge"], scores)
    assert again.fallback and not again.cache_hit


@pytest.mark.integration
def test_with_an_exit_on_the_edge_the_edge_answers_from_it(tmp_path: Path, rt: Any) -> None:
    # Threshold 1: the exit is never confident enough, so normally the cloud answers.
    split = rt.cnn(tmp_path / "plan", {"device-edge": "raw", "edge-cloud": "raw"}, 1.0)
    plan = load_plan(split.plan_dir)
    device_seg = open_session(split.plan_dir / plan.segments[0].file)
    edge_seg = open_session(split.plan_dir / plan.segments[1].file)
    samples = split.sample(seed=52, count=20)
    with rt.processes() as start:
        cloud = start("cloud", split.plan_dir)
        edge = TierServer.from_plan(
            "edge",
            split.plan_dir,
            "127.0.0.1:0",
            forwarder=Forwarding(cloud.address),
            options=OPTIONS,
        )
        edge.start()
        try:
            with DeviceClient(split.plan_dir, edge.address, window=4, deadline_s=10.0) as device:
                results = list(device.run_stream(_killing(samples, 6, cloud.kill)))
                start("cloud", split.plan_dir, listen=cloud.address)
                back = _until_cloud(device, samples[0])
        finally:
            edge.stop(0.5)
    assert len({r.id for r in results}) == len(samples)
    assert all(r.answered_by == "cloud" and not r.fallback for r in results[:2])
    exits = [(feeds, r) for feeds, r in zip(samples, results, strict=True) if r.fallback]
    assert all(r.fallback for r in results[6:])  # those in flight at the kill may be too
    for feeds, result in exits:
        result.unwrap()
        assert (result.answered_by, result.exit) == ("edge", "exit_edge")
        assert result.fallback_reason is not None and "cloud" in result.fallback_reason
        (h1,) = device_seg.run(["h1"], feeds)
        scores = edge_seg.run(["exit_edge"], {"h1": h1})[0]
        np.testing.assert_array_equal(result.outputs["exit_edge"], scores)
    for feeds, result in zip(samples, results, strict=True):
        if not result.fallback:
            np.testing.assert_array_equal(result.outputs["y"], split.reference(feeds)["y"])
    assert not back.fallback and back.exit is None


def test_a_device_edge_plan_takes_over_while_the_cloud_is_gone(tmp_path: Path, rt: Any) -> None:
    split = rt.cnn(tmp_path / "plan", {"device-edge": "raw", "edge-cloud": "raw"})
    model = load_plan(split.plan_dir)
    onnx.utils.extract_model(
        str(split.model_path), str(split.plan_dir / "rest.onnx"), ["h1"], ["y"]
    )
    conv1 = model.segments[0]
    normal, pair = _with_plan(split, conv1, SegmentSpec("edge", "rest.onnx", ("h1",), ("y",)))
    samples = split.sample(seed=53, count=16)
    with (
        rt.in_process(split.plan_dir) as tiers,
        tiers.device(window=3, deadline_s=10.0, retry_s=0.0) as device,
    ):
        assert device.fallback_plan is None  # no device-only plan in this set
        results = list(device.run_stream(_killing(samples, 5, lambda: tiers.cloud.drain(0.0))))
        cloud = Tier("cloud", PlanSet((normal, pair)), split.plan_dir, options=OPTIONS)
        cloud.load()  # the cloud back, as a new process would be
        assert isinstance(tiers.edge.forwarder, Forwarding)
        tiers.edge.forwarder.upstream = LocalUpstream(cloud, me="edge")
        back = device.infer(samples[0])
        cloud.close()
    assert [r.id for r in results] == [str(i) for i in range(len(samples))]
    for feeds, result in zip(samples, results, strict=True):
        result.unwrap()
        np.testing.assert_array_equal(result.outputs["y"], split.reference(feeds)["y"])
    late = results[5:]  # sent after the cloud stopped
    assert all(r.fallback and r.answered_by == "edge" and r.plan == pair.plan_id for r in late)
    assert all(r.fallback_reason and "cloud" in r.fallback_reason for r in late)
    assert not back.fallback and back.plan == normal.plan_id and back.answered_by == "cloud"


def test_without_a_plan_that_skips_the_cloud_requests_fail_typed(tmp_path: Path, rt: Any) -> None:
    split = rt.cnn(tmp_path / "plan", {"device-edge": "raw", "edge-cloud": "raw"})
    with rt.in_process(split.plan_dir) as tiers, tiers.device(deadline_s=10.0) as device:
        tiers.cloud.close()
        results = [device.submit(feeds).result() for feeds in split.sample(seed=54, count=3)]
    for result in results:
        assert isinstance(result.error, RemoteError) and not result.fallback
        assert result.error.code == "UPSTREAM_UNAVAILABLE" and result.error.tier == "edge"


def test_fallback_answers_count_as_their_own_outcome_in_the_metrics() -> None:
    pytest.importorskip("prometheus_client", reason="the metrics extra")
    from tierflow.runtime.metrics import TierMetrics

    metrics = TierMetrics("edge", lambda: 0.0)
    reply = tier_pb2.Reply(answered_by="edge", exit="exit_edge", fallback="the cloud is gone")
    metrics.observe(reply, "device-edge", 0)
    labels = {"tier": "edge", "outcome": "fallback", "answered_by": "edge"}
    assert metrics.registry.get_sample_value("tierflow_requests_total", labels) == 1.0
    labels["outcome"] = "exit"
    assert metrics.registry.get_sample_value("tierflow_requests_total", labels) is None
