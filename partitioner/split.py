"""Splitting an analysed model into per-tier segment models, running and checking them.

Segments are extracted (:class:`~tierflow.partitioner.extract.SegmentExtractor`, onnx's
Extractor rebuilt on public ``onnx.helper`` API) from the in-memory, shape-inferred model of a
:class:`~tierflow.partitioner.graph.ModelGraph`, so they carry the static shapes the
analysis found. Each segment's inputs are the tensors crossing its first cut and its
outputs those crossing its last (see [Note: cut sets] in
:mod:`tierflow.partitioner.cuts`), so a tensor needed further on (a skip connection, a
mask, a model output made early) passes through a segment unchanged.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx.checker
import onnx.helper

from tierflow.codec.base import ImageNorm
from tierflow.errors import ModelError, PlanError, UsageError
from tierflow.link.spec import LINKS, TIERS, LinkSpec
from tierflow.partitioner.extract import SegmentExtractor
from tierflow.partitioner.graph import ModelGraph
from tierflow.partitioner.tensors import first_line
from tierflow.partitioner.weights import PROTOBUF_LIMIT, check_graph, open_model_session
from tierflow.partitioner.weights import save_model as save_weighted_model
from tierflow.plan import PLAN_FILE, DecoderSpec, Plan, SegmentSpec, TensorShape, save_plan

logger = logging.getLogger(__name__)

Segment = tuple[SegmentSpec, onnx.ModelProto]


def extract_segment(
    graph: ModelGraph, start: int, end: int, extractor: SegmentExtractor | None = None
) -> onnx.ModelProto:
    """The sub-model running ``graph.cuts[start]`` to ``graph.cuts[end]``.

    Its inputs are the tensors crossing the first cut, its outputs those crossing the
    second; it keeps the source's opset imports and IR version and passes the onnx
    checker. ``extractor`` cuts it from another copy of the model than the analysed one
    (a decoder's as shipped, :func:`~.decoder_graph.split_decoder`).
    """
    if not 0 <= start < end < len(graph.cuts):
        raise PlanError(
            f"segment cuts {start}..{end} must satisfy 0 <= start < end <= {len(graph.cuts) - 1}"
        )
    first, last = graph.cuts[start], graph.cuts[end]
    inputs, outputs = segment_names(graph, start, end)
    try:
        segment = (extractor or graph.extractor).extract(inputs, outputs)
    except (ModelError, ValueError) as exc:
        raise ModelError(
            f"cannot extract cuts {start}..{end} of {graph.path}: {first_line(exc)}"
        ) from exc
    segment.ir_version = graph.model.ir_version
    segment.graph.name = f"{graph.model.graph.name or 'model'}[{first.position}:{last.position}]"
    try:
        # A segment over protobuf's limit has its weights inline (an inline model is under
        # it, [Note: weights stay on disk]); the checker cannot serialize it.
        if segment.ByteSize() <= PROTOBUF_LIMIT:
            check_graph(segment)
    except onnx.checker.ValidationError as exc:
        raise ModelError(
            f"segment {start}..{end} of {graph.path} is not a valid model: {first_line(exc)}"
        ) from exc
    return segment


def segment_names(graph: ModelGraph, start: int, end: int) -> tuple[list[str], list[str]]:
    """A segment's inputs and outputs: the cut tensors, plus the state pairs it owns.

    See [Note: state pairs in the cut search] in :mod:`tierflow.partitioner.stateful`.
    """
    owned = graph.states_between(start, end)
    return (
        [*graph.cuts[start].tensors, *(s.input for s in owned)],
        [*graph.cuts[end].tensors, *(s.output for s in owned)],
    )


def split_model(
    graph: ModelGraph,
    cut_indices: Sequence[int],
    tiers: Sequence[str] = TIERS,
    *,
    extractor: SegmentExtractor | None = None,
) -> list[Segment]:
    """Split at ``cut_indices`` into one segment per tier that has work, in order.

    With tiers (device, edge, cloud) and cut_indices (a, b) the device runs
    ``cuts[0]..cuts[a]``, the edge ``cuts[a]..cuts[b]`` and the cloud
    ``cuts[b]..cuts[-1]``. A tier whose stretch holds no nodes is dropped. Files are
    named by execution order and tier, like ``00-device.onnx``. ``extractor``: as
    :func:`extract_segment` takes it.
    """
    if len(cut_indices) != len(tiers) - 1:
        raise PlanError(
            f"{len(tiers)} tiers need {len(tiers) - 1} cut indices, got {list(cut_indices)}"
        )
    unknown = [t for t in tiers if t not in TIERS]
    if unknown:
        raise PlanError(f"unknown tiers {unknown}: expected names among {', '.join(TIERS)}")
    bounds = [0, *cut_indices, len(graph.cuts) - 1]
    if any(b < 0 or b >= len(graph.cuts) for b in bounds) or bounds != sorted(bounds):
        raise PlanError(
            f"cut indices {list(cut_indices)} must be ascending within 0..{len(graph.cuts) - 1}"
        )
    segments: list[Segment] = []
    for tier, start, end in zip(tiers, bounds[:-1], bounds[1:], strict=True):
        if graph.cuts[start].position == graph.cuts[end].position:
            continue
        model = extract_segment(graph, start, end, extractor)
        inputs, outputs = segment_names(graph, start, end)
        spec = SegmentSpec(
            tier=tier,
            file=f"{len(segments):02d}-{tier}.onnx",
            inputs=tuple(inputs),
            outputs=tuple(outputs),
            state=graph.states_between(start, end),
        )
        segments.append((spec, model))
    return segments


def session(model: onnx.ModelProto, *, level: str = "disabled") -> Any:
    """An ONNX Runtime CPU session for an in-memory model at an optimization ``level``.

    "disabled" and "basic" keep a chain of segments bit-for-bit equal to the whole model;
    "extended" and "all" may not (see [Note: cut sets]). ONNX Runtime picks the thread
    count (one per core).
    """
    return open_model_session(
        model,
        threads=0,
        optimization=level,
        what=f"model {model.graph.name!r} in ONNX Runtime",
    )


def _run(sess: Any, feeds: Mapping[str, np.ndarray], what: str) -> dict[str, np.ndarray]:
    names = [o.name for o in sess.get_outputs()]
    try:
        values = sess.run(names, dict(feeds))
    except Exception as exc:  # onnxruntime raises its own exception types
        raise ModelError(f"ONNX Runtime failed running {what}: {first_line(exc)}") from exc
    return dict(zip(names, values, strict=True))


def run_segments(
    segments: Iterable[Segment], inputs: Mapping[str, np.ndarray], *, level: str = "disabled"
) -> dict[str, np.ndarray]:
    """Run the segments one after another, as the tiers would; return every segment's outputs.

    A segment that owns state pairs takes their inputs from ``inputs`` (as its tier would
    from its session store); its state outputs are returned, never fed onwards.
    """
    available = dict(inputs)
    outputs: dict[str, np.ndarray] = {}
    for spec, model in segments:
        missing = [name for name in spec.inputs if name not in available]
        if missing:
            raise PlanError(f"segment {spec.file} needs {missing}, which nothing before it made")
        feeds = {name: available[name] for name in spec.inputs}
        made = _run(session(model, level=level), feeds, f"segment {spec.file}")
        outputs.update(made)
        available.update({n: made[n] for n in spec.sent_outputs})
    return outputs


@dataclass(frozen=True)
class VerifyResult:
    """Whether the chained segments reproduced the whole model's outputs exactly."""

    bitwise_equal: bool
    max_abs_diff: float
    outputs: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "bitwise_equal": self.bitwise_equal,
            "max_abs_diff": self.max_abs_diff,
            "outputs": list(self.outputs),
        }

    @classmethod
    def from_dict(cls, data: Any) -> VerifyResult:
        try:
            return cls(
                bool(data["bitwise_equal"]),
                float(data["max_abs_diff"]),
                tuple(str(n) for n in data["outputs"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise PlanError(f"malformed verification result {data!r}: {exc}") from exc


def verify_split(
    graph: ModelGraph,
    segments: Sequence[Segment],
    inputs: Mapping[str, np.ndarray] | None = None,
    *,
    level: str = "disabled",
) -> VerifyResult:
    """Run the whole model and the chain of segments on the same input and compare.

    Both run at the same ONNX Runtime optimization ``level``; at "disabled" (the
    default) and "basic" equality must be bit-for-bit (see [Note: cut sets]).
    ``inputs`` defaults to ``graph.representative_inputs()``.
    """
    feeds = dict(inputs) if inputs is not None else graph.representative_inputs()
    expected = _run(session(graph.model, level=level), feeds, f"the whole model {graph.path}")
    actual = run_segments(segments, feeds, level=level)
    names = tuple(o.name for o in graph.outputs)
    missing = [n for n in names if n not in actual]
    if missing:
        raise PlanError(f"the segments do not produce model outputs {missing}")
    equal = True
    worst = 0.0
    for name in names:
        want, got = np.asarray(expected[name]), np.asarray(actual[name])
        same = want.dtype == got.dtype and want.shape == got.shape
        equal = equal and same and want.tobytes() == got.tobytes()
        if same and want.size and want.dtype.kind in "fiub":
            diff = np.abs(want.astype(np.float64) - got.astype(np.float64))
            worst = max(worst, float(np.nanmax(diff)) if not np.isnan(diff).all() else 0.0)
        elif not same:
            worst = float("inf")
    logger.info(
        "[split] verified %d segments: bitwise=%s max|diff|=%g", len(segments), equal, worst
    )
    return VerifyResult(bitwise_equal=equal, max_abs_diff=worst, outputs=names)


def write_segments(segments: Iterable[Segment], plan_dir: str | Path) -> None:
    """Write each segment as ``plan_dir/<spec.file>``, weights embedded.

    A segment of a model whose weights lie in data files, or one over protobuf's 2 GiB
    limit, keeps its weights in ``<file>.data`` beside it ([Note: weights stay on disk]).
    """
    directory = Path(plan_dir)
    directory.mkdir(parents=True, exist_ok=True)
    for spec, model in segments:
        path = directory / spec.file
        save_weighted_model(model, path)
        logger.info("[split] wrote %s (%s, %d nodes)", path, spec.tier, len(model.graph.node))


# Segment files as split_model names them (``00-device.onnx``), as plan sets name them
# (``seg-<hash>.onnx``, see tierflow.partitioner.plan_sets), their external data, and
# what a tier fetching them left unfinished (``.part``, see tierflow.runtime.segment_store).
_SEGMENT_FILE = re.compile(
    r"(?:\d{2}-(?:device|edge|cloud)|seg-[0-9a-f]{12})\.onnx(?:\.data)?(?:\.part)?"
)


def check_plan_dir(plan_dir: str | Path) -> Path:
    """Refuse an output that cannot become a plan directory, before any work is done."""
    directory = Path(plan_dir)
    if directory.exists() and not directory.is_dir():
        raise UsageError(f"-o {plan_dir}: exists and is not a directory; a plan is a directory")
    for parent in directory.parents:
        if parent.exists() and not parent.is_dir():
            raise UsageError(f"-o {plan_dir}: {parent} is a file, not a directory")
    return directory


def remove_old_plan(plan_dir: str | Path) -> list[str]:
    """Delete the files of a plan already in ``plan_dir``; return their names.

    Only files the old ``plan.json`` names (segments and their ``.data``), ``plan.json``
    itself and files named like tierflow's segments go, so that the directory then holds
    exactly the new plan (a stale ``02-cloud.onnx`` would otherwise ship with it);
    anything else a user keeps there stays.
    """
    directory = Path(plan_dir)
    if not directory.is_dir():
        return []
    named: set[str] = set()
    try:
        old = json.loads((directory / PLAN_FILE).read_text())
        plans = old.get("plans", [old])  # a plan set, or one plan
        named = {str(seg["file"]) for plan in plans for seg in plan["segments"]}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass  # no plan, or not one tierflow wrote: only its segment-named files go
    removed = []
    for path in sorted(directory.iterdir()):
        name = path.name
        if not path.is_file() or "/" in name:
            continue
        base = name.removesuffix(".part").removesuffix(".data")
        if name == PLAN_FILE or base in named or _SEGMENT_FILE.fullmatch(name):
            path.unlink()
            removed.append(name)
    if removed:
        logger.info("[split] removed the old plan's files in %s: %s", directory, removed)
    return removed


def crossing_tensors(segments: Sequence[Segment]) -> dict[str, TensorShape]:
    """The dtype and declared shape of every tensor the segments take or give that is not
    state: what ``plan.json`` records for each tier's largest request ([Note: a tier's
    largest request] in tierflow/runtime/limits.py)."""
    found: dict[str, TensorShape] = {}
    for spec, model in segments:
        kept = {s.input for s in spec.state} | {s.output for s in spec.state}
        for value in [*model.graph.input, *model.graph.output]:
            if value.name in kept or value.name in found:
                continue
            kind = value.type.tensor_type
            dims = tuple(d.dim_value if d.HasField("dim_value") else None for d in kind.shape.dim)
            dtype = onnx.helper.tensor_dtype_to_np_dtype(kind.elem_type).name
            found[value.name] = TensorShape(dtype, dims)
    return found


def save_split_plan(
    graph: ModelGraph,
    segments: Sequence[Segment],
    plan_dir: str | Path,
    *,
    cuts: Sequence[int] = (),
    codec: Mapping[str, str] | None = None,
    links: Mapping[str, LinkSpec] | None = None,
    estimate: Mapping[str, Any] | None = None,
    fidelity: Mapping[str, Any] | None = None,
    images: Mapping[str, ImageNorm] | None = None,
    decoder: DecoderSpec | None = None,
) -> Plan:
    """Write ``segments`` and the ``plan.json`` that describes them: a plan directory.

    ``cuts`` are indices into ``graph.cuts`` (recorded as node positions); ``codec``
    maps link names to codec specs, a link not named gets ``raw``. A plan already in
    ``plan_dir`` is replaced whole (:func:`remove_old_plan`).
    """
    remove_old_plan(check_plan_dir(plan_dir))
    write_segments(segments, plan_dir)
    plan = Plan(
        tensors=crossing_tensors(segments),
        model_file=Path(graph.path).name,
        model_sha256=graph.sha256,
        inputs=tuple(i.name for i in graph.travelling_inputs),
        outputs=tuple(o.name for o in graph.answered_outputs),
        segments=tuple(spec for spec, _ in segments),
        links=dict(links or {}),
        codec={name: (codec or {}).get(name, "raw") for name in LINKS},
        estimate=dict(estimate or {}),
        cuts=tuple(graph.cuts[c].position for c in cuts),
        fidelity=dict(fidelity or {}),
        images=dict(images or {}),
        state_pairs=tuple((s.input, s.output) for s in graph.state),
        decoder=decoder,
    )
    save_plan(plan, plan_dir)
    return plan
