"""Batched steps: the concurrent decode steps of many sessions in one ONNX Runtime call.

A decoder's decode step reads all of its segment's weights to make one token: it is
bound by memory, not arithmetic, so a tier that runs the steps of many sessions together
gets several tokens for little more than the price of one (continuous batching, as in
Orca and vLLM). :class:`StepBatcher` does that for one tier's share of one plan
(:class:`~tierflow.runtime.segment_runner.TierRunner` holds one when the plan allows it);
:func:`group_key`, :func:`stack` and :func:`split` are its pure parts.

[Note: batching exactness]
Which groupings ONNX Runtime (1.32, CPU, "extended") keeps bit-identical to each step
run alone, measured on a decoder with Qwen2-0.5B's block shapes (hidden 896, GQA 14/2
heads, MLP 4864) with 12 blocks and a 32k vocabulary, random weights, exported by optimum
(``tierflow.zoo.hf_decoders``, as ``benchmarks/batching.py`` builds it) and by
torch's TorchScript exporter, and on the tiny test decoder
(``tierflow.zoo.tiny_stateful``), at 1 and 2 intra-op threads:

* steps whose every input has the same shape but for the batch axis (same past length,
  same step length): decode steps of 2, 4 and 8 sessions at past 64, and prefills of 4
  prompts of 64, differ from the same steps alone by exactly 0.0 in every output (logits
  and new KV caches), at both thread counts and on all three. The rows of a batch never
  meet: every MatMul multiplies each row by the same weights with the same inner loop
  over K (MLAS splits a GEMM among threads by rows and columns, never along K), and
  attention, softmax and the norms work per row over the same lengths;
* sessions of different past lengths left-padded to the longest (KV cache zeros, mask 0
  there) are not: the Qwen2-shaped decoder's logits differ by up to 2.7e-6 (argmax the
  same in 4 of 4 at each thread count), and padding one session alone, with no batch,
  already differs by 2.6e-6: a softmax over a longer row, its masked terms exactly 0,
  still sums in another order. Worse, padding is only correct for a model whose causal
  mask compares cache indices, as Hugging Face's models do; the test decoder and the
  byte decoders compare ``position_ids`` with cache indices (ALiBi), so padding them
  changes the function (logits off by 0.3, argmax changed in 1 of 4).

So the default groups only steps whose tensors have the same shapes but for axis 0
(:func:`group_key`): exact, whatever the model. ``--batch-padding`` also groups decoder
steps of different past lengths, left-padding their caches and masks (:func:`pad`): more
steps share a call, but each costs the padding's compute and its answers are no longer
bit-identical (its token agreement end to end is not measured yet); it is for Hugging
Face style decoders only. A batch is only formed for a decoder plan's segments whose every
input and output has a symbolic first (batch) axis and no early exit: a graph whose axis
0 is not the batch (a streaming model's time axis) would be stacked wrongly without
failing, so nothing else is batched.

[Note: a batch's states in place]
A call's outputs come back as one array each, cut into each step's rows (:func:`split`:
views, no copies), and a session keeps its rows of the new KV caches as its state. When
the same sessions step together again, their states are the rows of that call's arrays.
So the batcher puts a call's steps in the order their largest tensors lie in memory
(:func:`row_order`), and :func:`stack` passes a tensor whose members are one array's rows,
back to back in order, as those rows (:func:`in_place`: same array, C-contiguous, each part
starting where the one before ended) instead of concatenating a copy; anything else (a
session new to the batch, a step decoded from the wire, a padded batch) is copied as
before. Which row a step has in a call changes nothing in its answer ([Note: batching
exactness]). What it saves: at 16 lockstep sessions on the cloud-only plan of
``benchmarks/batching.py``'s decoder, 9.4 MB of KV caches copied each round; in two pairs
of served runs (2026-12-06, CPUs kept awake) 195 and 200 tokens/s against 187 and 187. On
the split plan, whose tiers each hold a third of the caches, two pairs came out 151/176
against 167/176: no difference the machine resolves.
Looking costs about 1-1.5 µs a member's tensor (where it lies, read from numpy's
``__array_interface__``, which is a third faster than ``.ctypes.data``: 37 against 65 µs
for a tensor of 16 members, measured 2026-12-07), so tensors under ``IN_PLACE_BYTES`` are
copied without.

[Note: the step batcher]
A tier's steps of one plan reach :meth:`StepBatcher.run` from its worker threads, and the
steps of a batched request reach :meth:`StepBatcher.run_all` together, from one ([Note: a
batch in one message] in tierflow/runtime/batch_message.py). One
batch of a runner runs at a time (the intra-op threads, ``--threads``, give it the
cores): a step that finds none running runs at once, alone, so an idle tier adds no wait
and a lone session pays only a lock (with ``--batch-delay``, unless company is expected:
below). Steps that arrive while a batch runs queue; a step
in the batcher, queued or running, lends its worker ([Note: a worker lent while a step
queues] in tierflow/runtime/workers.py), so a batch can grow past ``--workers``; when it
ends, the
thread whose step is next in line takes the oldest queued step and every later queued
step of the same group (:func:`group_key`), up to ``--max-batch``, in the order they
came, and runs them as one call: their tensors stacked on axis 0 (the sessions' KV
caches gathered), the outputs and new caches split back per step. Steps of other groups
wait for the next call; the oldest step always goes next, so no session starves and each
session's steps keep their order (a session has one step in flight, [Note: a stream's
requests run at once] in tierflow/runtime/streams.py).

``--batch-delay`` D > 0 pulls the steps of lockstep sessions together. Left alone they
fall into turns: the first step of a round finds the tier idle and runs alone, the rest
queue behind it and run as a batch after it (16 sessions: 1 + 15 calls every round,
two weight reads for one). So with D > 0 a step waits up to D, when it finds the tier
idle and when it leads a batch, while company it can expect has not queued yet (and its
group is not full): the other sessions whose last step here was of the same group as
its own session's last step (the same shapes: their next steps will be too, [Note:
batching exactness]), and that are active: their last step was taken at most
``ROUNDS`` of their own round times ago (the time between their last two steps here),
never more than ``ACTIVE_S``. The wait ends as soon as each of them has a step queued.
A lone session's later steps, or a session whose company is a step behind or ahead
(another past length), never wait; a session that ended is waited for at most
``ROUNDS`` rounds, not for as long as it was ever seen; and the steps of the batch that
just ran, a round ahead of the queued ones, are not waited for by them. The steps of a
batched request queue at once (:meth:`StepBatcher.run_all`, [Note: a batch in one
message]), and wait only for company beyond them. With D = 0 (the default)
nothing waits: a step that finds the tier idle runs at once, and nothing is tracked.

A session's first step here (or its first after ``ACTIVE_S`` without one) waits too, up to D
or until its group is full, unless it came in a batched request, whose steps are each
other's company: the
sessions that start together then start as one batch. Without that, the first of them
found the tier idle and ran alone, and the rest queued behind it as a second batch.
Cloud-only, the two groups met again within a few rounds; on a split plan they never
did. The tiers form a pipeline, each tier running one group while the other is on another
tier, and the lone session fell a whole step behind the rest: its steps, of another past
length, were no one's company (``benchmarks/batching.py``, 16 sessions at D = 20 ms: 1 +
15 on every tier in every round). What this costs: with D > 0, a session's first step
(its prefill) waits up to D at each tier it crosses, when no other session starts with
it. What D still does not mend: groups that drift further apart than D once running.

The calls themselves run on one thread of the batcher's own (``own_thread``; a tier's
runner with segments to run has it), whichever thread leads the batch. A tier's requests
come to it on the threads of its pool in turn ([Note: a stream's requests run at once] in
tierflow/runtime/streams.py), and the same ONNX Runtime call ran slower from threads
that take turns than from one. The cloud's segment of ``benchmarks/batching.py``'s split
plan, 8 rows, called every 40 ms in one process (2026-12-07, sets of 40 calls in turn):
22.3, 24.6 and 22.9 ms by mean from one thread against 27.6, 26.1 and 25.5 from two
threads in turn; in a second run 25.1, 24.3 and 26.2 from one, 26.9, 28.3 and 27.7 from
two in turn, and 23.7, 25.6 and 26.8 from two in turn that hand the call to one thread.
(Where it comes from was not found: the caller's thread works in the call beside the
pool's, and its caches are the colder the longer since its last call.) Served, the tiers
whose requests take turns were the slow ones: their calls ran 4-10% longer than the same
calls in the ceiling's one thread (8 sessions stepped together), the device's (always on
the thread that steps its sessions) no longer. Handing a call over costs two thread
wake-ups. With it, 8 split sessions stepped together took 60.9, 60.9 and 63.1 ms a round
against 64.4, 62.2 and 66.4 without (three pairs, run in turn); 16 took 87.3, 79.6 and
79.8 against 95.5, 83.5 and 77.1, while the machine's speed drifted by a fifth.
Until a second thread leads a call, though, the calls run on the one that has led them
all: a device whose sessions are stepped together from one loop ([Note: sessions stepped
together] in device/client.py) already calls from one thread, and handing its calls over
cost it the two wake-ups for nothing. 8 split sessions stepped together spent 8.9, 8.8
and 8.9 ms a round outside the tiers' calls against 9.5, 9.2 and 9.1 (three pairs in
turn, 2026-12-07); at 16, 11.4, 11.0 and 12.7 against 12.1, 11.5 and 11.8. Once another
thread has led one, every call goes to the batcher's own thread for good.

A step whose deadline passed while it queued fails alone (DEADLINE_EXCEEDED); a batch
whose call fails is run again one step at a time, so the step with the bad tensor fails
alone, with its own typed error, and the others get their answers. When more steps of
the group are queued than ``--max-batch``, each owner's oldest step goes before any
owner's second ([Note: who a caller is] in tierflow/transport/callers.py), so an identity
with many sessions does not take every place in a batch from one with few.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from tierflow.errors import DeadlineError, ModelError
from tierflow.runtime.workers import lent
from tierflow.state.spec import StateSpec

logger = logging.getLogger(__name__)

Feeds = Mapping[str, np.ndarray]
Outputs = dict[str, np.ndarray]
#: Below this many bytes a member's tensor is copied without looking for it in place
#: ([Note: a batch's states in place]): looking costs more than the copy.
IN_PLACE_BYTES = 4096
#: The longest a session counts as active for ``--batch-delay`` after its last step
#: ([Note: the step batcher]); a session seen once counts this long.
ACTIVE_S = 2.0
#: A session counts as active for this many of its own round times after its last step.
ROUNDS = 2.0


def unpaddable(mask: str | None, states: Sequence[StateSpec]) -> str | None:
    """Why ``--batch-padding`` cannot pad a decoder's steps, given its attention mask and
    its states (None: it can): it left-pads the mask and every state as a KV cache
    ([Note: batching exactness])."""
    if mask is None:
        return "the decoder has no attention mask to pad"
    if any(state.grows is None for state in states):
        return "a state of the decoder is not a KV cache"
    return None


@dataclass(frozen=True)
class Padding:
    """How to left-pad a decoder's steps of different past lengths into one batch.

    ``mask``: the attention mask input [batch, past + seq]; ``states``: each growing
    state's input, output and growing axis (a KV cache [batch, heads, past, dim]).
    """

    mask: str
    states: tuple[tuple[str, str, int], ...]


def group_key(feeds: Feeds, padding: Padding | None = None) -> Hashable:
    """What steps must share to run as one call: every tensor's dtype and shape but for
    axis 0 ([Note: batching exactness]); with ``padding``, the past length is not part of it."""
    grows = {name: axis for name, _, axis in padding.states} if padding else {}
    if padding is not None:
        grows[padding.mask] = 1
    key: list[tuple[str, object, tuple[int, ...]]] = []
    for name in sorted(feeds):
        value = feeds[name]
        dims = value.shape[1:]
        axis = grows.get(name)
        if axis is not None:
            dims = (*dims[: axis - 1], -1, *dims[axis:])
        key.append((name, value.dtype, dims))
    if padding is not None:  # the step's length: the mask minus a state's past
        mask = feeds.get(padding.mask)
        state = feeds.get(padding.states[0][0]) if padding.states else None
        if mask is None or state is None:
            return ("unpadded", tuple(key))
        key.append(("seq", "", (mask.shape[1] - state.shape[padding.states[0][2]],)))
    return tuple(key)


def stack(members: Sequence[Feeds]) -> dict[str, np.ndarray]:
    """The members' tensors concatenated on axis 0, in member order: where they already lie
    so, back to back in one array, that array's rows instead of a copy ([Note: a batch's
    states in place])."""
    first = members[0]
    stacked = {}
    for name in first:
        parts = [m[name] for m in members]
        rows = in_place(parts) if parts[0].nbytes >= IN_PLACE_BYTES else None
        stacked[name] = np.concatenate(parts, axis=0) if rows is None else rows
    return stacked


def in_place(parts: Sequence[np.ndarray]) -> np.ndarray | None:
    """The rows of one C-contiguous array that ``parts`` are, in order and back to back (the
    array :func:`stack` would make, as a view); None when they are not."""
    base = parts[0].base
    if not isinstance(base, np.ndarray) or base.ndim == 0 or not base.flags.c_contiguous:
        return None
    if base.shape[1:] != parts[0].shape[1:] or base.dtype != parts[0].dtype:
        return None
    if any(part.base is not base for part in parts):
        return None
    row = base.itemsize * math.prod(base.shape[1:])
    if row == 0:
        return None
    origin = _address(base)
    start, off_row = divmod(_address(parts[0]) - origin, row)
    if off_row:
        return None
    end = start
    for part in parts:  # each a whole row or rows of base's, right after the one before
        if not part.flags.c_contiguous or _address(part) != origin + end * row:
            return None
        end += part.shape[0]
    return base[start:end] if end <= base.shape[0] else None


def _address(array: np.ndarray) -> int:
    """Where ``array``'s first element lies (``array.ctypes.data``, a third faster)."""
    return int(array.__array_interface__["data"][0])


