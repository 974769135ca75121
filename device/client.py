"""The device runtime: run the first segment(s) here, stream the features to the edge.

:class:`DeviceClient` is what ``tierflow run``, ``tierflow device``, the demo and the
benchmarks call. It is the device's :class:`~tierflow.runtime.pipeline.Pipeline` (the
same request path every tier runs: cache, segments and exits, encoding for the next
link; [Note: one request path] in tierflow/runtime/pipeline.py) plus what only a device
does: choosing a plan per request from the link estimates (``tierflow.device.adaptation``),
finishing requests without a missing tier (``tierflow.device.fallback``), and sending to
the edge on one long-lived stream with up to ``window`` requests in flight, so that
device, links, edge and cloud work as a pipeline. Each request ends as one
:class:`~tierflow.device.results.Result`: the outputs, or a typed error
(``TransportError``, ``DeadlineError`` or ``RemoteError``), never a hang: a request not
answered within ``deadline_s`` fails with a ``DeadlineError``, and a tier that goes away
fails every request in flight at once (see ``tierflow.transport.stream_client``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import logging
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path

import numpy as np

from tierflow.cache.base import FeatureCache
from tierflow.codec.spec import CodecSpec
from tierflow.device.adaptation import Adaptation
from tierflow.device.batched_send import DeviceDeposit, member_sent, send_up
from tierflow.device.fallback import (
    DEFAULT_RETRY_S,
    MissingTiers,
    device_only,
    runs_on_device_only,
)
from tierflow.device.in_flight import tickets
from tierflow.device.probing import DEFAULT_IDLE_S
from tierflow.device.results import DEFAULT_DEADLINE_S, Result, Ticket, local_ms
from tierflow.errors import (
    InputError,
    StateError,
    TierflowError,
    TransportError,
    UsageError,
    is_upstream_gone,
)
from tierflow.link.spec import LINKS
from tierflow.options import RuntimeOptions
from tierflow.plan import load_plan_set
from tierflow.rpc import tier_pb2
from tierflow.runtime.batching import Departure, departure_seat
from tierflow.runtime.pipeline import (
    Answered,
    Climb,
    Down,
    Onward,
    Pipeline,
    SessionStep,
    check_initial_state,
    drive_together,
    split_first_state,
    up,
)
from tierflow.runtime.segment_runner import TierRunner
from tierflow.runtime.segment_store import tier_files
from tierflow.runtime.upstream import StreamUpstream, Upstream
from tierflow.state.store import check_session_id
from tierflow.transport.deadline import Deadline
from tierflow.transport.stream_client import Sent
from tierflow.transport.wire import put_tensors

__all__ = [
    "DEFAULT_DEADLINE_S",
    "DEFAULT_RETRY_S",
    "DeviceClient",
    "Result",
    "SessionRequest",
    "Ticket",
]

logger = logging.getLogger(__name__)

DEFAULT_WINDOW = 16
#: How a session's first state values for the tiers above travel.
_INITIAL_STATE_CODEC = CodecSpec.parse("zstd")
#: Sessions whose plan the client remembers (the least recently started forgotten first).
_SESSIONS_KEPT = 10_000


# [Note: sessions stepped together]
# A device that serves several local sessions (a gateway, an app with several users) can
# step them with a thread each, DeviceClient.submit from each, and let its step batcher
# gather their steps ([Note: the step batcher] in tierflow/runtime/batching.py); or step
# them from one thread, :meth:`DeviceClient.submit_together` (TierDecoder.choose_together
# for decoders). That takes every request up together, as a tier takes the members of a
# batched request ([Note: a batch in one message] in tierflow/runtime/batch_message.py;
# :func:`~tierflow.runtime.pipeline.drive_together`): each request's own checks and
# session step, their device steps in one batch call (StepBatcher.run_all: they are each
# other's company, so none waits for a --batch-delay), and the steps that go on as one
# message to the edge, which runs them as one call and sends them on as one. Each still
# gets its own ticket and its own typed error. TierDecoder.choose_together tries the
# steps that a missing tier failed again together, with backoff, while each decoder's
# retry_s lasts (one session's tries after another's would take N times as long to give
# up), and replays a step whose tier lost its session alone.
#
# What it saves is the threads. When a round's answers come, a thread a session means
# each thread wakes in turn for its own, makes its next step and waits again at the
# batcher, and again after the call to send its step on: two wake-ups a session a round,
# one after another on the GIL. Measured on one device process, 16 sessions, a tiny
# Qwen2-shaped decoder whose round is all overhead, cloud-only: a round of 22.6-24.9 ms
# with a thread a session against 17.8-19.1 stepped together; on the 0.95 GB decoder
# (benchmarks/batching.py's), the device's CPU a round went from 8.3-10.0 ms to 5.2-5.7.
# And with no delay to wait for company, the default --batch-delay 0 batches whole
# rounds on every tier. In that benchmark's run of 2026-12-07 09:18, 16 sessions of the
# split plan took 67.8 ms a round stepped together and 71.4 a thread each (--batch-delay
# 10ms, every round whole on every tier). What the threads cost is CPU, not order:
# having the thread that led the device's call take every member on and send the message
# before waking any (tried that day) let the message leave 1.0 ms sooner after the call,
# and rounds were no shorter (three pairs in turn: 69.3, 68.7 and 70.1 ms against 69.3,
# 70.0 and 68.6), since the woken threads then ran while the message was away, on the two
# cores the edge's and the cloud's calls use.


@dataclasses.dataclass(frozen=True)
class SessionRequest:
    """One session's request of :meth:`DeviceClient.submit_together`, as
    :meth:`DeviceClient.submit` takes it."""

    inputs: Mapping[str, np.ndarray]
    session: str
    position: int
    keep_last: int = 0
    choices_only: bool = False


class DeviceClient:
    """Runs a plan from the device: local segments, then the edge and cloud over gRPC.

    ``edge`` (``HOST:PORT``) is needed unless the plan runs entirely on the device.
    ``options`` say how to run: ONNX Runtime settings, emulated links (only
    ``device-edge`` matters here), limits, and the TLS and token setting of the channel
    to the edge. ``window`` requests are in flight at most; each fails with a
    ``DeadlineError`` if not answered within ``deadline_s``. ``cache`` (any
    :class:`~tierflow.cache.base.FeatureCache`, e.g. from ``run --cache``) is looked up
    with the model inputs before anything runs: a hit is answered here, with no compute
    and nothing sent (``answered_by`` "device", ``cache_hit``); every answer is stored
    when its result is read. When the plan directory also holds a device-only plan,
    requests the edge cannot take are answered with it ([Note: device fallback] in
    device/fallback.py); while the cloud is missing, plans that do not need it
    answer ([Note: losing a tier] there). With a plan set that switches, the plan is
    chosen per request ([Note: switching plans on the device] in
    device/adaptation.py; ``adaptive=False`` keeps the default plan). Use as a
    context manager, or call :meth:`close`.
    """

    def __init__(
        self,
        plan_dir: str | Path,
        edge: str | None = None,
        *,
        options: RuntimeOptions | None = None,
        window: int = DEFAULT_WINDOW,
        deadline_s: Deadline | float = DEFAULT_DEADLINE_S,
        cache: FeatureCache | None = None,
        adaptive: bool = True,
        idle_probe_s: float | None = DEFAULT_IDLE_S,
        retry_s: float = DEFAULT_RETRY_S,
        upstream: Upstream | None = None,
    ) -> None:
        if window < 1:
            raise UsageError(f"the window must be at least 1 request, got {window}")
        # Checked when made: [Note: one deadline] in tierflow.transport.deadline.
        self.deadline = Deadline.of(deadline_s)
        self.options = options = options or RuntimeOptions()
        self.plans = plans = load_plan_set(plan_dir, require_segments=False)
        self.plan = plans.default_plan
        self.plan_id = self.plan.plan_id
        self.plan_dir = plan_dir
        self.window = window
        self.deadline_s = self.deadline.seconds
        self.max_tensor_bytes = options.max_tensor_bytes
        self.cache = cache
        self.codec = self.plan.link_codec("device-edge")
        self.local_only = runs_on_device_only(self.plan)
        self.fallback_plan = None if self.local_only else device_only(plans.plans)
        #: The edge ([Note: the next tier in process] in tierflow/runtime/upstream.py).
        self.upstream = upstream
        self._ids = itertools.count()
        remote = any(not runs_on_device_only(plan) for plan in plans.plans)
        if upstream is None and (not self.local_only or (edge and remote)):
            if not edge:
                raise UsageError(
                    "the plan runs segments on the edge or the cloud; give the edge's "
                    "address (--edge HOST:PORT)"
                )
            self.upstream = StreamUpstream(edge, me="device", peer="edge", options=options)
        #: The gRPC stream to the edge (None: no edge, or the edge in this process).
        self.stream = None if self.upstream is None else self.upstream.stream
        source = None if self.upstream is None else self.upstream.segment_source()
        self.pipeline = Pipeline("device", plans, plan_dir, options, cache=cache, source=source)
        self.segments = self.pipeline.segments
        self._fetching_ahead = threading.Lock()  # one fetch ahead at a time
        try:
            self.pipeline.runner(plans.default)  # fetched and opened now, not at the first request
        except BaseException:
            if self.upstream is not None:
                self.upstream.close()
            raise
        self.adaptation = Adaptation(
            plans,
            self.segments,
            self.stream,
            adaptive=adaptive,
            idle_probe_s=idle_probe_s,
            on_answer=self._answered,
        )
        self.selector = self.adaptation.selector
        self.estimators = self.adaptation.estimators
        self.prober = self.adaptation.prober
        self.tiers = MissingTiers(
            plans, retry_s, self.adaptation.closest if self.selector is not None else None
        )
        self.retry_s = retry_s
        self._session_plans: dict[str, int] = {}  # the plan each session runs on
        self._session_lock = threading.Lock()

    def __enter__(self) -> DeviceClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.adaptation.close()
        if self.upstream is not None:
            self.upstream.close()
        self.pipeline.close()

    @property
    def runner(self) -> TierRunner:
        """The default plan's device runner (reopened, its files fetched, if evicted)."""
        return self.pipeline.runner(self.plans.default)

    # ------------------------------------------------------------------ requests

    def submit(
        self,
        inputs: Mapping[str, np.ndarray],
        *,
        session: str | None = None,
        position: int = 0,
        keep_last: int = 0,
        choices_only: bool = False,
        replay_to: int = 0,
    ) -> Ticket:
        """Run the device's part now and send the rest on; errors end up in the Result.

        The plan is chosen per request ([Note: switching plans on the device]). While the
        edge is known to be down, and no device exit could answer, the request fails at
        once without running anything (see [Note: retries and failing fast]).

        ``session`` names the session of a stateful plan and ``position`` the steps its
        state holds before this request ([Note: session state on a tier] in
        tierflow/state/store.py); at position 0, ``inputs`` may also hold the first
        value of a fixed-shape state, which goes to the tier that owns it. A session
        keeps the plan it started on. ``keep_last``: a decoder step's answer keeps the
        logits of its last positions only (0: all); ``choices_only``: it carries each
        position's argmax in their place (tier.proto: Request.choices_only). ``replay_to``:
        the request is a replay's, rebuilding the session up to that position ([Note:
        replaying a session] in device/generation.py).
        """
        if session is None:
            index, switch = self.adaptation.choose()
            index, switch, avoided = self.tiers.adjust(index, switch)
        else:
            index, switch, avoided = self._session_plan(session, position), None, None
        plan = self.plans.plans[index]
        try:
            with self.pipeline.holding(index):
                step = self._step(
                    index, session, position, inputs, keep_last, choices_only, replay_to
                )
                ticket = self._submit(inputs, index, step=step)
        except TierflowError as exc:  # its segments could not be fetched
            request_id, started = str(next(self._ids)), time.perf_counter()
            result = None
            if isinstance(exc, TransportError):
                arrays = {name: np.asarray(value) for name, value in inputs.items()}
                result = self._fall_back(request_id, started, arrays, exc)
            if result is None:
                ticket = self._local(request_id, started, error=exc)
            else:
                ticket = Ticket(request_id, started, result.ms["device"], result=result)
        ticket.plan, ticket.switch, ticket.avoided = plan.plan_id, switch, avoided
        return ticket

    def submit_together(self, requests: Sequence[SessionRequest]) -> list[Ticket]:
        """Several sessions' requests at once, from this thread ([Note: sessions stepped
        together]): their device steps run as one batch call and those that go on leave
        as one message; a ticket each, in order, each resolving to its own Result (its
        own typed error if it failed, which fails no other)."""
        tickets: dict[int, Ticket] = {}
        climbs: dict[int, Climb[Answered | Onward | Ticket]] = {}
        begun: dict[int, tuple[str, float, int]] = {}
        plans_held: set[int] = set()
        with contextlib.ExitStack() as held:
            for i, request in enumerate(requests):
                request_id, started = str(next(self._ids)), time.perf_counter()
                index = self._session_plan(request.session, request.position)
                begun[i] = (request_id, started, index)
                try:
                    if index not in plans_held:  # its files, fetched if need be
                        held.enter_context(self.pipeline.holding(index))
                        plans_held.add(index)
                    step = self._step(
                        index,
                        request.session,
                        request.position,
                        request.inputs,
                        request.keep_last,
                        request.choices_only,
                    )
                    arrays = self._model_inputs(request.inputs, index)
                    climbs[i] = self.pipeline.climb(
                        index,
                        inputs=arrays,
                        session=step,
                        deadline_unix_s=self.deadline.expires_unix_s(time.time()),
                        next_down=functools.partial(self._edge_down, request_id, started, arrays),
                        together=True,
                    )
                except TierflowError as exc:
                    tickets[i] = self._local(request_id, started, error=exc)
            going: dict[int, DeviceDeposit] = {}
            for i, reached in drive_together(climbs).items():
                if isinstance(reached, Onward):
                    going[i] = self._deposit(reached)
                else:
                    request_id, started, _ = begun[i]
                    tickets[i] = self._reached(request_id, started, reached)
        if going and self.upstream is not None:  # encoded as one message here
            send_up(self.upstream, list(going.values()), self.adaptation.sent)
        for i, deposit in going.items():
            request_id, started, index = begun[i]
            tickets[i] = self._going(request_id, started, index, deposit.onward, deposit.sent)
        plan = self.plans.plans
        for i, ticket in tickets.items():
            ticket.plan = plan[begun[i][2]].plan_id
        return [tickets[i] for i in range(len(requests))]

    def _session_plan(self, session: str, position: int) -> int:
        """The plan of ``session``: the one it started on, or (at its start) the default."""
        with self._session_lock:
            if position == 0 or session not in self._session_plans:
                self._session_plans[session] = self.plans.default
                while len(self._session_plans) > _SESSIONS_KEPT:
                    del self._session_plans[next(iter(self._session_plans))]
            return self._session_plans[session]

    def _step(
        self,
        index: int,
        session: str | None,
        position: int,
        inputs: Mapping[str, np.ndarray],
        keep_last: int = 0,
        choices_only: bool = False,
        replay_to: int = 0,
    ) -> SessionStep | None:
        """The device's session step for a request; a state value in ``inputs`` (position 0)
        is kept here if the device owns that state, else passed on to the tier that does."""
        if session is None:
            return None
        check_session_id(session)  # it travels with every request of the session
        states = self.plans.plans[index].state_inputs
        given = {name: np.asarray(v) for name, v in inputs.items() if name in states}
        if given and position != 0:
            raise StateError(
                f"session {session!r}: a state value ({sorted(given)}) comes with the first "
                f"request (position 0) only, this one is at position {position}"
            )
        mine: dict[str, np.ndarray] = {}
        passed = tier_pb2.Request()
        if given:  # a first request's state values
            check_initial_state(
                self.plans.plans[index].states,
                [(k, v.dtype.name, tuple(v.shape)) for k, v in given.items()],
                f"session {session!r}",
            )
            mine, others = split_first_state(self.pipeline.runner(index), given)
            if others:  # for the tiers above
                put_tensors(passed.initial_state, others, _INITIAL_STATE_CODEC)
        return SessionStep(
            session,
            position,
            mine,
            list(passed.initial_state),
            keep_last,
            choices_only,
            replay_to=replay_to,
        )

    def _submit(
        self,
        inputs: Mapping[str, np.ndarray],
        index: int,
        request_id: str | None = None,
        *,
        step: SessionStep | None = None,
    ) -> Ticket:
        """The device's part of [Note: one request path] for plan ``index``.

        ``request_id``: a request sent again keeps its id (new ones get the next).
        """
        request_id = str(next(self._ids)) if request_id is None else request_id
        started = time.perf_counter()
        done: Answered | Ticket | Exception
        try:
            arrays = self._model_inputs(inputs, index)
            send = functools.partial(
                self._send, request_id, started, arrays, index, stateful=step is not None
            )
            try:
                climb = self.pipeline.climb(
                    index,
                    inputs=arrays,
                    session=step,
                    deadline_unix_s=self.deadline.expires_unix_s(time.time()),
                    next_down=functools.partial(self._edge_down, request_id, started, arrays),
                )
                done = up(climb, send)
            finally:  # a step of a batch call that did not go up settles its seat
                self._leave(departure_seat())
        except Exception as exc:
            done = exc
        return self._reached(request_id, started, done)

    def _model_inputs(self, inputs: Mapping[str, np.ndarray], index: int) -> dict[str, np.ndarray]:
        """``inputs`` without the first state values (the session step carries those)."""
        states = self.plans.plans[index].state_inputs
        return {n: np.asarray(v) for n, v in inputs.items() if n not in states}

    def _reached(
        self, request_id: str, started: float, done: Answered | Ticket | Exception
    ) -> Ticket:
        """The ticket of a request whose way up on the device ended: answered here, sent
        (its ticket), or failed (one Result still, with its typed error)."""
        if isinstance(done, Ticket):
            return done
        if isinstance(done, TierflowError):
            return self._local(request_id, started, error=done)
        if isinstance(done, Exception):  # onnxruntime or numpy on odd input
            logger.error("[device] request %s failed", request_id, exc_info=done)
            return self._local(request_id, started, error=InputError(str(done)))
        if not done.cache_hit:
            self.adaptation.demand()  # chosen on a link estimate it cannot refresh
        return self._local(
            request_id, started, outputs=done.outputs, exit_name=done.exit, cache_hit=done.cache_hit
        )

    def _edge_down(
        self,
        request_id: str,
        started: float,
        arrays: dict[str, np.ndarray],
        runner: TierRunner,
    ) -> Ticket | None:
        """The device's check between the cache and the segments ([Note: one request
        path]): while the edge is known to be down and no device exit could answer, the
        request is answered another way at once (or fails), without running anything."""
        exits = any(spec.exits for _, spec, _ in runner.segments)
        upstream = self.upstream
        if upstream is None or exits or not upstream.known_down():
            return None
        down = TransportError(f"the edge at {upstream.address} is down; not running")
        result = self._fall_back(request_id, started, arrays, down)
        if result is None:
            raise down
        return Ticket(request_id, started, result.ms["device"], result=result)

    def _send(
        self,
        request_id: str,
        started: float,
        arrays: dict[str, np.ndarray],
        index: int,
        onward: Onward,
        *,
        stateful: bool = False,
    ) -> Ticket:
        """Send ``onward`` to the edge; its Ticket resolves when the reply comes, through the
        pipeline's way down ([Note: one request path]).

        A session's request is not answered another way when a tier is missing: its
        state is on the tiers it started on (``stateful``).
        """
        assert self.upstream is not None
        seat = departure_seat()
        if seat is not None and stateful:
            return self._depart(seat, request_id, started, index, onward)
        self._leave(seat)
        device_ms = (time.perf_counter() - started) * 1e3
        fallback = None
        if not stateful:
            fallback = functools.partial(self._fall_back, request_id, started, arrays)
        deadline = self.deadline.expires_monotonic(time.monotonic())
        try:
            sent = self.pipeline.send(self.upstream, index, onward, deadline=deadline)
        except TierflowError as exc:
            return self._local(request_id, started, error=exc)
        if isinstance(sent, Down):  # refused at once: the edge is known to be down
            result = None
            if fallback is not None and sent.gone is not None:
                result = fallback(sent.gone, sent.answered)
            if result is None:
                refused = sent.gone or sent.failure  # the TransportError submit raised
                assert isinstance(refused, TierflowError)
                return self._local(request_id, started, error=refused)
            return Ticket(request_id, started, result.ms["device"], result=result)
        self.adaptation.sent(sent)
        return Ticket(
            request_id,
            started,
            device_ms,
            compute_ms=onward.compute_s * 1e3,
            sent=sent,
            timeout=self.deadline_s,
            max_tensor_bytes=self.max_tensor_bytes,
            came_down=functools.partial(self._came_down, index, onward),
            fallback=fallback,
        )

    def _depart(
        self,
        seat: tuple[Departure, int],
        request_id: str,
        started: float,
        index: int,
        onward: Onward,
    ) -> Ticket:
        """A session's step that ran in a batch call goes up with the batch's other steps,
        as one message ([Note: a batch in one message] in
        tierflow/runtime/batch_message.py; device/batched_send.py)."""
        deposit = self._deposit(onward)
        self._send_batch(seat[0].deposit(seat[1], deposit))
        return self._going(request_id, started, index, onward, deposit.sent)

    def _deposit(self, onward: Onward) -> DeviceDeposit:
        """``onward`` as one member of a message of several sessions' steps."""
        deadline = self.deadline.expires_monotonic(time.monotonic())
        return DeviceDeposit(onward, member_sent(onward), deadline)

    def _going(
        self, request_id: str, started: float, index: int, onward: Onward, sent: Sent
    ) -> Ticket:
        """The ticket of a session's step sent up as a member of a message."""
        return Ticket(
            request_id,
            started,
            (time.perf_counter() - started) * 1e3,
            compute_ms=onward.compute_s * 1e3,
            sent=sent,
            timeout=self.deadline_s,
            max_tensor_bytes=self.max_tensor_bytes,
            came_down=functools.partial(self._came_down, index, onward),
        )

    def _leave(self, seat: tuple[Departure, int] | None) -> None:
        """The step of a batch call goes no further up (answered here, or failed)."""
        if seat is not None:
            self._send_batch(seat[0].settle(seat[1]))

    def _send_batch(self, deposits: list[object] | None) -> None:
        """Send a batch call's steps that go up, once the last has settled."""
        if deposits and self.upstream is not None:
            batch = [d for d in deposits if isinstance(d, DeviceDeposit)]
            send_up(self.upstream, batch, self.adaptation.sent)

    def _came_down(
        self,
        index: int,
        onward: Onward,
        got: tier_pb2.Reply | BaseException,
        outputs: Mapping[str, np.ndarray] | None,
    ) -> Down:
        return self.pipeline.came_down(index, onward, got, outputs=outputs)

    def _answered(self, reply: tier_pb2.Reply) -> None:
        """The edge answered: the cloud may be missing or back; the link is up."""
        self.tiers.track(reply)
        self._fetch_ahead()

    def _fetch_ahead(self) -> None:
        """Fetch, in the background, the device files the next requests may need.

        Those of the device-only plan ([Note: device fallback]) and of the plan the
        selector is about to switch to ([Note: switching plans on the device]), when the
        store's budget holds them beside the current plan's files. One fetch at a time.
        """
        upstream = self.upstream
        if self.segments.source is None or upstream is None or upstream.known_down():
            return
        wanted = [spec.file for spec in self.fallback_plan.segments] if self.fallback_plan else []
        current, candidate = self.adaptation.candidate()
        if candidate is not None:
            wanted += tier_files(self.plans, candidate, "device")
        missing = [name for name in dict.fromkeys(wanted) if not self.segments.present(name)]
        keep = tier_files(self.plans, current, "device")
        if not missing or not self.segments.fits(missing, keep=keep):
            return
        if not self._fetching_ahead.acquire(blocking=False):
            return
        threading.Thread(
            target=self._fetch, args=(missing,), name="device-fetch-ahead", daemon=True
        ).start()

    def _fetch(self, files: list[str]) -> None:
        try:
            with self.segments.holding(files):
                pass
        except TierflowError as exc:
            logger.info("[device] fetching %s ahead failed, later again: %s", files, exc)
        finally:
            self._fetching_ahead.release()

    # ------------------------------------------------------------------ without a tier

    def _fall_back(
        self,
        request_id: str,
        started: float,
        arrays: Mapping[str, np.ndarray],
        cause: TierflowError,
        at_exit: Answered | None = None,
    ) -> Result | None:
        """Answer a request that the edge or the cloud could not take; never raises.

        The cloud missing ([Note: losing a tier]): a plan that does not need it. The
        edge missing ([Note: device fallback]): the device-only plan. Failing those, the
        device's own exit scores (``at_exit``, :meth:`Pipeline.without_next`). None: no
        way to answer here.
        """
        why = self.pipeline.unavailable(cause)
        if is_upstream_gone(cause):
            self.tiers.lose_cloud(why)
            index = self.tiers.cloud_free_plan() if self.tiers.cloud_free else None
        else:
            index = self.tiers.device_only_index
        if index is None:
            if at_exit is None:
                return None
            total = (time.perf_counter() - started) * 1e3
            ms = local_ms(total, device=0.0, network=total)
            return Result(
                request_id,
                at_exit.outputs,
                "device",
                at_exit.exit,
                bytes={link: 0 for link in LINKS},
                rate_bps={link: 0.0 for link in LINKS},
                ms=ms,
                fallback=True,
                fallback_reason=at_exit.fallback,
            )
        plan = self.plans.plans[index]
        if not runs_on_device_only(plan):
            return self._send_again(request_id, started, arrays, index, why)
        bytes_ = {link: 0 for link in LINKS}
        rates = {link: 0.0 for link in LINKS}
        try:
            with self.pipeline.holding(index):  # fetched ahead, or this fails
                if index not in self.pipeline.opened():  # the first time: sessions open now
                    logger.warning(
                        "[device] %s; answering with the device-only plan %s until it is back",
                        why,
                        plan.plan_id,
                    )
                runner = self.pipeline.runner(index)
                run_start = time.perf_counter()
                outcome = runner.run(dict(arrays))
        except TierflowError as exc:
            total = (time.perf_counter() - started) * 1e3
            ms = local_ms(total, device=total)
            logger.warning("[device] request %s: the device-only plan failed too", request_id)
            return Result(request_id, bytes=bytes_, rate_bps=rates, ms=ms, error=exc)
        assert outcome.final, "a device-only plan ends on the device"
        total = (time.perf_counter() - started) * 1e3
        # Time spent trying the edge is waiting, not the device's work.
        device_ms = (time.perf_counter() - run_start) * 1e3
        ms = local_ms(total, device=device_ms, network=max(total - device_ms, 0.0))
        timings = {
            "device": {
                "compute_ms": outcome.compute_s * 1e3,
                "codec_ms": 0.0,
                "queue_ms": 0.0,
            }
        }
        return Result(
            request_id,
            outcome.tensors,
            "device",
            outcome.exit,
            False,
            bytes_,
            rates,
            ms,
            timings=timings,
            fallback=True,
            plan=plan.plan_id,
            fallback_reason=f"{why}; answered with the device-only plan",
        )

    def _send_again(
        self,
        request_id: str,
        started: float,
        arrays: Mapping[str, np.ndarray],
        index: int,
        why: str,
    ) -> Result:
        """Run a request again on plan ``index``, which needs no cloud ([Note: losing a tier])."""
        plan = self.plans.plans[index]
        with self.pipeline.holding(index):
            ticket = self._submit(arrays, index, request_id)
        answer = ticket.result()
        ms = dict(answer.ms)
        total = (time.perf_counter() - started) * 1e3
        # The first attempt's time is waiting, not any tier's work.
        ms["network"] = ms.get("network", 0.0) + max(total - ms.get("total", 0.0), 0.0)
        ms["total"] = total
        if answer.error is not None:
            return dataclasses.replace(answer, id=request_id, ms=ms, plan=plan.plan_id)
        reason = f"{why}; answered with plan {plan.plan_id}"
        if answer.fallback_reason:  # the edge went too: the device answered alone
            reason = f"{why}; then {answer.fallback_reason}"
        return dataclasses.replace(
            answer,
            id=request_id,
            ms=ms,
            fallback=True,
            plan=answer.plan or plan.plan_id,
            fallback_reason=reason,
        )

    def _local(
        self,
        request_id: str,
        started: float,
        *,
        outputs: dict[str, np.ndarray] | None = None,
        exit_name: str | None = None,
        error: TierflowError | None = None,
        cache_hit: bool = False,
    ) -> Ticket:
        total = (time.perf_counter() - started) * 1e3
        ms = local_ms(total, device=total)
        result = Result(
            request_id,
            outputs or {},
            None if error else "device",
            exit_name,
            cache_hit,
            {link: 0 for link in LINKS},
            {link: 0.0 for link in LINKS},
            ms,
            error,
        )
        return Ticket(request_id, started, total, result=result)

    # ------------------------------------------------------------------ for callers

    def infer(self, inputs: Mapping[str, np.ndarray]) -> Result:
        """One request, start to end; raises its error (a TierflowError) if it failed."""
        return self.submit(inputs).result().unwrap()

    def run_stream(self, requests: Iterable[Mapping[str, np.ndarray]]) -> Iterator[Result]:
        """Results in request order, with up to ``window`` requests in flight.

        Failed requests are yielded too (``Result.error``): the stream goes on.
        """
        yield from tickets(self.window).stream(requests, self.submit)
