"""Early exits: small classifier heads grafted onto a model, with calibrated thresholds.

An exit lets an easy request leave before the whole model has run: a head reads a
feature that crosses one of the graph's cuts (average pooling, to one value or a small
grid per channel, then one linear layer, then softmax) and, when its top probability
reaches the exit's threshold, its answer is taken and the rest of the model is skipped. See [Note: exit calibration] for
how thresholds are chosen and [Note: exits in a plan] for how exits save compute in a
split model.

Heads are trained with scikit-learn's logistic regression on features computed by ONNX
Runtime from a calibration file (``IN.npz`` layout, optional ``labels``), against the
labels when there are any, else against the full model's own predictions. The grafted
model keeps every original node and output untouched; heads are extra outputs named
``exit0_probs``, ``exit1_probs``..., recorded in the model's ``metadata_props`` under
``tierflow.exits`` (a JSON list of :class:`ExitInfo`).

[Note: exit calibration]
The calibration data is split deterministically (seed 0) into a part that trains the
heads and a held-out part that sets the thresholds (or ``holdout`` is given). Exits are
taken in order: a request leaves at the first exit whose top probability is at least
its threshold. For exit k, among the held-out requests that did not leave earlier, we
sort by confidence and choose the *lowest* threshold such that, among the requests that
would leave at k, the disagreement with the full model's prediction (or, with labels,
the accuracy lost against the full model) is at most the target, counted with one
pseudo-miss: (misses + 1) / (leavers + 1). Picking the lowest threshold that passes on a
finite sample is optimistic (the running rate dips below the target by chance); the
pseudo-miss damps that and disables exits that too few held-out requests support. Each
exit meeting the target among its leavers means the overall figure, which counts requests
that run to the end as exact, meets it too (it is a weighted mean of the per-exit figures
and zeros). When no threshold meets the target the exit is disabled (threshold above 1).
Thresholds are measured on the grafted model run by ONNX Runtime, so they apply to
exactly the probabilities the runtime will see. On new data the figure is a sample
estimate like any other: expect it within a point or so of the target for a few hundred
held-out requests, more when the calibration data is the model's own training data.

[Note: exits in a plan]
A plan carries an exit as an :class:`~tierflow.plan.ExitSpec` on the segment that yields
its output (:meth:`ExitInfo.to_spec`). To save compute the model is cut *at* the exit's
feature: the segment ending there outputs the exit probabilities and the crossing
feature; the tier checks the exit and answers if confident, else runs its next segment
(a tier may run several consecutive segments). :func:`expected_compute` turns per-unit
latencies and exit rates into the expected compute the cost model should use.
"""

from __future__ import annotations

import json
import logging
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from tierflow.errors import InputError, ModelError, UsageError
from tierflow.plan import ExitSpec

logger = logging.getLogger(__name__)

METADATA_KEY = "tierflow.exits"
SUMMARY_KEY = "tierflow.exits.summary"
NEVER = 2.0  # a threshold no probability reaches: the exit is disabled
DEFAULT_TARGET = 0.01
DEFAULT_GRID = 2
HOLDOUT_FRACTION = 0.4
_BATCH = 64
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
class Head:
    """A trained exit head before grafting: output name, feature read, pooling, weights.

    ``grid`` g > 1 average-pools a 4-D feature to g x g cells instead of one (see
    :func:`pool_feature`); ``weight`` is [pooled features, classes].
    """

    name: str
    at: str
    grid: int
    weight: np.ndarray
    bias: np.ndarray


@dataclass(frozen=True)
class CalibrationData:
    """Model inputs as rows ready for ONNX Runtime, with labels if the file had them.

    Files hold one array per input with a leading request axis; here the request axis and
    each request's own batch axis are merged, so row r of every array is one example.
    """

    inputs: dict[str, np.ndarray]
    labels: np.ndarray | None

    @property
    def rows(self) -> int:
        return len(next(iter(self.inputs.values())))

    def take(self, index: np.ndarray) -> CalibrationData:
        labels = None if self.labels is None else self.labels[index]
        return CalibrationData({k: v[index] for k, v in self.inputs.items()}, labels)


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


