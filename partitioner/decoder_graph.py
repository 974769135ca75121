"""A decoder loaded for planning: analysed at its two points, and split with its symbols kept.

:func:`load_decoder` finds the state pairs and decoder tensors, analyses the model at the
prefill and the decode point ([Note: decoder analysis points] in :mod:`.decoder_points`),
the first with the second one's cuts and rebuilt tensors, and keeps the model as shipped
(``source``);
:func:`split_decoder` cuts segments out of ``source`` that run at any ``seq`` and
``past``; :func:`verify_decoder_split` checks them on a short greedy generation.

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
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from tierflow.errors import InputError, ModelError, PlanError
from tierflow.partitioner.decoder_points import (
    DecoderSettings,
    Point,
    analysis_points,
    crossing_infos,
    point_sample,
)
from tierflow.partitioner.extract import SegmentExtractor
from tierflow.partitioner.graph import ModelGraph, load_model
from tierflow.partitioner.loading import drop_initializer_inputs, read_model, sort_nodes
from tierflow.partitioner.split import Segment, split_model
from tierflow.partitioner.stand_ins import stand_in_shapes
from tierflow.partitioner.state_verify import (
    StatefulCheck,
    chain_step,
    verify_decoder,
    whole_step,
)
from tierflow.partitioner.stateful import graph_states, rebind_state_shapes, value_sig
from tierflow.partitioner.tensors import first_line
from tierflow.state.pairs import find_decoder
from tierflow.state.spec import DecoderSpec, StateSpec

logger = logging.getLogger(__name__)

#: Tensors a decoder cut may carry: the hidden state, the companions, and the small shape
#: tensors an exporter computes once and every block reads (sizes of seq and past, which
#: stay values in a graph that runs at any length: [Note: decoder analysis points]).
DECODER_MAX_CUT_TENSORS = 8
#: The split is checked on a greedy generation of this many tokens from a prompt this long.
VERIFY_TOKENS = 8
VERIFY_PROMPT = 6
#: A block's number in its KV cache's names (``past_key_values.3.key``).
_LAYER = re.compile(r"\d+")


@dataclass(frozen=True, eq=False)
class DecoderGraph:
    """A decoder's two analyses (same cuts), its tensors, and the model as shipped."""

    prefill: ModelGraph
    decode: ModelGraph
    source: onnx.ModelProto
    decoder: DecoderSpec
    settings: DecoderSettings
    points: tuple[Point, Point]

    @property
    def states(self) -> tuple[StateSpec, ...]:
        return self.prefill.state

    def unit_blocks(self) -> list[tuple[int, ...]]:
        """Each unit's blocks: the layer numbers of the KV caches it keeps (``past.3.key``)."""
        return [
            tuple(
                sorted(
                    {
                        int(found.group())
                        for s in self.prefill.states_between(i, i + 1)
                        if (found := _LAYER.search(s.input)) is not None
                    }
                )
            )
            for i in range(self.prefill.unit_count())
        ]

    def state_bytes(self) -> list[int]:
        """Each unit's state at ``--context`` (its blocks' KV cache), in bytes."""
        context = self.settings.context
        return [
            sum(s.nbytes(context) for s in self.prefill.states_between(i, i + 1))
            for i in range(self.prefill.unit_count())
        ]


def read_source(path: Path) -> onnx.ModelProto:
    """The model as shipped, nodes in order, initializers no inputs: what segments come from."""
    model, _ = read_model(path)
    sort_nodes(model, path)
    drop_initializer_inputs(model)
    return model


def decoder_of(
    model: onnx.ModelProto,
    states: Sequence[StateSpec],
    settings: DecoderSettings,
    *,
    where: str,
) -> DecoderSpec | None:
    """The decoder tensors of ``model``, None when it has no growing state."""
    weights = {t.name for t in model.graph.initializer}
    inputs = [value_sig(v) for v in model.graph.input if v.name not in weights]
    outputs = [value_sig(v) for v in model.graph.output]
    return find_decoder(
        inputs,
        outputs,
        states,
        context=settings.context,
        max_tokens=settings.max_tokens,
        where=where,
    )


#: Operators that pass ``position_ids`` on as the same indices (to a table's Gather).
_SAME_INDICES = ("Cast", "Reshape", "Squeeze", "Unsqueeze", "Identity", "Flatten")


