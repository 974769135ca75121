"""Measuring a link to a running tier: round-trip time and rate, via the ``Probe`` RPC.

``tierflow probe HOST:PORT`` prints the result the way ``tierflow plan --link`` reads it
(``device-edge=87.3mbit,0.41ms``) or as JSON (``--json``), which ``plan --link
device-edge=probe.json`` reads. See [Note: probing a link].

[Note: probing a link]
RTT: the median round trip of small messages, one at a time, after a warm-up. Rate: a
large payload is sent up (with an empty echo) and asked for down (with an empty
request), several times each; a transfer's time is its round trip minus the RTT, and
the rate is the median over transfers of bytes * 8 / time. The link's rate is the slower
direction's. The probed tier names itself in the stream's metadata, which gives the link
its name (an edge answers for ``device-edge``, a cloud for ``edge-cloud``).
"""

from __future__ import annotations

import logging
import queue
import statistics
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc

from tierflow.errors import TransportError, UsageError, shown
from tierflow.link.spec import LinkSpec, check_link
from tierflow.rpc import tier_pb2, tier_pb2_grpc
from tierflow.transport.address import Address
from tierflow.transport.reach import close_when_unwatched, connect
from tierflow.transport.security import Security, open_channel
from tierflow.transport.stream_client import channel_options
from tierflow.units import format_duration, format_rate

logger = logging.getLogger(__name__)

_LINK_OF_TIER = {"edge": "device-edge", "cloud": "edge-cloud"}


@dataclass(frozen=True)
class ProbeResult:
    """A measured link: what ``plan --link NAME=probe.json`` reads."""

    link: str
    rate_bps: float
    rtt_s: float
    samples: dict[str, Any] = field(default_factory=dict)

    @property
    def spec(self) -> LinkSpec:
        return LinkSpec(self.rate_bps, self.rtt_s)

    def link_option(self) -> str:
        """``NAME=RATE,RTT`` as ``tierflow plan --link`` takes it."""
        return f"{self.link}={format_rate(self.rate_bps)},{format_duration(self.rtt_s)}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "link": self.link,
            "rate_bps": self.rate_bps,
            "rtt_s": self.rtt_s,
            "samples": self.samples,
        }

    @classmethod
    def from_dict(cls, data: Any) -> ProbeResult:
        try:
            return cls(
                check_link(str(data["link"])),
                float(data["rate_bps"]),
                float(data["rtt_s"]),
                dict(data.get("samples") or {}),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise UsageError(f"malformed probe result {shown(data)}: {exc}") from exc


class _Echo:
    """One open Probe stream, used one message at a time."""

    def __init__(self, channel: grpc.Channel, timeout: float) -> None:
        self._outgoing: queue.SimpleQueue[tier_pb2.ProbeMessage | None] = queue.SimpleQueue()
        self._timeout = timeout
        self._call = tier_pb2_grpc.TierStub(channel).Probe(self._messages(), timeout=timeout)
        self._seq = 0
        self._replies: Iterator[tier_pb2.ProbeMessage] = iter(self._call)
        self._lock = threading.Lock()

    def _messages(self) -> Iterator[tier_pb2.ProbeMessage]:
        while (message := self._outgoing.get()) is not None:
            yield message

    def tier(self) -> str:
        metadata = dict(self._call.initial_metadata() or ())
        return str(metadata.get("tierflow-tier", ""))

    def round_trip(self, payload: bytes, reply_bytes: int) -> float:
        """Seconds from sending ``payload`` to receiving ``reply_bytes`` back."""
        with self._lock:
            self._seq += 1
            start = time.perf_counter()
            self._outgoing.put(
                tier_pb2.ProbeMessage(seq=self._seq, payload=payload, reply_bytes=reply_bytes)
            )
            reply = next(self._replies)
            elapsed = time.perf_counter() - start
        if reply.seq != self._seq or len(reply.payload) != reply_bytes:
            raise TransportError(
                f"probe echo {reply.seq} with {len(reply.payload)} bytes, expected "
                f"{self._seq} with {reply_bytes} (a tier sends a probe no more than it "
                "was sent)"
            )
        return elapsed

    def close(self) -> None:
        self._outgoing.put(None)
        self._call.cancel()


def probe(
    address: Address | str,
    *,
    link: str | None = None,
    pings: int = 20,
    payload_bytes: int = 2 * 1024 * 1024,
    transfers: int = 3,
    timeout: float = 60.0,
    connect_timeout: float = 10.0,
    security: Security | None = None,
) -> ProbeResult:
    """Measure RTT and rate to the tier at ``address`` ([Note: probing a link]).

    A string is parsed as ``tierflow probe`` parses its argument (:class:`Address`).
    """
    if not isinstance(address, Address):
        address = Address.parse(address)
    if pings < 1 or transfers < 1 or payload_bytes < 1:
        raise UsageError("probe needs at least one ping, one transfer and one payload byte")
    channel = open_channel(address.target, security, channel_options())
    try:
        connect(channel, str(address), security, connect_timeout)
        echo = _Echo(channel, timeout)
        try:
            for _ in range(3):  # warm-up: connection windows, allocations
                echo.round_trip(b"", 0)
            pings_s = [echo.round_trip(b"", 0) for _ in range(pings)]
            rtt = statistics.median(pings_s)
            payload = bytes(payload_bytes)
            echo.round_trip(payload, payload_bytes)
            up_s = [echo.round_trip(payload, 0) for _ in range(transfers)]
            down_s = [echo.round_trip(b"", payload_bytes) for _ in range(transfers)]
            tier = echo.tier()
        finally:
            echo.close()
    except grpc.RpcError as exc:
        code = exc.code().name if isinstance(exc, grpc.Call) else "UNKNOWN"
        raise TransportError(f"probing {address} failed: {code}") from exc
    finally:
        close_when_unwatched(channel)  # connect watched it
    name = link or _LINK_OF_TIER.get(tier)
    if name is None:
        raise UsageError(f"the tier at {address} did not say which it is; give --link NAME")
    check_link(name)

    def rate(times: list[float]) -> float:
        per = [payload_bytes * 8.0 / max(t - rtt, 1e-9) for t in times]
        return float(statistics.median(per))

    up, down = rate(up_s), rate(down_s)
    samples = {
        "tier": tier,
        "ping_s": pings_s,
        "payload_bytes": payload_bytes,
        "up_s": up_s,
        "down_s": down_s,
        "up_rate_bps": up,
        "down_rate_bps": down,
    }
    logger.info(
        "[probe] %s: rtt %.3f ms, up %.3g bit/s, down %.3g bit/s", name, rtt * 1e3, up, down
    )
    return ProbeResult(name, min(up, down), rtt, samples)