def load_calibration(path: str | Path) -> dict[str, np.ndarray]:
    """Read a calibration ``.npz`` into a dict of arrays (checked later against a model)."""
    try:
        with np.load(Path(path), allow_pickle=False) as archive:
            return {name: archive[name] for name in archive.files}
    except FileNotFoundError as exc:
        raise InputError(f"calibration data {path} not found") from exc
    except (OSError, ValueError) as exc:
        raise InputError(
            f"cannot read calibration data {path}: expected an .npz file ({exc})"
        ) from exc


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
        probs = _probabilities(outputs[info.name])
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
            raise ValueError(f"exit skips from unit {first_skipped}, expected 0..{len(costs)}")
        if rate < 0:
            raise ValueError(f"exit rate must be non-negative, got {rate}")
        reach[first_skipped:] -= rate
        total_rate += rate
    if total_rate > 1.0 + 1e-9:
        raise ValueError(f"exit rates add up to {total_rate}, more than 1")
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
    calib = _prepare(original, arrays, "calibration data")
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
        held = _prepare(original, held_arrays, "held-out data")
    if metric == "accuracy_drop" and held.labels is None:
        raise InputError("--max-accuracy-drop needs a 'labels' array in the held-out data")

    points = list(at) if at else choose_exit_points(graph, 3 if exits is None else exits)
    _check_points(graph, points)
    heads: list[Head] = []
    if points:
        outputs = run_model(original, fit.inputs, [*points, final])
        targets = fit.labels if fit.labels is not None else outputs[final].argmax(axis=1)
        for i, point in enumerate(points):
            grid = _grid_for(graph.tensors[point].shape, pool_grid)
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
        [_probabilities(results[n]) for n in names],
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
    _check(grafted, "the model with exits")
    return ExitedModel(grafted, exit_infos, summary)


def choose_exit_points(graph: Any, count: int, fractions: Sequence[float] = ()) -> list[str]:
    """Pick up to ``count`` cut tensors spread over the model's estimated compute.

    Candidates are one-tensor cuts whose tensor is a 2-D to 4-D float feature and not a
    model output. Targets are evenly spaced fractions of the compute (25/50/75% for three;
    MACs of Conv/Gemm/MatMul, or node count when those are absent); each takes the
    nearest unused candidate, in order of depth.
    """
    if count < 0:
        raise UsageError(f"the number of exits must be at least 0, got {count}")
    if count == 0:
        return []
    spots = list(fractions) or [(i + 1) / (count + 1) for i in range(count)]
    depth = _compute_depth(graph)
    positions = {cut.tensors[0]: cut.position for cut in graph.cuts if len(cut.tensors) == 1}
    candidates: list[tuple[float, str]] = []
    for name in exit_candidates(graph):
        fraction = depth[min(positions[name], len(depth) - 1)]
        if 0.0 < fraction < 0.98:
            candidates.append((fraction, name))
    chosen: list[tuple[float, str]] = []
    for spot in spots:
        free = [c for c in candidates if c not in chosen]
        if free:
            chosen.append(min(free, key=lambda c: (abs(c[0] - spot), c[0])))
    chosen.sort()
    logger.info(
        "[exits] exit points %s",
        ", ".join(f"{name} ({100 * frac:.0f}% of compute)" for frac, name in chosen),
    )
    return [name for _, name in chosen]


def exit_candidates(graph: Any) -> list[str]:
    """Tensors an exit may read, in depth order: one-tensor cuts that are 2-D to 4-D
    floating-point activations, neither model inputs nor model outputs."""
    ends = {t.name for t in (*graph.inputs, *graph.outputs)}
    names: list[str] = []
    for cut in graph.cuts:
        if len(cut.tensors) != 1 or cut.tensors[0] in ends:
            continue
        info = graph.tensors.get(cut.tensors[0])
        if info is None or len(info.shape) not in (2, 3, 4):
            continue
        if np.issubdtype(np.dtype(info.dtype), np.floating):
            names.append(cut.tensors[0])
    return names


def _compute_depth(graph: Any) -> list[float]:
    """Fraction of estimated compute done before each node position (length nodes + 1)."""
    costs = [_node_macs(graph, node) for node in graph.nodes]
    if sum(costs) <= 0:
        costs = [1.0] * len(graph.nodes)
    running = np.concatenate([[0.0], np.cumsum(costs)])
    return list(running / max(running[-1], 1e-12))


