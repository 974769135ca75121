"""Measuring fidelity end to end: the sample runs through a split with its codecs applied.

:class:`FidelityProbe` is the measuring half of planning under a fidelity budget (the
pure half is :mod:`.fidelity_search`): for a plan ``(a, b)`` with a codec per link it
runs each sample request as the tiers would — the device's segment, the crossing
tensors encoded and decoded with the device-edge codec, the edge's segment, the
edge-cloud codec, the cloud's segment — and compares the outputs with the exact
model's (:func:`tierflow.partitioner.fidelity.score`). The codec is the runtime's own
(:func:`tierflow.codec.base.encode` / :func:`~tierflow.codec.base.decode`), so what is measured is
what the tiers will do. Segments and the reference run at the same ONNX Runtime
optimisation level (``disabled`` by default, as :func:`~.split.verify_split`), so a plan
with lossless codecs scores bit for bit.

:func:`plan_fidelity` measures a written plan directory the same way, reading its
segment files: the benchmarks use it to give every result row its fidelity.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tierflow import npz
from tierflow.codec.base import CodecSpec, ImageNorm
from tierflow.errors import InputError, ModelError, PlanError
from tierflow.link.spec import TIERS, link_between
from tierflow.onnxrt.inference import open_session
from tierflow.partitioner.fidelity import FidelityBudget, FidelityScore, score
from tierflow.partitioner.graph import ModelGraph
from tierflow.partitioner.image_inputs import crossed_with
from tierflow.partitioner.split import extract_segment, session
from tierflow.partitioner.tensors import first_line
from tierflow.plan import Plan, load_plan

logger = logging.getLogger(__name__)

Request = dict[str, np.ndarray]

# Prefix features (device segment outputs on the raw sample) kept across candidates.
_PREFIX_CACHE_BYTES = 256 << 20
# Answers of plans already run, kept for the next time a search asks for the same plan
# (a plan set searches each rate and each budget on one probe).
_ANSWER_CACHE_BYTES = 64 << 20


def fidelity_class(codec: str) -> str:
    """Codecs in one class decode to the same values: the codec without its compressor.

    ``sparse+`` and ``drop+`` stay: they decode zeros and constant channels exactly,
    which the quantiser alone may not.
    """
    spec = CodecSpec.parse(codec)
    if spec.bit_exact:
        return "lossless"
    if spec.image:
        return str(spec)
    return str(CodecSpec(spec.quant, "none", sparse=spec.sparse, drop=spec.drop))


def sample_requests(
    inputs: Sequence[Any], sample: Mapping[str, np.ndarray], *, what: str = "the sample"
) -> list[Request]:
    """Split ``IN.npz`` arrays into one input dict per request, as ``tierflow run`` does.

    ``inputs`` are the model's input infos (name, shape, dtype). Rows gain a batch
    dimension exactly when ``run`` would add one ([Note: request rows] in
    :mod:`tierflow.npz`); each request must then have the input's shape where the model
    fixes it, and a dtype of the same kind.
    """
    ranks: dict[str, int | None] = {info.name: len(info.shape) for info in inputs}
    count = npz.request_count(sample, list(ranks), what)
    batch = npz.adds_batch(sample, ranks, what)
    requests: list[Request] = []
    for index in range(count):
        rows = npz.request(sample, ranks, index, batch=batch)
        for info in inputs:
            row, declared = rows[info.name], tuple(info.shape)
            if len(declared) != row.ndim or any(
                isinstance(d, int) and d != r for d, r in zip(declared, row.shape, strict=True)
            ):
                raise InputError(
                    f"{what}: request {index} of input {info.name!r} has shape {row.shape}, "
                    f"the model expects {declared}"
                )
            try:
                rows[info.name] = row.astype(info.dtype, casting="same_kind", copy=False)
            except TypeError as exc:
                raise InputError(
                    f"{what}: input {info.name!r} holds {row.dtype}, the model input is "
                    f"{info.dtype}"
                ) from exc
        requests.append(rows)
    return requests


def _run(sess: Any, feeds: Mapping[str, np.ndarray], what: str) -> Request:
    names = [o.name for o in sess.get_outputs()]
    wanted = {i.name: feeds[i.name] for i in sess.get_inputs()}
    try:
        values = sess.run(names, wanted)
    except Exception as exc:  # onnxruntime raises its own exception types
        raise ModelError(f"ONNX Runtime failed running {what}: {first_line(exc)}") from exc
    return dict(zip(names, (np.asarray(v) for v in values), strict=True))


@dataclass(frozen=True)
class Measurement:
    """A plan measured on the sample: its score and whether it met the budget.

    With ``stop_early`` a failing plan is scored only up to the request that settled it
    (``complete`` false): enough to reject it, not a figure to report.
    """

    score: FidelityScore
    passed: bool
    complete: bool


class FidelityProbe:
    """Runs sample requests through splits of one analysed model, codecs applied.

    Sessions are built once per segment and reused; the exact model's outputs are
    computed once per request. ``images`` are the image inputs' normalisations, which
    image codecs need. Not thread-safe.
    """

    def __init__(
        self,
        graph: ModelGraph,
        requests: Sequence[Request],
        *,
        images: Mapping[str, ImageNorm] | None = None,
        level: str = "disabled",
    ) -> None:
        if not requests:
            raise PlanError("measuring fidelity needs at least one sample request")
        self.graph = graph
        self.requests = list(requests)
        self.level = level
        self.images = dict(images or {})
        self.last = len(graph.cuts) - 1
        # What a request is answered with; a state output stays on its tier.
        self.outputs = tuple(o.name for o in graph.answered_outputs)
        self._sessions: dict[tuple[int, int], Any] = {}
        self._reference: dict[int, Request] = {}
        self._prefix: dict[tuple[int, int], Request] = {}
        self._prefix_bytes = 0
        self._answers: dict[tuple[Any, ...], Request] = {}
        self._answer_bytes = 0
        self.runs = 0  # plans measured, for the planner's notes

    def _session(self, start: int, end: int) -> Any:
        key = (start, end)
        if key not in self._sessions:
            model = self.graph.model if (start, end) == (0, self.last) else None
            if model is None:
                model = extract_segment(self.graph, start, end)
            self._sessions[key] = session(model, level=self.level)
        return self._sessions[key]

    def reference(self, index: int) -> Request:
        """The exact model's outputs for request ``index``."""
        if index not in self._reference:
            outputs = _run(self._session(0, self.last), self.requests[index], "the whole model")
            self._reference[index] = {name: outputs[name] for name in self.outputs}
        return self._reference[index]

    def _segment(self, start: int, end: int, feeds: Mapping[str, np.ndarray]) -> Request:
        cuts = self.graph.cuts
        if cuts[start].position == cuts[end].position:
            return {name: np.asarray(feeds[name]) for name in cuts[end].tensors}
        return _run(self._session(start, end), feeds, f"cuts {start}..{end}")

    def _device(self, a: int, index: int) -> Request:
        if a == 0:
            return {name: self.requests[index][name] for name in self.graph.cuts[0].tensors}
        key = (a, index)
        if key not in self._prefix:
            features = self._segment(0, a, self.requests[index])
            size = sum(v.nbytes for v in features.values())
            if self._prefix_bytes + size > _PREFIX_CACHE_BYTES:
                return features
            self._prefix[key] = features
            self._prefix_bytes += size
        return self._prefix[key]

    def crossing(self, a: int, index: int) -> Request:
        """The tensors of cut ``a`` for request ``index``: what the device sends at ``a``.

        The raw features, before any codec (the benchmarks encode them to count bytes).
        """
        if not 0 <= a <= self.last:
            raise PlanError(f"cut must be within 0..{self.last}, got {a}")
        return self._device(a, index)

    def run_split(self, cuts: tuple[int, int], codec: Mapping[str, str], index: int) -> Request:
        """Request ``index`` through plan ``cuts = (a, b)`` with ``codec[link]`` on each link.

        As the tiers run it ([Note: what crosses a link] in :mod:`.cost`): the tensors of
        cut ``a`` cross device-edge when the edge or cloud has work, those of cut ``b``
        cross edge-cloud when the cloud has work. An edge with no work forwards what it
        received as it came: the device-edge codec is applied once, and
        ``codec["edge-cloud"]`` is not read.
        """
        a, b = cuts
        if not 0 <= a <= b <= self.last:
            raise PlanError(f"cuts must satisfy 0 <= a <= b <= {self.last}, got {cuts}")
        # The values a plan answers with depend on its cuts and on what its codecs decode
        # to, not on their compressors: int8 and int8+zstd give one answer.
        crossing = fidelity_class(codec.get("device-edge", "raw")) if a < self.last else None
        onward = fidelity_class(codec.get("edge-cloud", "raw")) if a < b < self.last else None
        key = (a, b, crossing, onward, index)
        if key in self._answers:
            return dict(self._answers[key])
        answer = self._run_split(a, b, codec, index)
        size = sum(v.nbytes for v in answer.values())
        if self._answer_bytes + size <= _ANSWER_CACHE_BYTES:
            self._answers[key] = answer
            self._answer_bytes += size
        return dict(answer)

    def _run_split(self, a: int, b: int, codec: Mapping[str, str], index: int) -> Request:
        current = self._device(a, index)
        # Each tier feeds its segment's state from its own store: here, from the request.
        state = {s.input: self.requests[index][s.input] for s in self.graph.state}
        if a < self.last:
            current = crossed_with(current, codec.get("device-edge", "raw"), self.images)
            if a < b:
                current = self._segment(a, b, {**current, **state})
            if b < self.last:
                if a < b:
                    current = crossed_with(current, codec.get("edge-cloud", "raw"), self.images)
                current = self._segment(b, self.last, {**current, **state})
        return {name: current[name] for name in self.outputs}

    def measure(
        self,
        cuts: tuple[int, int],
        codec: Mapping[str, str],
        budget: FidelityBudget,
        *,
        stop_early: bool = False,
    ) -> Measurement:
        """Score plan ``cuts`` with ``codec`` on the whole sample against ``budget``."""
        self.runs += 1
        references: list[Request] = []
        outputs: list[Request] = []
        allowed = budget.allowed_disagreements(len(self.requests))
        misses = 0
        for index in range(len(self.requests)):
            reference = self.reference(index)
            got = self.run_split(cuts, codec, index)
            references.append(reference)
            outputs.append(got)
            if not stop_early:
                continue
            partial = score(budget, [reference], [got])
            if budget.metric == "top1":
                misses += partial.value < 1.0
                if misses > allowed:
                    return Measurement(score(budget, references, outputs), False, False)
            elif not budget.met_by(partial.value, 1):
                return Measurement(score(budget, references, outputs), False, False)
        measured = score(budget, references, outputs)
        passed = budget.met_by(measured.value, measured.samples)
        logger.info("[fidelity] cuts %s codec %s: %s", cuts, dict(codec), measured.describe())
        return Measurement(measured, passed, True)


