"""Link emulation: serialisation at the link rate, propagation pipelined, order kept."""

from __future__ import annotations

import time

import pytest

from tierflow.errors import UsageError
from tierflow.link.emulation import LinkEmulation, LinkShaper, ShapedQueue, resolve_links
from tierflow.link.spec import LinkOption, LinkSpec
from tierflow.plan import Plan, SegmentSpec

MB = 1_000_000


def _arrivals(queue: ShapedQueue[int]) -> list[tuple[int, float]]:
    """Drain everything put so far; when each item came out."""
    queue.close()
    return [(item, time.monotonic()) for item in queue.drain()]


# The next two wait on the real clock: that the queue really holds a message until its
# arrival is their point (the schedule itself is checked exactly, on an injected clock, by
# test_the_schedule_on_an_injected_clock_is_exact). Arriving early would be a bug at any
# load, so the lower bounds are tight; the upper bounds only catch a queue that waits far
# too long, with half a second of margin for a loaded machine.
@pytest.mark.integration
def test_a_megabyte_over_20_mbit_takes_0_4_s_plus_half_the_rtt() -> None:
    queue: ShapedQueue[int] = ShapedQueue(LinkShaper("device-edge", LinkSpec(20e6, 0.05)))
    start = time.monotonic()
    transfer = queue.put(1, MB)
    ((item, at),) = _arrivals(queue)
    assert item == 1
    assert 0.42 <= at - start < 0.425 + 0.5  # 0.4 s serialisation + 25 ms propagation
    assert transfer.stat("device-edge").rate_bps == pytest.approx(20e6, rel=0.05)


@pytest.mark.integration
def test_messages_queue_for_the_link_but_propagation_overlaps() -> None:
    queue: ShapedQueue[int] = ShapedQueue(LinkShaper("edge-cloud", LinkSpec(80e6, 0.2)))
    start = time.monotonic()
    for item in range(3):
        queue.put(item, MB // 2)  # 50 ms each at 80 Mbit/s
    arrivals = _arrivals(queue)
    assert [item for item, _ in arrivals] == [0, 1, 2]
    offsets = [at - start for _, at in arrivals]
    # 50, 100, 150 ms on the link, then 100 ms of propagation each, not one after another.
    for offset, expected in zip(offsets, (0.15, 0.2, 0.25), strict=True):
        assert expected - 0.005 <= offset < expected + 0.5


def test_an_unshaped_queue_does_not_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    slept: list[float] = []
    monkeypatch.setattr(time, "sleep", slept.append)
    queue: ShapedQueue[int] = ShapedQueue(LinkShaper("device-edge", None))
    transfer = queue.put(7, 100 * MB)
    assert [item for item, _ in _arrivals(queue)] == [7]
    assert slept == [] and transfer.arrives is None


def test_a_queue_on_an_injected_clock_holds_each_message_until_it_arrives(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The waits the queue asks for are exactly the schedule's, and the order is kept."""
    clock = _Clock(0.0)
    slept: list[float] = []

    def sleep(seconds: float) -> None:  # time passes only when the queue waits
        slept.append(seconds)
        clock.now += seconds

    monkeypatch.setattr(time, "sleep", sleep)
    queue: ShapedQueue[int] = ShapedQueue(
        LinkShaper("edge-cloud", LinkSpec(80e6, 0.2), clock=clock)
    )
    transfers = [queue.put(item, MB // 2) for item in range(3)]  # 50 ms each at 80 Mbit/s
    queue.close()
    arrivals = []
    for item in queue.drain():
        arrivals.append((item, clock.now))
    # 50, 100, 150 ms on the link, then 100 ms of propagation each, not one after another.
    assert [item for item, _ in arrivals] == [0, 1, 2]
    assert [at for _, at in arrivals] == pytest.approx([0.15, 0.2, 0.25])
    assert slept == pytest.approx([0.15, 0.05, 0.05])
    assert all(t.handed for t in transfers)
    assert transfers[2].stat("edge-cloud").rate_bps == pytest.approx(80e6)


def test_a_message_known_never_to_have_reached_the_peer_reports_no_bytes() -> None:
    # The sender learns the stream died before connecting; the transport's thread then
    # still takes the message from the dead stream's queue. That must not count it sent.
    queue: ShapedQueue[int] = ShapedQueue(LinkShaper("device-edge", None))
    transfer = queue.put(1, 2048)
    transfer.unreached = True
    assert [item for item, _ in _arrivals(queue)] == [1]
    assert transfer.handed
    stat = transfer.stat("device-edge")
    assert stat.bytes == 0 and stat.rate_bps == 0.0


def test_resolve_links_uses_the_plan_and_overrides() -> None:
    plan = Plan(
        model_file="m.onnx",
        model_sha256="0" * 64,
        inputs=("x",),
        outputs=("y",),
        segments=(SegmentSpec("device", "a.onnx", ("x",), ("y",)),),
        links={"device-edge": LinkSpec(20e6, 0.01), "edge-cloud": LinkSpec(1e9, 0.02)},
    )
    off, by_plan = LinkEmulation.parse("off"), LinkEmulation.parse("plan")
    assert resolve_links(plan.links, off) == {}
    links = resolve_links(plan.links, by_plan, [LinkOption.parse("edge-cloud=100mbit,5ms")])
    assert links["device-edge"] == LinkSpec(20e6, 0.01)
    assert links["edge-cloud"] == LinkSpec(100e6, 0.005)
    # A pinned link is shaped without a mode; the others stay unshaped; a rate alone
    # keeps the plan's RTT ([Note: emulated links] in tierflow.link.emulation).
    assert resolve_links(plan.links, off, [LinkOption.parse("device-edge=1mbit")]) == {
        "device-edge": LinkSpec(1e6, 0.01)
    }
    with pytest.raises(UsageError):
        LinkOption.parse("wifi=1mbit")


class _Clock:
    """A clock the test moves by hand."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_the_schedule_on_an_injected_clock_is_exact() -> None:
    clock = _Clock(10.0)
    shaper = LinkShaper("device-edge", LinkSpec(20e6, 0.05), clock=clock)
    first = shaper.schedule(MB)  # 0.4 s on the link, then 25 ms of propagation
    assert (first.queued, first.left, first.arrives) == (10.0, 10.4, pytest.approx(10.425))
    clock.now = 10.1  # handed over while the link is busy: waits for it
    second = shaper.schedule(MB // 2)
    assert second.queued == 10.1
    assert second.left == pytest.approx(10.6) and second.arrives == pytest.approx(10.625)
    second.handed = True  # the transport took it ([Note: honest link figures]):
    stat = second.stat("device-edge")  # the link's rate; the 0.3 s wait is queueing
    assert stat.rate_bps == pytest.approx(20e6) and stat.queue_ms == pytest.approx(300)
    clock.now = 20.0  # the link has been idle: starts at once
    third = shaper.schedule(MB // 4)
    assert third.left == pytest.approx(20.1) and third.arrives == pytest.approx(20.125)
    assert LinkShaper("device-edge", None, clock=clock).schedule(MB).left is None
