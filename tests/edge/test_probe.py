"""``tierflow probe`` against running tiers."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tierflow.cli.main import main
from tierflow.edge.probe import ProbeResult, probe
from tierflow.errors import TransportError


@pytest.mark.integration
def test_probe_measures_plausible_rtt_and_rate(tmp_path: Path, rt: Any, capsys: Any) -> None:
    split = rt.cnn(tmp_path / "plan")
    with rt.tiers(split.plan_dir) as (edge, _, cloud):
        result = probe(edge, pings=5, payload_bytes=1 << 20, transfers=2)
        assert main(["probe", cloud.address, "--json", "--pings", "5", "--payload", "1MiB"]) == 0
    assert result.link == "device-edge"
    assert 0 < result.rtt_s < 0.5
    assert 1e7 < result.rate_bps < 1e12  # loopback: far above a real link, but finite
    assert result.link_option().startswith("device-edge=")
    printed = json.loads(capsys.readouterr().out)
    again = ProbeResult.from_dict(printed)
    assert again.link == "edge-cloud" and again.rate_bps > 0 and set(printed) >= {"samples"}


class _ThrottledRelay:
    """A TCP relay to a tier that forwards each direction at ``rate_bps``: a known link.

    Each chunk is held for its transmission time (``bytes * 8 / rate``) behind the one
    before it, as a link of that rate serialises it, then forwarded.
    """

    def __init__(self, target: str, rate_bps: float) -> None:
        host, _, port = target.rpartition(":")
        self.target = (host, int(port))
        self.rate_bps = rate_bps
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.sockets: list[socket.socket] = [self.listener]
        self.threads = [threading.Thread(target=self._accept, daemon=True)]
        self.threads[0].start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            self.sockets += [client, upstream]
            for source, sink in ((client, upstream), (upstream, client)):
                thread = threading.Thread(target=self._pump, args=(source, sink), daemon=True)
                self.threads.append(thread)
                thread.start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        due = time.perf_counter()
        with contextlib.suppress(OSError):
            while chunk := source.recv(16384):
                due = max(due, time.perf_counter()) + len(chunk) * 8 / self.rate_bps
                time.sleep(max(due - time.perf_counter(), 0.0))
                sink.sendall(chunk)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        for sock in self.sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        for thread in self.threads:
            thread.join(timeout=5)


@contextlib.contextmanager
def _throttled(target: str, rate_bps: float) -> Iterator[_ThrottledRelay]:
    relay = _ThrottledRelay(target, rate_bps)
    try:
        yield relay
    finally:
        relay.close()


@pytest.mark.integration
def test_probe_finds_the_rate_of_a_known_link(tmp_path: Path, rt: Any) -> None:
    truth = 10e6  # bits per second, each way
    split = rt.cnn(tmp_path / "plan")
    with rt.tiers(split.plan_dir) as (edge, _, _), _throttled(edge, truth) as link:
        result = probe(link.address, pings=5, payload_bytes=256 << 10, transfers=3)
    assert result.link == "device-edge"
    up, down = result.samples["up_rate_bps"], result.samples["down_rate_bps"]
    for measured in (result.rate_bps, up, down):
        assert truth / 2 < measured < truth * 2, (measured, truth)


def test_probe_of_nothing_is_a_transport_error() -> None:
    with pytest.raises(TransportError, match="cannot reach"):
        probe("127.0.0.1:1", pings=1, transfers=1, connect_timeout=1.0)
