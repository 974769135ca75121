"""Profiles: what one tier's machine costs for each unit of a model, measured.

A *unit* is the run of nodes between two consecutive candidate cuts (``cuts[i]`` to
``cuts[i + 1]``). A profile holds, for one machine (real or emulated), the compute time
of every unit, the fixed overhead of one session call, the bytes and codec figures of
every cut, and the memory each unit needs. The cost model (:mod:`.cost`) only reads
profiles; this module is where the measuring happens. See [Note: segment latency].

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

Emulation: a machine ``slowdown`` times slower than this one is profiled by measuring
here and multiplying every time (compute, overhead, codec speed) by ``slowdown``; the
benchmark emulates it the same way, by sleeping ``(slowdown - 1)`` times what it measured.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import socket
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from tierflow import codec as codec_lib
from tierflow.codec import PLANNER_CODECS, CodecStats
from tierflow.errors import ModelError, ProfileError, TierflowError

if TYPE_CHECKING:
    import onnx
    import onnxruntime

    from tierflow.partitioner.graph import ModelGraph

logger = logging.getLogger(__name__)

PROFILE_FORMAT = "tierflow.profile/1"

# Called as progress(done, total, what) while profiling.
ProgressFn = Callable[[int, int, str], None]


# --------------------------------------------------------------------------- data


@dataclass(frozen=True)
class MachineInfo:
    """The machine a profile describes: where it was measured and how it was emulated."""

    hostname: str
    cpu: str
    cores: int
    threads: int
    slowdown: float
    emulated: bool
    onnxruntime: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "hostname": self.hostname,
            "cpu": self.cpu,
            "cores": self.cores,
            "threads": self.threads,
            "slowdown": self.slowdown,
            "emulated": self.emulated,
            "onnxruntime": self.onnxruntime,
        }

    @classmethod
    def from_dict(cls, data: Any) -> MachineInfo:
        try:
            return cls(
                hostname=str(data["hostname"]),
                cpu=str(data["cpu"]),
                cores=int(data["cores"]),
                threads=int(data["threads"]),
                slowdown=float(data["slowdown"]),
                emulated=bool(data["emulated"]),
                onnxruntime=str(data["onnxruntime"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ProfileError(f"malformed profile machine {data!r}: {exc}") from exc

    def describe(self) -> str:
        """One line for people: ``host (cpu), 1 thread, emulated 4x slower``."""
        threads = f"{self.threads} thread{'s' if self.threads != 1 else ''}"
        how = f"emulated {self.slowdown:g}x slower" if self.emulated else "measured"
        return f"{self.hostname} ({self.cpu}), {threads}, {how}"


@dataclass(frozen=True)
class CutProfile:
    """A candidate cut: the tensors crossing it, their raw bytes, and each codec on them."""

    index: int
    position: int
    tensors: tuple[str, ...]
    nbytes: int
    codecs: Mapping[str, CodecStats]

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "position": self.position,
            "tensors": list(self.tensors),
            "nbytes": self.nbytes,
            "codecs": {name: stats.to_dict() for name, stats in self.codecs.items()},
        }

    @classmethod
    def from_dict(cls, data: Any) -> CutProfile:
        try:
            codecs = {str(k): CodecStats.from_dict(v) for k, v in dict(data["codecs"]).items()}
            return cls(
                index=int(data["index"]),
                position=int(data["position"]),
                tensors=tuple(str(t) for t in data["tensors"]),
                nbytes=int(data["nbytes"]),
                codecs=codecs,
            )
        except (KeyError, TypeError, ValueError, TierflowError) as exc:
            raise ProfileError(f"malformed profile cut: {exc}") from exc


@dataclass(frozen=True)
class UnitProfile:
    """The nodes between cut ``index`` and cut ``index + 1``: time and memory."""

    index: int
    compute_s: float
    weight_bytes: int
    peak_activation_bytes: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "compute_s": self.compute_s,
            "weight_bytes": self.weight_bytes,
            "peak_activation_bytes": self.peak_activation_bytes,
        }

    @classmethod
    def from_dict(cls, data: Any) -> UnitProfile:
        try:
            unit = cls(
                index=int(data["index"]),
                compute_s=float(data["compute_s"]),
                weight_bytes=int(data["weight_bytes"]),
                peak_activation_bytes=int(data["peak_activation_bytes"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ProfileError(f"malformed profile unit {data!r}: {exc}") from exc
        if unit.compute_s < 0 or unit.weight_bytes < 0 or unit.peak_activation_bytes < 0:
            raise ProfileError(f"malformed profile unit {data!r}: negative figures")
        return unit


@dataclass(frozen=True)
class Profile:
    """One tier's measured costs for one model. See [Note: segment latency]."""

    machine: MachineInfo
    model_file: str
    model_sha256: str
    cuts: tuple[CutProfile, ...]
    units: tuple[UnitProfile, ...]
    overhead_s: float
    calibration: Mapping[str, Any] = field(default_factory=dict)
    output_s_per_byte: float = 0.0

    def __post_init__(self) -> None:
        if len(self.cuts) < 2:
            raise ProfileError(f"malformed profile: it needs at least 2 cuts, has {len(self.cuts)}")
        if len(self.units) != len(self.cuts) - 1:
            raise ProfileError(
                f"malformed profile: {len(self.cuts)} cuts need {len(self.cuts) - 1} units, "
                f"found {len(self.units)}"
            )
        if [c.index for c in self.cuts] != list(range(len(self.cuts))):
            raise ProfileError("malformed profile: cut indices must be 0, 1, 2, ... in order")
        if [u.index for u in self.units] != list(range(len(self.units))):
            raise ProfileError("malformed profile: unit indices must be 0, 1, 2, ... in order")
        if not self.overhead_s >= 0:
            raise ProfileError(f"malformed profile: overhead_s must be >= 0, got {self.overhead_s}")
        if not self.output_s_per_byte >= 0:
            raise ProfileError(
                f"malformed profile: output_s_per_byte must be >= 0, got {self.output_s_per_byte}"
            )
        names = {frozenset(c.codecs) for c in self.cuts}
        if len(names) != 1:
            raise ProfileError("malformed profile: every cut must list the same codecs")

    @property
    def codecs(self) -> tuple[str, ...]:
        """The codecs measured at every cut, in the order of the first cut."""
        return tuple(self.cuts[0].codecs)

    @property
    def slowdown(self) -> float:
        return self.machine.slowdown

    def segment_s(self, start: int, end: int) -> float:
        """Predicted time of cuts ``start`` to ``end`` as one session; 0 when empty."""
        if start >= end:
            return 0.0
        return (
            self.overhead_s
            + sum(u.compute_s for u in self.units[start:end])
            + self.output_s_per_byte * self.cuts[end].nbytes
        )

    def emulate(self, slowdown: float, threads: int | None = None) -> Profile:
        """This profile as seen on a machine ``slowdown`` times slower than the measured one.

        Every time scales by ``slowdown / self.slowdown``; bytes and ratios stay.
        """
        if not slowdown > 0:
            raise ProfileError(f"a slowdown must be positive, got {slowdown!r}")
        factor = slowdown / self.machine.slowdown
        cuts = tuple(
            replace(
                cut,
                codecs={
                    name: replace(
                        stats,
                        encode_s_per_mb=stats.encode_s_per_mb * factor,
                        decode_s_per_mb=stats.decode_s_per_mb * factor,
                    )
                    for name, stats in cut.codecs.items()
                },
            )
            for cut in self.cuts
        )
        units = tuple(replace(u, compute_s=u.compute_s * factor) for u in self.units)
        machine = replace(
            self.machine,
            slowdown=slowdown,
            emulated=self.machine.emulated or slowdown != 1.0,
            threads=self.machine.threads if threads is None else threads,
        )
        return replace(
            self,
            machine=machine,
            cuts=cuts,
            units=units,
            overhead_s=self.overhead_s * factor,
            output_s_per_byte=self.output_s_per_byte * factor,
        )

    def check_model(self, graph: ModelGraph, *, where: str = "profile") -> None:
        """Raise :class:`ProfileError` unless this profile was made for ``graph``."""
        if self.model_sha256 != graph.sha256:
            raise ProfileError(
                f"{where} was made for another model: it names {self.model_file or '?'} "
                f"(sha256 {self.model_sha256[:12]}), but the model is {graph.path} "
                f"(sha256 {graph.sha256[:12]})"
            )
        ours = [(c.position, c.tensors) for c in self.cuts]
        theirs = [(c.position, tuple(c.tensors)) for c in graph.cuts]
        if ours != theirs:
            raise ProfileError(
                f"{where} was made for the same model with other cuts: it has {len(ours)} "
                f"cuts, the model {graph.path} has {len(theirs)} (another --shape?)"
            )

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": PROFILE_FORMAT,
            "machine": self.machine.to_dict(),
            "model": {"file": self.model_file, "sha256": self.model_sha256},
            "overhead_s": self.overhead_s,
            "output_s_per_byte": self.output_s_per_byte,
            "cuts": [c.to_dict() for c in self.cuts],
            "units": [u.to_dict() for u in self.units],
            "calibration": dict(self.calibration),
        }

    @classmethod
    def from_dict(cls, data: Any) -> Profile:
        if not isinstance(data, dict):
            raise ProfileError("malformed profile: expected a JSON object")
        if data.get("format") != PROFILE_FORMAT:
            raise ProfileError(
                f"unsupported profile format {data.get('format')!r}: expected {PROFILE_FORMAT!r}"
            )
        model = data.get("model")
        if not isinstance(model, dict) or not isinstance(model.get("sha256"), str):
            raise ProfileError("malformed profile: 'model' must be an object with 'sha256'")
        cuts, units = data.get("cuts"), data.get("units")
        if not isinstance(cuts, list) or not isinstance(units, list):
            raise ProfileError("malformed profile: 'cuts' and 'units' must be lists")
        try:
            overhead = float(data["overhead_s"])
            per_byte = float(data.get("output_s_per_byte", 0.0))
        except (KeyError, TypeError, ValueError) as exc:
            raise ProfileError(
                "malformed profile: 'overhead_s' and 'output_s_per_byte' must be numbers"
            ) from exc
        return cls(
            machine=MachineInfo.from_dict(data.get("machine")),
            model_file=str(model.get("file", "")),
            model_sha256=model["sha256"],
            cuts=tuple(CutProfile.from_dict(c) for c in cuts),
            units=tuple(UnitProfile.from_dict(u) for u in units),
            overhead_s=overhead,
            calibration=dict(data.get("calibration") or {}),
            output_s_per_byte=per_byte,
        )


