"""Which streams a tier takes: at most so many open at once, from each peer and in all.

[Note: stream admission]
A tier serves every open stream (``Infer`` or ``Probe``) on a gRPC thread of its own that
mostly waits for the stream's next message; the work itself runs on the tier's worker
pool (``tierflow.runtime.tier``). An idle or slow stream so costs a parked thread, never a
worker. :class:`~tierflow.runtime.server.TierServer` sizes gRPC's thread pool for the caps below
plus a few spare threads for health checks, and tells gRPC to refuse any call beyond
that at once (``maximum_concurrent_rpcs``): no call ever waits in gRPC's queue behind
idle streams, which is how 64 idle streams used to stall every device.

A client that sends requests but stops reading its replies holds only its own
stream's threads, and only until a reply has waited ``reply_timeout`` for it: then its
stream is cancelled ([Note: slow readers] in ``tierflow.runtime.replies``).

A stream beyond ``max_streams_per_peer`` from one peer, or beyond ``max_streams`` in all,
ends at once with gRPC status RESOURCE_EXHAUSTED and a message starting ``OVERLOADED:``;
the client (``tierflow.transport.stream_client``) fails that stream's requests with a
:class:`~tierflow.errors.RemoteError` of code ``OVERLOADED`` and does not send them
again by itself. A peer is a host: the address without its port (every device on one
machine, or behind one NAT, shares a peer's cap), a unix socket path, or the peer
string gRPC gives for anything else.

Behind a NAT (a carrier's, a campus's), every device shows the same address, so the cap
per peer is a cap on all of them together: a tierflow device keeps one stream to its
edge (one per replica with ``ipv4:A,B`` targets) plus a short probe now and then, so set
``--max-streams-per-peer`` to the devices expected behind one address, with headroom.
And one host must not hold the cap with streams it never uses: a stream that has nothing
in flight and has sent no well-formed message for ``--stream-idle`` seconds (default 60)
is cancelled, its place given back; one that sends only garbage is closed sooner
([Note: garbage on a stream] in ``tierflow.runtime.streams``). tierflow's own clients
close and reopen a stream of theirs that has been idle for half that
(``tierflow.transport.stream_client``), so they never meet it.

Nor may a few hosts hold the global cap between them: four hosts at the default cap per
peer (256) once filled the default global cap (1024), and every other host's devices
were refused. So the last quarter of the global places is a reserve
(:func:`reserve_of`): while it is being used, a peer is given a place only if it holds
fewer streams than places remain free. A host holding its cap per peer is refused new
streams as before; hosts that have filled the open three quarters get a shrinking share
of the reserve (the first about half of it, the next a quarter, ...); and a host with
few streams (one device, or a few behind a NAT) still gets in while any place is free.
"""

from __future__ import annotations

import threading
from collections import Counter

#: Marks the refusal's message, so that clients can tell it from other RESOURCE_EXHAUSTED.
OVERLOADED = "OVERLOADED"


def peer_host(peer: str) -> str:
    """The host part of a gRPC peer string (``ipv4:10.0.0.5:40512`` -> ``10.0.0.5``)."""
    kind, _, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6") and rest:
        host, sep, port = rest.rpartition(":")
        if sep and port.isdigit():
            return host
    return peer


def reserve_of(max_streams: int) -> int:
    """The global places kept for peers with few streams ([Note: stream admission])."""
    return max_streams // 4


class StreamAdmission:
    """Counts a tier's open streams per peer and in all ([Note: stream admission]).

    :meth:`admit` either takes a place and returns None, or returns why not; each place
    taken is given back once with :meth:`release`. Thread-safe.
    """

    def __init__(self, tier: str, max_streams: int, max_per_peer: int) -> None:
        if max_streams < 1 or max_per_peer < 1:
            raise ValueError(f"stream caps must be >= 1, got {max_streams} and {max_per_peer}")
        self.tier = tier
        self.max_streams = max_streams
        self.max_per_peer = max_per_peer
        self.reserve = reserve_of(max_streams)
        self._lock = threading.Lock()
        self._open: Counter[str] = Counter()
        self._total = 0

    @property
    def open_streams(self) -> int:
        return self._total

    def admit(self, peer: str) -> str | None:
        """Take a place for a stream from ``peer`` (a host), or say why there is none."""
        with self._lock:
            held = self._open[peer]
            if held >= self.max_per_peer:
                return (
                    f"{OVERLOADED}: the {self.tier} serves {held} streams from "
                    f"{peer} already (at most {self.max_per_peer} per peer)"
                )
            free = self.max_streams - self._total
            if free <= 0:
                return (
                    f"{OVERLOADED}: the {self.tier} serves {self._total} streams already "
                    f"(at most {self.max_streams})"
                )
            if free <= self.reserve and held >= free:
                return (
                    f"{OVERLOADED}: the {self.tier} has {free} places left of "
                    f"{self.max_streams}, kept for peers holding fewer streams than that; "
                    f"{peer} holds {held}"
                )
            self._open[peer] += 1
            self._total += 1
            return None

    def release(self, peer: str) -> None:
        """Give back a place :meth:`admit` took for ``peer``."""
        with self._lock:
            assert self._open[peer] > 0, f"no stream from {peer} to release"
            self._open[peer] -= 1
            if not self._open[peer]:
                del self._open[peer]
            self._total -= 1
