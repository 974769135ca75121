"""Session state on the tier that made it: each stateful segment's state, kept per session.

[Note: session state on a tier]
A stateful segment owns state pairs ([Note: state pairs] in tierflow/state_pairs.py): an
input fed with what the segment output on the session's previous request (a decoder's KV
cache, a streaming model's recurrent state). The tier running the segment keeps that
output per session here, and feeds it back on the session's next request; it never
crosses a link. A request names its session and its ``position``: the steps already in
the session's state (tokens for a decoder, chunks for a streaming model).

* Position 0 starts the session afresh (whatever was kept for it is dropped): a growing
  state starts empty along its growing axis, a fixed one with the value the request
  carries (``initial_state``: the first row of ``run --session``'s IN.npz) or zeros.
* At a later position a growing state is cut back to ``position`` along its growing axis
  first: that is how tokens a draft proposed and the model rejected leave every tier's KV
  cache. A fixed state must have taken exactly ``position`` steps.
* A state that is not here at that position (the session was evicted, was idle longer
  than ``idle_s``, or the tier restarted) is a :class:`~tierflow.errors.StateLostError`,
  STATE_LOST on the wire: the device then replays the session from position 0 with what
  it holds (a decoder's tokens so far, a stream's chunks), so a lost state costs time,
  never a wrong answer ([Note: replaying a session] in tierflow/device/sessions.py).
* A session belongs to one plan; naming it with another plan is a
  :class:`~tierflow.errors.StateError`, as is a session whose state alone would not fit
  the budget.

The state of all sessions together is bounded by ``budget`` bytes (``--state-budget``):
the least recently used sessions are evicted first. Requests of a session run one at a
time and in order on every tier ([Note: a stream's requests run at once] in
tierflow/runtime/service.py), so a session's state is never used by two steps at once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from tierflow.errors import StateError, StateLostError
from tierflow.state_spec import StateSpec
from tierflow.units import format_size

logger = logging.getLogger(__name__)


@dataclass
class _Kept:
    plan_id: str
    position: int
    values: dict[str, np.ndarray]  # by state input name: what the next step is fed
    used: float
    nbytes: int = field(init=False)

    def __post_init__(self) -> None:
        self.nbytes = sum(int(v.nbytes) for v in self.values.values())


def initial_value(spec: StateSpec, given: np.ndarray | None = None) -> np.ndarray:
    """A session's first state: empty along a growing axis; ``given`` or zeros otherwise.

    Symbolic dimensions other than the growing one are 1 (one sequence at a time).
    """
    if given is not None and spec.grows is None:
        return np.ascontiguousarray(given, dtype=np.dtype(spec.dtype))
    dims = [
        0 if axis == spec.grows else (1 if d is None else d) for axis, d in enumerate(spec.shape)
    ]
    return np.zeros(dims, dtype=np.dtype(spec.dtype))


class SessionStates:
    """The session state one tier keeps ([Note: session state on a tier]); thread-safe.

    ``budget``: bytes kept at most over all sessions (None: no bound); ``idle_s``: seconds
    a session is kept without a request.
    """

    def __init__(
        self,
        tier: str,
        *,
        budget: int | None = None,
        idle_s: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.tier = tier
        self.budget = budget
        self.idle_s = idle_s
        self._clock = clock
        self._kept: OrderedDict[str, _Kept] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()
        self.evicted = 0

    @property
    def nbytes(self) -> int:
        """Bytes of state held now, all sessions together."""
        with self._lock:
            return sum(kept.nbytes for kept in self._kept.values())

    def __len__(self) -> int:
        with self._lock:
            return len(self._kept)

    def position(self, session: str) -> int | None:
        """The steps kept for ``session``, or None when nothing is kept for it."""
        with self._lock:
            kept = self._kept.get(session)
            return None if kept is None else kept.position

    def inputs(
        self,
        session: str,
        plan_id: str,
        position: int,
        specs: Sequence[StateSpec],
        given: Mapping[str, np.ndarray] | None = None,
    ) -> dict[str, np.ndarray]:
        """The state inputs of ``session``'s step at ``position``, by state input name."""
        if position < 0:
            raise StateError(f"session {session!r}: position {position} is negative")
        if position == 0:
            with self._lock:
                self._kept.pop(session, None)  # a fresh start
            given = given or {}
            return {spec.input: initial_value(spec, given.get(spec.input)) for spec in specs}
        now = self._clock()
        with self._lock:
            self._expire(now)
            kept = self._kept.get(session)
            if kept is None:
                raise StateLostError(
                    f"the {self.tier} holds no state for session {session!r} (evicted, idle "
                    f"for over {self.idle_s:g} s, or the {self.tier} restarted)"
                )
            if kept.plan_id != plan_id:
                raise StateError(
                    f"session {session!r} runs plan {kept.plan_id}; a request names it with "
                    f"plan {plan_id}: a session id is one plan's"
                )
            kept.used = now
            self._kept.move_to_end(session)
            values = dict(kept.values)
            held = kept.position
        out: dict[str, np.ndarray] = {}
        for spec in specs:
            value = values[spec.input]
            if spec.grows is None:
                if held != position:
                    raise StateLostError(
                        f"the {self.tier} holds session {session!r} at step {held}, the "
                        f"request continues from step {position}"
                    )
                out[spec.input] = value
                continue
            length = value.shape[spec.grows]
            if length < position:
                raise StateLostError(
                    f"the {self.tier} holds {length} steps of session {session!r}, the "
                    f"request continues from step {position}"
                )
            if length > position:  # roll back what the session did not keep
                cut = [slice(None)] * value.ndim
                cut[spec.grows] = slice(0, position)
                value = np.ascontiguousarray(value[tuple(cut)])
            out[spec.input] = value
        return out

    def commit(
        self,
        session: str,
        plan_id: str,
        position: int,
        specs: Sequence[StateSpec],
        outputs: Mapping[str, np.ndarray],
    ) -> int:
        """Keep ``outputs`` (by state input name) as ``session``'s state after the step at
        ``position``; return the new position (a growing state's length, else one step on)."""
        growing = [outputs[s.input].shape[s.grows] for s in specs if s.grows is not None]
        after = growing[0] if growing else position + 1
        kept = _Kept(plan_id, after, {s.input: outputs[s.input] for s in specs}, self._clock())
        if self.budget is not None and kept.nbytes > self.budget:
            with self._lock:
                self._kept.pop(session, None)
            raise StateError(
                f"session {session!r} needs {format_size(kept.nbytes)} of state on the "
                f"{self.tier}, more than --state-budget {format_size(self.budget)}"
            )
        with self._lock:
            self._kept.pop(session, None)
            self._kept[session] = kept
            self._expire(kept.used)
            self._make_room(session)
        return after

    def drop(self, session: str) -> None:
        with self._lock:
            self._kept.pop(session, None)

    def _expire(self, now: float) -> None:
        """Forget sessions idle longer than ``idle_s``; call with the lock held."""
        while self._kept:
            session, kept = next(iter(self._kept.items()))
            if now - kept.used <= self.idle_s:
                return
            del self._kept[session]
            self.evicted += 1
            logger.info(
                "[%s] session %s dropped: idle for %.0f s", self.tier, session, now - kept.used
            )

    def _make_room(self, keep: str) -> None:
        """Evict least recently used sessions (not ``keep``) until the budget holds."""
        if self.budget is None:
            return
        total = sum(kept.nbytes for kept in self._kept.values())
        for session in list(self._kept):
            if total <= self.budget:
                return
            if session == keep:
                continue
            total -= self._kept.pop(session).nbytes
            self.evicted += 1
            logger.info("[%s] session %s evicted: --state-budget", self.tier, session)
