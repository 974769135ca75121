"""One tier's request path, the same on every tier, both ways: decode, cache, segments,
encode on the way up; the next tier's reply, or an answer without it, on the way down.

The device, the edge and the cloud each take a request through one :class:`Pipeline`
configured for the tier ([Note: one request path]); what only one tier does sits around it
in that tier's folder: the device's plan switching and fallbacks (``tierflow.device``),
the edge's writing of a reply that came from the cloud (``tierflow.edge.forwarding``),
the edge's or the cloud's tier that takes the requests of the tier below through its
pipeline (``tierflow.runtime.tier``), and the gRPC service that feeds it a server's
streams (``tierflow.runtime.service``).

[Note: one request path]
A request reaches a tier as tensors: the device's own inputs, or the encoded tensors of a
request from the tier below, which are checked against what the tier's segments expect
before any payload is decoded (:meth:`Pipeline.decode`). Then, for every tier alike,
in the order :meth:`Pipeline.climb` keeps (:meth:`Pipeline.run` for steps 2-3):

1. the feature cache, if the tier has one, is looked up with the features: a hit is the
   answer, nothing runs; on a miss, a tier that knows its next tier is down may answer
   here without running anything (the device's hook: [Note: retries and failing fast]
   in tierflow/transport/stream_client.py);
2. the tier's segments of the request's plan run in order; a confident early exit is
   the answer (stored in the cache), and so are the model outputs when no segment is
   left;
3. otherwise what the next tier needs is encoded with the next link's codec
   (:class:`Onward`), and the tier sends it up its way (the device's stream, the edge's
   forwarder). A tier that runs nothing for the plan forwards the tensors as they came
   ([Note: an edge that runs nothing] in tierflow/plan.py).

The way up is one generator, :meth:`Pipeline.climb` (a :data:`Climb`): it stops where a
step goes to the tier's step batcher ([Note: the step batcher] in
tierflow/runtime/batching.py) and goes on with the step's outputs. :func:`up` takes one
request up on its own thread (:func:`drive`); a tier takes the members of a
batched request up together on one, their steps in one call ([Note: a batch in one
message] in tierflow/runtime/batch_message.py).

The way down mirrors the way up (:meth:`Pipeline.came_down`), for the device and the edge
alike: what the next tier sent back for a request (:class:`~tierflow.runtime.upstream.Upstream`)

4. is its reply, or a failure; if the failure (or the reply's error) says the next tier
   is gone, the request is answered here without it ([Note: answering without the next
   tier]);
5. otherwise the reply is passed down as it is, an error too, and an answer in it is
   stored in this tier's cache (:meth:`Pipeline.fill`), unless it is one given without
   a tier.

What a tier adds on the way down is its role: the edge writes the reply to the stream
it came on (``tierflow.edge.forwarding``); the device turns it into the request's Result
and may answer with another plan of its set first (``tierflow.device``).

An answer made here is stored in the cache at once; one that comes from the next tier is
stored when it arrives, off the reply's way unless it is decoded already. The pipeline
opens a plan's ONNX Runtime sessions on its first request, sharing those of segment files
that plans have in common, and drops them when the segment store evicts their file
([Note: segments on demand] in tierflow/runtime/segment_store.py). Codec work is timed,
and emulated slower with the tier's ``slowdown`` ([Note: emulating a slower tier] in
tierflow/runtime/segment_runner.py).

[Note: answering without the next tier]
When the next tier cannot be reached (the stream to it broke, it is known to be down, or
it answered UNAVAILABLE because it is stopping, or UPSTREAM_UNAVAILABLE because the tier
after it is gone), a request that has already crossed to this tier still gets one answer
from here (:func:`next_tier_gone` decides, for the device and the edge alike). If the
plan has an early exit on this tier, the request's scores at that exit (checked and found
not confident enough) are the answer, marked with ``Reply.fallback`` (why), never cached
(:meth:`Pipeline.without_next`). Otherwise the edge answers with an
``UPSTREAM_UNAVAILABLE`` error: the device, which still holds the request's inputs,
finishes it with a plan of its set that does not need the missing tier ([Note: losing a
tier] in device/fallback.py), before its own exit's scores. The features computed here
are not sent back: the device would need the missing tier's segment files to use them,
and a plan without that tier reproduces the model from the inputs bit for bit anyway.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Generator, Hashable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import numpy as np

from tierflow.cache.base import CacheAnswer, FeatureCache, cache_key
from tierflow.codec.base import decode
from tierflow.codec.spec import CodecSpec
from tierflow.errors import (
    CacheError,
    CodecError,
    DeadlineError,
    InputError,
    PlanError,
    StateError,
    TierflowError,
    TransportError,
    is_gone,
    is_missing,
    is_upstream_gone,
)
from tierflow.link.spec import TIERS, downstream_link, upstream_link
from tierflow.options import RuntimeOptions
from tierflow.plan import Plan, PlanSet
from tierflow.rpc import tier_pb2
from tierflow.runtime.batching import Outputs, Pending, departs_together
from tierflow.runtime.segment_runner import SegmentRunner, TierRunner, emulate_slower
from tierflow.runtime.segment_store import SegmentSource, SegmentStore, tier_files
from tierflow.runtime.upstream import Upstream
from tierflow.state.spec import DecoderSpec, StateSpec
from tierflow.state.store import SessionStates, check_session_id
from tierflow.transport.callers import owner_of
from tierflow.transport.stream_client import Sent
from tierflow.transport.wire import (
    check_deadline,
    check_figures,
    decode_tensors,
    error_from_proto,
    put_tensors,
    received,
)

logger = logging.getLogger(__name__)

#: A first state value as a tier holds it: an array on the device, a wire tensor above.
Value = TypeVar("Value")
#: What a tier makes of a request it sends up (:func:`up`).
SentUp = TypeVar("SentUp")
#: What a way up returns (:func:`drive`).
Reached = TypeVar("Reached")
#: What names each of several requests taken up together (:func:`drive_together`).
Key = TypeVar("Key", bound=Hashable)
#: A request's way up at a tier, as :meth:`Pipeline.climb` takes it: a generator that
#: yields its step for the tier's batcher, if it has one, is sent the step's outputs (or
#: has the step's error thrown into it), and returns where the request got to.
Climb = Generator[Pending, Outputs, Reached]


def up(
    climb: Climb[Answered | Onward | SentUp], send: Callable[[Onward], SentUp]
) -> Answered | SentUp:
    """A request's way up at a tier (:meth:`Pipeline.climb`), taken on this thread: the
    tier's answer (:class:`Answered`), or what ``send`` made of the request it sent up (its
    reply comes down to :meth:`Pipeline.came_down`)."""
    step = drive(climb)
    return send(step) if isinstance(step, Onward) else step


def drive(climb: Climb[Reached]) -> Reached:
    """Take a request up to where it gets, on this thread: its step, if it yields one, run
    by the tier's batcher alone or with the steps queued beside it ([Note: the step
    batcher] in tierflow/runtime/batching.py). Another thread's steps may share the call;
    the steps of a batched request share one, from one thread ([Note: a batch in one
    message] in tierflow/runtime/batch_message.py)."""
    given: Outputs | BaseException | None = None
    try:
        while True:
            pending = resume(climb, given)
            try:
                given = pending.run()
            except BaseException as exc:  # the step's own error, raised where it ran
                given = exc
    except StopIteration as stop:
        return stop.value


def drive_together(climbs: Mapping[Key, Climb[Reached]]) -> dict[Key, Reached | Exception]:
    """Take several requests up together on this thread: each as far as it gets, their
    steps for one batcher run as one call (:meth:`StepBatcher.run_all
    <tierflow.runtime.batching.StepBatcher.run_all>`), then each on with its own outputs
    or its own error. Where each got to, or the error its way up raised, by key."""
    left = dict(climbs)
    went: dict[Key, Reached | Exception] = {}
    sent: dict[Key, Outputs | BaseException | None] = dict.fromkeys(left)
    while left:
        pending: dict[Key, Pending] = {}
        for key, climb in list(left.items()):
            try:
                pending[key] = resume(climb, sent.pop(key))
                continue
            except StopIteration as stop:
                went[key] = stop.value
            except Exception as exc:
                went[key] = exc
            del left[key]
        by_batcher: dict[int, list[Key]] = {}
        for key, step in pending.items():
            by_batcher.setdefault(id(step.batcher), []).append(key)
        for keys in by_batcher.values():
            steps = [pending[key] for key in keys]
            sent.update(zip(keys, steps[0].batcher.run_all(steps), strict=True))
    return went


def resume(climb: Climb[Reached], given: Outputs | BaseException | None) -> Pending:
    """Take ``climb`` on to its next step for the batcher: started (``given`` None), sent
    its last step's outputs, or thrown its last step's error. Raises ``StopIteration``,
    carrying where the request got to, when it yields no more."""
    if given is None:
        return next(climb)
    if isinstance(given, BaseException):
        return climb.throw(given)
    return climb.send(given)


@dataclass
class Answered:
    """The tier answers the request itself: model outputs, an exit's scores, or a cache hit."""

    outputs: dict[str, np.ndarray]
    exit: str | None = None
    cache_hit: bool = False
    compute_s: float = 0.0
    codec_s: float = 0.0
    #: Answered without the next tier, which is gone: why, and how ([Note: answering
    #: without the next tier]).
    fallback: str | None = None


