"""The ``Tier`` gRPC service an edge or a cloud runs: each stream's requests through the
tier's pipeline, at once and answered as they finish.

:class:`TierService` feeds the requests of every stream that connects to a tier through
one :class:`~tierflow.runtime.pipeline.Pipeline` ([Note: one request path] in
tierflow/runtime/pipeline.py), the same request path the device runs. What the edge adds,
sending a request on to the cloud and answering when the cloud is gone, is its
:class:`Forwarder` (``tierflow.edge.forwarding``); the cloud has none and answers
everything itself. How the requests of one stream are read and run is in
[Note: a stream's requests run at once]; how replies are written in [Note: slow readers]
(tierflow/runtime/replies.py).

[Note: a request at a tier]
1. Refuse it if the tier is not ready, the plan id is not one of the tier's plan set, or
   its deadline has passed. Each request names its plan, so requests in flight finish on
   the plan they started with while the device switches ([Note: switching with
   hysteresis] in tierflow/device/switching.py).
2. Take it through the pipeline: decode (headers checked first), cache, segments and
   exits; the answer goes back down, or the request goes up through the forwarder.
Every request gets exactly one reply: any failure becomes a ``Reply`` with a typed
``Error`` (see :func:`tierflow.transport.wire.error_to_proto`); the stream itself is never
broken on purpose.

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
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import grpc

from tierflow.cache.base import FeatureCache
from tierflow.errors import (
    CodecError,
    DeadlineError,
    PlanError,
    TierflowError,
    TransportError,
    UsageError,
)
from tierflow.link.emulation import LinkShaper, ShapedQueue
from tierflow.link.spec import TIERS
from tierflow.options import RuntimeOptions
from tierflow.plan import Plan, PlanSet
from tierflow.rpc import tier_pb2, tier_pb2_grpc
from tierflow.runtime.admission import StreamAdmission, peer_host
from tierflow.runtime.pipeline import Answered, Onward, Pipeline, SessionStep
from tierflow.runtime.probe import ProbeCredit, echo
from tierflow.runtime.providers import describe as describe_providers
from tierflow.runtime.replies import StreamReplies
from tierflow.runtime.segment_store import SegmentSource, SegmentStore, serve_segment
from tierflow.transport.wire import Undecodable, check_deadline, check_figures, error_to_proto

if TYPE_CHECKING:
    from tierflow.runtime.metrics import TierMetrics

logger = logging.getLogger(__name__)

Send = Callable[[tier_pb2.Reply], None]


class Forwarder(Protocol):
    """The edge's way to the next tier (``tierflow.edge.forwarding``)."""

    address: str

    def open(self, tier: str, options: RuntimeOptions) -> None:
        """Open the channel and its stream client; say so if the next tier is not there."""

    def segment_source(self) -> SegmentSource:
        """Where the tier fetches the segment files it lacks."""

    def forward(
        self,
        pipeline: Pipeline,
        index: int,
        onward: Onward,
        request_id: str,
        timing: tier_pb2.TierTiming,
        send: Send,
    ) -> tier_pb2.Reply | None:
        """Send ``onward`` up; its reply comes to ``send`` later (None), or the reply now."""

    def close(self, timeout: float) -> None:
        """Close the stream to the next tier, waiting up to ``timeout`` s."""


