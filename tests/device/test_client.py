"""The device client: device-only plans, bad inputs, unreachable and silent edges, npz I/O."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tierflow.device.client import DeviceClient
from tierflow.device.npz import load_requests, save_outputs
from tierflow.errors import DeadlineError, InputError, TransportError, UsageError
from tierflow.plan import Plan, SegmentSpec, load_plan, save_plan
from tierflow.rpc import tier_pb2, tier_pb2_grpc
from tierflow.transport.wire import GRPC_OPTIONS


def _chain_plan(directory: Path, tiers: list[str]) -> Path:
    """A chain of Gemm segments x -> t1 -> ... -> y, one per tier in ``tiers``."""
    directory.mkdir(parents=True, exist_ok=True)
    names = ["x"] + [f"t{i}" for i in range(1, len(tiers))] + ["y"]
    segments = []
    for i, tier in enumerate(tiers):
        weights = np.random.default_rng(i).standard_normal((4, 4)).astype(np.float32)
        graph = helper.make_graph(
            [helper.make_node("Gemm", [names[i], "w"], [names[i + 1]], transB=1)],
            f"s{i}",
            [helper.make_tensor_value_info(names[i], TensorProto.FLOAT, [1, 4])],
            [helper.make_tensor_value_info(names[i + 1], TensorProto.FLOAT, [1, 4])],
            [numpy_helper.from_array(weights, "w")],
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        onnx.save(model, directory / f"s{i}.onnx")
        segments.append(SegmentSpec(tier, f"s{i}.onnx", (names[i],), (names[i + 1],)))
    plan = Plan("m.onnx", "0" * 64, ("x",), ("y",), tuple(segments))
    save_plan(plan, directory)
    return directory


def _chain_reference(x: np.ndarray, segments: int) -> np.ndarray:
    """What the chain of ``_chain_plan`` computes, in numpy: the truth to compare with."""
    for i in range(segments):
        x = x @ np.random.default_rng(i).standard_normal((4, 4)).astype(np.float32).T
    return x


def _x(seed: int = 0) -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(seed).standard_normal((1, 4)).astype(np.float32)}


def test_a_device_only_plan_needs_no_edge(tmp_path: Path) -> None:
    plan_dir = _chain_plan(tmp_path / "plan", ["device", "device"])
    with DeviceClient(plan_dir) as device:
        results = list(device.run_stream([_x(i) for i in range(5)]))
    assert [r.id for r in results] == ["0", "1", "2", "3", "4"]
    for i, result in enumerate(results):
        assert result.ok and result.answered_by == "device"
        want = _chain_reference(_x(i)["x"], 2)
        np.testing.assert_allclose(result.outputs["y"], want, rtol=1e-5, atol=1e-6)
        assert result.bytes == {"device-edge": 0, "edge-cloud": 0}
        assert result.ms["total"] > 0


def test_bad_inputs_end_as_input_errors(tmp_path: Path) -> None:
    plan_dir = _chain_plan(tmp_path / "plan", ["device"])
    with DeviceClient(plan_dir) as device:
        wrong_name = device.submit({"z": _x()["x"]}).result()
        wrong_shape = device.submit({"x": np.ones((1, 5), np.float32)}).result()
        with pytest.raises(InputError, match="expected"):
            device.infer({"x": np.ones((1, 4), np.float64)})
    assert isinstance(wrong_name.error, InputError) and not wrong_name.ok
    assert isinstance(wrong_shape.error, InputError) and "float32[1x5]" in str(wrong_shape.error)


def test_a_split_plan_needs_the_edge_address(tmp_path: Path) -> None:
    plan_dir = _chain_plan(tmp_path / "plan", ["device", "edge"])
    with pytest.raises(UsageError, match="--edge"):
        DeviceClient(plan_dir)


@pytest.mark.integration
def test_an_unreachable_edge_is_a_transport_error_at_once(tmp_path: Path) -> None:
    plan_dir = _chain_plan(tmp_path / "plan", ["device", "cloud"])
    with DeviceClient(plan_dir, "127.0.0.1:1", deadline_s=20) as device:
        start = time.monotonic()
        results = list(device.run_stream([_x(i) for i in range(3)]))
    assert all(isinstance(r.error, TransportError) for r in results)
    assert not any(isinstance(r.error, DeadlineError) for r in results)
    assert time.monotonic() - start < 10


class _SilentTier(tier_pb2_grpc.TierServicer):
    """Reads requests and never answers: only deadlines can end them."""

    def Infer(
        self, request_iterator: Iterator[tier_pb2.Request], context: grpc.ServicerContext
    ) -> Iterator[tier_pb2.Reply]:
        for _ in request_iterator:
            pass
        yield from ()


@pytest.mark.integration
def test_requests_to_a_silent_edge_fail_at_their_deadline(tmp_path: Path) -> None:
    plan_dir = _chain_plan(tmp_path / "plan", ["device", "edge"])
    server = grpc.server(ThreadPoolExecutor(max_workers=4), options=GRPC_OPTIONS)
    tier_pb2_grpc.add_TierServicer_to_server(_SilentTier(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with DeviceClient(plan_dir, f"127.0.0.1:{port}", deadline_s=0.5) as device:
            start = time.monotonic()
            results = list(device.run_stream([_x(i) for i in range(4)]))
            elapsed = time.monotonic() - start
    finally:
        server.stop(None)
    assert all(isinstance(r.error, DeadlineError) for r in results)
    assert 0.45 < elapsed < 3.0


def test_npz_requests_gain_and_outputs_lose_the_batch_axis(tmp_path: Path) -> None:
    plan_dir = _chain_plan(tmp_path / "plan", ["device"])
    plan = load_plan(plan_dir)
    inputs = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    np.savez(tmp_path / "in.npz", x=inputs)
    requests, added = load_requests(tmp_path / "in.npz", plan, plan_dir)
    assert added and [r["x"].shape for r in requests] == [(1, 4)] * 3
    with DeviceClient(plan_dir) as device:
        results = list(device.run_stream(requests))
    results[1] = type(results[1])(id="1", error=TransportError("gone"))
    assert save_outputs(tmp_path / "out.npz", results, plan, batch_added=True) == ["y"]
    with np.load(tmp_path / "out.npz") as out:
        y = out["y"]
    assert y.shape == (3, 4)
    np.testing.assert_array_equal(y[0], results[0].outputs["y"][0])
    assert np.isnan(y[1]).all()
    np.savez(tmp_path / "bad.npz", y=inputs)
    with pytest.raises(InputError, match="lacks model inputs"):
        load_requests(tmp_path / "bad.npz", plan, plan_dir)


def test_tierflow_run_on_a_device_only_plan(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tierflow.cli.main import main

    plan_dir = _chain_plan(tmp_path / "plan", ["device", "device"])
    inputs = np.random.default_rng(2).standard_normal((4, 4)).astype(np.float32)
    np.savez(tmp_path / "in.npz", x=inputs)
    args = ["run", "--plan", str(plan_dir), "--input", str(tmp_path / "in.npz")]
    args += ["--output", str(tmp_path / "out.npz"), "--report", str(tmp_path / "r.jsonl")]
    assert main(args) == 0
    assert "answered by  device 4, edge 0, cloud 0" in capsys.readouterr().out  # the table
    assert main([*args, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert (summary["requests"], summary["failed"], summary["exits"]) == (4, 0, 0)
    assert summary["answered_by"] == {"device": 4, "edge": 0, "cloud": 0}
    assert summary["bytes_per_request"] == {"device-edge": 0, "edge-cloud": 0}
    assert summary["rate_bps"] == {"device-edge": None, "edge-cloud": None}
    assert summary["p50_ms"]["total"] >= summary["p50_ms"]["device"] > 0
    with np.load(tmp_path / "out.npz") as out:
        assert out["y"].shape == (4, 4)
        for i in range(4):
            want = _chain_reference(inputs[i][np.newaxis], 2)[0]
            np.testing.assert_allclose(out["y"][i], want, rtol=1e-5, atol=1e-6)
    lines = (tmp_path / "r.jsonl").read_text().splitlines()
    assert len(lines) == 4 and '"answered_by": "device"' in lines[0]


@pytest.mark.integration
def test_requests_queued_behind_a_backlog_are_answered_on_the_device(tmp_path: Path) -> None:
    """[Note: a backlog on the link]: at 2 kbit/s each upload waits behind the last one,
    so the device answers alone until the link has drained, then goes back to the edge."""
    from tierflow.link.spec import LinkSpec
    from tierflow.options import RuntimeOptions
    from tierflow.plan import PlanSet, save_plan_set
    from tierflow.runtime.server import TierServer

    plan_dir = _chain_plan(tmp_path / "plan", ["device", "edge"])
    split = load_plan(plan_dir)
    slow = LinkSpec(2e3, 0.0)
    # The cost model's figures: 50 ms with the edge (20 ms of it on the wire) at 2 kbit/s,
    # 60 ms alone; the regions keep the edge's plan at this rate.
    remote = dataclasses.replace(
        split,
        links={"device-edge": slow},
        estimate={"latency_s": 0.05, "links": {"device-edge": {"wire_s": 0.02}}},
    )
    alone = tuple(SegmentSpec("device", s.file, s.inputs, s.outputs) for s in split.segments)
    local = Plan(*_identity(split), alone, estimate={"latency_s": 0.06})
    regions = (({"device-edge": slow},), ({"device-edge": LinkSpec(1.0, 0.0)},))
    save_plan_set(PlanSet((remote, local), regions), plan_dir)
    edge = TierServer.from_plan("edge", plan_dir, "127.0.0.1:0")
    edge.start()
    try:
        options = RuntimeOptions(links={"device-edge": slow})
        with DeviceClient(
            plan_dir, edge.address, options=options, window=8, idle_probe_s=None
        ) as device:
            tickets = [device.submit(_x(i)) for i in range(4)]
            first = [ticket.result() for ticket in tickets]
            time.sleep(0.2)  # answered, nothing queued any more
            later = device.infer(_x(4))
    finally:
        edge.stop(0.5)
    results = [*first, later]
    assert all(r.ok for r in results)
    for i, result in enumerate(results):
        np.testing.assert_allclose(result.outputs["y"], _chain_reference(_x(i)["x"], 2), rtol=1e-5)
    # The first upload takes the link (over 0.1 s at 2 kbit/s); the next ones would wait
    # behind it, 50 ms + its rest > 60 ms, so they run alone.
    assert [r.plan for r in first] == [remote.plan_id] + [local.plan_id] * 3
    assert first[0].answered_by == "edge" and first[1].answered_by == "device"
    assert first[1].switch is not None and "backlog" in first[1].switch
    assert first[2].switch is None and first[1].bytes["device-edge"] == 0
    assert later.plan == remote.plan_id and "drained" in (later.switch or "")


def _identity(plan: Plan) -> tuple[str, str, tuple[str, ...], tuple[str, ...]]:
    return plan.model_file, plan.model_sha256, plan.inputs, plan.outputs