# --------------------------------------------------------------------------- plan dirs


def _plan_sessions(plan: Plan, plan_dir: Path, level: str) -> list[Any]:
    return [_load_session(plan_dir / spec.file, level) for spec in plan.segments]


def _load_session(path: Path, level: str) -> Any:
    """A segment file's session, opened from the file (its weights may lie beside it)."""
    return open_session(path, threads=0, optimization=level, what=f"segment {path}")


def run_plan_dir(plan: Plan, sessions: Sequence[Any], request: Mapping[str, np.ndarray]) -> Request:
    """One request through a written plan's segments, each link's codec applied.

    Between tiers only what a later segment reads (or a model output) crosses; a tier
    without work passes what it receives on as it came, so the codec of the link into it
    is applied once ([Note: an edge that runs nothing] in :mod:`tierflow.plan`).
    Early exits are not taken: this measures the plan's full path.
    """
    available: Request = {name: np.asarray(request[name]) for name in plan.inputs}
    holder = "device"
    for tier in TIERS:
        indices = [i for i, spec in enumerate(plan.segments) if spec.tier == tier]
        if not indices:
            continue
        if tier != holder:
            later = set(plan.outputs).union(
                *(plan.segments[i].inputs for i in range(indices[0], len(plan.segments)))
            )
            available = {name: v for name, v in available.items() if name in later}
            step = TIERS.index(holder)
            link = link_between(TIERS[step], TIERS[step + 1])
            available = crossed_with(available, str(plan.link_codec(link)), plan.images)
            holder = tier
        for i in indices:
            spec = plan.segments[i]
            available.update(_run(sessions[i], available, f"segment {spec.file}"))
    return {name: available[name] for name in plan.outputs}


