"""A tier's session state ([Note: session state on a tier]): fresh starts, roll-backs, losses,
owners, budgets and shares."""

from __future__ import annotations

import numpy as np
import pytest

from tierflow.errors import InputError, StateError, StateLostError
from tierflow.options import RuntimeOptions
from tierflow.state.spec import StateSpec
from tierflow.state.store import (
    DEFAULT_MEMORY_SHARE,
    MAX_SESSION_BYTES,
    PIN_S,
    SESSION_OVERHEAD,
    SessionStates,
    check_session_id,
    default_state_budget,
    describe_state_budget,
    initial_value,
    machine_memory,
)

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
    with pytest.raises(StateLostError, match="holds no state for session 's'"):
        states.inputs("s", "p1", 9, [KV])


def test_a_fixed_state_must_be_at_the_requests_step() -> None:
    states = SessionStates("edge")
    after = states.commit("mic", "p1", 0, [RNN], {"state": np.zeros((2, 1, 3), np.float32)})
    assert after == 1
    states.inputs("mic", "p1", 1, [RNN])
    with pytest.raises(StateLostError, match="holds no state for session 'mic'"):
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
    one = kv(8).nbytes + len("a") + SESSION_OVERHEAD  # everything a session holds counts
    states = SessionStates("edge", budget=2 * one)
    states.commit("a", "p", 0, [KV], {"past.0": kv(8)})
    states.commit("b", "p", 0, [KV], {"past.0": kv(8)})
    assert states.nbytes == 2 * one
    states.inputs("a", "p", 8, [KV])  # a is used again: b is now the oldest
    states.commit("c", "p", 0, [KV], {"past.0": kv(8)})
    assert states.position("b") is None and states.position("a") == 8
    assert states.nbytes <= 2 * one and states.evicted == 1
    with pytest.raises(StateError, match="more than --state-budget"):
        states.commit("huge", "p", 0, [KV], {"past.0": kv(100)})


def test_a_sessions_id_and_owner_count_against_the_budget() -> None:
    """Issue 28, finding 3: 400 sessions with 1 MB ids once added 430 MB under a 1 MiB
    budget. Ids are bounded, and what they hold is counted."""
    states = SessionStates("edge", budget=64 << 10)
    name = "n" * MAX_SESSION_BYTES
    for i in range(400):
        states.commit(
            f"{i:03d}{name[3:]}",
            "p",
            0,
            [RNN],
            {"state": np.zeros((2, 1, 3), np.float32)},
            owner="peer:" + "x" * 900,
        )
    assert states.nbytes <= 64 << 10
    assert len(states) == (64 << 10) // (24 + MAX_SESSION_BYTES + 905 + SESSION_OVERHEAD)
    with pytest.raises(InputError, match="1 to 128 bytes"):
        check_session_id("é" * 65)  # 130 bytes in UTF-8
    with pytest.raises(InputError, match="1 to 128 bytes"):
        check_session_id("")
    check_session_id("s" * 128)


def test_a_session_belongs_to_its_owner() -> None:
    """Issue 28, finding 1: another owner naming the same session id reads, overwrites and
    resets nothing of it, and hears what a session that never existed answers."""
    states = SessionStates("cloud")
    states.commit("s", "p", 0, [KV], {"past.0": kv(5, 1.0)}, owner="token:alice")
    with pytest.raises(StateLostError) as theirs:  # read
        states.inputs("s", "p", 5, [KV], owner="token:mallory")
    with pytest.raises(StateLostError) as never:
        states.inputs("never", "p", 5, [KV], owner="token:mallory")
    assert str(theirs.value) == str(never.value).replace("'never'", "'s'")
    assert not any(ch.isdigit() for ch in str(theirs.value).split("idle for over")[0])
    # overwrite and reset: mallory's own session of that id, alice's untouched
    states.inputs("s", "p", 0, [KV], owner="token:mallory")
    states.commit("s", "p", 0, [KV], {"past.0": kv(2, 9.0)}, owner="token:mallory")
    mine = states.inputs("s", "p", 5, [KV], owner="token:alice")["past.0"]
    np.testing.assert_array_equal(mine, kv(5, 1.0))
    assert states.position("s", "token:mallory") == 2
    states.drop("s", "token:mallory")
    assert states.position("s", "token:alice") == 5
    # A step count held is never told: a short state and a long one read the same.
    with pytest.raises(StateLostError) as longer:
        states.inputs("s", "p", 9, [KV], owner="token:alice")
    assert str(longer.value) == str(theirs.value)


