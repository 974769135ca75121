"""Session state on the tier that made it: each stateful segment's state, kept per session.

[Note: session state on a tier]
A stateful segment owns state pairs ([Note: state pairs] in tierflow/state/pairs.py): an
input fed with what the segment output on the session's previous request (a decoder's KV
cache, a streaming model's recurrent state). The tier running the segment keeps that
output per session here, and feeds it back on the session's next request; it never
crosses a link. A request names its session and its ``position``: the steps already in
the session's state (tokens for a decoder, chunks for a streaming model).

* A session belongs to its owner: the caller that made it, or the device an edge vouches
  for within the edge's identity ([Note: who a caller is] in tierflow/transport/callers.py).
  State is kept per (owner, session id); a session id is 1 to ``MAX_SESSION_BYTES`` bytes.
  Another owner's session with the same id is simply not there for a caller: naming it
  reads, overwrites and resets nothing of it.
* Position 0 starts the session afresh (whatever was kept for it is dropped): a growing
  state starts empty along its growing axis, a fixed one with the value the request
  carries (``initial_state``: the first row of ``run --session``'s IN.npz) or zeros.
* At a later position a growing state is cut back to ``position`` along its growing axis
  first: that is how tokens a draft proposed and the model rejected leave every tier's KV
  cache. A fixed state must have taken exactly ``position`` steps.
* A state that is not here at that position (the session was evicted, was idle longer
  than ``idle_s``, the tier restarted, or it never existed for this owner) is a
  :class:`~tierflow.errors.StateLostError`, STATE_LOST on the wire, always in the same
  words and without the steps held (:meth:`SessionStates.lost`): the answer tells a caller
  nothing about other callers' sessions. The device then replays the session from
  position 0 with what it holds (a decoder's tokens so far, a stream's chunks), so a lost
  state costs time, never a wrong answer ([Note: replaying a session] in
  device/generation.py).
* A session belongs to one plan; naming it with another plan is a
  :class:`~tierflow.errors.StateError`, as is a session whose state alone would not fit
  the budget or the owner's share.

The state of all sessions together is bounded by ``budget`` bytes (``--state-budget``,
by default ``DEFAULT_MEMORY_SHARE`` of the machine's memory: :func:`default_state_budget`).
Everything a session holds counts: its arrays, its id and owner's name, and
``SESSION_OVERHEAD`` bytes for the rest. Each owner has a share of it: ``share`` bytes
(``--state-share``, then also a cap an owner's sessions never pass together), or else
an equal split of the budget among the owners holding state. When the budget is passed,
sessions are evicted least recently used first, but first from owners over their share,
then from those over an equal split: one caller flooding the tier with sessions evicts
its own, not another's. A session with a request waiting or running here is held
(:meth:`SessionStates.hold`), and so is one a replay is rebuilding (its requests say up
to which position: ``replay_to``) until the replay gets there, for ``PIN_S`` at most; a
held session is evicted only when nothing else is left, so a replay under pressure
completes. Requests of a session run one at a time
and in order on every tier ([Note: a stream's requests run at once] in
tierflow/runtime/streams.py), so a session's state is never used by two steps at once.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tierflow.errors import InputError, StateError, StateLostError
from tierflow.state.spec import StateSpec
from tierflow.units import format_size

logger = logging.getLogger(__name__)

#: Longest session id, in bytes (UTF-8).
MAX_SESSION_BYTES = 128
#: Bytes a kept session costs beyond its arrays and names (its entries and objects).
SESSION_OVERHEAD = 512
#: The share of this machine's memory a tier keeps for session state by default.
DEFAULT_MEMORY_SHARE = 0.25
#: Seconds a replay's session is held at most without getting to its end (a device that
#: went away mid-replay does not hold it longer).
PIN_S = 30.0
#: Where cgroup v2 says how much memory this process may use.
_CGROUP_LIMIT = Path("/sys/fs/cgroup/memory.max")


def machine_memory() -> int:
    """Bytes of memory this process may use: the machine's, or its cgroup's limit if lower."""
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # not POSIX: assume a small machine
        total = 4 << 30
    try:
        limit = _CGROUP_LIMIT.read_text().strip()
    except OSError:
        return int(total)
    return min(int(total), int(limit)) if limit.isdigit() else int(total)


def default_state_budget() -> int:
    """``DEFAULT_MEMORY_SHARE`` of :func:`machine_memory`: ``--state-budget``'s default."""
    return int(machine_memory() * DEFAULT_MEMORY_SHARE)


def describe_state_budget(budget: int | None, share: int | None) -> str:
    """One line saying how much session state a tier keeps (``budget`` bytes, None: no
    bound) and each owner's share of it (``share``, None: an equal split)."""
    if budget is None:
        kept = "no bound on session state"
    else:
        kept = f"at most {format_size(budget)}"
        memory = machine_memory()
        if budget == int(memory * DEFAULT_MEMORY_SHARE):
            kept += f" ({DEFAULT_MEMORY_SHARE:.0%} of {format_size(memory)} of memory)"
    if share is not None:
        return f"{kept}, at most {format_size(share)} for each caller"
    return f"{kept}, shared equally among the callers holding state when full"


