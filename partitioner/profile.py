"""Profiling: measuring what one tier's machine costs for each unit of a model.

A *unit* is the run of nodes between two consecutive candidate cuts (``cuts[i]`` to
``cuts[i + 1]``). A profile holds, for one machine (real or emulated), the compute time
of every unit, the fixed overhead of one session call, the bytes and codec figures of
every cut, and the memory each unit needs. The cost model (:mod:`.cost`) only reads
profiles; this module is where the measuring happens (:func:`profile_model`), and
:mod:`tierflow.partitioner.profile_data` holds the data classes and their JSON form, all
re-exported here. See [Note: segment latency].

Profiles are JSON (``"format": "tierflow.profile/1"``) so one can be made on the real
device (``tierflow profile`` on a Raspberry Pi) and planned with elsewhere. A profile is
tied to one model: its sha256 and cut list must match the model it is used with.

[Note: segment latency]
A segment ``[s, e)`` run as one ONNX Runtime session costs ``overhead_s + Σ compute_s``
of its units ``+ output_s_per_byte * bytes at cut e``: its outputs come back as fresh
arrays, allocated and written on every call, while inner tensors stay in the session's
reused arena. Each unit gets its own session; the units are timed in rounds, in model
order (so each finds the caches as a whole run leaves them, and a burst of load on a
shared machine hits all of them alike), and a unit's time is the lower quartile of its
rounds (:func:`typical_s`) minus the call overhead measured on a trivial session and
minus the cost of its own output. A few whole segments (the whole model and its halves)
are timed in rounds too: the per-byte output cost is fitted (least squares) so that unit
sums match them, and ``correction`` (the median of measured / predicted over them)
rescales the unit times for what else units lose when run apart (fusions across a cut,
cache behaviour). The fit is kept in the profile (``calibration``) for people to check.
The number of rounds adapts to the model so that profiling stays within a time budget.
With one intra-op thread every call is timed by the calling thread's CPU time
(:func:`compute_clock`), so a burst of other work on a shared machine delays the
profile without inflating it; with more threads only the wall clock sees the pool's work.

Emulation: a machine ``slowdown`` times slower than this one is profiled by measuring
here and multiplying every time (compute, overhead, codec speed) by ``slowdown``
(:meth:`Profile.emulate`, which ``plan --slowdown`` uses too); the runtime emulates it the
same way, by sleeping ``(slowdown - 1)`` times what it measured.
"""

from __future__ import annotations

import logging
import os
import platform
import socket
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from tierflow.codec import base as codec_lib
from tierflow.codec.base import PLANNER_CODECS, CodecStats
from tierflow.errors import ModelError, ProfileError
from tierflow.onnxrt.providers import CPU
from tierflow.partitioner.codec_pruning import CutTraits, pruned_by, skipped_stats, widest_float
from tierflow.partitioner.profile_data import (
    PROFILE_FORMAT,
    CutProfile,
    MachineInfo,
    Profile,
    UnitProfile,
    load_profile,
    save_profile,
)

if TYPE_CHECKING:
    import onnx
    import onnxruntime

    from tierflow.partitioner.graph import ModelGraph

__all__ = [
    "PROFILE_FORMAT",
    "CutProfile",
    "MachineInfo",
    "Profile",
    "ProgressFn",
    "UnitProfile",
    "capture_features",
    "load_profile",
    "machine_info",
    "make_session",
    "measure_cut_codecs",
    "profile_model",
    "run_session",
    "save_profile",
    "time_session",
    "typical_s",
    "with_codecs",
]

logger = logging.getLogger(__name__)

# Called as progress(done, total, what) while profiling.
ProgressFn = Callable[[int, int, str], None]


# Each unit is timed at least this many times (after one warm-up run), at most _MAX_RUNS;
# the whole segments that calibrate the unit sum at most _MAX_CALIBRATION_RUNS.
_MIN_RUNS = 3
_MAX_RUNS = 25
_MAX_CALIBRATION_RUNS = 10
# The share of the time budget given to timing units; the rest covers sessions and codecs.
_TIMING_SHARE = 0.5


def machine_info(threads: int, providers: Sequence[str] = (CPU,)) -> MachineInfo:
    """Describe this machine, profiled with ``threads`` (as it is: :meth:`Profile.emulate`
    makes it slower)."""
    import onnxruntime

    return MachineInfo(
        hostname=socket.gethostname(),
        cpu=_cpu_model(),
        cores=os.cpu_count() or 1,
        threads=threads,
        slowdown=1.0,
        emulated=False,
        onnxruntime=onnxruntime.__version__,
        providers=tuple(providers),
    )


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "Model", "Hardware") and value.strip():
                return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def make_session(
    model: onnx.ModelProto, threads: int, providers: Sequence[str] = (CPU,)
) -> onnxruntime.InferenceSession:
    """An ONNX Runtime session exactly as the tiers run one (same options, level, providers).

    Profiling with other session options than the runtimes would time a different
    program: see [Note: optimization level and exactness] in tierflow/onnxrt/inference.py.
    """
    from tierflow.partitioner.weights import open_model_session

    return open_model_session(model, threads=threads, providers=providers, what="a segment")