class TierService(tier_pb2_grpc.TierServicer):
    """The ``Tier`` servicer of an edge or a cloud ([Note: a request at a tier]).

    ``plan`` may be a whole :class:`~tierflow.plan.PlanSet`: the tier serves every plan of
    it (``plan`` and ``plan_id`` are the default's). ``forwarder`` sends requests on to
    the next tier; it is needed when a plan runs segments beyond this tier. ``cache`` is
    any :class:`~tierflow.cache.base.FeatureCache`. ``options`` say how to run: ONNX
    Runtime settings, the links to emulate (``tierflow.link.emulation``), limits, and the
    TLS and token settings. Call :meth:`load` before serving.
    """

    def __init__(
        self,
        tier: str,
        plan: Plan | PlanSet,
        plan_dir: str | Path,
        *,
        forwarder: Forwarder | None = None,
        cache: FeatureCache | None = None,
        options: RuntimeOptions | None = None,
    ) -> None:
        if tier not in ("edge", "cloud"):
            raise UsageError(f"a tier service runs on the edge or the cloud, not on {tier!r}")
        self.tier = tier
        self.plans = plan if isinstance(plan, PlanSet) else PlanSet((plan,))
        self.plan = self.plans.default_plan
        self.plan_id = self.plan.plan_id
        self.plan_dir = Path(plan_dir)
        self.forwarder = forwarder
        self.cache = cache
        self.options = options = options or RuntimeOptions()
        self.workers = options.workers or os.cpu_count() or 1
        self.pipeline: Pipeline | None = None  # made by load
        self.metrics: TierMetrics | None = None  # --metrics-port (tierflow.runtime.metrics)
        self.admission = StreamAdmission(tier, options.max_streams, options.max_streams_per_peer)
        # Threads that read streams and run requests ([Note: a stream's requests run at
        # once]): one reading each open stream, plus the requests running.
        self.pool = ThreadPoolExecutor(
            max_workers=options.max_streams + self.workers, thread_name_prefix=f"{tier}-work"
        )
        self._running = threading.BoundedSemaphore(self.workers)
        self.order = SessionOrder()
        self._in_flight = 0
        self._count_lock = threading.Lock()
        self._streams: set[StreamReplies] = set()  # watched for slow readers
        self._readers: set[_Watched] = set()  # streams watched for idleness
        self._ready = threading.Event()
        self._stopping = threading.Event()
        self._closed = threading.Event()
        self._watchdog: threading.Thread | None = None
        self.probe_credit = ProbeCredit()

    # ------------------------------------------------------------------ lifecycle

    def load(self) -> None:
        """Open the way to the next tier, then load (or fetch) this tier's segments."""
        rank = TIERS.index(self.tier)
        beyond = any(TIERS.index(s.tier) > rank for p in self.plans.plans for s in p.segments)
        if beyond and self.forwarder is None:
            raise UsageError(
                f"the plan runs segments after the {self.tier}; give the next tier's "
                "address (--upstream HOST:PORT)"
            )
        source = None
        if self.forwarder is not None:
            self.forwarder.open(self.tier, self.options)
            source = self.forwarder.segment_source()
        pipeline = Pipeline(
            self.tier, self.plans, self.plan_dir, self.options, cache=self.cache, source=source
        )
        runner = pipeline.runner(self.plans.default)
        self.pipeline = pipeline
        self._ready.set()
        logger.info(
            "[%s] plan %s loaded: segments %s on %s, forwards to %s",
            self.tier,
            self.plan_id,
            [i for i, _, _ in runner.segments],
            describe_providers(self.options.providers),
            self.forwarder.address if self.forwarder is not None else "nobody",
        )

    @property
    def segments(self) -> SegmentStore | None:
        """The tier's segment store, once loaded ([Note: segments on demand])."""
        return None if self.pipeline is None else self.pipeline.segments

    @property
    def opened_plans(self) -> list[str]:
        """Ids of the plans whose sessions are open: the default's, and those asked for."""
        if self.pipeline is None:
            return []
        return [self.plans.plans[i].plan_id for i in self.pipeline.opened()]

    @property
    def in_flight(self) -> int:
        """Requests at this tier not yet answered."""
        return self._in_flight

    def drain(self, timeout: float) -> bool:
        """Refuse new requests from now on; wait up to ``timeout`` s for those in flight.

        Returns whether every request in flight was answered. Requests that arrive from
        now on are answered at once with UNAVAILABLE ("stopping"), so that a device
        learns to go elsewhere instead of waiting for a tier that will not answer.
        A request counts as answered once its reply is written to its stream, not when
        it is handed to the stream's writer thread: cancelling the streams in between
        would lose the reply.
        """
        self._stopping.set()
        ends = time.monotonic() + max(timeout, 0.0)
        while True:
            with self._count_lock:
                answered = self._in_flight <= 0
                streams = list(self._streams)
            if answered and all(replies.written() for replies in streams):
                return True
            if time.monotonic() >= ends:
                return False
            time.sleep(0.01)

    def close(self, timeout: float = 1.0) -> None:
        """Release the pool and the stream to the next tier (waiting up to ``timeout`` s)."""
        self._ready.clear()
        self._stopping.set()
        self._closed.set()
        if self.forwarder is not None:
            self.forwarder.close(timeout)
        self.pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ streams

    def _admit(self, context: grpc.ServicerContext) -> None:
        """Take a place for this stream, or end it OVERLOADED ([Note: stream admission])."""
        peer = peer_host(context.peer())
        refusal = self.admission.admit(peer)
        if refusal is not None:
            logger.info("[%s] stream refused: %s", self.tier, refusal)
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, refusal)
        released = threading.Event()

        def release() -> None:
            if not released.is_set():
                released.set()
                self.admission.release(peer)

        if not context.add_callback(release):  # the call already ended
            release()

    def Infer(
        self,
        request_iterator: Iterator[tier_pb2.Request | Undecodable],
        context: grpc.ServicerContext,
        send_response: Callable[[tier_pb2.Reply | None], None] | None = None,
    ) -> Iterator[tier_pb2.Reply] | None:
        """Serve one stream ([Note: a stream's requests run at once]).

        With ``send_response`` (grpc's non-blocking handler form) replies are written by
        the threads that make them ([Note: slow readers]); without it (a grpc that does
        not offer that form), or with an emulated reply link, they go through a queue
        that the returned generator (or one writer thread) drains.
        """
        self._admit(context)
        spec = self.options.links.get(self.down_link)
        if send_response is None or spec is not None:
            shaper = LinkShaper(self.down_link, spec)
            return self._serve_queued(request_iterator, context, shaper, send_response)
        lock = threading.Lock()

        def write(reply: tier_pb2.Reply | None) -> None:
            with lock:  # grpc allows one message in flight per call
                try:
                    send_response(reply)
                except Exception as exc:  # the reply is lost; the request still counts as done
                    if reply is not None:  # expected when the device went away: one line
                        logger.warning("[%s] reply %s not delivered: %r", self.tier, reply.id, exc)

        replies = StreamReplies(write, f"{self.tier}-replies", context)
        self._watch(replies)
        reader = _StreamReader(self, request_iterator, context, replies, finish=lambda: write(None))
        self._track(reader)
        reader.read()
        return None

    @property
    def down_link(self) -> str:
        """The link this tier answers on."""
        return "device-edge" if self.tier == "edge" else "edge-cloud"

    def _serve_queued(
        self,
        request_iterator: Iterator[tier_pb2.Request | Undecodable],
        context: grpc.ServicerContext,
        shaper: LinkShaper,
        send_response: Callable[[tier_pb2.Reply | None], None] | None,
    ) -> Iterator[tier_pb2.Reply] | None:
        """Replies through a queue, each leaving when the emulated reply link has carried
        it: the returned generator yields them to grpc, or (non-blocking form) this
        thread writes them."""
        queued: ShapedQueue[tier_pb2.Reply] = ShapedQueue(shaper)
        context.add_callback(queued.close)
        reader = _StreamReader(self, request_iterator, context, queued, finish=queued.close)
        self._track(reader)
        reader.start()
        if send_response is None:
            return self._watched(queued.drain(), context)
        for reply in self._watched(queued.drain(), context):
            try:
                send_response(reply)
            except Exception as exc:  # the reply is lost; the request still counts as done
                logger.warning("[%s] reply %s not delivered: %r", self.tier, reply.id, exc)
        with contextlib.suppress(Exception):
            send_response(None)
        return None

    def _watched(
        self, replies: Iterator[tier_pb2.Reply], context: grpc.ServicerContext
    ) -> Iterator[tier_pb2.Reply]:
        """The queued replies, each write watched for a slow reader ([Note: slow readers])."""
        watched = StreamReplies(lambda reply: None, f"{self.tier}-replies", context)
        self._watch(watched)
        try:
            for reply in replies:
                watched.write_started = time.monotonic()
                yield reply
                watched.write_started = None
        finally:
            self._unwatch(watched)

    def _watch(self, replies: StreamReplies) -> None:
        """Have :meth:`_watch_writes` look after this stream's writes."""
        with self._count_lock:
            self._streams.add(replies)
            self._start_watchdog()

    def _start_watchdog(self) -> None:
        """Start :meth:`_watch_writes` on first use; call with ``_count_lock`` held."""
        if self._watchdog is None:
            self._watchdog = threading.Thread(
                target=self._watch_writes, name=f"{self.tier}-watchdog", daemon=True
            )
            self._watchdog.start()

    def _unwatch(self, replies: StreamReplies) -> None:
        with self._count_lock:
            self._streams.discard(replies)

    def _track(self, reader: _Watched) -> None:
        """Have the watchdog close ``reader``'s stream once it is idle (``--stream-idle``)."""
        with self._count_lock:
            self._readers.add(reader)
            self._start_watchdog()
        reader.on_finish = lambda: self._untrack(reader)

    def _untrack(self, reader: _Watched) -> None:
        with self._count_lock:
            self._readers.discard(reader)

    def _watch_writes(self) -> None:
        """Cancel each stream whose reply waited longer than ``reply_timeout`` to be read.

        See [Note: slow readers]; the cancel makes the waiting write return.
        """
        limit = self.options.reply_timeout
        while not self._closed.wait(min(limit / 4, 0.25)):
            now = time.monotonic()
            self._close_idle(now)
            with self._count_lock:
                streams = list(self._streams)
            for replies in streams:
                started = replies.write_started
                if started is None or now - started <= limit or replies.cancelled:
                    continue
                replies.cancelled = True
                logger.warning(
                    "[%s] stream from %s cancelled: a reply waited %.1f s for it to read "
                    "(--reply-timeout)",
                    self.tier,
                    replies.context.peer(),
                    now - started,
                )
                replies.context.cancel()

    def _close_idle(self, now: float) -> None:
        """Cancel the streams with nothing in flight that sent nothing for ``stream_idle_s``
        ([Note: stream admission] in tierflow/runtime/admission.py)."""
        limit = self.options.stream_idle_s
        with self._count_lock:
            idle = [r for r in self._readers if r.idle_for(now) > limit]
            for reader in idle:
                self._readers.discard(reader)
        for reader in idle:
            logger.info(
                "[%s] stream from %s closed: idle for %.0f s (--stream-idle)",
                self.tier,
                reader.context.peer(),
                reader.idle_for(now),
            )
            reader.context.cancel()

    # ------------------------------------------------------------------ requests

    def admit_request(self) -> tier_pb2.Error | None:
        """Count a request just read in flight; the error to answer it with at once, if any."""
        with self._count_lock:
            self._in_flight += 1
            overloaded = self._in_flight > self.options.max_in_flight
        if self._stopping.is_set():
            return error_to_proto(TransportError(f"the {self.tier} is stopping"), self.tier)
        if overloaded:
            limit = self.options.max_in_flight
            error = error_to_proto(
                TransportError(f"the {self.tier} has {limit} requests in flight already"),
                self.tier,
            )
            error.code = tier_pb2.ErrorCode.OVERLOADED
            return error
        return None

    def answered(self) -> None:
        """A request counted by :meth:`admit_request` got its reply."""
        with self._count_lock:
            self._in_flight -= 1

    def handle(
        self, request: tier_pb2.Request, received: float, later: Send
    ) -> tier_pb2.Reply | None:
        """Take one request through the tier: its reply, or None when the next tier's reply
        will come to ``later`` (from another thread)."""
        timing = tier_pb2.TierTiming(
            tier=self.tier, queue_ms=(time.perf_counter() - received) * 1e3
        )
        try:
            reply = self._process(request, timing, later)
        except TierflowError as exc:
            logger.info("[%s] request %s refused: %s", self.tier, request.id, exc)
            reply = self.error_reply(request.id, exc)
            reply.timings.append(timing)
        except Exception as exc:
            logger.exception("[%s] request %s failed", self.tier, request.id)
            reply = self.error_reply(request.id, exc)
            reply.timings.append(timing)
        if reply is not None:
            reply.id = request.id
        return reply

    def _process(
        self, request: tier_pb2.Request, timing: tier_pb2.TierTiming, later: Send
    ) -> tier_pb2.Reply | None:
        """Steps 1-2 of [Note: a request at a tier]; None when the reply comes later."""
        pipeline = self.pipeline
        if pipeline is None or not self._ready.is_set():
            raise TransportError(f"the {self.tier} is not serving yet (its model is loading)")
        index = pipeline.index_of(request.plan_id)
        check_figures(request)
        deadline = check_deadline(request.deadline_unix_s, time.time())
        if deadline and time.time() > deadline:
            raise DeadlineError(f"the request's deadline passed before the {self.tier} ran it")
        with pipeline.holding(index):  # its segment files stay while it runs
            runner = pipeline.runner(index)
            features, codec_s = pipeline.decode(index, runner, request.segment, request.tensors)
            session = SessionStep.of_request(request, runner, self.options.max_tensor_bytes)
            hit, key = pipeline.cached(index, request.segment, features, session)
            step = hit or pipeline.run(
                index,
                runner,
                features,
                segment=request.segment,
                key=key,
                deadline_unix_s=deadline or 0.0,
                as_received=request.tensors,
                checked=True,
                session=session,
            )
        timing.compute_ms = step.compute_s * 1e3
        if isinstance(step, Answered):
            reply = pipeline.answer(index, step)
            timing.codec_ms = (codec_s + step.codec_s) * 1e3
            reply.timings.append(timing)
            return reply
        timing.codec_ms = (codec_s + step.codec_s) * 1e3
        if self.forwarder is None:
            plan_id = self.plans.plans[index].plan_id
            raise PlanError(f"plan {plan_id} runs beyond the {self.tier}, which has no --upstream")
        return self.forwarder.forward(pipeline, index, step, request.id, timing, later)

    def error_reply(
        self, request_id: str, exc: BaseException, code: str | None = None
    ) -> tier_pb2.Reply:
        error = error_to_proto(exc, self.tier)
        if code is not None:
            error.code = tier_pb2.ErrorCode.Value(code)
        return tier_pb2.Reply(id=request_id, plan_id=self.plan_id, error=error)

    # ------------------------------------------------------------------ segments

    def FetchSegment(
        self, request: tier_pb2.SegmentRequest, context: grpc.ServicerContext
    ) -> Iterator[tier_pb2.SegmentChunk]:
        """A segment file in chunks, for the tier below ([Note: segments on demand])."""
        self._admit(context)
        if self.pipeline is None or not self._ready.is_set():
            context.abort(grpc.StatusCode.UNAVAILABLE, f"the {self.tier} is not serving yet")
            return
        shaper = LinkShaper(self.down_link, self.options.links.get(self.down_link))
        yield from serve_segment(self.pipeline.segments, request, context, shaper)

    # ------------------------------------------------------------------ probe

    def Probe(
        self,
        request_iterator: Iterator[tier_pb2.ProbeMessage | Undecodable],
        context: grpc.ServicerContext,
    ) -> Iterator[tier_pb2.ProbeMessage]:
        """Echo ``reply_bytes`` bytes for each message; the tier's name goes in the metadata.

        What a probe may be sent is bounded per peer ([Note: probe credit] in
        tierflow/runtime/probe.py).
        """
        self._admit(context)
        context.send_initial_metadata((("tierflow-tier", self.tier),))
        watched = _ProbeActivity(context)
        self._track(watched)
        messages = watched.counted(request_iterator)
        try:
            yield from echo(self.tier, messages, context, self.probe_credit)
        finally:
            self._untrack(watched)


