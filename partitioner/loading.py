"""Reading a model file as users have it: parse, external data, hash, node order.

:func:`read_model` parses the ``.onnx`` file, checks the weights kept in external data
files beside it (leaving them there) and hashes everything it read (the sha256 a plan
and a profile are tied to);
:func:`sort_nodes` puts the nodes in topological order; :func:`drop_initializer_inputs`
stops initializers from posing as inputs. :func:`tierflow.partitioner.graph.load_model`
calls them before fixing shapes (:mod:`tierflow.partitioner.shapes`).
"""

from __future__ import annotations

import hashlib
import heapq
import logging
from pathlib import Path

import onnx
from google.protobuf.message import DecodeError

from tierflow.errors import ModelError
from tierflow.partitioner.tensors import first_line, node_uses
from tierflow.partitioner.weights import SPILL_BYTES, anchor, spill, weight_files_digest

logger = logging.getLogger(__name__)


def read_model(path: Path) -> tuple[onnx.ModelProto, str]:
    """Parse the model's graph, check its external data, and hash the bytes it came from.

    Weights in external data files stay there: each such tensor keeps its reference, with
    its location made absolute ([Note: weights stay on disk] in :mod:`.weights`), so the
    proto holds the graph and the weights inside the .onnx file only. The hash is sha256
    of the .onnx file when the weights are inside it; with external data it also covers
    each data file, in sorted location order, each preceded by its location, so moving
    weights between files changes it. A data file missing or too short is a ModelError.
    """
    try:
        raw = path.read_bytes()
    except FileNotFoundError as exc:
        raise ModelError(f"model file {path} does not exist") from exc
    except OSError as exc:
        raise ModelError(f"cannot read model file {path}: {exc}") from exc
    if not raw:
        raise ModelError(f"{path} is empty, not an ONNX model")
    try:
        model = onnx.load_model_from_string(raw)
    except (DecodeError, ValueError, RuntimeError) as exc:
        raise ModelError(
            f"{path} is not an ONNX model (or is truncated): {first_line(exc)}"
        ) from exc
    if not model.HasField("graph") or not model.opset_import:
        raise ModelError(f"{path} is not an ONNX model: it has no graph or no opset import")
    digest = hashlib.sha256(raw)
    large = len(raw) > SPILL_BYTES
    del raw
    files = anchor(model, path)
    if large:
        model = spill(model)
    weight_files_digest(files, digest, path.parent.resolve())
    return model, digest.hexdigest()


def _topological_order(graph: onnx.GraphProto, path: Path) -> list[int]:
    """The file's node order if it is topological, else a deterministic Kahn sort.

    Ties go to the node that comes first in the file. A name nothing defines, or a
    cycle, is a ModelError.
    """
    nodes = list(graph.node)
    available = {v.name for v in graph.input} | {t.name for t in graph.initializer}
    uses = [node_uses(n) for n in nodes]
    valid = True
    seen = set(available)
    for node, needed in zip(nodes, uses, strict=True):
        if any(name not in seen for name in needed):
            valid = False
            break
        seen.update(n for n in node.output if n)
    if valid:
        return list(range(len(nodes)))
    producer: dict[str, int] = {}
    for i, node in enumerate(nodes):
        for name in node.output:
            if name:
                producer[name] = i
    waiting = [0] * len(nodes)
    consumers: dict[int, list[int]] = {}
    for i, needed in enumerate(uses):
        for name in set(needed):
            if name in available:
                continue
            if name not in producer:
                raise ModelError(
                    f"invalid graph in {path}: node {nodes[i].name or nodes[i].op_type!r} "
                    f"reads {name!r}, which no input, initializer or node provides"
                )
            waiting[i] += 1
            consumers.setdefault(producer[name], []).append(i)
    ready = [i for i, count in enumerate(waiting) if count == 0]
    heapq.heapify(ready)
    order: list[int] = []
    while ready:
        i = heapq.heappop(ready)
        order.append(i)
        for j in consumers.get(i, []):
            waiting[j] -= 1
            if waiting[j] == 0:
                heapq.heappush(ready, j)
    if len(order) != len(nodes):
        raise ModelError(f"invalid graph in {path}: its nodes form a cycle")
    logger.info("[graph] %s: nodes were not in topological order; sorted them", path)
    return order


def sort_nodes(model: onnx.ModelProto, path: Path) -> None:
    """Put the nodes in topological order (the checker and the Extractor need it)."""
    order = _topological_order(model.graph, path)
    if order != sorted(order):
        graph = model.graph
        ordered = [onnx.NodeProto.FromString(graph.node[i].SerializeToString()) for i in order]
        del graph.node[:]
        graph.node.extend(ordered)


def drop_initializer_inputs(model: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    """Remove initializers from the graph inputs; return the real inputs.

    Initializers listed as inputs (keep_initializers_as_inputs) are overridable in ONNX
    Runtime, which then cannot pre-pack them and rounds differently from the segments,
    where they are plain weights. They are constants here ([Note: cut sets]).
    """
    graph = model.graph
    initializer_names = {t.name for t in graph.initializer}
    real = [v for v in graph.input if v.name not in initializer_names]
    if len(real) != len(graph.input):
        kept = [onnx.ValueInfoProto.FromString(v.SerializeToString()) for v in real]
        del graph.input[:]
        graph.input.extend(kept)
        model.ir_version = max(model.ir_version, 4)  # IR 3 required them among the inputs
        real = list(graph.input)
    return real
