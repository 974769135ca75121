"""Running a tier's share of a plan in ONNX Runtime: segments, input checks, early exits.

Every tier (device, edge, cloud) uses the same two classes: a :class:`SegmentRunner` owns
one ONNX Runtime session for one segment file; a :class:`TierRunner` runs the segments a
plan gives one tier, checks their early exits, and says what to do next: answer now, or
forward the named tensors to the next tier.

See [Note: what crosses to the next tier] in tierflow/plan.py for which tensors are forwarded and
[Note: exit confidence] for how an exit decides; sessions are opened by
``tierflow.onnxrt.inference``, whose [Note: optimization level and exactness] says which ONNX
Runtime setting keeps splits bit-exact. How to run (threads, slowdown, level) comes in one
:class:`~tierflow.options.RuntimeOptions`.

[Note: exit confidence]
An exit output holds class scores with classes on the last axis. If every row already
is a probability distribution (values in [0, 1] summing to 1 within 1e-3) it is used as
is; otherwise it is treated as logits and a softmax is taken. A request leaves at the
exit when the top probability of every row is at least the exit's threshold. An exit on
the plan's last segment is never taken: the final outputs are there anyway.

[Note: emulating a slower tier]
A tier run with ``slowdown`` s > 1 stands for a machine s times slower than this one
(``tierflow profile --slowdown`` makes its profile the same way: every measured time,
compute and codec alike, times s). So it sleeps ``(s - 1)`` times the time of each
piece of its own CPU work: every ONNX Runtime call (:meth:`SegmentRunner.run`) and every
encoding or decoding of the tensors it sends or receives (the device's upload, a
server's decode, forward and answer), through :func:`emulate_slower`. Sleeping after the
compute only would make a slow device's zstd as fast as this machine's, and the planner,
whose profile scales codec time, would rank compressed uploads against raw ones by
codec costs the emulated tier never pays. Codec work is timed in the thread's CPU time
(as the profile measures it, ``tierflow.codec.base.measure``), not wall time: an encode on a
device with many requests in flight, or on a machine shared with other jobs, waits for
the GIL or for a core, and that wait is not the tier's work; multiplied by ``s - 1`` it
would be charged 19 times over on a 20x device. ONNX Runtime calls are timed the same
way when the session has one intra-op thread (``--threads 1``, as every emulated tier of
the benchmarks and the demo runs): its work then runs on the calling thread, whose CPU
time is the call's compute. In wall time the call also counts the wait to take the GIL
back when it returns, up to Python's switch interval (5 ms) whenever another thread of
the process is busy: measured on MobileNetV2 at 112x112, 12.6 ms alone and 18.0 ms
beside one busy thread in wall time, 12.6 and 12.9 ms in CPU time. On a 10x device that
wait became 25 ms more per device-only request in the adaptation benchmark's adaptive
runs, whose device process has more threads awake (probes, the estimate sampler) than a
static run's. With more threads, ONNX Runtime's own threads do part of the work, which
the calling thread's CPU time does not see, so the call is timed in wall time.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tierflow.errors import InputError, ModelError, PlanError
from tierflow.link.spec import TIERS
from tierflow.onnxrt.inference import open_session
from tierflow.options import RuntimeOptions
from tierflow.plan import ExitSpec, Plan, SegmentSpec
from tierflow.runtime.batching import Outputs, Padding, Pending, StepBatcher, unpaddable
from tierflow.state.spec import StateSpec

logger = logging.getLogger(__name__)

# ONNX Runtime's element type names -> numpy dtypes.
_ORT_DTYPES: dict[str, str] = {
    "tensor(float)": "float32",
    "tensor(float16)": "float16",
    "tensor(double)": "float64",
    "tensor(int8)": "int8",
    "tensor(int16)": "int16",
    "tensor(int32)": "int32",
    "tensor(int64)": "int64",
    "tensor(uint8)": "uint8",
    "tensor(uint16)": "uint16",
    "tensor(uint32)": "uint32",
    "tensor(uint64)": "uint64",
    "tensor(bool)": "bool",
}


@dataclass(frozen=True)
class InputSpec:
    """What a segment expects of one input: dtype and shape (None for a symbolic dim)."""

    name: str
    dtype: str
    shape: tuple[int | None, ...]

    def describe(self) -> str:
        dims = "x".join("?" if d is None else str(d) for d in self.shape)
        return f"{self.dtype}[{dims}]"

    def check(self, dtype: str, shape: tuple[int, ...], owner: str) -> None:
        """Raise an :class:`InputError` unless ``dtype``/``shape`` fit this input."""
        fits = dtype == self.dtype and len(shape) == len(self.shape)
        if fits:  # a loop: this runs for every tensor of every request
            for expected, found in zip(self.shape, shape, strict=True):
                if expected is not None and expected != found:
                    fits = False
                    break
        if not fits:
            dims = "x".join(str(d) for d in shape)
            raise InputError(
                f"{owner} input {self.name!r}: expected {self.describe()}, found {dtype}[{dims}]"
            )

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> InputSpec:
        return cls(str(data["name"]), str(data["dtype"]), tuple(data["shape"]))


def emulate_slower(
    slowdown: float, started: float, clock: Callable[[], float] = time.perf_counter
) -> None:
    """Sleep ``(slowdown - 1)`` times ``clock() - started``; nothing at ``slowdown`` 1.

    The clock is this thread's CPU time, :func:`time.thread_time`, for codec work and for
    ONNX Runtime calls on one thread; wall time for ONNX Runtime calls whose work may run
    on its own threads (see [Note: emulating a slower tier]).
    """
    if slowdown > 1.0:
        time.sleep((slowdown - 1.0) * (clock() - started))


class SegmentRunner:
    """One segment file loaded into an ONNX Runtime session; safe to call from many threads.

    ``options.slowdown`` > 1 emulates a slower tier: after each run the caller sleeps
    ``(slowdown - 1)`` times the compute time, so the tier is slow end to end (latency and
    throughput alike) just as the profile for that tier says
    ([Note: emulating a slower tier]).
    """

    def __init__(self, path: str | Path, options: RuntimeOptions | None = None) -> None:
        options = options or RuntimeOptions()
        self.path = Path(path)
        self.slowdown = options.slowdown
        # What a run's compute is timed by ([Note: emulating a slower tier]).
        self._clock = time.thread_time if options.threads == 1 else time.perf_counter
        self.session = open_session(
            self.path,
            threads=options.threads,
            optimization=options.optimization,
            providers=options.providers,
            what=f"segment {self.path}",
        )
        self.inputs: dict[str, InputSpec] = {}
        for arg in self.session.get_inputs():
            dtype = _ORT_DTYPES.get(arg.type)
            if dtype is None:
                raise ModelError(f"segment {self.path.name} input {arg.name!r} has type {arg.type}")
            shape = tuple(d if isinstance(d, int) and d >= 0 else None for d in arg.shape)
            self.inputs[arg.name] = InputSpec(arg.name, dtype, shape)
        self.output_names = [arg.name for arg in self.session.get_outputs()]
        #: Every input and output has a symbolic first axis: steps could share a call
        #: ([Note: batching exactness] in tierflow/runtime/batching.py).
        self.symbolic_batch = all(spec.shape[:1] == (None,) for spec in self.inputs.values())
        self.symbolic_batch = self.symbolic_batch and all(
            len(arg.shape) > 0 and not isinstance(arg.shape[0], int)
            for arg in self.session.get_outputs()
        )

    def check_inputs(self, feeds: Mapping[str, np.ndarray]) -> None:
        """Raise an :class:`InputError` naming what was expected and what was found."""
        missing = sorted(set(self.inputs) - set(feeds))
        extra = sorted(set(feeds) - set(self.inputs))
        if missing or extra:
            raise InputError(
                f"segment {self.path.name} expects inputs {sorted(self.inputs)}, found "
                f"{sorted(feeds)} (missing {missing}, unexpected {extra})"
            )
        for name, spec in self.inputs.items():
            array = feeds[name]
            spec.check(array.dtype.name, tuple(array.shape), f"segment {self.path.name}")

    def run(
        self, feeds: Mapping[str, np.ndarray], *, checked: bool = False
    ) -> dict[str, np.ndarray]:
        """Run the segment; inputs are checked first (unless ``checked``: the caller did),
        runtime failures become ModelError."""
        if not checked:
            self.check_inputs(feeds)
        start = self._clock() if self.slowdown > 1.0 else 0.0
        try:
            values = self.session.run(self.output_names, dict(feeds))
        except Exception as exc:
            text = str(exc)
            if "INVALID_ARGUMENT" in text or "InvalidArgument" in type(exc).__name__:
                raise InputError(f"segment {self.path.name} refused its inputs: {text}") from exc
            # The one line a failed run leaves (ONNX Runtime's own is off:
            # tierflow/onnxrt/inference.py).
            logger.warning("segment %s failed: %s", self.path.name, text.strip()[:500])
            raise ModelError(f"segment {self.path.name} failed: {text}") from exc
        emulate_slower(self.slowdown, start, self._clock)
        return dict(zip(self.output_names, values, strict=True))


def exit_confidence(scores: np.ndarray) -> float:
    """Lowest top-class probability over the rows of ``scores`` ([Note: exit confidence])."""
    values = np.asarray(scores, dtype=np.float64)
    if values.ndim == 0 or values.size == 0:
        return 0.0
    rows = values.reshape(-1, values.shape[-1])
    if not np.isfinite(rows).all():
        return 0.0
    sums = rows.sum(axis=-1)
    if (rows >= 0).all() and (rows <= 1).all() and np.allclose(sums, 1.0, atol=1e-3):
        probs = rows
    else:
        shifted = np.exp(rows - rows.max(axis=-1, keepdims=True))
        probs = shifted / shifted.sum(axis=-1, keepdims=True)
    return float(probs.max(axis=-1).min())


@dataclass
class Outcome:
    """What a tier did with a request: an answer (``final``) or tensors to forward."""

    tensors: dict[str, np.ndarray]
    final: bool
    exit: str | None = None
    next_segment: int = 0
    compute_s: float = 0.0
    confidence: float | None = None
    exits_checked: list[str] = field(default_factory=list)
    #: The last exit checked and not taken, with its scores: the best answer a tier has
    #: when the next tier is gone ([Note: answering without the next tier] in
    #: tierflow/runtime/pipeline.py). None when no exit was checked, or one was taken.
    unconfident: tuple[str, np.ndarray] | None = None
    #: The state outputs of this tier's segments, by the state input they feed next
    #: ([Note: session state on a tier] in tierflow/state/store.py).
    state: dict[str, np.ndarray] = field(default_factory=dict)


class TierRunner:
    """The segments one tier runs for a plan, in order, with their early exits.

    A tier with no segments is valid (it only forwards, or only answers from a cache).
    ``start`` is the index of the first segment that this tier or a later one runs: the
    ``segment`` a request arriving here must name.
    """

    def __init__(
        self,
        plan: Plan,
        plan_dir: str | Path,
        tier: str,
        options: RuntimeOptions | None = None,
        sessions: dict[Path, SegmentRunner] | None = None,
    ) -> None:
        """``sessions`` (by segment file) is shared by the runners of one plan set's plans:
        a segment file two plans name is opened once."""
        if tier not in TIERS:
            raise PlanError(f"unknown tier {tier!r}: expected one of {', '.join(TIERS)}")
        self.plan = plan
        self.tier = tier
        self.start = plan.entry(tier)
        mine = plan.segments_for(tier)
        self.segments: list[tuple[int, SegmentSpec, SegmentRunner]] = []
        for index, spec in mine:
            path = Path(plan_dir) / spec.file
            runner = sessions.get(path) if sessions is not None else None
            if runner is None:
                runner = SegmentRunner(path, options)
                if sessions is not None:
                    sessions[path] = runner
            missing = sorted(set(spec.inputs) - set(runner.inputs))
            if missing or not set(spec.outputs) <= set(runner.output_names):
                raise PlanError(
                    f"segment file {spec.file} does not match the plan: expected inputs "
                    f"{list(spec.inputs)} and outputs {list(spec.outputs)}, found inputs "
                    f"{sorted(runner.inputs)} and outputs {runner.output_names}"
                )
            self.segments.append((index, spec, runner))
        self.end = self.segments[-1][0] + 1 if self.segments else self.start
        #: The state pairs of this tier's segments ([Note: state pairs] in
        #: tierflow/state/pairs.py): fed by the caller, never carried by a request.
        self.states: tuple[StateSpec, ...] = tuple(
            state for _, spec, _ in self.segments for state in spec.state
        )
        #: Their inputs' names.
        self.state_inputs = frozenset(s.input for s in self.states)
        self.needs = self.required_names(self.start)
        self._needed = set(self.needs)
        # What a request leaving this tier carries ([Note: what crosses to the next tier]).
        self._forwarded = self.required_names(self.end)
        self._input_specs: dict[str, InputSpec] = {}
        for _, spec, runner in self.segments:
            for name in spec.inputs:
                if name in self._needed and name not in self._input_specs:
                    self._input_specs[name] = runner.inputs[name]
        #: Runs the steps of many sessions in one call, where the plan allows it
        #: ([Note: the step batcher] in tierflow/runtime/batching.py); None otherwise.
        self.batcher = self._batcher(options or RuntimeOptions())

    def _batcher(self, options: RuntimeOptions) -> StepBatcher | None:
        """A batcher for a decoder plan's segments that batch ([Note: batching exactness]).

        A tier with none of the plan's segments has one too, whose call runs nothing: the
        steps it gathers go on as one message ([Note: a batch in one message] in
        tierflow/runtime/batch_message.py), as a device's sessions' steps of a cloud-only
        plan do."""
        decoder = self.plan.decoder
        if options.max_batch <= 1 or decoder is None:
            return None
        if any(spec.exits for _, spec, _ in self.segments):
            return None
        if not all(runner.symbolic_batch for _, _, runner in self.segments):
            return None
        padding = None
        mask = decoder.attention_mask
        if (
            options.batch_padding
            and mask is not None
            and mask in self._needed
            and unpaddable(mask, self.states) is None
        ):
            growing = tuple(
                (s.input, s.output, s.grows) for s in self.states if s.grows is not None
            )
            padding = Padding(mask, growing)
        final = self.end >= len(self.plan.segments)
        self._returned = (
            *(self.plan.outputs if final else self._forwarded),
            *(s.output for s in self.states),
        )
        return StepBatcher(
            self._through,
            name=f"the {self.tier}",
            max_batch=options.max_batch,
            delay_s=options.batch_delay_s,
            padding=padding,
            own_thread=bool(self.segments),  # [Note: the step batcher]
        )

    def _through(self, env: Mapping[str, np.ndarray]) -> Outputs:
        """This tier's segments on ``env`` (one step, or a batch of them): what the step
        returns (model outputs or forwarded tensors) and its new states."""
        values = dict(env)
        for _, spec, runner in self.segments:
            values.update(runner.run({name: values[name] for name in spec.inputs}, checked=True))
        return {name: values[name] for name in self._returned}

    def required_names(self, index: int) -> tuple[str, ...]:
        """Tensors a request entering at segment ``index`` must carry (``Plan.carried``)."""
        return self.plan.carried(index)

    def check_specs(self, given: Iterable[tuple[str, str, tuple[int, ...]]], owner: str) -> None:
        """Raise an :class:`InputError` unless each incoming tensor (name, dtype, shape) that
        this tier's segments read directly fits the input it feeds."""
        for name, dtype, shape in given:
            spec = self._input_specs.get(name)
            if spec is not None:
                spec.check(dtype, shape, owner)

    def check_names(self, names: set[str], *, segment: int) -> None:
        """Raise unless a request names segment ``start`` and carries exactly ``needs``."""
        if segment != self.start:
            raise InputError(
                f"the {self.tier} runs the plan from segment {self.start}, but the request "
                f"names segment {segment}"
            )
        expected = self._needed
        if names != expected:
            raise InputError(
                f"the {self.tier} expects tensors {sorted(expected)}, found {sorted(names)} "
                f"(missing {sorted(expected - names)}, unexpected {sorted(names - expected)})"
            )

    def run(
        self,
        tensors: Mapping[str, np.ndarray],
        *,
        checked: bool = False,
        state: Mapping[str, np.ndarray] | None = None,
        member: str = "",
        owner: str = "",
        deadline_unix_s: float = 0.0,
    ) -> Outcome:
        """Run this tier's segments on ``tensors``; stop at the first confident exit.

        ``checked``: the caller has checked every tensor against :meth:`check_specs`
        already (a server, before decoding), so the segments need not check again.
        ``state``: the value of each of :attr:`states`' inputs for this step; the outcome
        carries what they become. ``member`` (the step's session), ``owner`` (whose it
        is) and ``deadline_unix_s`` are for the batcher, when the tier has one ([Note:
        the step batcher]).
        """
        if self.batcher is not None:
            pending = self.pending(tensors, checked, state, member, owner, deadline_unix_s)
            start = time.perf_counter()
            return self.batched_outcome(pending.run(), time.perf_counter() - start)
        env = self._env(tensors, state)
        last = len(self.plan.segments) - 1
        start = time.perf_counter()
        exits: list[str] = []
        for index, spec, runner in self.segments:
            env.update(runner.run({name: env[name] for name in spec.inputs}, checked=checked))
            if index == last:
                continue
            for exit_spec in spec.exits:
                exits.append(exit_spec.name)
                confidence = exit_confidence(env[exit_spec.name])
                if confidence >= exit_spec.threshold:
                    return self._exit(exit_spec, env, confidence, start, exits)
        elapsed = time.perf_counter() - start
        if self.end >= len(self.plan.segments):
            outputs = {name: env[name] for name in self.plan.outputs}
            return Outcome(
                outputs, True, None, self.end, elapsed, exits_checked=exits, state=self._kept(env)
            )
        forward = {name: env[name] for name in self._forwarded}
        unconfident = (exits[-1], env[exits[-1]]) if exits else None
        return Outcome(
            forward,
            False,
            None,
            self.end,
            elapsed,
            exits_checked=exits,
            unconfident=unconfident,
            state=self._kept(env),
        )

    def _env(
        self, tensors: Mapping[str, np.ndarray], state: Mapping[str, np.ndarray] | None
    ) -> dict[str, np.ndarray]:
        """What the segments are fed: ``tensors`` and the step's ``state``."""
        env = dict(tensors)
        if self.states:
            if state is None or state.keys() != self.state_inputs:
                raise InputError(
                    f"the {self.tier}'s segments keep state {[s.input for s in self.states]}: "
                    "a request must name a session"
                )
            env.update(state)
        return env

    def pending(
        self,
        tensors: Mapping[str, np.ndarray],
        checked: bool = False,
        state: Mapping[str, np.ndarray] | None = None,
        member: str = "",
        owner: str = "",
        deadline_unix_s: float = 0.0,
    ) -> Pending:
        """A step for the batcher, as :meth:`run` takes it: its tensors checked here, alone,
        so a bad one fails its own step before it joins a batch. Its outputs become its
        :class:`Outcome` with :meth:`batched_outcome`."""
        assert self.batcher is not None
        env = self._env(tensors, state)
        if not checked:
            for name, spec in self._input_specs.items():
                if name not in tensors:
                    self.check_names(set(tensors), segment=self.start)  # raises
                value = tensors[name]
                spec.check(value.dtype.name, tuple(value.shape), f"the {self.tier}'s")
        return Pending(self.batcher, env, member, owner, deadline_unix_s)

    def batched_outcome(self, values: Outputs, elapsed: float) -> Outcome:
        """A step's :class:`Outcome` from what the batcher returned for it, ``elapsed``
        seconds after it was handed over."""
        final = self.end >= len(self.plan.segments)
        names = self.plan.outputs if final else self._forwarded
        return Outcome(
            {name: values[name] for name in names},
            final,
            None,
            self.end,
            elapsed,
            state=self._kept(values),
        )

    def _kept(self, env: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """What this tier's state inputs are fed next: their outputs of this step."""
        return {s.input: env[s.output] for s in self.states}

    def _exit(
        self,
        exit_spec: ExitSpec,
        env: dict[str, np.ndarray],
        confidence: float,
        start: float,
        checked: list[str],
    ) -> Outcome:
        elapsed = time.perf_counter() - start
        logger.debug("[%s] exit %s taken (confidence %.3f)", self.tier, exit_spec.name, confidence)
        return Outcome(
            {exit_spec.name: env[exit_spec.name]},
            True,
            exit_spec.name,
            self.end,
            elapsed,
            confidence,
            checked,
        )