def save_profile(profile: Profile, path: str | Path) -> Path:
    """Write ``profile`` as JSON; return the path."""
    target = Path(path)
    if target.parent != Path():
        target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(profile.to_dict(), indent=1) + "\n")
    return target


def load_profile(path: str | Path, graph: ModelGraph | None = None) -> Profile:
    """Read a profile; with ``graph``, also check it was made for that model."""
    source = Path(path)
    try:
        data = json.loads(source.read_text())
    except FileNotFoundError as exc:
        raise ProfileError(f"no profile at {source}") from exc
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProfileError(f"cannot read profile {source}: {exc}") from exc
    try:
        profile = Profile.from_dict(data)
    except ProfileError as exc:
        raise ProfileError(f"{source}: {exc}") from exc
    if graph is not None:
        profile.check_model(graph, where=f"profile {source}")
    return profile


# --------------------------------------------------------------------------- measuring

# Each unit is timed at least this many times (after one warm-up run), at most _MAX_RUNS;
# the whole segments that calibrate the unit sum at most _MAX_CALIBRATION_RUNS.
_MIN_RUNS = 3
_MAX_RUNS = 25
_MAX_CALIBRATION_RUNS = 10
# The share of the time budget given to timing units; the rest covers sessions and codecs.
_TIMING_SHARE = 0.5


