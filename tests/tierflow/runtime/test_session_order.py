"""A session's requests run one at a time and in order on every tier (SessionOrder).

The threads of a real stream are stood in for by calls made from inside running work: a
request that arrives while its session's previous one runs is what such a call is, and
what happens to it is then fixed, not a race.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tierflow.runtime.session_order import SessionOrder


def test_a_sessions_request_waits_for_the_one_running_and_runs_after_it() -> None:
    order = SessionOrder()
    done: list[str] = []

    def first() -> None:
        order.run("s", lambda: done.append("second"))  # arrives meanwhile: queued
        order.run("s", lambda: done.append("third"))
        assert done == []  # neither ran inside the first
        done.append("first")

    order.run("s", first)
    assert done == ["first", "second", "third"]  # taken along by the same caller, in order


def test_other_sessions_and_no_session_do_not_wait() -> None:
    order = SessionOrder()
    done: list[str] = []

    def long_one() -> None:
        order.run("other", lambda: done.append("other"))  # runs at once, inline
        done.append("s")

    order.run("s", long_one)
    assert done == ["other", "s"]


def test_a_session_that_finished_starts_afresh() -> None:
    order = SessionOrder()
    done: list[int] = []
    for step in range(3):
        order.run("s", lambda step=step: done.append(step))
    assert done == [0, 1, 2] and order._waiting == {}


def test_work_queued_in_work_that_queues_more_keeps_the_order() -> None:
    order = SessionOrder()
    done: list[int] = []

    def step(n: int) -> Callable[[], None]:
        def work() -> None:
            if n < 4:
                order.run("s", step(n + 1))
            done.append(n)

        return work

    order.run("s", step(0))
    assert done == [0, 1, 2, 3, 4]


def test_work_that_raises_neither_drops_the_next_request_nor_stops_the_session(
    caplog: pytest.LogCaptureFixture,
) -> None:
    order = SessionOrder()
    done: list[str] = []

    def failing() -> None:
        order.run("s", lambda: done.append("queued"))
        raise RuntimeError("boom")

    with caplog.at_level("ERROR"):
        order.run("s", failing)  # logged: the session goes on
    order.run("s", lambda: done.append("later"))
    assert done == ["queued", "later"]
    assert any("session s" in r.getMessage() for r in caplog.records)
