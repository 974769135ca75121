"""State pairs in graph analysis: finding them in an ONNX graph, and where cuts may not go.

The pairs themselves are found by :mod:`tierflow.state.pairs` ([Note: state pairs]); this
module reads their signatures from the graph (:func:`graph_states`), finds the node span
each pair needs on one tier (:func:`state_spans`), the positions no cut may take
(:func:`forbidden_positions`) and which pairs a segment owns (:func:`states_within`).
See [Note: state pairs in the cut search].

[Note: state pairs in the cut search]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A state input is fed on the tier that keeps the session, not carried by the request; a
state output stays on that tier for the next request. So in the crossing sets of
[Note: cut sets] a state input is not live from position 0 (cut 0 carries only the
travelling inputs, what the device sends in a cloud-only plan) and a state output is not
a model output that every later cut must carry (the output cut carries the model's other
outputs). What remains is to keep each pair on one segment: its *span* runs from the
first node that reads the input or makes the output to the last node that reads either or
makes the output, and no cut may fall inside it (positions ``lo + 1 .. hi``). Then the
input's readers, the output's maker and the output's readers share a segment, neither
tensor is ever in a crossing set, and each pair belongs to exactly one segment (the one
whose node range holds its span). A decoder's ``past_key_values.N`` pairs each span
a few nodes of block N (the Concat that makes ``present.N`` and the attention that reads
it), so cuts between blocks stay; a recurrent state read at a model's start and replaced
at its end forbids every cut between.

A node that reads only a state's *shape* binds the pair as well, and exporters read
shapes from whichever input has the dimension: torch.export takes the batch size from
one of the caches (``Shape(past_key_values.1.value, end=1)`` at the graph's start),
which would tie that block to the start and forbid every cut before it. So
:func:`rebind_state_shapes` points such a Shape node at a travelling input that declares
the same dimensions on the same axes (the token ids share the batch), before the graph is
analysed or split: the same value, from a tensor every request carries. A Shape node
reading an axis no travelling input shares (the cache length) stays, and binds.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence

import onnx
import onnx.helper

from tierflow.errors import ModelError
from tierflow.partitioner.shapes import declared_dims
from tierflow.partitioner.tensors import np_dtype_name
from tierflow.state.pairs import TensorSig, find_state_pairs
from tierflow.state.spec import StateSpec

logger = logging.getLogger(__name__)

#: A pair's span: the first and last node index it needs on one tier.
Span = tuple[int, int]


def value_sig(value: onnx.ValueInfoProto) -> TensorSig:
    """A graph input's or output's declared name, dtype and shape."""
    tensor_type = value.type.tensor_type
    if not value.type.HasField("tensor_type") or not tensor_type.elem_type:
        return TensorSig(value.name, "unknown", None)
    return TensorSig(value.name, np_dtype_name(tensor_type.elem_type), _declared(value))


def _declared(value: onnx.ValueInfoProto) -> tuple[int | str | None, ...] | None:
    found = declared_dims(value)
    return None if found is None else tuple(found)


def graph_states(
    model: onnx.ModelProto, given: Sequence[tuple[str, str]] = (), *, where: str = "the model"
) -> tuple[StateSpec, ...]:
    """The state pairs of ``model``: ``given`` (``--state`` patterns), then by name.

    Reads the declared shapes, so call it before shapes are fixed. Initializers listed
    among the inputs are no state.
    """
    graph = model.graph
    weights = {t.name for t in graph.initializer}
    inputs = [value_sig(v) for v in graph.input if v.name not in weights]
    outputs = [value_sig(v) for v in graph.output]
    return find_state_pairs(inputs, outputs, given, where=where)


def rebind_state_shapes(
    model: onnx.ModelProto, states: Sequence[StateSpec], *, where: str = "the model"
) -> int:
    """Point Shape nodes that read a state's shared dimensions at a travelling input.

    Changes ``model`` in place (one node for one, so node positions stay); returns how many
    nodes it changed. See the note above.
    """
    graph = model.graph
    weights = {t.name for t in graph.initializer}
    declared = {v.name: _declared(v) for v in graph.input if v.name not in weights}
    kept = {s.input for s in states}
    travelling = [(n, d) for n, d in declared.items() if n not in kept and d is not None]
    changed = 0
    for node in graph.node:
        if node.op_type != "Shape" or node.domain not in ("", "ai.onnx") or not node.input:
            continue
        source = declared.get(node.input[0])
        if node.input[0] not in kept or source is None:
            continue
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        rank = len(source)
        start, end = (int(attrs.get("start", 0)), int(attrs.get("end", rank)))
        axes = range(*slice(start, end).indices(rank))
        for name, dims in travelling:
            if all(
                a < len(dims) and dims[a] is not None and dims[a] == source[a] for a in axes
            ) and (axes or rank == len(dims)):
                node.input[0] = name
                changed += 1
                break
    if changed:
        logger.info(
            "[graph] %s: %d Shape node(s) read a state's shared dims elsewhere", where, changed
        )
    return changed


def state_spans(
    uses: Sequence[Iterable[str]],
    outputs: Sequence[Iterable[str]],
    states: Sequence[StateSpec],
    *,
    where: str = "the model",
) -> dict[str, Span]:
    """Each pair's span of node indices, by state input name; see the note above.

    ``uses[i]`` are the names node ``i`` reads (:func:`~.tensors.node_uses`), ``outputs[i]``
    those it makes.
    """
    readers: dict[str, list[int]] = {}
    maker: dict[str, int] = {}
    for i, (read, made) in enumerate(zip(uses, outputs, strict=True)):
        for name in read:
            readers.setdefault(name, []).append(i)
        for name in made:
            maker[name] = i
    spans: dict[str, Span] = {}
    for state in states:
        if state.output not in maker:
            raise ModelError(
                f"state output {state.output!r} of {where} is made by no node: it cannot "
                f"replace {state.input!r}"
            )
        nodes = [maker[state.output], *readers.get(state.input, ()), *readers.get(state.output, ())]
        spans[state.input] = (min(nodes), max(nodes))
    return spans


def forbidden_positions(spans: Mapping[str, Span]) -> frozenset[int]:
    """Cut positions that would separate a pair: ``lo + 1 .. hi`` of every span."""
    return frozenset(p for lo, hi in spans.values() for p in range(lo + 1, hi + 1))


def states_within(
    states: Sequence[StateSpec], spans: Mapping[str, Span], first: int, last: int
) -> tuple[StateSpec, ...]:
    """The pairs whose span lies in nodes ``[first, last)``: those a segment owns."""
    return tuple(s for s in states if first <= spans[s.input][0] and spans[s.input][1] < last)
