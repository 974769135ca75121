"""Writing a chosen plan: split the model at its cuts, verify the split, write the directory.

:func:`write_plan` splits (:mod:`.split`, with exits; a decoder's by
:func:`~.decoder_graph.split_decoder`), checks the split against the whole model (bit for
bit; over consecutive requests for a model with state; a greedy generation for a
decoder) and writes ``plan.json`` beside the segments, its ``estimate`` object made by
:func:`estimate_dict`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tierflow.errors import PlanError
from tierflow.link.spec import LINKS, TIERS
from tierflow.partitioner.cost import Estimate
from tierflow.partitioner.decoder_cost import DecoderEstimate
from tierflow.partitioner.decoder_graph import DecoderGraph, split_decoder, verify_decoder_split
from tierflow.partitioner.exits.plan import split_with_exits
from tierflow.partitioner.fidelity import FidelityScore
from tierflow.partitioner.fidelity_search import lossy_crossings
from tierflow.partitioner.graph import ModelGraph
from tierflow.partitioner.plan_options import Planned, PlanOptions
from tierflow.partitioner.split import Segment, VerifyResult, save_split_plan, verify_split
from tierflow.partitioner.state_verify import StatefulCheck, verify_stream_split
from tierflow.partitioner.tier_profiles import DecoderProfiles, Profiles
from tierflow.plan import Plan
from tierflow.runtime.batching import unpaddable
from tierflow.state.spec import DecoderSpec, StateSpec

logger = logging.getLogger(__name__)


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
            "batching": batching_dict(graph.decoder, graph.states),
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


def batching_dict(decoder: DecoderSpec, states: Sequence[StateSpec]) -> dict[str, str]:
    """How the tiers may batch the decoder's steps of different sessions, and what each
    way costs ([Note: batching exactness] in tierflow/runtime/batching.py): the exact
    default, and ``--batch-padding`` where the decoder has what it pads (an attention
    mask, and every state a KV cache: :func:`~tierflow.runtime.batching.unpaddable`, as
    the tiers decide it)."""
    refused = unpaddable(decoder.attention_mask, states)
    if refused is not None:
        padding = f"does not apply: {refused}"
    else:
        padding = (
            "opt-in (serve --batch-padding): steps of different past lengths also share a "
            "call, left-padded to the longest; each pays for the padding's compute, and its "
            "logits differ from its step alone (about 3e-6), so greedy tokens can differ; "
            "only for decoders whose mask covers cache positions, as Hugging Face's do"
        )
    return {
        "exact": "steps of the same past and step length share one call (serve --max-batch, "
        "--batch-delay), each answered bit for bit as alone",
        "padding": padding,
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


def check_split(
    graph: ModelGraph, segments: Sequence[Segment], cuts: tuple[int, int]
) -> VerifyResult:
    """Check the split on one input bit for bit against the whole model, or raise
    :class:`PlanError` (one plan here, every plan of a set in :mod:`.plan_sets`)."""
    check = verify_split(graph, segments)
    if not check.bitwise_equal:
        raise PlanError(
            f"the split at cuts {cuts} does not reproduce the model: outputs differ "
            f"by up to {check.max_abs_diff:g}"
        )
    return check


def _verify(graph: Planned, segments: Sequence[Segment], cuts: tuple[int, int]) -> StatefulCheck:
    """Check the split against the whole model, or raise :class:`PlanError`.

    A model with state carries it over consecutive requests; a decoder generates greedily.
    """
    if isinstance(graph, DecoderGraph):
        return verify_decoder_split(graph, segments, cuts)
    check = check_split(graph, segments, cuts)
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
        step = chosen.step if isinstance(chosen, DecoderEstimate) else chosen
        if fidelity is None and not lossy_crossings(step):
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
