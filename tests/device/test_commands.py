"""``tierflow run`` and ``tierflow device``: the idle-probe and retry options."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tierflow.cli.main import build_parser
from tierflow.device.app import Device
from tierflow.device.client import DEFAULT_RETRY_S, DeviceClient
from tierflow.device.probing import DEFAULT_IDLE_S
from tierflow.errors import UsageError
from tierflow.link.spec import LinkSpec
from tierflow.plan import Plan, PlanSet, SegmentSpec, save_plan, save_plan_set

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


def _matmul_segments(directory: Path) -> tuple[SegmentSpec, SegmentSpec]:
    """Two tiny segments x -> h -> y, written into ``directory``."""
    specs = []
    for name, (src, dst) in {"s0.onnx": ("x", "h"), "s1.onnx": ("h", "y")}.items():
        weights = numpy_helper.from_array(np.eye(4, dtype=np.float32), "w")
        graph = helper.make_graph(
            [helper.make_node("MatMul", [src, "w"], [dst])],
            "g",
            [helper.make_tensor_value_info(src, TensorProto.FLOAT, [1, 4])],
            [helper.make_tensor_value_info(dst, TensorProto.FLOAT, [1, 4])],
            [weights],
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        onnx.save(model, directory / name)
        specs.append(SegmentSpec("device", name, (src,), (dst,)))
    return specs[0], specs[1]


def _plan(segments: tuple[SegmentSpec, ...]) -> Plan:
    return Plan("m.onnx", "0" * 64, ("x",), ("y",), segments)


def test_the_device_hands_the_retry_interval_to_its_client(tmp_path: Path) -> None:
    first, second = _matmul_segments(tmp_path)
    save_plan(_plan((first, second)), tmp_path)
    with Device(DeviceClient(tmp_path, retry_s=2.5, idle_probe_s=None)) as device:
        assert device.client.retry_s == 2.5 and device.client.prober is None


@pytest.mark.integration
def test_a_device_keeps_its_plan_when_its_client_is_not_adaptive(tmp_path: Path) -> None:
    first, second = _matmul_segments(tmp_path)
    with_edge = _plan((first, SegmentSpec("edge", second.file, second.inputs, second.outputs)))
    alone = _plan((first, second))
    regions = (({"device-edge": LinkSpec(200e6, 0.02)},), ({"device-edge": LinkSpec(2e6, 0.02)},))
    save_plan_set(PlanSet((with_edge, alone), regions), tmp_path)
    edge = "127.0.0.1:9"  # never dialled: no request is sent
    with Device(DeviceClient(tmp_path, edge, idle_probe_s=None)) as device:
        assert device.client.selector is not None  # a set with regions switches
    with Device(DeviceClient(tmp_path, edge, adaptive=False, idle_probe_s=None)) as device:
        assert device.client.selector is None and device.plan == with_edge