def machine_info(threads: int, slowdown: float) -> MachineInfo:
    """Describe this machine, profiled with ``threads`` and emulated ``slowdown`` x slower."""
    import onnxruntime

    return MachineInfo(
        hostname=socket.gethostname(),
        cpu=_cpu_model(),
        cores=os.cpu_count() or 1,
        threads=threads,
        slowdown=slowdown,
        emulated=slowdown != 1.0,
        onnxruntime=onnxruntime.__version__,
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


def make_session(model: onnx.ModelProto, threads: int) -> onnxruntime.InferenceSession:
    """An ONNX Runtime CPU session exactly as the tiers run one (same options and level).

    Profiling with other session options than the runtimes would time a different
    program: see [Note: optimization level and exactness] in tierflow/segment_runner.py.
    """
    import onnxruntime

    from tierflow.segment_runner import DEFAULT_OPTIMIZATION, session_options

    options = session_options(threads, DEFAULT_OPTIMIZATION)
    options.log_severity_level = 3
    try:
        return onnxruntime.InferenceSession(
            model.SerializeToString(), options, providers=["CPUExecutionProvider"]
        )
    except Exception as exc:  # onnxruntime raises its own untyped errors
        raise ModelError(f"ONNX Runtime cannot load a segment: {exc}") from exc


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


def time_session(
    session: onnxruntime.InferenceSession,
    feeds: Mapping[str, np.ndarray],
    *,
    budget_s: float,
    min_runs: int = _MIN_RUNS,
    max_runs: int = _MAX_RUNS,
) -> float:
    """Median seconds of one call, after a warm-up: at least ``min_runs`` runs, more while
    ``budget_s`` lasts (adaptive repetition keeps big models inside the time limit)."""
    names = [o.name for o in session.get_outputs()]
    wanted = {i.name: feeds[i.name] for i in session.get_inputs()}
    session.run(names, wanted)
    times: list[float] = []
    spent = 0.0
    while len(times) < min_runs or (len(times) < max_runs and spent < budget_s):
        start = time.perf_counter()
        session.run(names, wanted)
        elapsed = time.perf_counter() - start
        times.append(elapsed)
        spent += elapsed
    return statistics.median(times)


def _call_overhead_s(threads: int) -> float:
    """Seconds ONNX Runtime spends on a call that computes nothing (an Identity node)."""
    import onnx.helper

    value = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])
    out = onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Identity", ["x"], ["y"])], "overhead", [value], [out]
    )
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])
    model.ir_version = 8
    session = make_session(model, threads)
    feeds = {"x": np.zeros(1, dtype=np.float32)}
    return time_session(session, feeds, budget_s=0.05, min_runs=50, max_runs=400)


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
    sessions: Sequence[onnxruntime.InferenceSession], feeds: Sequence[Mapping[str, np.ndarray]]
) -> list[float]:
    """Seconds of one call of each session, run one after the other."""
    times = []
    for session, feed in zip(sessions, feeds, strict=True):
        start = time.perf_counter()
        session.run(None, dict(feed))
        times.append(time.perf_counter() - start)
    return times