def learned_positions(model: onnx.ModelProto, position_ids: str | None) -> int | None:
    """How many positions a decoder's learned position table holds, if it has one.

    A GPT-2-style decoder gathers rows of a weight table with ``position_ids`` (directly or
    through casts and reshapes): past its last row, ONNX Runtime fails on the step. None
    when no such table is read (rotary or ALiBi positions have no such limit).
    """
    if position_ids is None:
        return None
    tables = {t.name: t for t in model.graph.initializer}
    carrying = {position_ids}
    found: list[int] = []
    for node in model.graph.node:  # in order: a chain's links come before its uses
        if node.op_type in _SAME_INDICES and node.input and node.input[0] in carrying:
            carrying.update(node.output)
        elif node.op_type == "Gather" and len(node.input) == 2 and node.input[1] in carrying:
            table = tables.get(node.input[0])
            axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
            if table is not None and axis == 0 and table.dims:
                found.append(int(table.dims[0]))
    return min(found) if found else None


def inspect_decoder(
    path: str | Path, given: Sequence[tuple[str, str]] = (), settings: DecoderSettings | None = None
) -> DecoderSpec | None:
    """Whether the model at ``path`` is a decoder (its tensors), reading only its graph."""
    path = Path(path)
    try:
        model = onnx.load_model(str(path), load_external_data=False)
    except FileNotFoundError as exc:
        raise ModelError(f"model file {path} does not exist") from exc
    except Exception as exc:  # protobuf and onnx raise several types
        raise ModelError(f"{path} is not an ONNX model: {first_line(exc)}") from exc
    states = graph_states(model, given, where=str(path))
    return decoder_of(model, states, settings or DecoderSettings(), where=str(path))


def load_decoder(
    path: str | Path,
    settings: DecoderSettings,
    given: Sequence[tuple[str, str]] = (),
    progress: Callable[[int, int, str], None] | None = None,
) -> DecoderGraph:
    """Analyse the decoder at ``path`` at its prefill and decode points.

    ``progress(done, total, what)`` hears of each step (a large model's take minutes).
    """
    path = Path(path)
    say = progress or (lambda done, total, what: None)
    say(0, 3, "reading the graph and checking its weights")
    source = read_source(path)
    states = graph_states(source, given, where=str(path))
    rebind_state_shapes(source, states, where=str(path))
    # As the analyses do ([Note: shape stand-ins] in :mod:`.stand_ins`): the same nodes.
    stand_in_shapes(source, {s.input for s in states}, where=str(path))
    decoder = decoder_of(source, states, settings, where=str(path))
    if decoder is None:
        raise ModelError(f"{path} has no growing state pair: it is no decoder")
    positions = learned_positions(source, decoder.position_ids)
    if positions is not None and settings.context > positions:
        raise PlanError(
            f"--context {settings.context}: {path.name} has position embeddings for "
            f"{positions} positions, and a generation past them would fail in ONNX Runtime; "
            f"give --context {positions} or less"
        )
    inputs = [value_sig(v) for v in source.graph.input]
    prefill_point, decode_point = analysis_points(settings)
    # Cuts carry only batch-first tensors where steps may stack ([Note: a split decoder's
    # batch axis] in :mod:`.decoder_points`).
    batched = _batch_name(source, decoder.tokens) is not None
    # The decode point finds the cuts and what tiers rebuild (a step per token is what a
    # generation repeats: [Note: derived tensors stay home] in :mod:`.rebuild`); the
    # prefill point takes both, so the two see the same cut sets.
    say(1, 3, f"shapes, cuts and what tiers rebuild at the decode point (past {decode_point.past})")
    decode = load_model(
        path,
        sample=point_sample(inputs, decoder, states, decode_point, seed=1),
        state=given,
        fold=False,
        max_cut_tensors=DECODER_MAX_CUT_TENSORS,
        rebuild=True,
        batched=batched,
    )
    say(2, 3, f"shapes at the prefill point (seq {prefill_point.seq})")
    prefill = load_model(
        path,
        sample=point_sample(inputs, decoder, states, prefill_point),
        state=given,
        positions=[c.position for c in decode.cuts],
        fold=False,
        max_cut_tensors=DECODER_MAX_CUT_TENSORS,
        rebuild=decode.rebuilt,
        batched=batched,
    )
    say(3, 3, f"{len(prefill.cuts)} cuts")
    logger.info(
        "[plan] %s is a decoder: %d state pairs, %d cuts, analysed at %s and %s; tiers rebuild %s",
        path,
        len(states),
        len(prefill.cuts),
        prefill_point,
        decode_point,
        ", ".join(decode.rebuilt) or "nothing",
    )
    return DecoderGraph(prefill, decode, source, decoder, settings, (prefill_point, decode_point))


