"""A tier that cannot be reached is one line before the first request ([Note: reaching a
tier first]); the TLS cases, which need a server, are in tests/edge/test_security.py."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from tierflow.cli.main import main
from tierflow.errors import TransportError
from tierflow.plan import Plan, save_plan
from tierflow.transport import reach
from tierflow.transport.reach import _host_port, check_reachable

from ...tiny_plans import matmul_chain


@pytest.fixture
def dead_address() -> Iterator[str]:
    """An address where nothing listens: a port held (bound, never listening) meanwhile."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", 0))
        yield f"127.0.0.1:{held.getsockname()[1]}"


def _device_edge_plan(directory: Path) -> Path:
    """A two-segment plan, x -> h on the device, h -> y on the edge."""
    directory.mkdir()
    specs = matmul_chain(directory, [("device", "device.onnx"), ("edge", "edge.onnx")])
    save_plan(Plan("m.onnx", "0" * 64, ("x",), ("y",), tuple(specs)), directory)
    np.savez(directory.parent / "in.npz", x=np.ones((5, 1, 4), np.float32))
    return directory


def test_nothing_listening_is_said_so(dead_address: str) -> None:
    with pytest.raises(TransportError) as caught:
        check_reachable(dead_address, option="--edge")
    assert str(caught.value) == (
        f"--edge cannot reach a tier at {dead_address}: nothing listens there (connection refused)"
    )


@pytest.mark.parametrize(
    ("address", "found"),
    [
        ("127.0.0.1:50051", ("127.0.0.1", 50051)),
        ("[::1]:7", ("::1", 7)),
        ("dns:///edge.local:50051", None),
        ("ipv4:10.0.0.5:1,10.0.0.6:1", None),
        ("unix:/run/t.sock", None),
    ],
)
def test_only_a_plain_host_and_port_is_checked_over_tcp(
    address: str, found: tuple[str, int] | None
) -> None:
    assert _host_port(address) == found


@pytest.mark.parametrize("command", ["run", "device", "generate"])
def test_a_dead_edge_fails_the_command_once_before_any_request(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, dead_address: str, command: str
) -> None:
    """``run`` printed one line per request and wrote outputs full of NaN; ``generate``
    waited out its whole deadline."""
    plan_dir = _device_edge_plan(tmp_path / "plan")
    output = tmp_path / "out.npz"
    argv = ["--plan", str(plan_dir), "--edge", dead_address]
    if command == "run":
        argv = ["run", *argv, "--input", str(tmp_path / "in.npz"), "--output", str(output)]
    elif command == "device":
        argv = ["device", *argv, "--source", str(tmp_path), "--results", str(output)]
    else:  # generate waited out its whole --deadline (30 s) for a refused connection
        argv = ["generate", *argv, "--prompt-ids", "1,2", "--json"]
    assert main(argv) == 1  # a failure while it ran, not a usage error
    captured = capsys.readouterr()
    assert captured.err == (
        f"tierflow {command}: error: --edge cannot reach a tier at {dead_address}: "
        "nothing listens there (connection refused)\n"
    )
    assert not output.exists()
    if command == "generate":  # --json still ends with its line: no tokens, and why
        line = json.loads(captured.out.strip().splitlines()[-1])
        assert line["tokens"] == [] and line["stopped"] == "error"
        assert "nothing listens there" in line["error"]
    else:
        assert captured.out == ""


@pytest.mark.integration
def test_a_reachable_tier_is_let_go_only_once_grpc_stops_watching_the_channel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """[Note: closing a watched channel]: the check's channel is closed only after grpc's
    thread watching it, which connecting started, has ended (right after unsubscribing it
    is still waiting on the channel; closing then could kill it with "Channel closed!")."""
    server = grpc.server(ThreadPoolExecutor(1))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    watched_at_close: list[bool] = []
    closed = threading.Event()
    opened = reach.open_channel

    def recording(*args: Any, **kwargs: Any) -> grpc.Channel:
        channel = opened(*args, **kwargs)
        close = channel.close

        def close_and_record() -> None:
            watched_at_close.append(channel._connectivity_state.polling)
            close()
            closed.set()

        channel.close = close_and_record  # type: ignore[method-assign]
        return channel

    monkeypatch.setattr(reach, "open_channel", recording)
    try:
        check_reachable(f"127.0.0.1:{port}")
        assert closed.wait(5.0)
    finally:
        server.stop(0)
    assert watched_at_close == [False]
