"""How a tier serves each ``Infer`` stream: its requests read and run at once, a session's
in order, its replies written as they finish.

:func:`serve_stream` serves an ``Infer`` call once the
:class:`~tierflow.runtime.service.TierService` has taken the stream's place: a
:class:`StreamReader` feeds the stream's requests to the
:class:`~tierflow.runtime.tier.Tier` and puts each reply on the stream ([Note: slow
readers] in tierflow/runtime/replies.py), the service's
:class:`~tierflow.runtime.watchdog.StreamWatchdog` watching both. :class:`ProbeActivity`
is what the watchdog reads of a probe stream.

[Note: a stream's requests run at once]
A stream's requests are read as soon as they arrive and run side by side, up to
``workers`` at once on the tier (``serve --workers``; a decode step queued for a batch
lends its worker: [Note: a worker lent while a step queues] in
tierflow/runtime/workers.py), each answered when it is done:
replies are matched to requests by id, so they need not keep the order of the requests.
The edge sends every device's requests to the cloud on one stream, so a cloud that ran a
stream's requests one after the other would make every device behind an edge queue.
Reading and running are one thread's work, handed on: the thread that reads a request
first hands the reading to another thread of the tier's pool, then runs the request
itself and writes its reply. A request so waits for no thread hand-over on its way
through the tier (each costs 0.03-0.1 ms on a small machine, as much as the codec and
compute of a 100 KB feature), and the stream's next request is read while it runs. When
``workers`` requests are running already, a request waits for one of them to finish.
The requests of one session ([Note: session state on a tier] in tierflow/state/store.py)
run one at a time, in the order they were read (:class:`SessionOrder` in
tierflow/runtime/session_order.py): each continues the state the one before left, and an
edge passes them on in that order.
Every request read is counted in flight at once, so a stopping tier ([Note: stopping a
tier] in tierflow/runtime/server.py) answers every request sent before it began to stop.

[Note: garbage on a stream]
A message that does not parse, or a request that names no plan the tier serves, is
garbage: it is answered at once with a typed error (CODEC, PLAN_MISMATCH), as every
message is, but it is not activity. Only a well-formed request keeps a stream from the
idle watchdog ([Note: stream admission] in tierflow/runtime/admission.py): 256 streams
sending 4 undecodable bytes every 5 s were once never idle, and held a host's every
place. A stream that sends :data:`GARBAGE_LIMIT` garbage messages in a row is closed
after answering the last of them (cancelled: its client sees CANCELLED), with one
warning counted (``garbage_stream``). Warnings about garbage are logged at most once per
peer every 10 s and each counted in the metrics ([Note: warnings about a peer] in
tierflow/transport/peer_warnings.py): one line a message once wrote 1,792 lines in 32 s.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable, Hashable, Iterator

import grpc

from tierflow.errors import CodecError, PlanError, TierflowError, TransportError
from tierflow.link.emulation import LinkShaper, ShapedQueue
from tierflow.rpc import tier_pb2
from tierflow.runtime.admission import peer_host
from tierflow.runtime.replies import StreamReplies
from tierflow.runtime.tier import Tier
from tierflow.runtime.watchdog import StreamWatchdog
from tierflow.transport.peer_warnings import WARNINGS
from tierflow.transport.wire import Undecodable, error_to_proto

logger = logging.getLogger(__name__)

#: Garbage messages in a row after which a stream is closed ([Note: garbage on a stream]).
GARBAGE_LIMIT = 4


def serve_stream(
    tier: Tier,
    watchdog: StreamWatchdog,
    requests: Iterator[tier_pb2.Request | Undecodable],
    context: grpc.ServicerContext,
    send_response: Callable[[tier_pb2.Reply | None], None] | None,
    caller: str,
) -> Iterator[tier_pb2.Reply] | None:
    """Serve one admitted ``Infer`` stream of ``caller`` on ``tier`` ([Note: a stream's
    requests run at once]).

    With ``send_response`` (grpc's non-blocking handler form) replies are written by
    the threads that make them ([Note: slow readers]); without it (a grpc that does
    not offer that form), or with an emulated reply link, they go through a queue
    that the returned generator (or one writer thread) drains.
    """
    spec = tier.options.links.get(tier.down_link)
    if send_response is None or spec is not None:
        shaper = LinkShaper(tier.down_link, spec)
        return _serve_queued(tier, watchdog, requests, context, shaper, send_response, caller)
    lock = threading.Lock()

    def write(reply: tier_pb2.Reply | None) -> None:
        with lock:  # grpc allows one message in flight per call
            try:
                send_response(reply)
            except Exception as exc:  # the reply is lost; the request still counts as done
                if reply is not None:  # expected when the device went away: one line
                    _reply_lost(tier.name, context, reply, exc)

    replies = StreamReplies(write, f"{tier.name}-replies", context)
    watchdog.watch(replies)

    def finish() -> None:
        watchdog.unwatch(replies)  # its reader is done
        write(None)

    reader = StreamReader(tier, requests, context, replies, finish=finish, caller=caller)
    watchdog.track(reader)
    reader.read()
    return None


def _serve_queued(
    tier: Tier,
    watchdog: StreamWatchdog,
    requests: Iterator[tier_pb2.Request | Undecodable],
    context: grpc.ServicerContext,
    shaper: LinkShaper,
    send_response: Callable[[tier_pb2.Reply | None], None] | None,
    caller: str,
) -> Iterator[tier_pb2.Reply] | None:
    """Replies through a queue, each leaving when the emulated reply link has carried
    it: the returned generator yields them to grpc, or (non-blocking form) this
    thread writes them."""
    queued: ShapedQueue[tier_pb2.Reply] = ShapedQueue(shaper)
    context.add_callback(queued.close)
    reader = StreamReader(tier, requests, context, queued, finish=queued.close, caller=caller)
    watchdog.track(reader)
    reader.start()
    if send_response is None:
        return _watched(tier.name, watchdog, queued.drain(), context)
    for reply in _watched(tier.name, watchdog, queued.drain(), context):
        try:
            send_response(reply)
        except Exception as exc:  # the reply is lost; the request still counts as done
            _reply_lost(tier.name, context, reply, exc)
    with contextlib.suppress(Exception):
        send_response(None)
    return None


def _watched(
    name: str,
    watchdog: StreamWatchdog,
    replies: Iterator[tier_pb2.Reply],
    context: grpc.ServicerContext,
) -> Iterator[tier_pb2.Reply]:
    """The queued replies, each write watched for a slow reader ([Note: slow readers])."""
    watched = StreamReplies(lambda reply: None, f"{name}-replies", context)
    watchdog.watch(watched)
    try:
        for reply in replies:
            watched.write_started = time.monotonic()
            yield reply
            watched.write_started = None
    finally:
        watchdog.unwatch(watched)


def _reply_lost(
    name: str, context: grpc.ServicerContext, reply: tier_pb2.Reply, exc: Exception
) -> None:
    """One (rate-limited) line for a reply its stream could not take ([Note: warnings
    about a peer] in tierflow/transport/peer_warnings.py)."""
    peer = context.peer()
    WARNINGS.warn(
        logger,
        name,
        "reply_not_delivered",
        peer_host(peer),
        "[%s] reply %s to %s not delivered: %r",
        name,
        reply.id,
        peer,
        exc,
    )


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
            if not isinstance(message, Undecodable):  # [Note: garbage on a stream]
                self._active = time.monotonic()
            yield message

    def idle_for(self, now: float) -> float:
        return now - self._active


def _nothing() -> None:
    pass


class StreamReader:
    """Reads one stream's requests and runs each on ``tier`` ([Note: a stream's requests run
    at once]).

    The thread in :meth:`read` takes the next request, hands the reading on to a pool
    thread, and runs the request. ``replies`` takes each reply (a :class:`StreamReplies`,
    or a :class:`~tierflow.link.emulation.ShapedQueue` for an emulated reply link);
    ``finish`` is called once, when the stream has ended and every reply is out.
    """

    def __init__(
        self,
        tier: Tier,
        requests: Iterator[tier_pb2.Request | Undecodable],
        context: grpc.ServicerContext,
        replies: StreamReplies | ShapedQueue[tier_pb2.Reply],
        finish: Callable[[], None],
        caller: str = "local",
    ) -> None:
        self.tier = tier
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
        self._garbage = 0  # garbage messages read in a row ([Note: garbage on a stream])
        self._plans = {plan.plan_id for plan in tier.plans.plans}
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
            logger.exception("[%s] reading a stream failed", self.tier.name)
            self._end()
            return
        received = time.perf_counter()
        garbage = self._garbage_in(request)
        closing = False
        with self._lock:
            self._open += 1
            if garbage is None:
                self._garbage = 0
                self._active = time.monotonic()
            else:
                self._garbage += 1
                closing = self._garbage >= GARBAGE_LIMIT
        if garbage is not None:
            self._answer_garbage(request, garbage, closing)
            return
        assert isinstance(request, tier_pb2.Request)  # Undecodable is garbage
        refusal = self.tier.admit_request()
        ordered: tuple[Hashable, Callable[[], None], bool] | None = None
        if refusal is None and request.session:
            # [Note: a stream's requests run at once]: a session's in order, its place
            # taken before the next request is read
            key = (self.caller, request.on_behalf_of, request.session)
            release = self.tier.hold(request, self.caller)
            work = functools.partial(self._run, request, received, release)
            ordered = (key, work, self.tier.order.enter(key, work))
        if not self._submit(self.read):  # the pool is shut down: the tier is stopping
            if ordered is None:  # one already in its session's order is answered as it runs
                refusal = refusal or error_to_proto(
                    TransportError(f"the {self.tier.name} is stopping"), self.tier.name
                )
            self._end()
        if refusal is not None:
            refused = tier_pb2.Reply(id=request.id, plan_id=self.tier.plan_id, error=refusal)
            self._reply(refused, received, own=True)
            return
        if ordered is None:
            self._run(request, received)
        elif ordered[2]:
            self.tier.order.drain(ordered[0], ordered[1])

    def _garbage_in(self, request: tier_pb2.Request | Undecodable) -> TierflowError | None:
        """Why ``request`` is garbage, as the error that answers it (None: well-formed)."""
        if isinstance(request, Undecodable):  # see tierflow.transport.wire.add_tier_servicer
            return CodecError(request.message)
        if request.plan_id not in self._plans:
            served = ", ".join(sorted(self._plans))
            return PlanError(
                f"the {self.tier.name} serves plans {served}, the request names plan "
                f"{request.plan_id[:64] or '(none)'}"
            )
        return None

    def _answer_garbage(
        self, request: tier_pb2.Request | Undecodable, error: TierflowError, closing: bool
    ) -> None:
        """Answer a garbage message; close the stream after the last one it may send
        ([Note: garbage on a stream])."""
        tier, peer = self.tier, self.context.peer()
        if isinstance(request, Undecodable):
            WARNINGS.warn(
                logger,
                tier.name,
                "undecodable",
                peer_host(peer),
                "[%s] %s from %s",
                tier.name,
                request.message,
                peer,
            )
        if not closing:
            self._submit(self.read)
        request_id = "" if isinstance(request, Undecodable) else request.id
        reply = tier.error_reply(request_id, error)
        if tier.metrics is not None:
            tier.metrics.observe(reply, tier.down_link, reply.ByteSize())
        self._put(reply, own=True)
        if closing:
            WARNINGS.warn(
                logger,
                tier.name,
                "garbage_stream",
                peer_host(peer),
                "[%s] stream from %s closed: %d messages in a row that were not requests "
                "for a plan served here (last: %s)",
                tier.name,
                peer,
                GARBAGE_LIMIT,
                error,
            )
            self.context.cancel()
            self._end()
        self._done(active=False)

    def _run(
        self, request: tier_pb2.Request, received: float, release: Callable[[], None] = _nothing
    ) -> None:
        try:
            with self.tier.running:
                reply = self.tier.handle(
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
        tier = self.tier
        if tier.metrics is not None:
            tier.metrics.observe_latency(received)
            tier.metrics.observe(reply, tier.down_link, reply.ByteSize())
        self._put(reply, own=own)
        tier.answered()
        self._done()

    def _put(self, reply: tier_pb2.Reply, *, own: bool) -> None:
        if isinstance(self.replies, StreamReplies):
            self.replies.put(reply, own=own)
        else:
            self.replies.put(reply, reply.ByteSize() if self._shaped else 0)

    def _submit(self, task: Callable[[], None]) -> bool:
        return self.tier.pool.submit(task)  # False: the pool is shut down

    def _end(self) -> None:
        with self._lock:
            self._ended = True
        self._done(read=False)

    def idle_for(self, now: float) -> float:
        """Seconds the stream has had nothing in flight and sent nothing (0: busy)."""
        with self._lock:
            return 0.0 if self._open or self._ended else now - self._active

    def _done(self, read: bool = True, active: bool = True) -> None:
        """One request answered (``read``; ``active``: a well-formed one) or the reading
        ended: finish if both are over."""
        with self._lock:
            if read:
                self._open -= 1
                if active:
                    self._active = time.monotonic()
            if not self._ended or self._open > 0 or self._finished:
                return
            self._finished = True
        if self.on_finish is not None:
            self.on_finish()
        with contextlib.suppress(Exception):
            if isinstance(self.replies, StreamReplies):
                self.replies.close()
            self._finish()
