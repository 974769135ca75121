"""The device's ordered in-flight window: up to ``size`` requests sent, answered in order.

Every way the device streams requests (``DeviceClient.run_stream``, ``Device.pairs``, a
session's chunks and their replay in ``device/sessions.py``, ``tierflow device``'s frames)
keeps the same window: a request is sent once fewer than ``size`` are waiting, results
come out oldest first, and a result already there is taken as soon as everything before
it is, so the device, the links and the tiers above work as a pipeline while the caller
still sees the order it sent in.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable, Iterator
from typing import Generic, TypeVar

from tierflow.device.results import Result, Ticket
from tierflow.errors import UsageError

T = TypeVar("T")
E = TypeVar("E")
R = TypeVar("R")


class InFlight(Generic[E, R]):
    """Entries in flight, oldest first, at most ``size`` of them once :meth:`room` is taken.

    ``done(entry)`` says whether an entry's answer is there; ``settle(entry)`` waits for it
    and gives the entry's result. Not thread-safe: one caller streams through a window.
    """

    def __init__(self, size: int, settle: Callable[[E], R], done: Callable[[E], bool]) -> None:
        if size < 1:
            raise UsageError(f"the window must be at least 1 request, got {size}")
        self.size = size
        self._settle = settle
        self._done = done
        self._entries: collections.deque[E] = collections.deque()

    def __len__(self) -> int:
        return len(self._entries)

    def room(self) -> Iterator[R]:
        """Settle the oldest entries until another may be sent (fewer than ``size`` wait)."""
        while len(self._entries) >= self.size:
            yield self._settle(self._entries.popleft())

    def add(self, entry: E) -> None:
        """A request just sent (after :meth:`room`)."""
        self._entries.append(entry)

    def ready(self) -> Iterator[R]:
        """Settle the oldest entries while their answers are already there."""
        while self._entries and self._done(self._entries[0]):
            yield self._settle(self._entries.popleft())

    def drain(self) -> Iterator[R]:
        """Settle every entry, oldest first."""
        while self._entries:
            yield self._settle(self._entries.popleft())

    def take(self) -> list[E]:
        """Remove every entry unsettled, oldest first (a replay sends them again)."""
        entries = list(self._entries)
        self._entries.clear()
        return entries

    def stream(self, items: Iterable[T], send: Callable[[T], E]) -> Iterator[R]:
        """Send each item (``send``) as the window allows; every result in order, the last
        ones once ``items`` ends."""
        for item in items:
            yield from self.room()
            self.add(send(item))
            yield from self.ready()
        yield from self.drain()


def tickets(size: int) -> InFlight[Ticket, Result]:
    """A window of tickets, each settled as its :class:`Result`."""
    return InFlight(size, Ticket.result, Ticket.done)


def tagged(size: int) -> InFlight[tuple[T, Ticket], tuple[T, Result]]:
    """A window of tickets each with the item it answers, settled as (item, Result)."""
    return InFlight(size, _tagged_result, _tagged_done)


def _tagged_result(entry: tuple[T, Ticket]) -> tuple[T, Result]:
    return entry[0], entry[1].result()


def _tagged_done(entry: tuple[T, Ticket]) -> bool:
    return entry[1].done()
