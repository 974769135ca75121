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

[Note: pricing batched steps]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``plan --objective throughput --sessions N`` plans for N concurrent sessions whose decode
steps every tier runs as one batch ([Note: the step batcher] in
tierflow/runtime/batching.py). A batched step reads a segment's weights once for all its
rows, so its time grows far slower than N: it is measured, not assumed. The decode point
is analysed again and profiled here at batch 1, 2, 4, ... up to the first power of two
at or above N (:func:`batch_sizes`), the steps stacked on the batch axis; a tier's step
at N is interpolated linearly between the two measured sizes around N, unit by unit
(compute, activation peaks, the bytes crossing each cut; codec figures per MB from the
larger size): :func:`at_batch`, exact at a measured size.

The N sessions move together: each waits for its token before its next step, so the
batch is one request through the tiers, priced by :mod:`.cost` like any step on the
batch's profiles: each tier's batched compute, each used link carrying N hidden states
up and N answers down, one RTT. Its latency ``L(N)`` is every session's time per token,
and the sessions together make ``N / L(N)`` tokens per second, what the search maximises
(it minimises ``L(N)``, a :class:`~.cost.CostTables` like the others). Per token that is
each tier's batched step time / N plus the links' costs / N. Memory counts N sessions'
KV caches and the batch's activation peak. Without ``--sessions`` the throughput
objective keeps the pipelined rate above; TTFT and one session's time per token are
reported as for every plan.
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


def answer_bytes(decode: Profile, *, sampled: bool, sessions: int = 1) -> int:
    """What one step answers over each link it used ([Note: pricing a decoder]).

    ``decode`` is profiled at one token (seq 1), so its output cut holds one position's
    logits: what a sampled step needs back; a greedy one needs its choice alone. A
    batched step of ``sessions`` answers each of them (its profile holds their rows).
    """
    return decode.cuts[-1].nbytes if sampled else CHOICE_BYTES * sessions


def batch_sizes(sessions: int) -> tuple[int, ...]:
    """The batch sizes a decode step is profiled at for ``sessions`` concurrent sessions:
    1, 2, 4, ... up to the first power of two at or above it ([Note: pricing batched
    steps])."""
    if sessions < 1:
        raise PlanError(f"sessions must be at least 1, got {sessions}")
    sizes = [1]
    while sizes[-1] < sessions:
        sizes.append(2 * sizes[-1])
    return tuple(sizes)


def at_batch(by_batch: Mapping[int, Profile], batch: int) -> Profile:
    """One tier's decode-step profile at ``batch`` sessions from its profiles measured at
    the sizes in ``by_batch``: linear between the two around ``batch``, exact at one of
    them ([Note: pricing batched steps])."""
    if batch in by_batch:
        return by_batch[batch]
    below = [b for b in by_batch if b < batch]
    above = [b for b in by_batch if b > batch]
    if not below or not above:
        raise PlanError(f"no decode profile around batch {batch}: measured at {sorted(by_batch)}")
    lo, hi = max(below), min(above)
    low, high = by_batch[lo], by_batch[hi]
    share = (batch - lo) / (hi - lo)

    def mix(a: float, b: float) -> float:
        return a + share * (b - a)

    units = tuple(
        replace(
            u,
            compute_s=mix(u.compute_s, v.compute_s),
            peak_activation_bytes=round(mix(u.peak_activation_bytes, v.peak_activation_bytes)),
        )
        for u, v in zip(low.units, high.units, strict=True)
    )
    cuts = tuple(
        replace(c, nbytes=round(mix(c.nbytes, d.nbytes)))
        for c, d in zip(low.cuts, high.cuts, strict=True)
    )
    return replace(
        high,
        units=units,
        cuts=cuts,
        overhead_s=mix(low.overhead_s, high.overhead_s),
        output_s_per_byte=mix(low.output_s_per_byte, high.output_s_per_byte),
    )


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
    """Prefill, decode-step and whole-generation tables, all with the decoder's memory;
    with ``sessions``, a batched step of that many sessions too ([Note: pricing batched
    steps]). ``state_bytes`` is each unit's state for every session held."""

    prefill: CostTables
    decode: CostTables
    generation: CostTables
    max_tokens: int
    state_bytes: tuple[int, ...]
    batched: CostTables | None = None
    sessions: int | None = None