@dataclass
class Onward:
    """The request goes on to the next tier: ``request`` holds the encoded tensors.

    ``unconfident`` is the last exit checked here and not taken, with its scores: the best
    answer the tier has if the next tier is gone. ``key`` and ``features`` store the next
    tier's answer in this tier's cache when it comes (``key`` None: no cache).
    """

    request: tier_pb2.Request
    nbytes: int
    unconfident: tuple[str, np.ndarray] | None = None
    compute_s: float = 0.0
    codec_s: float = 0.0
    key: bytes | None = None
    features: dict[str, np.ndarray] = field(default_factory=dict)
    #: The tensors still to encode, with ``codec`` (bit-exact): a step of a batch that
    #: goes on as one message, whose tensors it carries stacked ([Note: a batch's
    #: tensors stacked] in tierflow/runtime/batch_message.py). :func:`encode_onward`
    #: encodes them into ``request`` when the step goes on alone.
    arrays: dict[str, np.ndarray] | None = None
    codec: CodecSpec | None = None


def encode_onward(onward: Onward) -> Onward:
    """``onward`` with its tensors in its request (a no-op when they are there already)."""
    if onward.arrays is not None:
        assert onward.codec is not None
        start = time.perf_counter()
        onward.nbytes = put_tensors(onward.request.tensors, onward.arrays, onward.codec)
        onward.codec_s += time.perf_counter() - start
        onward.arrays = None
    return onward


