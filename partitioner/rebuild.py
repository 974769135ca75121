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
rotary frequency vector), in at most ``REBUILD_MAX_NODES`` nodes.
It is *rebuilt* when, at the point the graph is analysed, its bytes are at least those of
its roots that would not cross with it anyway: the rotary tables (256 bytes a token for
``position_ids``' 8) always are; a mask read from an int64 ``attention_mask`` one byte a
key against eight is not, at a decode step, so it still crosses (a lossless codec
shrinks both, all ones, to almost nothing). One decision holds for every cut, and the
second analysis of a decoder takes the first one's, so both see the same cut sets
([Note: decoder analysis points] in :mod:`.decoder_points`).
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
    """The crossing tensors worth rebuilding at this point ([Note: derived tensors stay home]):
    each is at least as large as its roots that do not cross beside it at every cut."""
    chosen: list[str] = []
    seen: set[str] = set()
    for crossing in sets[1:-1]:
        for name in crossing:
            if name in seen or name not in cones or name not in tensors:
                continue
            seen.add(name)
            beside = [set(s) for s in sets[1:-1] if name in s]
            always = set.intersection(*beside) if beside else set()
            extra = [r for r in cones[name].roots if r not in always]
            if all(r in tensors for r in extra) and tensors[name].nbytes >= sum(
                tensors[r].nbytes for r in extra
            ):
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
