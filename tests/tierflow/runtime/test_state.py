"""A tier's session state ([Note: session state on a tier]): fresh starts, roll-backs, losses."""

from __future__ import annotations

import numpy as np
import pytest

from tierflow.errors import StateError, StateLostError
from tierflow.runtime.state import SessionStates, initial_value
from tierflow.state_spec import StateSpec

KV = StateSpec("past.0", "present.0", "float32", (1, 2, None, 4), grows=2)
RNN = StateSpec("state", "stateN", "float32", (2, None, 3))


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def kv(length: int, fill: float = 1.0) -> np.ndarray:
    return np.full((1, 2, length, 4), fill, dtype=np.float32)


def test_a_session_starts_empty_along_its_growing_axis_and_from_the_given_fixed_state() -> None:
    states = SessionStates("edge")
    given = np.ones((2, 1, 3), np.float32)
    first = states.inputs("s", "p1", 0, [KV, RNN], {"state": given})
    assert first["past.0"].shape == (1, 2, 0, 4)
    np.testing.assert_array_equal(first["state"], given)
    assert initial_value(RNN).shape == (2, 1, 3) and not initial_value(RNN).any()


def test_a_growing_state_is_cut_back_to_the_position_a_request_continues_from() -> None:
    states = SessionStates("cloud")
    assert states.commit("s", "p1", 0, [KV], {"past.0": kv(7)}) == 7
    assert states.inputs("s", "p1", 7, [KV])["past.0"].shape[2] == 7
    # Three drafted tokens were rejected: the next request continues from 4.
    rolled = states.inputs("s", "p1", 4, [KV])["past.0"]
    assert rolled.shape == (1, 2, 4, 4) and rolled.flags.c_contiguous
    with pytest.raises(StateLostError, match="holds 7 steps"):
        states.inputs("s", "p1", 9, [KV])


def test_a_fixed_state_must_be_at_the_requests_step() -> None:
    states = SessionStates("edge")
    after = states.commit("mic", "p1", 0, [RNN], {"state": np.zeros((2, 1, 3), np.float32)})
    assert after == 1
    states.inputs("mic", "p1", 1, [RNN])
    with pytest.raises(StateLostError, match="at step 1"):
        states.inputs("mic", "p1", 2, [RNN])


def test_a_session_unknown_here_is_lost_and_one_of_another_plan_is_refused() -> None:
    states = SessionStates("edge")
    with pytest.raises(StateLostError, match="holds no state for session 'x'"):
        states.inputs("x", "p1", 3, [KV])
    states.commit("x", "p1", 0, [KV], {"past.0": kv(3)})
    with pytest.raises(StateError, match="runs plan p1; a request names it with plan p2"):
        states.inputs("x", "p2", 3, [KV])
    # Position 0 starts afresh, whatever the plan.
    assert states.inputs("x", "p2", 0, [KV])["past.0"].shape[2] == 0
    assert states.position("x") is None


def test_the_budget_evicts_the_least_recently_used_sessions() -> None:
    one = kv(8).nbytes
    states = SessionStates("edge", budget=2 * one)
    states.commit("a", "p", 0, [KV], {"past.0": kv(8)})
    states.commit("b", "p", 0, [KV], {"past.0": kv(8)})
    states.inputs("a", "p", 8, [KV])  # a is used again: b is now the oldest
    states.commit("c", "p", 0, [KV], {"past.0": kv(8)})
    assert states.position("b") is None and states.position("a") == 8
    assert states.nbytes <= 2 * one and states.evicted == 1
    with pytest.raises(StateError, match="more than --state-budget"):
        states.commit("huge", "p", 0, [KV], {"past.0": kv(100)})


def test_idle_sessions_are_dropped() -> None:
    clock = Clock()
    states = SessionStates("edge", idle_s=60.0, clock=clock)
    states.commit("old", "p", 0, [KV], {"past.0": kv(2)})
    clock.now += 30
    states.commit("new", "p", 0, [KV], {"past.0": kv(2)})
    clock.now += 45  # old idle 75 s, new 45 s
    with pytest.raises(StateLostError):
        states.inputs("old", "p", 2, [KV])
    assert states.inputs("new", "p", 2, [KV])["past.0"].shape[2] == 2
