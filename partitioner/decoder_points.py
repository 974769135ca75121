"""A decoder's symbolic lengths made concrete: the prefill and decode points it is analysed at.

A decoder's graph has symbolic ``seq`` and ``past`` ([Note: one graph for prefill and
decode] in :mod:`tierflow.zoo.bytelm`); the planner analyses and profiles it twice at
fixed shapes, once per kind of step, and writes segments that keep the symbols. See
[Note: decoder analysis points].

[Note: decoder analysis points]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The *prefill* point runs the prompt from an empty cache: ``seq`` = ``--prompt-tokens``
(at least 2), ``past`` = 0. The *decode* point runs one token after a cache of ``past`` =
prompt + max_tokens / 2 tokens, the mean cache length over the generation (attention
costs grow linearly with it), at most ``--context`` - 1. Token ids are drawn from the
vocabulary, ``attention_mask`` is ones [1, past + seq], ``position_ids`` past ..
past + seq - 1, cache inputs standard normal with ``past`` rows; every other symbolic
dimension is 1 (one sequence at a time).

The segments written to the plan must run at any length, so they are cut from the model
as shipped, and the analysed copies keep its Shape and Size nodes (other models' are
folded to constants, [Note: cut sets]): a size computed from the tokens once and read by
every block then crosses a cut as the small int64 tensor it is, and a segment never
reads a tensor it was not given (up to 8 tensors cross a decoder cut, against 3
elsewhere). The segments' inputs and outputs that are model inputs, outputs or state
keep the model's declared shapes; a tensor crossing a cut gets its shape from comparing
the two points: a dimension equal at both is fixed, one that differs is symbolic (named
``seq``, ``past`` or ``past_seq`` where its sizes say so). For that the points must tell
the lengths apart: ``seq`` differs (prefill seq >= 2 against 1), ``past`` differs (0
against >= 1) and ``past + seq`` differs (so the decode point's past is moved by one
when ``past + 1`` would equal the prompt's length). A segment declares those shapes only
where the tensor is its input or output; inside it the model's own declarations stand,
so ONNX Runtime optimises its nodes as it does the model's (declared shapes unlock other
fusions at "extended": the family's large decoder differed by 3e-6 in its logits until
they went). A split is so bit-exact at "basic" and below, and at "extended" and "all"
wherever no fusion spans a cut ([Note: cut sets]).

[Note: a split decoder's batch axis]
Both points run one sequence, so a crossing tensor's first axis is 1 at both and would be
declared fixed: a tier could then never run the steps of several sessions as one call
([Note: the step batcher] in tierflow/runtime/batching.py). When the model's token input
has a symbolic first axis (Hugging Face's layout: every input and output is batch-first),
the first axis of every crossing tensor of rank 2 or more that is 1 at both points takes
that name. Such a decoder is cut only where every crossing tensor has that axis ([Note:
cut sets] in :mod:`.cuts`, batched models): a shape scalar an exporter computes from the
model inputs (a batch size, a step length, the sizes behind the causal mask) is rebuilt
by the tier that reads it ([Note: derived tensors stay home] in :mod:`.rebuild`), and a
position where one made from a block's activations would cross (Shape of the block's
input, inside optimum's attention) is no candidate, so no scalar or rank-1 size crosses
a cut. Were a tensor's first axis not the batch after all, a batched call's outputs
would not have one row per step and the tier runs those steps one at a time
(``tierflow.runtime.batching.split``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnx
import onnx.helper

from tierflow.errors import ModelError, UsageError
from tierflow.state.pairs import TensorSig
from tierflow.state.spec import DecoderSpec, StateSpec


@dataclass(frozen=True)
class DecoderSettings:
    """``plan --context``, ``--max-tokens``, ``--prompt-tokens``, ``--sampled``,
    ``--sessions``, checked where they enter."""

    context: int = 2048
    max_tokens: int = 64
    prompt_tokens: int = 32
    #: Generation samples (each step answers logits), not greedy (the choice alone).
    sampled: bool = False
    #: Concurrent sessions whose decode steps the tiers batch, for the throughput
    #: objective ([Note: pricing batched steps] in :mod:`.decoder_cost`); None: not asked.
    sessions: int | None = None

    def __post_init__(self) -> None:
        for name in ("context", "max_tokens", "prompt_tokens", "sessions"):
            value = getattr(self, name)
            if name == "sessions" and value is None:
                continue
            if not isinstance(value, int) or value < 1:
                flag = "--" + name.replace("_", "-")
                raise UsageError(f"{flag} must be a whole number >= 1, got {value!r}")
        if self.prompt_tokens > self.context:
            raise UsageError(
                f"--prompt-tokens {self.prompt_tokens} is longer than --context {self.context}: "
                "the prompt must fit the context the tiers hold"
            )

    def to_dict(self) -> dict[str, int | bool]:
        return {
            "context": self.context,
            "max_tokens": self.max_tokens,
            "prompt_tokens": self.prompt_tokens,
            "sampled": self.sampled,
            **({"sessions": self.sessions} if self.sessions is not None else {}),
        }


@dataclass(frozen=True)
class Point:
    """One analysis point: the step's length and the cache length before it."""

    name: str
    seq: int
    past: int

    @property
    def total(self) -> int:
        return self.past + self.seq