def load_batched_decode(graph: DecoderGraph, batch: int) -> ModelGraph:
    """The decode point analysed again with ``batch`` sessions' steps stacked, at the same
    cuts and with the same rebuilt tensors: what a tier's step batcher runs ([Note: the
    step batcher] in tierflow/runtime/batching.py), for profiling at that batch size.

    Raises :class:`PlanError` when the model does not run ``batch`` sequences at once.
    """
    check_batches(graph, batch)
    decode = graph.decode
    inputs = [value_sig(v) for v in graph.source.graph.input]
    _, point = graph.points
    try:
        # The cuts are the batch-1 analysis's, chosen there with the batch axis in mind
        # (load_decoder's batched=): at batch > 1 no first dimension is 1 to tell it by.
        return load_model(
            decode.path,
            sample=point_sample(inputs, graph.decoder, graph.states, point, seed=1, batch=batch),
            state=[(s.input, s.output) for s in graph.states],
            positions=[c.position for c in decode.cuts],
            fold=False,
            max_cut_tensors=DECODER_MAX_CUT_TENSORS,
            rebuild=decode.rebuilt,
        )
    except (ModelError, InputError) as exc:
        raise PlanError(
            f"cannot price {batch} sessions' decode steps as one batch: {Path(decode.path).name} "
            f"does not run at batch {batch} ({first_line(exc)})"
        ) from exc


def check_batches(graph: DecoderGraph, sessions: int) -> None:
    """Refuse to plan ``sessions`` > 1 batched when the token input's first axis is fixed:
    its steps cannot stack ([Note: a split decoder's batch axis] in :mod:`.decoder_points`)."""
    if sessions > 1 and _batch_name(graph.source, graph.decoder.tokens) is None:
        raise PlanError(
            f"--sessions {sessions}: {Path(graph.decode.path).name} takes one sequence at a "
            f"time (its {graph.decoder.tokens} input has a fixed first axis), so the steps "
            "of several sessions cannot run as one batch; export it with a symbolic batch axis"
        )


def split_decoder(graph: DecoderGraph, cut_indices: Sequence[int]) -> list[Segment]:
    """Segments of the shipped model at ``cut_indices`` (a, b), one per tier with work.

    Cut by :func:`~tierflow.partitioner.split.split_model` at the analysed cuts (same
    files, names, state pairs), but from ``graph.source``, so they keep its symbolic
    dimensions ([Note: decoder analysis points] in :mod:`.decoder_points`).
    """
    return split_model(graph.prefill, cut_indices, extractor=_extractor(graph))


def check_generation(
    graph: DecoderGraph, segments: Sequence[Segment], prompt: Sequence[int], tokens: int
) -> StatefulCheck:
    """``tokens`` greedy tokens from ``prompt``, made by the whole model and through
    ``segments``, compared step by step (:func:`verify_decoder`)."""
    whole, chain = whole_step(graph.source), chain_step(segments)
    outputs = [o.name for o in graph.source.graph.output]
    return verify_decoder(whole, chain, graph.decoder, graph.states, outputs, prompt, tokens)


def verify_decoder_split(
    graph: DecoderGraph, segments: Sequence[Segment], cuts: Sequence[int]
) -> StatefulCheck:
    """A short greedy generation through the segments split at ``cuts`` against the
    whole model: bit for bit, or for an fp16 decoder the same tokens ([Note: half
    precision splits]); raises :class:`PlanError` otherwise.
    """
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(0, graph.decoder.vocab, VERIFY_PROMPT)]
    tokens = min(VERIFY_TOKENS, graph.settings.context - len(prompt) + 1)
    check = check_generation(graph, segments, prompt, tokens)
    half = any(t.dtype == "float16" for t in graph.prefill.outputs)
    if not (check.bitwise_equal or (half and check.same_tokens)):
        raise PlanError(
            f"the decoder split at cuts {tuple(cuts)} does not reproduce the model over "
            f"{check.steps} greedy steps: outputs differ by up to {check.max_abs_diff:g}"
            + (", and so do its tokens" if half else "")
        )
    return check


def _extractor(graph: DecoderGraph) -> SegmentExtractor:
    """An extractor over the shipped model that declares the cut tensors where they cross."""
    model = graph.source
    declared = {v.name for v in (*model.graph.input, *model.graph.output)}
    crossing = {name for cut in graph.prefill.cuts for name in cut.tensors if name not in declared}
    shapes = {
        name: (
            graph.prefill.tensors[name].shape,
            graph.decode.tensors[name].shape,
            graph.prefill.tensors[name].dtype,
        )
        for name in crossing
    }
    # The model's own value infos stay as they are; the cut tensors' (symbolic) types and
    # shapes are declared only where a segment takes or makes them.
    batch = _batch_name(model, graph.decoder.tokens)
    return SegmentExtractor(model, boundary=crossing_infos(shapes, *graph.points, batch=batch))


def _batch_name(model: onnx.ModelProto, tokens: str) -> str | None:
    """The symbolic name of the token input's first axis, if it has one ([Note: a split
    decoder's batch axis] in :mod:`.decoder_points`)."""
    for value in model.graph.input:
        if value.name == tokens:
            dims = value.type.tensor_type.shape.dim
            if dims and dims[0].dim_param:
                return str(dims[0].dim_param)
    return None
