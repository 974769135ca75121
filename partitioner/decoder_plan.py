"""Planning a decoder: profile both points, rank with the decoder cost model, split, verify, write.

The glue around the pure parts, as :mod:`.planner` is for other models: profiles come
from this machine (:func:`decoder_profiles`), the ranking from :mod:`.decoder_cost`, the
segments from :func:`~.decoder_graph.split_decoder`, and the split is checked by a short
greedy generation through the chained segments against the whole model, bit for bit
(:func:`~.state_verify.verify_decoder`).

[Note: half precision splits]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
ONNX Runtime's CPU kernels compute most fp16 nodes in fp32 (it puts Casts around them
and drops the Cast pairs between two such nodes), so inside the whole model a chain of
them rounds to fp16 only where a tensor leaves the graph or meets a node with an fp16
kernel. A cut sends the model's type, fp16, and so adds a rounding the whole model does
not have: an fp16 decoder split anywhere but next to such a node (the embedding's
Gather) differs from the whole model in the last bits of its logits (measured on a
3-block tiny decoder: up to 1e-3). The plan's check of an fp16 decoder therefore asks
for the same greedy tokens at every step (``same_tokens``) and reports how far the
logits moved (``max_abs_diff``); int8 and 4-bit decoders (their activations fp32)
stay bit for bit, like fp32 ones.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tierflow.errors import PlanError, UsageError
from tierflow.link.spec import LINKS, TIERS
from tierflow.partitioner.cost import Problem
from tierflow.partitioner.decoder_cost import (
    DecoderEstimate,
    DecoderResult,
    decoder_search,
    decoder_tables,
)
from tierflow.partitioner.decoder_graph import DecoderGraph, split_decoder
from tierflow.partitioner.fidelity import FidelityScore
from tierflow.partitioner.planner import (
    DEFAULT_EMULATION,
    PlanOptions,
    codec_candidates,
    complete_profiles,
    ensure_codecs,
    estimate_dict,
)
from tierflow.partitioner.profile import Profile, ProgressFn
from tierflow.partitioner.split import save_split_plan
from tierflow.partitioner.state_verify import StatefulCheck, chain_step, verify_decoder, whole_step
from tierflow.plan import Plan

logger = logging.getLogger(__name__)

#: The split is checked on a greedy generation of this many tokens from a prompt this long.
VERIFY_TOKENS = 8
VERIFY_PROMPT = 6


@dataclass(frozen=True)
class DecoderProfiles:
    """One profile per tier at each point ([Note: decoder analysis points])."""

    prefill: Mapping[str, Profile]
    decode: Mapping[str, Profile]


@dataclass(frozen=True)
class DecoderOutcome:
    """The written decoder plan, the ranking it came from and the check of its split."""

    plan: Plan
    plan_dir: Path
    result: DecoderResult
    check: StatefulCheck | None
    notes: tuple[str, ...]


def decoder_profiles(
    graph: DecoderGraph,
    *,
    emulation: Mapping[str, float] = DEFAULT_EMULATION,
    threads: int = 1,
    time_budget_s: float = 10.0,
    progress: ProgressFn | None = None,
    codecs: Sequence[str] = ("raw",),
) -> tuple[DecoderProfiles, list[str]]:
    """Profile the decoder here at both points, each tier emulated slower."""
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
    return DecoderProfiles(profiles["prefill"], profiles["decode"]), notes


def decoder_codecs(options: PlanOptions) -> tuple[str, ...]:
    """The lossless codecs a decoder plan may use: a lossy budget is measured per request,
    and a decoder's error would compound over the tokens of a generation."""
    if not options.fidelity.lossless_only:
        raise UsageError(
            f"--fidelity {options.fidelity} is not available for decoders: plan them exact "
            "(lossless codecs), as every token's error would feed the next"
        )
    if options.images:
        raise UsageError("--image-input does not apply to a decoder: its inputs are token ids")
    return codec_candidates(options.codec, options.fidelity)


