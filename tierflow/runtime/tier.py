"""An edge or a cloud, whatever carries its requests: what a tier is and does with one.

:class:`Tier` takes each request through one :class:`~tierflow.runtime.pipeline.Pipeline`
([Note: one request path] in tierflow/runtime/pipeline.py), the same request path the
device runs. What the edge adds, sending a request on to the cloud and answering when the
cloud is gone, is its :class:`Forwarder` (``tierflow.edge.forwarding``); the cloud has none
and answers everything itself. A tier holds no stream, channel or server: its ``Tier``
gRPC service (tierflow/runtime/service.py) feeds it each stream's requests ([Note: a
stream's requests run at once] in tierflow/runtime/streams.py), and the tier below in the
same process calls it directly ([Note: the next tier in process] in
tierflow/runtime/upstream.py), each the same way: :meth:`Tier.admit_request`,
:meth:`Tier.hold` for a session's request, :meth:`Tier.handle`, and :meth:`Tier.answered`
once its one reply is out; a segment file goes to either through :meth:`Tier.segment_chunks`
on the call's context.

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

import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Generator, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import grpc
import numpy as np

from tierflow.cache.base import FeatureCache
from tierflow.errors import PlanError, TierflowError, TransportError, UsageError
from tierflow.link.emulation import LinkShaper
from tierflow.link.spec import TIERS
from tierflow.onnxrt.providers import describe as describe_providers
from tierflow.options import RuntimeOptions
from tierflow.plan import Plan, PlanSet
from tierflow.rpc import tier_pb2
from tierflow.runtime import batch_message
from tierflow.runtime.batch_message import (
    Deposit,
    MemberReplies,
    check_members,
    member_rows,
    send_together,
)
from tierflow.runtime.batching import BatchStats, departure_seat
from tierflow.runtime.pipeline import Answered, Climb, Onward, Pipeline, drive, drive_together
from tierflow.runtime.replies import Send
from tierflow.runtime.segment_store import SegmentSource, SegmentStore, serve_segment
from tierflow.runtime.session_order import SessionOrder
from tierflow.runtime.workers import WorkerPool, WorkerSlots
from tierflow.transport.callers import MAX_BEHALF_BYTES, owner_of
from tierflow.transport.wire import RAW, error_to_proto, put_tensors

if TYPE_CHECKING:
    from tierflow.runtime.metrics import TierMetrics

logger = logging.getLogger(__name__)


class Forwarder(batch_message.Forwarder, Protocol):
    """The edge's way to the next tier (``tierflow.edge.forwarding``): its
    :class:`~tierflow.runtime.upstream.Upstream`, and the reply it writes for what comes
    back (:meth:`Pipeline.came_down`); ``forward`` as a batch's members are sent on
    (:class:`tierflow.runtime.batch_message.Forwarder`)."""

    address: str

    def open(self, tier: str, options: RuntimeOptions) -> None:
        """Open the channel and its stream client; say so if the next tier is not there."""

    def segment_source(self) -> SegmentSource | None:
        """Where the tier fetches the segment files it lacks (None: nowhere)."""

    def close(self, timeout: float) -> None:
        """Close the stream to the next tier, waiting up to ``timeout`` s."""


class Outlet(Protocol):
    """Where replies handed on wait to be written (a stream's
    :class:`~tierflow.runtime.replies.StreamReplies`)."""

    def written(self) -> bool:
        """Whether every reply handed to it is written."""


class Tier:
    """An edge or a cloud ([Note: a request at a tier]), named ``name``.

    ``plan`` may be a whole :class:`~tierflow.plan.PlanSet`: the tier serves every plan of
    it (``plan`` and ``plan_id`` are the default's). ``forwarder`` sends requests on to
    the next tier; it is needed when a plan runs segments beyond this tier. ``cache`` is
    any :class:`~tierflow.cache.base.FeatureCache`. ``options`` say how to run: ONNX
    Runtime settings, the links to emulate (``tierflow.link.emulation``), limits, and the
    TLS and token settings. Call :meth:`load` before serving.
    """

    def __init__(
        self,
        name: str,
        plan: Plan | PlanSet,
        plan_dir: str | Path,
        *,
        forwarder: Forwarder | None = None,
        cache: FeatureCache | None = None,
        options: RuntimeOptions | None = None,
    ) -> None:
        if name not in ("edge", "cloud"):
            raise UsageError(f"a tier service runs on the edge or the cloud, not on {name!r}")
        self.name = name
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
        # Threads that read streams and run requests ([Note: a stream's requests run at
        # once]): one reading each open stream, plus the requests running.
        self.pool = WorkerPool(options.max_streams + self.workers, f"{name}-work")
        # [Note: a worker lent while a step queues] (tierflow/runtime/workers.py).
        self.running = WorkerSlots(self.workers)
        self.order = SessionOrder()
        self._in_flight = 0
        #: Guards the count of requests in flight; the service's watchdog shares it, so
        #: that :meth:`drain` reads the streams and the requests in flight at one moment.
        self.lock = threading.Lock()
        self._ready = threading.Event()
        self._stopping = threading.Event()
        #: Set by :meth:`close`; what watches the tier's streams stops with it.
        self.closed_event = threading.Event()

    # ------------------------------------------------------------------ lifecycle

    def load(self) -> None:
        """Open the way to the next tier, then load (or fetch) this tier's segments."""
        rank = TIERS.index(self.name)
        beyond = any(TIERS.index(s.tier) > rank for p in self.plans.plans for s in p.segments)
        if beyond and self.forwarder is None:
            raise UsageError(
                f"the plan runs segments after the {self.name}; give the next tier's "
                "address (--upstream HOST:PORT)"
            )
        source = None
        if self.forwarder is not None:
            self.forwarder.open(self.name, self.options)
            source = self.forwarder.segment_source()
        pipeline = Pipeline(
            self.name, self.plans, self.plan_dir, self.options, cache=self.cache, source=source
        )
        runner = pipeline.runner(self.plans.default)
        self.pipeline = pipeline
        self._ready.set()
        logger.info(
            "[%s] plan %s loaded: segments %s on %s, forwards to %s",
            self.name,
            self.plan_id,
            [i for i, _, _ in runner.segments],
            describe_providers(self.options.providers),
            self.forwarder.address if self.forwarder is not None else "nobody",
        )

    @property
    def ready(self) -> bool:
        """Whether the tier is loaded and not closed: it serves requests."""
        return self.pipeline is not None and self._ready.is_set()

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

    def segment_chunks(
        self,
        request: tier_pb2.SegmentRequest,
        context: grpc.ServicerContext,
        shaper: LinkShaper,
    ) -> Generator[tier_pb2.SegmentChunk, None, None]:
        """A segment file in chunks for the tier below ([Note: segments on demand]), each
        leaving as ``shaper``, the reply link, carries it; ``context`` is the call's (a
        gRPC one, or a :class:`~tierflow.runtime.local_call.LocalContext` in process:
        [Note: the next tier in process] in tierflow/runtime/upstream.py), aborted when
        the tier is not serving or refuses."""
        segments = self.segments
        if segments is None or not self.ready:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"the {self.name} is not serving yet")
            return
        yield from serve_segment(segments, request, context, shaper)

    @property
    def down_link(self) -> str:
        """The link this tier answers on."""
        return "device-edge" if self.name == "edge" else "edge-cloud"

    @property
    def in_flight(self) -> int:
        """Requests at this tier not yet answered."""
        return self._in_flight

    def drain(self, timeout: float, outlets: Callable[[], Iterable[Outlet]] = tuple) -> bool:
        """Refuse new requests from now on; wait up to ``timeout`` s for those in flight.

        Returns whether every request in flight was answered. Requests that arrive from
        now on are answered at once with UNAVAILABLE ("stopping"), so that a device
        learns to go elsewhere instead of waiting for a tier that will not answer.
        ``outlets`` (the service's streams, listed under :attr:`lock`) hold the replies
        handed on to be written: a request counts as answered once its reply is written
        to its stream, not when it is handed to the stream's writer thread, since
        cancelling the streams in between would lose the reply.
        """
        self._stopping.set()
        ends = time.monotonic() + max(timeout, 0.0)
        while True:
            with self.lock:
                answered = self._in_flight <= 0
                waiting = list(outlets())
            if answered and all(outlet.written() for outlet in waiting):
                return True
            if time.monotonic() >= ends:
                return False
            time.sleep(0.01)

    def close(self, timeout: float = 1.0) -> None:
        """Release the pool and the stream to the next tier (waiting up to ``timeout`` s)."""
        self._ready.clear()
        self._stopping.set()
        self.closed_event.set()
        if self.forwarder is not None:
            self.forwarder.close(timeout)
        if self.pipeline is not None:
            self.pipeline.close()
        self.pool.shutdown()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called: the tier serves nothing any more."""
        return self.closed_event.is_set()

    # ------------------------------------------------------------------ requests

    def admit_request(self) -> tier_pb2.Error | None:
        """Count a request just read in flight; the error to answer it with at once, if any."""
        with self.lock:
            self._in_flight += 1
            overloaded = self._in_flight > self.options.max_in_flight
        if self._stopping.is_set():
            return error_to_proto(TransportError(f"the {self.name} is stopping"), self.name)
        if overloaded:
            limit = self.options.max_in_flight
            error = error_to_proto(
                TransportError(f"the {self.name} has {limit} requests in flight already"),
                self.name,
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
        with self.lock:
            self._in_flight -= 1

    def handle(
        self,
        request: tier_pb2.Request,
        received: float,
        later: Send,
        caller: str = "local",
    ) -> tier_pb2.Reply | None:
        """Take one request of ``caller`` ([Note: who a caller is]) through the tier: its
        reply, or None when the next tier's reply will come to ``later`` (from another
        thread)."""
        timing = self._timing(received)
        try:
            if request.members:
                check_members(request)
                self.run_members(request, received, later, caller)
                return None
            try:
                went = drive(self._climb(request, timing, later, caller))
                reply = went if isinstance(went, tier_pb2.Reply) else self._go_on(went)
            finally:
                self._settle_departure()
        except Exception as exc:
            reply = self._failed(request, caller, timing, exc)
        if reply is not None:
            reply.id = request.id
        return reply

    def _timing(self, received: float) -> tier_pb2.TierTiming:
        return tier_pb2.TierTiming(tier=self.name, queue_ms=(time.perf_counter() - received) * 1e3)

    def _failed(
        self,
        request: tier_pb2.Request,
        caller: str,
        timing: tier_pb2.TierTiming,
        exc: Exception,
    ) -> tier_pb2.Reply:
        """The reply to ``request``, which failed here with ``exc`` (a bug is logged as one)."""
        if isinstance(exc, TierflowError):
            logger.info("[%s] request %s of %s refused: %s", self.name, request.id, caller, exc)
        else:
            logger.exception("[%s] request %s of %s failed", self.name, request.id, caller)
        reply = self.error_reply(request.id, exc)
        reply.timings.append(timing)
        return reply

    def run_members(
        self, request: tier_pb2.Request, received: float, later: Send, caller: str
    ) -> None:
        """Take the members of a batched request through the tier together, on this thread
        (steps 2-3 of [Note: a batch in one message]); their replies go to ``later`` as
        one. A member whose session has a request here still running waits for it, and
        then runs alone."""
        replies = MemberReplies(request, later)
        rows, decoded_ms = self._rows(request)
        together: list[tuple[int, tier_pb2.Request]] = []
        entered: list[tuple[tuple[str, str, str], Callable[[], None]]] = []
        for seat, member in enumerate(request.members):
            if member.session:  # [Note: a stream's requests run at once]: a session's in order
                key = (caller, member.on_behalf_of, member.session)
                release = self.hold(member, caller)
                alone = functools.partial(
                    self._run_member, member, seat, received, replies, caller, release, rows
                )
                if not self.order.enter(key, alone):  # taken along by the one before
                    continue
                entered.append((key, release))
            together.append((seat, member))
        try:
            self._run_together(together, received, replies, caller, rows, decoded_ms)
        finally:
            for key, release in entered:  # then what waited behind them, on this thread
                self.order.drain(key, release)

    def _rows(self, request: tier_pb2.Request) -> tuple[list[dict[str, np.ndarray]] | None, float]:
        """Each member's rows of a batch's stacked tensors, if they came stacked ([Note: a
        batch's tensors stacked] in tierflow/runtime/batch_message.py), checked, and each
        member's share of decoding them (ms). Every member's rows are slices of the same
        tensors (names, dtypes, shapes), so one member's check is every member's."""
        pipeline = self.pipeline
        if not request.tensors or pipeline is None:
            return None, 0.0
        start = time.perf_counter()
        index = pipeline.index_of(request.plan_id)
        runner = pipeline.runner(index)
        rows = member_rows(request, pipeline.options.max_tensor_bytes, len(runner.needs))
        pipeline.check_rows(runner, request.segment, rows[0])
        return rows, (time.perf_counter() - start) * 1e3 / len(rows)

    def _run_together(
        self,
        members: list[tuple[int, tier_pb2.Request]],
        received: float,
        replies: MemberReplies,
        caller: str,
        rows: list[dict[str, np.ndarray]] | None = None,
        decoded_ms: float = 0.0,
    ) -> None:
        """Each of ``members`` (seat, request) taken up as far as the tier takes it, their
        steps run as one batch call (each batcher's, a plan's), and those that go on sent
        on as one message; each member still the request it is, with its own checks and
        its own typed error, which fails no other member. ``rows``: each seat's tensors,
        when they came stacked."""
        timings: dict[int, tier_pb2.TierTiming] = {}
        climbs: dict[int, Climb[tier_pb2.Reply | Deposit]] = {}
        for seat, member in members:
            timings[seat] = self._timing(received)
            timings[seat].codec_ms = decoded_ms
            later = functools.partial(replies.put, seat)
            inputs = None if rows is None else rows[seat]
            climbs[seat] = self._climb(member, timings[seat], later, caller, inputs, True)
        went = drive_together(climbs)
        deposits = []
        for seat, member in members:
            outcome = went[seat]
            if isinstance(outcome, Exception):
                outcome = self._failed(member, caller, timings[seat], outcome)
            if isinstance(outcome, Deposit):
                deposits.append(outcome)
            else:
                replies.put(seat, outcome)
        if deposits:
            assert self.forwarder is not None  # _climb checked
            send_together(self.forwarder, self.name, deposits)

    def _run_member(
        self,
        member: tier_pb2.Request,
        seat: int,
        received: float,
        replies: MemberReplies,
        caller: str,
        release: Callable[[], None],
        rows: list[dict[str, np.ndarray]] | None = None,
    ) -> None:
        """One member of a batched request, alone, as :meth:`StreamReader._run` runs a
        request: it waited for its session's request before it. Its rows of the batch's
        stacked tensors (``rows``), if they came so, go with it as its own tensors."""
        if rows is not None:
            put_tensors(member.tensors, rows[seat], RAW)
        try:
            with self.running:
                later = functools.partial(replies.put, seat)
                reply = self.handle(member, received, later, caller)
        finally:
            release()  # this tier's step of the session is done (its state kept)
        if reply is not None:
            replies.put(seat, reply)

    def _climb(
        self,
        request: tier_pb2.Request,
        timing: tier_pb2.TierTiming,
        later: Send,
        caller: str,
        rows: dict[str, np.ndarray] | None = None,
        together: bool = False,
    ) -> Climb[tier_pb2.Reply | Deposit]:
        """Steps 1-2 of [Note: a request at a tier], as far as the tier takes ``request``:
        its reply, or what goes on to the next tier (its reply to come to ``later``).
        ``rows``: a member's tensors, decoded from its batch's stacked ones; ``together``:
        it goes on with its batch's others ([Note: a batch's tensors stacked] in
        tierflow/runtime/batch_message.py)."""
        pipeline = self.pipeline
        if pipeline is None or not self._ready.is_set():
            raise TransportError(f"the {self.name} is not serving yet (its model is loading)")
        index = pipeline.index_of(request.plan_id)
        step = yield from pipeline.climb(
            index, request=request, caller=caller, inputs=rows, together=together
        )
        if isinstance(step, Onward):
            timing.compute_ms = step.compute_s * 1e3
            timing.codec_ms += step.codec_s * 1e3
            if self.forwarder is None:
                plan_id = self.plans.plans[index].plan_id
                raise PlanError(
                    f"plan {plan_id} runs beyond the {self.name}, which has no --upstream"
                )
            return Deposit(pipeline, index, step, request.id, timing, later)
        assert isinstance(step, Answered)
        timing.compute_ms = step.compute_s * 1e3
        reply = pipeline.answer(index, step)
        timing.codec_ms += step.codec_s * 1e3
        reply.timings.append(timing)
        return reply

    def _go_on(self, deposit: Deposit) -> tier_pb2.Reply | None:
        """Send ``deposit`` on to the next tier, with its batch if its step ran in one that
        goes on ([Note: a batch in one message]); None when its reply comes later."""
        seat = departure_seat()
        if seat is not None:
            self._depart(seat[0].deposit(seat[1], deposit))
            return None
        assert self.forwarder is not None  # _climb checked
        d = deposit
        return self.forwarder.forward(d.pipeline, d.index, d.onward, d.request_id, d.timing, d.send)

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
            send_together(self.forwarder, self.name, batch)

    def error_reply(
        self, request_id: str, exc: BaseException, code: str | None = None
    ) -> tier_pb2.Reply:
        """The reply that answers request ``request_id`` with ``exc`` as a typed error."""
        error = error_to_proto(exc, self.name)
        if code is not None:
            error.code = tier_pb2.ErrorCode.Value(code)
        return tier_pb2.Reply(id=request_id, plan_id=self.plan_id, error=error)


def _nothing() -> None:
    pass
