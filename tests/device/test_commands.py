"""``tierflow run`` and ``tierflow device``: the idle-probe and retry options."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tierflow.cli import build_parser
from tierflow.device.app import Device
from tierflow.device.client import DEFAULT_RETRY_S
from tierflow.device.probing import DEFAULT_IDLE_S
from tierflow.errors import UsageError
from tierflow.plan import Plan, SegmentSpec, save_plan

COMMANDS = {
    "run": ["run", "--plan", "p", "--input", "in.npz"],
    "device": ["device", "--plan", "p", "--source", "-"],
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_idle_probe_and_retry_default_to_the_clients_and_can_be_set(command: str) -> None:
    parser = build_parser()
    args = parser.parse_args(COMMANDS[command])
    assert (args.idle_probe, args.retry) == (DEFAULT_IDLE_S, DEFAULT_RETRY_S)
    args = parser.parse_args([*COMMANDS[command], "--idle-probe", "250ms", "--retry", "3s"])
    assert (args.idle_probe, args.retry) == (0.25, 3.0)
    assert parser.parse_args([*COMMANDS[command], "--idle-probe", "off"]).idle_probe is None
    for wrong in (["--retry", "0s"], ["--idle-probe", "-1s"], ["--idle-probe", "soon"]):
        with pytest.raises((UsageError, SystemExit)):
            parser.parse_args([*COMMANDS[command], *wrong])


def test_the_device_hands_the_retry_interval_to_its_client(tmp_path: Path) -> None:
    weights = numpy_helper.from_array(np.eye(4, dtype=np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
        [weights],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(model, tmp_path / "s0.onnx")
    plan = Plan(
        "m.onnx", "0" * 64, ("x",), ("y",), (SegmentSpec("device", "s0.onnx", ("x",), ("y",)),)
    )
    save_plan(plan, tmp_path)
    with Device(tmp_path, retry_s=2.5, idle_probe_s=None) as device:
        assert device.client.retry_s == 2.5 and device.client.prober is None
