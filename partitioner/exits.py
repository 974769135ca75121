"""Early exits: small classifier heads grafted onto a model, with calibrated thresholds.

An exit lets an easy request leave before the whole model has run: a head reads a
feature that crosses one of the graph's cuts (average pooling, to one value or a small
grid per channel, then one linear layer, then softmax) and, when its top probability
reaches the exit's threshold, its answer is taken and the rest of the model is skipped.

Heads are trained with scikit-learn's logistic regression on features computed by ONNX
Runtime from a calibration file (``IN.npz`` layout, optional ``labels``), against the
labels when there are any, else against the full model's own predictions; they are
built and grafted by :mod:`tierflow.partitioner.exit_heads`. The grafted model keeps
every original node and output untouched; heads are extra outputs named
``exit0_probs``, ``exit1_probs``..., recorded in the model's ``metadata_props`` under
``tierflow.exits`` (a JSON list of :class:`ExitInfo`). Thresholds are chosen as
[Note: exit calibration] in :mod:`tierflow.partitioner.exit_calibration` explains.

[Note: exits in a plan]
A plan carries an exit as an :class:`~tierflow.plan.ExitSpec` on the segment that yields
its output (:meth:`ExitInfo.to_spec`). To save compute the model is cut *at* the exit's
feature: the segment ending there outputs the exit probabilities and the crossing
feature; the tier checks the exit and answers if confident, else runs its next segment
(a tier may run several consecutive segments). :func:`attach_exits` builds such segments
from a split of the model without exits; :func:`expected_compute` turns per-unit
latencies and exit rates into the expected compute. ``tierflow plan`` does all this for
a model with exits: :mod:`tierflow.partitioner.exit_plan` plans its trunk and attaches
the heads, and the cost model weighs every cost by the chance of getting there
([Note: expected cost with early exits] in :mod:`tierflow.partitioner.cost`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx.utils
from onnx import helper

from tierflow.errors import InputError, ModelError, PlanError, UsageError
from tierflow.partitioner.exit_calibration import (
    DEFAULT_TARGET,
    NEVER,
    calibrate,
    load_calibration,
    prepare_data,
    probabilities,
)
from tierflow.partitioner.exit_heads import (
    Head,
    all_names,
    check_model,
    graft_heads,
    grid_for,
    infer_shapes,
    pool_feature,
    run_model,
    train_head,
)
from tierflow.partitioner.exit_points import (
    check_exit_points,
    choose_exit_points,
    exit_candidates,
)
from tierflow.plan import ExitSpec, SegmentSpec

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_TARGET",
    "NEVER",
    "ExitInfo",
    "ExitedModel",
    "add_exits",
    "attach_exits",
    "calibrate",
    "choose_exit_points",
    "exit_candidates",
    "exit_cut_indices",
    "exit_skips",
    "expected_compute",
    "expected_compute_fraction",
    "format_table",
    "load_calibration",
    "read_exit_summary",
    "read_exits",
    "run_model",
    "simulate_exits",
]

METADATA_KEY = "tierflow.exits"
SUMMARY_KEY = "tierflow.exits.summary"
DEFAULT_GRID = 2
HOLDOUT_FRACTION = 0.4
_SEED = 0


@dataclass(frozen=True)
class ExitInfo:
    """One exit of a model: its output, the feature it reads, and its threshold.

    ``at`` is the cut tensor the head reads (empty when a declared exit's source is not a
    single tensor). ``calibration`` holds the target and the achieved figures.
    """

    name: str
    at: str
    threshold: float
    calibration: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "at": self.at,
            "threshold": self.threshold,
            "calibration": dict(self.calibration),
        }

    @classmethod
    def from_dict(cls, data: Any) -> ExitInfo:
        if not isinstance(data, dict) or not isinstance(data.get("name"), str):
            raise ModelError(f"malformed exit record: expected an object with a name, got {data!r}")
        try:
            threshold = float(data["threshold"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelError(
                f"malformed exit record {data['name']!r}: no numeric threshold"
            ) from exc
        return cls(
            name=data["name"],
            at=str(data.get("at") or ""),
            threshold=threshold,
            calibration=dict(data.get("calibration") or {}),
        )

    def to_spec(self) -> ExitSpec:
        """The plan's view of this exit (see [Note: exits in a plan])."""
        return ExitSpec(self.name, self.threshold, {"at": self.at, **self.calibration})

    @property
    def exit_rate(self) -> float:
        """Fraction of held-out requests that left here during calibration (0 if unknown)."""
        return float(self.calibration.get("exit_rate", 0.0))


