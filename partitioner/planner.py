"""From a model and its profiles to a plan directory: the glue around the pure search.

:func:`make_plan` loads nothing and measures nothing itself beyond what it is asked
to: it takes the analysed graph and one profile per tier, scores every plan
(:mod:`.search`), splits the model at the chosen cuts (:mod:`.split`), checks the split
against the whole model, and writes ``plan.json`` with the segments. Tiers that come
without a profile are profiled on this machine first (:func:`complete_profiles`),
emulated as slower machines, and the result says so.

The fidelity budget (:mod:`.fidelity`) decides which codecs are candidates: ``exact``,
the default, only lossless ones; a lossy budget lets the lossy codecs in, each measured
end to end on the sample as the search needs it (:mod:`.fidelity_search`), and the
chosen plan is measured on the whole sample and recorded in ``plan.json``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from tierflow.codec.base import PLANNER_CODECS, CodecSpec, CodecStats, ImageNorm
from tierflow.errors import PlanError, UsageError
from tierflow.link.spec import LINKS, TIERS, LinkSpec
from tierflow.partitioner.cost import (
    Estimate,
    ExitPoint,
    Problem,
    build_tables,
    estimate,
    with_state_memory,
)
from tierflow.partitioner.decoder_cost import (
    DecoderEstimate,
    at_batch,
    batch_sizes,
    decoder_search,
    decoder_tables,
)
from tierflow.partitioner.decoder_graph import (
    DecoderGraph,
    check_batches,
    load_batched_decode,
    split_decoder,
    verify_decoder_split,
)
from tierflow.partitioner.exits.plan import exit_points, split_with_exits
from tierflow.partitioner.fidelity import (
    EXACT,
    FidelityBudget,
    FidelityScore,
    check_sample_size,
    confidence_warning,
)
from tierflow.partitioner.fidelity_probe import FidelityProbe, sample_requests
from tierflow.partitioner.fidelity_search import search_within_budget
from tierflow.partitioner.graph import ModelGraph
from tierflow.partitioner.image_inputs import (
    IMAGE_CANDIDATES,
    measure_image_codecs,
    measured_requests,
    outside_pixels,
    png_is_exact,
)
from tierflow.partitioner.profile import (
    Profile,
    ProgressFn,
    capture_features,
    measure_cut_codecs,
    profile_model,
    with_codecs,
)
from tierflow.partitioner.search import SearchResult, search
from tierflow.partitioner.split import Segment, save_split_plan, verify_split
from tierflow.partitioner.state_verify import (
    StatefulCheck,
    unit_state_bytes,
    verify_stream_split,
)
from tierflow.plan import Plan
from tierflow.units import format_duration

logger = logging.getLogger(__name__)

# How much slower than this machine tiers without a profile are emulated to be.
DEFAULT_EMULATION: dict[str, float] = {"device": 4.0, "edge": 2.0, "cloud": 1.0}
DEFAULT_LINKS: dict[str, str] = {"device-edge": "20mbit,10ms", "edge-cloud": "200mbit,30ms"}


@dataclass(frozen=True)
class PlanOptions:
    """What the user asked for, parsed and checked (see ``tierflow plan --help``)."""

    links: Mapping[str, LinkSpec]
    memory: Mapping[str, int] = field(default_factory=dict)
    objective: str = "latency"
    codec: str = "auto"
    verify: bool = True
    top: int = 5
    fidelity: FidelityBudget = EXACT
    images: Mapping[str, ImageNorm] = field(default_factory=dict)

    def problem(
        self,
        profiles: Mapping[str, Profile],
        codecs: tuple[str, ...],
        exits: tuple[ExitPoint, ...] = (),
    ) -> Problem:
        """What the search scores plans against: these options with ``profiles``."""
        return Problem(
            profiles=profiles,
            links=self.links,
            memory=self.memory,
            objective=self.objective,
            codecs=codecs,
            exits=exits,
        )


@dataclass(frozen=True)
class DecoderProfiles:
    """A decoder's profiles: one per tier at each of its points ([Note: decoder analysis
    points] in :mod:`.decoder_points`), and with ``plan --sessions`` at each batch size
    of the decode step measured beyond 1 ([Note: pricing batched steps] in
    :mod:`.decoder_cost`)."""

    prefill: Mapping[str, Profile]
    decode: Mapping[str, Profile]
    batched: Mapping[int, Mapping[str, Profile]] = field(default_factory=dict)

    def by_batch(self, tier: str) -> dict[int, Profile]:
        """``tier``'s decode-step profile at each measured batch size, 1 included."""
        return {1: self.decode[tier], **{b: p[tier] for b, p in self.batched.items()}}

    def step_s_by_batch(self) -> dict[int, float]:
        """The whole model's decode step on this machine at each measured batch size."""
        return {
            batch: profile.emulate(1.0).segment_s(0, len(profile.units))
            for batch, profile in self.by_batch("cloud").items()
        }


