"""Shape stand-ins: sizes a graph reads from a cache or an activation, read from the inputs.

See [Note: shape stand-ins]. Changes a model in place before it is analysed or split.

[Note: shape stand-ins]
~~~~~~~~~~~~~~~~~~~~~~~
An exporter reads sizes wherever it finds them: optimum's causal mask takes the cache
length from ``Shape(past_key_values.0.key)`` and the step length from the embedding's
output, and each attention block takes the batch size and step length from the shape of
the block's input. A size read so is made from a state the first block keeps, or from the
hidden state, so no tier after a cut can make it again from the model inputs ([Note:
derived tensors stay home] in :mod:`.rebuild`): it crosses every cut, a rank-0 scalar
that no batch of steps can stack ([Note: a split decoder's batch axis] in
:mod:`.decoder_points`), and with it the causal mask it shapes.

The model's declarations say where else each size lies. A Shape node reading a tensor ``x``
whose dimensions are all known, either declared (a graph input or output) or inferred from
the declared inputs by ONNX shape inference, is replaced by nodes that read the same
dimensions from the *travelling* inputs (model inputs that are no state): each dimension is
a number, a name some travelling input declares on one of its axes (``batch_size`` on
``input_ids``' first), or a term of a sum a travelling input declares whose other terms
are such names (``past_sequence_length`` is ``attention_mask``'s second axis, declared
``past_sequence_length + sequence_length``, less ``input_ids``' second). The new nodes
(Shape of the inputs, Gather of one axis, Sub, Concat) give the Shape's output the same
value, so the model computes what it did, bit for bit, for every input its declarations
admit (a runtime feeding a cache whose length is not the mask's less the step's already
breaks the model). A Shape of a tensor with an unknown dimension stays as it is.

The replacement goes where the Shape node was, so the node order stays topological, and
the rewrite is deterministic: the analysed copies of a decoder and the model its segments
are cut from get the same nodes and names. It runs only where tiers rebuild ([Note:
derived tensors stay home]).
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence

import numpy as np
import onnx
import onnx.helper
import onnx.numpy_helper
import onnx.shape_inference

from tierflow.partitioner.shapes import declared_dims

logger = logging.getLogger(__name__)

#: One axis of one travelling input.
Axis = tuple[str, int]
#: A size: axes added, axes subtracted.
Size = tuple[tuple[Axis, ...], tuple[Axis, ...]]
#: Where a dimension comes from: a number or a size.
Source = int | Size


def _terms(name: str) -> list[str]:
    return [t.strip() for t in name.split("+")]


def _known_sizes(travelling: Sequence[tuple[str, list[int | str | None]]]) -> dict[str, Size]:
    """Each symbolic size the travelling inputs declare: (plus terms, minus terms)."""
    found: dict[str, Size] = {}
    for name, dims in travelling:
        for axis, dim in enumerate(dims):
            if isinstance(dim, str) and dim not in found:
                found[dim] = (((name, axis),), ())
    # A sum whose other terms are known gives the remaining term.
    changed = True
    while changed:
        changed = False
        for name, dims in travelling:
            for axis, dim in enumerate(dims):
                if not isinstance(dim, str):
                    continue
                terms = _terms(dim)
                unknown = [t for t in terms if t not in found]
                if len(terms) < 2 or len(unknown) != 1:
                    continue
                plus: list[Axis] = [(name, axis)]
                minus: list[Axis] = []
                for term in terms:
                    if term != unknown[0]:
                        more, less = found[term]
                        minus.extend(more)
                        plus.extend(less)
                found[unknown[0]] = (tuple(plus), tuple(minus))
                changed = True
    return found


def _shapes(model: onnx.ModelProto) -> dict[str, list[int | str | None]]:
    """Declared and inferred symbolic shapes, inferred on the graph without its weights."""
    graph = model.graph
    stubs = []
    for tensor in graph.initializer:
        stub = onnx.TensorProto(name=tensor.name, data_type=tensor.data_type, dims=tensor.dims)
        stubs.append(stub)
    light = onnx.helper.make_model(
        onnx.helper.make_graph(list(graph.node), "shapes", list(graph.input), list(graph.output),
                               initializer=[], value_info=list(graph.value_info)),
        opset_imports=list(model.opset_import),
        ir_version=model.ir_version,
    )  # fmt: skip
    # Weights as inputs of their shape: inference reads dims, never data.
    for stub in stubs:
        light.graph.input.append(
            onnx.helper.make_tensor_value_info(stub.name, stub.data_type, list(stub.dims))
        )
    found: dict[str, list[int | str | None]] = {}
    try:
        inferred = onnx.shape_inference.infer_shapes(light, check_type=False, strict_mode=False)
        values = list(inferred.graph.value_info)
    except Exception:  # inference is best effort here: a Shape it cannot see stays
        values = []
    for value in [*values, *graph.input, *graph.output]:
        dims = declared_dims(value)
        if dims is not None:
            found[value.name] = dims
    return found


def stand_in_shapes(model: onnx.ModelProto, kept: Collection[str], *, where: str = "") -> int:
    """Replace Shape nodes by reads of the travelling inputs ([Note: shape stand-ins]).

    ``kept``: the state inputs (no travelling input). Changes ``model`` in place; returns
    how many Shape nodes it replaced.
    """
    graph = model.graph
    weights = {t.name for t in graph.initializer}
    travelling = [
        (v.name, dims)
        for v in graph.input
        if v.name not in weights and v.name not in kept and (dims := declared_dims(v)) is not None
    ]
    names = {name for name, _ in travelling}
    sizes = _known_sizes(travelling)
    shapes = _shapes(model)
    nodes: list[onnx.NodeProto] = []
    replaced = 0
    for node in graph.node:
        plan = None
        shape = node.op_type == "Shape" and node.domain in ("", "ai.onnx") and node.input
        if shape and node.input[0] not in names:
            plan = _dims_of(node, shapes.get(node.input[0]), sizes)
        if plan is None:
            nodes.append(node)
            continue
        nodes.extend(_stand_in(node.output[0], plan))
        replaced += 1
    if replaced:
        del graph.node[:]
        graph.node.extend(nodes)
        logger.info("[graph] %s: %d Shape node(s) read the model inputs instead", where, replaced)
    return replaced


def _dims_of(
    node: onnx.NodeProto, dims: list[int | str | None] | None, sizes: dict[str, Size]
) -> list[Source] | None:
    """Where each dimension the Shape node returns comes from, None if one is unknown."""
    if dims is None:
        return None
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    rank = len(dims)
    axes = range(*slice(int(attrs.get("start", 0)), int(attrs.get("end", rank))).indices(rank))
    plan: list[Source] = []
    for axis in axes:
        dim = dims[axis]
        if isinstance(dim, int):
            plan.append(dim)
        elif isinstance(dim, str) and dim in sizes:
            plan.append(sizes[dim])
        else:
            return None
    return plan


def _stand_in(output: str, plan: Sequence[Source]) -> list[onnx.NodeProto]:
    """Nodes that make ``output`` (an int64 shape vector) from the travelling inputs."""
    made: list[onnx.NodeProto] = []
    shape_of: dict[str, str] = {}

    def name(what: str) -> str:
        return f"{output}/stand_in/{what}{len(made)}"

    def constant(values: list[int]) -> str:
        out = name("c")
        made.append(onnx.helper.make_node("Constant", [], [out], value=_int64s(values, out)))
        return out

    def axis_of(source: Axis) -> str:
        tensor, axis = source
        if tensor not in shape_of:
            shape_of[tensor] = name("shape")
            made.append(onnx.helper.make_node("Shape", [tensor], [shape_of[tensor]]))
        out = name("dim")
        made.append(onnx.helper.make_node("Gather", [shape_of[tensor], constant([axis])], [out]))
        return out

    parts = []
    for source in plan:
        if isinstance(source, int):
            parts.append(constant([source]))
            continue
        plus, minus = source
        value = axis_of(plus[0])
        for term, op in [*((t, "Add") for t in plus[1:]), *((t, "Sub") for t in minus)]:
            out = name(op.lower())
            made.append(onnx.helper.make_node(op, [value, axis_of(term)], [out]))
            value = out
        parts.append(value)
    if not parts:
        return [onnx.helper.make_node("Constant", [], [output], value=_int64s([], output))]
    made.append(onnx.helper.make_node("Concat", parts, [output], axis=0))
    return made


def _int64s(values: list[int], name: str) -> onnx.TensorProto:
    return onnx.numpy_helper.from_array(np.array(values, dtype=np.int64), name)
