"""Candidate cuts: which positions in the node order a model may be split at.

:func:`node_usage` finds the constants, weight sources and last use of every tensor,
:func:`crossing_sets` the activations crossing each position, and
:func:`candidate_cuts` filters and collapses those positions into the :class:`Cut` list
the planner searches. See [Note: cut sets] below.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import onnx

from tierflow.errors import ModelError
from tierflow.partitioner.tensors import (
    TensorInfo,
    all_tensors,
    node_uses,
    subgraphs,
    tensor_nbytes,
)

# [Note: cut sets]
# A cut is a position p in the topological node order (0 <= p <= len(nodes)): nodes
# [0, p) run before it, nodes [p, len) after. The tensors crossing it are the
# *activations* defined before p (model inputs count as defined at -1) and needed at or
# after p, where "needed" means used as a node input, referenced from inside a
# control-flow subgraph of a node (If/Loop/Scan bodies read outer-scope names; such a
# reference is an input of the node that owns the subgraph, so the node is atomic and
# never cut inside), or being a model output. Model outputs therefore cross every cut
# after the node that makes them, and cuts[-1] carries exactly the model outputs.
#
# Constants never cross. A constant is an initializer, a Constant node's output, or the
# output of any deterministic node all of whose inputs are constants. Because every cut
# happens at fixed (analysed) input shapes, Shape and Size of a tensor with a static shape
# are constants too: load_model replaces those nodes by Constant nodes holding the value,
# so shape arithmetic (Shape -> Gather -> Concat -> Reshape, as the legacy exporter writes
# for dynamic batch) is recomputed inside each segment that needs it instead of being
# sent. onnx.utils.Extractor pulls such constant chains into whichever segment uses them,
# since it walks back from a segment's outputs until it reaches the segment's inputs.
#
# Candidates. Position 0 (the model inputs) and len(nodes) (the model outputs) are always
# cuts. An interior position is a candidate when its crossing set is non-empty, holds only
# tensors (no sequences or optionals) and has at most max_cut_tensors tensors (default
# DEFAULT_MAX_CUT_TENSORS = 3: a chain CNN gives 1, a residual block interior 2, a
# transformer the hidden state plus a mask bias, and 3 leaves room for a
# downsampling block's interior; larger sets are rarely worth sending and multiply the
# number of units the planner must profile). Consecutive candidates that differ only by a
# cheap one-in-one-out elementwise or layout node (Relu after a Conv, a bias Add, a
# Reshape; see _CHEAP_OPS), or by a node that only computes constants, carry the same
# information; such a run is collapsed to the position with the fewest bytes, ties to the
# later one (so a cut after Conv+Relu, never between them). A run that reaches position 0
# or len(nodes) collapses onto that end. A full-size ResNet-18 gets 32 cuts.
#
# Bitwise equality. Segments are plain sub-graphs of the analysed model, so each node runs
# with the same inputs and kernel in the chain as in the whole model. ONNX Runtime's
# graph optimizations, though, rewrite across node boundaries, and a cut can break a
# rewrite, which changes rounding. Measured with onnxruntime 1.32 on the zoo models, a
# chain of segments equals the whole model bit for bit at ORT_DISABLE_ALL and
# ORT_ENABLE_BASIC (constant folding, Conv+BN/Conv+Add/Conv+Relu fusions: the same
# arithmetic); at ORT_ENABLE_EXTENDED the transformer differs by ~6e-8 (LayerNorm/Gelu/
# MatMul+Add fusions) and at ORT_ENABLE_ALL ResNet does too (NCHWc layouts change the
# accumulation order). verify_split therefore runs both sides at the same level,
# "disabled" by default; runtimes that must match the unsplit model bit for bit should
# use at most "basic".
#
# Batched models. When a model's steps may run several at a time stacked on a batch axis
# (a decoder whose token input has a symbolic first axis: [Note: a split decoder's batch
# axis] in decoder_points.py), a position is a candidate only if every tensor crossing it
# has that axis: rank 2 or more and a first dimension of 1 at the analysed shapes (one
# sequence). A shape scalar or size vector an exporter computes inside a block (batch
# size and step length from Shape of the block's input, optimum's attention) cannot be
# stacked, and a segment taking one would run every step alone (unbatched_positions).

DEFAULT_MAX_CUT_TENSORS = 3


# One-in-one-out nodes that cost next to nothing: a cut before one is as good as after it.
_CHEAP_OPS = frozenset(
    {
        "Abs", "Add", "BatchNormalization", "Cast", "Ceil", "Clip", "Div", "Dropout", "Elu",
        "Erf", "Exp", "Flatten", "Floor", "Gelu", "HardSigmoid", "HardSwish", "Identity",
        "LeakyRelu", "Log", "Mul", "Neg", "Not", "PRelu", "Pow", "Reciprocal", "Relu",
        "Reshape", "Round", "Selu", "Sigmoid", "Sign", "Softplus", "Softsign", "Sqrt",
        "Squeeze", "Sub", "Tanh", "ThresholdedRelu", "Unsqueeze", "Where",
    }
)  # fmt: skip


# Nodes whose output differs from run to run: never constant, even without inputs.
_NONDETERMINISTIC_OPS = frozenset(
    {"RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Multinomial",
     "Bernoulli"}
)  # fmt: skip


@dataclass(frozen=True)
class Cut:
    """A candidate cut: a position in the node order and the activations crossing it.

    See [Note: cut sets].
    """

    index: int
    position: int
    tensors: tuple[str, ...]
    nbytes: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "position": self.position,
            "tensors": list(self.tensors),
            "nbytes": self.nbytes,
        }

    @classmethod
    def from_dict(cls, data: Any) -> Cut:
        try:
            return cls(
                index=int(data["index"]),
                position=int(data["position"]),
                tensors=tuple(str(t) for t in data["tensors"]),
                nbytes=int(data["nbytes"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelError(f"malformed cut description {data!r}: {exc}") from exc


@dataclass(frozen=True)
class NodeUsage:
    """Per-node facts the analysis and the segment queries share (indexed like nodes)."""

    uses: tuple[tuple[str, ...], ...]  # inputs plus outer-scope names read by subgraphs
    constant_nodes: frozenset[int]  # nodes that compute only constants
    constants: frozenset[str]  # every constant tensor name
    weights: tuple[frozenset[str], ...]  # weight sources (initializers, Constant outputs)
    private_weight_bytes: tuple[int, ...]  # weights stored inside the node's subgraphs
    weight_nbytes: dict[str, int]  # size of each weight source
    last_use: dict[str, int]  # activation -> last node index needing it (len(nodes): output)


def _subgraph_weight_bytes(graph: onnx.GraphProto) -> int:
    return sum(tensor_nbytes(t) for t in all_tensors(graph))


def node_usage(
    graph: onnx.GraphProto, infos: Mapping[str, TensorInfo], outputs: Sequence[str]
) -> NodeUsage:
    """Constants, weight sources and last uses; see [Note: cut sets]."""
    nodes = list(graph.node)
    uses = tuple(node_uses(n) for n in nodes)
    weight_nbytes = {t.name: tensor_nbytes(t) for t in graph.initializer}
    constants = set(weight_nbytes)
    sources: dict[str, frozenset[str]] = {name: frozenset({name}) for name in constants}
    constant_nodes: set[int] = set()
    weights: list[frozenset[str]] = []
    private: list[int] = []
    for i, node in enumerate(nodes):
        node_sources = frozenset().union(*(sources[u] for u in uses[i] if u in sources))
        weights.append(node_sources)
        private.append(sum(_subgraph_weight_bytes(g) for g in subgraphs(node)))
        deterministic = node.op_type not in _NONDETERMINISTIC_OPS
        if deterministic and all(u in constants for u in uses[i]):
            constant_nodes.add(i)
            for name in node.output:
                if not name:
                    continue
                constants.add(name)
                if node.op_type == "Constant":
                    info = infos.get(name)
                    weight_nbytes[name] = info.nbytes if info is not None else 0
                    sources[name] = frozenset({name})
                else:
                    sources[name] = node_sources
    last_use: dict[str, int] = {}
    for i, needed in enumerate(uses):
        if i in constant_nodes:
            continue
        for name in needed:
            if name not in constants:
                last_use[name] = i
    for name in outputs:
        last_use[name] = len(nodes)
    return NodeUsage(
        uses=uses,
        constant_nodes=frozenset(constant_nodes),
        constants=frozenset(constants),
        weights=tuple(weights),
        private_weight_bytes=tuple(private),
        weight_nbytes=weight_nbytes,
        last_use=last_use,
    )


def crossing_sets(
    graph: onnx.GraphProto, usage: NodeUsage, input_names: Sequence[str]
) -> list[tuple[str, ...]]:
    """The activations crossing each position 0..len(nodes), in order of definition."""
    live: dict[str, None] = {name: None for name in input_names if name in usage.last_use}
    sets = [tuple(input_names)]
    for i, node in enumerate(graph.node):
        if i not in usage.constant_nodes:
            for name in node.output:
                if name and usage.last_use.get(name, -1) > i:
                    live[name] = None
            for name in usage.uses[i]:
                if name in live and usage.last_use[name] <= i:
                    del live[name]
        sets.append(tuple(live))
    return sets


def unbatched_positions(
    sets: Sequence[tuple[str, ...]], tensors: Mapping[str, TensorInfo]
) -> frozenset[int]:
    """Interior positions where a tensor without a batch axis crosses: rank below 2, or a
    first dimension other than 1 at the analysed shapes ([Note: cut sets], batched models)."""
    return frozenset(
        p
        for p in range(1, len(sets) - 1)
        if any(
            n in tensors and (len(tensors[n].shape) < 2 or tensors[n].shape[0] != 1)
            for n in sets[p]
        )
    )


def candidate_cuts(
    graph: onnx.GraphProto,
    usage: NodeUsage,
    sets: Sequence[tuple[str, ...]],
    tensors: Mapping[str, TensorInfo],
    outputs: Sequence[str],
    max_cut_tensors: int,
    *,
    forbidden: Collection[int] = (),
    positions: Sequence[int] | None = None,
) -> list[Cut]:
    """Filter and collapse positions into candidate cuts; see [Note: cut sets].

    ``forbidden`` positions are never cuts (they would separate a state pair: [Note:
    state pairs in the cut search] in :mod:`tierflow.partitioner.stateful`).
    ``positions``, when given, are the cuts, taken as they are (the decode-step analysis
    of a decoder cuts where its prefill analysis did); each must be a candidate.
    """
    end = len(sets) - 1

    def nbytes(names: Sequence[str]) -> int:
        return sum(tensors[n].nbytes for n in names)

    def candidate(p: int) -> bool:
        crossing = sets[p]
        return (
            p not in forbidden
            and 0 < len(crossing) <= max_cut_tensors
            and all(n in tensors for n in crossing)
        )

    if positions is not None:
        ordered = list(positions)
        wrong = [p for p in ordered if not (p in (0, end) or (0 < p < end and candidate(p)))]
        if wrong or ordered != sorted(set(ordered)) or ordered[:1] != [0] or ordered[-1:] != [end]:
            raise ModelError(
                f"cut positions {list(positions)} are not candidates of this graph "
                f"(0..{end}; not candidates: {wrong})"
            )
        return _cuts(ordered, sets, outputs, end, nbytes)

    def equivalent(p: int) -> bool:
        """Whether positions p and p+1 differ only by a cheap or constant node."""
        if p in usage.constant_nodes or sets[p] == sets[p + 1]:
            return True
        node = graph.node[p]
        active_in = [u for u in usage.uses[p] if u not in usage.constants]
        active_out = [o for o in node.output if o and o in tensors]
        return (
            node.domain in ("", "ai.onnx")
            and node.op_type in _CHEAP_OPS
            and len(active_in) == 1
            and len(active_out) == 1
            and len(sets[p]) == len(sets[p + 1])
        )

    positions = [0] + [p for p in range(1, end) if candidate(p)] + [end]
    kept: list[int] = []
    run: list[int] = [positions[0]]
    for p in positions[1:]:
        if p == run[-1] + 1 and equivalent(run[-1]):
            run.append(p)
            continue
        kept.append(_best(run, sets, nbytes, end))
        run = [p]
    kept.append(_best(run, sets, nbytes, end))
    return _cuts(kept, sets, outputs, end, nbytes)


def _cuts(
    kept: Sequence[int],
    sets: Sequence[tuple[str, ...]],
    outputs: Sequence[str],
    end: int,
    nbytes: Any,
) -> list[Cut]:
    cuts = []
    for index, p in enumerate(kept):
        names = tuple(outputs) if p == end else sets[p]
        cuts.append(Cut(index=index, position=p, tensors=names, nbytes=nbytes(names)))
    return cuts


def _best(run: Sequence[int], sets: Sequence[tuple[str, ...]], nbytes: Any, end: int) -> int:
    """The position a run of equivalent positions collapses to."""
    if run[0] == 0:
        return 0
    if run[-1] == end:
        return end
    return min(reversed(run), key=lambda p: nbytes(sets[p]))