#: What a plan is priced from: one profile per tier, or a decoder's at both points.
Profiles = Mapping[str, Profile] | DecoderProfiles
#: What the planner plans: an analysed model, or a decoder analysed at its two points.
Planned = ModelGraph | DecoderGraph


def codec_candidates(
    codec: str, fidelity: FidelityBudget | None = None, images: Collection[str] = ()
) -> tuple[str, ...]:
    """The codecs the search may choose from: the planner codecs for ``auto``, else one.

    With image inputs (their names in ``images``) ``auto`` adds the image codecs
    (:data:`~.image_inputs.IMAGE_CANDIDATES`). Under the ``exact`` budget (the default;
    ``None`` means any budget) only bit-exact codecs are candidates, and ``png``, which
    :func:`rank` keeps only where it reproduces the sample bit for bit: ``auto`` picks
    among ``raw`` and ``zstd`` (and ``png``), and naming a lossy codec is a usage error
    that asks for a budget.
    """
    if codec == "auto":
        candidates = PLANNER_CODECS + (IMAGE_CANDIDATES if images else ())
    else:
        spec = CodecSpec.parse(codec)
        if spec.image and not images:
            raise UsageError(
                f"codec {spec} sends image inputs as images: name them with --image-input"
            )
        candidates = (str(spec),)
    if fidelity is not None and fidelity.lossless_only:
        lossy = [c for c in candidates if not CodecSpec.parse(c).bit_exact and c != "png"]
        if codec != "auto" and lossy:
            raise UsageError(
                f"codec {lossy[0]} is lossy, and the fidelity budget is exact (the default): "
                "state one with --fidelity top1=P% or rel=E and --sample IN.npz, or use a "
                "lossless codec (raw, zstd, shuffle+zstd)"
            )
        candidates = tuple(c for c in candidates if c not in lossy)
    return candidates


def complete_profiles(
    graph: ModelGraph,
    given: Mapping[str, Profile],
    *,
    emulation: Mapping[str, float] = DEFAULT_EMULATION,
    threads: int = 1,
    time_budget_s: float = 20.0,
    progress: ProgressFn | None = None,
    codecs: Sequence[str] = PLANNER_CODECS,
) -> tuple[dict[str, Profile], list[str]]:
    """One profile per tier: the given ones, the rest measured here once and emulated.

    ``codecs`` are those measured at each cut: the candidates (:func:`codec_candidates`)
    are enough, image codecs are measured apart. Returns the profiles and one note per
    tier profiled here, for the user.
    """
    for tier, profile in given.items():
        if tier not in TIERS:
            raise UsageError(f"unknown tier {tier!r}: expected one of {', '.join(TIERS)}")
        profile.check_model(graph, where=f"the {tier} profile")
    profiles = dict(given)
    missing = [t for t in TIERS if t not in profiles]
    notes: list[str] = []
    if missing:
        base = profile_model(
            graph,
            threads=threads,
            time_budget_s=time_budget_s,
            progress=progress,
            codecs=[c for c in codecs if not CodecSpec.parse(c).image],
        )
        for tier in missing:
            slowdown = emulation.get(tier, 1.0)
            profiles[tier] = base.emulate(slowdown)
            notes.append(
                f"{tier}: no profile given, profiled on this machine "
                f"({profiles[tier].machine.describe()})"
            )
    return profiles, notes


