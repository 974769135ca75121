"""Ranking plans: the cost tables built from the profiles and the options, then the search.

:func:`rank` is pure apart from measuring codecs the profiles lack
(:mod:`.candidates`): it builds the problem (:meth:`~.plan_options.PlanOptions.problem`),
adds early exits and state memory, and runs the search (:mod:`.search`), within a lossy
fidelity budget by measuring candidates on the sample (:mod:`.fidelity_search`), or a
decoder's over a whole generation (:mod:`.decoder_cost`). :func:`score_plan` prices one
given plan the same way, for baselines the search may not choose.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from tierflow.errors import UsageError
from tierflow.link.spec import TIERS
from tierflow.partitioner.candidates import (
    codec_candidates,
    ensure_codecs,
    ensure_image_codecs,
    keep_png,
)
from tierflow.partitioner.cost import Estimate, build_tables, estimate, with_state_memory
from tierflow.partitioner.decoder_cost import (
    DecoderEstimate,
    at_batch,
    decoder_search,
    decoder_tables,
)
from tierflow.partitioner.decoder_graph import DecoderGraph
from tierflow.partitioner.exits.plan import exit_points
from tierflow.partitioner.fidelity import check_sample_size
from tierflow.partitioner.fidelity_probe import FidelityProbe
from tierflow.partitioner.fidelity_search import search_within_budget
from tierflow.partitioner.graph import ModelGraph
from tierflow.partitioner.plan_options import Planned, PlanOptions
from tierflow.partitioner.profile import Profile, ProgressFn
from tierflow.partitioner.search import SearchResult, search
from tierflow.partitioner.state_verify import unit_state_bytes
from tierflow.partitioner.tier_profiles import DecoderProfiles, Profiles


def rank(
    graph: Planned,
    profiles: Profiles,
    options: PlanOptions,
    *,
    probe: FidelityProbe | None = None,
    progress: ProgressFn | None = None,
) -> tuple[SearchResult[Any], list[str]]:
    """Score every plan; pure apart from measuring codecs missing from the profiles.

    A graph from :func:`~tierflow.partitioner.exits.plan.load_planning_graph` brings its
    early exits: the scores are then expectations over where requests leave (fidelity
    is then measured on the trunk: exits keep their own calibrated disagreement). A
    lossy fidelity budget needs a ``probe`` on the sample: the ranking then holds only
    plans whose lossy crossings were measured to meet it (``progress`` follows that).
    A decoder is priced by its own terms, a generation from its two points
    ([Note: pricing a decoder] in :mod:`.decoder_cost`).
    """
    budget = options.fidelity
    stateful = graph.states if isinstance(graph, DecoderGraph) else graph.state
    if stateful and not budget.lossless_only:
        raise UsageError(
            f"--fidelity {budget} is not available for a model with state pairs: a lossy "
            "codec's error would carry over from request to request in the state"
        )
    if not budget.lossless_only and probe is None:
        raise UsageError(
            f"--fidelity {budget} needs --sample IN.npz: lossy codecs are measured end to end "
            "on real inputs"
        )
    codecs = codec_candidates(options.codec, budget, tuple(options.images))
    if isinstance(graph, DecoderGraph):
        assert isinstance(profiles, DecoderProfiles)
        if options.images:
            raise UsageError("--image-input does not apply to a decoder: its inputs are token ids")
        return _rank_decoder(graph, profiles, options, codecs)
    assert not isinstance(profiles, DecoderProfiles)
    codecs, notes = keep_png(codecs, budget, options.images, probe)
    profiles = dict(profiles)
    notes += ensure_codecs(graph, profiles, codecs)
    requests = probe.requests if probe is not None else [graph.representative_inputs()]
    notes += ensure_image_codecs(graph, profiles, codecs, options.images, requests)
    points, exit_notes = exit_points(graph)
    notes += exit_notes
    problem = options.problem(profiles, codecs, points)
    tables = build_tables(problem)
    if graph.state:
        tables = with_state_memory(tables, unit_state_bytes(graph))
    if budget.lossless_only or probe is None:
        return search(problem, top=options.top, tables=tables), notes
    check_sample_size(budget, len(probe.requests))
    budgeted = search_within_budget(
        problem, tables, budget, probe, top=options.top, progress=progress
    )
    verdicts = budgeted.verdicts
    notes.append(
        f"fidelity {budget}: {verdicts.count} lossy candidate(s) measured end to end on "
        f"{len(probe.requests)} sample requests, {budgeted.measured_passed()} met the budget"
    )
    if budgeted.exhausted:
        notes.append(
            "fidelity: stopped measuring after "
            f"{verdicts.count} candidates; lossy crossings not measured were left out"
        )
    return budgeted.result, notes


def _rank_decoder(
    graph: DecoderGraph, profiles: DecoderProfiles, options: PlanOptions, codecs: tuple[str, ...]
) -> tuple[SearchResult[DecoderEstimate], list[str]]:
    """:func:`rank` for a decoder: the search over a whole generation's tables."""
    prefill, decode = dict(profiles.prefill), dict(profiles.decode)
    notes = ensure_codecs(graph.prefill, prefill, codecs)
    notes += ensure_codecs(graph.decode, decode, codecs)
    sessions = graph.settings.sessions
    batched = None
    if sessions is not None:  # --objective throughput: refuse_for_decoder checks it on entry
        at_n = {t: at_batch(profiles.by_batch(t), sessions) for t in TIERS}
        batched = options.problem(at_n, codecs)
    tables = decoder_tables(
        options.problem(prefill, codecs),
        options.problem(decode, codecs),
        max_tokens=graph.settings.max_tokens,
        state_bytes=graph.state_bytes(),
        sampled=graph.settings.sampled,
        batched=batched,
        sessions=sessions,
    )
    result = decoder_search(tables, top=options.top, context=graph.settings.context)
    return result, sorted(set(notes))


def score_plan(
    graph: ModelGraph,
    profiles: Mapping[str, Profile],
    options: PlanOptions,
    cuts: tuple[int, int],
    codec: Mapping[str, str],
    feeds: Mapping[str, np.ndarray],
) -> Estimate:
    """The cost model's prediction for one given plan, outside any fidelity budget.

    For baselines the search may not choose, such as uploading the input as JPEG under
    the exact budget: codecs the profiles lack are measured as :func:`rank` measures
    them (image codecs on ``feeds``, one request).
    """
    codecs = tuple(dict.fromkeys(codec.values()))
    profiles = dict(profiles)
    ensure_codecs(graph, profiles, codecs)
    ensure_image_codecs(graph, profiles, codecs, options.images, [feeds])
    tables = build_tables(options.problem(profiles, codecs, exit_points(graph)[0]))
    if graph.state:
        tables = with_state_memory(tables, unit_state_bytes(graph))
    return estimate(tables, cuts[0], cuts[1], codec)