def measure_cut_codecs(
    graph: ModelGraph,
    features: Mapping[str, np.ndarray],
    codecs: Sequence[str],
    *,
    slowdown: float = 1.0,
    progress: Callable[[int], None] | None = None,
) -> list[dict[str, CodecStats]]:
    """Each codec's figures on the real features crossing each cut, times ``slowdown``.

    ``features`` must hold every tensor crossing a cut (see :func:`capture_features`).
    """
    result: list[dict[str, CodecStats]] = []
    for cut in graph.cuts:
        arrays = [features[name] for name in cut.tensors]
        repeats = 3 if cut.nbytes < (1 << 20) else 1
        stats: dict[str, CodecStats] = {}
        for name in codecs:
            measured = codec_lib.measure(name, arrays, repeats=repeats)
            stats[name] = replace(
                measured,
                codec=name,
                encode_s_per_mb=measured.encode_s_per_mb * slowdown,
                decode_s_per_mb=measured.decode_s_per_mb * slowdown,
            )
        result.append(stats)
        if progress is not None:
            progress(cut.index)
    return result


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
) -> Profile:
    """Measure ``graph`` on this machine; see [Note: segment latency].

    Runs the model once unit by unit on its representative input (``--sample`` when
    given), which both times every unit and captures the real features at every cut for
    the codec figures. ``time_budget_s`` bounds the adaptive repetitions, not the fixed
    costs (building sessions, one run of each unit).
    """
    from tierflow.partitioner.split import extract_segment

    if threads < 1:
        raise ProfileError(f"threads must be at least 1, got {threads}")
    if not slowdown > 0:
        raise ProfileError(f"a slowdown must be positive, got {slowdown!r}")
    n = len(graph.cuts) - 1
    spans = _calibration_spans([1.0] * n)
    # Steps: overhead, building each unit, timing rounds, calibration rounds, codecs per cut.
    # The number of rounds is known once one pass has run; until then assume the most.
    rounds = _MAX_RUNS
    calibration_rounds = _MAX_CALIBRATION_RUNS
    step = 0

    def advance(what: str) -> None:
        nonlocal step
        step += 1
        if progress is not None:
            total = 1 + n + rounds + calibration_rounds + len(graph.cuts)
            progress(step, total, what)

    started = time.perf_counter()
    overhead = _call_overhead_s(threads)
    advance("call overhead")

    # One pass unit by unit: builds the sessions and captures the features at every cut.
    features: dict[str, np.ndarray] = dict(graph.representative_inputs())
    sessions = []
    for index in range(n):
        session = make_session(extract_segment(graph, index, index + 1), threads)
        features.update(run_session(session, features))
        sessions.append(session)
        advance(f"unit {index + 1}/{n}")
    feeds = [_feeds(session, features) for session in sessions]

    # Timing rounds run the units in model order, so each finds the caches as a whole run
    # leaves them, and a burst of load on a shared machine hits all units alike.
    times = [_time_chain(sessions, feeds)]
    budget = time_budget_s * _TIMING_SHARE
    chain_s = sum(times[0])
    rounds = int(min(max(budget / max(chain_s, 1e-9), _MIN_RUNS), _MAX_RUNS))
    for round_index in range(rounds):
        times.append(_time_chain(sessions, feeds))
        advance(f"timing round {round_index + 1}/{rounds}")
    call_s = [typical_s([t[i] for t in times[1:]]) for i in range(n)]
    del sessions, feeds

    # Whole segments, interleaved the same way, to correct the unit sum.
    segment_sessions = [
        make_session(extract_segment(graph, start, end), threads) for start, end in spans
    ]
    segment_feeds = [_feeds(session, features) for session in segment_sessions]
    segment_times = [_time_chain(segment_sessions, segment_feeds)]
    calibration_rounds = int(
        min(
            max(budget / 2 / max(sum(segment_times[0]), 1e-9), _MIN_RUNS),
            _MAX_CALIBRATION_RUNS,
        )
    )
    for round_index in range(calibration_rounds):
        segment_times.append(_time_chain(segment_sessions, segment_feeds))
        advance(f"calibration round {round_index + 1}/{calibration_rounds}")
    measured = [
        (start, end, typical_s([t[i] for t in segment_times[1:]]))
        for i, (start, end) in enumerate(spans)
    ]
    nbytes = [cut.nbytes for cut in graph.cuts]
    per_byte = _fit_output_cost(overhead, call_s, nbytes, measured)
    # Never more than the smallest unit can pay: a unit's compute stays non-negative.
    per_byte = min(
        [per_byte] + [(call_s[i] - overhead) / nbytes[i + 1] for i in range(n) if nbytes[i + 1]]
    )
    per_byte = max(per_byte, 0.0)
    output_s = [per_byte * b for b in nbytes]
    raw_unit_s = [max(call_s[i] - overhead - output_s[i + 1], 0.0) for i in range(n)]
    correction = _fit_correction(overhead, raw_unit_s, measured, output_s)

    cut_stats = measure_cut_codecs(
        graph, features, codecs, slowdown=slowdown, progress=lambda i: advance(f"codecs at cut {i}")
    )
    cut_profiles = [
        CutProfile(cut.index, cut.position, tuple(cut.tensors), cut.nbytes, stats)
        for cut, stats in zip(graph.cuts, cut_stats, strict=True)
    ]

    units = tuple(
        UnitProfile(
            index=i,
            compute_s=raw_unit_s[i] * correction * slowdown,
            weight_bytes=graph.weight_bytes(i, i + 1),
            peak_activation_bytes=graph.peak_activation_bytes(i, i + 1),
        )
        for i in range(n)
    )
    calibration = {
        "correction": correction,
        "output_s_per_mb": per_byte * 1e6,
        "segments": [
            {
                "start": s,
                "end": e,
                "measured_s": m,
                "predicted_s": overhead + correction * sum(raw_unit_s[s:e]) + output_s[e],
            }
            for s, e, m in measured
        ],
        "profile_s": time.perf_counter() - started,
    }
    logger.info(
        "[profile] %s: %d units, overhead %.3g ms, correction %.3f, %.1f s",
        graph.path,
        n,
        overhead * 1e3,
        correction,
        calibration["profile_s"],
    )
    return Profile(
        machine=machine_info(threads, slowdown),
        model_file=Path(graph.path).name,
        model_sha256=graph.sha256,
        cuts=tuple(cut_profiles),
        units=units,
        overhead_s=overhead * slowdown,
        calibration=calibration,
        output_s_per_byte=per_byte * slowdown,
    )
