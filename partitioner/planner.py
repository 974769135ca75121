"""From a model and its profiles to a plan directory: the glue around the pure search.

:func:`make_plan` loads nothing and measures nothing itself beyond what it is asked
to: it takes the analysed graph and one profile per tier (:mod:`.tier_profiles`, where
tiers that come without a profile are profiled on this machine first, emulated as slower
machines, and the result says so), ranks every plan (:mod:`.ranking`), and writes the
best one: splits the model at the chosen cuts, checks the split against the whole model,
and writes ``plan.json`` with the segments (:mod:`.plan_writing`).

The fidelity budget (:mod:`.fidelity`) decides which codecs are candidates
(:mod:`.candidates`): ``exact``, the default, only lossless ones; a lossy budget lets
the lossy codecs in, each measured end to end on the sample as the search needs it
(:mod:`.fidelity_search`), and the chosen plan is measured on the whole sample here and
recorded in ``plan.json``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tierflow.errors import PlanError, UsageError
from tierflow.partitioner.decoder_graph import DecoderGraph
from tierflow.partitioner.fidelity import check_sample_size, confidence_warning
from tierflow.partitioner.fidelity_probe import FidelityProbe, sample_requests
from tierflow.partitioner.plan_options import Planned, PlanOptions
from tierflow.partitioner.plan_writing import WrittenPlan, write_plan
from tierflow.partitioner.profile import ProgressFn
from tierflow.partitioner.ranking import rank
from tierflow.partitioner.search import SearchResult
from tierflow.partitioner.tier_profiles import Profiles


@dataclass(frozen=True, kw_only=True)
class PlanOutcome(WrittenPlan):
    """The written plan, the ranking it came from and the notes for the user."""

    result: SearchResult[Any]
    notes: tuple[str, ...] = ()


def make_plan(
    graph: Planned,
    profiles: Profiles,
    options: PlanOptions,
    plan_dir: str | Path,
    *,
    sample: Mapping[str, np.ndarray] | None = None,
    progress: ProgressFn | None = None,
) -> PlanOutcome:
    """Choose the best plan, split the model, verify the split, write the plan directory.

    With a ``sample`` (``IN.npz`` arrays, a leading request axis) the chosen plan is
    measured end to end on every request and ``plan.json`` records its fidelity; a
    lossy budget needs one (:func:`~.ranking.rank`). A decoder takes none: its requests are drawn
    from its vocabulary ([Note: decoder analysis points] in :mod:`.decoder_points`).
    """
    budget = options.fidelity
    probe = None
    if sample is not None:
        if isinstance(graph, DecoderGraph):
            raise UsageError("--sample does not apply to a decoder: the planner draws its tokens")
        requests = sample_requests(graph.inputs, sample)
        check_sample_size(budget, len(requests))
        probe = FidelityProbe(graph, requests, images=options.images)
    result, notes = rank(graph, profiles, options, probe=probe, progress=progress)
    best = result.best
    fidelity = None
    if probe is not None:
        measured = probe.measure(best.cuts, best.codec, budget)
        if not measured.passed:
            raise PlanError(
                f"the chosen plan at cuts {best.cuts} misses the budget {budget} when measured "
                f"as a whole: {measured.score.describe()}"
            )
        fidelity = measured.score
        warning = confidence_warning(budget, fidelity)
        if warning:
            notes.append(warning)
    written = write_plan(graph, profiles, options, best, plan_dir, fidelity=fidelity)
    fields = {f.name: getattr(written, f.name) for f in dataclasses.fields(written)}
    return PlanOutcome(**fields, result=result, notes=tuple(notes))