def row_order(members: Sequence[Feeds]) -> list[int]:
    """The members' indices in the order their largest tensors lie in memory: the sessions
    of one earlier call come together, in that call's order, so that :func:`stack` finds
    their states in place ([Note: a batch's states in place])."""
    first = members[0]
    if not first:
        return list(range(len(members)))
    name = max(first, key=lambda n: first[n].nbytes)
    return sorted(range(len(members)), key=lambda i: _address(members[i][name]))


def split(outputs: Mapping[str, np.ndarray], sizes: Sequence[int]) -> list[Outputs]:
    """Cut each output on axis 0 back into the members' parts (views, no copies).

    A :class:`ModelError` when an output's axis 0 is not the batch (its length is not the
    members' total): the graph did not keep rows apart, and nothing is answered from it.
    """
    total = sum(sizes)
    for name, value in outputs.items():
        if value.ndim == 0 or value.shape[0] != total:
            raise ModelError(
                f"output {name!r} of a batch of {len(sizes)} steps has shape "
                f"{list(value.shape)}: expected {total} rows on axis 0"
            )
    parts: list[Outputs] = []
    start = 0
    for size in sizes:
        parts.append({name: value[start : start + size] for name, value in outputs.items()})
        start += size
    return parts


def pad(members: Sequence[Feeds], padding: Padding) -> tuple[list[Feeds], list[int]]:
    """The members left-padded to the longest past ([Note: batching exactness]): zeros in
    each growing state and in the mask before what each member has; and each member's pad."""
    axis0 = padding.states[0]
    pasts = [m[axis0[0]].shape[axis0[2]] for m in members]
    longest = max(pasts)
    padded: list[Feeds] = []
    for member, past in zip(members, pasts, strict=True):
        extra = longest - past
        out = dict(member)
        if extra:
            for name, _, axis in padding.states:
                out[name] = _left_pad(member[name], axis, extra)
            out[padding.mask] = _left_pad(member[padding.mask], 1, extra)
        padded.append(out)
    return padded, [longest - past for past in pasts]


