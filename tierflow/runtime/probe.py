"""The tier's side of ``tierflow probe`` and the device's idle probes: an echo, bounded.

[Note: probe credit]
A probe asks a tier for ``reply_bytes`` bytes back for each message. A tier sends a probe
stream at most what the caller sent on that stream, plus a small allowance per *peer*
(host) that refills over time: :data:`PROBE_ALLOWANCE` bytes, refilled at
:data:`PROBE_ALLOWANCE` bytes per second, shared by every probe stream of that host.
Asking for more gets a shorter reply. So a probe costs the caller about as many bytes as
the tier, and a small request never makes a tier send a large answer: an allowance per
stream let 200 streams on one connection, asking 64 KiB each and sending nothing, take
13 MB back for 17 KB sent. ``tierflow probe`` sends its payload up before asking for it
down, so it never meets the bound; the device's idle probes ask for a few KiB.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator

import grpc

from tierflow.rpc import tier_pb2
from tierflow.runtime.admission import peer_host
from tierflow.transport.peer_warnings import WARNINGS
from tierflow.transport.wire import Undecodable

logger = logging.getLogger(__name__)

#: Largest probe reply a tier sends.
MAX_PROBE_BYTES = 64 * 1024 * 1024
#: Bytes a peer's probes may be sent beyond what they sent, and the refill per second
#: ([Note: probe credit]).
PROBE_ALLOWANCE = 64 * 1024
#: Peers remembered at most (the least recently seen are forgotten first).
_PEERS_KEPT = 4096


class ProbeCredit:
    """Each peer's allowance for probe bytes beyond what it sent ([Note: probe credit]).

    A token bucket per host: ``allowance`` bytes at most, refilled at ``per_s`` bytes
    per second. Thread-safe.
    """

    def __init__(
        self,
        allowance: int = PROBE_ALLOWANCE,
        per_s: float = PROBE_ALLOWANCE,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.allowance = allowance
        self.per_s = per_s
        self._clock = clock
        self._buckets: dict[str, tuple[float, float]] = {}  # peer -> (bytes, when)
        self._lock = threading.Lock()

    def draw(self, peer: str, wanted: int) -> int:
        """Take up to ``wanted`` bytes of ``peer``'s allowance; return what was granted
        (never negative).

        The clock is read under the lock: read before it, a draw could take a time older
        than the one the draw before it stored, refill by a negative amount and grant a
        negative count (which once reached ``bytes(size)`` in :func:`echo`).
        """
        if wanted <= 0:
            return 0
        with self._lock:
            now = self._clock()
            level, when = self._buckets.pop(peer, (float(self.allowance), now))
            level = min(float(self.allowance), level + max(now - when, 0.0) * self.per_s)
            granted = max(int(min(level, wanted)), 0)
            self._buckets[peer] = (level - granted, now)  # re-inserted: most recent last
            while len(self._buckets) > _PEERS_KEPT:
                del self._buckets[next(iter(self._buckets))]
        return granted


def echo(
    tier: str,
    messages: Iterator[tier_pb2.ProbeMessage | Undecodable],
    context: grpc.ServicerContext,
    credit: ProbeCredit,
) -> Iterator[tier_pb2.ProbeMessage]:
    """Answer each probe message with ``reply_bytes`` zero bytes, within the caller's credit."""
    peer = peer_host(context.peer())
    zeros = b""
    sent = 0  # bytes the caller sent on this stream and has not had back yet
    for message in messages:
        if isinstance(message, Undecodable):  # see tierflow.transport.wire.add_tier_servicer
            WARNINGS.warn(  # [Note: warnings about a peer]
                logger, tier, "undecodable", peer, "[%s] %s from %s", tier, message.message, peer
            )
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, message.message)
            return  # abort raises; this is for the type checker
        sent += len(message.payload)
        wanted = min(max(message.reply_bytes, 0), MAX_PROBE_BYTES)
        own = min(wanted, sent)
        size = own + max(credit.draw(peer, wanted - own), 0)
        sent -= own
        if len(zeros) != size:
            zeros = bytes(size)
        yield tier_pb2.ProbeMessage(seq=message.seq, payload=zeros, reply_bytes=size)
