"""Streaming a stateful model from the device: one session's chunks, in order, replayed as needed.

A :class:`StreamSession` sends a session's chunks (``run --session``'s IN.npz rows, a
``tierflow device`` source, an app's frames) with up to ``window`` in flight. Each chunk is
one request at the next position; the tier that owns the model's state feeds it back from
chunk to chunk ([Note: session state on a tier] in tierflow/state/store.py), so the
answers equal a local loop that feeds each state output back, bit for bit at the
runtime's settings. When a tier answers STATE_LOST, the session is replayed from its
first chunk ([Note: replaying a session] in device/generation.py): the chunks
answered since are sent again in order (their answers are not yielded twice), then the
lost one and those after it, whose answers are the ones yielded. The tier holds the
session's state while its chunks wait there (``SessionStates.hold``), so a replay, whose
chunks fill the window, completes under eviction pressure; one that loses its state
again all the same starts over, ``REPLAY_TRIES`` times at most. ``keep`` bounds the
chunks the device holds for that (None: all); a loss beyond them fails the rest of the
session with a :class:`~tierflow.errors.StateLostError` rather than give a different answer.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import TypeVar

import numpy as np

from tierflow.device.client import DeviceClient
from tierflow.device.in_flight import InFlight, tickets
from tierflow.device.results import Result, Ticket
from tierflow.errors import StateLostError, TierflowError, UsageError, is_state_lost
from tierflow.npz import read_arrays
from tierflow.plan import Plan

logger = logging.getLogger(__name__)

T = TypeVar("T")
#: Times a session is replayed for one loss before its chunk fails: a replay whose state
#: is lost again starts over ([Note: replaying a session] in device/generation.py).
REPLAY_TRIES = 3
Inputs = Mapping[str, np.ndarray]


def initial_states(path: str | Path, plan: Plan) -> dict[str, np.ndarray]:
    """The first row of each fixed-shape state input ``path`` holds (``run --session``).

    A state input is taken from the file for the first request only; the tier that owns
    it feeds its own outputs back from then on. A growing state (a KV cache) always
    starts empty and is not read.
    """
    arrays = read_arrays(path)
    found: dict[str, np.ndarray] = {}
    for state in plan.states:
        if state.grows is not None or state.input not in arrays:
            continue
        row = np.ascontiguousarray(arrays[state.input][0])
        if row.ndim + 1 == len(state.shape):  # the rows lack the batch dimension
            row = row[np.newaxis]
        found[state.input] = row
    return found


class StreamSession:
    """One session of a streaming model, sent through ``client`` (see the module)."""

    def __init__(
        self,
        client: DeviceClient,
        name: str,
        *,
        initial: Inputs | None = None,
        keep: int | None = None,
    ) -> None:
        if keep is not None and keep < 1:
            raise UsageError(f"chunks kept for a replay must be at least 1, got {keep}")
        self.client = client
        self.name = name
        self.initial = dict(initial or {})
        self.keep = keep
        self.replays = 0
        self._sent: collections.deque[Inputs] = collections.deque()  # chunks by position
        self._first = 0  # the position of the oldest chunk kept
        self._next = 0  # the position of the next chunk: a session goes on across calls
        self._lost: StateLostError | None = None

    @property
    def position(self) -> int:
        """The position the next chunk takes: the chunks this session has sent so far."""
        return self._next

    def run(self, chunks: Iterable[Inputs]) -> Iterator[Result]:
        """One Result per chunk, in order; a later call goes on where this one ended."""
        for _, result in self.pairs(chunks, lambda chunk: chunk):
            yield result

    def pairs(
        self, items: Iterable[T], prepare: Callable[[T], Inputs]
    ) -> Iterator[tuple[T, Result]]:
        """One Result per item, with the item it answers; ``prepare`` gives its inputs."""
        window: InFlight[tuple[T, int, Ticket], tuple[T, Result]] = InFlight(
            self.client.window, lambda entry: self._settle(entry, window), _chunk_done
        )
        for item in items:
            yield from window.room()
            try:
                inputs = prepare(item)
            except TierflowError as exc:  # a frame that cannot be read takes no position
                yield from window.drain()
                started = time.perf_counter()
                failed = Result("unread", error=exc, ms={"total": 0.0, "device": 0.0})
                yield item, Ticket(failed.id, started, 0.0, result=failed).result()
                continue
            position, self._next = self._next, self._next + 1
            window.add((item, position, self._send(inputs, position)))
            yield from window.ready()
        yield from window.drain()

    def _send(self, inputs: Inputs, position: int) -> Ticket:
        """Chunk ``position``, kept for a replay (the first with the initial state)."""
        self._sent.append(inputs)
        if self.keep is not None and len(self._sent) > self.keep:
            self._sent.popleft()
            self._first += 1
        return self._submit(inputs, position)

    def _submit(self, inputs: Inputs, position: int, replay_to: int = 0) -> Ticket:
        if self._lost is not None:  # the session cannot go on: fail the rest as it did
            return _failed_ticket(position, self._lost)
        feeds = {**inputs, **self.initial} if position == 0 else inputs
        return self.client.submit(feeds, session=self.name, position=position, replay_to=replay_to)

    def _settle(
        self,
        chunk: tuple[T, int, Ticket],
        window: InFlight[tuple[T, int, Ticket], tuple[T, Result]],
    ) -> tuple[T, Result]:
        """The oldest chunk's Result (taken from ``window``), the session replayed first if
        a tier lost it."""
        item, position, ticket = chunk
        result = ticket.result()
        if not is_state_lost(result.error):
            return item, result
        # Every chunk after this one ran (or will) on the lost state too: wait them out,
        # rebuild the state up to this chunk, then send this one and those after again.
        later = window.take()
        for _, _, pending in later:
            pending.result()
        result, resent = self._replay(position, result, [pos for _, pos, _ in later])
        for (it, pos, _), again in zip(later, resent, strict=True):
            window.add((it, pos, again))
        return item, result

    def _replay(self, position: int, lost: Result, after: list[int]) -> tuple[Result, list[Ticket]]:
        """Send chunks 0..position-1 again, then chunk ``position`` and the chunks ``after``
        it: chunk ``position``'s Result, and the tickets of those after.

        They go out one stream, each sent before the ones ahead of it are answered, so a
        request of the session waits at the tier all along and the tier holds its state
        ([Note: replaying a session] in device/generation.py).
        """
        if self._lost is not None or self._first > 0:  # the first chunks are gone
            self._lost = self._lost or StateLostError(
                f"session {self.name!r}: a tier lost its state ({lost.error}), and the device "
                f"keeps only the last {self.keep} chunks, not the {position} before this "
                "one that rebuild it"
            )
            return _failed(lost, self._lost), [self._resend(pos) for pos in after]
        result = lost
        for _ in range(REPLAY_TRIES):  # a replay that lost its state again starts over
            self.replays += 1
            logger.info(
                "[device] session %s: a tier lost its state (%s); replaying %d chunks",
                self.name,
                result.error,
                position,
            )
            window = tickets(self.client.window)
            failed: TierflowError | None = None
            end = max([position, *after]) + 1  # the tier holds the session until then
            for earlier in range(position):
                window.add(self._resend(earlier, end))
                failed = _first_error(window.room())
                if failed is not None:
                    break
            if failed is None:
                ticket = self._resend(position, end)
                resent = [self._resend(pos, end) for pos in after]
                failed = _first_error(window.drain())
                result = ticket.result()
                if failed is None and not is_state_lost(result.error):
                    return result, resent
                for again in resent:
                    window.add(again)
            for _ in window.drain():  # waited out
                pass
            if failed is not None:
                result = replace(lost, error=failed, outputs={})
                if not is_state_lost(failed):
                    break
        return result, [self._resend(pos) for pos in after]

    def _resend(self, position: int, replay_to: int = 0) -> Ticket:
        return self._submit(self._sent[position - self._first], position, replay_to)


def _first_error(results: Iterator[Result]) -> TierflowError | None:
    """A replayed chunk's answer is not kept; its failure ends the replay (the results
    after it are left to settle)."""
    return next((result.error for result in results if result.error is not None), None)


def _chunk_done(chunk: tuple[T, int, Ticket]) -> bool:
    return chunk[2].done()


def _failed(result: Result, error: StateLostError) -> Result:
    return replace(result, error=error, outputs={})


def _failed_ticket(position: int, error: StateLostError) -> Ticket:
    started = time.perf_counter()
    result = Result(f"session-{position}", error=error, ms={"total": 0.0, "device": 0.0})
    return Ticket(result.id, started, 0.0, result=result)