@dataclass(frozen=True)
class ExitedModel:
    """A model with exit heads grafted on and thresholds calibrated.

    ``summary`` holds the overall achieved figures on the held-out calibration data.
    """

    model: onnx.ModelProto
    exits: tuple[ExitInfo, ...]
    summary: dict[str, Any]

    def save(self, path: str | Path) -> Path:
        """Write the model as one ONNX file (weights embedded)."""
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.tmp")
        try:
            onnx.save_model(self.model, str(tmp))
            tmp.replace(target)
        except (OSError, ValueError) as exc:
            raise ModelError(f"cannot write {target}: {exc}") from exc
        finally:
            tmp.unlink(missing_ok=True)
        return target

    def table(self) -> str:
        """The calibration figures as an aligned table for people."""
        return format_table(self.exits, self.summary)


# --- reading ----------------------------------------------------------------------------


def read_exits(model: onnx.ModelProto | str | Path) -> list[ExitInfo]:
    """The exits recorded in a model's metadata, in order; empty if it has none."""
    proto = model if isinstance(model, onnx.ModelProto) else _load_proto(model)
    for prop in proto.metadata_props:
        if prop.key == METADATA_KEY:
            try:
                records = json.loads(prop.value)
            except json.JSONDecodeError as exc:
                raise ModelError(f"malformed {METADATA_KEY} metadata: {exc}") from exc
            if not isinstance(records, list):
                raise ModelError(f"malformed {METADATA_KEY} metadata: expected a JSON list")
            return [ExitInfo.from_dict(r) for r in records]
    return []


def read_exit_summary(model: onnx.ModelProto | str | Path) -> dict[str, Any]:
    """The overall calibration figures recorded with the exits; empty if none."""
    proto = model if isinstance(model, onnx.ModelProto) else _load_proto(model)
    for prop in proto.metadata_props:
        if prop.key == SUMMARY_KEY:
            try:
                summary = json.loads(prop.value)
            except json.JSONDecodeError as exc:
                raise ModelError(f"malformed {SUMMARY_KEY} metadata: {exc}") from exc
            return dict(summary) if isinstance(summary, dict) else {}
    return {}


def simulate_exits(
    model: onnx.ModelProto | str | Path,
    inputs: Mapping[str, np.ndarray],
    exits: Sequence[ExitInfo] | None = None,
) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
    """Run a model with exits on rows of ``inputs`` and apply the exit rule per row.

    Returns ``(taken, predicted, outputs)``: the index of the exit each row left at (-1
    when it ran to the end), the class answered, and every fetched output (the model's
    own outputs and the exits'). ``exits`` defaults to those recorded in the model; pass
    modified thresholds to try others. For benchmarks and tests: the runtime applies the
    same rule per request ([Note: exit confidence] in ``tierflow.segment_runner``).
    """
    proto = model if isinstance(model, onnx.ModelProto) else _load_proto(model)
    chosen = list(read_exits(proto) if exits is None else exits)
    final, _ = _classifier_output(proto)
    names = [o.name for o in proto.graph.output]
    outputs = run_model(proto, inputs, names)
    rows = len(outputs[final])
    taken = np.full(rows, -1, dtype=np.int64)
    predicted = outputs[final].argmax(axis=1)
    for k, info in enumerate(chosen):
        probs = probabilities(outputs[info.name])
        leave = (taken < 0) & (probs.max(axis=1) >= info.threshold)
        taken[leave] = k
        predicted[leave] = probs[leave].argmax(axis=1)
    return taken, predicted, outputs


# --- the planner's view -----------------------------------------------------------------