@dataclass
class Down:
    """What came down for a request this tier sent up (:meth:`Pipeline.came_down`).

    ``reply``: the next tier's reply, to pass down as it is (its error too). ``gone``: the
    next tier is missing, so no reply came from it; ``answered`` is this tier's answer
    without it (an exit's scores), None when it has none. ``failure``: why no reply came
    when the next tier is not gone (late, refused, a bug).
    """

    reply: tier_pb2.Reply | None
    gone: TierflowError | None = None
    answered: Answered | None = None
    failure: BaseException | None = None


@dataclass(frozen=True)
class SessionStep:
    """A request's place in its session ([Note: session state on a tier] in
    tierflow/state/store.py): its ``session``, the steps already kept (``position``),
    the first values of fixed states this tier owns (``initial``) and those it passes on
    to the tiers after it (``passed_on``, as received). ``owner``: whose session it is
    ([Note: who a caller is] in tierflow/transport/callers.py; "" on the device)."""

    session: str
    position: int
    initial: Mapping[str, np.ndarray] = field(default_factory=dict)
    passed_on: Sequence[tier_pb2.Tensor] = ()
    #: A decoder step's answer keeps the logits of its last ``keep_last`` positions (0: all).
    keep_last: int = 0
    #: A decoder step's answer carries each kept position's argmax, not its logits.
    choices_only: bool = False
    owner: str = ""
    #: A replay's request: the session is rebuilt up to this position (0: not a replay).
    replay_to: int = 0

    @classmethod
    def of_request(
        cls, request: tier_pb2.Request, runner: TierRunner, max_bytes: int, owner: str = ""
    ) -> SessionStep | None:
        """The session step a request from the tier below names (None: no session), of
        ``owner``'s session."""
        if not request.session:
            if request.initial_state:
                raise StateError("a request carries initial state but names no session")
            return None
        check_session_id(request.session)
        if request.initial_state and request.position != 0:
            raise StateError(
                f"session {request.session!r}: initial state comes with position 0 only, "
                f"the request is at {request.position}"
            )
        if request.keep_last < 0:
            raise StateError(f"keep_last must not be negative, got {request.keep_last}")
        initial: dict[str, np.ndarray] = {}
        passed_on: list[tier_pb2.Tensor] = []
        if request.initial_state:  # a first request that brings state values
            check_initial_state(
                runner.plan.states,
                [(t.name, t.dtype, tuple(t.shape)) for t in request.initial_state],
                f"session {request.session!r}",
            )
            # Named once each: check_initial_state refused a state named twice.
            mine, passed = split_first_state(runner, {t.name: t for t in request.initial_state})
            initial = decode_tensors(list(mine.values()), max_bytes=max_bytes) if mine else {}
            passed_on = list(passed.values())
        return cls(
            request.session,
            request.position,
            initial,
            passed_on,
            request.keep_last,
            request.choices_only,
            owner,
            max(request.replay_to, 0),
        )


def split_first_state(
    runner: TierRunner, given: Mapping[str, Value]
) -> tuple[dict[str, Value], dict[str, Value]]:
    """A session's first state values by name, split into those of the states ``runner``
    holds on this tier (kept here) and the rest (passed on to the tiers after it); each
    in the order given. The device splits arrays, the tiers above it the wire tensors."""
    owned = runner.state_inputs
    mine = {name: value for name, value in given.items() if name in owned}
    return mine, {name: value for name, value in given.items() if name not in owned}


def check_initial_state(
    specs: Sequence[StateSpec], given: Sequence[tuple[str, str, tuple[int, ...]]], what: str
) -> None:
    """Refuse first state values (name, dtype, shape) that no state of ``specs`` (a plan's
    states, every tier's) takes,
    that repeat, or that do not fit their state exactly (:meth:`StateSpec.check_initial`):
    a value of another dtype is refused, never cast. Checked from the headers alone,
    before anything is decoded, by every tier a session's first request reaches."""
    states = {spec.input: spec for spec in specs}
    names = [name for name, _, _ in given]
    if len(set(names)) != len(names):
        raise StateError(f"{what}: initial state {sorted(names)} names a state twice")
    unknown = sorted(set(names) - set(states))
    if unknown:
        raise StateError(
            f"{what}: initial state {unknown} is no state of the plan (its states: "
            f"{sorted(states)})"
        )
    for name, dtype, shape in given:
        states[name].check_initial(dtype, shape)