def decoder_profiles(
    graph: DecoderGraph,
    *,
    emulation: Mapping[str, float] = DEFAULT_EMULATION,
    threads: int = 1,
    time_budget_s: float = 10.0,
    progress: ProgressFn | None = None,
    codecs: Sequence[str] = ("raw",),
) -> tuple[DecoderProfiles, list[str]]:
    """:func:`complete_profiles` for a decoder: every tier profiled here at both points,
    and with ``--sessions`` the decode step at several batch sizes."""
    check_batches(graph, graph.settings.sessions or 1)
    profiles = {}
    said: list[str] = []
    for name, analysed in (("prefill", graph.prefill), ("decode", graph.decode)):
        profiles[name], lines = complete_profiles(
            analysed,
            {},
            emulation=emulation,
            threads=threads,
            time_budget_s=time_budget_s,
            progress=progress,
            codecs=codecs,
        )
        said += [line for line in lines if line not in said]
    prefill, decode = graph.points
    where = (
        f" at the prefill point (seq {prefill.seq}, past {prefill.past}) and the decode point "
        f"(seq {decode.seq}, past {decode.past})"
    )
    notes = [line + where for line in said]
    sessions = graph.settings.sessions
    batched: dict[int, dict[str, Profile]] = {}
    for batch in batch_sizes(sessions or 1)[1:]:
        batched[batch], _ = complete_profiles(
            load_batched_decode(graph, batch),
            {},
            emulation=emulation,
            threads=threads,
            time_budget_s=time_budget_s,
            progress=progress,
            codecs=codecs,
        )
    profiled = DecoderProfiles(profiles["prefill"], profiles["decode"], batched)
    if sessions is not None:
        steps = ", ".join(
            f"{batch}: {format_duration(s)}" for batch, s in profiled.step_s_by_batch().items()
        )
        notes.append(
            f"decode step profiled here at batch {', '.join(map(str, batch_sizes(sessions)))} "
            f"for {sessions} sessions (the whole model on this machine, by batch: {steps})"
        )
    return profiled, notes


def ensure_codecs(
    graph: ModelGraph, profiles: dict[str, Profile], codecs: Sequence[str]
) -> list[str]:
    """Measure codecs a profile lacks (like ``zstd:9``) on this machine's features.

    Such figures are this machine's, scaled by each profile's slowdown: an estimate for
    a profile made elsewhere, and the note says so. Image codecs are measured apart
    (:func:`_ensure_image_codecs`).
    """
    lacking = sorted(
        {
            c
            for p in profiles.values()
            for c in codecs
            if (c not in p.codecs or _skipped_without_stand_in(p, c, codecs))
            and not CodecSpec.parse(c).image
        }
    )
    if not lacking:
        return []
    features = capture_features(graph)
    base = measure_cut_codecs(graph, features, lacking)
    for tier, profile in profiles.items():
        kept = replace(
            profile,
            cuts=tuple(
                replace(cut, codecs={k: v for k, v in cut.codecs.items() if k not in lacking})
                for cut in profile.cuts
            ),
        )
        profiles[tier] = with_codecs(kept, _scaled(base, profile.slowdown))
    return [f"codec {', '.join(lacking)}: not in the profiles, measured on this machine"]


def _skipped_without_stand_in(profile: Profile, codec: str, codecs: Sequence[str]) -> bool:
    """Whether ``profile`` skipped ``codec`` at some cut ([Note: codec pruning]) while the
    codec that stood in for it there is no candidate now (``--codec drop+zstd``, say)."""
    if not any(math.isinf(cut.codecs[codec].encode_s_per_mb) for cut in profile.cuts):
        return False
    spec = CodecSpec.parse(codec)
    stand_ins = {
        str(replace(spec, drop=False)),
        str(replace(spec, sparse=False)),
        str(replace(spec, drop=False, sparse=False)),
    } - {codec}
    return not stand_ins & set(codecs)


def _ensure_image_codecs(
    graph: ModelGraph,
    profiles: dict[str, Profile],
    codecs: Sequence[str],
    images: Mapping[str, ImageNorm],
    requests: Sequence[Mapping[str, np.ndarray]],
) -> list[str]:
    """Measure the image codecs at cut 0 (the model inputs) on the sample's ``requests``.

    Medians over up to ``IMAGE_SAMPLE_LIMIT`` of them ([Note: image codec figures] in
    :mod:`.image_inputs`). They can carry nothing else: at the other cuts they are
    infinitely slow, so the search never puts them there. Scaled by each profile's
    slowdown, as :func:`ensure_codecs` does.
    """
    wanted = [c for c in codecs if CodecSpec.parse(c).image]
    if not wanted:
        return []
    crossing = graph.cuts[0].tensors
    chosen = [requests[i] for i in measured_requests(len(requests))]
    measured = measure_image_codecs(
        [{name: request[name] for name in crossing} for request in chosen], images, wanted
    )
    nowhere = {c: CodecStats(c, 1.0, math.inf, math.inf, math.inf) for c in wanted}
    base: list[dict[str, CodecStats]] = [measured] + [dict(nowhere) for _ in graph.cuts[1:]]
    for tier, profile in profiles.items():
        profiles[tier] = with_codecs(profile, _scaled(base, profile.slowdown))
    notes = []
    for name, norm in images.items():
        share = max(outside_pixels(request[name], norm) for request in chosen)
        if share > 0.01:
            notes.append(
                f"note: {100 * share:.0f}% of image input {name}'s values fall outside what "
                "its normalisation maps 0..255 to: check --image-norm"
            )
    return notes


