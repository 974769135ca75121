"""Writing a stream's replies: one at a time, by the threads that may wait for its client.

[Note: slow readers]
A write waits while the client does not read its replies (HTTP/2 flow control). A client
that keeps sending requests but never reads would so hold whatever thread writes to it,
and on the edge that was once the one thread receiving all of the cloud's replies: every
device stalled. So only a thread that belongs to the stream waits for it: a thread that
ran one of the stream's requests writes its reply itself (``own=True``), and a reply made
anywhere else (on the edge, by the thread receiving the cloud's replies) is handed to the
stream's writer thread (started on first use, parked, never a worker) or queued behind
the write in progress. At most one thread per stream so waits: the others queue their
replies behind it and move on. A write that has waited ``reply_timeout`` seconds
(``serve --reply-timeout``, default 5) makes the service's watchdog cancel the stream,
which ends the waiting write; the stream's queued replies are dropped, since its client
can no longer receive them, and its place is given back ([Note: stream admission] in
``tierflow.runtime.admission``). tierflow's own clients read their replies at once
(``tierflow.transport.stream_client``), so they never meet the limit.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

import grpc

from tierflow.rpc import tier_pb2

#: Where a reply that comes later (from the next tier) goes.
Send = Callable[[tier_pb2.Reply], None]


class StreamReplies:
    """A stream's replies, written one at a time and in the order they are put.

    ``write`` sends one reply and returns once it is written (grpc's non-blocking handler
    form passes such a function). A reply put while another is being written is queued,
    and the thread writing takes it along ([Note: slow readers]).
    """

    def __init__(
        self,
        write: Callable[[tier_pb2.Reply], None],
        name: str,
        context: grpc.ServicerContext,
    ) -> None:
        self._write = write
        self._name = name
        self.context = context
        self.cancelled = False
        self._lock = threading.Condition()
        self._queue: deque[tier_pb2.Reply] = deque()
        self._writing = False  # some thread is writing, and takes the queue along
        self._handed = False  # the writer thread has a reply to take
        self._closed = False
        self._writer: threading.Thread | None = None
        #: When the write in progress began (monotonic), None while none is.
        self.write_started: float | None = None

    def put(self, reply: tier_pb2.Reply, *, own: bool) -> None:
        """Write ``reply`` now on this thread (``own``: it belongs to the stream), or hand
        it to the stream's writer thread; queue it behind a write in progress."""
        with self._lock:
            if self._closed:
                return  # the stream ended: the client cannot receive it
            if self._writing:
                self._queue.append(reply)
                return
            self._writing = True
            if not own:
                self._queue.append(reply)
                self._handed = True
                if self._writer is None:
                    self._writer = threading.Thread(
                        target=self._run_writer, name=self._name, daemon=True
                    )
                    self._writer.start()
                else:
                    self._lock.notify_all()
                return
        self._write_from(reply)

    def _run_writer(self) -> None:
        while True:
            with self._lock:
                while not self._handed and not self._closed:
                    self._lock.wait()
                if not self._handed:
                    return
                self._handed = False
                reply = self._queue.popleft()
            self._write_from(reply)

    def _write_from(self, reply: tier_pb2.Reply) -> None:
        """Write ``reply``, then what was queued meanwhile (this thread holds the writing)."""
        while True:
            self.write_started = time.monotonic()
            self._write(reply)
            with self._lock:
                self.write_started = None
                if not self._queue:
                    self._writing = False
                    self._lock.notify_all()
                    return
                reply = self._queue.popleft()

    def written(self) -> bool:
        """Whether every reply put so far has been written (or the stream has ended)."""
        with self._lock:
            return self._closed or not (self._writing or self._queue)

    def close(self) -> None:
        """Wait until the queued replies are written or the stream ended; stop the writer."""
        with self._lock:
            while (self._writing or self._queue) and self.context.is_active():
                self._lock.wait(0.5)
            self._closed = True
            self._queue.clear()
            self._handed = False  # what was handed to the writer is dropped with the rest
            self._lock.notify_all()
