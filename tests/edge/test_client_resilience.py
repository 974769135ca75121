"""Clients that survive: long links, a tier that comes up late, a tier known to be down."""

from __future__ import annotations

import contextlib
import logging
import queue
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tierflow.device.client import DeviceClient
from tierflow.edge.forwarding import Forwarding
from tierflow.errors import TransportError
from tierflow.options import RuntimeOptions
from tierflow.runtime.server import TierServer

pytestmark = pytest.mark.integration


@contextlib.contextmanager
def delayed_link(target: str, one_way_s: float) -> Iterator[str]:
    """A TCP proxy on 127.0.0.1 that delays every byte ``one_way_s`` each way; its address."""
    host, _, port = target.rpartition(":")
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    sockets: list[socket.socket] = [listener]
    closing = threading.Event()

    def pump(source: socket.socket, sink: socket.socket) -> None:
        due: queue.SimpleQueue[tuple[float, bytes]] = queue.SimpleQueue()

        def deliver() -> None:
            while True:
                at, data = due.get()
                time.sleep(max(at - time.monotonic(), 0.0))
                try:
                    if not data:
                        sink.shutdown(socket.SHUT_WR)
                        return
                    sink.sendall(data)
                except OSError:
                    return

        threading.Thread(target=deliver, daemon=True).start()
        while True:
            try:
                data = source.recv(1 << 16)
            except OSError:
                data = b""
            due.put((time.monotonic() + one_way_s, data))
            if not data:
                return

    def accept() -> None:
        while not closing.is_set():
            try:
                client, _ = listener.accept()
            except OSError:
                return
            upstream = socket.create_connection((host, int(port)))
            sockets.extend((client, upstream))
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=pump, args=(source, sink), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield f"127.0.0.1:{listener.getsockname()[1]}"
    finally:
        closing.set()
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()


def test_a_300ms_round_trip_link_answers_from_the_first_request(
    tmp_path: Path, rt: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A 100 ms connect timeout failed the first requests of every run on such a link."""
    split = rt.cnn(tmp_path / "plan")
    feeds = split.sample(3, count=4)
    caplog.set_level(logging.INFO, logger="tierflow.transport.stream_client")
    with (
        rt.tiers(split.plan_dir) as (edge, _, _),
        delayed_link(edge, 0.15) as far_edge,
        DeviceClient(split.plan_dir, far_edge, deadline_s=20) as device,
    ):
        results = list(device.run_stream(feeds))
    assert all(r.ok for r in results), [str(r.error) for r in results]
    for result, inputs in zip(results, feeds, strict=True):
        for name, array in split.reference(inputs).items():
            np.testing.assert_array_equal(result.outputs[name], array)
    assert min(r.ms["total"] for r in results) >= 300  # the link really was that long
    # The first connection attempt succeeded: no request had to be sent again.
    assert not [r for r in caplog.records if "never reached" in r.getMessage()]


def test_requests_sent_before_the_edge_is_up_are_sent_again(tmp_path: Path, rt: Any) -> None:
    split = rt.cnn(tmp_path / "plan")
    feeds = split.sample(4)[0]
    port = rt.free_port()
    with (
        rt.tiers(split.plan_dir) as (_, _, cloud),
        DeviceClient(split.plan_dir, f"127.0.0.1:{port}", deadline_s=10) as device,
    ):
        ticket = device.submit(feeds)  # refused: nothing listens yet
        time.sleep(0.15)
        edge = TierServer.from_plan(
            "edge",
            split.plan_dir,
            f"127.0.0.1:{port}",
            forwarder=Forwarding(cloud.address),
            options=RuntimeOptions(workers=1),
        )
        edge.start()
        try:
            result = ticket.result()
            assert result.ok, result.error
            np.testing.assert_array_equal(result.outputs["y"], split.reference(feeds)["y"])
        finally:
            edge.stop(0)


def test_a_device_fails_fast_while_the_edge_is_known_down(tmp_path: Path, rt: Any) -> None:
    split = rt.cnn(tmp_path / "plan")
    feeds = split.sample(5)[0]
    with DeviceClient(split.plan_dir, f"127.0.0.1:{rt.free_port()}", deadline_s=10) as device:
        first = device.submit(feeds).result()  # tried, sent again, then failed
        assert isinstance(first.error, TransportError)
        started = time.perf_counter()
        later = [device.submit(feeds).result() for _ in range(20)]
        elapsed = time.perf_counter() - started
    assert all(isinstance(r.error, TransportError) for r in later)
    assert "is down" in str(later[0].error)
    # No device compute and no attempt per request: a request that tried the edge again
    # would wait 0.1 s before its first retry alone, 2 s for the 20; the bound leaves a
    # loaded machine five times the 0.2 s an idle one needs at most.
    assert elapsed < 1.0