def rank_decoder(
    graph: DecoderGraph, profiles: DecoderProfiles, options: PlanOptions
) -> tuple[DecoderResult, list[str]]:
    """Score every decoder plan; pure apart from measuring codecs the profiles lack."""
    codecs = decoder_codecs(options)
    prefill, decode = dict(profiles.prefill), dict(profiles.decode)
    notes = ensure_codecs(graph.prefill, prefill, codecs)
    notes += ensure_codecs(graph.decode, decode, codecs)

    def problem(tiers: Mapping[str, Profile]) -> Problem:
        return Problem(
            profiles=tiers,
            links=options.links,
            memory=options.memory,
            objective=options.objective,
            codecs=codecs,
        )

    tables = decoder_tables(
        problem(prefill),
        problem(decode),
        max_tokens=graph.settings.max_tokens,
        state_bytes=graph.state_bytes(),
        sampled=graph.settings.sampled,
    )
    result = decoder_search(tables, top=options.top, context=graph.settings.context)
    return result, sorted(set(notes))


def decoder_estimate_dict(
    graph: DecoderGraph, chosen: DecoderEstimate, objective: str
) -> dict[str, Any]:
    """``plan.json``'s ``estimate`` for a decoder: the step's breakdown and the generation's."""
    data = estimate_dict(chosen.step, graph.decode, objective)
    data["decoder"] = {
        **graph.settings.to_dict(),
        "points": {p.name: {"seq": p.seq, "past": p.past} for p in graph.points},
        **chosen.to_dict(),
    }
    data["latency_s"] = chosen.generation_s
    return data


def verify_decoder_split(graph: DecoderGraph, segments: Sequence[Any]) -> StatefulCheck:
    """A short greedy generation through the chained segments against the whole model."""
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(0, graph.decoder.vocab, VERIFY_PROMPT)]
    outputs = [o.name for o in graph.source.graph.output]
    tokens = min(VERIFY_TOKENS, graph.settings.context - len(prompt) + 1)
    return verify_decoder(
        whole_step(graph.source),
        chain_step(segments),
        graph.decoder,
        graph.states,
        outputs,
        prompt,
        tokens,
    )


def half_precision(graph: DecoderGraph) -> bool:
    """Whether the decoder computes in fp16 ([Note: half precision splits])."""
    return any(t.dtype == "float16" for t in graph.prefill.outputs)


def write_decoder_plan(
    graph: DecoderGraph,
    chosen: DecoderEstimate,
    options: PlanOptions,
    plan_dir: str | Path,
    profiles: DecoderProfiles,
) -> tuple[Plan, StatefulCheck | None]:
    """Split the decoder at ``chosen``'s cuts, check the split, write the plan directory."""
    segments = split_decoder(graph, chosen.cuts)
    check = None
    if options.verify:
        check = verify_decoder_split(graph, segments)
        half = half_precision(graph)
        if not (check.bitwise_equal or (half and check.same_tokens)):
            raise PlanError(
                f"the decoder split at cuts {chosen.cuts} does not reproduce the model over "
                f"{check.steps} greedy steps: outputs differ by up to {check.max_abs_diff:g}"
                + (", and so do its tokens" if half else "")
            )
    estimate = decoder_estimate_dict(graph, chosen, options.objective)
    estimate["tiers"] = {t: profiles.decode[t].machine.to_dict() for t in TIERS}
    fidelity = None
    if check is not None:
        estimate["verified"] = check.to_dict()
        fidelity = FidelityScore("exact", 1.0, check.steps, True, str(options.fidelity))
    plan = save_split_plan(
        graph.prefill,
        segments,
        Path(plan_dir),
        cuts=chosen.cuts,
        codec={name: chosen.step.links[name].codec for name in LINKS},
        links=options.links,
        estimate=estimate,
        fidelity=fidelity.to_dict() if fidelity is not None else None,
        decoder=graph.decoder,
    )
    logger.info("[plan] wrote decoder plan %s: cuts %s", plan_dir, chosen.cuts)
    return plan, check


def make_decoder_plan(
    graph: DecoderGraph,
    profiles: DecoderProfiles,
    options: PlanOptions,
    plan_dir: str | Path,
) -> DecoderOutcome:
    """Choose the best decoder plan, split, verify and write it."""
    result, notes = rank_decoder(graph, profiles, options)
    plan, check = write_decoder_plan(graph, result.best, options, plan_dir, profiles)
    return DecoderOutcome(plan, Path(plan_dir), result, check, tuple(notes))
