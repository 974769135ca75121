"""The strategies the benchmark compares, and how each one picks its plan.

Every strategy is a plan in tierflow's own terms: cuts ``a <= b`` (device ``[0, a)``,
edge ``[a, b)``, cloud ``[b, last)``) and a codec per link used. They differ only in how
the plan is chosen, so they are measured by the same code on the same requests:

``device-only``            the whole model on the device; nothing crosses a link.
``cloud-only``             the raw input crosses both links (the edge only forwards);
                           the whole model runs in the cloud.
``cloud-only-compressed``  as cloud-only, the input sent as ``int8+zstd``: images are
                           8-bit to begin with, so this is what a careful client sends.
``single-split``           Neurosurgeon's approach: the best single device|cloud cut by
                           the same cost model restricted to two tiers (edge forwards,
                           no compute there) with raw fp32 features.
``tierflow``               the planner's choice over all cut pairs and its exact codecs
                           (``--codec auto`` under the default ``--fidelity exact``).
``tierflow-budget``        the planner under a stated fidelity budget (``BUDGET``,
                           ``tierflow plan --fidelity top1=99%``) with the image input
                           declared (``--image-input``): JPEG/WebP/PNG on the input and the
                           lossy feature codecs (fp16, int8, int4, int2, sparse, drop) are
                           candidates, each lossy crossing measured end to end on the
                           planner's own sample (``ranking.rank``, :func:`choose_within_budget`).
                           Its row's fidelity is measured on held-out requests.
``tierflow-budget-98``,    as ``tierflow-budget`` under top1=98%, 95% and 90% (``BUDGETS``,
``-95``, ``-90``           trained models only): the rest of tierflow's rate-fidelity front.
``tierflow-budget-100``    as ``tierflow-budget`` under top1=100% (every calibration answer
                           kept): the plan tierflow offers at the highest fidelity level;
                           orientation only, folded from ``bottleneck.py``, whose
                           ``tierflow-budget`` is planned under top1=98%.
``tierflow-budget-90``     as ``tierflow-budget`` under top1=90% (orientation only, from
                           ``bottleneck.py``): the plan for a user who trades some
                           answers for speed.
``tierflow-split``         as ``tierflow-budget`` under ``SPLIT_BUDGET`` (top1=100%: the
                           fidelity the JPEG upload it is compared with keeps on the
                           trained models), on a device that cannot hold the whole
                           model: the planner's device memory budget
                           (``PlanOptions.memory``) is ``SPLIT_MEMORY_FRACTION`` of what
                           the whole model needs there (:func:`device_memory_budget`), so
                           device-only is infeasible and the first layers still fit
                           (trained models only).
``cloud-only-jpeg``,       as cloud-only, the input sent as an 8-bit image (JPEG at
``cloud-only-jpeg-qNN``,   quality 90, the quality sweep at NN, or PNG) with its
``cloud-only-png``         normalisation; image-input models only
                           (``comparison.fidelity.IMAGE_BASELINES``, no cost-model choice).
``tierflow-exits``         tierflow's plan chosen knowing the early exits (the cost model's
                           expected latency, :func:`choose_with_exits`), run with the exits
                           and the edge's feature cache (measured by ``comparison.exit_strategy``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tierflow.codec.base import EXACT_PLANNER_CODECS
from tierflow.link.spec import LinkSpec
from tierflow.partitioner.cost import (
    CostTables,
    Estimate,
    ExitPoint,
    Problem,
    build_tables,
    estimate,
)
from tierflow.partitioner.fidelity import FidelityBudget
from tierflow.partitioner.profile import Profile
from tierflow.partitioner.search import search

STRATEGIES: tuple[str, ...] = (
    "device-only",
    "cloud-only",
    "cloud-only-compressed",
    "single-split",
    "tierflow",
    "tierflow-exits",
)
#: Strategies whose plan comes from the cost model alone (``tierflow-exits`` adds exits).
PLANNED: tuple[str, ...] = STRATEGIES[:-1]
COMPRESSED_INPUT_CODEC = "int8+zstd"
#: The codecs the cost tables hold: tierflow's exact ones, then the compressed baseline's.
TABLE_CODECS: tuple[str, ...] = (*EXACT_PLANNER_CODECS, COMPRESSED_INPUT_CODEC)
RAW = {"device-edge": "raw", "edge-cloud": "raw"}
#: The ``tierflow-budget`` strategy's budget: 99% of requests keep the exact model's top-1
#: answer (``--fidelity top1=99%``; the planner needs at least 100 sample requests for it).
BUDGET = FidelityBudget("top1", 0.99)
#: The budgets tierflow's plans are made under on the trained models, one strategy each:
#: the rate-fidelity front from the exact plan (``tierflow``) down to top1=90%.
BUDGETS: dict[str, FidelityBudget] = {
    "tierflow-budget": BUDGET,
    "tierflow-budget-98": FidelityBudget("top1", 0.98),
    "tierflow-budget-95": FidelityBudget("top1", 0.95),
    "tierflow-budget-90": FidelityBudget("top1", 0.90),
}
#: ``tierflow-split``'s budget: every sample request keeps its top-1 answer, as the JPEG
#: q90 upload does on the trained models' frames (fidelity 1.000), so the split goal
#: compares plans of equal fidelity; a 99% plan missed that on held-out frames (0.98).
SPLIT_BUDGET = FidelityBudget("top1", 1.0)
#: ``tierflow-split``'s device: half the memory the whole model needs on it, so it holds
#: the first layers (and the input's peak) but not every weight.
SPLIT_MEMORY_FRACTION = 0.5


@dataclass(frozen=True)
class Choice:
    """The plan a strategy picked at one link setting, and the cost model's prediction."""

    strategy: str
    cuts: tuple[int, int]
    codec: dict[str, str]
    predicted_s: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "strategy": self.strategy,
            "cuts": list(self.cuts),
            "codec": dict(self.codec),
            "predicted_ms": self.predicted_s * 1e3,
        }


