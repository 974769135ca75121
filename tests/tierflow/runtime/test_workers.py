"""The tier's worker threads (WorkerPool): tasks run, threads are reused and bounded, a
failing task does not stop its thread, and a pool shut down runs nothing more; the worker
slots (WorkerSlots) bound the requests running and a thread lends its slot while it waits
([Note: a worker lent while a step queues])."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from tierflow.runtime.workers import WorkerPool, WorkerSlots, lent

WAIT_S = 10.0


def test_tasks_run_on_the_pools_threads_and_an_idle_one_takes_the_next() -> None:
    pool = WorkerPool(4, "test-work")
    names: list[str] = []
    done = threading.Event()

    def task() -> None:
        names.append(threading.current_thread().name)
        done.set()

    for _ in range(5):
        done.clear()
        assert pool.submit(task)
        assert done.wait(WAIT_S)
        ends = time.monotonic() + WAIT_S
        while pool._idle == 0 and time.monotonic() < ends:  # it parks just after the task
            threading.Event().wait(0.001)
    assert names == ["test-work-1"] * 5  # the first thread, never a new one
    pool.shutdown()


def test_tasks_beyond_the_thread_limit_wait_for_a_thread() -> None:
    pool = WorkerPool(2, "test-work")
    release = threading.Event()
    started = threading.Semaphore(0)
    finished = threading.Semaphore(0)

    def blocking() -> None:
        started.release()
        release.wait(WAIT_S)
        finished.release()

    for _ in range(3):
        pool.submit(blocking)
    assert started.acquire(timeout=WAIT_S) and started.acquire(timeout=WAIT_S)
    assert not started.acquire(timeout=0.05)  # the third waits: two threads at most
    assert pool._threads == 2
    release.set()
    for _ in range(3):
        assert finished.acquire(timeout=WAIT_S)
    pool.shutdown()


def test_a_failing_task_is_logged_and_its_thread_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    pool = WorkerPool(1, "test-work")
    done = threading.Event()

    def failing() -> None:
        raise RuntimeError("a bug")

    with caplog.at_level(logging.ERROR, logger="tierflow.runtime.workers"):
        pool.submit(failing)
        pool.submit(done.set)
        assert done.wait(WAIT_S)
    assert "a task on test-work-1 failed" in caplog.text
    pool.shutdown()


def test_a_pool_shut_down_refuses_tasks_and_drops_those_not_started() -> None:
    pool = WorkerPool(1, "test-work")
    release = threading.Event()
    running = threading.Event()
    ran: list[str] = []

    def first() -> None:
        running.set()
        release.wait(WAIT_S)
        ran.append("first")

    pool.submit(first)
    assert running.wait(WAIT_S)
    pool.submit(lambda: ran.append("queued"))
    pool.shutdown()
    assert not pool.submit(lambda: ran.append("late"))
    release.set()
    for thread in threading.enumerate():
        if thread.name == "test-work-1":
            thread.join(WAIT_S)
    assert ran == ["first"]  # the running task finished; the queued one was dropped


def test_a_slot_held_is_lent_while_its_thread_waits_and_taken_back_after() -> None:
    slots = WorkerSlots(1)
    lending = threading.Event()
    back = threading.Event()
    other_ran = threading.Event()
    order: list[str] = []

    def holder() -> None:
        with slots:
            with lent():
                lending.set()
                assert other_ran.wait(WAIT_S)  # another request ran on the slot meanwhile
            order.append("holder took its slot back")
            back.set()

    def other() -> None:
        assert lending.wait(WAIT_S)
        with slots:
            order.append("other ran")
            other_ran.set()

    threads = [threading.Thread(target=holder), threading.Thread(target=other)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT_S)
    assert back.is_set() and order == ["other ran", "holder took its slot back"]
    # One slot: nobody else holds it now.
    assert slots._slots.acquire(timeout=0)
    slots._slots.release()


def test_lent_outside_a_slot_changes_nothing() -> None:
    slots = WorkerSlots(1)
    with lent(), slots:  # this thread held no slot when it lent
        assert not slots._slots.acquire(timeout=0)
    assert slots._slots.acquire(timeout=0)
    slots._slots.release()
