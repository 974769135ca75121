"""The rest of an ONNX model after a cut, run by torch so that gradients flow through it.

Training a learned bottleneck against the model's *outputs* (not only its features)
needs the frozen layers after the cut to be differentiable. onnx2torch would convert the
graph, but it requires torchvision, which tierflow does not install; this module instead
interprets the analysed graph node by node with ``torch.nn.functional``, for the operators
convnet classifiers and detectors use (:data:`SUPPORTED_OPS`). A graph with any other
operator after the cut raises :class:`UnsupportedTail`, and the caller trains on features
only. :func:`checked_tail` checks its result against ONNX Runtime before it is used.

Weights become frozen tensors; the tensor at the cut is the only input that carries
gradients. Shapes are static (the graph is the planner's analysed model, whose shapes are
fixed for one request and whose Shape/Size nodes are folded to constants); the tail runs a
batch of requests along axis 0, so a Reshape to a constant shape with a leading 1 (the
analysed batch) keeps the batch instead. Needs torch (the ``train`` extra).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from tierflow.errors import ModelError

SUPPORTED_OPS = frozenset(
    {
        "Add", "AveragePool", "BatchNormalization", "Cast", "Clip", "Concat", "Constant",
        "Conv", "Div", "Dropout", "Flatten", "Gemm", "GlobalAveragePool", "HardSigmoid",
        "HardSwish", "Identity", "MatMul", "MaxPool", "Mul", "ReduceMean", "Relu", "Reshape",
        "Sigmoid", "Slice", "Softmax", "Squeeze", "Sub", "Tanh", "Transpose", "Unsqueeze",
    }
)  # fmt: skip


class UnsupportedTail(ModelError):
    """The layers after the cut use an operator this interpreter does not implement."""


def _attrs(node: onnx.NodeProto) -> dict[str, Any]:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def _pads(attrs: dict[str, Any], spatial: int) -> tuple[list[int], bool]:
    """ONNX pads [b1, b2, ..., e1, e2, ...] as torch's symmetric padding, if symmetric."""
    if attrs.get("auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET"):
        raise UnsupportedTail("auto_pad other than NOTSET is not supported")
    pads = list(attrs.get("pads", [0] * 2 * spatial))
    begin, end = pads[:spatial], pads[spatial:]
    return begin, begin == end