def expected_compute(unit_costs: Sequence[float], exits: Sequence[tuple[int, float]]) -> float:
    """Expected compute of running units in order when requests may leave at exits.

    ``unit_costs[i]`` is the cost (seconds, or FLOPs) of unit ``i``; ``exits`` holds
    ``(first_skipped_unit, exit_rate)`` pairs: a request leaving at that exit has run
    units ``0 .. first_skipped_unit - 1`` and skips the rest, and ``exit_rate`` is the
    fraction of *all* requests leaving there (``ExitInfo.exit_rate``). With the graph's
    cuts, an exit reading the tensor of cut ``k`` skips unit ``k`` onwards when unit ``i``
    spans cut ``i`` to cut ``i + 1`` (see :func:`exit_cut_indices`). Head costs are
    neglected: a pool and one small matrix product.
    """
    costs = np.asarray(unit_costs, dtype=np.float64)
    reach = np.ones(len(costs))
    total_rate = 0.0
    for first_skipped, rate in exits:
        if not 0 <= first_skipped <= len(costs):
            raise PlanError(f"exit skips from unit {first_skipped}, expected 0..{len(costs)}")
        if rate < 0:
            raise PlanError(f"exit rate must be non-negative, got {rate}")
        reach[first_skipped:] -= rate
        total_rate += rate
    if total_rate > 1.0 + 1e-9:
        raise PlanError(f"exit rates add up to {total_rate}, more than 1")
    return float(np.dot(costs, np.clip(reach, 0.0, 1.0)))


def expected_compute_fraction(
    unit_costs: Sequence[float], exits: Sequence[tuple[int, float]]
) -> float:
    """:func:`expected_compute` as a fraction of running every unit (1.0 without exits)."""
    total = float(np.sum(np.asarray(unit_costs, dtype=np.float64)))
    return expected_compute(unit_costs, exits) / total if total > 0 else 1.0


def exit_cut_indices(graph: Any, exits: Sequence[ExitInfo]) -> dict[str, int]:
    """Map each exit's name to the index of the one-tensor cut of ``graph`` it reads."""
    by_tensor = {cut.tensors[0]: cut.index for cut in graph.cuts if len(cut.tensors) == 1}
    return {e.name: by_tensor[e.at] for e in exits if e.at in by_tensor}


def exit_skips(graph: Any, exits: Sequence[ExitInfo]) -> list[tuple[int, float]]:
    """``(first_skipped_unit, exit_rate)`` pairs for :func:`expected_compute`.

    ``graph`` is the analysed model *without* exits, whose units the profiles time;
    exits whose feature is not one of its one-tensor cuts are left out.
    """
    indices = exit_cut_indices(graph, exits)
    return [(indices[e.name], e.exit_rate) for e in exits if e.name in indices]


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
        spec = replace(
            spec,
            outputs=(*spec.outputs, *(e.name for e in mine)),
            exits=(*spec.exits, *(e.to_spec() for e in mine)),
        )
        result.append((spec, model))
    return result


# --- adding exits -----------------------------------------------------------------------