def unpad(outputs: Outputs, original: Feeds, extra: int, padding: Padding) -> Outputs:
    """A padded member's outputs as its own: growing states without the padding, the mask
    it came with."""
    if not extra:
        return outputs
    out = dict(outputs)
    for _, name, axis in padding.states:
        if name in out:
            cut = [slice(None)] * out[name].ndim
            cut[axis] = slice(extra, None)
            out[name] = out[name][tuple(cut)]
    if padding.mask in out:
        out[padding.mask] = np.asarray(original[padding.mask])
    return out


def _left_pad(value: np.ndarray, axis: int, extra: int) -> np.ndarray:
    widths = [(0, 0)] * value.ndim
    widths[axis] = (extra, 0)
    return np.pad(value, widths)


@dataclass(frozen=True)
class Pending:
    """A step on its way to a batcher: what :meth:`StepBatcher.run` takes, and the batcher
    that runs it ([Note: a batch in one message] in tierflow/runtime/batch_message.py)."""

    batcher: StepBatcher
    feeds: Feeds
    member: Hashable = ""
    owner: str = ""
    deadline_unix_s: float = 0.0

    def run(self) -> Outputs:
        """Run the step alone, or in a batch with what queues beside it."""
        return self.batcher.run(
            self.feeds, member=self.member, owner=self.owner, deadline_unix_s=self.deadline_unix_s
        )


