"""How a tier reads each stream's requests and runs them: at once, a session's in order.

:class:`StreamReader` serves one ``Infer`` stream for the
:class:`~tierflow.runtime.service.TierService`; :class:`SessionOrder` keeps the requests of
each session in order; :class:`Watched` is what the service's watchdog closes once idle.

[Note: a stream's requests run at once]
A stream's requests are read as soon as they arrive and run side by side, up to
``workers`` at once on the tier (``serve --workers``), each answered when it is done:
replies are matched to requests by id, so they need not keep the order of the requests.
The edge sends every device's requests to the cloud on one stream, so a cloud that ran a
stream's requests one after the other would make every device behind an edge queue.
Reading and running are one thread's work, handed on: the thread that reads a request
first hands the reading to another thread of the service's pool, then runs the request
itself and writes its reply. A request so waits for no thread hand-over on its way
through the tier (each costs 0.03-0.1 ms on a small machine, as much as the codec and
compute of a 100 KB feature), and the stream's next request is read while it runs. When
``workers`` requests are running already, a request waits for one of them to finish.
The requests of one session ([Note: session state on a tier] in tierflow/runtime/state.py)
run one at a time, in the order they were read (:class:`SessionOrder`): each continues the
state the one before left, and an edge passes them on in that order.
Every request read is counted in flight at once, so a stopping tier ([Note: stopping a
tier] in tierflow/runtime/server.py) answers every request sent before it began to stop.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterator
from typing import TYPE_CHECKING, Protocol

import grpc

from tierflow.errors import CodecError, TransportError
from tierflow.link.emulation import ShapedQueue
from tierflow.rpc import tier_pb2
from tierflow.runtime.replies import StreamReplies
from tierflow.transport.wire import Undecodable, error_to_proto

if TYPE_CHECKING:
    from tierflow.runtime.service import TierService

logger = logging.getLogger(__name__)


class Watched(Protocol):
    """A stream the watchdog closes once it is idle ([Note: stream admission])."""

    context: grpc.ServicerContext
    on_finish: Callable[[], None] | None

    def idle_for(self, now: float) -> float:
        """Seconds the stream has had nothing in flight and sent nothing (0: busy)."""


class ProbeActivity:
    """When a probe stream last sent a message, for the idle watchdog."""

    def __init__(self, context: grpc.ServicerContext) -> None:
        self.context = context
        self.on_finish: Callable[[], None] | None = None
        self._active = time.monotonic()

    def counted(
        self, messages: Iterator[tier_pb2.ProbeMessage | Undecodable]
    ) -> Iterator[tier_pb2.ProbeMessage | Undecodable]:
        for message in messages:
            self._active = time.monotonic()
            yield message

    def idle_for(self, now: float) -> float:
        return now - self._active


def _nothing() -> None:
    pass


class SessionOrder:
    """Runs each session's requests one at a time, in the order they were read.

    A request of a session that has one running waits in the session's queue, and the
    thread running the one before takes it along ([Note: a stream's requests run at
    once]). Requests of other sessions, and those of no session, do not wait for it.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting: dict[Hashable, deque[Callable[[], None]]] = {}

    def run(self, session: Hashable, work: Callable[[], None]) -> None:
        """Run ``work`` for ``session`` (its key: the owner's names and the session id)."""
        with self._lock:
            queue = self._waiting.get(session)
            if queue is not None:
                queue.append(work)
                return
            self._waiting[session] = deque()
        while True:
            try:
                work()
            except Exception:  # a bug: the session's later requests must still run
                logger.exception("a request of session %s failed", session)
            with self._lock:
                queue = self._waiting[session]
                if not queue:
                    del self._waiting[session]
                    return
                work = queue.popleft()


