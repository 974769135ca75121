"""The ``Tier`` gRPC service an edge or a cloud runs: answer each request, or forward it.

One :class:`TierService` serves every stream that connects to a tier. Requests from a
stream are read by one thread and run on a shared worker pool (sized to the cores), so
several requests are in progress at once and the tiers work as a pipeline; how few
thread hand-overs a request makes on its way is in [Note: replies written where they
are made]. What a request goes through is in [Note: a request at a tier]; the edge and
the cloud differ only in whether a next tier exists (see ``tierflow.edge.server`` and
``tierflow.cloud.server``).

[Note: a request at a tier]
1. Refuse it if the tier is not ready, the plan id is not one of the tier's plan set, or
   its deadline has passed. Each request names its plan, so requests in flight finish on
   the plan they started with while the device switches ([Note: switching with
   hysteresis] in tierflow/device/switching.py); a plan's sessions open on its first
   request, sharing those of segment files that plans have in common.
2. Check the tensor headers (names, dtypes, shapes, codec, sizes) before decoding any
   payload, so malformed or hostile messages cost nothing; then decode. An edge that
   runs nothing for the plan decodes nothing (only for its feature cache, if it has
   one) and forwards the tensors as they came ([Note: an edge that runs nothing] in
   tierflow/plan.py).
3. Look the features up in the feature cache, if there is one: a hit is the answer.
4. Run this tier's segments; a confident early exit is the answer; so are the model
   outputs when no segment is left.
5. Otherwise encode what the next tier needs with the next link's codec and send it up
   the one stream to the next tier; its reply comes back down with this tier's timing
   and link statistics added.
Every request gets exactly one reply: any failure becomes a ``Reply`` with a typed
``Error`` (see :func:`tierflow.transport.wire.error_to_proto`); the stream itself is never
broken on purpose.
Answers are encoded with the lossless part of the reply link's codec: outputs are small,
and quantising them would change the model's answers.

[Note: replies written where they are made]
On this small machine every wake-up of another thread costs 0.05-0.1 ms, as much as
the codec and compute of a 100 KB feature, so the hot path avoids them. Both changes
below together cut the transport overhead per hop (``benchmarks/transport_bench.py``,
old and new servers side by side in one run, before [Note: slow readers]) from 0.77 to
0.56 ms for 100 KB features and from 1.89 to 1.46 ms for 1 MB (a bare gRPC round trip:
0.38 and 1.05 ms):

* A request that finds no other request in flight on the tier (one at a time, as an
  interactive client sends them) is run by the thread that read it, not handed to the
  pool. With others in flight the pool runs it and the reader reads on, so a pipeline
  always has its next request read ahead.
* Replies are written to the stream through grpc's non-blocking handler form
  (``experimental_non_blocking``: grpc passes the handler a function that writes one
  message and waits until it is written), one at a time per stream. The gRPC thread
  running the handler reads the stream itself, and writes the replies it made; a reply
  any other thread made (a worker, or on the edge the thread that received the cloud's
  reply) goes to the stream's writer thread, for the reason in [Note: slow readers].
  When the reply link is emulated, or a grpc version does not pass that function,
  replies go through a :class:`~tierflow.link.emulation.ShapedQueue` to one writer thread.

[Note: slow readers]
A write waits while the client does not read its replies (HTTP/2 flow control). A
client that keeps sending requests but never reads would so hold whatever thread
writes to it, and on the edge that was the one thread receiving all of the cloud's
replies: every device stalled. So only a thread that belongs to the stream waits for
it: its gRPC thread writes what it made itself (then it reads no further requests
from that client, which is only fair), and replies made anywhere else are handed to
the stream's writer thread (started on first use; a parked thread, like the reader,
never a worker) or queued behind the write in progress. The thread receiving the
cloud's replies, and the workers, never wait for a client (with an emulated reply
link, the stream's one writer thread writes every reply). A write that has waited
``reply_timeout`` seconds (``serve --reply-timeout``, default 5) makes a watchdog
cancel the stream, which ends the waiting write; the stream's queued replies are
dropped, since its client can no longer receive them, and its place is given back
([Note: stream admission] in ``tierflow.runtime.admission``). tierflow's own clients read
their replies at once (``tierflow.transport.stream_client``), so they never meet the limit.
It costs some speed (on the edge, a reply from the cloud now changes threads once more).
``benchmarks/transport_bench.py --against`` runs another checkout's servers side by side
with these, requests interleaved: against d776eb1, the commit before this change, the
servers of 8ac944e (whose serving code differs from it by this change alone) took about
8% more per hop, 1.12 -> 1.21 ms for 100 KB features and 2.30 -> 2.49 ms for 1 MB (30
rounds, a shared 2-core machine). ``benchmarks/results/transport.json`` has the same
comparison for later code.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
import numpy as np

from tierflow.cache.base import CacheAnswer, FeatureCache, cache_key
from tierflow.codec.base import CodecSpec, EncodedTensor, decode
from tierflow.errors import (
    CacheError,
    CodecError,
    DeadlineError,
    InputError,
    PlanError,
    RemoteError,
    TierflowError,
    TransportError,
    UsageError,
)
from tierflow.link.emulation import LinkShaper, ShapedQueue, Transfer
from tierflow.link.spec import TIERS, downstream_link, upstream_link
from tierflow.options import RuntimeOptions
from tierflow.plan import Plan, PlanSet
from tierflow.rpc import tier_pb2, tier_pb2_grpc
from tierflow.runtime.admission import StreamAdmission, peer_host
from tierflow.runtime.providers import describe as describe_providers
from tierflow.runtime.segment_runner import Outcome, SegmentRunner, TierRunner, emulate_slower
from tierflow.runtime.segment_store import SegmentSource, SegmentStore, serve_segment, tier_files
from tierflow.transport.stream_client import StreamClient

if TYPE_CHECKING:
    from tierflow.runtime.metrics import TierMetrics
from tierflow.transport.wire import (
    Undecodable,
    check_deadline,
    decode_tensors,
    error_from_proto,
    error_to_proto,
    from_proto,
    put_tensors,
)

logger = logging.getLogger(__name__)

#: Largest probe reply a tier sends.
MAX_PROBE_BYTES = 64 * 1024 * 1024
#: Bytes a probe stream may be sent beyond what its caller sent ([Note: probe credit]).
PROBE_ALLOWANCE = 64 * 1024


#: Error codes from the next tier that mean it is gone ([Note: answering without the next tier]).
_GONE_CODES = (tier_pb2.ErrorCode.UNAVAILABLE, tier_pb2.ErrorCode.UPSTREAM_UNAVAILABLE)


def _is_gone(exc: BaseException) -> bool:
    """Whether a failure to forward means the next tier is gone (not late, not busy)."""
    if isinstance(exc, RemoteError):
        return exc.code in ("UNAVAILABLE", "UPSTREAM_UNAVAILABLE")
    return isinstance(exc, TransportError) and not isinstance(exc, DeadlineError)


def _reply_codec(plan: Plan, link: str | None) -> CodecSpec:
    """Answers go down with the lossless part of the link's codec ([Note: a request at a tier])."""
    codec = plan.link_codec(link).lossless_part()
    return CodecSpec.parse("raw") if codec.compress == "none" else codec


