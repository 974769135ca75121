"""Where early exits go: the cut tensors that can carry one, and a spread of them over compute.

Pure functions of a :class:`~tierflow.partitioner.graph.ModelGraph`: no I/O. The depth of
a cut is the fraction of the model's estimated compute done before it (multiply-adds of
Conv, Gemm and MatMul from static shapes, or node count when a model has none of those).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import onnx

from tierflow.errors import UsageError

if TYPE_CHECKING:
    from tierflow.partitioner.graph import ModelGraph

logger = logging.getLogger(__name__)


def choose_exit_points(graph: ModelGraph, count: int, fractions: Sequence[float] = ()) -> list[str]:
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


def exit_candidates(graph: ModelGraph) -> list[str]:
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


def _compute_depth(graph: ModelGraph) -> list[float]:
    """Fraction of estimated compute done before each node position (length nodes + 1)."""
    costs = [_node_macs(graph, node) for node in graph.nodes]
    if sum(costs) <= 0:
        costs = [1.0] * len(graph.nodes)
    running = np.concatenate([[0.0], np.cumsum(costs)])
    return list(running / max(running[-1], 1e-12))


def _node_macs(graph: ModelGraph, node: onnx.NodeProto) -> float:
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


def check_exit_points(graph: ModelGraph, points: Sequence[str]) -> None:
    """Refuse repeated points and points that cannot carry an exit (see exit_candidates)."""
    if len(set(points)) != len(points):
        raise UsageError(f"exit points must be distinct, got {list(points)}")
    candidates = exit_candidates(graph)
    for point in points:
        if point not in candidates:
            raise UsageError(
                f"{point!r} cannot carry an exit: expected a one-tensor cut holding a 2-D to "
                f"4-D float feature, one of {', '.join(candidates) or 'none'}"
            )