def check_decoder_step(
    decoder: DecoderSpec, features: Mapping[str, np.ndarray], position: int
) -> None:
    """Refuse a decoder step whose companions disagree with its ``position``
    ([Note: a decoder step's companions]).

    [Note: a decoder step's companions]
    A decoder step after ``position`` tokens feeds T new tokens with ``attention_mask``
    [1, position + T] and ``position_ids`` [[position .. position + T - 1]]
    (:class:`~tierflow.state.spec.DecoderSpec`). Their shapes are symbolic in the model,
    so the segment's input check cannot see that they disagree with the position; ONNX
    Runtime then failed inside an attention node, which was answered INTERNAL (with its
    own error line on the tier's stderr). The tier that reads them checks them first:
    a client's mistake is an INVALID_INPUT (a :class:`~tierflow.errors.StateError`).
    T is the tokens' length, or the position ids' where the tokens are not read here.
    """
    tokens = features.get(decoder.tokens)
    ids = features.get(decoder.position_ids) if decoder.position_ids else None
    mask = features.get(decoder.attention_mask) if decoder.attention_mask else None
    length = None
    if tokens is not None and tokens.ndim == 2:
        length = int(tokens.shape[1])
    elif ids is not None and ids.ndim == 2:
        length = int(ids.shape[1])
    if ids is not None:
        fits = ids.ndim == 2 and ids.shape[1] == length
        if fits and length == 1:  # a decode step's: a lot cheaper than array_equal
            fits = int(ids[0, 0]) == position
        elif fits:
            expected = np.arange(position, position + (length or 0), dtype=np.int64)
            fits = np.array_equal(ids[0], expected)
        if not fits:
            raise StateError(
                f"a step at position {position} of {length} token(s) has position_ids "
                f"[[{position} .. {position + (length or 0) - 1}]], found shape "
                f"{list(ids.shape)} starting at {ids.flat[0] if ids.size else None}"
            )
    if mask is not None:
        width = int(mask.shape[-1]) if mask.ndim else -1
        fits = width == position + length if length is not None else width > position
        if not fits:
            want = f"{position + length}" if length is not None else f"more than {position}"
            raise StateError(
                f"a step at position {position} needs an attention_mask of {want} "
                f"positions, found {width}"
            )


def reply_codec(plan: Plan, link: str | None) -> CodecSpec:
    """Answers go down with the lossless part of the link's codec: outputs are small, and
    quantising them would change the model's answers."""
    codec = plan.link_codec(link).lossless_part()
    return CodecSpec.parse("raw") if codec.compress == "none" else codec


