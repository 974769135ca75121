"""Adding early exits: train small classifier heads, graft them on, calibrate thresholds.

An exit lets an easy request leave before the whole model has run: a head reads a
feature that crosses one of the graph's cuts (average pooling, to one value or a small
grid per channel, then one linear layer, then softmax) and, when its top probability
reaches the exit's threshold, its answer is taken and the rest of the model is skipped.

Heads are trained with scikit-learn's logistic regression on features computed by ONNX
Runtime from a calibration file (``IN.npz`` layout, optional ``labels``), against the
labels when there are any, else against the full model's own predictions; they are
built and grafted by :mod:`tierflow.partitioner.exits.heads` and recorded as
:mod:`tierflow.partitioner.exits.metadata` describes. Thresholds are chosen as
[Note: exit calibration] in :mod:`tierflow.partitioner.exits.calibration` explains.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import onnx

from tierflow.errors import InputError, ModelError, UsageError
from tierflow.partitioner.exits.calibration import (
    DEFAULT_TARGET,
    calibrate,
    load_calibration,
    prepare_data,
    probabilities,
)
from tierflow.partitioner.exits.heads import (
    Head,
    check_model,
    graft_heads,
    grid_for,
    pool_feature,
    run_model,
    train_head,
)
from tierflow.partitioner.exits.metadata import (
    ExitedModel,
    ExitInfo,
    load_proto,
    read_exits,
    write_metadata,
)
from tierflow.partitioner.exits.points import check_exit_points, choose_exit_points
from tierflow.partitioner.graph import ModelGraph, load_model

logger = logging.getLogger(__name__)

DEFAULT_GRID = 2
HOLDOUT_FRACTION = 0.4
_SEED = 0


def add_exits(
    model: str | Path | ModelGraph,
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
    original = load_proto(graph.path) if graph.path else graph.model
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
    write_metadata(grafted, exit_infos, summary)
    check_model(grafted, "the model with exits")
    return ExitedModel(grafted, exit_infos, summary)


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
    same rule per request ([Note: exit confidence] in ``tierflow.runtime.segment_runner``).
    """
    proto = model if isinstance(model, onnx.ModelProto) else load_proto(model)
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


# --- helpers ----------------------------------------------------------------------------


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
