"""Graph analysis of an ONNX model: the analysed :class:`ModelGraph` and :func:`load_model`.

Pure analysis: :func:`load_model` reads the model file (its external data stays where it
lies, [Note: weights stay on disk]) and returns
a :class:`ModelGraph`; nothing is written. The planner profiles the "units" between
consecutive cuts and scores pairs of cuts; :mod:`tierflow.partitioner.split` turns a pair
into segment models. The steps live beside this module: reading the file
(:mod:`.loading`), fixing static shapes (:mod:`.shapes`) and finding candidate cuts
(:mod:`.cuts`, with [Note: cut sets], which says what a cut is and which positions are
candidates); :mod:`.tensors` holds what they share. Their public names are re-exported
here.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import onnx.checker

from tierflow.errors import ModelError, UsageError
from tierflow.partitioner.cuts import (
    DEFAULT_MAX_CUT_TENSORS,
    Cut,
    NodeUsage,
    candidate_cuts,
    crossing_sets,
    node_usage,
    unbatched_positions,
)
from tierflow.partitioner.exits.metadata import ExitInfo
from tierflow.partitioner.extract import SegmentExtractor
from tierflow.partitioner.loading import drop_initializer_inputs, read_model, sort_nodes
from tierflow.partitioner.rebuild import choose_rebuilt, rebuildable, rebuilt_sets
from tierflow.partitioner.shapes import (
    branch_reads,
    branch_shaped,
    first_request,
    fix_input_shapes,
    fold_shapes,
    load_sample,
    parse_shape_option,
    representative_inputs_for,
    sample_request,
    shipped_values,
    static_infos,
    static_model,
    write_value_infos,
)
from tierflow.partitioner.stand_ins import stand_in_shapes
from tierflow.partitioner.stateful import (
    Span,
    forbidden_positions,
    graph_states,
    rebind_state_shapes,
    state_spans,
    states_within,
)
from tierflow.partitioner.tensors import TensorInfo, first_line, node_uses, np_dtype_name
from tierflow.partitioner.weights import check_graph
from tierflow.state.spec import StateSpec

__all__ = [
    "DEFAULT_MAX_CUT_TENSORS",
    "Cut",
    "ModelGraph",
    "TensorInfo",
    "first_line",
    "load_model",
    "load_sample",
    "node_uses",
    "parse_shape_option",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class ModelGraph:
    """A loaded and analysed model: static shapes, node order, candidate cuts.

    ``model`` has its symbolic dimensions fixed, shapes inferred (and measured), nodes in
    the order of ``nodes`` and Shape/Size of static tensors folded to constants (see
    [Note: cut sets]), except what control-flow nodes read, which keeps the shapes the
    model shipped with ([Note: shapes a branch reads]); it is what segments are extracted
    from. ``tensors`` holds the static shapes of all. ``sample`` holds the
    first request of ``--sample`` when one was given.

    ``state`` holds the model's state pairs and ``spans`` the node span each needs on one
    tier ([Note: state pairs in the cut search] in :mod:`.stateful`); ``inputs`` and
    ``outputs`` include the state tensors, while cut 0 and the output cut leave them out.
    """

    path: str
    sha256: str
    model: onnx.ModelProto
    nodes: tuple[onnx.NodeProto, ...]
    inputs: tuple[TensorInfo, ...]
    outputs: tuple[TensorInfo, ...]
    tensors: dict[str, TensorInfo]
    cuts: tuple[Cut, ...]
    sample: dict[str, np.ndarray] | None = None
    usage: NodeUsage | None = field(default=None, repr=False)
    # When the graph is the trunk of a model with early exits (set by
    # exits.plan.load_planning_graph): its exits in order, and the model with their heads.
    exits: tuple[ExitInfo, ...] = ()
    exited_model: onnx.ModelProto | None = field(default=None, repr=False)
    state: tuple[StateSpec, ...] = ()
    spans: Mapping[str, Span] = field(default_factory=dict, repr=False)
    #: Tensors each tier rebuilds from model inputs, never sent; see
    #: [Note: derived tensors stay home] in :mod:`.rebuild`.
    rebuilt: tuple[str, ...] = ()

    def states_between(self, start: int, end: int) -> tuple[StateSpec, ...]:
        """The state pairs the segment ``cuts[start]..cuts[end]`` owns."""
        first, last = self._span(start, end)
        return states_within(self.state, self.spans, first, last)

    @property
    def travelling_inputs(self) -> tuple[TensorInfo, ...]:
        """The inputs a request carries: every input but the state inputs."""
        kept = {s.input for s in self.state}
        return tuple(i for i in self.inputs if i.name not in kept)

    @property
    def answered_outputs(self) -> tuple[TensorInfo, ...]:
        """The outputs a request is answered with: every output but the state outputs."""
        kept = {s.output for s in self.state}
        return tuple(o for o in self.outputs if o.name not in kept)

    @functools.cached_property
    def extractor(self) -> SegmentExtractor:
        """Cuts segments out of ``model``; built on first use (it indexes every node)."""
        return SegmentExtractor(self.model)

    def _usage(self) -> NodeUsage:
        assert self.usage is not None, "ModelGraph built without load_model"
        return self.usage

    def _span(self, start: int, end: int) -> tuple[int, int]:
        if not 0 <= start <= end < len(self.cuts):
            raise ModelError(
                f"cut range {start}..{end} is not within 0..{len(self.cuts) - 1} in order"
            )
        return self.cuts[start].position, self.cuts[end].position

    def weight_bytes(self, start: int, end: int) -> int:
        """Bytes of the weights the nodes between ``cuts[start]`` and ``cuts[end]`` read.

        Counts initializers and Constant data each once, however many nodes share them,
        including constants computed from them and weights inside control-flow bodies.
        """
        first, last = self._span(start, end)
        usage = self._usage()
        sources: set[str] = set()
        private = 0
        for i in range(first, last):
            if i in usage.constant_nodes:
                continue
            sources |= usage.weights[i]
            private += usage.private_weight_bytes[i]
        return private + sum(usage.weight_nbytes[name] for name in sources)

    def peak_activation_bytes(self, start: int, end: int) -> int:
        """Peak bytes of live activations while running the segment ``cuts[start..end]``.

        The segment's inputs are live from the start; a tensor is freed after its last
        use unless the segment outputs it; a node's inputs and outputs are live together.
        Weights are not included (see :meth:`weight_bytes`).
        """
        first, last = self._span(start, end)
        usage = self._usage()
        keep = set(self.cuts[end].tensors)
        live = {name: self.tensors[name].nbytes for name in self.cuts[start].tensors}
        current = peak = sum(live.values())
        for i in range(first, last):
            if i in usage.constant_nodes:
                continue
            for name in self.nodes[i].output:
                if name in self.tensors and name not in live:
                    live[name] = self.tensors[name].nbytes
                    current += live[name]
            peak = max(peak, current)
            for name in (*usage.uses[i], *self.nodes[i].output):
                if name in live and name not in keep and usage.last_use.get(name, -1) <= i:
                    current -= live.pop(name)
        return peak

    def representative_inputs(self, seed: int = 0) -> dict[str, np.ndarray]:
        """One request's inputs: the sample's first row if given, else seeded random data.

        Random floats are standard normal; integers are 0 or 1 (valid indices for any
        embedding table); booleans are fair coin flips.
        """
        return representative_inputs_for(self.inputs, self.sample, seed)

    def unit_count(self) -> int:
        """Number of units (stretches between consecutive cuts) the planner profiles."""
        return len(self.cuts) - 1


def load_model(
    path: str | Path,
    *,
    shapes: Mapping[str, Sequence[int]] | None = None,
    sample: Mapping[str, np.ndarray] | None = None,
    max_cut_tensors: int = DEFAULT_MAX_CUT_TENSORS,
    state: Sequence[tuple[str, str]] = (),
    positions: Sequence[int] | None = None,
    fold: bool = True,
    rebuild: bool | Collection[str] = False,
    batched: bool = False,
) -> ModelGraph:
    """Load an ONNX model as users have it and analyse it for cutting.

    Accepts both torch exporters' output and hand-built graphs; weights in initializers,
    Constant nodes or external data files beside the model; opset 11 and newer. Symbolic
    input dimensions are fixed from ``shapes`` (``--shape``), else from the first request
    of ``sample`` (``--sample``, arrays with a leading request axis), else a leading
    batch dimension becomes 1 and any other unknown one is a ModelError. Shapes are
    inferred, then measured by running the model once in ONNX Runtime. See
    [Note: cut sets] for the cuts.

    State pairs are found by name, after the ``state`` patterns (``--state IN=OUT``), and
    no cut separates one ([Note: state pairs in the cut search] in :mod:`.stateful`).
    ``positions`` fixes the cuts instead of searching them (each must be a candidate).
    ``fold`` False keeps Shape and Size nodes as they are: the graph is analysed at fixed
    shapes but its segments will run at others (a decoder: [Note: decoder analysis
    points] in :mod:`.decoder_points`), so what they compute must cross like any value.
    ``rebuild`` True lets tiers rebuild what they can from the model inputs instead of
    receiving it, chosen at this analysis; a collection names the tensors to rebuild
    ([Note: derived tensors stay home] in :mod:`.rebuild`), and either first reads sizes
    from the travelling inputs ([Note: shape stand-ins] in :mod:`.stand_ins`).
    ``batched`` True keeps cuts where a tensor without a batch axis would cross out of the
    candidates ([Note: cut sets], batched models).
    """
    path = Path(path)
    if max_cut_tensors < 1:
        raise UsageError(f"max_cut_tensors must be at least 1, got {max_cut_tensors}")
    model, sha256 = read_model(path)
    sort_nodes(model, path)
    try:
        check_graph(model)
    except (onnx.checker.ValidationError, ValueError) as exc:
        raise ModelError(f"invalid ONNX graph in {path}: {first_line(exc)}") from exc

    states = graph_states(model, state, where=str(path))
    rebind_state_shapes(model, states, where=str(path))
    input_values = drop_initializer_inputs(model)
    if rebuild is not False:  # sizes read from the inputs, so tiers can rebuild what they shape
        stand_in_shapes(model, {s.input for s in states}, where=str(path))
    first = sample_request(input_values, sample, path) if sample is not None else None
    input_shapes = fix_input_shapes(input_values, path, shapes or {}, first)
    # Declared as shipped, not at the fixed shapes ([Note: shapes a branch reads]).
    reads = branch_reads(model)
    shipped = shipped_values(model, reads, path)
    model = static_model(model, input_shapes, path)
    varying = branch_shaped(model)
    graph = model.graph
    inputs = tuple(
        TensorInfo(v.name, np_dtype_name(v.type.tensor_type.elem_type), input_shapes[v.name])
        for v in graph.input
        if v.name in input_shapes
    )
    sample_row = None
    if first is not None:
        sample_row = {i.name: first_request(first[i.name], i) for i in inputs}

    infos = static_infos(model, inputs, sample_row, path)
    produced = [n for node in graph.node for n in node.output if n]
    unknown = [n for n in produced if infos.get(n) is None]

    static = {k: v for k, v in infos.items() if v is not None}
    # The inputs' shapes were fixed above; inference may not take a 0 (an empty KV cache).
    static.update({i.name: i for i in inputs})
    folded = fold_shapes(model, static, keep=reads) if fold else 0
    output_names = [v.name for v in graph.output]
    for name in (*output_names, *(i.name for i in inputs)):
        if name not in static:
            raise ModelError(f"cannot determine the shape of {name!r} in {path}")
    write_value_infos(model, static, {i.name for i in inputs}, varying, shipped)

    kept = {n for s in states for n in (s.input, s.output)}
    answered = [n for n in output_names if n not in kept]
    usage = node_usage(graph, static, answered)
    constant_outputs = [n for n in output_names if n in usage.constants]
    if constant_outputs:
        raise ModelError(
            f"model outputs {constant_outputs} of {path} are constants; nothing to run"
        )
    input_names = [i.name for i in inputs]
    tensors = {
        name: static[name]
        for name in (*input_names, *produced)
        if name not in usage.constants and name in static
    }
    spans = state_spans(usage.uses, [n.output for n in graph.node], states, where=str(path))
    travelling = [n for n in input_names if n not in kept]
    sets = crossing_sets(graph, usage, travelling)
    rebuilt: tuple[str, ...] = ()
    if rebuild is not False:
        cones = rebuildable(graph, usage, travelling)
        rebuilt = (
            choose_rebuilt(sets, cones, tensors)
            if rebuild is True
            else tuple(n for n in rebuild if n in cones)
        )
        sets = rebuilt_sets(sets, cones, rebuilt, travelling)
    # No cut carries a tensor whose shape follows a branch ([Note: shapes that follow a branch]).
    cuttable = {n: i for n, i in tensors.items() if n not in varying or n in output_names}
    cuts = candidate_cuts(
        graph,
        usage,
        sets,
        cuttable,
        answered,
        max_cut_tensors,
        forbidden=forbidden_positions(spans)
        | (unbatched_positions(sets, tensors) if batched else frozenset()),
        positions=positions,
    )
    logger.info(
        "[graph] %s: %d nodes, %d cuts, %d shapes folded, %d tensors of unknown shape",
        path,
        len(graph.node),
        len(cuts),
        folded,
        len(unknown),
    )
    return ModelGraph(
        path=str(path),
        sha256=sha256,
        model=model,
        nodes=tuple(graph.node),
        inputs=inputs,
        outputs=tuple(static[n] for n in output_names),
        tensors=tensors,
        cuts=tuple(cuts),
        sample=sample_row,
        usage=usage,
        state=states,
        spans=spans,
        rebuilt=rebuilt,
    )