class Departure:
    """The steps of one batched call, going on from the tier together ([Note: a batch in
    one message] in tierflow/runtime/batch_message.py).

    Each member is settled once: by depositing what it sends on, or by going no further
    (answered here, or failed). The one call that settles the last member gets every
    deposit, in seat order, to send as one message; every other call gets None.
    Thread-safe."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._lock = threading.Lock()
        self._settled: set[int] = set()
        self._deposits: dict[int, object] = {}

    def deposit(self, seat: int, what: object) -> list[object] | None:
        """Member ``seat`` goes on with ``what``."""
        return self._settle(seat, what)

    def settle(self, seat: int) -> list[object] | None:
        """Member ``seat`` goes no further (nothing, if it was settled already)."""
        return self._settle(seat, None)

    def _settle(self, seat: int, what: object) -> list[object] | None:
        with self._lock:
            if seat in self._settled:
                return None
            self._settled.add(seat)
            if what is not None:
                self._deposits[seat] = what
            if len(self._settled) < self.size:
                return None
            return [self._deposits[s] for s in sorted(self._deposits)]


#: The departure seat of the step this thread ran last, if it ran in a batch.
_departing = threading.local()


def departs_together() -> bool:
    """Whether this thread's last step ran in a batch call whose steps go on together, its
    seat not yet asked for (:func:`departure_seat`): what the step sends on is encoded
    with the others', stacked ([Note: a batch's tensors stacked] in
    tierflow/runtime/batch_message.py)."""
    return getattr(_departing, "seat", None) is not None


def departure_seat() -> tuple[Departure, int] | None:
    """The batch call that this thread's last step ran in, and its seat there (None: it
    ran alone, or this was asked already): what the thread must settle."""
    seat: tuple[Departure, int] | None = getattr(_departing, "seat", None)
    _departing.seat = None
    return seat


@dataclass
class _Step:
    feeds: Feeds
    key: Hashable
    member: Hashable
    deadline_unix_s: float
    owner: str = ""
    #: It came with the others of a batched request (:meth:`StepBatcher.run_all`): they
    #: are its company, and go on together from the tier that sent them.
    together: bool = False
    departure: tuple[Departure, int] | None = None
    result: Outputs | None = None
    error: BaseException | None = None
    done: bool = False
    #: Its thread waits on it (under the batcher's lock) for its answer or its turn to lead.
    turn: threading.Condition | None = None
    rows: int = field(init=False)

    def __post_init__(self) -> None:
        first = next(iter(self.feeds.values()), None)
        self.rows = int(first.shape[0]) if first is not None and first.ndim else 1


def _answered(step: _Step) -> Outputs:
    assert step.result is not None
    return step.result


@dataclass(frozen=True)
class _Seen:
    """A session's last step here, for ``--batch-delay``'s company ([Note: the step
    batcher]): when it was taken, its group, and the time since the session's step before."""

    at: float
    key: Hashable
    gap: float | None

    def active(self, now: float) -> bool:
        window = ACTIVE_S if self.gap is None else min(ACTIVE_S, ROUNDS * self.gap)
        return now - self.at <= window


