"""gRPC C-core's own notices stay out of a tier's log unless the user asks for them.

A peer's GOAWAY with an error code (an edge's upstream connection when the cloud stops,
here a hand-written HTTP/2 frame) makes C-core log ``chttp2_transport.cc ... Got goaway``
at INFO on stderr, which ``tierflow serve`` sends to its log.
"""

from __future__ import annotations

import os
import socket
import struct
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tierflow.cli.main import GRPC_LOG_DEFAULT, quiet_grpc_core
from tierflow.partitioner.graph import load_model
from tierflow.partitioner.split import save_split_plan, split_model
from tierflow.runtime.processes import ServeProcess


def _cloud_plan(directory: Path) -> Path:
    weights = numpy_helper.from_array(np.eye(4, dtype=np.float32), "w")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Relu", ["h"], ["y"])]
    graph = helper.make_graph(
        nodes,
        "mm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
        [weights],
    )
    onnx.save(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), directory / "m.onnx"
    )
    loaded = load_model(directory / "m.onnx")
    save_split_plan(loaded, split_model(loaded, (0, 0)), directory / "plan")
    return directory / "plan"


def _frame(kind: int, payload: bytes) -> bytes:
    """An HTTP/2 frame on stream 0: 24-bit length, type, no flags."""
    return struct.pack(">I", len(payload))[1:] + bytes([kind, 0]) + struct.pack(">I", 0) + payload


def _send_goaway_with_an_error(address: str) -> None:
    host, port = address.rsplit(":", 1)
    settings, goaway = _frame(0x4, b""), _frame(0x7, struct.pack(">II", 0, 2) + b"test")
    with socket.create_connection((host, int(port)), timeout=1) as conn:
        conn.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + settings + goaway)
        try:  # until the server has read it and closed the connection, or a second passed
            while conn.recv(4096):
                pass
        except TimeoutError:
            pass


def _wait_for(log: Path, text: str, seconds: float) -> None:
    ends = time.monotonic() + seconds
    while text not in log.read_text() and time.monotonic() < ends:
        time.sleep(0.05)


@pytest.mark.integration
@pytest.mark.parametrize("verbosity", [None, "INFO"])
def test_a_tier_logs_grpc_core_notices_only_when_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, verbosity: str | None
) -> None:
    if verbosity is None:
        monkeypatch.delenv("GRPC_VERBOSITY", raising=False)
    else:
        monkeypatch.setenv("GRPC_VERBOSITY", verbosity)
    log = tmp_path / "cloud.log"
    with ServeProcess("cloud", _cloud_plan(tmp_path), log=log) as server:
        _send_goaway_with_an_error(server.address)
        if verbosity == "INFO":  # C-core logs it as it reads the frame
            _wait_for(log, "Got goaway", 10)
    # The user's own setting is kept: then C-core says what it received.
    assert ("Got goaway [2]" in log.read_text()) == (verbosity == "INFO"), log.read_text()


def test_the_default_leaves_a_users_setting_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GRPC_VERBOSITY", raising=False)
    quiet_grpc_core()
    assert os.environ["GRPC_VERBOSITY"] == GRPC_LOG_DEFAULT == "ERROR"
    monkeypatch.setenv("GRPC_VERBOSITY", "DEBUG")
    quiet_grpc_core()
    assert os.environ["GRPC_VERBOSITY"] == "DEBUG"
