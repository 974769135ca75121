"""The threads a tier reads its streams and runs its requests on.

[Note: the tier's worker threads]
A tier hands each stream's reading from thread to thread ([Note: a stream's requests run
at once] in tierflow/runtime/streams.py), so it starts one task per request. The standard
``ThreadPoolExecutor`` makes a ``Future`` (with its own condition variable), a work item
and a semaphore round for each task, and sets the future when the task ends; a tier never
looks at those futures, and all that work holds the GIL while the request beside it is on
its way. :class:`WorkerPool` takes a task from a queue and runs it, nothing more. Its
threads start as tasks need them, up to ``max_threads``, and then stay, parked on the
queue. A task's exception is logged; the thread goes on with the next.

[Note: a worker lent while a step queues]
``--workers`` bounds the requests a tier runs at once (:class:`WorkerSlots`): each holds
a slot while it decodes, runs and encodes, so the cores are not shared among more
requests than that. A batch can only grow from the decode steps queued in the step
batcher ([Note: the step batcher] in tierflow/runtime/batching.py): if they held their
slots, no batch could exceed ``--workers`` (two, one per core, by default on a small
machine), and with one worker none would ever form. So a step lends its slot
(:func:`lent`) for its time in the batcher, queued or running, and takes one again
(waiting for it if need be) once it has its answer: every step that reaches the tier can
queue for a batch, whatever ``--workers``. The batcher bounds its own compute (one call
of a plan's segments at a time), and the decoding, encoding and unbatched requests around
it stay bounded by ``--workers``. The other limits do not change: the requests a tier
holds in flight (``--max-in-flight``), each step's deadline (a step whose deadline passes
in the queue fails alone) and each session's order (one step of a session in flight).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Callable, Iterator

logger = logging.getLogger(__name__)

#: The :class:`WorkerSlots` whose slot the current thread holds, if any.
_held = threading.local()


class WorkerSlots:
    """At most ``count`` requests run at once; a thread that holds a slot may lend it
    while it waits for work that needs no core ([Note: a worker lent while a step
    queues]). Use as a context manager around a request's run."""

    def __init__(self, count: int) -> None:
        self.count = count
        self._slots = threading.BoundedSemaphore(count)

    def __enter__(self) -> WorkerSlots:
        self._slots.acquire()
        _held.slots = self
        return self

    def __exit__(self, *exc: object) -> None:
        _held.slots = None
        self._slots.release()


@contextlib.contextmanager
def lent() -> Iterator[None]:
    """While the block runs, the slot this thread holds (if any) serves another request;
    it is taken back (waiting for one free) when the block ends."""
    slots: WorkerSlots | None = getattr(_held, "slots", None)
    if slots is None:
        yield
        return
    _held.slots = None
    slots._slots.release()
    try:
        yield
    finally:
        slots._slots.acquire()
        _held.slots = slots


class WorkerPool:
    """Runs submitted tasks on up to ``max_threads`` threads named ``name-N``."""

    def __init__(self, max_threads: int, name: str) -> None:
        self._max = max(1, max_threads)
        self._name = name
        self._tasks: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads = 0
        self._idle = 0  # threads parked on the queue that no submitted task has claimed
        self._closed = False

    def submit(self, task: Callable[[], None]) -> bool:
        """Run ``task`` on a pool thread; False (and nothing run) once :meth:`shutdown`."""
        with self._lock:
            if self._closed:
                return False
            if self._idle:
                self._idle -= 1
            elif self._threads < self._max:
                self._threads += 1
                thread = threading.Thread(
                    target=self._work, name=f"{self._name}-{self._threads}", daemon=True
                )
                thread.start()
            self._tasks.put(task)
        return True

    def _work(self) -> None:
        while (task := self._tasks.get()) is not None:
            try:
                task()
            except Exception:  # a bug in a task: the thread serves the next one
                logger.exception("a task on %s failed", threading.current_thread().name)
            with self._lock:
                self._idle += 1

    def shutdown(self) -> None:
        """Refuse new tasks, drop those not started and stop the threads once idle
        (running tasks finish)."""
        with self._lock:
            self._closed = True
            threads = self._threads
        while True:
            try:
                self._tasks.get_nowait()
            except queue.Empty:
                break
        for _ in range(threads):
            self._tasks.put(None)