def analysis_points(settings: DecoderSettings) -> tuple[Point, Point]:
    """The prefill and decode points of [Note: decoder analysis points]."""
    prefill = Point("prefill", max(settings.prompt_tokens, 2), 0)
    past = max(min(settings.prompt_tokens + settings.max_tokens // 2, settings.context - 1), 1)
    if past + 1 == prefill.total:
        past += 1
    return prefill, Point("decode", 1, past)


def point_sample(
    inputs: Sequence[TensorSig],
    decoder: DecoderSpec,
    states: Sequence[StateSpec],
    point: Point,
    *,
    seed: int = 0,
    batch: int = 1,
) -> dict[str, np.ndarray]:
    """One request at ``point``, as ``--sample`` arrays (a leading request axis of 1).

    ``batch`` sequences at once: the steps of that many sessions stacked on the first
    axis ([Note: a split decoder's batch axis]). Raises :class:`ModelError` for an input
    the decoder layout does not size.
    """
    rng = np.random.default_rng(seed)
    growing = {s.input: s for s in states}
    row: dict[str, np.ndarray] = {}
    for sig in inputs:
        if sig.name == decoder.tokens:
            row[sig.name] = rng.integers(0, decoder.vocab, (batch, point.seq), dtype=np.int64)
        elif sig.name == decoder.attention_mask:
            row[sig.name] = np.ones((batch, point.total), dtype=np.int64)
        elif sig.name == decoder.position_ids:
            positions = np.arange(point.past, point.total, dtype=np.int64)
            row[sig.name] = np.tile(positions, (batch, 1))
        elif sig.name in growing:
            state = growing[sig.name]
            dims = [
                point.past
                if axis == state.grows
                else ((batch if axis == 0 else 1) if d is None else d)
                for axis, d in enumerate(state.shape)
            ]
            row[sig.name] = rng.standard_normal(dims).astype(state.dtype)
        else:
            raise ModelError(
                f"decoder input {sig.name!r} is not one the planner can size: expected the "
                f"token ids, attention_mask, position_ids and state inputs, found {sig.shown()}"
            )
    return {name: value[None] for name, value in row.items()}


def _named(sizes: tuple[int, int], prefill: Point, decode: Point) -> str:
    """A symbolic dimension's name from its sizes at the two points ('' when none fits)."""
    for name, expected in (
        ("seq", (prefill.seq, decode.seq)),
        ("past", (prefill.past, decode.past)),
        ("past_seq", (prefill.total, decode.total)),
    ):
        if sizes == expected:
            return name
    return ""


def crossing_infos(
    shapes: Mapping[str, tuple[tuple[int, ...], tuple[int, ...], str]],
    prefill: Point,
    decode: Point,
    batch: str | None = None,
) -> dict[str, onnx.ValueInfoProto]:
    """Value infos for tensors crossing cuts, from their shapes at the two points.

    ``shapes[name]`` is ``(prefill shape, decode shape, numpy dtype)``; see
    [Note: decoder analysis points]. ``batch``: the model's symbolic batch dimension, the
    name a crossing tensor's first axis takes (see [Note: a split decoder's batch axis]).
    """
    infos: dict[str, onnx.ValueInfoProto] = {}
    for name, (at_prefill, at_decode, dtype) in shapes.items():
        if len(at_prefill) != len(at_decode):
            raise ModelError(
                f"tensor {name!r} has rank {len(at_prefill)} at the prefill point and "
                f"{len(at_decode)} at the decode point: no cut may carry it"
            )
        dims: list[int | str | None] = []
        for a, b in zip(at_prefill, at_decode, strict=True):
            dims.append(a if a == b else (_named((a, b), prefill, decode) or None))
        if batch and len(dims) >= 2 and dims[0] == 1:
            dims[0] = batch
        elem = onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
        infos[name] = onnx.helper.make_tensor_value_info(name, elem, dims)
    return infos