def _keep_png(
    codecs: tuple[str, ...], options: PlanOptions, probe: FidelityProbe | None
) -> tuple[tuple[str, ...], list[str]]:
    """Under the exact budget, ``png`` stays a candidate only if the sample shows it exact."""
    if not options.fidelity.lossless_only or "png" not in codecs:
        return codecs, []
    if probe is not None and png_is_exact(probe.requests, options.images):
        return codecs, [
            f"png reproduces image input(s) {', '.join(options.images)} bit for bit on all "
            f"{len(probe.requests)} sample requests: an exact candidate"
        ]
    kept = tuple(c for c in codecs if c != "png")
    why = "no --sample to check it on" if probe is None else "it changes the sample's values"
    if not kept:
        raise UsageError(
            f"codec png is exact only for 8-bit pixels, and {why}: state a fidelity budget "
            "or choose a lossless codec"
        )
    return kept, [f"png left out under the exact budget: {why}"]


def _scaled(
    base: Sequence[Mapping[str, CodecStats]], slowdown: float
) -> list[dict[str, CodecStats]]:
    """Codec figures per cut with every time scaled by ``slowdown``."""
    return [
        {
            name: replace(
                stats,
                encode_s_per_mb=stats.encode_s_per_mb * slowdown,
                decode_s_per_mb=stats.decode_s_per_mb * slowdown,
            )
            for name, stats in cut.items()
        }
        for cut in base
    ]


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
    codecs, notes = _keep_png(codecs, options, probe)
    profiles = dict(profiles)
    notes += ensure_codecs(graph, profiles, codecs)
    requests = probe.requests if probe is not None else [graph.representative_inputs()]
    notes += _ensure_image_codecs(graph, profiles, codecs, options.images, requests)
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
    if sessions is not None:
        if options.objective != "throughput":
            raise UsageError(
                f"--sessions {sessions} plans for concurrent sessions: add --objective throughput"
            )
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
    _ensure_image_codecs(graph, profiles, codecs, options.images, [feeds])
    tables = build_tables(options.problem(profiles, codecs, exit_points(graph)[0]))
    if graph.state:
        tables = with_state_memory(tables, unit_state_bytes(graph))
    return estimate(tables, cuts[0], cuts[1], codec)


def estimate_dict(
    best: Estimate | DecoderEstimate, graph: Planned, objective: str
) -> dict[str, Any]:
    """The ``estimate`` object of ``plan.json``: prediction, breakdown and chosen cuts.

    A decoder's is its decode step's, with the generation's (``decoder``) beside it; its
    ``latency_s`` is the generation's.
    """
    if isinstance(best, DecoderEstimate):
        assert isinstance(graph, DecoderGraph)
        data = estimate_dict(best.step, graph.decode, objective)
        data["decoder"] = {
            **graph.settings.to_dict(),
            "points": {p.name: {"seq": p.seq, "past": p.past} for p in graph.points},
            **best.to_dict(),
        }
        data["latency_s"] = best.generation_s
        return data
    assert isinstance(graph, ModelGraph)
    a, b = best.cuts
    return {
        "objective": objective,
        **best.to_dict(),
        "cut_indices": [a, b],
        "cut_tensors": {
            "device-edge": list(graph.cuts[a].tensors) if best.links["device-edge"].used else [],
            "edge-cloud": list(graph.cuts[b].tensors) if best.links["edge-cloud"].used else [],
        },
    }


@dataclass(frozen=True)
class WrittenPlan:
    """A plan directory on disk and how its split was checked.

    ``verify_inputs`` counts the requests it was checked on (for a model with state, one
    after the other, a decoder's the steps of a greedy generation); ``max_abs_diff`` is 0
    unless an fp16 decoder's logits moved ([Note: half precision splits] in
    :mod:`.decoder_graph`).
    """

    plan: Plan
    plan_dir: Path
    verified_bitwise: bool | None
    max_abs_diff: float
    verify_inputs: int
    fidelity: FidelityScore | None = None


