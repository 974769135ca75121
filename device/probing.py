"""Keeping the device-edge estimate fresh while nothing crosses the link: idle probes.

The device learns its links passively, from the transfers of real requests
([Note: switching plans on the device] in ``tierflow.device.adaptation``). A device that
sends nothing for a while learns nothing, and its first request after a pause would run
on a plan chosen for the link as it was. An :class:`IdleProber` fills the gap: once the
link has carried no request for ``idle_s`` seconds it sends one small probe over the
``Probe`` RPC of the channel the requests use, and again while the link stays idle, at
intervals that double up to ``max_interval_s``. See [Note: idle probes].

[Note: idle probes]
A probe round opens a short ``Probe`` stream and sends two empty messages (the round
trip: the faster of the two) and then one payload of ``probe_bytes`` (the estimate's
rate times :data:`PROBE_TIME_S`, within :data:`MIN_PROBE_BYTES` and
:data:`MAX_PROBE_BYTES`), asking nothing back: a tier sends a probe no more than it was
sent (``tierflow.runtime.probe``, [Note: probe credit]), and these answers are a few bytes.
The payload's transfer time is measured as a request's is ([Note: honest link figures]
in ``tierflow.link.emulation``): on an emulated link it is booked on the same
:class:`~tierflow.link.emulation.LinkShaper` as the requests (a request arriving meanwhile
waits behind it, and counts that as queueing, as behind any message) and its transfer
is the emulated serialisation; on a real link it is the payload's round trip less the
empty one's. Bytes over that time feed the device-edge
:class:`~tierflow.device.switching.LinkEstimator`, the round trip its RTT. No probe
starts while a request is in flight or has been sent within ``idle_s``, so probes never
compete with real traffic. They cost at most ``MAX_PROBE_BYTES`` per ``idle_s`` right
after traffic stops, and less the longer the link stays idle: the interval doubles
after each probe, up to ``max_interval_s`` (30 s: about 2 KiB/s at most on a device
left idle for hours); the first request resets it. A device that keeps answering
requests without the link (a device-only plan chosen for a slow link, or a device exit)
is not idle: each such request is chosen on the estimate, so after an interval in which
one came the next probe follows ``demand_s`` (0.25 s, at most ``idle_s``) later, without
backing off (:meth:`IdleProber.demand`); without that, a link that recovered while the
device sat on a device-only plan would go unseen for up to ``max_interval_s``, and even
``idle_s`` apart every request meanwhile runs on the old estimate (the adaptation
benchmark's device stayed on its device-only plan for 0.8 s after the 2 -> 200 Mbit/s
step, at twice the latency). Such a probe takes the link for about ``PROBE_TIME_S`` (20
ms) at the estimated rate, so it holds a link the requests do not use for under a tenth
of the time. A probe long after the last
observation replaces most of the estimate (its weight grows with the time since,
``LinkEstimator``), so a few probes suffice even far apart.
A probe that fails (the edge is down) is skipped: the channel's own state tells the
device that ([Note: retries and failing fast] in ``tierflow.transport.stream_client``).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator

import grpc

from tierflow.errors import TransportError, UsageError
from tierflow.link.emulation import LinkShaper
from tierflow.rpc import tier_pb2, tier_pb2_grpc

logger = logging.getLogger(__name__)

#: Seconds without a request before the first probe (and the first interval after it).
DEFAULT_IDLE_S = 1.0
#: Interval between probes while requests are answered without the link (seconds).
DEFAULT_DEMAND_S = 0.25
#: Longest interval between probes while the link stays idle (seconds).
DEFAULT_MAX_INTERVAL_S = 30.0
#: A probe's payload aims at this many seconds on the link at the estimated rate.
PROBE_TIME_S = 0.02
#: Bounds on a probe's payload (bytes).
MIN_PROBE_BYTES = 4 * 1024
MAX_PROBE_BYTES = 64 * 1024
#: Longest a probe round may take before it is given up (seconds).
PROBE_TIMEOUT_S = 5.0

#: Called with (now, payload bytes, transfer seconds, round trip seconds) after a probe.
Report = Callable[[float, int, float, float], None]


def probe_size(rate_bps: float) -> int:
    """The payload for a link estimated at ``rate_bps`` ([Note: idle probes])."""
    wanted = int(rate_bps * PROBE_TIME_S / 8)
    return min(max(wanted, MIN_PROBE_BYTES), MAX_PROBE_BYTES)


class IdleProber:
    """Probes the link on ``channel`` once it has been idle for ``idle_s`` seconds.

    Then again at intervals doubling from ``idle_s`` up to ``max_interval_s`` while it
    stays idle, or every ``demand_s`` (at most ``idle_s``) while requests are answered
    without it ([Note: idle probes]).

    ``busy`` says whether requests are in flight; :meth:`touch` is called for every
    request sent or answered, :meth:`demand` for every one answered on the device alone.
    ``rate`` gives the current rate estimate (to size the probe) and ``report`` receives
    each measurement. ``shaper`` is the requests' link emulation (None or unshaped: a
    real link). Runs a daemon thread from :meth:`start` until :meth:`close`.
    """

    def __init__(
        self,
        channel: grpc.Channel,
        *,
        busy: Callable[[], bool],
        rate: Callable[[], float],
        report: Report,
        shaper: LinkShaper | None = None,
        idle_s: float = DEFAULT_IDLE_S,
        max_interval_s: float = DEFAULT_MAX_INTERVAL_S,
        demand_s: float = DEFAULT_DEMAND_S,
    ) -> None:
        if not idle_s > 0 or not demand_s > 0:
            raise UsageError(
                f"the intervals before a probe must be positive, got {idle_s!r}, {demand_s!r}"
            )
        self.idle_s = idle_s
        self.max_interval_s = max(max_interval_s, idle_s)
        self.demand_s = min(demand_s, idle_s)
        self._streak = 0  # probes since the last request
        self.probes = 0  # rounds that measured the link
        self.failures = 0
        self.last_started: float | None = None  # when the last round began (monotonic)
        self._stub = tier_pb2_grpc.TierStub(channel)
        self._busy = busy
        self._rate = rate
        self._report = report
        self._shaper = shaper if shaper is not None and shaper.spec is not None else None
        self._active_at = time.monotonic()
        self._probed_at = self._active_at
        self._demanded = False  # a request ran without the link since the loop looked
        self._stop = threading.Event()
        self._call: grpc.Call | None = None
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="device-prober", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def touch(self) -> None:
        """A request was sent or answered now: the link is not idle."""
        self._active_at = time.monotonic()

    def demand(self) -> None:
        """A request was answered on the device without the link: keep probing, no back-off."""
        self._demanded = True

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            call = self._call
        if call is not None:
            call.cancel()
        if self._thread.is_alive():
            self._thread.join(PROBE_TIMEOUT_S)

    def interval(self, streak: int) -> float:
        """Seconds before the probe that follows ``streak`` probes of one idle spell."""
        return min(self.idle_s * 2.0 ** min(streak, 32), self.max_interval_s)

    def _run(self) -> None:
        while True:
            active, probed = self._active_at, self._probed_at
            wanted = self._demanded  # one answered alone since the last probe
            streak = 0 if active >= probed or wanted else self._streak
            due = max(active, probed) + (self.demand_s if wanted else self.interval(streak))
            # Looks again every demand_s at most: a request answered alone meanwhile
            # brings the probe forward.
            woken = min(due, time.monotonic() + self.demand_s)
            if self._stop.wait(max(woken - time.monotonic(), 0.0)):
                return
            if time.monotonic() < due:
                continue
            self._demanded = False
            if self._active_at != active:
                continue  # a request came meanwhile
            if self._busy():
                self.touch()  # a request is in flight: look again an idle time later
                continue
            try:
                self._probe()
                self.probes += 1
            except (grpc.RpcError, TransportError, StopIteration) as exc:
                self.failures += 1
                logger.debug("[device] idle probe failed: %s", exc)
            self._probed_at = time.monotonic()
            self._streak = streak + 1

    def _probe(self) -> None:
        """One probe round ([Note: idle probes])."""
        self.last_started = time.monotonic()
        nbytes = probe_size(self._rate())
        outgoing: queue.SimpleQueue[tier_pb2.ProbeMessage | None] = queue.SimpleQueue()
        call = self._stub.Probe(iter(outgoing.get, None), timeout=PROBE_TIMEOUT_S)
        with self._lock:
            self._call = call
        if self._stop.is_set():
            call.cancel()
        replies: Iterator[tier_pb2.ProbeMessage] = iter(call)
        try:
            rtt = min(_echo(outgoing, replies, seq, b"") for seq in (1, 2))
            transfer = self._shaper.schedule(nbytes) if self._shaper is not None else None
            # Held until it has crossed the emulated link, as a request is.
            arrives = transfer.arrives if transfer is not None else None
            if arrives is not None and self._stop.wait(max(arrives - time.monotonic(), 0.0)):
                return
            took = _echo(outgoing, replies, 3, bytes(nbytes))
        finally:
            outgoing.put(None)
            call.cancel()
            with self._lock:
                self._call = None
        if transfer is not None and transfer.started is not None and transfer.left is not None:
            seconds = transfer.left - transfer.started
            if transfer.arrives is not None:
                rtt += 2 * (transfer.arrives - transfer.left)  # the emulated propagation
        else:
            seconds = took - rtt
        self._report(time.monotonic(), nbytes, seconds, rtt)


def _echo(
    outgoing: queue.SimpleQueue[tier_pb2.ProbeMessage | None],
    replies: Iterator[tier_pb2.ProbeMessage],
    seq: int,
    payload: bytes,
) -> float:
    """Seconds from sending ``payload`` to its (empty) echo."""
    start = time.perf_counter()
    outgoing.put(tier_pb2.ProbeMessage(seq=seq, payload=payload, reply_bytes=0))
    reply = next(replies)
    elapsed = time.perf_counter() - start
    if reply.seq != seq:
        raise TransportError(f"probe echo {reply.seq}, expected {seq}")
    return elapsed