class Pipeline:
    """A tier's request path ([Note: one request path]); thread-safe.

    ``plans`` are every plan the tier serves; their segment files live in ``plan_dir``,
    bounded by ``options.segment_budget`` and fetched from ``source`` (the tier above)
    when missing. ``cache`` is any :class:`~tierflow.cache.base.FeatureCache`.
    """

    def __init__(
        self,
        tier: str,
        plans: PlanSet,
        plan_dir: str | Path,
        options: RuntimeOptions,
        *,
        cache: FeatureCache | None = None,
        source: SegmentSource | None = None,
    ) -> None:
        self.tier = tier
        self.plans = plans
        self.plan_dir = Path(plan_dir)
        self.options = options
        self.cache = cache
        self.up_link = upstream_link(tier)
        rank = TIERS.index(tier)
        #: The tier requests go on to from here (None on the cloud).
        self.next_tier = TIERS[rank + 1] if rank + 1 < len(TIERS) else None
        self._storing: ThreadPoolExecutor | None = None  # fills the cache off the way down
        self.down_link = downstream_link(tier)
        self.segments = SegmentStore(
            self.plan_dir,
            plans,
            tier=tier,
            budget=options.segment_budget,
            source=source,
            on_evict=self._evicted,
        )
        self._index = {plan.plan_id: i for i, plan in enumerate(plans.plans)}
        self._files = [tier_files(plans, i, tier) for i in range(len(plans.plans))]
        self._as_is = [tier == "edge" and plan.edge_forwards for plan in plans.plans]
        self._reply_codecs = [reply_codec(plan, self.down_link) for plan in plans.plans]
        # Codec work is timed in CPU time only to emulate a slower tier; the clock costs
        # a system call, three a request, so it is not read otherwise.
        self._cpu = time.thread_time if options.slowdown > 1.0 else _no_clock
        self._runners: dict[int, TierRunner] = {}  # by plan index, opened on first use
        self._opened: dict[Path, SegmentRunner] = {}  # by segment file, shared by plans
        self._lock = threading.Lock()
        #: Each session's state of this tier's stateful segments.
        self.states = SessionStates(
            tier,
            budget=options.state_budget,
            share=options.state_share,
            idle_s=options.state_idle_s,
        )

    # ------------------------------------------------------------------ plans

    def index_of(self, plan_id: str) -> int:
        """The index of the plan a request names; a :class:`PlanError` if not served here."""
        index = self._index.get(plan_id)
        if index is None:
            served = ", ".join(p.plan_id for p in self.plans.plans)
            raise PlanError(
                f"the {self.tier} serves plans {served}, the request names plan "
                f"{plan_id or '(none)'}"
            )
        return index

    def holding(self, index: int) -> contextlib.AbstractContextManager[None]:
        """Hold (fetching if need be) the files of plan ``index`` that this tier runs."""
        return self.segments.holding(self._files[index])

    def runner(self, index: int) -> TierRunner:
        """Plan ``index``'s runner on this tier, opened on first use (its files fetched first)."""
        with self._lock:
            runner = self._runners.get(index)
        if runner is not None:
            return runner
        with self.holding(index), self._lock:
            runner = self._runners.get(index)
            if runner is None:
                plan = self.plans.plans[index]
                runner = TierRunner(plan, self.plan_dir, self.tier, self.options, self._opened)
                self._runners[index] = runner
                if index != self.plans.default:
                    logger.info("[%s] plan %s opened", self.tier, plan.plan_id)
            return runner

    def opened(self) -> list[int]:
        """Indices of the plans whose sessions are open."""
        with self._lock:
            return list(self._runners)

    def _evicted(self, file: str) -> None:
        """A segment file left the store: drop the sessions on it and the plans using it."""
        with self._lock:
            self._opened.pop(self.plan_dir / file, None)
            for index, runner in list(self._runners.items()):
                if any(spec.file == file for _, spec, _ in runner.segments):
                    del self._runners[index]
                    plan_id = self.plans.plans[index].plan_id
                    logger.info("[%s] plan %s closed: segment %s evicted", self.tier, plan_id, file)

    # ------------------------------------------------------------------ the path

    def climb(
        self,
        index: int,
        *,
        request: tier_pb2.Request | None = None,
        caller: str = "",
        inputs: dict[str, np.ndarray] | None = None,
        session: SessionStep | None = None,
        deadline_unix_s: float = 0.0,
        next_down: Callable[[TierRunner], SentUp | None] | None = None,
        together: bool = False,
    ) -> Climb[Answered | Onward | SentUp]:
        """The way up for plan ``index`` as far as this tier takes it (a :data:`Climb`):
        the tier's answer (:class:`Answered`), or what to send up (:class:`Onward`).

        A request enters as the ``request`` of ``caller`` from the tier below (checked
        and decoded here, its session step read from it), or as the device's own
        ``inputs`` at segment 0 with its ``session`` step and ``deadline_unix_s``. A
        member of a batch whose tensors came stacked enters as its ``request`` with its
        rows of them as ``inputs``, decoded and checked already (:meth:`check_rows`;
        [Note: a batch's tensors stacked] in tierflow/runtime/batch_message.py).
        ``next_down``: the tier's check, between the cache and the segments, that the
        next tier is known to be down; what it returns (not None) is the request's
        outcome, and nothing runs. ``together``: the request goes on with its batch's
        others as one message, so its onward tensors are left for that message to
        encode, stacked, when its link's codec is bit-exact; so are those of a step that
        came alone and ran in a batch call whose steps go on together. The plan's files
        are held while the request runs here, not while it is sent.
        """
        codec_s = 0.0
        as_received: Sequence[tier_pb2.Tensor] = ()
        if request is not None:
            check_figures(request)
            deadline = check_deadline(request.deadline_unix_s, time.time())
            if deadline and time.time() > deadline:
                raise DeadlineError(f"the request's deadline passed before the {self.tier} ran it")
            deadline_unix_s, segment = deadline or 0.0, request.segment
            as_received = request.tensors
        else:
            segment = 0
        with self.holding(index):  # its segment files stay while it runs
            runner = self.runner(index)
            if request is not None:
                if inputs is None:
                    features, codec_s = self.decode(index, runner, segment, request.tensors)
                else:  # a batch's rows, checked for the batch (Tier._rows)
                    features = dict(inputs)
                owner = owner_of(caller, request.on_behalf_of)
                limit = self.options.max_tensor_bytes
                session = SessionStep.of_request(request, runner, limit, owner)
            else:
                features = inputs or {}
                runner.check_names(set(features), segment=0)
            hit, key = self.cached(index, segment, features, session)
            if hit is None and next_down is not None:
                known = next_down(runner)
                if known is not None:
                    return known
            step = hit or (
                yield from self.run(
                    index,
                    runner,
                    features,
                    segment=segment,
                    key=key,
                    deadline_unix_s=deadline_unix_s,
                    as_received=as_received,
                    checked=request is not None,
                    session=session,
                    together=together,
                )
            )
        step.codec_s += codec_s
        return step

    def decode(
        self, index: int, runner: TierRunner, segment: int, tensors: Sequence[tier_pb2.Tensor]
    ) -> tuple[dict[str, np.ndarray], float]:
        """A request's tensors from the tier below, checked, then decoded; and the codec time.

        The segment and the tensor count are checked before anything else: a request of
        two million tiny tensors costs no more than one of the plan's size. Each tensor's
        dtype and shape are checked against the segment's input before any payload is
        decoded, so a tensor decodes to exactly the size the plan expects (at most
        ``max_tensor_bytes`` along a symbolic dimension). A tier that only forwards the
        plan's tensors decodes nothing (unless its cache needs them).
        """
        start, cpu = time.perf_counter(), self._cpu()
        if segment != runner.start:
            runner.check_names(set(), segment=segment)  # raises: wrong segment
        if len(tensors) != len(runner.needs):
            raise InputError(
                f"the {self.tier} expects {len(runner.needs)} tensors {list(runner.needs)}, "
                f"the request carries {len(tensors)}"
            )
        limit = self.options.max_tensor_bytes
        encoded = [received(message, max_bytes=limit) for message in tensors]
        names = {t.name for t, _ in encoded}
        if len(names) != len(encoded):
            raise CodecError(f"tensor names repeat in one request: {sorted(names)}")
        runner.check_names(names, segment=segment)
        runner.check_specs(((t.name, t.dtype, t.shape) for t, _ in encoded), f"the {self.tier}'s")
        features: dict[str, np.ndarray] = {}
        if not (self.forwards_as_is(index) and self.cache is None):
            # Read-only views: ONNX Runtime only reads them.
            features = {t.name: decode(t, checked=c, writable=False) for t, c in encoded}
        emulate_slower(self.options.slowdown, cpu, self._cpu)
        return features, time.perf_counter() - start

    def check_rows(self, runner: TierRunner, segment: int, rows: Mapping[str, np.ndarray]) -> None:
        """Raise unless a member's rows of a batch's stacked tensors fit, as :meth:`decode`
        checks a request's tensors: the segment, the names, and each one's dtype and
        shape."""
        runner.check_names(set(rows), segment=segment)
        given = ((name, value.dtype.name, value.shape) for name, value in rows.items())
        runner.check_specs(given, f"the {self.tier}'s")

    def forwards_as_is(self, index: int) -> bool:
        """Whether this tier runs nothing for plan ``index`` and passes its tensors on as
        they came ([Note: an edge that runs nothing] in tierflow/plan.py)."""
        return self._as_is[index]

    def cached(
        self,
        index: int,
        segment: int,
        features: dict[str, np.ndarray],
        session: SessionStep | None = None,
    ) -> tuple[Answered | None, bytes | None]:
        """Step 1 of [Note: one request path]: the cached answer, if any, and the key under
        which to store the answer otherwise (None: the tier has no cache). A session's
        answers depend on its state, so they are never cached."""
        if self.cache is None or session is not None:
            return None, None
        plan = self.plans.plans[index]
        key = cache_key(plan.model_sha256, plan.plan_id, segment, features)
        answer = self.lookup(key, features)
        if answer is None:
            return None, key
        return Answered(answer.outputs, answer.exit, cache_hit=True), key

    def run(
        self,
        index: int,
        runner: TierRunner,
        features: dict[str, np.ndarray],
        *,
        segment: int,
        key: bytes | None = None,
        deadline_unix_s: float = 0.0,
        as_received: Sequence[tier_pb2.Tensor] = (),
        checked: bool = False,
        session: SessionStep | None = None,
        together: bool = False,
    ) -> Climb[Answered | Onward]:
        """Steps 2-3 of [Note: one request path] for features entering at ``segment`` (a
        part of :meth:`climb`).

        ``key``: where the cache keeps this request's answer (from :meth:`cached`).
        ``as_received``: the request's encoded tensors, forwarded unchanged by a tier that
        runs nothing for the plan. ``checked``: :meth:`decode` checked the features.
        ``session``: the request's session step; the tier's state is fed from it and
        kept for the session's next request. ``together``: see :meth:`climb`.
        """
        plan = self.plans.plans[index]
        if self.forwards_as_is(index):
            forward = _onward(plan.plan_id, runner.start, deadline_unix_s, session)
            if not as_received and features:  # its rows of a stacked batch, on as they came
                codec = plan.link_codec(self.up_link)
                return Onward(forward, 0, key=key, features=features, arrays=features, codec=codec)
            forward.tensors.extend(as_received)
            nbytes = sum(len(t.data) + len(t.params) for t in as_received)
            return Onward(forward, nbytes, key=key, features=features)
        if session is not None and plan.decoder is not None:  # before the state is touched
            check_decoder_step(plan.decoder, features, session.position)
        state = None
        if runner.states:
            if session is None:
                raise StateError(
                    f"plan {plan.plan_id} keeps state on the {self.tier} between requests: "
                    "a request must name its session"
                )
            state = self.states.inputs(
                session.session,
                plan.plan_id,
                session.position,
                runner.states,
                session.initial,
                owner=session.owner,
            )
        if runner.batcher is None:
            outcome = runner.run(features, checked=checked, state=state)
        else:  # the step goes to the batcher ([Note: the step batcher])
            pending = runner.pending(
                features,
                checked,
                state,
                member=f"{session.owner}/{session.session}" if session is not None else "",
                owner=session.owner if session is not None else "",
                deadline_unix_s=deadline_unix_s,
            )
            start = time.perf_counter()
            values = yield pending
            together = together or departs_together()  # on with its batch call's steps
            outcome = runner.batched_outcome(values, time.perf_counter() - start)
        if session is not None and runner.states and outcome.state:
            self.states.commit(
                session.session,
                plan.plan_id,
                session.position,
                runner.states,
                outcome.state,
                owner=session.owner,
                replay_to=session.replay_to,
            )
        if outcome.final:
            if key is not None:
                self.store(key, features, outcome.tensors, outcome.exit)
            outputs = outcome.tensors
            if session is not None and plan.decoder is not None:
                outputs = _decoder_answer(outputs, plan.decoder.logits, session)
            return Answered(outputs, outcome.exit, compute_s=outcome.compute_s)
        if self.up_link is None:
            raise PlanError(f"plan {plan.plan_id} runs beyond the {self.tier}")
        forward = _onward(plan.plan_id, outcome.next_segment, deadline_unix_s, session)
        codec = plan.link_codec(self.up_link)
        if together and codec.bit_exact and self.options.slowdown <= 1.0:
            return Onward(  # encoded with its batch's others ([Note: a batch's tensors stacked])
                forward,
                0,
                outcome.unconfident,
                compute_s=outcome.compute_s,
                key=key,
                features=features,
                arrays=outcome.tensors,
                codec=codec,
            )
        start, cpu = time.perf_counter(), self._cpu()
        nbytes = put_tensors(forward.tensors, outcome.tensors, codec, plan.images)
        emulate_slower(self.options.slowdown, cpu, self._cpu)
        return Onward(
            forward,
            nbytes,
            outcome.unconfident,
            compute_s=outcome.compute_s,
            codec_s=time.perf_counter() - start,
            key=key,
            features=features,
        )

    def answer(self, index: int, answered: Answered) -> tier_pb2.Reply:
        """``answered`` as the reply a server sends down, its codec time added to it."""
        start, cpu = time.perf_counter(), self._cpu()
        plan = self.plans.plans[index]
        reply = tier_pb2.Reply(
            plan_id=plan.plan_id,
            answered_by=self.tier,
            exit=answered.exit or "",
            cache_hit=answered.cache_hit,
            fallback=answered.fallback or "",
        )
        put_tensors(reply.outputs, answered.outputs, self._reply_codecs[index])
        emulate_slower(self.options.slowdown, cpu, self._cpu)
        answered.codec_s += time.perf_counter() - start
        return reply

    def send(
        self,
        upstream: Upstream,
        index: int,
        onward: Onward,
        *,
        deadline: float | None = None,
        on_reply: Callable[[Sent], None] | None = None,
    ) -> Sent | Down:
        """Send ``onward`` (plan ``index``) up through ``upstream``, its reply due by
        ``deadline`` (monotonic; None: none): what was sent, whose reply the tier takes
        to :meth:`came_down` when it comes (``on_reply``, or when read). A next tier known
        to be down refuses it at once, and what came down is then that (the next tier
        gone: this tier's answer without it, if any)."""
        encode_onward(onward)
        try:
            return upstream.submit(
                onward.request, deadline=deadline, nbytes=onward.nbytes, on_reply=on_reply
            )
        except TransportError as exc:  # known to be down: no waiting for it
            return self.came_down(index, onward, exc)

    # ------------------------------------------------------------------ the way down

    def came_down(
        self,
        index: int,
        onward: Onward,
        got: tier_pb2.Reply | BaseException,
        *,
        outputs: Mapping[str, np.ndarray] | None = None,
    ) -> Down:
        """Steps 4-5 of [Note: one request path] for ``onward``, sent up for plan ``index``:
        ``got`` is the next tier's reply, or why none came. ``outputs``: the reply's
        outputs, if this tier decoded them already (else they are decoded off the reply's
        way to be cached)."""
        gone = next_tier_gone(got)
        if gone is not None:
            return Down(None, gone=gone, answered=self.without_next(onward, gone))
        if isinstance(got, BaseException):
            return Down(None, failure=got)
        self.fill(onward, got, outputs)
        return Down(got)

    def unavailable(self, cause: TierflowError) -> str:
        """Why the next tier is missing, as an answer without it says (``cause`` names the
        tier after it when the next tier said that one is gone)."""
        if is_upstream_gone(cause):
            return str(cause)
        return f"the {self.next_tier} is unavailable ({cause})"

    def without_next(self, onward: Onward, cause: TierflowError) -> Answered | None:
        """This tier's own answer to ``onward`` while the next tier is gone: the scores of
        the last exit checked here (not confident enough), marked as a fallback; None
        without one ([Note: answering without the next tier])."""
        if onward.unconfident is None:
            return None
        name, scores = onward.unconfident
        why = f"{self.unavailable(cause)}; answered at the {self.tier}'s exit"
        return Answered({name: np.asarray(scores)}, name, fallback=why)

    def fill(
        self,
        onward: Onward,
        reply: tier_pb2.Reply,
        outputs: Mapping[str, np.ndarray] | None = None,
    ) -> None:
        """Keep the next tier's answer to ``onward`` in this tier's cache, if it has one.

        Not an error, nor an answer given without a tier (it would stay after the tier is
        back). With ``outputs`` (decoded already) it is stored now; otherwise decoded and
        stored on the cache's own thread, off the reply's way.
        """
        if onward.key is None or reply.HasField("error") or reply.fallback:
            return
        exit_name = reply.exit or None
        if outputs is not None:
            self.store(onward.key, onward.features, outputs, exit_name)
            return
        tensors = list(reply.outputs)
        with self._lock:
            if self._storing is None:
                self._storing = ThreadPoolExecutor(1, thread_name_prefix=f"{self.tier}-cache")
            storing = self._storing
        with contextlib.suppress(RuntimeError):  # shut down: the tier is stopping
            storing.submit(self._fill, onward, tensors, exit_name)

    def _fill(self, onward: Onward, tensors: list[tier_pb2.Tensor], exit_name: str | None) -> None:
        assert onward.key is not None
        try:
            self.store(onward.key, onward.features, decode_tensors(tensors), exit_name)
        except Exception:
            logger.exception("[%s] could not cache the %s's answer", self.tier, self.next_tier)

    def close(self) -> None:
        """Stop storing the next tier's answers (those still queued are dropped)."""
        with self._lock:
            storing, self._storing = self._storing, None
        if storing is not None:
            storing.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ cache

    def lookup(self, key: bytes, features: Mapping[str, np.ndarray]) -> CacheAnswer | None:
        """The cached answer for ``key``, or None; a failing cache is a miss, never an error."""
        assert self.cache is not None
        try:
            return self.cache.lookup(key, features)
        except CacheError as exc:
            logger.warning("[%s] cache lookup failed, running the model: %s", self.tier, exc)
            return None

    def store(
        self,
        key: bytes,
        features: Mapping[str, np.ndarray],
        outputs: Mapping[str, np.ndarray],
        exit_name: str | None,
    ) -> None:
        """Keep an answer in the cache; a failing cache is logged, never an error."""
        assert self.cache is not None
        try:
            self.cache.store(key, features, CacheAnswer(dict(outputs), exit_name))
        except CacheError as exc:
            logger.warning("[%s] cache store failed: %s", self.tier, exc)