def run_session(
    session: onnxruntime.InferenceSession, feeds: Mapping[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """Run ``session`` on the feeds it needs; return its outputs by name."""
    names = [o.name for o in session.get_outputs()]
    wanted = {i.name: feeds[i.name] for i in session.get_inputs()}
    try:
        values = session.run(names, wanted)
    except Exception as exc:  # onnxruntime raises its own untyped errors
        raise ModelError(f"ONNX Runtime failed to run a segment: {exc}") from exc
    return dict(zip(names, (np.asarray(v) for v in values), strict=True))


def compute_clock(threads: int, providers: Sequence[str] = (CPU,)) -> Callable[[], float]:
    """The clock that times ONNX Runtime calls made with ``threads`` intra-op threads.

    With one thread ONNX Runtime computes on the calling thread, so that thread's CPU
    time is the call's compute time, and other jobs on a shared machine cannot inflate
    it (they only delay it); with more threads the work spreads over a pool and only the
    wall clock sees all of it; so does a GPU provider's work, which this thread only waits
    for. See [Note: segment latency].
    """
    return time.thread_time if threads == 1 and tuple(providers) == (CPU,) else time.perf_counter


def time_session(
    session: onnxruntime.InferenceSession,
    feeds: Mapping[str, np.ndarray],
    *,
    budget_s: float,
    min_runs: int = _MIN_RUNS,
    max_runs: int = _MAX_RUNS,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """Median seconds of one call, after a warm-up: at least ``min_runs`` runs, more while
    ``budget_s`` lasts (adaptive repetition keeps big models inside the time limit)."""
    names = [o.name for o in session.get_outputs()]
    wanted = {i.name: feeds[i.name] for i in session.get_inputs()}
    session.run(names, wanted)
    times: list[float] = []
    spent = 0.0
    while len(times) < min_runs or (len(times) < max_runs and spent < budget_s):
        start = clock()
        session.run(names, wanted)
        elapsed = clock() - start
        times.append(elapsed)
        spent += elapsed
    return statistics.median(times)


def _call_overhead_s(threads: int, providers: Sequence[str]) -> float:
    """Seconds ONNX Runtime spends on a call that computes nothing (an Identity node)."""
    import onnx.helper

    value = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])
    out = onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Identity", ["x"], ["y"])], "overhead", [value], [out]
    )
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])
    model.ir_version = 8
    session = make_session(model, threads, providers)
    feeds = {"x": np.zeros(1, dtype=np.float32)}
    return time_session(
        session,
        feeds,
        budget_s=0.05,
        min_runs=50,
        max_runs=400,
        clock=compute_clock(threads, providers),
    )


def _calibration_spans(unit_s: Sequence[float]) -> list[tuple[int, int]]:
    """Whole segments to time against the unit sum: the model and its two halves."""
    n = len(unit_s)
    spans = [(0, n)]
    if n >= 2:
        prefix = np.cumsum(unit_s)
        middle = int(np.searchsorted(prefix, prefix[-1] / 2)) + 1
        middle = min(max(middle, 1), n - 1)
        spans += [(0, middle), (middle, n)]
    return spans


def typical_s(times: Sequence[float]) -> float:
    """The time a profile records for repeated runs: their lower quartile.

    On a machine of its own a run's time hardly varies, and any statistic will do; on a
    shared one, other work makes some runs slower, never faster, so the lower quartile is
    the machine's own speed and is what the next measurement will reproduce, where the
    median drifts with the load. The benchmark reads its runs the same way.
    """
    return float(np.percentile(np.asarray(times, dtype=np.float64), 25))