class StreamReader:
    """Reads one stream's requests and runs each ([Note: a stream's requests run at once]).

    The thread in :meth:`read` takes the next request, hands the reading on to a pool
    thread, and runs the request. ``replies`` takes each reply (a :class:`StreamReplies`,
    or a :class:`~tierflow.link.emulation.ShapedQueue` for an emulated reply link);
    ``finish`` is called once, when the stream has ended and every reply is out.
    """

    def __init__(
        self,
        service: TierService,
        requests: Iterator[tier_pb2.Request | Undecodable],
        context: grpc.ServicerContext,
        replies: StreamReplies | ShapedQueue[tier_pb2.Reply],
        finish: Callable[[], None],
        caller: str = "local",
    ) -> None:
        self.service = service
        self.caller = caller
        self.requests = requests
        self.context = context
        self.replies = replies
        self._finish = finish
        self._lock = threading.Lock()
        self._open = 0  # requests read and not yet answered
        self._ended = False  # no more requests will be read
        self._finished = False
        self._active = time.monotonic()  # when a request was last read or answered
        self.on_finish: Callable[[], None] | None = None
        shaped = isinstance(replies, ShapedQueue) and replies.shaper is not None
        self._shaped = shaped and replies.shaper.spec is not None  # type: ignore[union-attr]

    def start(self) -> None:
        """Read (and run) on a pool thread; for a caller that must return at once."""
        if not self._submit(self.read):
            self._end()

    def read(self) -> None:
        """Read one request, hand the reading on, and run it (see the class)."""
        try:
            request = next(self.requests)
        except StopIteration:
            self._end()
            return
        except grpc.RpcError:  # the client went away; its replies have nowhere to go
            self._end()
            return
        except Exception:
            logger.exception("[%s] reading a stream failed", self.service.tier)
            self._end()
            return
        received = time.perf_counter()
        with self._lock:
            self._open += 1
            self._active = time.monotonic()
        if isinstance(request, Undecodable):  # see tierflow.transport.wire.add_tier_servicer
            logger.warning(
                "[%s] %s from %s", self.service.tier, request.message, self.context.peer()
            )
            self._submit(self.read)
            self._put(self.service.error_reply("", CodecError(request.message)), own=True)
            self._done()
            return
        refusal = self.service.admit_request()
        if not self._submit(self.read):  # the pool is shut down: the tier is stopping
            refusal = refusal or error_to_proto(
                TransportError(f"the {self.service.tier} is stopping"), self.service.tier
            )
            self._end()
        if refusal is not None:
            refused = tier_pb2.Reply(id=request.id, plan_id=self.service.plan_id, error=refusal)
            self._reply(refused, received, own=True)
            return
        if request.session:  # [Note: a stream's requests run at once]: a session's in order
            key = (self.caller, request.on_behalf_of, request.session)
            release = self.service.hold(request, self.caller)
            self.service.order.run(key, lambda: self._run(request, received, release))
        else:
            self._run(request, received)

    def _run(
        self, request: tier_pb2.Request, received: float, release: Callable[[], None] = _nothing
    ) -> None:
        try:
            with self.service._running:
                reply = self.service.handle(
                    request,
                    received,
                    lambda later: self._reply(later, received, own=False),
                    self.caller,
                )
        finally:
            release()  # this tier's step of the session is done (its state kept)
        if reply is not None:
            self._reply(reply, received, own=True)

    def _reply(self, reply: tier_pb2.Reply, received: float, *, own: bool) -> None:
        """Send a request's one reply: ``own`` from the thread that ran it ([Note: slow
        readers] in tierflow/runtime/replies.py)."""
        service = self.service
        if service.metrics is not None:
            service.metrics.observe_latency(received)
            service.metrics.observe(reply, service.down_link, reply.ByteSize())
        self._put(reply, own=own)
        service.answered()
        self._done()

    def _put(self, reply: tier_pb2.Reply, *, own: bool) -> None:
        if isinstance(self.replies, StreamReplies):
            self.replies.put(reply, own=own)
        else:
            self.replies.put(reply, reply.ByteSize() if self._shaped else 0)

    def _submit(self, task: Callable[[], None]) -> bool:
        return self.service.pool.submit(task)  # False: the pool is shut down

    def _end(self) -> None:
        with self._lock:
            self._ended = True
        self._done(read=False)

    def idle_for(self, now: float) -> float:
        """Seconds the stream has had nothing in flight and sent nothing (0: busy)."""
        with self._lock:
            return 0.0 if self._open or self._ended else now - self._active

    def _done(self, read: bool = True) -> None:
        """One request answered (``read``) or the reading ended: finish if both are over."""
        with self._lock:
            if read:
                self._open -= 1
                self._active = time.monotonic()
            if not self._ended or self._open > 0 or self._finished:
                return
            self._finished = True
        if self.on_finish is not None:
            self.on_finish()
        with contextlib.suppress(Exception):
            if isinstance(self.replies, StreamReplies):
                self.replies.close()
                self.service._unwatch(self.replies)
            self._finish()
