"""Facts about ONNX tensors and nodes that loading, shape fixing and cut search share.

:class:`TensorInfo` (an activation's dtype and static shape), the names a node reads
(:func:`node_uses`, which makes control-flow nodes atomic: see [Note: cut sets] in
:mod:`tierflow.partitioner.cuts`), walks over subgraphs and stored tensors, and the
numpy names of ONNX element types.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
import onnx.helper

from tierflow.errors import ModelError

# numpy has no dtype for these ONNX element types; their sizes in bytes.
_ITEMSIZE_FALLBACK = {"bfloat16": 2, "float8e4m3fn": 1, "float8e4m3fnuz": 1, "float8e5m2": 1,
                      "float8e5m2fnuz": 1, "int4": 1, "uint4": 1, "float4e2m1": 1}  # fmt: skip


def first_line(exc: BaseException) -> str:
    """An exception's message cut to its first line (onnx and ORT write whole reports)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _itemsize(dtype: str) -> int:
    try:
        return int(np.dtype(dtype).itemsize)
    except TypeError:
        return _ITEMSIZE_FALLBACK.get(dtype, 1)


@dataclass(frozen=True)
class TensorInfo:
    """An activation tensor: its name, numpy dtype name and static shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * _itemsize(self.dtype)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}

    @classmethod
    def from_dict(cls, data: Any) -> TensorInfo:
        try:
            return cls(str(data["name"]), str(data["dtype"]), tuple(int(d) for d in data["shape"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelError(f"malformed tensor description {data!r}: {exc}") from exc


def subgraphs(node: onnx.NodeProto) -> Iterator[onnx.GraphProto]:
    for attr in node.attribute:
        if attr.type == onnx.AttributeProto.GRAPH:
            yield attr.g
        elif attr.type == onnx.AttributeProto.GRAPHS:
            yield from attr.graphs


def _outer_refs(graph: onnx.GraphProto) -> set[str]:
    """Names a subgraph reads from enclosing scopes (recursively through nested bodies)."""
    defined = {v.name for v in graph.input} | {t.name for t in graph.initializer}
    refs: set[str] = set()
    for node in graph.node:
        for name in node.input:
            if name and name not in defined:
                refs.add(name)
        for sub in subgraphs(node):
            refs |= _outer_refs(sub) - defined
        defined.update(n for n in node.output if n)
    return refs


def node_uses(node: onnx.NodeProto) -> tuple[str, ...]:
    """A node's inputs plus the outer-scope names its subgraphs read, without duplicates.

    For liveness a control-flow node reads everything its bodies reference, so it is
    atomic: see [Note: cut sets].
    """
    names = [n for n in node.input if n]
    for sub in subgraphs(node):
        names.extend(sorted(_outer_refs(sub)))
    return tuple(dict.fromkeys(names))


def all_tensors(graph: onnx.GraphProto) -> Iterator[onnx.TensorProto]:
    yield from graph.initializer
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.TENSOR:
                yield attr.t
            elif attr.type == onnx.AttributeProto.TENSORS:
                yield from attr.tensors
        for sub in subgraphs(node):
            yield from all_tensors(sub)


def np_dtype_name(elem_type: int) -> str:
    try:
        return str(onnx.helper.tensor_dtype_to_np_dtype(elem_type).name)
    except (KeyError, TypeError) as exc:
        raise ModelError(
            f"unsupported tensor element type {elem_type} "
            f"({onnx.TensorProto.DataType.Name(elem_type)})"
        ) from exc


def tensor_nbytes(tensor: onnx.TensorProto) -> int:
    count = int(np.prod(tensor.dims, dtype=np.int64))
    return count * _itemsize(np_dtype_name(tensor.data_type))