def _fit_output_cost(
    overhead: float,
    call_s: Sequence[float],
    nbytes: Sequence[int],
    measured: Sequence[tuple[int, int, float]],
) -> float:
    """Seconds per byte a session call spends handing its outputs back (least squares).

    A unit timed alone returns its output as a fresh array (allocated and written each
    call); inside a larger segment the same tensor stays in ONNX Runtime's reused arena.
    So ``Σ call_s`` over a segment's units exceeds the segment's time by ``(k - 1)``
    overheads plus this cost on every inner cut's bytes. See [Note: segment latency].
    """
    xs, ys = [], []
    for start, end, seconds in measured:
        inner = sum(nbytes[i + 1] for i in range(start, end)) - nbytes[end]
        xs.append(inner)
        ys.append(sum(call_s[start:end]) - seconds - (end - start - 1) * overhead)
    x, y = np.asarray(xs, dtype=np.float64), np.asarray(ys, dtype=np.float64)
    if not (x > 0).any():
        return 0.0
    return max(float(np.dot(x, y) / np.dot(x, x)), 0.0)


def _fit_correction(
    overhead: float,
    unit_s: Sequence[float],
    measured: Sequence[tuple[int, int, float]],
    output_s: Sequence[float],
) -> float:
    """The factor c with ``overhead + c * Σ units + output_s[end] ≈ measured``.

    The median of the per-segment ratios, so that one segment timed during a burst of
    load on a shared machine does not drag the factor; clamped to [1/4, 4], beyond which
    the measurements are noise rather than fusion or cache effects.
    """
    ratios = [
        (seconds - overhead - output_s[end]) / total
        for start, end, seconds in measured
        if (total := sum(unit_s[start:end])) > 0
    ]
    if not ratios:
        return 1.0
    return min(max(statistics.median(ratios), 0.25), 4.0)


def _feeds(
    session: onnxruntime.InferenceSession, features: Mapping[str, np.ndarray]
) -> dict[str, np.ndarray]:
    return {i.name: features[i.name] for i in session.get_inputs()}


def _time_chain(
    sessions: Sequence[onnxruntime.InferenceSession],
    feeds: Sequence[Mapping[str, np.ndarray]],
    clock: Callable[[], float],
) -> list[float]:
    """Seconds of one call of each session, run one after the other."""
    times = []
    for session, feed in zip(sessions, feeds, strict=True):
        start = clock()
        session.run(None, dict(feed))
        times.append(clock() - start)
    return times


def measure_cut_codecs(
    graph: ModelGraph,
    features: Mapping[str, np.ndarray],
    codecs: Sequence[str],
    *,
    progress: Callable[[int], None] | None = None,
) -> list[dict[str, CodecStats]]:
    """Each codec's figures on the real features crossing each cut, on this machine.

    ``features`` must hold every tensor crossing a cut (see :func:`capture_features`).
    A ``drop+`` or ``sparse+`` codec that a cheap look at the features shows cannot beat
    the same codec without that stage (also measured) is skipped at that cut and recorded
    as never worth choosing there: see [Note: codec pruning].
    """
    result: list[dict[str, CodecStats]] = []
    for cut in graph.cuts:
        arrays = [features[name] for name in cut.tensors]
        repeats = 3 if cut.nbytes < (1 << 20) else 1
        stats: dict[str, CodecStats] = {}
        traits = CutTraits.of(arrays) if any(_prunable(c) for c in codecs) else None
        for name in codecs:
            better = (
                None if traits is None else pruned_by(name, traits, codecs, widest_float(arrays))
            )
            if better is not None:
                logger.debug(
                    "[profile] cut %d: %s skipped, %s does as well", cut.index, name, better
                )
                stats[name] = skipped_stats(name)
                continue
            measured = codec_lib.measure(name, arrays, repeats=repeats)
            stats[name] = replace(measured, codec=name)
        result.append(stats)
        if progress is not None:
            progress(cut.index)
    return result


def _prunable(codec: str) -> bool:
    spec = codec_lib.CodecSpec.parse(codec)
    return spec.drop or spec.sparse


def capture_features(graph: ModelGraph) -> dict[str, np.ndarray]:
    """Run the model once on its representative input; return every tensor at every cut."""
    import onnx.helper

    from tierflow.partitioner.split import session

    model = type(graph.model)()
    model.CopyFrom(graph.model)
    wanted = {name for cut in graph.cuts for name in cut.tensors}
    present = {v.name for v in model.graph.output} | {i.name for i in graph.inputs}
    for name in sorted(wanted - present):
        info = graph.tensors[name]
        elem = onnx.helper.np_dtype_to_tensor_dtype(np.dtype(info.dtype))
        model.graph.output.append(onnx.helper.make_tensor_value_info(name, elem, list(info.shape)))
    feeds = graph.representative_inputs()
    sess = session(model)
    names = [o.name for o in sess.get_outputs()]
    try:
        values = sess.run(names, feeds)
    except Exception as exc:  # onnxruntime raises its own untyped errors
        raise ModelError(f"ONNX Runtime failed to run {graph.path}: {exc}") from exc
    features = dict(feeds)
    features.update(zip(names, (np.asarray(v) for v in values), strict=True))
    return features