def _run_node(torch: Any, op: str, attrs: dict[str, Any], x: list[Any]) -> list[Any]:
    fn = torch.nn.functional
    if op in ("Identity", "Dropout"):
        return [x[0]]
    if op == "Relu":
        return [torch.relu(x[0])]
    if op == "Sigmoid":
        return [torch.sigmoid(x[0])]
    if op == "Tanh":
        return [torch.tanh(x[0])]
    if op == "HardSigmoid":
        alpha, beta = attrs.get("alpha", 0.2), attrs.get("beta", 0.5)
        return [torch.clamp(alpha * x[0] + beta, 0.0, 1.0)]
    if op == "HardSwish":
        return [x[0] * torch.clamp(x[0] / 6.0 + 0.5, 0.0, 1.0)]
    if op == "Clip":
        low = x[1] if len(x) > 1 and x[1] is not None else attrs.get("min")
        high = x[2] if len(x) > 2 and x[2] is not None else attrs.get("max")
        low = None if low is None else float(low)
        high = None if high is None else float(high)
        return [torch.clamp(x[0], low, high)]
    if op in ("Add", "Sub", "Mul", "Div"):
        fns = {"Add": torch.add, "Sub": torch.sub, "Mul": torch.mul, "Div": torch.div}
        return [fns[op](x[0], x[1])]
    if op == "Conv":
        spatial = x[0].dim() - 2
        begin, symmetric = _pads(attrs, spatial)
        data = x[0]
        if not symmetric:
            pads = list(attrs["pads"])
            flat = [p for i in reversed(range(spatial)) for p in (pads[i], pads[i + spatial])]
            data, begin = fn.pad(data, flat), [0] * spatial
        conv = {1: fn.conv1d, 2: fn.conv2d, 3: fn.conv3d}[spatial]
        return [
            conv(
                data,
                x[1],
                x[2] if len(x) > 2 else None,
                stride=list(attrs.get("strides", [1] * spatial)),
                padding=begin,
                dilation=list(attrs.get("dilations", [1] * spatial)),
                groups=int(attrs.get("group", 1)),
            )
        ]
    if op == "BatchNormalization":
        return [fn.batch_norm(x[0], x[3], x[4], x[1], x[2], False, 0.0, attrs.get("epsilon", 1e-5))]
    if op == "GlobalAveragePool":
        return [x[0].mean(dim=tuple(range(2, x[0].dim())), keepdim=True)]
    if op in ("MaxPool", "AveragePool"):
        spatial = x[0].dim() - 2
        dilated = any(d != 1 for d in attrs.get("dilations", [1, 1]))
        if spatial != 2 or attrs.get("ceil_mode", 0) or dilated:
            raise UnsupportedTail(f"{op} other than plain 2-D pooling is not supported")
        begin, symmetric = _pads(attrs, spatial)
        if not symmetric:
            raise UnsupportedTail(f"{op} with asymmetric padding is not supported")
        kernel, stride = list(attrs["kernel_shape"]), list(attrs.get("strides", [1, 1]))
        if op == "MaxPool":
            return [fn.max_pool2d(x[0], kernel, stride, begin)]
        include = bool(attrs.get("count_include_pad", 0))
        return [fn.avg_pool2d(x[0], kernel, stride, begin, count_include_pad=include)]
    if op == "ReduceMean":
        axes = attrs.get("axes")
        if axes is None and len(x) > 1 and x[1] is not None:
            axes = [int(a) for a in x[1].tolist()]
        dims = tuple(axes) if axes else tuple(range(x[0].dim()))
        return [x[0].mean(dim=dims, keepdim=bool(attrs.get("keepdims", 1)))]
    if op == "Flatten":
        axis = int(attrs.get("axis", 1)) % max(x[0].dim(), 1)
        return [x[0].reshape(int(np.prod(x[0].shape[:axis])), -1)]
    if op == "Reshape":
        shape = [int(s) for s in x[1].tolist()]
        if not attrs.get("allowzero", 0):
            shape = [x[0].shape[i] if s == 0 else s for i, s in enumerate(shape)]
        if shape and shape[0] == 1:
            shape[0] = x[0].shape[0]  # the analysed graph's batch of 1 is the batch here
        return [x[0].reshape(shape)]
    if op == "Transpose":
        perm = attrs.get("perm", list(reversed(range(x[0].dim()))))
        return [x[0].permute(*perm)]
    if op == "Squeeze":
        axes = attrs.get("axes") or ([int(a) for a in x[1].tolist()] if len(x) > 1 else None)
        if axes is None:
            return [x[0].squeeze()]
        out = x[0]
        for axis in sorted((a % out.dim() for a in axes), reverse=True):
            out = out.squeeze(axis)
        return [out]
    if op == "Unsqueeze":
        axes = attrs.get("axes") or [int(a) for a in x[1].tolist()]
        out = x[0]
        rank = out.dim() + len(axes)
        for axis in sorted(a % rank for a in axes):
            out = out.unsqueeze(axis)
        return [out]
    if op == "Concat":
        return [torch.cat(list(x), dim=int(attrs["axis"]))]
    if op == "MatMul":
        return [torch.matmul(x[0], x[1])]
    if op == "Gemm":
        a = x[0].transpose(-1, -2) if attrs.get("transA", 0) else x[0]
        b = x[1].transpose(-1, -2) if attrs.get("transB", 0) else x[1]
        out = attrs.get("alpha", 1.0) * (a @ b)
        if len(x) > 2 and x[2] is not None:
            out = out + attrs.get("beta", 1.0) * x[2]
        return [out]
    if op == "Slice":
        starts, ends = x[1].tolist(), x[2].tolist()
        axes = x[3].tolist() if len(x) > 3 and x[3] is not None else list(range(len(starts)))
        steps = x[4].tolist() if len(x) > 4 and x[4] is not None else [1] * len(starts)
        if any(step < 1 for step in steps):
            raise UnsupportedTail("Slice with negative steps is not supported")
        index = [slice(None)] * x[0].dim()
        for start, end, axis, step in zip(starts, ends, axes, steps, strict=True):
            size = x[0].shape[axis]
            index[axis] = slice(max(-size, min(start, size)), max(-size, min(end, size)), step)
        return [x[0][tuple(index)]]
    if op == "Softmax":
        return [torch.softmax(x[0], dim=int(attrs.get("axis", -1)))]
    if op == "Cast":
        to = onnx.helper.tensor_dtype_to_np_dtype(int(attrs["to"]))
        if to != np.float32:
            raise UnsupportedTail(f"Cast to {to} is not supported after the cut")
        return [x[0].float()]
    if op == "Constant":
        return [torch.from_numpy(numpy_helper.to_array(attrs["value"]).copy())]
    raise UnsupportedTail(f"operator {op} is not supported after the cut")