def check_session_id(session: str) -> None:
    """Raise an :class:`InputError` unless ``session`` is 1 to ``MAX_SESSION_BYTES`` bytes."""
    size = len(session.encode())
    if not 0 < size <= MAX_SESSION_BYTES:
        raise InputError(f"a session id must be 1 to {MAX_SESSION_BYTES} bytes (UTF-8), got {size}")


@dataclass
class _Kept:
    owner: str
    session: str
    plan_id: str
    position: int
    values: dict[str, np.ndarray]  # by state input name: what the next step is fed
    used: float
    nbytes: int = field(init=False)

    def __post_init__(self) -> None:
        names = len(self.owner.encode()) + len(self.session.encode())
        arrays = sum(int(v.nbytes) for v in self.values.values())
        self.nbytes = arrays + names + SESSION_OVERHEAD


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


Key = tuple[str, str]  # (owner, session id)


class SessionStates:
    """The session state one tier keeps ([Note: session state on a tier]); thread-safe.

    ``budget``: bytes kept at most over all sessions (None: no bound); ``share``: bytes
    each owner may keep (None: an equal split of the budget among the owners holding
    state, applied when the budget is passed); ``idle_s``: seconds a session is kept
    without a request. ``owner`` names whose session it is ("": the process's own).
    """

    def __init__(
        self,
        tier: str,
        *,
        budget: int | None = None,
        share: int | None = None,
        idle_s: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.tier = tier
        self.budget = budget
        self.share = share
        self.idle_s = idle_s
        self._clock = clock
        self._kept: OrderedDict[Key, _Kept] = OrderedDict()  # least recently used first
        self._owned: dict[str, list[int]] = {}  # owner -> [sessions, bytes]
        self._total = 0
        self._held: dict[Key, int] = {}  # sessions with requests waiting here: evicted last
        self._pinned: dict[Key, float] = {}  # sessions a replay rebuilds, until when
        self._lock = threading.Lock()
        self.evicted = 0

    @property
    def nbytes(self) -> int:
        """Bytes of state held now, all sessions together (everything counted)."""
        with self._lock:
            return self._total

    def __len__(self) -> int:
        with self._lock:
            return len(self._kept)

    def by_owner(self) -> dict[str, tuple[int, int]]:
        """Sessions and bytes held now, by owner (for logs and metrics)."""
        with self._lock:
            return {owner: (count, nbytes) for owner, (count, nbytes) in self._owned.items()}

    def held(self) -> list[Key]:
        """(owner, session id) of every session held, least recently used first."""
        with self._lock:
            return list(self._kept)

    def position(self, session: str, owner: str | None = None) -> int | None:
        """The steps kept for ``owner``'s ``session`` (None: nothing kept). ``owner`` None:
        whichever owner holds a session of that id (tests and tools; the first found)."""
        with self._lock:
            for (holder, name), kept in self._kept.items():
                if name == session and (owner is None or holder == owner):
                    return kept.position
            return None

    def lost(self, session: str) -> StateLostError:
        """What a request finds when no state of ``session`` is here at its position: the
        same words whatever the reason, and whoever else holds that id."""
        return StateLostError(
            f"the {self.tier} holds no state for session {session!r} at the request's "
            f"position (never started, evicted, idle for over {self.idle_s:g} s, or the "
            f"{self.tier} restarted)"
        )

    def inputs(
        self,
        session: str,
        plan_id: str,
        position: int,
        specs: Sequence[StateSpec],
        given: Mapping[str, np.ndarray] | None = None,
        *,
        owner: str = "",
    ) -> dict[str, np.ndarray]:
        """The state inputs of ``owner``'s ``session`` at ``position``, by state input name."""
        if position < 0:
            raise StateError(f"session {session!r}: position {position} is negative")
        key = (owner, session)
        if position == 0:
            with self._lock:
                self._pop(key)  # a fresh start
            given = given or {}
            return {spec.input: initial_value(spec, given.get(spec.input)) for spec in specs}
        now = self._clock()
        with self._lock:
            self._expire(now)
            kept = self._kept.get(key)
            if kept is None:
                raise self.lost(session)
            if kept.plan_id != plan_id:
                raise StateError(
                    f"session {session!r} runs plan {kept.plan_id}; a request names it with "
                    f"plan {plan_id}: a session id is one plan's"
                )
            kept.used = now
            self._kept.move_to_end(key)
            values = dict(kept.values)
            held = kept.position
        out: dict[str, np.ndarray] = {}
        for spec in specs:
            value = values[spec.input]
            if spec.grows is None:
                if held != position:
                    raise self.lost(session)
                out[spec.input] = value
                continue
            if value.shape[spec.grows] < position:
                raise self.lost(session)
            if value.shape[spec.grows] > position:  # roll back what the session did not keep
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
        *,
        owner: str = "",
        replay_to: int = 0,
    ) -> int:
        """Keep ``outputs`` (by state input name) as ``owner``'s ``session``'s state after the
        step at ``position``; return the new position (a growing state's length, else one
        step on). ``replay_to``: the step is a replay's, which rebuilds the session up to
        that position; the session is held until it gets there (for ``PIN_S`` at most)."""
        growing = [outputs[s.input].shape[s.grows] for s in specs if s.grows is not None]
        after = growing[0] if growing else position + 1
        values = {s.input: outputs[s.input] for s in specs}
        kept = _Kept(owner, session, plan_id, after, values, self._clock())
        key = (owner, session)
        for limit, flag in ((self.budget, "--state-budget"), (self.share, "--state-share")):
            if limit is not None and kept.nbytes > limit:
                with self._lock:
                    self._pop(key)
                raise StateError(
                    f"session {session!r} needs {format_size(kept.nbytes)} of state on the "
                    f"{self.tier}, more than {flag} {format_size(limit)}"
                )
        with self._lock:
            self._pop(key)
            self._put(key, kept)
            if replay_to > after:
                self._pinned[key] = kept.used + PIN_S
            self._expire(kept.used)
            self._make_room(key)
        return after

    def hold(self, session: str, owner: str = "") -> Callable[[], None]:
        """Mark ``owner``'s ``session`` as having a request waiting or running here, until
        the returned function is called: a held session is evicted only when no other is
        left to evict, so a session whose requests follow one another (a stream, a
        replay: [Note: replaying a session] in device/generation.py) keeps its
        state from one to the next under pressure."""
        key = (owner, session)
        with self._lock:
            self._held[key] = self._held.get(key, 0) + 1
        released = False

        def release() -> None:
            nonlocal released
            if released:
                return
            released = True
            with self._lock:
                count = self._held.pop(key) - 1
                if count:
                    self._held[key] = count

        return release

    def drop(self, session: str, owner: str | None = None) -> None:
        """Forget ``owner``'s ``session`` (``owner`` None: every owner's of that id)."""
        with self._lock:
            for key in [k for k in self._kept if k[1] == session]:
                if owner is None or key[0] == owner:
                    self._pop(key)

    # ------------------------------------------------------------------ bookkeeping
    # All below: call with the lock held.

    def _put(self, key: Key, kept: _Kept) -> None:
        self._kept[key] = kept
        owned = self._owned.setdefault(kept.owner, [0, 0])
        owned[0] += 1
        owned[1] += kept.nbytes
        self._total += kept.nbytes

    def _pop(self, key: Key) -> _Kept | None:
        self._pinned.pop(key, None)
        kept = self._kept.pop(key, None)
        if kept is not None:
            owned = self._owned[kept.owner]
            owned[0] -= 1
            owned[1] -= kept.nbytes
            if owned[0] == 0:
                del self._owned[kept.owner]
            self._total -= kept.nbytes
        return kept

    def _evict(self, key: Key, why: str) -> None:
        kept = self._pop(key)
        assert kept is not None
        self.evicted += 1
        logger.info("[%s] session %s of %s evicted: %s", self.tier, key[1], key[0], why)

    def _expire(self, now: float) -> None:
        """Forget sessions idle longer than ``idle_s``."""
        while self._kept:
            key, kept = next(iter(self._kept.items()))
            if now - kept.used <= self.idle_s:
                return
            self._pop(key)
            self.evicted += 1
            logger.info(
                "[%s] session %s of %s dropped: idle for %.0f s",
                self.tier,
                key[1],
                key[0],
                now - kept.used,
            )

    def _make_room(self, keep: Key) -> None:
        """Evict sessions (not ``keep``) until ``keep``'s owner is within ``share`` and all
        are within the budget: least recently used first, from owners over their share
        first, then from those over an equal split, then any; sessions held (a request of
        theirs waiting here) only when no other is left to evict."""
        for spare_held in (True, False):
            if self.share is not None:
                mine = (lambda owner: owner == keep[0], self.share, "--state-share")
                self._trim(keep, *mine, spare_held)
            if self.budget is None or self._total <= self.budget:
                continue
            equal = self.budget // max(len(self._owned), 1)
            for share in (self.share, equal, 0):
                if share is not None:
                    self._trim(keep, lambda owner: True, share, "--state-budget", spare_held)
                    if self._total <= self.budget:
                        break

    def _trim(
        self, keep: Key, whose: Callable[[str], bool], share: int, why: str, spare_held: bool
    ) -> None:
        """Evict, least recently used first, sessions of owners chosen by ``whose`` holding
        more than ``share`` bytes, until they hold no more (or, for the budget, until the
        budget holds); with ``spare_held``, not the sessions held or pinned by a replay."""
        now = self._clock()
        for key in list(self._kept):
            if why == "--state-budget" and self._total <= (self.budget or 0):
                return
            owner = key[0]
            if key == keep or not whose(owner) or self._owned[owner][1] <= share:
                continue
            if spare_held and (key in self._held or self._pinned.get(key, 0.0) > now):
                continue
            self._evict(key, why)
