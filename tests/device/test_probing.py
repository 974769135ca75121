"""The idle prober on a fake clock: when it probes, and what one probe measures.

Its loop runs on the test's thread with the clock moved by its own waits, and a probe
round goes to an in-process echo, so the schedule and the figures are exact, whatever
the load. See [Note: idle probes] in device/probing.py;
tests/edge/test_idle_probe.py runs probes against a real edge.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
import pytest

from tierflow.device import probing
from tierflow.device.probing import (
    DEFAULT_DEMAND_S,
    MAX_PROBE_BYTES,
    IdleProber,
    probe_size,
)
from tierflow.errors import UsageError
from tierflow.link.emulation import LinkShaper
from tierflow.link.spec import LinkSpec
from tierflow.link.trace import LinkTrace, TraceStep
from tierflow.rpc import tier_pb2


class _Clock:
    """The prober's ``time``: a clock that moves only when the prober waits."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    perf_counter = monotonic


class _Timeline:
    """Stands in for the prober's stop event: a wait moves the clock, running what falls in it.

    ``events`` are (time, action) pairs, seconds after the start (a request sent, a
    request answered alone); the prober's loop ends once the clock reaches ``until``.
    """

    def __init__(self, clock: _Clock, until: float, events: list[tuple[float, Any]]) -> None:
        self.clock, self.start = clock, clock.now
        self.until = clock.now + until
        self.events = sorted(((self.start + t, i, a) for i, (t, a) in enumerate(events)))

    def wait(self, timeout: float) -> bool:
        target = min(self.clock.now + max(timeout, 0.0), self.until)
        while self.events and self.events[0][0] <= target:
            at, _, action = self.events.pop(0)
            self.clock.now = max(self.clock.now, at)
            action()
        self.clock.now = target
        return self.clock.now >= self.until

    def is_set(self) -> bool:
        return self.clock.now >= self.until

    def set(self) -> None:
        self.until = self.clock.now


def _schedule(
    monkeypatch: pytest.MonkeyPatch,
    until: float,
    events: Callable[[IdleProber], list[tuple[float, Any]]] = lambda _: [],
    *,
    busy: Callable[[float], bool] = lambda _: False,
    idle_s: float = 1.0,
) -> list[float]:
    """When the prober probes (seconds after it starts) over ``until`` seconds.

    Runs its loop on this thread on a fake clock: no thread, no waiting, no channel used
    (each probe is recorded instead of sent).
    """
    clock = _Clock()
    monkeypatch.setattr(probing, "time", clock)
    with grpc.insecure_channel("127.0.0.1:9") as channel:  # never used
        prober = IdleProber(
            channel,
            busy=lambda: busy(clock.now - start),
            rate=lambda: 1e6,
            report=lambda *_: None,
            idle_s=idle_s,
        )
    start = clock.now
    probed: list[float] = []
    monkeypatch.setattr(prober, "_probe", lambda: probed.append(round(clock.now - start, 6)))
    monkeypatch.setattr(prober, "_stop", _Timeline(clock, until, events(prober)))
    prober._run()
    assert prober.probes == len(probed) and prober.failures == 0
    return probed


def test_an_idle_link_is_probed_at_intervals_doubling_up_to_the_longest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # 1 s idle, then 2, 4, 8, 16 s apart, then 30 s (the longest) apart.
    assert _schedule(monkeypatch, 100.0) == [1, 3, 7, 15, 31, 61, 91]


def test_a_request_restarts_the_count_and_the_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    probed = _schedule(monkeypatch, 12.0, lambda prober: [(4.5, prober.touch)])
    assert probed == [1, 3, 5.5, 7.5, 11.5]


def test_a_device_answering_alone_probes_every_demand_interval(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """While requests are answered without the link, every 0.25 s; then back to idle_s.

    A request answered alone every 50 ms for 1.6 s, then nothing: the probes come 0.25 s
    apart from the first such request on, and once they stop, 2 s after the last probe
    (the spell's second interval), then 4 s.
    """
    answered = [(0.05 * k, None) for k in range(1, 33)]  # 0.05 .. 1.6 s

    def events(prober: IdleProber) -> list[tuple[float, Any]]:
        return [(t, prober.demand) for t, _ in answered]

    probed = _schedule(monkeypatch, 8.0, events)
    assert probed == [0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 3.75, 7.75]
    assert DEFAULT_DEMAND_S == 0.25


def test_no_probe_starts_while_a_request_is_in_flight(monkeypatch: pytest.MonkeyPatch) -> None:
    # In flight from 0.5 s to 3.2 s: each probe that falls due finds it in flight (at 1,
    # 2 and 3 s) and is put off an idle time; the one at 4 s goes.
    assert _schedule(monkeypatch, 6.0, busy=lambda t: 0.5 <= t < 3.2) == [4.0]


class _EchoTier:
    """The edge's side of a probe round, in process: each message echoed, nothing asked back."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self.cancelled = 0

    def Probe(self, requests: Any, timeout: float) -> _EchoTier:
        self._requests = requests
        return self

    def __iter__(self) -> Any:
        for message in self._requests:
            self.received.append(len(message.payload))
            yield tier_pb2.ProbeMessage(seq=message.seq)

    def cancel(self) -> None:
        self.cancelled += 1


def test_a_probe_on_an_emulated_link_reports_the_links_rate_and_rtt_now(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """100x slower from 0.3 s on: a probe at 1 s measures 2 Mbit/s and the 20 ms RTT.

    The payload is sized for the estimate (20 ms at 200 Mbit/s, within the bounds), booked
    on the requests' shaper, and held until it has crossed, as a request would be.
    """
    clock = _Clock()
    monkeypatch.setattr(probing, "time", clock)
    steps = (TraceStep(0.0, LinkSpec(200e6, 0.02)), TraceStep(0.3, LinkSpec(2e6, 0.02)))
    shaper = LinkShaper("device-edge", LinkTrace(steps), clock=clock.monotonic)
    reports: list[tuple[float, int, float, float]] = []
    with grpc.insecure_channel("127.0.0.1:9") as channel:  # never used: the tier is in process
        prober = IdleProber(
            channel,
            busy=lambda: False,
            rate=lambda: 200e6,
            report=lambda *figures: reports.append(figures),
            shaper=shaper,
        )
    tier = _EchoTier()
    monkeypatch.setattr(prober, "_stub", tier)
    monkeypatch.setattr(prober, "_stop", _Timeline(clock, 60.0, []))
    opened = clock.now  # the trace's time 0
    clock.now += 1.0
    prober._probe()
    nbytes = probe_size(200e6)
    assert nbytes == MAX_PROBE_BYTES and tier.received == [0, 0, nbytes]
    ((at, sent, seconds, rtt),) = reports
    assert sent == nbytes and sent * 8 / seconds == pytest.approx(2e6)
    assert rtt == pytest.approx(0.02)  # the emulated propagation, both ways
    # Reported once it has crossed: serialised, then half the round trip on the way.
    assert at == clock.now == pytest.approx(opened + 1.0 + seconds + 0.01)
    assert prober.last_started is not None and tier.cancelled == 1


def test_the_demand_interval_is_never_longer_than_the_idle_time() -> None:
    with grpc.insecure_channel("127.0.0.1:9") as channel:
        prober = IdleProber(
            channel, busy=lambda: False, rate=lambda: 1e6, report=lambda *_: None, idle_s=0.1
        )
        assert prober.demand_s == 0.1
        with pytest.raises(UsageError):
            IdleProber(
                channel,
                busy=lambda: False,
                rate=lambda: 1e6,
                report=lambda *_: None,
                demand_s=0.0,
            )
