"""The ``Tier`` gRPC service an edge or a cloud runs: each stream's requests through the
tier's pipeline, at once and answered as they finish.

:class:`TierService` feeds the requests of every stream that connects to a tier through
one :class:`~tierflow.runtime.pipeline.Pipeline` ([Note: one request path] in
tierflow/runtime/pipeline.py), the same request path the device runs. What the edge adds,
sending a request on to the cloud and answering when the cloud is gone, is its
:class:`Forwarder` (``tierflow.edge.forwarding``); the cloud has none and answers
everything itself. How the requests of one stream are read and run is in [Note: a stream's
requests run at once] (tierflow/runtime/streams.py); how replies are written in
[Note: slow readers] (tierflow/runtime/replies.py).

[Note: a request at a tier]
1. Refuse it if the tier is not ready, the plan id is not one of the tier's plan set, or
   its deadline has passed. Each request names its plan, so requests in flight finish on
   the plan they started with while the device switches ([Note: switching with
   hysteresis] in device/switching.py).
2. Take it through the pipeline: decode (headers checked first), cache, segments and
   exits; the answer goes back down, or the request goes up through the forwarder. A
   request whose ``members`` are a batch's steps takes each of them through alike, and
   answers them in one reply ([Note: a batch in one message] in
   tierflow/runtime/batch_message.py).
Every request gets exactly one reply: any failure becomes a ``Reply`` with a typed
``Error`` (see :func:`tierflow.transport.wire.error_to_proto`); the stream itself is never
broken on purpose.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import grpc

from tierflow.cache.base import FeatureCache
from tierflow.errors import (
    PlanError,
    TierflowError,
    TransportError,
    UsageError,
)
from tierflow.link.emulation import LinkShaper, ShapedQueue
from tierflow.link.spec import TIERS
from tierflow.onnxrt.providers import describe as describe_providers
from tierflow.options import RuntimeOptions
from tierflow.plan import Plan, PlanSet
from tierflow.rpc import tier_pb2, tier_pb2_grpc
from tierflow.runtime.admission import StreamAdmission, peer_host
from tierflow.runtime.batch_message import Deposit, MemberReplies, check_members, send_together
from tierflow.runtime.batching import BatchStats, Convoy, departure_seat
from tierflow.runtime.pipeline import Answered, Onward, Pipeline
from tierflow.runtime.probe import ProbeCredit, echo
from tierflow.runtime.replies import StreamReplies
from tierflow.runtime.segment_store import SegmentSource, SegmentStore, serve_segment
from tierflow.runtime.streams import ProbeActivity, Send, SessionOrder, StreamReader
from tierflow.runtime.watchdog import StreamWatchdog
from tierflow.runtime.workers import WorkerPool, WorkerSlots
from tierflow.transport.callers import MAX_BEHALF_BYTES, caller_of, owner_of
from tierflow.transport.peer_warnings import WARNINGS
from tierflow.transport.wire import Undecodable, error_to_proto

if TYPE_CHECKING:
    from tierflow.runtime.metrics import TierMetrics

logger = logging.getLogger(__name__)


class Forwarder(Protocol):
    """The edge's way to the next tier (``tierflow.edge.forwarding``): its
    :class:`~tierflow.runtime.upstream.Upstream`, and the reply it writes for what comes
    back (:meth:`Pipeline.came_down`)."""

    address: str

    def open(self, tier: str, options: RuntimeOptions) -> None:
        """Open the channel and its stream client; say so if the next tier is not there."""

    def segment_source(self) -> SegmentSource | None:
        """Where the tier fetches the segment files it lacks (None: nowhere)."""

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
        self.pool = WorkerPool(options.max_streams + self.workers, f"{tier}-work")
        # [Note: a worker lent while a step queues] (tierflow/runtime/workers.py).
        self.running = WorkerSlots(self.workers)
        self.order = SessionOrder()
        self._in_flight = 0
        self._count_lock = threading.Lock()
        self._ready = threading.Event()
        self._stopping = threading.Event()
        self._closed = threading.Event()
        #: Cancels streams whose replies are not read, or that went idle.
        self.watchdog = StreamWatchdog(tier, options, self._count_lock, self._closed)
        self.probe_credit = ProbeCredit()
        #: The tokens that name callers ([Note: who a caller is] in tierflow/transport/callers.py).
        self.tokens = options.security.tokens()

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

    def batch_stats(self) -> list[BatchStats]:
        """The figures of the step batchers of the plans opened here ([Note: the step
        batcher] in tierflow/runtime/batching.py)."""
        pipeline = self.pipeline
        if pipeline is None:
            return []
        runners = [pipeline.runner(index) for index in pipeline.opened()]
        return [runner.batcher.stats for runner in runners if runner.batcher is not None]

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
                streams = list(self.watchdog.streams)
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
        if self.pipeline is not None:
            self.pipeline.close()
        self.pool.shutdown()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called: the tier serves nothing any more."""
        return self._closed.is_set()

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
        caller = caller_of(context, self.tokens)
        spec = self.options.links.get(self.down_link)
        if send_response is None or spec is not None:
            shaper = LinkShaper(self.down_link, spec)
            return self._serve_queued(request_iterator, context, shaper, send_response, caller)
        lock = threading.Lock()

        def write(reply: tier_pb2.Reply | None) -> None:
            with lock:  # grpc allows one message in flight per call
                try:
                    send_response(reply)
                except Exception as exc:  # the reply is lost; the request still counts as done
                    if reply is not None:  # expected when the device went away: one line
                        self._reply_lost(context, reply, exc)

        replies = StreamReplies(write, f"{self.tier}-replies", context)
        self.watchdog.watch(replies)
        reader = StreamReader(
            self, request_iterator, context, replies, finish=lambda: write(None), caller=caller
        )
        self.watchdog.track(reader)
        reader.read()
        return None

    def _reply_lost(
        self, context: grpc.ServicerContext, reply: tier_pb2.Reply, exc: Exception
    ) -> None:
        """One (rate-limited) line for a reply its stream could not take ([Note: warnings
        about a peer] in tierflow/transport/peer_warnings.py)."""
        peer = context.peer()
        WARNINGS.warn(
            logger,
            self.tier,
            "reply_not_delivered",
            peer_host(peer),
            "[%s] reply %s to %s not delivered: %r",
            self.tier,
            reply.id,
            peer,
            exc,
        )

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
        caller: str,
    ) -> Iterator[tier_pb2.Reply] | None:
        """Replies through a queue, each leaving when the emulated reply link has carried
        it: the returned generator yields them to grpc, or (non-blocking form) this
        thread writes them."""
        queued: ShapedQueue[tier_pb2.Reply] = ShapedQueue(shaper)
        context.add_callback(queued.close)
        reader = StreamReader(
            self, request_iterator, context, queued, finish=queued.close, caller=caller
        )
        self.watchdog.track(reader)
        reader.start()
        if send_response is None:
            return self._watched(queued.drain(), context)
        for reply in self._watched(queued.drain(), context):
            try:
                send_response(reply)
            except Exception as exc:  # the reply is lost; the request still counts as done
                self._reply_lost(context, reply, exc)
        with contextlib.suppress(Exception):
            send_response(None)
        return None

    def _watched(
        self, replies: Iterator[tier_pb2.Reply], context: grpc.ServicerContext
    ) -> Iterator[tier_pb2.Reply]:
        """The queued replies, each write watched for a slow reader ([Note: slow readers])."""
        watched = StreamReplies(lambda reply: None, f"{self.tier}-replies", context)
        self.watchdog.watch(watched)
        try:
            for reply in replies:
                watched.write_started = time.monotonic()
                yield reply
                watched.write_started = None
        finally:
            self.unwatch(watched)

    def unwatch(self, replies: StreamReplies) -> None:
        """Stop watching this stream's writes (its reader is done)."""
        self.watchdog.unwatch(replies)

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

    def hold(self, request: tier_pb2.Request, caller: str) -> Callable[[], None]:
        """Hold the state of the session ``request`` names while it waits and runs here
        (:meth:`~tierflow.state.store.SessionStates.hold`); call what it returns after."""
        pipeline = self.pipeline
        if pipeline is None or len(request.on_behalf_of.encode()) > MAX_BEHALF_BYTES:
            return _nothing  # refused when it runs
        owner = owner_of(caller, request.on_behalf_of)
        return pipeline.states.hold(request.session, owner)

    def answered(self) -> None:
        """A request counted by :meth:`admit_request` got its reply."""
        with self._count_lock:
            self._in_flight -= 1

    def handle(
        self,
        request: tier_pb2.Request,
        received: float,
        later: Send,
        caller: str = "local",
        convoy: tuple[Convoy, int] | None = None,
    ) -> tier_pb2.Reply | None:
        """Take one request of ``caller`` ([Note: who a caller is]) through the tier: its
        reply, or None when the next tier's reply will come to ``later`` (from another
        thread). ``convoy``: the batch the request is a member of, and its seat there
        ([Note: a batch in one message] in tierflow/runtime/batch_message.py)."""
        timing = tier_pb2.TierTiming(
            tier=self.tier, queue_ms=(time.perf_counter() - received) * 1e3
        )
        try:
            if request.members:
                check_members(request)
                self.run_members(request, received, later, caller)
                return None
            try:
                reply = self._process(request, timing, later, caller, convoy)
            finally:
                self._settle_departure()
        except TierflowError as exc:
            logger.info("[%s] request %s of %s refused: %s", self.tier, request.id, caller, exc)
            reply = self.error_reply(request.id, exc)
            reply.timings.append(timing)
        except Exception as exc:
            logger.exception("[%s] request %s of %s failed", self.tier, request.id, caller)
            reply = self.error_reply(request.id, exc)
            reply.timings.append(timing)
        if reply is not None:
            reply.id = request.id
        return reply

    def run_members(
        self, request: tier_pb2.Request, received: float, later: Send, caller: str
    ) -> None:
        """Take each member of a batched request through the tier as the request it is, on
        a thread of its own, their steps batched together; their replies go to ``later``
        as one (steps 2-3 of [Note: a batch in one message])."""
        replies = MemberReplies(request, later)
        convoy = Convoy(len(request.members))
        for seat, member in enumerate(request.members):
            run = functools.partial(self._run_member, member, seat, received, replies, convoy)
            work: Callable[[], None] = functools.partial(run, caller, _nothing)
            release, key = _nothing, None
            if member.session:  # [Note: a stream's requests run at once]: a session's in order
                key = (caller, member.on_behalf_of, member.session)
                release = self.hold(member, caller)
                step = functools.partial(run, caller, release)
                if not self.order.enter(key, step):  # taken along by the one before
                    continue
                work = functools.partial(self.order.drain, key, step)
            if not self.pool.submit(work):  # the pool is shut down: the tier is stopping
                convoy.settle(seat)
                stopping = TransportError(f"the {self.tier} is stopping")
                replies.put(seat, self.error_reply(member.id, stopping))
                release()
                if key is not None:  # what waits behind it still runs, and is answered
                    self.order.drain(key, _nothing)

    def _run_member(
        self,
        member: tier_pb2.Request,
        seat: int,
        received: float,
        replies: MemberReplies,
        convoy: Convoy,
        caller: str,
        release: Callable[[], None],
    ) -> None:
        """One member of a batched request, as :meth:`StreamReader._run` runs a request."""
        try:
            with self.running:
                later = functools.partial(replies.put, seat)
                reply = self.handle(member, received, later, caller, (convoy, seat))
        finally:
            convoy.settle(seat)  # it will not reach the batcher now, if it has not
            release()  # this tier's step of the session is done (its state kept)
        if reply is not None:
            replies.put(seat, reply)

    def _process(
        self,
        request: tier_pb2.Request,
        timing: tier_pb2.TierTiming,
        later: Send,
        caller: str,
        convoy: tuple[Convoy, int] | None = None,
    ) -> tier_pb2.Reply | None:
        """Steps 1-2 of [Note: a request at a tier]; None when the reply comes later."""
        pipeline = self.pipeline
        if pipeline is None or not self._ready.is_set():
            raise TransportError(f"the {self.tier} is not serving yet (its model is loading)")
        index = pipeline.index_of(request.plan_id)
        send = functools.partial(self._send_up, pipeline, index, request.id, timing, later)
        step = pipeline.up(index, send, request=request, caller=caller, convoy=convoy)
        if not isinstance(step, Answered):
            return step
        timing.compute_ms = step.compute_s * 1e3
        reply = pipeline.answer(index, step)
        timing.codec_ms = step.codec_s * 1e3
        reply.timings.append(timing)
        return reply

    def _send_up(
        self,
        pipeline: Pipeline,
        index: int,
        request_id: str,
        timing: tier_pb2.TierTiming,
        later: Send,
        onward: Onward,
    ) -> tier_pb2.Reply | None:
        """Send ``onward`` to the next tier (with its batch, if it came in one); None when
        its reply comes to ``later``."""
        timing.compute_ms = onward.compute_s * 1e3
        timing.codec_ms = onward.codec_s * 1e3
        if self.forwarder is None:
            plan_id = self.plans.plans[index].plan_id
            raise PlanError(f"plan {plan_id} runs beyond the {self.tier}, which has no --upstream")
        seat = departure_seat()
        if seat is not None:  # [Note: a batch in one message]: it goes on with its batch
            deposit = Deposit(pipeline, index, onward, request_id, timing, later)
            self._depart(seat[0].deposit(seat[1], deposit))
            return None
        return self.forwarder.forward(pipeline, index, onward, request_id, timing, later)

    def _settle_departure(self) -> None:
        """Settle the batch seat of this thread's step, if it has one still: it goes no
        further ([Note: a batch in one message])."""
        seat = departure_seat()
        if seat is not None:
            self._depart(seat[0].settle(seat[1]))

    def _depart(self, deposits: list[object] | None) -> None:
        """Send a batch's members that go on, once the last has settled."""
        if deposits and self.forwarder is not None:
            batch = [d for d in deposits if isinstance(d, Deposit)]
            send_together(self.forwarder, self.tier, batch)

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
        shaper = LinkShaper(self.down_link, self.options.links.get(self.down_link))
        return self.segment_chunks(request, context, shaper)

    def segment_chunks(
        self,
        request: tier_pb2.SegmentRequest,
        context: grpc.ServicerContext,
        shaper: LinkShaper,
    ) -> Generator[tier_pb2.SegmentChunk, None, None]:
        """:meth:`FetchSegment` with the reply link's ``shaper`` given (a fake clock's in
        process: [Note: the next tier in process] in tierflow/runtime/upstream.py)."""
        self._admit(context)
        if self.pipeline is None or not self._ready.is_set():
            context.abort(grpc.StatusCode.UNAVAILABLE, f"the {self.tier} is not serving yet")
            return
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
        watched = ProbeActivity(context)
        self.watchdog.track(watched)
        messages = watched.counted(request_iterator)
        try:
            yield from echo(self.tier, messages, context, self.probe_credit)
        finally:
            self.watchdog.untrack(watched)


def _nothing() -> None:
    pass


# grpc calls a handler marked so with a third argument, a function that writes one reply
# (None: the final status) from any thread ([Note: slow readers]).
TierService.Infer.experimental_non_blocking = True  # type: ignore[attr-defined]