@dataclass(frozen=True, kw_only=True)
class PlanOutcome(WrittenPlan):
    """The written plan, the ranking it came from and the notes for the user."""

    result: SearchResult[Any]
    notes: tuple[str, ...] = ()


def _verify(graph: Planned, segments: Sequence[Segment], cuts: tuple[int, int]) -> StatefulCheck:
    """Check the split against the whole model, or raise :class:`PlanError`.

    A model with state carries it over consecutive requests; a decoder generates greedily.
    """
    if isinstance(graph, DecoderGraph):
        return verify_decoder_split(graph, segments, cuts)
    check = verify_split(graph, segments)
    if not check.bitwise_equal:
        raise PlanError(
            f"the split at cuts {cuts} does not reproduce the model: outputs differ "
            f"by up to {check.max_abs_diff:g}"
        )
    if not graph.state:
        return StatefulCheck(True, check.max_abs_diff, 1)
    stream = verify_stream_split(graph, segments)
    if not stream.bitwise_equal:
        raise PlanError(
            f"the split at cuts {cuts} does not carry its state as the model "
            f"does: over {stream.steps} requests outputs differ by up to "
            f"{stream.max_abs_diff:g}"
        )
    return StatefulCheck(True, check.max_abs_diff, stream.steps)


def write_plan(
    graph: Planned,
    profiles: Profiles,
    options: PlanOptions,
    chosen: Estimate | DecoderEstimate,
    plan_dir: str | Path,
    *,
    fidelity: FidelityScore | None = None,
) -> WrittenPlan:
    """Split the model at ``chosen``'s cuts, verify the split, write the plan directory.

    ``chosen`` is usually the search's best plan; the demo and the benchmarks also write
    the baselines (device-only, cloud-only) this way to measure them side by side.
    ``fidelity`` is the plan measured on the sample; without it a verified plan records
    the verification (one input, bit for bit; a decoder's greedy steps).
    """
    if isinstance(graph, DecoderGraph):
        assert isinstance(profiles, DecoderProfiles)
        analysed, tiers, segments = (
            graph.prefill,
            profiles.decode,
            split_decoder(graph, chosen.cuts),
        )
    else:
        assert isinstance(chosen, Estimate) and not isinstance(profiles, DecoderProfiles)
        analysed, tiers, segments = graph, profiles, split_with_exits(graph, chosen)
    check = _verify(graph, segments, chosen.cuts) if options.verify else None
    estimate = estimate_dict(chosen, graph, options.objective)
    estimate["tiers"] = {t: tiers[t].machine.to_dict() for t in TIERS}
    if isinstance(profiles, DecoderProfiles) and profiles.batched:
        measured = profiles.step_s_by_batch().items()
        estimate["decoder"]["batch_step_s"] = {str(b): s for b, s in measured}
    if check is not None:
        estimate["verified"] = (
            check.to_dict()
            if isinstance(graph, DecoderGraph)
            else {
                "bitwise_equal": check.bitwise_equal,
                "inputs": check.steps,
                "max_abs_diff": check.max_abs_diff,
            }
        )
        if fidelity is None and _lossless(chosen):
            fidelity = FidelityScore("exact", 1.0, check.steps, True, str(options.fidelity))
    directory = Path(plan_dir)
    plan = save_split_plan(
        analysed,
        segments,
        directory,
        cuts=chosen.cuts,
        codec={name: chosen.links[name].codec for name in LINKS},
        links=options.links,
        estimate=estimate,
        fidelity=fidelity.to_dict() if fidelity is not None else None,
        images=options.images,
        decoder=graph.decoder if isinstance(graph, DecoderGraph) else None,
    )
    logger.info(
        "[plan] wrote %s: cuts %s, %.3g ms", directory, chosen.cuts, estimate["latency_s"] * 1e3
    )
    if check is None:
        return WrittenPlan(plan, directory, None, 0.0, 1, fidelity)
    return WrittenPlan(
        plan, directory, check.bitwise_equal, check.max_abs_diff, check.steps, fidelity
    )


def _lossless(chosen: Estimate | DecoderEstimate) -> bool:
    return all(CodecSpec.parse(codec).bit_exact for codec in chosen.codec.values())


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
    lossy budget needs one (:func:`rank`). A decoder takes none: its requests are drawn
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
