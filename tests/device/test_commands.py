"""``tierflow run`` and ``tierflow device``: the idle-probe and retry options."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tierflow.cli.main import build_parser
from tierflow.device.app import Device
from tierflow.device.client import DEFAULT_RETRY_S, DeviceClient
from tierflow.device.probing import DEFAULT_IDLE_S
from tierflow.errors import UsageError
from tierflow.link.spec import LinkSpec
from tierflow.plan import Plan, PlanSet, SegmentSpec, save_plan, save_plan_set

from ..tiny_plans import matmul_chain

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
    """Two tiny segments x -> h -> y, both on the device, written into ``directory``."""
    first, second = matmul_chain(directory, [("device", "s0.onnx"), ("device", "s1.onnx")])
    return first, second


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


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_stateful_plan_without_a_session_is_refused_once_before_sending(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    """Every request would fail for that same reason, one line each (issue 30, item 11)."""
    from tierflow.cli.main import main
    from tierflow.state.spec import StateSpec

    state = StateSpec("h_in", "h_out", "float32", (1, 4))
    segment = SegmentSpec("device", "s.onnx", ("x", "h_in"), ("y", "h_out"), state=(state,))
    plan = Plan("m.onnx", "0" * 64, ("x",), ("y",), (segment,), state_pairs=(("h_in", "h_out"),))
    save_plan(plan, tmp_path)
    argv = [*COMMANDS[command], "--plan", str(tmp_path)]
    assert main(argv) == 2
    assert capsys.readouterr().err == (
        f"tierflow {command}: error: the plan in {tmp_path} keeps state between requests "
        "(h_in <- h_out): its requests are one session's chunks, in order; give --session NAME\n"
    )


def test_a_folder_source_without_pillow_fails_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A runtime-only install has no Pillow: each frame failed separately (issue 30, 11)."""
    from tierflow.cli.main import main

    plan_dir, frames = tmp_path / "plan", tmp_path / "frames"
    plan_dir.mkdir()
    frames.mkdir()
    for name in ("a.png", "b.png", "c.png"):
        (frames / name).write_bytes(b"not read")
    save_plan(_plan(_matmul_segments(plan_dir)), plan_dir)
    monkeypatch.setitem(sys.modules, "PIL", None)  # as if Pillow were not installed
    monkeypatch.delitem(sys.modules, "PIL.Image", raising=False)
    results = tmp_path / "results.jsonl"
    argv = ["device", "--plan", str(plan_dir), "--source", str(frames), "--results", str(results)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err == (
        "tierflow device: error: --source DIR (reading its images) needs PIL, which is not "
        "installed: pip install 'tierflow[image]'\n"
    )