def next_tier_gone(got: tier_pb2.Reply | BaseException) -> TierflowError | None:
    """Why the next tier is missing, if ``got`` (its reply, or why none came) says it is
    ([Note: answering without the next tier]): it could not be reached or went away, or it
    answered that a tier is gone (UNAVAILABLE: it is stopping; UPSTREAM_UNAVAILABLE: the
    tier after it is). Not a deadline, not a refusal, not a bad request."""
    if isinstance(got, BaseException):
        return got if isinstance(got, TierflowError) and is_missing(got) else None
    if got.HasField("error"):
        error = error_from_proto(got.error)
        return error if is_gone(error) else None
    return None


def _onward(
    plan_id: str, segment: int, deadline_unix_s: float, session: SessionStep | None
) -> tier_pb2.Request:
    """The request to the next tier, with its session step (if any, on behalf of its owner:
    [Note: who a caller is]) and the initial states this tier did not own."""
    forward = tier_pb2.Request(plan_id=plan_id, segment=segment, deadline_unix_s=deadline_unix_s)
    if session is not None:
        forward.session = session.session
        forward.position = session.position
        forward.initial_state.extend(session.passed_on)
        forward.keep_last = session.keep_last
        forward.choices_only = session.choices_only
        forward.on_behalf_of = session.owner
        forward.replay_to = session.replay_to
    return forward


def _decoder_answer(
    outputs: dict[str, np.ndarray], logits: str, step: SessionStep
) -> dict[str, np.ndarray]:
    """``outputs`` with a decoder's logits [batch, seq, vocab] cut to the last
    ``step.keep_last`` positions (a prefill's answer needs one, not one per prompt token)
    and, with ``step.choices_only``, each position's argmax in their place [batch, seq]
    (int64): a greedy step needs 8 bytes a position, not 4 per vocabulary entry."""
    scores = outputs.get(logits)
    if scores is None or scores.ndim != 3:
        return outputs
    if 0 < step.keep_last < scores.shape[1]:
        scores = scores[:, -step.keep_last :]
    if step.choices_only:
        scores = np.argmax(scores, axis=-1).astype(np.int64)
    return {**outputs, logits: np.ascontiguousarray(scores)}


def _no_clock() -> float:
    return 0.0
