"""The cost model for decoders: time to first token, time per token, memory with the KV cache.

Pure, like :mod:`.cost`, whose tables it combines; see [Note: pricing a decoder].

[Note: pricing a decoder]
~~~~~~~~~~~~~~~~~~~~~~~~~
A generation is one prefill and then one step per token, each a request through every
tier with work. Both are priced by :mod:`.cost` on profiles measured at their own point
([Note: decoder analysis points] in :mod:`.decoder_points`):

* *prefill* (the prompt's ``T`` tokens from an empty cache): each tier's compute at the
  prefill point, each used link carrying its cut's tensors at ``T`` (the prompt's hidden
  states plus the model inputs the next tiers rebuild their masks and position tables
  from: [Note: derived tensors stay home] in :mod:`.cuts`) once, a full round trip, and
  the answer back. This is the time to first token (TTFT).
* *a decode step* (one token after a cache of the mean length): the same at the decode
  point; each used link carries one token's hidden state and the companions up, the
  answer down, and pays its full RTT: the per-token time.

The answer is what the runtime sends back (tier.proto: ``Request.keep_last``,
``Request.choices_only``), not the model's logits output: a prefill answers its last
position only, and a greedy generation (the default) answers each position's token
choice, 8 bytes (int64); a sampled one (``plan --sampled``) the last position's logits,
``vocab x 4`` bytes in float32 (:func:`answer_bytes`). With a vocabulary of 32,000 the
logits of a 32-token prompt are 4 MB, its greedy answer 8 bytes. The compute still pays
for the logits of every position, as the model computes them.

The latency objective is the whole generation, ``TTFT + (max_tokens - 1) x per-token``:
the prefill answers the first token and each of the other ``max_tokens - 1`` takes a step
(as ``generate`` counts them: ``ms_per_token`` is over the tokens after the first). The
tables of the two are linear in every part (compute, codec times, wire, RTT), so their
sum weighted by the steps is itself a :class:`~.cost.CostTables` and the search of :mod:`.search`
ranks it unchanged, codecs chosen per link for the whole generation. Under
``--objective throughput`` the decode tables are ranked by their period: a step of one
session waits for the previous token, so a single session gets ``1 / per-token`` tokens
per second, and the pipelined rate (the slowest tier or link of a step) is what
concurrent sessions share.

Memory per tier is its weights, plus the state its blocks keep for one session at
``--context`` (the KV cache: :meth:`~tierflow.state.spec.StateSpec.nbytes`), plus the
larger of its activation peaks at the two points. Cloud-only (the prompt goes up, every
token comes down) and device-only are plans like any other.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from tierflow.errors import PlanError
from tierflow.link.spec import TIERS
from tierflow.partitioner.cost import (
    CostTables,
    Estimate,
    LinkCost,
    LinkTable,
    build_tables,
    estimate,
    spans,
    with_state_memory,
)
from tierflow.partitioner.cost import Problem as CostProblem
from tierflow.partitioner.profile_data import Profile
from tierflow.partitioner.search import SearchResult, search
from tierflow.units import format_size

#: A greedy step's answer: one token choice (int64) for the one position it needs.
CHOICE_BYTES = 8


def answer_bytes(decode: Profile, *, sampled: bool) -> int:
    """What one step answers over each link it used ([Note: pricing a decoder]).

    ``decode`` is profiled at one token (seq 1), so its output cut holds one position's
    logits: what a sampled step needs back; a greedy one needs its choice alone.
    """
    return decode.cuts[-1].nbytes if sampled else CHOICE_BYTES


def _combined_link(prefill: LinkTable, decode: LinkTable, tokens: int) -> LinkTable:
    return LinkTable(
        used=prefill.used | decode.used,
        raw_bytes=prefill.raw_bytes + tokens * decode.raw_bytes,
        bytes=prefill.bytes + tokens * decode.bytes,
        encode_s=prefill.encode_s + tokens * decode.encode_s,
        wire_s=prefill.wire_s + tokens * decode.wire_s,
        decode_s=prefill.decode_s + tokens * decode.decode_s,
        propagation_s=prefill.propagation_s + tokens * decode.propagation_s,
        reply_s=prefill.reply_s + tokens * decode.reply_s,
    )


@dataclass(frozen=True)
class DecoderTables:
    """Prefill, decode-step and whole-generation tables, all with the decoder's memory."""

    prefill: CostTables
    decode: CostTables
    generation: CostTables
    max_tokens: int
    state_bytes: tuple[int, ...]