def build_tail(
    model: onnx.ModelProto, start: str, outputs: Sequence[str]
) -> Callable[[Any], list[Any]]:
    """A function: the tensor ``start`` (a torch tensor) -> the model's ``outputs``.

    ``model`` must be the analysed model (static shapes, Shape folded, nodes in order).
    Only the nodes ``outputs`` depend on are run; a node that needs a non-constant tensor
    from before the cut other than ``start`` is a :class:`ModelError`.
    """
    import torch

    producer = {out: i for i, node in enumerate(model.graph.node) for out in node.output}
    needed: set[int] = set()
    stack = [producer[name] for name in outputs if name in producer]
    initializers = {t.name: t for t in model.graph.initializer}
    while stack:
        i = stack.pop()
        if i in needed:
            continue
        needed.add(i)
        for name in model.graph.node[i].input:
            if name and name != start and name in producer:
                stack.append(producer[name])
    order = sorted(needed)
    unsupported = sorted({model.graph.node[i].op_type for i in order} - SUPPORTED_OPS)
    if unsupported:
        raise UnsupportedTail(f"operators {unsupported} after the cut are not supported")
    constants = {
        name: torch.from_numpy(numpy_helper.to_array(t).copy()) for name, t in initializers.items()
    }
    graph_inputs = {i.name for i in model.graph.input} - set(initializers)
    for i in order:
        for name in model.graph.node[i].input:
            if name in graph_inputs and name != start:
                raise ModelError(f"the layers after the cut read model input {name!r} directly")
    steps = [(model.graph.node[i], _attrs(model.graph.node[i])) for i in order]

    def tail(feature: Any) -> list[Any]:
        values: dict[str, Any] = dict(constants)
        values[start] = feature
        for node, attrs in steps:
            args = [values[name] if name else None for name in node.input]
            for name, value in zip(
                node.output, _run_node(torch, node.op_type, attrs, args), strict=False
            ):
                values[name] = value
        return [values[name] for name in outputs]

    return tail


# Relative difference from ONNX Runtime above which torch's re-run is not trusted.
TAIL_TOLERANCE = 1e-3


def checked_tail(
    model: onnx.ModelProto,
    start: str,
    outputs: Sequence[str],
    features: np.ndarray,
    expected: Sequence[np.ndarray],
) -> tuple[Callable[[Any], list[Any]] | None, str]:
    """:func:`build_tail`, if it reproduces ONNX Runtime's ``expected`` outputs on a few rows.

    Returns the tail (or None) and how training will distil, for the user to read.
    """
    import torch

    try:
        tail = build_tail(model, start, outputs)
        with torch.no_grad():
            got = tail(torch.from_numpy(np.ascontiguousarray(features[:4], dtype=np.float32)))
    except UnsupportedTail as exc:
        return None, f"features only ({exc})"
    except (ModelError, RuntimeError, ValueError, KeyError, IndexError) as exc:
        return None, f"features only (the layers after the cut did not run in torch: {exc})"
    worst = 0.0
    for want, have in zip(expected, got, strict=True):
        scale = float(np.abs(want[:4]).max()) or 1.0
        worst = max(worst, float(np.abs(want[:4] - have.numpy()).max()) / scale)
    if worst > TAIL_TOLERANCE:
        return None, f"features only (torch's re-run of the later layers differs by {worst:.2g})"
    return tail, "features + outputs (the layers after the cut re-run in torch)"