def _node_macs(graph: Any, node: onnx.NodeProto) -> float:
    """Multiply-accumulates of Conv, Gemm and MatMul nodes from static shapes; 0 for others."""
    if node.op_type not in ("Conv", "Gemm", "MatMul") or not node.output:
        return 0.0
    out = graph.tensors.get(node.output[0])
    weights = {init.name: tuple(init.dims) for init in graph.model.graph.initializer}
    if out is None:
        return 0.0
    elements = float(np.prod(out.shape))
    if node.op_type == "Conv":
        kernel = weights.get(node.input[1])
        return elements * float(np.prod(kernel[1:])) if kernel else 0.0
    first = graph.tensors.get(node.input[0])
    shape = first.shape if first is not None else weights.get(node.input[0])
    if not shape:
        return 0.0
    trans_a = any(a.name == "transA" and a.i for a in node.attribute)
    inner = shape[0] if node.op_type == "Gemm" and trans_a else shape[-1]
    return elements * float(inner)


def _check_points(graph: Any, points: Sequence[str]) -> None:
    if len(set(points)) != len(points):
        raise UsageError(f"exit points must be distinct, got {list(points)}")
    candidates = exit_candidates(graph)
    for point in points:
        if point not in candidates:
            raise UsageError(
                f"{point!r} cannot carry an exit: expected a one-tensor cut holding a 2-D to "
                f"4-D float feature, one of {', '.join(candidates) or 'none'}"
            )


# --- running and heads ------------------------------------------------------------------


def run_model(
    model: onnx.ModelProto, inputs: Mapping[str, np.ndarray], outputs: Sequence[str]
) -> dict[str, np.ndarray]:
    """Run ``model`` in ONNX Runtime on rows of ``inputs`` and fetch ``outputs``.

    Intermediate tensors are added as graph outputs for the run. Rows go in batches of 64
    when every input's leading dimension is dynamic, else in batches of that dimension.
    """
    import onnxruntime as ort

    proto = onnx.ModelProto()
    proto.CopyFrom(model)
    present = {o.name for o in proto.graph.output}
    for name in outputs:
        if name not in present:
            proto.graph.output.append(onnx.ValueInfoProto(name=name))
    try:
        options = ort.SessionOptions()
        options.log_severity_level = 3
        session = ort.InferenceSession(
            proto.SerializeToString(), options, providers=["CPUExecutionProvider"]
        )
    except Exception as exc:
        raise ModelError(f"ONNX Runtime cannot load the model: {exc}") from exc
    batch = _BATCH
    for item in proto.graph.input:
        dims = item.type.tensor_type.shape.dim
        if dims and dims[0].HasField("dim_value") and item.name in inputs:
            batch = min(batch, dims[0].dim_value)
    rows = len(next(iter(inputs.values())))
    chunks: list[list[np.ndarray]] = []
    for first in range(0, rows, batch):
        feeds = {name: array[first : first + batch] for name, array in inputs.items()}
        try:
            chunks.append(session.run(list(outputs), feeds))
        except Exception as exc:
            raise ModelError(f"ONNX Runtime failed on the calibration data: {exc}") from exc
    return {name: np.concatenate([c[i] for c in chunks]) for i, name in enumerate(outputs)}


def _grid_for(shape: Sequence[int], grid: int) -> int:
    """``grid`` if it divides a 4-D feature's height and width, else 1 (global pooling)."""
    if len(shape) == 4 and grid > 1 and shape[2] % grid == 0 and shape[3] % grid == 0:
        return grid
    return 1