@dataclass
class BatchStats:
    """What a batcher did: calls made, steps run, the largest batch, steps run in batches;
    the calls by the steps each ran (``sizes``) and the seconds they took (``seconds``)."""

    calls: int = 0
    steps: int = 0
    largest: int = 0
    batched: int = 0
    sizes: dict[int, int] = field(default_factory=dict)
    seconds: dict[int, float] = field(default_factory=dict)

    def took(self, size: int, seconds: float) -> None:
        """A call of ``size`` steps took ``seconds``."""
        self.seconds[size] = self.seconds.get(size, 0.0) + seconds

    def to_dict(self) -> dict[str, object]:
        return {
            "calls": self.calls,
            "steps": self.steps,
            "largest": self.largest,
            "batched": self.batched,
            "sizes": {str(k): v for k, v in sorted(self.sizes.items())},
            "seconds": {str(k): v for k, v in sorted(self.seconds.items())},
        }


class StepBatcher:
    """Runs ``run`` on steps of many threads, grouped into batches ([Note: the step batcher]).

    ``run`` takes one feed dict (stacked or not) and returns the outputs, rows on axis 0.
    ``max_batch`` steps at most share a call; ``delay_s`` is ``--batch-delay``;
    ``padding`` (``--batch-padding``) groups steps of different past lengths;
    ``first_waits``: with a delay, a session's first step here waits for company too (for
    other sessions starting with it), not only its later steps; ``own_thread``: ``run``
    runs on one thread, whichever thread leads: the only one to have led so far, else
    one of the batcher's own ([Note: the step batcher]).
    """

    def __init__(
        self,
        run: Callable[[Feeds], Outputs],
        *,
        name: str,
        max_batch: int,
        delay_s: float = 0.0,
        padding: Padding | None = None,
        clock: Callable[[], float] = time.monotonic,
        first_waits: bool = True,
        own_thread: bool = False,
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self._run = run
        self.name = name
        self.max_batch = max_batch
        self.delay_s = delay_s
        self.padding = padding
        self._clock = clock
        self.first_waits = first_waits
        self._lock = threading.Lock()
        #: A leader waiting for company waits on it; each queued step waits on
        #: its own (``_Step.turn``), so an answer or a free batcher wakes one thread.
        self._cond = threading.Condition(self._lock)
        self._queue: deque[_Step] = deque()
        self._busy = False
        self._seen: dict[Hashable, _Seen] = {}  # with --batch-delay: each session's last step
        self.stats = BatchStats()
        self._calls = (
            ThreadPoolExecutor(1, thread_name_prefix=f"{name.removeprefix('the ')}-calls")
            if own_thread
            else None
        )
        #: With ``own_thread``: the thread that has led every call so far (they ran on it,
        #: with no hand-over), until another leads one (``_many_leaders``).
        self._leader: int | None = None
        self._many_leaders = False

    def run(
        self,
        feeds: Feeds,
        *,
        member: Hashable = "",
        owner: str = "",
        deadline_unix_s: float = 0.0,
    ) -> Outputs:
        """Run one step, alone or in a batch; its outputs, or its own error raised.

        ``member``: the step's session; ``owner``: whose it is (batches are shared fairly
        among owners)."""
        key = group_key(feeds, self.padding) if self.delay_s > 0 else None
        if self._idle_run(member, key):
            _departing.seat = None
            try:
                with lent():  # [Note: a worker lent while a step queues]
                    return self._timed(1, feeds)  # the tier was idle: at once, alone
            finally:
                self._free()
        if key is None:
            key = group_key(feeds, self.padding)
        step = _Step(feeds, key, member, deadline_unix_s, owner)
        step.turn = threading.Condition(self._lock)
        # [Note: a worker lent while a step queues] (tierflow/runtime/workers.py).
        with lent():
            with self._cond:
                self._queue.append(step)
                self._cond.notify_all()  # a leader waiting out --batch-delay counts it
                self._wait_turn(step)
            if not step.done:
                self._lead(step)
        _departing.seat = step.departure
        if step.error is not None:
            raise step.error
        assert step.result is not None
        return step.result

    def run_all(self, steps: Sequence[Pending]) -> list[Outputs | BaseException]:
        """Run the steps of one batched request together, from one thread: each step's
        outputs, or its own error ([Note: a batch in one message] in
        tierflow/runtime/batch_message.py). They queue at once, so they share a call
        (with other steps of their group queued here, up to ``max_batch``), and they are
        each other's company: none waits for other sessions to start."""
        queued = []
        for pending in steps:
            key = group_key(pending.feeds, self.padding)
            step = _Step(
                pending.feeds, key, pending.member, pending.deadline_unix_s, pending.owner, True
            )
            step.turn = threading.Condition(self._lock)
            queued.append(step)
        with lent():  # [Note: a worker lent while a step queues]
            with self._cond:
                self._queue.extend(queued)
                self._cond.notify_all()
            for step in queued:
                with self._cond:
                    self._wait_turn(step)
                if not step.done:
                    self._lead(step)
        return [step.error or _answered(step) for step in queued]

    def _idle_run(self, member: Hashable, key: Hashable | None) -> bool:
        """Take the batcher for a step that finds it idle (nothing running, nothing
        queued): it runs at once, alone, with no step to queue or batch to form; unless
        ``--batch-delay`` (``key``: the step's group, given only then) expects company
        for it ([Note: the step batcher])."""
        with self._cond:
            if self._busy or self._queue:
                return False
            if key is not None:
                now = self._clock()
                if self._missing(member, now) or self._new(member):
                    return False
                self._saw(member, key, now)
            self._busy = True
            stats = self.stats
            stats.calls += 1
            stats.steps += 1
            stats.largest = max(stats.largest, 1)
            stats.sizes[1] = stats.sizes.get(1, 0) + 1
            return True

    def _free(self) -> None:
        with self._cond:
            self._release()

    def _release(self) -> None:
        """The batcher is free: the oldest queued step's thread takes the lead; hold the
        lock."""
        self._busy = False
        if self._queue:
            turn = self._queue[0].turn
            assert turn is not None
            turn.notify()
        self._cond.notify_all()

    def _wait_turn(self, step: _Step) -> None:
        """Wait until ``step`` is answered or the batcher is free, then take the lead if
        it is not answered; hold the lock."""
        assert step.turn is not None
        while not step.done and self._busy:
            step.turn.wait()
        if not step.done:
            self._busy = True

    def _lead(self, mine: _Step) -> None:
        """Run batches until ``mine`` is answered, then hand the lead on."""
        try:
            while not mine.done:
                batch = self._take()
                if batch:
                    self._call(batch)
        finally:
            with self._cond:
                self._release()

    def _take(self) -> list[_Step]:
        """The next batch: the oldest queued step and the later ones of its group."""
        with self._cond:
            if self.delay_s > 0:
                ends = self._clock() + self.delay_s
                while self._awaits_company():
                    left = ends - self._clock()
                    if left <= 0:
                        break
                    self._cond.wait(left)
            batch = self._gather()
            if self.delay_s > 0:
                now = self._clock()
                for step in batch:
                    self._saw(step.member, step.key, now)
        return self._live(batch)

    def _gather(self) -> list[_Step]:
        """Take the oldest queued step and its group's later steps off the queue; hold the lock.

        When more of the group are queued than ``max_batch``, each owner's first step goes
        before any owner's second, and so on (oldest first within a rank): an identity
        with many sessions does not fill every batch ([Note: the step batcher])."""
        if not self._queue:
            return []
        key = self._queue[0].key
        group = [step for step in self._queue if step.key == key]
        if len(group) > self.max_batch:
            ranks: dict[str, int] = {}
            order = []
            for i, step in enumerate(group):
                rank = ranks.get(step.owner, 0)
                ranks[step.owner] = rank + 1
                order.append((rank, i))
            chosen = {i for _, i in sorted(order)[: self.max_batch]}
            group = [step for i, step in enumerate(group) if i in chosen]
        taken = {id(step) for step in group}
        self._queue = deque(step for step in self._queue if id(step) not in taken)
        return group

    def queued(self) -> int:
        """Steps waiting for a call now."""
        with self._cond:
            return len(self._queue)

    def _awaits_company(self) -> bool:
        """Whether the oldest queued step's group is not full and company it can expect
        has not queued yet ([Note: the step batcher]); hold the lock."""
        if not self._queue:
            return False
        head = self._queue[0]
        if sum(step.key == head.key for step in self._queue) >= self.max_batch:
            return False
        missing = self._missing(head.member, self._clock())
        if not head.together and self._new(head.member):
            return True  # the first steps of sessions that start together: up to the delay
        return missing > 0

    def _new(self, member: Hashable) -> bool:
        """Whether ``member``'s step is the first this batcher sees of its session (or its
        first after ``ACTIVE_S`` without one), with ``first_waits``; hold the lock. Not
        whether it is active: a session whose steps come further apart than ``ROUNDS``
        of its rounds expects no company, and waits for none."""
        return self.first_waits and member not in self._seen

    def _missing(self, member: Hashable, now: float) -> int:
        """The active sessions whose last step was of the same group as ``member``'s
        last, with no step queued: the company ``member``'s step can expect ([Note: the
        step batcher]). Forgets the sessions not seen for ``ACTIVE_S``; hold the lock."""
        mine = self._seen.get(member)
        queued = {step.member for step in self._queue}
        missing = 0
        for other, seen in list(self._seen.items()):
            if now - seen.at > ACTIVE_S:
                del self._seen[other]
            elif mine is not None and other != member and seen.key == mine.key:
                missing += seen.active(now) and other not in queued
        return missing

    def _saw(self, member: Hashable, key: Hashable, now: float) -> None:
        """``member``'s step of group ``key`` was taken at ``now``; hold the lock."""
        seen = self._seen.get(member)
        self._seen[member] = _Seen(now, key, None if seen is None else now - seen.at)

    def _live(self, batch: list[_Step]) -> list[_Step]:
        """``batch`` without the steps whose deadline passed while they queued."""
        now = time.time()
        live = []
        for step in batch:
            if step.deadline_unix_s and now > step.deadline_unix_s:
                self._finish(
                    step,
                    error=DeadlineError(
                        f"the step's deadline passed while it queued for a batch on {self.name}"
                    ),
                )
            else:
                live.append(step)
        return live

    def _call(self, batch: list[_Step]) -> None:
        """Run ``batch`` as one call; if it fails, each step alone."""
        stats = self.stats
        stats.calls += 1
        stats.steps += len(batch)
        stats.largest = max(stats.largest, len(batch))
        stats.sizes[len(batch)] = stats.sizes.get(len(batch), 0) + 1
        if len(batch) == 1:
            self._alone(batch[0])
            return
        stats.batched += len(batch)
        try:
            parts = self._batched(batch)
        except Exception as exc:
            logger.info(
                "[%s] a batch of %d steps failed (%s); running them one by one",
                self.name,
                len(batch),
                exc,
            )
            for step in batch:
                self._alone(step)
            return
        # The steps that came one by one go on together; those of a batched request go on
        # with their own (run_all's caller sends them).
        alone = [step for step in batch if not step.together]
        departure = Departure(len(alone))
        for seat, step in enumerate(alone):
            step.departure = (departure, seat)
        for step, part in zip(batch, parts, strict=True):
            self._finish(step, result=part)

    def _batched(self, batch: list[_Step]) -> list[Outputs]:
        """Each step's outputs, in ``batch``'s order, from one call whose rows are in
        :func:`row_order`."""
        order = row_order([step.feeds for step in batch])
        steps = [batch[i] for i in order]
        feeds: list[Feeds] = [step.feeds for step in steps]
        extras = [0] * len(steps)
        if self.padding is not None:
            feeds, extras = pad(feeds, self.padding)
        parts = split(self._timed(len(steps), stack(feeds)), [step.rows for step in steps])
        if self.padding is not None:
            parts = [
                unpad(part, step.feeds, extra, self.padding)
                for part, step, extra in zip(parts, steps, extras, strict=True)
            ]
        outputs: list[Outputs] = [{} for _ in batch]
        for i, part in zip(order, parts, strict=True):
            outputs[i] = part
        return outputs

    def _timed(self, size: int, feeds: Feeds) -> Outputs:
        """``run`` on a call of ``size`` steps, its time kept in the stats: on the batcher's
        own thread, if it has one, unless one thread has led every call so far."""
        if self._calls is not None and not self._one_leader():
            return self._calls.submit(self._timed_here, size, feeds).result()
        return self._timed_here(size, feeds)

    def _one_leader(self) -> bool:
        """Whether this thread, leading a call, is the one that led every call before it
        (``own_thread``; [Note: the step batcher]). Only the leader calls it."""
        if self._many_leaders:
            return False
        me = threading.get_ident()
        if self._leader is None:
            self._leader = me
        self._many_leaders = self._leader != me
        return not self._many_leaders

    def _timed_here(self, size: int, feeds: Feeds) -> Outputs:
        start = time.perf_counter()
        try:
            return self._run(feeds)
        finally:
            self.stats.took(size, time.perf_counter() - start)

    def _alone(self, step: _Step) -> None:
        try:
            result = self._timed(1, step.feeds)
        except BaseException as exc:  # the step's own error, for its own caller
            self._finish(step, error=exc)
            return
        self._finish(step, result=result)

    def _finish(
        self, step: _Step, *, result: Outputs | None = None, error: BaseException | None = None
    ) -> None:
        with self._cond:
            step.result, step.error, step.done = result, error, True
            if step.turn is not None:
                step.turn.notify()