def add_exits(
    model: Any,
    data: Mapping[str, np.ndarray] | str | Path,
    *,
    exits: int | None = None,
    at: Sequence[str] = (),
    declare: Sequence[str] = (),
    max_disagreement: float | None = None,
    max_accuracy_drop: float | None = None,
    holdout: Mapping[str, np.ndarray] | str | Path | None = None,
    pool_grid: int = DEFAULT_GRID,
    shapes: Mapping[str, Sequence[int]] | None = None,
) -> ExitedModel:
    """Graft exit heads onto ``model`` (a path or a ``ModelGraph``) and calibrate them.

    Exits go at the cut tensors named in ``at``, else at ``exits`` cuts (default 3,
    fewer when the graph has fewer distinct candidates) spread over the estimated compute;
    ``declare`` names outputs the model already has that are exits. The target is
    ``max_disagreement`` (default 1%) against the full model, or ``max_accuracy_drop``,
    which needs ``labels`` in the data. See [Note: exit calibration]. ``pool_grid``
    is how finely heads on 4-D features pool (see :func:`pool_feature`). When ``model``
    is a path it is analysed with ``shapes`` (``--shape``), else at the data's first
    request's shapes.
    """
    from tierflow.partitioner.graph import ModelGraph, load_model

    if max_disagreement is not None and max_accuracy_drop is not None:
        raise UsageError("give either a maximum disagreement or a maximum accuracy drop, not both")
    metric = "accuracy_drop" if max_accuracy_drop is not None else "disagreement"
    target = max_accuracy_drop if max_accuracy_drop is not None else max_disagreement
    target = DEFAULT_TARGET if target is None else float(target)
    if not 0.0 <= target < 1.0:
        raise UsageError(f"the exit target must be a fraction in [0, 1), got {target}")
    if exits is not None and at:
        raise UsageError("give either a number of exits or the tensors to put them at, not both")
    if pool_grid < 1:
        raise UsageError(f"the pooling grid must be at least 1, got {pool_grid}")

    arrays = load_calibration(data) if isinstance(data, str | Path) else dict(data)
    if isinstance(model, ModelGraph):
        graph = model
    else:
        sample = None if shapes else {k: v for k, v in arrays.items() if k != "labels"}
        graph = load_model(model, shapes=shapes, sample=sample)
    original = _load_proto(graph.path) if graph.path else graph.model
    if read_exits(original) and not declare:
        raise UsageError(
            "the model already has exits; start from the model without them, or declare "
            "its exit outputs with --declare-exit"
        )
    final, classes = _classifier_output(original)
    calib = prepare_data(original, arrays, "calibration data")
    if metric == "accuracy_drop" and calib.labels is None:
        raise InputError("--max-accuracy-drop needs a 'labels' array in the calibration data")

    if holdout is None:
        order = np.random.default_rng(_SEED).permutation(calib.rows)
        cut = round(calib.rows * (1 - HOLDOUT_FRACTION))
        fit, held = calib.take(np.sort(order[:cut])), calib.take(np.sort(order[cut:]))
    else:
        fit = calib
        held_arrays = (
            load_calibration(holdout) if isinstance(holdout, str | Path) else dict(holdout)
        )
        held = prepare_data(original, held_arrays, "held-out data")
    if metric == "accuracy_drop" and held.labels is None:
        raise InputError("--max-accuracy-drop needs a 'labels' array in the held-out data")
    for part in (fit, held):
        if part.labels is not None and (part.labels.min() < 0 or part.labels.max() >= classes):
            raise InputError(
                f"labels must be class indices 0..{classes - 1} for output {final!r}, found "
                f"{int(part.labels.min())}..{int(part.labels.max())}"
            )

    points = list(at) if at else choose_exit_points(graph, 3 if exits is None else exits)
    check_exit_points(graph, points)
    heads: list[Head] = []
    if points:
        outputs = run_model(original, fit.inputs, [*points, final])
        targets = fit.labels if fit.labels is not None else outputs[final].argmax(axis=1)
        for i, point in enumerate(points):
            grid = grid_for(graph.tensors[point].shape, pool_grid)
            weight, bias = train_head(pool_feature(outputs[point], grid), targets, classes)
            heads.append(Head(f"exit{i}_probs", point, grid, weight, bias))
            logger.info(
                "[exits] trained head exit%d_probs on %s (%dx%d pooling, %d rows)",
                i,
                point,
                grid,
                grid,
                fit.rows,
            )

    _check_declared(original, declare, classes)
    grafted = graft_heads(original, heads)
    declared = [(name, _exit_source(grafted, name, final)) for name in declare]
    ordered = _in_graph_order(grafted, [(h.name, h.at) for h in heads] + declared)
    if not ordered:
        raise UsageError("no exits to calibrate: the model has no candidate exit points")
    names = [name for name, _ in ordered]
    results = run_model(grafted, held.inputs, [*names, final])
    reference = results[final].argmax(axis=1)
    infos, summary = calibrate(
        [probabilities(results[n]) for n in names],
        reference,
        held.labels,
        metric=metric,
        target=target,
    )
    exit_infos = tuple(
        ExitInfo(name, source, info["threshold"], info["calibration"])
        for (name, source), info in zip(ordered, infos, strict=True)
    )
    summary["heads_trained_on"] = fit.rows
    _set_metadata(grafted, exit_infos, summary)
    check_model(grafted, "the model with exits")
    return ExitedModel(grafted, exit_infos, summary)