def decoder_tables(
    prefill: CostProblem,
    decode: CostProblem,
    *,
    max_tokens: int,
    state_bytes: Sequence[int],
    sampled: bool = False,
) -> DecoderTables:
    """Tabulate both points and their sum over a generation; see [Note: pricing a decoder].

    ``sampled``: steps answer one position's logits, not its greedy choice.
    """
    if max_tokens < 1:
        raise PlanError(f"max_tokens must be at least 1, got {max_tokens}")
    steps = max_tokens - 1  # the prefill answers the first token
    answer = answer_bytes(decode.profiles["device"], sampled=sampled)
    prefill = replace(prefill, reply_bytes=answer)
    decode = replace(decode, reply_bytes=answer)
    at_prefill, at_decode = build_tables(prefill), build_tables(decode)
    if prefill.ncuts != decode.ncuts:
        raise PlanError(f"{prefill.ncuts} cuts at the prefill point, {decode.ncuts} at decode")
    # Weights, the larger activation peak of the two points, and the state of one session.
    peaks = {t: np.maximum(at_prefill.memory[t], at_decode.memory[t]) for t in TIERS}
    at_prefill = with_state_memory(replace(at_prefill, memory=peaks), state_bytes)
    memory = at_prefill.memory
    at_decode = replace(at_decode, memory=memory)
    generation = CostTables(
        problem=replace(decode, objective="latency"),
        segment_s={t: at_prefill.segment_s[t] + steps * at_decode.segment_s[t] for t in TIERS},
        memory=memory,
        links={
            name: _combined_link(at_prefill.links[name], at_decode.links[name], steps)
            for name in at_decode.links
        },
    )
    return DecoderTables(at_prefill, at_decode, generation, max_tokens, tuple(state_bytes))


@dataclass(frozen=True)
class DecoderEstimate:
    """One plan of a decoder: its prefill, its decode step, and the generation they make."""

    prefill: Estimate
    step: Estimate
    max_tokens: int
    state_bytes: Mapping[str, int]
    reply_bytes: int = 0  # one step's answer (a choice, or one position's logits) per link

    @property
    def cuts(self) -> tuple[int, int]:
        return self.step.cuts

    @property
    def tiers(self) -> tuple[str, ...]:
        return self.step.tiers

    @property
    def codec(self) -> dict[str, str]:
        return self.step.codec

    @property
    def links(self) -> Mapping[str, LinkCost]:
        """Each link's cost in one decode step."""
        return self.step.links

    @property
    def feasible(self) -> bool:
        return self.step.feasible

    @property
    def memory_bytes(self) -> Mapping[str, int]:
        return self.step.memory_bytes

    @property
    def ttft_s(self) -> float:
        return self.prefill.latency_s

    @property
    def per_token_s(self) -> float:
        return self.step.latency_s

    @property
    def generation_s(self) -> float:
        """TTFT plus a step for each token after the first: what the latency objective
        minimises ([Note: pricing a decoder])."""
        return self.ttft_s + (self.max_tokens - 1) * self.per_token_s

    @property
    def tokens_per_s(self) -> float:
        """Tokens per second of one session over the whole generation."""
        return self.max_tokens / self.generation_s if self.generation_s > 0 else float("inf")

    @property
    def pipelined_tokens_per_s(self) -> float:
        """Tokens per second that concurrent sessions share: one per slowest step stage."""
        return self.step.throughput_rps

    def bytes_per_token(self) -> dict[str, float]:
        """Bytes each link carries per generated token after the prompt, up and down."""
        return {
            name: (cost.bytes + self.reply_bytes) if cost.used else 0.0
            for name, cost in self.step.links.items()
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "ttft_s": self.ttft_s,
            "per_token_s": self.per_token_s,
            "max_tokens": self.max_tokens,
            "generation_s": self.generation_s,
            "tokens_per_s": self.tokens_per_s,
            "pipelined_tokens_per_s": self.pipelined_tokens_per_s,
            "state_bytes": dict(self.state_bytes),
            "bytes_per_token": self.bytes_per_token(),
            "prefill": self.prefill.to_dict(),
            "step": self.step.to_dict(),
        }


def decoder_estimate(
    tables: DecoderTables, a: int, b: int, codec: Mapping[str, str]
) -> DecoderEstimate:
    """The plan ``(a, b)`` with ``codec`` on its links, at both points."""
    span = spans(a, b, tables.decode.last)
    state = np.concatenate([[0], np.cumsum(tables.state_bytes)])
    held = {t: int(state[span[t][1]] - state[span[t][0]]) for t in TIERS}
    return DecoderEstimate(
        prefill=estimate(tables.prefill, a, b, codec),
        step=estimate(tables.decode, a, b, codec),
        max_tokens=tables.max_tokens,
        state_bytes=held,
        reply_bytes=tables.decode.problem.answer_bytes,
    )


def decoder_search(
    tables: DecoderTables, *, top: int = 5, context: int | None = None
) -> SearchResult[DecoderEstimate]:
    """Rank every decoder plan; see [Note: pricing a decoder].

    Raises :class:`PlanError` naming the KV cache when no plan fits the memory budgets.
    """
    objective = tables.decode.problem.objective
    ranked_on = tables.decode if objective == "throughput" else tables.generation
    try:
        result = search(ranked_on.problem, top=top, tables=ranked_on)
    except PlanError as exc:
        total = format_size(float(sum(tables.state_bytes)))
        at = f" at --context {context}" if context is not None else ""
        raise PlanError(
            f"{exc}; each tier counts its weights, its activations and, kept on it with "
            f"their blocks, its state pairs' KV cache{at} ({total} for the whole model)"
        ) from exc

    return result.map(lambda e: decoder_estimate(tables, *e.cuts, e.codec))