def plan_fidelity(
    plan_dir: str | Path,
    model: str | Path,
    sample: Mapping[str, np.ndarray],
    *,
    metric: str = "top1",
    level: str = "disabled",
) -> FidelityScore:
    """Fidelity of a written plan against the unsplit ``model`` on ``sample`` (``IN.npz``).

    ``metric`` is ``top1`` (the share of requests whose argmax agrees: the benchmarks'
    ``fidelity`` field), ``rel`` or ``exact``; both sides run at ONNX Runtime ``level``.
    """
    directory = Path(plan_dir)
    plan = load_plan(directory)
    budget = {"top1": FidelityBudget("top1", 1.0), "rel": FidelityBudget("rel", 0.0)}.get(
        metric, FidelityBudget()
    )
    whole = open_session(model, threads=0, optimization=level, what=f"model {model}")
    infos = [_Info.of(arg) for arg in whole.get_inputs()]
    requests = sample_requests(infos, sample)
    sessions = _plan_sessions(plan, directory, level)
    references, outputs = [], []
    for request in requests:
        reference = _run(whole, request, f"model {model}")
        references.append({name: reference[name] for name in plan.outputs})
        outputs.append(run_plan_dir(plan, sessions, request))
    return score(budget, references, outputs)


_ORT_TYPES = {
    "tensor(float)": "float32",
    "tensor(double)": "float64",
    "tensor(float16)": "float16",
    "tensor(int64)": "int64",
    "tensor(int32)": "int32",
    "tensor(int8)": "int8",
    "tensor(uint8)": "uint8",
    "tensor(bool)": "bool",
}


@dataclass(frozen=True)
class _Info:
    """An ONNX Runtime input as :func:`sample_requests` reads it (symbolic dims as text)."""

    name: str
    shape: tuple[Any, ...]
    dtype: str

    @classmethod
    def of(cls, arg: Any) -> _Info:
        if arg.type not in _ORT_TYPES:
            raise ModelError(f"model input {arg.name!r} has unsupported type {arg.type}")
        return cls(arg.name, tuple(arg.shape), _ORT_TYPES[arg.type])
