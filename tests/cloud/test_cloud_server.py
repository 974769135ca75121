"""The cloud server: health, and a plan whose edge only forwards."""

from __future__ import annotations

from pathlib import Path

import grpc
import numpy as np
import onnx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from onnx import TensorProto, helper, numpy_helper

from tierflow.device.client import DeviceClient
from tierflow.edge.forwarding import Forwarding
from tierflow.plan import Plan, SegmentSpec, save_plan
from tierflow.runtime.segment_runner import SegmentRunner
from tierflow.runtime.server import TierServer

pytestmark = pytest.mark.integration


def _cloud_only_plan(directory: Path) -> Path:
    directory.mkdir(parents=True)
    weights = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("Gemm", ["x", "w"], ["z"], transB=1),
            helper.make_node("Softmax", ["z"], ["y"], axis=1),
        ],
        "cloud",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3])],
        [numpy_helper.from_array(weights, "w")],
    )
    onnx.save(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), directory / "c.onnx"
    )
    plan = Plan(
        "m.onnx",
        "0" * 64,
        ("x",),
        ("y",),
        (SegmentSpec("cloud", "c.onnx", ("x",), ("y",)),),
        codec={"device-edge": "zstd", "edge-cloud": "raw"},
    )
    save_plan(plan, directory)
    return directory


def test_health_says_serving_once_loaded_and_an_empty_edge_forwards(tmp_path: Path) -> None:
    plan_dir = _cloud_only_plan(tmp_path / "plan")
    cloud = TierServer.from_plan("cloud", plan_dir)
    cloud.start()
    edge = TierServer.from_plan("edge", plan_dir, forwarder=Forwarding(cloud.address))
    edge.start()
    try:
        with grpc.insecure_channel(cloud.address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            for service in ("", "tierflow.rpc.Tier"):
                status = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
                assert status.status == health_pb2.HealthCheckResponse.SERVING
        x = np.random.default_rng(1).standard_normal((1, 4)).astype(np.float32)
        with DeviceClient(plan_dir, edge.address) as device:
            result = device.infer({"x": x})
    finally:
        edge.stop(0.5)
        cloud.stop(0.5)
    expected = SegmentRunner(plan_dir / "c.onnx").run({"x": x})["y"]
    np.testing.assert_array_equal(result.outputs["y"], expected)
    assert result.answered_by == "cloud"
    # x itself crosses both links: the device and the edge have no segments.
    assert result.bytes["device-edge"] > 0 and result.bytes["edge-cloud"] > 0