def with_codecs(profile: Profile, extra: Sequence[Mapping[str, CodecStats]]) -> Profile:
    """``profile`` with codecs it lacks added at each cut (``extra[i]`` for cut ``i``)."""
    if len(extra) != len(profile.cuts):
        raise ProfileError(
            f"codec figures for {len(extra)} cuts, the profile has {len(profile.cuts)}"
        )
    cuts = tuple(
        replace(cut, codecs={**added, **cut.codecs})
        for cut, added in zip(profile.cuts, extra, strict=True)
    )
    return replace(profile, cuts=cuts)


def profile_model(
    graph: ModelGraph,
    *,
    threads: int = 1,
    slowdown: float = 1.0,
    codecs: Sequence[str] = PLANNER_CODECS,
    time_budget_s: float = 20.0,
    progress: ProgressFn | None = None,
    providers: Sequence[str] = (CPU,),
) -> Profile:
    """Measure ``graph`` on this machine, then emulate ``slowdown``; see [Note: segment latency].

    Runs the model once unit by unit on its representative input (``--sample`` when
    given), which both times every unit and captures the real features at every cut for
    the codec figures. ``time_budget_s`` bounds the adaptive repetitions, not the fixed
    costs (building sessions, one run of each unit). The phases: the call overhead, the
    units (:func:`_time_units`), whole segments (:func:`_time_segments`), the fit of one
    against the other (:func:`_fit_unit_costs`), and the codecs at every cut
    (:func:`measure_cut_codecs`).
    """
    if threads < 1:
        raise ProfileError(f"threads must be at least 1, got {threads}")
    if not slowdown > 0:
        raise ProfileError(f"a slowdown must be positive, got {slowdown!r}")
    n = len(graph.cuts) - 1
    steps = _Steps(progress, units=n, cuts=len(graph.cuts))
    started = time.perf_counter()
    clock = compute_clock(threads, providers)
    overhead = _call_overhead_s(threads, providers)
    steps.advance("call overhead")

    budget = time_budget_s * _TIMING_SHARE
    features, call_s = _time_units(graph, (threads, providers), clock, budget, steps)
    spans = _calibration_spans([1.0] * n)
    measured = _time_segments(
        graph, spans, (threads, providers), clock, features, budget / 2, steps
    )
    fit = _fit_unit_costs(overhead, call_s, [cut.nbytes for cut in graph.cuts], measured)
    cut_stats = measure_cut_codecs(
        graph,
        features,
        codecs,
        progress=lambda i: steps.advance(f"codecs at cut {i}"),
    )
    return _assemble(
        graph,
        machine_info(threads, providers),
        overhead=overhead,
        fit=fit,
        measured=measured,
        cut_stats=cut_stats,
        started=started,
    ).emulate(slowdown)


class _Steps:
    """Counts profiling steps for a ``progress`` callback.

    Steps: the call overhead, building each unit, the timing rounds, the calibration
    rounds and the codecs at each cut. The number of rounds is known once one pass has
    run; until then the most are assumed.
    """

    def __init__(self, progress: ProgressFn | None, *, units: int, cuts: int) -> None:
        self.progress = progress
        self.units = units
        self.cuts = cuts
        self.rounds = _MAX_RUNS
        self.calibration_rounds = _MAX_CALIBRATION_RUNS
        self.done = 0

    def advance(self, what: str) -> None:
        self.done += 1
        if self.progress is not None:
            total = 1 + self.units + self.rounds + self.calibration_rounds + self.cuts
            self.progress(self.done, total, what)


def _time_units(
    graph: ModelGraph,
    settings: tuple[int, Sequence[str]],
    clock: Callable[[], float],
    budget_s: float,
    steps: _Steps,
) -> tuple[dict[str, np.ndarray], list[float]]:
    """The typical seconds of one call of each unit alone, and the features at every cut.

    One pass unit by unit builds the sessions and captures the features. Timing rounds
    then run the units in model order, so each finds the caches as a whole run leaves
    them, and a burst of load on a shared machine hits all units alike.
    """
    from tierflow.partitioner.split import extract_segment

    n = len(graph.cuts) - 1
    features: dict[str, np.ndarray] = dict(graph.representative_inputs())
    sessions = []
    for index in range(n):
        session = make_session(extract_segment(graph, index, index + 1), *settings)
        features.update(run_session(session, features))
        sessions.append(session)
        steps.advance(f"unit {index + 1}/{n}")
    feeds = [_feeds(session, features) for session in sessions]
    times = [_time_chain(sessions, feeds, clock)]
    steps.rounds = int(min(max(budget_s / max(sum(times[0]), 1e-9), _MIN_RUNS), _MAX_RUNS))
    for round_index in range(steps.rounds):
        times.append(_time_chain(sessions, feeds, clock))
        steps.advance(f"timing round {round_index + 1}/{steps.rounds}")
    return features, [typical_s([t[i] for t in times[1:]]) for i in range(n)]