def pool_feature(feature: np.ndarray, grid: int = 1) -> np.ndarray:
    """What the grafted head computes before its linear layer: [rows, pooled features].

    A 4-D feature [N,C,H,W] is averaged over g x g equal cells (g = ``grid``; 1 is global
    average pooling) and flattened channel-major to C*g*g values: for small images where
    a stroke is matters as much as what it is (on the digits, a linear head on the stem's
    2x2-pooled feature is ~98% accurate, on its global pool ~81%). 3-D [N,T,D] is
    averaged over T, 2-D is used as it is.
    """
    if feature.ndim == 4 and grid > 1:
        n, c, h, w = feature.shape
        cells = feature.reshape(n, c, grid, h // grid, grid, w // grid)
        return cells.mean(axis=(3, 5), dtype=np.float64).reshape(n, c * grid * grid)
    if feature.ndim == 4:
        return feature.mean(axis=(2, 3), dtype=np.float64)
    if feature.ndim == 3:
        return feature.mean(axis=1, dtype=np.float64)
    if feature.ndim == 2:
        return feature.astype(np.float64)
    raise ModelError(f"an exit feature must be 2-D to 4-D, found shape {list(feature.shape)}")


def train_head(
    features: np.ndarray, targets: np.ndarray, classes: int
) -> tuple[np.ndarray, np.ndarray]:
    """Fit softmax regression; return ``weight`` [channels, classes] and ``bias`` [classes].

    Features are standardised for the fit and the scaling folded back into the weights,
    so the head in the graph reads the raw pooled feature. Classes absent from the
    targets get a bias of -30 (probability ~0).
    """
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.linear_model import LogisticRegression

    mean = features.mean(axis=0)
    std = features.std(axis=0) + 1e-6
    weight = np.zeros((features.shape[1], classes))
    bias = np.full(classes, -30.0)
    present = np.unique(targets)
    if len(present) == 1:
        bias[present[0]] = 30.0
        return weight.astype(np.float32), bias.astype(np.float32)
    regression = LogisticRegression(C=1.0, max_iter=2000)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)  # a head that is nearly fit is fine
        regression.fit((features - mean) / std, targets)
    coef = (
        regression.coef_ if len(present) > 2 else np.vstack([-regression.coef_, regression.coef_])
    )
    intercept = (
        regression.intercept_
        if len(present) > 2
        else np.concatenate([-regression.intercept_, regression.intercept_])
    )
    for row, cls in enumerate(regression.classes_):
        weight[:, int(cls)] = coef[row] / std
        bias[int(cls)] = intercept[row] - float(np.dot(coef[row], mean / std))
    return weight.astype(np.float32), bias.astype(np.float32)