def _choice(strategy: str, est: Estimate) -> Choice:
    full = {"device-edge": "raw", "edge-cloud": "raw"}
    full.update(est.codec)
    return Choice(strategy, est.cuts, full, est.latency_s)


def problem_at(profiles: Mapping[str, Profile], links: Mapping[str, LinkSpec]) -> Problem:
    """The planner's problem at one link setting: no memory budgets, ``TABLE_CODECS``."""
    return Problem(profiles=profiles, links=links, codecs=TABLE_CODECS)


def exact_problem(problem: Problem) -> Problem:
    """``problem`` with only the exact planner codecs: what ``tierflow plan`` searches
    under its default ``--fidelity exact``."""
    return dataclasses.replace(problem, codecs=EXACT_PLANNER_CODECS)


def choose(tables: CostTables) -> dict[str, Choice]:
    """Each cost-model strategy's plan for the link setting of ``tables``."""
    last = tables.last
    compressed = {"device-edge": COMPRESSED_INPUT_CODEC, "edge-cloud": COMPRESSED_INPUT_CODEC}
    splits = [estimate(tables, a, a, RAW) for a in range(last + 1)]
    # Ties go to the later cut (more work kept on the device), as the search does.
    single = min(reversed(splits), key=lambda e: round(e.latency_s, 12))
    return {
        "device-only": _choice("device-only", estimate(tables, last, last, RAW)),
        "cloud-only": _choice("cloud-only", estimate(tables, 0, 0, RAW)),
        "cloud-only-compressed": _choice(
            "cloud-only-compressed", estimate(tables, 0, 0, compressed)
        ),
        "single-split": _choice("single-split", single),
        "tierflow": _choice("tierflow", search(exact_problem(tables.problem), top=1).best),
    }


def choose_with_exits(
    profiles: Mapping[str, Profile], links: Mapping[str, LinkSpec], exits: Sequence[ExitPoint]
) -> Choice:
    """tierflow's plan when the model has early exits: the cost model weighs every plan by
    where requests leave (``Problem.exits``), and predicts the *mean* latency."""
    problem = Problem(
        profiles=profiles, links=links, codecs=EXACT_PLANNER_CODECS, exits=tuple(exits)
    )
    return _choice("tierflow-exits", search(problem, top=1).best)


def choose_at(profiles: Mapping[str, Profile], links: Mapping[str, LinkSpec]) -> dict[str, Choice]:
    return choose(build_tables(problem_at(profiles, links)))


def device_memory_budget(profile: Profile, fraction: float = SPLIT_MEMORY_FRACTION) -> int:
    """``fraction`` of the bytes the whole model needs on one tier, as the cost model counts
    them (every unit's weights plus the largest activation peak of any unit)."""
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"fraction must be in (0, 1), got {fraction}")
    weights = sum(u.weight_bytes for u in profile.units)
    peak = max((u.peak_activation_bytes for u in profile.units), default=0)
    return int(fraction * (weights + peak))


def choose_within_budget(
    graph: Any,
    profiles: Mapping[str, Profile],
    links: Mapping[str, LinkSpec],
    probe: Any,
    images: Mapping[str, Any],
    budget: FidelityBudget = BUDGET,
    *,
    device_memory: int | None = None,
) -> tuple[Choice, list[str]]:
    """``tierflow-budget``'s plan: what ``tierflow plan --fidelity BUDGET --image-input``
    chooses (``ranking.rank`` with the profiles, ``probe`` on the planner's sample).
    With ``device_memory`` (bytes), the device's memory budget too, under
    ``SPLIT_BUDGET``: ``tierflow-split``.

    Returns the plan and the planner's notes (how many lossy crossings it measured).
    """
    from tierflow.partitioner.plan_options import PlanOptions
    from tierflow.partitioner.ranking import rank

    memory = {} if device_memory is None else {"device": device_memory}
    if device_memory is not None:
        budget = SPLIT_BUDGET
    options = PlanOptions(links=links, fidelity=budget, images=dict(images), memory=memory)
    result, notes = rank(graph, profiles, options, probe=probe)
    name = "tierflow-budget" if device_memory is None else "tierflow-split"
    return _choice(name, result.best), notes
