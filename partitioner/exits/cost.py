"""What exits save: the expected compute of a model whose requests may leave early.

Pure functions for the planner: per-unit costs and calibrated exit rates in, expected
cost out. How the cost model uses them is [Note: expected cost with early exits] in
:mod:`tierflow.partitioner.cost`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from tierflow.errors import PlanError
from tierflow.partitioner.exits.metadata import ExitInfo

if TYPE_CHECKING:
    from tierflow.partitioner.graph import ModelGraph


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


def exit_cut_indices(graph: ModelGraph, exits: Sequence[ExitInfo]) -> dict[str, int]:
    """Map each exit's name to the index of the one-tensor cut of ``graph`` it reads."""
    by_tensor = {cut.tensors[0]: cut.index for cut in graph.cuts if len(cut.tensors) == 1}
    return {e.name: by_tensor[e.at] for e in exits if e.at in by_tensor}


def exit_skips(graph: ModelGraph, exits: Sequence[ExitInfo]) -> list[tuple[int, float]]:
    """``(first_skipped_unit, exit_rate)`` pairs for :func:`expected_compute`.

    ``graph`` is the analysed model *without* exits, whose units the profiles time;
    exits whose feature is not one of its one-tensor cuts are left out.
    """
    indices = exit_cut_indices(graph, exits)
    return [(indices[e.name], e.exit_rate) for e in exits if e.name in indices]
