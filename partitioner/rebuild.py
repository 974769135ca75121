"""Tensors a tier rebuilds from model inputs instead of receiving them across a cut.

See [Note: derived tensors stay home]. Pure: takes a graph's node usage and the crossing
sets of :mod:`.cuts`, returns other crossing sets.

[Note: derived tensors stay home]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
An exporter computes some tensors once, near the start, from the model inputs alone, and
every block reads them: a decoder's expanded causal mask (``/model/Expand_output_0``,
bool [batch, 1, seq, past + seq]) and its rotary tables (cos and sin, 64 floats a
position for a head of 128). They cross every cut between blocks, and those of the mask
grow with the context. A tier can make them again from the inputs they came from, for
next to nothing: that is *rebuilding*, and a cut whose set names such a tensor carries
its *roots* (the model inputs it reads: ``position_ids`` for the rotary tables,
``attention_mask`` and ``position_ids`` for the mask) in its place. The segment after the
cut then holds the nodes that make the tensor (the extractor walks back from what the
segment needs to what it is given), and those nodes run with the same inputs and kernels
as in the whole model, so the split stays bit-exact ([Note: cut sets]).

A tensor is *rebuildable* when every node that makes it, walked back to model inputs and
constants, reads no state input (a KV cache stays where it is), holds no subgraph, is
deterministic, applies no weight matrix (a MatMul, Gemm, Gather or convolution reading an
initializer of rank 2 or more: the embedding and the blocks' projections, however small
a test model's), and the weights they read total at most ``REBUILD_MAX_WEIGHT_BYTES`` (a
rotary frequency vector), in at most ``REBUILD_MAX_NODES`` nodes. Those bounds keep the
work tiny beside the segment's: with no weight matrix applied, each node (a Shape,
Gather of a size, Range, Cast, comparison, Expand, Cos or Sin, or a product of two
tensors made from positions) costs in proportion to the few elements it makes, per
position, where a block applies matrices of hidden x hidden per position.

Every rebuildable tensor that crosses a cut is *rebuilt*, whatever its size beside its
roots: roots are model inputs, which carry the batch axis first ([Note: a split
decoder's batch axis] in :mod:`.decoder_points`), so the steps of several sessions stack
into one call, where a shape scalar (rank 0) never does; and they compress to almost
nothing under a lossless codec (``attention_mask`` is all ones unless padded,
``position_ids`` a count), and a tier that batches with ``--batch-padding`` pads
``attention_mask``, which it could not do to an expanded mask. So what crosses a
decoder's block boundary is its hidden state and the model inputs the later blocks
rebuild their mask and position tables from. Measured on an optimum Qwen2 decoder with
hidden 896 at a past of 2,032: a decode step's cut took 5,625 bytes raw (hidden 3,584,
bool mask 2,033, position_ids 8) and 3,394 under zstd (level 3, all-ones masks, a random
hidden state); now 19,864 raw (``attention_mask``
16,264) and 3,418 under zstd; a 2,000-token prefill's cut 11.2 MB raw (the mask [2000,
2000] was 4 MB of it), now 7.2 MB. The price is the raw decode step: an int64
``attention_mask`` takes eight bytes a key where the bool mask took one; the planner
prices that, codecs and all, from what crosses, and picks zstd where bytes cost. One decision
holds for every cut, and the second analysis of a decoder takes the first one's, so both
see the same cut sets ([Note: decoder analysis points] in :mod:`.decoder_points`).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import onnx

from tierflow.partitioner.cuts import _NONDETERMINISTIC_OPS, NodeUsage
from tierflow.partitioner.tensors import TensorInfo, subgraphs

#: Weights a rebuilt tensor's nodes may read in all (a rotary frequency vector is 256 B).
REBUILD_MAX_WEIGHT_BYTES = 64 << 10
#: Nodes a rebuilt tensor's nodes may number (an exporter's mask takes a few dozen).
REBUILD_MAX_NODES = 256
#: Nodes that apply a weight matrix when one of their inputs is an initializer of rank >= 2.
_WEIGHT_OPS = frozenset(
    {"MatMul", "Gemm", "Gather", "Conv", "ConvTranspose", "Einsum", "MatMulInteger",
     "QLinearMatMul", "MatMulNBits", "GatherBlockQuantized", "DynamicQuantizeMatMul"}
)  # fmt: skip


@dataclass(frozen=True)
class Cone:
    """What rebuilding one tensor takes: the model inputs, nodes and weights it reads."""

    roots: frozenset[str]
    nodes: frozenset[int]
    weights: frozenset[str]


def rebuildable(graph: onnx.GraphProto, usage: NodeUsage, inputs: Sequence[str]) -> dict[str, Cone]:
    """Every activation a tier could rebuild from ``inputs`` (model inputs, no state)."""
    empty: frozenset[Any] = frozenset()
    cones = {name: Cone(frozenset({name}), empty, empty) for name in inputs}
    matrices = {t.name for t in graph.initializer if len(t.dims) >= 2}
    for i, node in enumerate(graph.node):
        if i in usage.constant_nodes:
            continue
        if node.op_type in _NONDETERMINISTIC_OPS or any(True for _ in subgraphs(node)):
            continue
        if node.op_type in _WEIGHT_OPS and any(n in matrices for n in node.input):
            continue
        parts = [cones.get(u) for u in usage.uses[i] if u not in usage.constants]
        if not parts or any(p is None for p in parts):
            continue
        found = [p for p in parts if p is not None]
        nodes = frozenset({i}).union(*(p.nodes for p in found))
        weights = usage.weights[i].union(*(p.weights for p in found))
        if len(nodes) > REBUILD_MAX_NODES:
            continue
        if sum(usage.weight_nbytes.get(w, 0) for w in weights) > REBUILD_MAX_WEIGHT_BYTES:
            continue
        cone = Cone(frozenset().union(*(p.roots for p in found)), nodes, weights)
        for name in node.output:
            if name:
                cones[name] = cone
    return {name: cone for name, cone in cones.items() if name not in inputs}


def choose_rebuilt(
    sets: Sequence[tuple[str, ...]],
    cones: Mapping[str, Cone],
    tensors: Mapping[str, TensorInfo],
) -> tuple[str, ...]:
    """The crossing tensors tiers rebuild ([Note: derived tensors stay home]): every one a
    cone makes from roots that may cross a cut, in order of first crossing."""
    chosen: list[str] = []
    seen: set[str] = set()
    for crossing in sets[1:-1]:
        for name in crossing:
            if name in seen or name not in cones or name not in tensors:
                continue
            seen.add(name)
            if all(r in tensors for r in cones[name].roots):
                chosen.append(name)
    return tuple(chosen)


def rebuilt_sets(
    sets: Sequence[tuple[str, ...]],
    cones: Mapping[str, Cone],
    rebuilt: Collection[str],
    inputs: Sequence[str],
) -> list[tuple[str, ...]]:
    """``sets`` with each rebuilt tensor replaced by its roots (model inputs first, in their
    order). A root stays in every set from the model inputs to the last that needs it (a
    segment can pass on only what it was given); the first set (the model inputs) and the
    last (the outputs) stay as they are."""
    inner = [[n for n in crossing if n not in rebuilt or n not in cones] for crossing in sets]
    needed: dict[str, int] = {}
    for index in range(1, len(sets) - 1):
        for name in sets[index]:
            if name in rebuilt and name in cones:
                for root in cones[name].roots:
                    needed[root] = index
    out = [tuple(sets[0])]
    for index in range(1, len(sets) - 1):
        kept = inner[index]
        added = [n for n in inputs if needed.get(n, 0) >= index and n not in kept]
        out.append((*added, *kept))
    if len(sets) > 1:
        out.append(tuple(sets[-1]))
    return out