def format_table(exits: Sequence[ExitInfo], summary: Mapping[str, Any]) -> str:
    """Per-exit figures and the overall line as an aligned table."""
    metric = str(summary.get("metric", "disagreement"))
    header = ("exit", "at", "threshold", "exit rate", metric)
    rows = [
        (
            e.name,
            e.at or "?",
            "never" if e.threshold > 1 else f"{e.threshold:.4f}",
            f"{100 * e.exit_rate:.1f}%",
            f"{100 * float(e.calibration.get('achieved', 0.0)):.2f}%",
        )
        for e in exits
    ]
    rows.append(
        (
            "overall",
            f"target {100 * float(summary.get('target', 0.0)):.2f}%",
            "",
            f"{100 * float(summary.get('exit_rate', 0.0)):.1f}%",
            f"{100 * float(summary.get('achieved', 0.0)):.2f}%",
        )
    )
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)) for r in [header, *rows]
    ]
    return "\n".join(line.rstrip() for line in lines)


# --- helpers ----------------------------------------------------------------------------


def _load_proto(path: str | Path) -> onnx.ModelProto:
    try:
        return onnx.load(str(path))
    except FileNotFoundError as exc:
        raise ModelError(f"model {path} not found") from exc
    except Exception as exc:
        raise ModelError(f"cannot read ONNX model {path}: {exc}") from exc


def _classifier_output(model: onnx.ModelProto) -> tuple[str, int]:
    """The model's first output, which must be 2-D [batch, classes] with classes known."""
    if not model.graph.output:
        raise ModelError("the model has no outputs")
    output = model.graph.output[0]
    dims = output.type.tensor_type.shape.dim
    if len(dims) != 2 or not dims[1].HasField("dim_value") or dims[1].dim_value < 2:
        shape = [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in dims]
        raise ModelError(
            f"exits need a classifier: expected the first output {output.name!r} to be "
            f"[batch, classes], found shape {shape}"
        )
    return output.name, int(dims[1].dim_value)


def _producers(model: onnx.ModelProto) -> dict[str, int]:
    return {out: i for i, node in enumerate(model.graph.node) for out in node.output}


def _ancestors(model: onnx.ModelProto, name: str) -> set[int]:
    producers = _producers(model)
    seen: set[int] = set()
    stack = [name]
    while stack:
        index = producers.get(stack.pop())
        if index is None or index in seen:
            continue
        seen.add(index)
        stack.extend(model.graph.node[index].input)
    return seen


def _exit_source(model: onnx.ModelProto, name: str, final: str) -> str:
    """The single trunk tensor a declared exit's branch reads, or "" when there is none."""
    branch = _ancestors(model, name) - _ancestors(model, final)
    produced_in_branch = {out for i in branch for out in model.graph.node[i].output}
    reads = {
        tensor
        for i in branch
        for tensor in model.graph.node[i].input
        if tensor and tensor not in produced_in_branch
    }
    trunk = reads - {init.name for init in model.graph.initializer}
    trunk = {t for t in trunk if t in _producers(model) or t in {i.name for i in model.graph.input}}
    return next(iter(trunk)) if len(trunk) == 1 else ""


def _check_declared(model: onnx.ModelProto, declare: Sequence[str], classes: int) -> None:
    outputs = {o.name: o for o in model.graph.output}
    for name in declare:
        if name not in outputs:
            raise UsageError(
                f"declared exit {name!r} is not an output of the model; its outputs are "
                f"{sorted(outputs)}"
            )
        dims = outputs[name].type.tensor_type.shape.dim
        if len(dims) != 2 or (dims[1].HasField("dim_value") and dims[1].dim_value != classes):
            raise ModelError(
                f"declared exit {name!r} must be [batch, {classes}] like the model's output"
            )


def _in_graph_order(
    model: onnx.ModelProto, exits: Sequence[tuple[str, str]]
) -> list[tuple[str, str]]:
    """Exits sorted by the position of the node computing them (earliest first)."""
    producers = _producers(model)

    def position(item: tuple[str, str]) -> int:
        name, source = item
        return producers.get(source, producers.get(name, 0))

    return sorted(exits, key=position)


def _set_metadata(
    model: onnx.ModelProto, exits: Sequence[ExitInfo], summary: Mapping[str, Any]
) -> None:
    props = {p.key: p.value for p in model.metadata_props}
    props[METADATA_KEY] = json.dumps([e.to_dict() for e in exits])
    props[SUMMARY_KEY] = json.dumps(dict(summary))
    helper.set_model_props(model, props)