def test_a_flooding_owner_evicts_its_own_sessions_not_anothers() -> None:
    """Issue 28, finding 3: with a budget, eviction was global LRU, so one caller's flood
    of sessions evicted another's; now it takes from owners over their share first."""
    one = kv(8).nbytes + len("v0") + len("flood") + SESSION_OVERHEAD  # ids and owners alike
    states = SessionStates("edge", budget=10 * one)
    states.commit("v0", "p", 0, [KV], {"past.0": kv(8)}, owner="victm")
    for i in range(100):  # the flood: every session newer than the victim's
        states.commit(f"{i:02d}", "p", 0, [KV], {"past.0": kv(8)}, owner="flood")
    assert states.position("v0", "victm") == 8
    assert states.nbytes == 10 * one and states.by_owner()["flood"] == (9, 9 * one)
    # The victim's own sessions beyond half the budget (an equal split) are its to lose.
    for i in range(1, 9):
        states.commit(f"v{i}", "p", 0, [KV], {"past.0": kv(8)}, owner="victm")
    assert states.by_owner() == {"victm": (5, 5 * one), "flood": (5, 5 * one)}
    assert states.position("v0", "victm") is None  # its oldest went first, not the flood's


def test_an_explicit_share_caps_each_owner() -> None:
    one = kv(8).nbytes + len("a") + len("alice") + SESSION_OVERHEAD
    states = SessionStates("edge", budget=100 * one, share=3 * one)
    for name in "abcde":
        states.commit(name, "p", 0, [KV], {"past.0": kv(8)}, owner="alice")
    states.commit("x", "p", 0, [KV], {"past.0": kv(8)}, owner="bobby")
    assert states.by_owner() == {"alice": (3, 3 * one), "bobby": (1, one)}
    assert states.position("a", "alice") is None and states.position("e", "alice") == 8
    with pytest.raises(StateError, match="more than --state-share"):
        states.commit("big", "p", 0, [KV], {"past.0": kv(100)}, owner="bobby")


def test_the_default_budget_is_a_share_of_this_machines_memory() -> None:
    assert default_state_budget() == int(machine_memory() * DEFAULT_MEMORY_SHARE)
    assert 0 < default_state_budget() < machine_memory()
    defaults = RuntimeOptions()
    line = describe_state_budget(defaults.state_budget, defaults.state_share)
    assert f"{DEFAULT_MEMORY_SHARE:.0%} of" in line and "shared equally" in line


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


def test_a_held_or_replaying_session_is_evicted_last() -> None:
    """Issue 28, finding 4: a session whose next request waits here, or which a replay is
    rebuilding (until it gets there, for PIN_S at most), is spared while others are left."""
    clock = Clock()
    one = kv(8).nbytes + len("s0") + len("o0") + SESSION_OVERHEAD
    states = SessionStates("edge", budget=3 * one, clock=clock)
    release = states.hold("s0", "o0")  # a request of s0 waits here
    states.commit("s0", "p", 0, [KV], {"past.0": kv(8)}, owner="o0")
    states.commit("s1", "p", 0, [KV], {"past.0": kv(8)}, owner="o1", replay_to=20)  # 8 of 20
    for i in range(2, 9):  # everyone over an equal share: LRU but held ones
        states.commit(f"s{i}", "p", 0, [KV], {"past.0": kv(8)}, owner=f"o{i}")
    assert states.position("s0", "o0") == 8 and states.position("s1", "o1") == 8
    release()
    release()  # twice is once
    states.commit("s9", "p", 0, [KV], {"past.0": kv(8)}, owner="o9")
    assert states.position("s0", "o0") is None and states.position("s1", "o1") == 8
    clock.now += PIN_S + 1  # the replay never came back
    states.commit("sa", "p", 0, [KV], {"past.0": kv(8)}, owner="oa")
    assert states.position("s1", "o1") is None
    # Nothing else left: a held session is evicted too; the budget is a bound.
    both = [states.hold("sa", "oa"), states.hold("sb", "ob"), states.hold("sc", "oc")]
    for name in ("sb", "sc", "sd"):
        states.commit(name, "p", 0, [KV], {"past.0": kv(8)}, owner="o" + name[1])
    assert states.nbytes <= 3 * one and states.position("sd", "od") == 8
    for release in both:
        release()
