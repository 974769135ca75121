"""Link emulation: make a local connection behave like a link of a given rate and RTT.

Three processes on one machine talk over loopback, which is far faster than the 20 Mbit/s
uplink of a phone. So that the local demo, the tests and the benchmarks see what a real
deployment would, every sender shapes what it puts on a link (see [Note: link shaping]).
Replies flowing back are shaped by their sender in the same way, on their own direction
of the link (links are full duplex).

[Note: link shaping]
A link direction is a server of one message at a time. A message of ``n`` bytes starts
when it is handed over or when the link is free, whichever is later; it occupies the link
for ``n * 8 / rate`` seconds (serialisation) and arrives ``rtt / 2`` after it has left
(propagation). Propagation does not hold the link: the next message starts serialising
while the previous one is still in flight, as on a real wire. Shaping happens on the
sending side by holding a message back until its arrival time, then writing it to the
(much faster) real connection; message order is kept.

[Note: honest link figures]
A message's time on a link direction has two parts, reported apart (``LinkStat``):
waiting at the sender behind earlier messages (``queue_ms``: with a window of 16
requests in flight, most of a message's time) and crossing the link (``send_ms``, from
the start of its serialisation, or the transport taking it, to its having left).
``rate_bps`` is bytes over the crossing time only, so it tells the link's rate, not how
full the window was. Waiting at the receiver is the receiver's ``TierTiming.queue_ms``.
A message the transport never took (its stream broke first), or one the sender learned
never reached the peer (its stream broke UNAVAILABLE before the channel ever connected),
reports 0 bytes. The second is a mark of its own, not a reset of ``handed``: the transport's
thread may still take the message from the dead stream's queue after the sender has
learned that, and must not undo it.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from tierflow.errors import UsageError, shown
from tierflow.link.spec import LINKS, LinkOption, LinkSpec, apply_links
from tierflow.link.trace import LinkTrace, load_trace
from tierflow.rpc import tier_pb2

T = TypeVar("T")
#: Seconds from some fixed point, like :func:`time.monotonic`.
Clock = Callable[[], float]
#: Waits that many seconds on a :data:`Clock`, like :func:`time.sleep`.
Sleep = Callable[[float], None]


def real_sleep(seconds: float) -> None:
    """:func:`time.sleep`, looked up when called (a test's patch of it, or the fast
    layer's guard in tests/layers.py, sees every wait)."""
    time.sleep(seconds)


#: ``--link-emulation`` values; ``trace`` is written ``trace=FILE.csv``.
EMULATION_MODES: tuple[str, ...] = ("off", "plan", "trace")


@dataclass
class Transfer:
    """One message put on a link direction, as its sender saw it (monotonic seconds).

    ``started`` is when the message began to cross the link (with emulation, the start of
    its serialisation; without, when the transport took it), ``left`` when it had left
    the sender (the end of its serialisation; when the transport had written it): see
    [Note: honest link figures]. ``handed`` says whether the transport got it at all,
    ``unreached`` that the sender learned it never reached the peer.
    """

    nbytes: int
    queued: float
    left: float | None = None
    arrives: float | None = None
    started: float | None = None
    handed: bool = False
    unreached: bool = False

    def stat(self, link: str) -> tier_pb2.LinkStat:
        """The wire record of this transfer ([Note: honest link figures])."""
        now = time.monotonic()
        if not self.handed or self.unreached:  # never got out: no bytes, no rate, all waiting
            return tier_pb2.LinkStat(link=link, queue_ms=max(now - self.queued, 0.0) * 1e3)
        started = self.started if self.started is not None else self.queued
        left = self.left if self.left is not None else now
        send_s = max(left - started, 0.0)
        rate = self.nbytes * 8.0 / send_s if send_s > 0 and self.nbytes > 0 else 0.0
        return tier_pb2.LinkStat(
            link=link,
            bytes=self.nbytes,
            send_ms=send_s * 1e3,
            rate_bps=rate,
            queue_ms=max(started - self.queued, 0.0) * 1e3,
        )


class LinkShaper:
    """The state of one emulated link direction; thread-safe. ``spec=None``: not shaped.

    A :class:`~tierflow.link.trace.LinkTrace` changes the link over time, counted from
    when the shaper is made (the sender opening the link). ``clock`` gives the time in
    seconds (monotonic, as the default) and ``sleep`` waits on it; a test can pass its own
    pair to check a schedule exactly without waiting, the way the caches take a clock.
    """

    def __init__(
        self,
        name: str,
        spec: LinkSpec | LinkTrace | None,
        *,
        clock: Clock = time.monotonic,
        sleep: Sleep = real_sleep,
    ) -> None:
        self.name = name
        self.spec = spec
        self.clock = clock
        self.sleep = sleep
        self._trace = LinkTrace.constant(spec) if isinstance(spec, LinkSpec) else spec
        # A fixed link does not depend on when it opened (0: its schedule stays exact).
        self._epoch = clock() if isinstance(spec, LinkTrace) else 0.0
        self._free_at = 0.0
        self._lock = threading.Lock()

    @property
    def epoch(self) -> float:
        """When a traced link opened, on ``clock``: the trace's time 0 (0 for a fixed link)."""
        return self._epoch

    def schedule(self, nbytes: int) -> Transfer:
        """Book the link for ``nbytes`` bytes handed over now ([Note: link shaping])."""
        now = self.clock()
        transfer = Transfer(nbytes, now)
        trace = self._trace
        if trace is None:
            return transfer
        with self._lock:
            start = max(now, self._free_at)
            self._free_at = self._epoch + trace.serialised(start - self._epoch, nbytes)
            transfer.started = start
            transfer.left = self._free_at
        transfer.arrives = transfer.left + trace.at(transfer.left - self._epoch).rtt_s / 2.0
        return transfer

    def wait_until(self, moment: float | None) -> None:
        """Hold the caller until ``moment`` on :attr:`clock` (None or past: not at all)."""
        if moment is not None:
            delay = moment - self.clock()
            if delay > 0:
                self.sleep(delay)


class ShapedQueue(Generic[T]):
    """A FIFO whose items come out no earlier than their emulated arrival on a link.

    Producers :meth:`put` messages (any thread); one consumer iterates :meth:`drain`,
    typically as the request iterator of a gRPC stream or a server's reply generator.
    :meth:`close` ends the iteration after everything put before it.
    """

    _END = object()

    def __init__(self, shaper: LinkShaper | None = None) -> None:
        self.shaper = shaper
        self._clock = shaper.clock if shaper is not None else time.monotonic
        self._sleep = shaper.sleep if shaper is not None else real_sleep
        self._queue: queue.SimpleQueue[tuple[Transfer | None, object]] = queue.SimpleQueue()

    def put(self, item: T, nbytes: int) -> Transfer:
        """Queue ``item`` (``nbytes`` on the wire); return its transfer record."""
        transfer = self.book(nbytes)
        self.send(transfer, item)
        return transfer

    def book(self, nbytes: int) -> Transfer:
        """The transfer record of ``nbytes`` handed over now; :meth:`send` queues its item."""
        if self.shaper is None:
            return Transfer(nbytes, self._clock())
        return self.shaper.schedule(nbytes)

    def send(self, transfer: Transfer, item: T) -> None:
        """Queue ``item`` under its transfer record (from :meth:`book`)."""
        self._queue.put((transfer, item))

    def close(self) -> None:
        self._queue.put((None, self._END))

    def drain(self) -> Iterator[T]:
        """Yield items at their arrival times until :meth:`close`."""
        while True:
            transfer, item = self._queue.get()
            if item is self._END:
                return
            assert transfer is not None
            if transfer.arrives is not None:
                delay = transfer.arrives - self._clock()
                if delay > 0:
                    self._sleep(delay)
            if transfer.started is None:
                transfer.started = self._clock()
            transfer.handed = True
            yield item  # type: ignore[misc]
            if transfer.left is None:
                # The transport asks for the next item once this one is written.
                transfer.left = self._clock()


@dataclass(frozen=True)
class LinkEmulation:
    """``--link-emulation``, parsed: what every link a process sends on is shaped to.

    ``off``: nothing shaped; ``plan``: each link as the plan has it; ``trace``: every
    link replays the trace in ``trace_file`` (``trace=FILE.csv``). ``--emulate-link``
    values (:class:`~tierflow.link.spec.LinkOption`) pin single links over that, and
    shape them also when the mode is ``off`` (see [Note: emulated links]).
    """

    mode: str = "off"
    trace_file: str | None = None

    def __post_init__(self) -> None:
        if self.mode not in EMULATION_MODES or (self.mode == "trace") != bool(self.trace_file):
            given = self.mode if self.trace_file is None else f"{self.mode}={self.trace_file}"
            raise UsageError(
                f"unknown --link-emulation {shown(given)}: expected off, plan or trace=FILE.csv"
            )

    @classmethod
    def parse(cls, text: str) -> LinkEmulation:
        mode, sep, path = text.strip().partition("=")
        return cls(mode, path.strip() if sep else None)

    def __str__(self) -> str:
        return f"trace={self.trace_file}" if self.mode == "trace" else self.mode


def resolve_links(
    plan_links: Mapping[str, LinkSpec],
    emulation: LinkEmulation,
    pinned: Sequence[LinkOption] = (),
) -> dict[str, LinkSpec | LinkTrace]:
    """The links to emulate, by name, for a plan whose links are ``plan_links``
    ([Note: emulated links]).

    [Note: emulated links]
    ``--link-emulation`` says what every link is shaped to: nothing (``off``), the plan's
    rate and RTT (``plan``) or a trace (``trace=FILE.csv``). ``--emulate-link`` pins one
    link to fixed values on top of that, and is shaped even when the mode is ``off``:
    a flag that names a link to emulate emulates it. A pinned value without an RTT keeps
    the plan's RTT for that link.
    """
    links: dict[str, LinkSpec | LinkTrace] = {}
    if emulation.mode == "trace":
        assert emulation.trace_file is not None
        trace = load_trace(emulation.trace_file)
        links = {name: trace for name in LINKS}
    elif emulation.mode == "plan":
        links = {name: plan_links[name] for name in LINKS if name in plan_links}
    fixed = apply_links(plan_links, pinned)
    links.update({option.name: fixed[option.name] for option in pinned})
    return links