class _StreamReplies:
    """A stream's replies, written one at a time and in order ([Note: slow readers]).

    A reply the stream's own gRPC thread made is written by that thread; any other
    (from a worker, or from the thread that receives the next tier's replies) is handed
    to the stream's writer thread, started on first use. A reply that finds a write in
    progress is queued, and the thread writing takes it along.
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
        self._owner = threading.current_thread()
        self._lock = threading.Condition()
        self._queue: deque[tier_pb2.Reply] = deque()
        self._writing = False  # some thread is writing, and takes the queue along
        self._handed = False  # the writer thread has a reply to take
        self._closed = False
        self._writer: threading.Thread | None = None
        #: When the write in progress began (monotonic), None while none is.
        self.write_started: float | None = None

    def put(self, reply: tier_pb2.Reply, nbytes: int) -> None:
        with self._lock:
            if self._closed:
                return  # the stream ended: the client cannot receive it
            if self._writing:
                self._queue.append(reply)
                return
            self._writing = True
            if threading.current_thread() is not self._owner:
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


class TierService(tier_pb2_grpc.TierServicer):
    """The ``Tier`` servicer of an edge or a cloud ([Note: a request at a tier]).

    ``upstream`` is the next tier's address; it is required when the plan runs segments
    beyond this tier. ``plan`` may be a whole :class:`~tierflow.plan.PlanSet`: the tier
    serves every plan of it (``plan``, ``plan_id`` and ``runner`` are the default's).
    ``cache`` is any :class:`~tierflow.cache.base.FeatureCache`. ``options`` say how to run:
    ONNX Runtime settings, the links to emulate (``tierflow.link.emulation``), limits, and the
    TLS and token setting of the channel to the next tier. Call
    :meth:`load` before serving.
    """

    def __init__(
        self,
        tier: str,
        plan: Plan | PlanSet,
        plan_dir: str | Path,
        *,
        upstream: str | None = None,
        cache: FeatureCache | None = None,
        options: RuntimeOptions | None = None,
    ) -> None:
        if tier not in ("edge", "cloud"):
            raise UsageError(f"a tier service runs on the edge or the cloud, not on {tier!r}")
        self.tier = tier
        self.plans = plan if isinstance(plan, PlanSet) else PlanSet((plan,))
        self.plan = plan = self.plans.default_plan
        self.plan_dir = Path(plan_dir)
        self.plan_id = plan.plan_id
        self.upstream_address = upstream
        self.cache = cache
        self.options = options = options or RuntimeOptions()
        self.up_link = upstream_link(tier)
        self.down_link = downstream_link(tier)
        self.up_codec = plan.link_codec(self.up_link)
        self.reply_codec = _reply_codec(plan, self.down_link)
        self.pool = ThreadPoolExecutor(
            max_workers=options.workers or os.cpu_count() or 1, thread_name_prefix=f"{tier}-work"
        )
        self.runner: TierRunner | None = None
        self._runners: dict[str, TierRunner] = {}  # by plan id, opened on first use
        self._sessions: dict[Path, SegmentRunner] = {}
        self._runners_lock = threading.Lock()
        self.upstream: StreamClient | None = None
        self.segments: SegmentStore | None = None  # made by load ([Note: segments on demand])
        self._in_flight = 0
        self._count_lock = threading.Lock()
        self.metrics: TierMetrics | None = None  # --metrics-port (tierflow.runtime.metrics)
        self._ready = threading.Event()
        self._stopping = threading.Event()
        self.admission = StreamAdmission(tier, options.max_streams, options.max_streams_per_peer)
        self._streams: set[_StreamReplies] = set()  # watched for slow readers
        self._watchdog: threading.Thread | None = None
        self._closed = threading.Event()
        self._upstream_lost = False  # the next tier was found gone and has not answered since

    # ------------------------------------------------------------------ lifecycle

    def load(self) -> None:
        """Open the channel to the next tier, then load (or fetch) this tier's segments."""
        rank = TIERS.index(self.tier)
        later = any(TIERS.index(s.tier) > rank for p in self.plans.plans for s in p.segments)
        beyond = any(TIERS.index(s.tier) > rank for s in self.plan.segments)
        if beyond or (later and self.upstream_address):
            if self.up_link is None or not self.upstream_address:
                raise UsageError(
                    f"the plan runs segments after the {self.tier}; give the next tier's "
                    "address (--upstream HOST:PORT)"
                )
            shaper = LinkShaper(self.up_link, self.options.links.get(self.up_link))
            self.upstream = StreamClient(
                self.upstream_address,
                me=self.tier,
                peer=TIERS[TIERS.index(self.tier) + 1],
                shaper=shaper,
                max_message_bytes=self.options.max_message_bytes,
                security=self.options.security,
            )
        self.segments = SegmentStore(
            self.plan_dir,
            self.plans,
            tier=self.tier,
            budget=self.options.segment_budget,
            source=None
            if self.upstream is None
            else SegmentSource(
                self.upstream.channel, self.upstream.peer, known_down=self.upstream.known_down
            ),
            on_evict=self._evicted,
        )
        with self.segments.holding(tier_files(self.plans, self.plans.default, self.tier)):
            runner = TierRunner(self.plan, self.plan_dir, self.tier, self.options, self._sessions)
        self.runner = self._runners[self.plan_id] = runner
        self._ready.set()
        logger.info(
            "[%s] plan %s loaded: segments %s on %s, forwards to %s",
            self.tier,
            self.plan_id,
            [i for i, _, _ in runner.segments],
            describe_providers(self.options.providers),
            self.upstream_address if self.upstream else "nobody",
        )

    @property
    def opened_plans(self) -> list[str]:
        """Ids of the plans whose sessions are open: the default's, and those asked for."""
        with self._runners_lock:
            return list(self._runners)

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
        if self.upstream is not None:
            self.upstream.close(timeout=timeout)
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
        """Serve one stream ([Note: replies written where they are made]).

        With ``send_response`` (grpc's non-blocking handler form) the calling thread reads
        the stream and replies are written by whichever thread makes them; without it
        (a grpc that does not offer that form) a reader thread dispatches the requests
        and the returned generator writes the replies.
        """
        self._admit(context)
        spec = self.options.links.get(self.down_link or "")
        shaper = LinkShaper(self.down_link or "", spec)
        if send_response is None or spec is not None:
            return self._serve_queued(request_iterator, context, shaper, send_response)
        lock = threading.Lock()

        def write(reply: tier_pb2.Reply) -> None:
            with lock:  # grpc allows one message in flight per call
                try:
                    send_response(reply)
                except Exception as exc:  # the reply is lost; the request still counts as done
                    # Expected when the device went away: one line, no traceback.
                    logger.warning("[%s] reply %s not delivered: %r", self.tier, reply.id, exc)

        replies = _StreamReplies(write, f"{self.tier}-replies", context)
        self._watch(replies)
        try:
            self._read_stream(request_iterator, replies, context)
        finally:
            with self._count_lock:
                self._streams.discard(replies)
        with lock:
            send_response(None)  # the status: the stream ends normally
        return None

    def _watch(self, replies: _StreamReplies) -> None:
        """Have :meth:`_watch_writes` look after this stream's writes."""
        with self._count_lock:
            self._streams.add(replies)
            if self._watchdog is None:
                self._watchdog = threading.Thread(
                    target=self._watch_writes, name=f"{self.tier}-watchdog", daemon=True
                )
                self._watchdog.start()

    def _watch_writes(self) -> None:
        """Cancel each stream whose reply waited longer than ``reply_timeout`` to be read.

        See [Note: slow readers]; the cancel makes the waiting write return.
        """
        limit = self.options.reply_timeout
        while not self._closed.wait(min(limit / 4, 0.25)):
            now = time.monotonic()
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

    def _serve_queued(
        self,
        request_iterator: Iterator[tier_pb2.Request | Undecodable],
        context: grpc.ServicerContext,
        shaper: LinkShaper,
        send_response: Callable[[tier_pb2.Reply | None], None] | None,
    ) -> Iterator[tier_pb2.Reply] | None:
        """Replies through a queue (shaped links, or no non-blocking form): see Infer."""
        replies: ShapedQueue[tier_pb2.Reply] = ShapedQueue(shaper)
        context.add_callback(replies.close)
        if send_response is None:
            reader = threading.Thread(
                target=self._read_stream,
                args=(request_iterator, replies, context),
                name=f"{self.tier}-stream",
                daemon=True,
            )
            reader.start()
            return replies.drain()
        writer = threading.Thread(
            target=self._write_all,
            args=(replies, send_response, context),
            name=f"{self.tier}-replies",
            daemon=True,
        )
        writer.start()
        self._read_stream(request_iterator, replies, context)
        writer.join()
        send_response(None)
        return None

    def _write_all(
        self,
        replies: ShapedQueue[tier_pb2.Reply],
        send_response: Callable[[tier_pb2.Reply], None],
        context: grpc.ServicerContext,
    ) -> None:
        """Write a stream's queued replies as they leave the queue, watched for a slow reader."""
        watched = _StreamReplies(send_response, f"{self.tier}-replies", context)
        self._watch(watched)  # this thread is its owner: it writes, and the watchdog times it
        try:
            for reply in replies.drain():
                watched.put(reply, 0)
        finally:
            with self._count_lock:
                self._streams.discard(watched)

    def _read_stream(
        self,
        requests: Iterator[tier_pb2.Request | Undecodable],
        replies: ShapedQueue[tier_pb2.Reply] | _StreamReplies,
        context: grpc.ServicerContext,
    ) -> None:
        """Dispatch a stream's requests; close its replies once every one is answered."""
        open_requests = [0]
        done = threading.Condition()

        shaped = (
            isinstance(replies, ShapedQueue)
            and replies.shaper is not None
            and replies.shaper.spec is not None
        )

        def send(reply: tier_pb2.Reply) -> None:
            if self.metrics is not None:
                self.metrics.observe(reply, self.down_link, reply.ByteSize())
            replies.put(reply, reply.ByteSize() if shaped else 0)
            with self._count_lock:
                self._in_flight -= 1
            with done:
                open_requests[0] -= 1
                done.notify_all()

        try:
            for request in requests:
                if isinstance(
                    request, Undecodable
                ):  # see tierflow.transport.wire.add_tier_servicer
                    logger.warning("[%s] %s from %s", self.tier, request.message, context.peer())
                    replies.put(self._error_reply("", CodecError(request.message)), 0)
                    continue
                received = time.perf_counter()
                with done:
                    open_requests[0] += 1
                with self._count_lock:
                    self._in_flight += 1
                    overloaded = self._in_flight > self.options.max_in_flight
                    alone = self._in_flight == 1
                if self._stopping.is_set():
                    stopping = TransportError(f"the {self.tier} is stopping")
                    send(self._error_reply(request.id, stopping))
                    continue
                if overloaded:
                    limit = self.options.max_in_flight
                    overload = TransportError(
                        f"the {self.tier} has {limit} requests in flight already"
                    )
                    send(self._error_reply(request.id, overload, "OVERLOADED"))
                    continue
                if alone:  # nothing else on the tier: no pipeline to keep fed
                    self._handle(request, received, send)
                    continue
                try:
                    self.pool.submit(self._handle, request, received, send)
                except RuntimeError:  # the pool is shut down: the server is stopping
                    send(
                        self._error_reply(
                            request.id, TransportError(f"the {self.tier} is stopping")
                        )
                    )
        except grpc.RpcError:
            pass  # the client went away; its replies have nowhere to go
        except Exception:
            logger.exception("[%s] reading a stream failed", self.tier)
        with done:
            while open_requests[0] > 0 and context.is_active():
                done.wait(0.5)
        replies.close()

    # ------------------------------------------------------------------ requests

    def _runner_for(self, plan_id: str) -> tuple[Plan, TierRunner]:
        """The plan a request names and its runner, opened on first use."""
        with self._runners_lock:
            runner = self._runners.get(plan_id)
            if runner is not None:
                return runner.plan, runner
            plan = next((p for p in self.plans.plans if p.plan_id == plan_id), None)
            if plan is None:
                served = ", ".join(p.plan_id for p in self.plans.plans)
                raise PlanError(
                    f"the {self.tier} serves plans {served}, the request names plan "
                    f"{plan_id or '(none)'}"
                )
            runner = TierRunner(plan, self.plan_dir, self.tier, self.options, self._sessions)
            self._runners[plan_id] = runner
            logger.info("[%s] plan %s opened", self.tier, plan_id)
            return plan, runner

    def _holding(self, plan_id: str) -> contextlib.AbstractContextManager[None]:
        """Hold (fetching if need be) the files of plan ``plan_id`` this tier runs."""
        index = next((i for i, p in enumerate(self.plans.plans) if p.plan_id == plan_id), None)
        if self.segments is None or index is None:
            return contextlib.nullcontext()  # not loaded, or a plan _process refuses
        return self.segments.holding(tier_files(self.plans, index, self.tier))

    def _evicted(self, file: str) -> None:
        """A segment file left the store: drop the sessions on it and the plans using it."""
        path = self.plan_dir / file
        with self._runners_lock:
            self._sessions.pop(path, None)
            for plan_id, runner in list(self._runners.items()):
                if any(spec.file == file for _, spec, _ in runner.segments):
                    del self._runners[plan_id]
                    if runner is self.runner:
                        self.runner = None  # reopened (fetched again) on its next request
                    logger.info("[%s] plan %s closed: segment %s evicted", self.tier, plan_id, file)

    def _error_reply(
        self, request_id: str, exc: BaseException, code: str | None = None
    ) -> tier_pb2.Reply:
        error = error_to_proto(exc, self.tier)
        if code is not None:
            error.code = tier_pb2.ErrorCode.Value(code)
        return tier_pb2.Reply(id=request_id, plan_id=self.plan_id, error=error)

    def _handle(
        self,
        request: tier_pb2.Request,
        received: float,
        send: Callable[[tier_pb2.Reply], None],
    ) -> None:
        timing = tier_pb2.TierTiming(
            tier=self.tier, queue_ms=(time.perf_counter() - received) * 1e3
        )
        if self.metrics is not None:
            send = self.metrics.timed(send, received)
        try:
            with self._holding(request.plan_id):  # its segment files stay while it runs
                reply = self._process(request, timing, send)  # None: the next tier answers
        except TierflowError as exc:
            logger.info("[%s] request %s refused: %s", self.tier, request.id, exc)
            reply = self._error_reply(request.id, exc)
            reply.timings.append(timing)
        except Exception as exc:
            logger.exception("[%s] request %s failed", self.tier, request.id)
            reply = self._error_reply(request.id, exc)
            reply.timings.append(timing)
        if reply is not None:
            reply.id = request.id
            send(reply)

    def _process(
        self,
        request: tier_pb2.Request,
        timing: tier_pb2.TierTiming,
        send: Callable[[tier_pb2.Reply], None],
    ) -> tier_pb2.Reply | None:
        """Steps 1-5 of [Note: a request at a tier]; None when the reply comes later."""
        if not self._ready.is_set():
            raise TransportError(f"the {self.tier} is not serving yet (its model is loading)")
        plan, runner = self._runner_for(request.plan_id)
        deadline = check_deadline(request.deadline_unix_s, time.time())
        if deadline and time.time() > deadline:
            raise DeadlineError(f"the request's deadline passed before the {self.tier} ran it")

        start, cpu = time.perf_counter(), time.thread_time()
        encoded = self._checked(request, runner)
        # [Note: an edge that runs nothing] in tierflow/plan.py: it forwards what came.
        relay = self.tier == "edge" and plan.edge_forwards
        limit = self.options.max_tensor_bytes  # read-only views: ONNX Runtime only reads them
        features = (
            {}
            if relay and self.cache is None
            else {t.name: decode(t, max_bytes=limit, writable=False) for t in encoded}
        )
        # See [Note: emulating a slower tier] in tierflow/runtime/segment_runner.py.
        emulate_slower(self.options.slowdown, cpu, time.thread_time)
        codec_s = time.perf_counter() - start

        key: bytes | None = None
        if self.cache is not None:
            answer, key = self._lookup(plan, request.segment, features)
            if answer is not None:
                start, cpu = time.perf_counter(), time.thread_time()
                reply = self._answer(plan, answer.outputs, answer.exit)
                reply.cache_hit = True
                emulate_slower(self.options.slowdown, cpu, time.thread_time)
                timing.codec_ms = (codec_s + time.perf_counter() - start) * 1e3
                reply.timings.append(timing)  # a copy: every field is set by now
                return reply

        outcome = Outcome({}, False, next_segment=runner.start) if relay else runner.run(features)
        timing.compute_ms = outcome.compute_s * 1e3
        start, cpu = time.perf_counter(), time.thread_time()
        if outcome.final:
            reply = self._answer(plan, outcome.tensors, outcome.exit)
            emulate_slower(self.options.slowdown, cpu, time.thread_time)
            timing.codec_ms = (codec_s + time.perf_counter() - start) * 1e3
            reply.timings.append(timing)
            if key is not None:
                self._store(key, features, outcome.tensors, outcome.exit)
            return reply

        if self.upstream is None:
            raise PlanError(
                f"plan {plan.plan_id} runs beyond the {self.tier}, which has no --upstream"
            )
        forward = tier_pb2.Request(
            plan_id=plan.plan_id, segment=outcome.next_segment, deadline_unix_s=deadline or 0.0
        )
        assert self.up_link is not None  # an upstream exists only below the cloud
        if relay:
            forward.tensors.extend(request.tensors)
            nbytes = sum(t.nbytes for t in encoded)
        else:
            codec = plan.link_codec(self.up_link)
            nbytes = put_tensors(forward.tensors, outcome.tensors, codec, plan.images)
        emulate_slower(self.options.slowdown, cpu, time.thread_time)
        timing.codec_ms = (codec_s + time.perf_counter() - start) * 1e3
        local_deadline = None
        if deadline:
            local_deadline = time.monotonic() + max(deadline - time.time(), 0.0)
        try:
            sent = self.upstream.submit(forward, deadline=local_deadline, nbytes=nbytes)
        except TransportError as exc:  # known to be down: no waiting for it
            reply = self._without_upstream(plan, outcome.unconfident, exc)
            reply.timings.append(timing)
            return reply
        sent.future.add_done_callback(
            lambda future: self._forwarded(
                future,
                request.id,
                timing,
                sent.transfer,
                key,
                features,
                send,
                plan,
                outcome.unconfident,
            )
        )
        return None

    def _checked(self, request: tier_pb2.Request, runner: TierRunner) -> list[EncodedTensor]:
        """The request's tensors, their headers (names, dtypes, shapes) checked.

        Payloads are decoded after ([Note: a request at a tier]), if at all.

        The segment and the tensor count are checked before anything else: a request of
        two million tiny tensors costs no more than one of the plan's size. Each tensor's
        dtype and shape are checked against the segment's input before any payload is
        decoded, so a tensor decodes to exactly the size the plan expects (at most
        ``max_tensor_bytes`` along a symbolic dimension).
        """
        if request.segment != runner.start:
            runner.check_names(set(), segment=request.segment)  # raises: wrong segment
        if len(request.tensors) != len(runner.needs):
            raise InputError(
                f"the {self.tier} expects {len(runner.needs)} tensors {list(runner.needs)}, "
                f"the request carries {len(request.tensors)}"
            )
        encoded = [from_proto(m, max_bytes=self.options.max_tensor_bytes) for m in request.tensors]
        names = [t.name for t in encoded]
        if len(set(names)) != len(names):
            raise CodecError(f"tensor names repeat in one request: {sorted(names)}")
        runner.check_names(set(names), segment=request.segment)
        specs = runner.input_specs()
        for tensor in encoded:
            spec = specs.get(tensor.name)
            if spec is not None:
                spec.check(tensor.dtype, tensor.shape, f"the {self.tier}'s")
        return encoded

    def _answer(
        self, plan: Plan, outputs: Mapping[str, np.ndarray], exit_name: str | None
    ) -> tier_pb2.Reply:
        reply = tier_pb2.Reply(plan_id=plan.plan_id, answered_by=self.tier, exit=exit_name or "")
        codec = self.reply_codec if plan is self.plan else _reply_codec(plan, self.down_link)
        put_tensors(reply.outputs, outputs, codec)
        return reply

    def _forwarded(
        self,
        future: Future[tier_pb2.Reply],
        request_id: str,
        timing: tier_pb2.TierTiming,
        transfer: Transfer,
        key: bytes | None,
        features: dict[str, np.ndarray],
        send: Callable[[tier_pb2.Reply], None],
        plan: Plan,
        unconfident: tuple[str, np.ndarray] | None,
    ) -> None:
        """The next tier answered (or failed): add this tier's figures and pass it down."""
        gone: TierflowError | None = None
        try:
            reply = future.result()
            if reply.HasField("error") and reply.error.code in _GONE_CODES:
                gone = error_from_proto(reply.error)
        except TierflowError as exc:
            reply = self._error_reply(request_id, exc)
            gone = exc if _is_gone(exc) else None
        except Exception as exc:  # a cancelled future, a bug: still one reply
            reply = self._error_reply(request_id, exc)
        if gone is not None:
            reply = self._without_upstream(plan, unconfident, gone)
        elif self._upstream_lost and not reply.HasField("error"):
            self._upstream_lost = False
            logger.info("[%s] the %s answers again", self.tier, self._next_tier)
        reply.id = request_id
        reply.timings.append(timing)
        if self.up_link is not None:
            reply.links.append(transfer.stat(self.up_link))
        send(reply)
        cacheable = not (reply.HasField("error") or reply.cache_hit or reply.fallback)
        if key is not None and cacheable:
            outputs = list(reply.outputs)
            exit_name = reply.exit or None
            self.pool.submit(self._store_reply, key, features, outputs, exit_name)

    def _without_upstream(
        self,
        plan: Plan,
        unconfident: tuple[str, np.ndarray] | None,
        cause: TierflowError,
    ) -> tier_pb2.Reply:
        """The reply to a request the next tier cannot take (it is gone).

        [Note: answering without the next tier]
        When the next tier cannot be reached (the stream to it broke, it is known to be
        down, or it answered UNAVAILABLE because it is stopping), a request that has
        already crossed to this tier still gets one answer from here. If the plan has
        an early exit on this tier, the request's scores at that exit (checked and found
        not confident enough) are the answer, marked with ``Reply.fallback`` (why), never
        cached. Otherwise the reply is an ``UPSTREAM_UNAVAILABLE`` error: the device,
        which still holds the request's inputs, finishes it with a plan of its set that
        does not need the missing tier ([Note: losing a tier] in
        tierflow/device/client.py). The features computed here are not sent back: the
        device would need the missing tier's segment files to use them, and a plan
        without that tier reproduces the model from the inputs bit for bit anyway.
        """
        peer = self._next_tier
        if not self._upstream_lost:
            self._upstream_lost = True
            how = "from its exits" if unconfident is not None else "UPSTREAM_UNAVAILABLE"
            logger.warning(
                "[%s] the %s is unavailable (%s); answering %s", self.tier, peer, cause, how
            )
        if unconfident is None:
            missing = TransportError(f"the {peer} is unavailable: {cause}")
            return self._error_reply("", missing, "UPSTREAM_UNAVAILABLE")
        name, scores = unconfident
        reply = self._answer(plan, {name: scores}, name)
        reply.fallback = f"the {peer} is unavailable ({cause}); answered at the {self.tier}'s exit"
        return reply

    @property
    def _next_tier(self) -> str:
        return TIERS[TIERS.index(self.tier) + 1] if self.tier != TIERS[-1] else "next tier"

    # ------------------------------------------------------------------ cache

    def _lookup(
        self, plan: Plan, segment: int, features: dict[str, np.ndarray]
    ) -> tuple[CacheAnswer | None, bytes]:
        assert self.cache is not None
        key = cache_key(plan.model_sha256, plan.plan_id, segment, features)
        try:
            answer = self.cache.lookup(key, features)
        except CacheError as exc:
            logger.warning("[%s] cache lookup failed, running the model: %s", self.tier, exc)
            return None, key
        return answer, key

    def _store(
        self,
        key: bytes,
        features: dict[str, np.ndarray],
        outputs: Mapping[str, np.ndarray],
        exit_name: str | None,
    ) -> None:
        assert self.cache is not None
        try:
            self.cache.store(key, features, CacheAnswer(dict(outputs), exit_name))
        except CacheError as exc:
            logger.warning("[%s] cache store failed: %s", self.tier, exc)

    def _store_reply(
        self,
        key: bytes,
        features: dict[str, np.ndarray],
        outputs: list[tier_pb2.Tensor],
        exit_name: str | None,
    ) -> None:
        try:
            self._store(key, features, decode_tensors(outputs), exit_name)
        except Exception:
            logger.exception("[%s] could not cache the next tier's answer", self.tier)

    # ------------------------------------------------------------------ segments

    def FetchSegment(
        self, request: tier_pb2.SegmentRequest, context: grpc.ServicerContext
    ) -> Iterator[tier_pb2.SegmentChunk]:
        """A segment file in chunks, for the tier below ([Note: segments on demand])."""
        self._admit(context)
        if self.segments is None or not self._ready.is_set():
            context.abort(grpc.StatusCode.UNAVAILABLE, f"the {self.tier} is not serving yet")
            return
        shaper = LinkShaper(self.down_link or "", self.options.links.get(self.down_link or ""))
        yield from serve_segment(self.segments, request, context, shaper)

    # ------------------------------------------------------------------ probe

    def Probe(
        self,
        request_iterator: Iterator[tier_pb2.ProbeMessage | Undecodable],
        context: grpc.ServicerContext,
    ) -> Iterator[tier_pb2.ProbeMessage]:
        """Echo ``reply_bytes`` bytes for each message; the tier's name goes in the metadata.

        [Note: probe credit]
        A probe stream is sent at most what its caller sent on it, plus
        :data:`PROBE_ALLOWANCE`: asking for more gets a shorter reply. A probe so costs the
        caller as many bytes as the tier, and a small request can never make a tier send a
        large answer. ``tierflow probe`` sends its payload up before asking
        for it down, so it never meets the bound.
        """
        self._admit(context)
        context.send_initial_metadata((("tierflow-tier", self.tier),))
        zeros = b""
        credit = PROBE_ALLOWANCE
        for message in request_iterator:
            if isinstance(message, Undecodable):  # see tierflow.transport.wire.add_tier_servicer
                logger.warning("[%s] %s from %s", self.tier, message.message, context.peer())
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, message.message)
                return  # abort raises; this is for the type checker
            credit += len(message.payload)
            size = min(max(message.reply_bytes, 0), MAX_PROBE_BYTES, credit)
            credit -= size
            if len(zeros) != size:
                zeros = bytes(size)
            yield tier_pb2.ProbeMessage(seq=message.seq, payload=zeros, reply_bytes=size)


# grpc calls a handler marked so with a third argument, a function that writes one reply
# (None: the final status) from any thread ([Note: replies written where they are made]).
TierService.Infer.experimental_non_blocking = True  # type: ignore[attr-defined]
