"""Cutting sub-models out of an ONNX model with public onnx API: :class:`SegmentExtractor`.

:mod:`tierflow.partitioner.split` cuts segments at a plan's cuts with the extractor a
:class:`~tierflow.partitioner.graph.ModelGraph` keeps (``ModelGraph.extractor``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import onnx
import onnx.helper

from tierflow.errors import ModelError
from tierflow.partitioner.tensors import node_uses


class SegmentExtractor:
    """Cuts sub-models out of one model, like :class:`onnx.utils.Extractor`, by public API.

    It walks back from the wanted outputs to the given inputs and builds the segment with
    :func:`onnx.helper.make_graph` and :func:`onnx.helper.make_model`. Unlike onnx's
    Extractor (whose private methods and attributes differ between onnx releases) a
    node's inputs here include the names its If/Loop/Scan bodies read from outer scope
    (:func:`~tierflow.partitioner.graph.node_uses`), so their producers and
    initializers come along. Building it indexes every node and tensor once.
    """

    def __init__(
        self,
        model: onnx.ModelProto,
        *,
        boundary: Mapping[str, onnx.ValueInfoProto] | None = None,
    ) -> None:
        graph = model.graph
        if graph.sparse_initializer or graph.quantization_annotation:
            raise ModelError(
                "cannot split a model with sparse initializers or quantization annotations"
            )
        self.model = model
        self.initializers = {t.name: t for t in graph.initializer}
        self.values = {v.name: v for v in (*graph.value_info, *graph.input, *graph.output)}
        self.producer = {name: i for i, n in enumerate(graph.node) for name in n.output if name}
        self.uses = [node_uses(node) for node in graph.node]
        # Types and shapes a segment declares for a tensor only where it is one of the
        # segment's inputs or outputs (a decoder's cut tensors, symbolic: [Note: decoder
        # analysis points]); inside a segment the model's own declarations stand, so ONNX
        # Runtime optimises the segment's nodes as it does the model's.
        self.boundary = dict(boundary or {})

    def _values(self, names: Sequence[str]) -> list[onnx.ValueInfoProto]:
        known = {**self.values, **self.boundary}
        missing = [name for name in names if name not in known]
        if missing:
            raise ModelError(f"tensors {missing} have no recorded type and shape")
        return [known[name] for name in names]

    def _functions(self, nodes: Sequence[onnx.NodeProto]) -> list[onnx.FunctionProto]:
        """The model-local functions the nodes call, directly or through other functions."""
        local = {(f.name, f.domain): f for f in self.model.functions}
        called: list[onnx.FunctionProto] = []
        queue = list(nodes)
        while queue:
            node = queue.pop(0)
            function = local.pop((node.op_type, node.domain), None)
            if function is not None:
                called.append(function)
                queue.extend(function.node)
        return called

    def extract(self, inputs: Sequence[str], outputs: Sequence[str]) -> onnx.ModelProto:
        """The sub-model computing ``outputs`` from ``inputs`` (and the weights it reads)."""
        graph = self.model.graph
        stop = set(inputs)
        reachable: set[int] = set()
        stack = list(outputs)
        while stack:
            name = stack.pop()
            index = self.producer.get(name)
            if name in stop or index is None or index in reachable:
                continue
            reachable.add(index)
            stack.extend(self.uses[index])
        nodes = [graph.node[i] for i in sorted(reachable)]  # the source order is topological
        names = {n for i in reachable for n in (*self.uses[i], *graph.node[i].output)}
        segment = onnx.helper.make_graph(
            nodes,
            f"Extracted from {{{graph.name}}}",
            self._values(inputs),
            self._values(outputs),
            initializer=[t for name, t in self.initializers.items() if name in names],
            value_info=[v for name, v in self.values.items() if name in names],
        )
        return onnx.helper.make_model(
            segment,
            ir_version=self.model.ir_version,
            opset_imports=self.model.opset_import,
            producer_name="tierflow",
            functions=self._functions(nodes),
        )