def decoder_tables(
    prefill: CostProblem,
    decode: CostProblem,
    *,
    max_tokens: int,
    state_bytes: Sequence[int],
    sampled: bool = False,
    batched: CostProblem | None = None,
    sessions: int | None = None,
) -> DecoderTables:
    """Tabulate both points and their sum over a generation; see [Note: pricing a decoder].

    ``sampled``: steps answer one position's logits, not its greedy choice. ``batched``:
    the decode step of ``sessions`` sessions as one batch, on profiles at that batch size
    (:func:`at_batch`), for the throughput objective ([Note: pricing batched steps]).
    """
    if max_tokens < 1:
        raise PlanError(f"max_tokens must be at least 1, got {max_tokens}")
    if (batched is None) != (sessions is None):
        raise PlanError("a batched step needs its number of sessions, and only it")
    steps = max_tokens - 1  # the prefill answers the first token
    answer = answer_bytes(decode.profiles["device"], sampled=sampled)
    prefill = replace(prefill, reply_bytes=answer)
    decode = replace(decode, reply_bytes=answer)
    points = [build_tables(prefill), build_tables(decode)]
    if batched is not None and sessions is not None:
        reply = answer_bytes(batched.profiles["device"], sampled=sampled, sessions=sessions)
        points.append(build_tables(replace(batched, reply_bytes=reply, objective="latency")))
    if len({t.problem.ncuts for t in points}) != 1:
        raise PlanError(f"cuts differ between the points: {[t.problem.ncuts for t in points]}")
    # Weights, the largest activation peak of the points, and the state of every session.
    held = tuple(size * (sessions or 1) for size in state_bytes)
    peaks = {t: np.maximum.reduce([p.memory[t] for p in points]) for t in TIERS}
    memory = with_state_memory(replace(points[0], memory=peaks), held).memory
    at_prefill, at_decode, *at_batch_size = (replace(p, memory=memory) for p in points)
    generation = CostTables(
        problem=replace(decode, objective="latency"),
        segment_s={t: at_prefill.segment_s[t] + steps * at_decode.segment_s[t] for t in TIERS},
        memory=memory,
        links={
            name: _combined_link(at_prefill.links[name], at_decode.links[name], steps)
            for name in at_decode.links
        },
    )
    return DecoderTables(
        at_prefill,
        at_decode,
        generation,
        max_tokens,
        held,
        at_batch_size[0] if at_batch_size else None,
        sessions,
    )


@dataclass(frozen=True)
class DecoderEstimate:
    """One plan of a decoder: its prefill, its decode step, and the generation they make."""

    prefill: Estimate
    step: Estimate
    max_tokens: int
    state_bytes: Mapping[str, int]
    #: The decode step of ``sessions`` sessions as one batch ([Note: pricing batched steps]).
    batched: Estimate | None = None
    sessions: int | None = None

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

    @property
    def session_per_token_s(self) -> float:
        """Each session's time per token when ``sessions`` step together as one batch."""
        return self.batched.latency_s if self.batched is not None else self.per_token_s

    @property
    def aggregate_tokens_per_s(self) -> float:
        """Tokens per second of all ``sessions`` together: what ``--sessions`` maximises."""
        step = self.session_per_token_s
        return (self.sessions or 1) / step if step > 0 else float("inf")

    def bytes_per_token(self) -> dict[str, float]:
        """Bytes each link carries up per token of the generation, the prompt's included
        ([Note: bytes per token])."""
        return bytes_per_token(
            {name: cost.bytes for name, cost in self.prefill.links.items()},
            {name: cost.bytes for name, cost in self.step.links.items()},
            self.max_tokens,
        )

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
            **(
                {
                    "sessions": self.sessions,
                    "session_per_token_s": self.session_per_token_s,
                    "aggregate_tokens_per_s": self.aggregate_tokens_per_s,
                    "batched_step": self.batched.to_dict(),
                }
                if self.batched is not None
                else {}
            ),
        }


def bytes_per_token(
    prefill: Mapping[str, float], step: Mapping[str, float], tokens: int
) -> dict[str, float]:
    """Bytes each link carries up per token of a ``tokens``-token generation: ``prefill``
    (the prompt's request) once and ``step`` for each token after the first.

    [Note: bytes per token]
    One count of a generation's bytes per token, wherever it is given: what the requests
    carry *up* each link, the prompt's included, over the tokens made. ``generate --json``
    measures it (each round trip's link figures, summed, over the tokens:
    :class:`~tierflow.device.generation.GenerationReport`), the plan predicts it with this
    function (``plan.json``'s ``estimate.decoder.bytes_per_token``, the plan table's
    ``B/tok``), and the benchmarks set one beside the other. The answers coming down
    (a choice, or one position's logits) are not in it; their time is in the estimate's
    ``reply_s``.
    """
    return {link: (prefill[link] + (tokens - 1) * step[link]) / tokens for link in step}


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
        batched=None if tables.batched is None else estimate(tables.batched, a, b, codec),
        sessions=tables.sessions,
    )


def decoder_search(
    tables: DecoderTables, *, top: int = 5, context: int | None = None
) -> SearchResult[DecoderEstimate]:
    """Rank every decoder plan; see [Note: pricing a decoder].

    Raises :class:`PlanError` naming the KV cache when no plan fits the memory budgets.
    """
    objective = tables.decode.problem.objective
    ranked_on = tables.decode if objective == "throughput" else tables.generation
    ranked_on = tables.batched or ranked_on  # its latency: every session's time per token
    try:
        result = search(ranked_on.problem, top=top, tables=ranked_on)
    except PlanError as exc:
        total = format_size(float(sum(tables.state_bytes)))
        at = f" at --context {context}" if context is not None else ""
        held = f" of {tables.sessions} sessions" if tables.sessions else ""
        raise PlanError(
            f"{exc}; each tier counts its weights, its activations and, kept on it with "
            f"their blocks, its state pairs' KV cache{held}{at} ({total} for the whole model)"
        ) from exc
    result = replace(result, objective=objective)
    return result.map(lambda e: decoder_estimate(tables, *e.cuts, e.codec))