def graft_heads(model: onnx.ModelProto, heads: Sequence[Head]) -> onnx.ModelProto:
    """Copy ``model`` and add one head per :class:`Head`.

    Each head is pool (GlobalAveragePool, or AveragePool to a g x g grid, then Flatten
    for 4-D; ReduceMean over axis 1 for 3-D) -> Gemm -> Softmax; nothing existing is
    changed, so the original outputs stay bit-for-bit the same.
    """
    grafted = onnx.ModelProto()
    grafted.CopyFrom(model)
    if not heads:
        return grafted
    inferred = _infer(grafted)
    shapes = _value_shapes(inferred)
    taken = _all_names(grafted)
    opset = next((o.version for o in grafted.opset_import if o.domain in ("", "ai.onnx")), 13)
    batch_dim = grafted.graph.output[0].type.tensor_type.shape.dim[0]
    for head in heads:
        name, point, weight, bias = head.name, head.at, head.weight, head.bias
        prefix = f"tierflow_{name}"
        new = {name, f"{prefix}_flat", f"{prefix}_pool", f"{prefix}_w", f"{prefix}_b"}
        clash = sorted(new & taken)
        if clash:
            raise ModelError(f"cannot add exit {name}: the model already has names {clash}")
        elem, shape = shapes.get(point, (onnx.TensorProto.FLOAT, None))
        source = point
        nodes: list[onnx.NodeProto] = []
        if elem != onnx.TensorProto.FLOAT:
            nodes.append(
                helper.make_node("Cast", [point], [f"{prefix}_cast"], to=onnx.TensorProto.FLOAT)
            )
            source = f"{prefix}_cast"
        rank = len(shape) if shape is not None else 4
        flat = f"{prefix}_flat"
        if rank == 4 and head.grid > 1:
            if shape is None or not isinstance(shape[2], int) or not isinstance(shape[3], int):
                raise ModelError(f"exit point {point!r} needs a static height and width to pool")
            kernel = [shape[2] // head.grid, shape[3] // head.grid]
            nodes.append(
                helper.make_node(
                    "AveragePool", [source], [f"{prefix}_pool"], kernel_shape=kernel, strides=kernel
                )
            )
            nodes.append(helper.make_node("Flatten", [f"{prefix}_pool"], [flat], axis=1))
        elif rank == 4:
            nodes.append(helper.make_node("GlobalAveragePool", [source], [f"{prefix}_pool"]))
            nodes.append(helper.make_node("Flatten", [f"{prefix}_pool"], [flat], axis=1))
        elif rank == 3:
            if opset >= 18:
                axes = numpy_helper.from_array(np.array([1], dtype=np.int64), f"{prefix}_axes")
                grafted.graph.initializer.append(axes)
                nodes.append(
                    helper.make_node("ReduceMean", [source, axes.name], [flat], keepdims=0)
                )
            else:
                nodes.append(helper.make_node("ReduceMean", [source], [flat], axes=[1], keepdims=0))
        else:
            flat = source
        grafted.graph.initializer.append(numpy_helper.from_array(weight, f"{prefix}_w"))
        grafted.graph.initializer.append(numpy_helper.from_array(bias, f"{prefix}_b"))
        nodes.append(
            helper.make_node("Gemm", [flat, f"{prefix}_w", f"{prefix}_b"], [f"{prefix}_logits"])
        )
        nodes.append(helper.make_node("Softmax", [f"{prefix}_logits"], [name], axis=-1))
        grafted.graph.node.extend(nodes)
        output = helper.make_tensor_value_info(
            name, onnx.TensorProto.FLOAT, [None, weight.shape[1]]
        )
        output.type.tensor_type.shape.dim[0].CopyFrom(batch_dim)
        grafted.graph.output.append(output)
        taken |= new
    _check(grafted, "the model with exit heads")
    return grafted


# --- calibration ------------------------------------------------------------------------


def calibrate(
    probabilities: Sequence[np.ndarray],
    reference: np.ndarray,
    labels: np.ndarray | None,
    *,
    metric: str = "disagreement",
    target: float = DEFAULT_TARGET,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Choose thresholds for exits taken in order (see [Note: exit calibration]).

    ``probabilities[k]`` are exit k's class probabilities [rows, classes] on held-out
    data, ``reference`` the full model's predicted classes. Returns one ``{"threshold",
    "calibration"}`` per exit and the overall summary. Pure: no I/O, deterministic.
    """
    rows = len(reference)
    if metric not in ("disagreement", "accuracy_drop"):
        raise UsageError(f"unknown exit metric {metric!r}")
    if metric == "accuracy_drop" and labels is None:
        raise InputError("an accuracy-drop target needs labels")
    remaining = np.ones(rows, dtype=bool)
    answer = reference.copy()
    results: list[dict[str, Any]] = []
    for probs in probabilities:
        confidence = probs.max(axis=1)
        predicted = probs.argmax(axis=1)
        if metric == "disagreement":
            cost = (predicted != reference).astype(np.float64)
        else:
            assert labels is not None
            cost = (reference == labels).astype(np.float64) - (predicted == labels)
        threshold = _lowest_threshold(confidence[remaining], cost[remaining], target)
        leaving = remaining & (confidence >= threshold)
        count = int(leaving.sum())
        answer[leaving] = predicted[leaving]
        remaining &= ~leaving
        results.append(
            {
                "threshold": threshold,
                "calibration": {
                    "metric": metric,
                    "target": target,
                    "achieved": float(cost[leaving].mean()) if count else 0.0,
                    "exit_rate": count / rows if rows else 0.0,
                    "exited": count,
                    "samples": rows,
                },
            }
        )
    summary = {"metric": metric, "target": target, "samples": rows}
    summary["disagreement"] = float((answer != reference).mean()) if rows else 0.0
    if labels is not None:
        summary["accuracy_full"] = float((reference == labels).mean()) if rows else 0.0
        summary["accuracy_with_exits"] = float((answer == labels).mean()) if rows else 0.0
    summary["achieved"] = (
        summary["disagreement"]
        if metric == "disagreement"
        else summary["accuracy_full"] - summary["accuracy_with_exits"]
    )
    summary["exit_rate"] = float(1.0 - remaining.mean()) if rows else 0.0
    return results, summary


def _lowest_threshold(confidence: np.ndarray, cost: np.ndarray, target: float) -> float:
    """Lowest confidence level whose leavers (confidence >= it) cost at most ``target``.

    The cost is counted with one pseudo-miss, ``(misses + 1) / (leavers + 1)``, so that a
    few lucky leavers cannot set a threshold: certifying 1% takes about 100 held-out
    requests at an exit (see [Note: exit calibration]).
    """
    if len(confidence) == 0:
        return NEVER
    order = np.argsort(-confidence, kind="stable")
    conf = confidence[order]
    mean_cost = (np.cumsum(cost[order]) + 1.0) / np.arange(2, len(conf) + 2)
    # Only prefixes ending where the confidence changes are thresholds (ties leave together).
    boundary = np.append(conf[1:] != conf[:-1], True)
    ok = np.flatnonzero(boundary & (mean_cost <= target + 1e-12))
    if len(ok) == 0:
        return NEVER
    return float(conf[ok[-1]])


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


def _check(model: onnx.ModelProto, what: str) -> None:
    try:
        onnx.checker.check_model(model)
    except onnx.checker.ValidationError as exc:
        raise ModelError(f"{what} is not a valid ONNX model: {exc}") from exc


def _infer(model: onnx.ModelProto) -> onnx.ModelProto:
    try:
        return onnx.shape_inference.infer_shapes(model)
    except Exception as exc:
        raise ModelError(f"shape inference failed on the model: {exc}") from exc


def _value_shapes(model: onnx.ModelProto) -> dict[str, tuple[int, tuple[int | str, ...] | None]]:
    values = [*model.graph.input, *model.graph.value_info, *model.graph.output]
    shapes: dict[str, tuple[int, tuple[int | str, ...] | None]] = {}
    for value in values:
        tensor = value.type.tensor_type
        dims = None
        if tensor.HasField("shape"):
            dims = tuple(
                d.dim_value if d.HasField("dim_value") else d.dim_param for d in tensor.shape.dim
            )
        shapes[value.name] = (tensor.elem_type, dims)
    return shapes


def _all_names(model: onnx.ModelProto) -> set[str]:
    graph = model.graph
    names = {i.name for i in graph.input} | {i.name for i in graph.initializer}
    for node in graph.node:
        names.update(node.output)
    return names


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


def _prepare(
    model: onnx.ModelProto, arrays: Mapping[str, np.ndarray], what: str
) -> CalibrationData:
    """Check ``arrays`` against the model's inputs and merge request and batch axes."""
    initializers = {i.name for i in model.graph.initializer}
    inputs = [i for i in model.graph.input if i.name not in initializers]
    missing = [i.name for i in inputs if i.name not in arrays]
    if missing:
        raise InputError(f"{what} lacks model inputs {missing}: found arrays {sorted(arrays)}")
    rows: dict[str, np.ndarray] = {}
    requests = None
    for item in inputs:
        array = np.asarray(arrays[item.name])
        dims = item.type.tensor_type.shape.dim
        if array.ndim != len(dims) + 1:
            raise InputError(
                f"{what} array {item.name!r} has shape {list(array.shape)}: expected a request "
                f"axis followed by the model input's {len(dims)} dimensions"
            )
        for axis, dim in enumerate(dims):
            if dim.HasField("dim_value") and axis > 0 and array.shape[axis + 1] != dim.dim_value:
                raise InputError(
                    f"{what} array {item.name!r} has shape {list(array.shape)}: dimension "
                    f"{axis} of each request must be {dim.dim_value}"
                )
        if requests is not None and array.shape[0] != requests:
            raise InputError(f"{what} arrays hold different numbers of requests")
        requests = array.shape[0]
        dtype = onnx.helper.tensor_dtype_to_np_dtype(item.type.tensor_type.elem_type)
        rows[item.name] = np.ascontiguousarray(
            array.reshape(-1, *array.shape[2:]).astype(dtype, copy=False)
        )
    if not rows or requests == 0:
        raise InputError(f"{what} holds no requests")
    labels = arrays.get("labels")
    total = len(next(iter(rows.values())))
    if labels is not None:
        labels = np.asarray(labels).reshape(-1).astype(np.int64)
        if len(labels) != total:
            raise InputError(
                f"{what} has {len(labels)} labels for {total} examples: expected one per example"
            )
    return CalibrationData(rows, labels)


def _probabilities(scores: np.ndarray) -> np.ndarray:
    """Rows as probabilities, the way the runtime reads an exit ([Note: exit confidence])."""
    values = np.asarray(scores, dtype=np.float64).reshape(len(scores), -1)
    sums = values.sum(axis=1)
    if (values >= 0).all() and (values <= 1).all() and np.allclose(sums, 1.0, atol=1e-3):
        return values
    shifted = np.exp(values - values.max(axis=1, keepdims=True))
    return shifted / shifted.sum(axis=1, keepdims=True)


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
