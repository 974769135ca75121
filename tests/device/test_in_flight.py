"""The device's ordered in-flight window (device/in_flight.py), with futures as requests."""

from __future__ import annotations

from concurrent.futures import Future

import pytest

from tierflow.device.in_flight import InFlight
from tierflow.errors import UsageError


def _window(size: int, log: list[str]) -> InFlight[Future[str], str]:
    def settle(future: Future[str]) -> str:
        if not future.done():  # the caller waits for the oldest: answer it now
            future.set_result(f"waited-{len(log)}")
        log.append(future.result())
        return future.result()

    return InFlight(size, settle, Future.done)


def test_at_most_size_are_in_flight_and_results_come_in_order() -> None:
    log: list[str] = []
    window = _window(3, log)
    sent: list[Future[str]] = []
    seen_in_flight = []

    def send(i: int) -> Future[str]:
        seen_in_flight.append(len(window))
        future: Future[str] = Future()
        sent.append(future)
        return future

    results = list(window.stream(range(7), send))
    assert max(seen_in_flight) == 2  # room is made before each send: at most 3 after it
    assert len(results) == 7 and results == log
    assert len(window) == 0


def test_an_answer_already_there_is_taken_once_those_before_it_are() -> None:
    log: list[str] = []
    window = _window(4, log)
    first: Future[str] = Future()
    second: Future[str] = Future()
    second.set_result("second")
    window.add(first)
    window.add(second)
    assert list(window.ready()) == []  # the oldest is not answered: nothing comes out
    first.set_result("first")
    assert list(window.ready()) == ["first", "second"]


def test_take_removes_the_rest_unsettled_in_order() -> None:
    window = _window(4, [])
    futures: list[Future[str]] = [Future() for _ in range(3)]
    for future in futures:
        window.add(future)
    assert window.take() == futures and len(window) == 0


def test_a_window_of_less_than_one_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="at least 1"):
        _window(0, [])