class _Watched(Protocol):
    """A stream the watchdog closes once it is idle ([Note: stream admission])."""

    context: grpc.ServicerContext
    on_finish: Callable[[], None] | None

    def idle_for(self, now: float) -> float:
        """Seconds the stream has had nothing in flight and sent nothing (0: busy)."""


class _ProbeActivity:
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


class SessionOrder:
    """Runs each session's requests one at a time, in the order they were read.

    A request of a session that has one running waits in the session's queue, and the
    thread running the one before takes it along ([Note: a stream's requests run at
    once]). Requests of other sessions, and those of no session, do not wait for it.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting: dict[str, deque[Callable[[], None]]] = {}

    def run(self, session: str, work: Callable[[], None]) -> None:
        with self._lock:
            queue = self._waiting.get(session)
            if queue is not None:
                queue.append(work)
                return
            self._waiting[session] = deque()
        while True:
            try:
                work()
            finally:
                with self._lock:
                    queue = self._waiting[session]
                    if not queue:
                        del self._waiting[session]
                        next_work = None
                    else:
                        next_work = queue.popleft()
            if next_work is None:
                return
            work = next_work


class _StreamReader:
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
    ) -> None:
        self.service = service
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
            self.service.order.run(request.session, lambda: self._run(request, received))
        else:
            self._run(request, received)

    def _run(self, request: tier_pb2.Request, received: float) -> None:
        with self.service._running:
            reply = self.service.handle(
                request, received, lambda later: self._reply(later, received, own=False)
            )
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
        try:
            self.service.pool.submit(task)
        except RuntimeError:  # the pool is shut down
            return False
        return True

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


# grpc calls a handler marked so with a third argument, a function that writes one reply
# (None: the final status) from any thread ([Note: slow readers]).
TierService.Infer.experimental_non_blocking = True  # type: ignore[attr-defined]
