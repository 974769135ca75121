"""Calibrating exit thresholds on held-out data, and reading calibration files.

Pure functions over arrays (:func:`calibrate`), plus the checks that turn a user's
``.npz`` file into rows the model can run (:func:`prepare_data`). Used by
:mod:`tierflow.partitioner.exits.add`.

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
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from tierflow.errors import InputError, UsageError
from tierflow.npz import read_archive

NEVER = 2.0  # a threshold no probability reaches: the exit is disabled
DEFAULT_TARGET = 0.01


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


def load_calibration(path: str | Path) -> dict[str, np.ndarray]:
    """Read a calibration ``.npz`` into a dict of arrays (checked later against a model)."""
    return read_archive(path, "calibration data")


def prepare_data(
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
            cost = (reference == labels).astype(np.float64) - (predicted == labels).astype(
                np.float64
            )
        threshold = lowest_threshold(confidence[remaining], cost[remaining], target)
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
    disagreement = float((answer != reference).mean()) if rows else 0.0
    summary: dict[str, Any] = {"metric": metric, "target": target, "samples": rows}
    summary["disagreement"] = disagreement
    summary["achieved"] = disagreement
    if labels is not None:
        accuracy_full = float((reference == labels).mean()) if rows else 0.0
        accuracy_with_exits = float((answer == labels).mean()) if rows else 0.0
        summary["accuracy_full"] = accuracy_full
        summary["accuracy_with_exits"] = accuracy_with_exits
        if metric == "accuracy_drop":
            summary["achieved"] = accuracy_full - accuracy_with_exits
    summary["exit_rate"] = float(1.0 - remaining.mean()) if rows else 0.0
    return results, summary


def lowest_threshold(confidence: np.ndarray, cost: np.ndarray, target: float) -> float:
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


def probabilities(scores: np.ndarray) -> np.ndarray:
    """Rows as probabilities, the way the runtime reads an exit ([Note: exit confidence])."""
    values = np.asarray(scores, dtype=np.float64).reshape(len(scores), -1)
    sums = values.sum(axis=1)
    if (values >= 0).all() and (values <= 1).all() and np.allclose(sums, 1.0, atol=1e-3):
        return values
    shifted = np.exp(values - values.max(axis=1, keepdims=True))
    return shifted / shifted.sum(axis=1, keepdims=True)