def _time_segments(
    graph: ModelGraph,
    spans: Sequence[tuple[int, int]],
    settings: tuple[int, Sequence[str]],
    clock: Callable[[], float],
    features: Mapping[str, np.ndarray],
    budget_s: float,
    steps: _Steps,
) -> list[tuple[int, int, float]]:
    """``(start, end, typical seconds)`` of whole segments, timed in rounds like the units."""
    from tierflow.partitioner.split import extract_segment

    sessions = [make_session(extract_segment(graph, start, end), *settings) for start, end in spans]
    feeds = [_feeds(session, features) for session in sessions]
    times = [_time_chain(sessions, feeds, clock)]
    steps.calibration_rounds = int(
        min(max(budget_s / max(sum(times[0]), 1e-9), _MIN_RUNS), _MAX_CALIBRATION_RUNS)
    )
    for round_index in range(steps.calibration_rounds):
        times.append(_time_chain(sessions, feeds, clock))
        steps.advance(f"calibration round {round_index + 1}/{steps.calibration_rounds}")
    return [
        (start, end, typical_s([t[i] for t in times[1:]])) for i, (start, end) in enumerate(spans)
    ]


@dataclass(frozen=True)
class _UnitCosts:
    """Unit times fitted against whole segments (see [Note: segment latency])."""

    per_byte: float  # seconds a call spends per byte of its outputs
    output_s: list[float]  # that cost at each cut
    unit_s: list[float]  # each unit's compute, before the correction
    correction: float


def _fit_unit_costs(
    overhead: float,
    call_s: Sequence[float],
    nbytes: Sequence[int],
    measured: Sequence[tuple[int, int, float]],
) -> _UnitCosts:
    """Split each unit's call time into compute and output cost, and fit the correction."""
    n = len(call_s)
    per_byte = _fit_output_cost(overhead, call_s, nbytes, measured)
    # Never more than the smallest unit can pay: a unit's compute stays non-negative.
    per_byte = min(
        [per_byte] + [(call_s[i] - overhead) / nbytes[i + 1] for i in range(n) if nbytes[i + 1]]
    )
    per_byte = max(per_byte, 0.0)
    output_s = [per_byte * b for b in nbytes]
    unit_s = [max(call_s[i] - overhead - output_s[i + 1], 0.0) for i in range(n)]
    correction = _fit_correction(overhead, unit_s, measured, output_s)
    return _UnitCosts(per_byte, output_s, unit_s, correction)


def _assemble(
    graph: ModelGraph,
    machine: MachineInfo,
    *,
    overhead: float,
    fit: _UnitCosts,
    measured: Sequence[tuple[int, int, float]],
    cut_stats: Sequence[Mapping[str, CodecStats]],
    started: float,
) -> Profile:
    """The profile of the measured figures, on this machine."""
    cut_profiles = [
        CutProfile(cut.index, cut.position, tuple(cut.tensors), cut.nbytes, stats)
        for cut, stats in zip(graph.cuts, cut_stats, strict=True)
    ]
    units = tuple(
        UnitProfile(
            index=i,
            compute_s=fit.unit_s[i] * fit.correction,
            weight_bytes=graph.weight_bytes(i, i + 1),
            peak_activation_bytes=graph.peak_activation_bytes(i, i + 1),
        )
        for i in range(len(fit.unit_s))
    )
    calibration = {
        "correction": fit.correction,
        "output_s_per_mb": fit.per_byte * 1e6,
        "segments": [
            {
                "start": s,
                "end": e,
                "measured_s": m,
                "predicted_s": overhead + fit.correction * sum(fit.unit_s[s:e]) + fit.output_s[e],
            }
            for s, e, m in measured
        ],
        "profile_s": time.perf_counter() - started,
    }
    logger.info(
        "[profile] %s: %d units, overhead %.3g ms, correction %.3f, %.1f s",
        graph.path,
        len(units),
        overhead * 1e3,
        fit.correction,
        calibration["profile_s"],
    )
    return Profile(
        machine=machine,
        model_file=Path(graph.path).name,
        model_sha256=graph.sha256,
        cuts=tuple(cut_profiles),
        units=units,
        overhead_s=overhead,
        calibration=calibration,
        output_s_per_byte=fit.per_byte,
    )
