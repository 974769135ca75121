"""What ``tierflow plan`` does differently for a decoder: what it refuses, how it is
analysed and profiled, and the lines that report its plan.

:func:`~tierflow.partitioner.commands.run_plan` plans every model, a decoder too; it
asks here once the graph shows a growing state pair ([Note: state pairs] in
:mod:`tierflow.state.pairs`). onnx and onnxruntime are imported inside.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from typing import Any

from tierflow.errors import PlanError, UsageError
from tierflow.link.spec import TIERS
from tierflow.units import format_duration, format_size


def refuse_for_decoder(args: argparse.Namespace, budget: Any) -> None:
    """Options that do not apply to a decoder, each a one-line error naming why."""
    reasons = [
        (bool(args.profile), "--profile", "tiers are profiled here at the prefill and decode "
         "points"),
        (bool(args.sample), "--sample", "the planner draws token ids and sizes the cache "
         "itself from --prompt-tokens and --max-tokens"),
        (bool(args.shape), "--shape", "seq and past stay symbolic; set the lengths priced "
         "with --prompt-tokens, --max-tokens and --context"),
        (bool(args.adaptive), "--adaptive", "plan sets are made for stateless requests"),
        (bool(args.image_input or args.image_norm), "--image-input", "a decoder's inputs "
         "are token ids"),
        (not budget.lossless_only, f"--fidelity {budget}", "every token's error would feed "
         "the next; decoders are planned exact"),
    ]  # fmt: skip
    if args.sessions is not None and args.objective != "throughput":
        raise UsageError(
            f"--sessions {args.sessions} plans for concurrent sessions' aggregate tokens per "
            "second: add --objective throughput"
        )
    for given, option, why in reasons:
        if given:
            raise UsageError(f"{option} does not apply to a decoder: {why}")


def _refuse_budgets_nothing_fits(graph: Any, memory: Mapping[str, int], context: int) -> None:
    """Budgets on every tier that together hold less than the weights and the KV cache.

    Checked once the graph is read, before profiling (minutes for a large model): no
    split can fit them, whatever the tiers measure. The search still checks each plan.
    """
    if any(tier not in memory for tier in TIERS):
        return
    weights = graph.prefill.weight_bytes(0, len(graph.prefill.cuts) - 1)
    kv = sum(graph.state_bytes())
    total = sum(memory[tier] for tier in TIERS)
    if weights + kv > total:
        limits = ", ".join(f"{tier} {format_size(memory[tier])}" for tier in TIERS)
        raise PlanError(
            f"no plan fits the memory budgets ({limits}; {format_size(total)} in all): the "
            f"model's weights are {format_size(weights)} and its KV cache at --context "
            f"{context} {format_size(kv)}"
        )


def profiled_decoder(
    args: argparse.Namespace,
    settings: Any,
    memory: Mapping[str, int],
    emulation: Mapping[str, float],
    codecs: Sequence[str],
) -> tuple[Any, Any, list[str]]:
    """The decoder at ``args.model`` analysed at its two points and profiled here at both:
    the graph, its profiles and the notes for the user."""
    from tierflow.partitioner.commands import parse_states
    from tierflow.partitioner.decoder_graph import load_decoder
    from tierflow.partitioner.report import Progress
    from tierflow.partitioner.tier_profiles import decoder_profiles

    analysing = Progress("analysing", every_s=0.0)
    try:
        graph = load_decoder(args.model, settings, parse_states(args.state), analysing)
    finally:
        analysing.close()
    _refuse_budgets_nothing_fits(graph, memory, settings.context)
    progress = Progress("profiling here")
    try:
        profiles, notes = decoder_profiles(
            graph, emulation=emulation, threads=args.threads, progress=progress, codecs=codecs
        )
    finally:
        progress.close()
    return graph, profiles, notes


def report_decoder_plan(
    outcome: Any, graph: Any, memory: Mapping[str, int], objective: str
) -> None:
    """Print a decoder plan's ranking, the chosen plan and how its split was checked."""
    from tierflow.partitioner.report import decoder_table

    settings = graph.settings
    kv = sum(graph.state_bytes())
    print(
        f"decoder: {len(graph.states)} state pairs, KV cache {format_size(kv)} at --context "
        f"{settings.context}; prefill of {settings.prompt_tokens} prompt tokens, then "
        f"{settings.max_tokens} tokens one at a time"
    )
    result = outcome.result
    sessions = settings.sessions
    if objective == "latency":
        goal = f"time to first token + {settings.max_tokens - 1} x time per token"
    elif sessions is not None:
        goal = f"the tokens per second of {sessions} sessions, each tier batching their steps"
    else:
        goal = "tokens per second with sessions pipelined"
    print(
        f"\n{result.considered} plans scored for {goal}, {result.feasible} fit the budgets; "
        "compute and link bytes per token, memory per tier with its KV cache:"
    )
    print(decoder_table(result, memory, graph.unit_blocks()))
    best = result.best
    held = ", ".join(
        f"{t} {format_size(best.memory_bytes[t])} (KV {format_size(best.state_bytes[t])})"
        for t in TIERS
        if t in best.tiers
    )
    print(
        f"\nchosen: {' -> '.join(best.tiers)}, predicted time to first token "
        f"{format_duration(best.ttft_s)}, {format_duration(best.per_token_s)} per token "
        f"({best.tokens_per_s:.1f} tokens/s over {settings.max_tokens}); memory {held}"
    )
    if sessions is not None:
        together = f"{sessions} sessions batched" if sessions > 1 else "1 session"
        print(
            f"with {together}: {format_duration(best.session_per_token_s)} per token each, "
            f"{best.aggregate_tokens_per_s:.1f} tokens/s in all (memory above counts "
            f"{sessions} KV cache{'s' if sessions > 1 else ''})"
        )
    steps = outcome.verify_inputs
    if outcome.verified_bitwise is None:
        print("not verified (--no-verify)")
    elif outcome.verified_bitwise:
        print(
            f"verified: chaining the segments reproduces the model bit for bit over "
            f"{steps} greedy steps, each tier's KV cache fed back"
        )
    else:  # an fp16 decoder: [Note: half precision splits] in partitioner/decoder_graph.py
        print(
            f"verified: chaining the segments chooses the model's tokens over {steps} "
            f"greedy steps, each tier's KV cache fed back; its fp16 logits differ by up to "
            f"{outcome.max_abs_diff:g} (ONNX Runtime's CPU kernels round fp16 only where a "
            "tensor leaves a graph)"
        )
