"""Planning a model that carries early exits: analyse its trunk, place and attach the heads.

A model from ``tierflow exits add`` has exit heads as extra outputs. Analysed as is, every
head output would cross every later cut (model outputs do, [Note: cut sets]) and the
heads' own nodes would make cuts of their own. So :func:`load_planning_graph` analyses
the *trunk*, the model without its heads: its cuts are those of the model the heads were
grafted onto, and profiles time its units. The heads come back when the plan is written:
:func:`split_with_exits` cuts the trunk at the plan's two cuts *and* at every exit's cut,
so each exit's feature ends a segment, and puts each head on that segment
(:func:`attach_exits`). The tier then runs up to the exit, checks it and either answers or
runs its next segment ([Note: exits in a plan] below). Exits may fall on any tier: the
device answers a confident request itself, without using any link.

How the exits change the predicted costs is [Note: expected cost with early exits] in
:mod:`tierflow.partitioner.cost`.

[Note: exits in a plan]
A plan carries an exit as an :class:`~tierflow.plan.ExitSpec` on the segment that yields
its output (:meth:`ExitInfo.to_spec`). To save compute the model is cut *at* the exit's
feature: the segment ending there outputs the exit probabilities and the crossing
feature; the tier checks the exit and answers if confident, else runs its next segment
(a tier may run several consecutive segments). :func:`attach_exits` builds such segments
from a split of the model without exits;
:func:`~tierflow.partitioner.exits.cost.expected_compute` turns per-unit latencies and
exit rates into the expected compute. ``tierflow plan`` does all this for a model with
exits: this module plans its trunk and attaches the heads, and the cost model weighs
every cost by the chance of getting there ([Note: expected cost with early exits] in
:mod:`tierflow.partitioner.cost`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import onnx
import onnx.utils

from tierflow.errors import ModelError
from tierflow.partitioner.cost import Estimate, ExitPoint, exit_tier
from tierflow.partitioner.exits.cost import exit_cut_indices
from tierflow.partitioner.exits.heads import all_names, check_model, infer_shapes
from tierflow.partitioner.exits.metadata import ExitInfo, read_exits
from tierflow.partitioner.graph import ModelGraph, load_model
from tierflow.partitioner.split import Segment, split_model
from tierflow.partitioner.tensors import first_line
from tierflow.plan import SegmentSpec

logger = logging.getLogger(__name__)


def load_planning_graph(
    path: str | Path,
    *,
    shapes: Mapping[str, Sequence[int]] | None = None,
    sample: Mapping[str, np.ndarray] | None = None,
    state: Sequence[tuple[str, str]] = (),
) -> ModelGraph:
    """Load a model for profiling and planning: its trunk when it has exits.

    Without exits this is :func:`~tierflow.partitioner.graph.load_model`. With exits the
    graph analyses the model without its heads but keeps the file's ``path`` and
    ``sha256`` (profiles and plans name the model the user gave) and holds the exits and
    the model with their heads (``ModelGraph.exits``, ``ModelGraph.exited_model``).
    """
    path = Path(path)
    exits = read_exits(_load(path, weights=False))
    if not exits:
        return load_model(path, shapes=shapes, sample=sample, state=state)
    proto = _load(path, weights=True)
    trunk = trunk_model(proto, exits)
    with tempfile.TemporaryDirectory(prefix="tierflow-trunk-") as tmp:
        trunk_path = Path(tmp) / path.name
        try:
            onnx.save_model(trunk, str(trunk_path))
        except (OSError, ValueError) as exc:
            raise ModelError(f"cannot write the trunk of {path}: {exc}") from exc
        graph = load_model(trunk_path, shapes=shapes, sample=sample, state=state)
    graph = dataclasses.replace(
        graph, path=str(path), sha256=_sha256(path), exits=tuple(exits), exited_model=proto
    )
    logger.info(
        "[plan] %s has %d exit(s): planning its trunk (%d cuts)", path, len(exits), len(graph.cuts)
    )
    return graph


def trunk_model(model: onnx.ModelProto, exits: Sequence[ExitInfo]) -> onnx.ModelProto:
    """``model`` without the heads of ``exits``: the nodes its other outputs need."""
    heads = {e.name for e in exits}
    outputs = [o.name for o in model.graph.output if o.name not in heads]
    if not outputs:
        raise ModelError("the model has only exit outputs; expected a final output too")
    initializers = {t.name for t in model.graph.initializer}
    inputs = [i.name for i in model.graph.input if i.name not in initializers]
    try:
        trunk = onnx.utils.Extractor(infer_shapes(model)).extract_model(inputs, outputs)
    except (ValueError, KeyError) as exc:
        raise ModelError(
            f"cannot separate the exit heads from the model: {first_line(exc)}"
        ) from exc
    trunk.ir_version = model.ir_version
    trunk.graph.name = model.graph.name
    del trunk.metadata_props[:]
    trunk.metadata_props.extend(model.metadata_props)
    return trunk


def graph_exits(graph: ModelGraph) -> tuple[ExitInfo, ...]:
    """The exits of a graph from :func:`load_planning_graph`; empty for any other graph."""
    return graph.exits


def exit_points(graph: ModelGraph) -> tuple[tuple[ExitPoint, ...], list[str]]:
    """The graph's exits the planner can place, and a note for each one it cannot.

    Disabled exits (threshold above 1) never answer, so they are left out rather than
    cost a head and a segment boundary; so is an exit whose feature is not an interior
    one-tensor cut of the trunk.
    """
    exits = graph_exits(graph)
    cuts = exit_cut_indices(graph, exits)
    last = len(graph.cuts) - 1
    points: list[ExitPoint] = []
    notes: list[str] = []
    for info in exits:
        if info.threshold > 1.0:
            notes.append(f"exit {info.name}: disabled (threshold above 1), left out of the plan")
        elif not 0 < cuts.get(info.name, 0) < last:
            notes.append(
                f"exit {info.name}: its feature {info.at or '?'} is not a cut of the model, "
                "left out of the plan"
            )
        else:
            points.append(ExitPoint(info.name, cuts[info.name], info.exit_rate))
    points.sort(key=lambda p: p.cut)
    return tuple(points), notes


def split_with_exits(graph: ModelGraph, chosen: Estimate) -> list[Segment]:
    """Segments for plan ``chosen``: split at its cuts and at its exits, heads attached.

    Without exits this is ``split_model(graph, chosen.cuts)``. A tier whose stretch holds
    an exit gets one segment ending at the exit's cut, with the head, and one going on.
    """
    if not chosen.exits:
        return split_model(graph, chosen.cuts)
    a, b = chosen.cuts
    bounds = sorted({a, b, *(e.cut for e in chosen.exits)})
    ends = [*bounds, len(graph.cuts) - 1]
    tiers = [exit_tier(end, a, b) for end in ends]  # the tier computing each stretch
    plain = split_model(graph, bounds, tiers)
    by_name = {e.name: e for e in graph_exits(graph)}
    used = [by_name[e.name] for e in chosen.exits if e.name in by_name]
    missing = [e.name for e in chosen.exits if e.name not in by_name]
    if missing:
        raise ModelError(f"the plan places exits {missing} that the model does not have")
    assert graph.exited_model is not None, "a graph with exits keeps the model with heads"
    segments = attach_exits(plain, graph.exited_model, used)
    placed = {x.name: spec.tier for spec, _ in segments for x in spec.exits}
    for point in chosen.exits:
        if placed.get(point.name) != point.tier:
            raise ModelError(
                f"exit {point.name} should be checked on the {point.tier}, but the split put "
                f"it on {placed.get(point.name) or 'no segment'}"
            )
    return segments


def attach_exits(
    segments: Sequence[tuple[SegmentSpec, onnx.ModelProto]],
    exited: onnx.ModelProto,
    exits: Sequence[ExitInfo] | None = None,
) -> list[tuple[SegmentSpec, onnx.ModelProto]]:
    """Put each exit's head on the segment that ends with the exit's feature.

    ``segments`` come from splitting the model *without* exits (``split_model``) at cuts
    that include the exits' one-tensor cuts (:func:`exit_cut_indices`); ``exited`` is the
    model with exits (heads and thresholds are read from it, or from ``exits``). A
    segment whose outputs include an exit's ``at`` tensor, which it does not take as
    input, gets the head's nodes and weights, the exit output, and the exit in its
    spec. The last segment gets none: the final answer is there anyway. See
    [Note: exits in a plan].
    """
    chosen = list(read_exits(exited) if exits is None else exits)
    extractor = onnx.utils.Extractor(infer_shapes(exited))
    result: list[tuple[SegmentSpec, onnx.ModelProto]] = []
    for i, (spec, segment) in enumerate(segments):
        mine = [
            e
            for e in chosen
            if i < len(segments) - 1 and e.at in spec.outputs and e.at not in spec.inputs
        ]
        if not mine:
            result.append((spec, segment))
            continue
        model = onnx.ModelProto()
        model.CopyFrom(segment)
        taken = all_names(model)
        for info in mine:
            try:
                head = extractor.extract_model([info.at], [info.name])
            except (ValueError, KeyError) as exc:
                raise ModelError(f"cannot extract exit head {info.name}: {exc}") from exc
            new = {o for n in head.graph.node for o in n.output} | {
                t.name for t in head.graph.initializer
            }
            if new & taken:
                raise ModelError(f"exit {info.name} clashes with names {sorted(new & taken)}")
            model.graph.node.extend(head.graph.node)
            model.graph.initializer.extend(head.graph.initializer)
            model.graph.output.extend(head.graph.output)
            taken |= new
        check_model(model, f"segment {spec.file} with exits")
        spec = dataclasses.replace(
            spec,
            outputs=(*spec.outputs, *(e.name for e in mine)),
            exits=(*spec.exits, *(e.to_spec() for e in mine)),
        )
        result.append((spec, model))
    return result


def _load(path: Path, *, weights: bool) -> onnx.ModelProto:
    """The model; without external weights when only its metadata is wanted."""
    try:
        return onnx.load(str(path), load_external_data=weights)
    except FileNotFoundError as exc:
        raise ModelError(f"model file {path} does not exist") from exc
    except Exception as exc:
        raise ModelError(f"cannot read ONNX model {path}: {first_line(exc)}") from exc


def _sha256(path: Path) -> str:
    """sha256 of the model file (models with exits keep their weights inside it)."""
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError as exc:
        raise ModelError(f"cannot read model file {path}: {exc}") from exc
