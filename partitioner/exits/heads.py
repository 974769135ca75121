"""Exit heads: pooling, a linear layer and softmax, trained in numpy and grafted with onnx.

A head reads one feature of the model. It average-pools a 4-D feature [N,C,H,W] to a
g x g grid per channel (g = 1 is global average pooling), averages a 3-D hidden state
over its sequence axis, or reads a 2-D one as it is; then one linear layer (ONNX
``Gemm``, weights as initializers) and ``Softmax``. Weights come from scikit-learn's
logistic regression on the pooled features (:func:`train_head`); :func:`pool_feature`
computes in numpy exactly what the grafted nodes compute in the graph. Grafting copies
the model and only adds nodes, initializers and outputs, so every original output
stays bit-for-bit the same. Used by :mod:`tierflow.partitioner.exits.add`.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper

from tierflow.errors import ModelError

logger = logging.getLogger(__name__)

_BATCH = 64


@dataclass(frozen=True)
class Head:
    """A trained exit head before grafting: output name, feature read, pooling, weights.

    ``grid`` g > 1 average-pools a 4-D feature to g x g cells instead of one (see
    :func:`pool_feature`); ``weight`` is [pooled features, classes].
    """

    name: str
    at: str
    grid: int
    weight: np.ndarray
    bias: np.ndarray


def run_model(
    model: onnx.ModelProto, inputs: Mapping[str, np.ndarray], outputs: Sequence[str]
) -> dict[str, np.ndarray]:
    """Run ``model`` in ONNX Runtime on rows of ``inputs`` and fetch ``outputs``.

    Intermediate tensors are added as graph outputs for the run. Rows go in batches of 64
    when every input's leading dimension is dynamic, else in batches of that dimension.
    """
    from tierflow.partitioner.weights import open_model_session

    proto = onnx.ModelProto()
    proto.CopyFrom(model)
    present = {o.name for o in proto.graph.output}
    for name in outputs:
        if name not in present:
            proto.graph.output.append(onnx.ValueInfoProto(name=name))
    session = open_model_session(proto, threads=0, optimization="all", what="the model")
    batch = _BATCH
    for item in proto.graph.input:
        dims = item.type.tensor_type.shape.dim
        if dims and dims[0].HasField("dim_value") and item.name in inputs:
            batch = min(batch, dims[0].dim_value)
    rows = len(next(iter(inputs.values())))
    chunks: list[list[np.ndarray]] = []
    for first in range(0, rows, batch):
        feeds = {name: array[first : first + batch] for name, array in inputs.items()}
        try:
            chunks.append(session.run(list(outputs), feeds))
        except Exception as exc:
            raise ModelError(f"ONNX Runtime failed on the calibration data: {exc}") from exc
    return {name: np.concatenate([c[i] for c in chunks]) for i, name in enumerate(outputs)}


def grid_for(shape: Sequence[int], grid: int) -> int:
    """``grid`` if it divides a 4-D feature's height and width, else 1 (global pooling)."""
    if len(shape) == 4 and grid > 1 and shape[2] % grid == 0 and shape[3] % grid == 0:
        return grid
    return 1


def pool_feature(feature: np.ndarray, grid: int = 1) -> np.ndarray:
    """What the grafted head computes before its linear layer: [rows, pooled features].

    A 4-D feature [N,C,H,W] is averaged over g x g equal cells (g = ``grid``; 1 is global
    average pooling) and flattened channel-major to C*g*g values: for small images where
    a stroke is matters as much as what it is (on the digits, a linear head on the stem's
    2x2-pooled feature is ~98% accurate, on its global pool ~81%). 3-D [N,T,D] is
    averaged over T, 2-D is used as it is.
    """
    if feature.ndim == 4 and grid > 1:
        n, c, h, w = feature.shape
        cells = feature.reshape(n, c, grid, h // grid, grid, w // grid)
        return cells.mean(axis=(3, 5), dtype=np.float64).reshape(n, c * grid * grid)
    if feature.ndim == 4:
        return feature.mean(axis=(2, 3), dtype=np.float64)
    if feature.ndim == 3:
        return feature.mean(axis=1, dtype=np.float64)
    if feature.ndim == 2:
        return feature.astype(np.float64)
    raise ModelError(f"an exit feature must be 2-D to 4-D, found shape {list(feature.shape)}")


def train_head(
    features: np.ndarray, targets: np.ndarray, classes: int
) -> tuple[np.ndarray, np.ndarray]:
    """Fit softmax regression; return ``weight`` [channels, classes] and ``bias`` [classes].

    Features are standardised for the fit and the scaling folded back into the weights,
    so the head in the graph reads the raw pooled feature. Classes absent from the
    targets get a bias of -30 (probability ~0).
    """
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.linear_model import LogisticRegression

    mean = features.mean(axis=0)
    std = features.std(axis=0) + 1e-6
    weight = np.zeros((features.shape[1], classes))
    bias = np.full(classes, -30.0)
    present = np.unique(targets)
    if len(present) == 1:
        bias[present[0]] = 30.0
        return weight.astype(np.float32), bias.astype(np.float32)
    regression = LogisticRegression(C=1.0, max_iter=2000)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)  # a head that is nearly fit is fine
        regression.fit((features - mean) / std, targets)
    coef, intercept = regression.coef_, regression.intercept_
    if len(present) == 2:  # one logit z for classes_[1]; softmax(-z/2, z/2) = sigmoid(z)
        coef = np.vstack([-coef, coef]) / 2
        intercept = np.concatenate([-intercept, intercept]) / 2
    for row, cls in enumerate(regression.classes_):
        weight[:, int(cls)] = coef[row] / std
        bias[int(cls)] = intercept[row] - float(np.dot(coef[row], mean / std))
    return weight.astype(np.float32), bias.astype(np.float32)


def graft_heads(model: onnx.ModelProto, heads: Sequence[Head]) -> onnx.ModelProto:
    """Copy ``model`` and add one head per :class:`Head`.

    Each head is pool (GlobalAveragePool, or AveragePool to a g x g grid, then Flatten
    for 4-D; ReduceMean over axis 1 for 3-D) -> Gemm -> Softmax; nothing existing is
    changed, so the original outputs stay bit-for-bit the same.
    """
    grafted = onnx.ModelProto()
    grafted.CopyFrom(model)
    if not heads:
        return grafted
    inferred = infer_shapes(grafted)
    shapes = value_shapes(inferred)
    taken = all_names(grafted)
    opset = next((o.version for o in grafted.opset_import if o.domain in ("", "ai.onnx")), 13)
    batch_dim = grafted.graph.output[0].type.tensor_type.shape.dim[0]
    for head in heads:
        name, point, weight, bias = head.name, head.at, head.weight, head.bias
        prefix = f"tierflow_{name}"
        new = {name, f"{prefix}_flat", f"{prefix}_pool", f"{prefix}_w", f"{prefix}_b"}
        clash = sorted(new & taken)
        if clash:
            raise ModelError(f"cannot add exit {name}: the model already has names {clash}")
        elem, shape = shapes.get(point, (onnx.TensorProto.FLOAT, None))
        source = point
        nodes: list[onnx.NodeProto] = []
        if elem != onnx.TensorProto.FLOAT:
            nodes.append(
                helper.make_node("Cast", [point], [f"{prefix}_cast"], to=onnx.TensorProto.FLOAT)
            )
            source = f"{prefix}_cast"
        rank = len(shape) if shape is not None else 4
        flat = f"{prefix}_flat"
        if rank == 4 and head.grid > 1:
            if shape is None or not isinstance(shape[2], int) or not isinstance(shape[3], int):
                raise ModelError(f"exit point {point!r} needs a static height and width to pool")
            kernel = [shape[2] // head.grid, shape[3] // head.grid]
            nodes.append(
                helper.make_node(
                    "AveragePool", [source], [f"{prefix}_pool"], kernel_shape=kernel, strides=kernel
                )
            )
            nodes.append(helper.make_node("Flatten", [f"{prefix}_pool"], [flat], axis=1))
        elif rank == 4:
            nodes.append(helper.make_node("GlobalAveragePool", [source], [f"{prefix}_pool"]))
            nodes.append(helper.make_node("Flatten", [f"{prefix}_pool"], [flat], axis=1))
        elif rank == 3:
            if opset >= 18:
                axes = numpy_helper.from_array(np.array([1], dtype=np.int64), f"{prefix}_axes")
                grafted.graph.initializer.append(axes)
                nodes.append(
                    helper.make_node("ReduceMean", [source, axes.name], [flat], keepdims=0)
                )
            else:
                nodes.append(helper.make_node("ReduceMean", [source], [flat], axes=[1], keepdims=0))
        else:
            flat = source
        grafted.graph.initializer.append(numpy_helper.from_array(weight, f"{prefix}_w"))
        grafted.graph.initializer.append(numpy_helper.from_array(bias, f"{prefix}_b"))
        nodes.append(
            helper.make_node("Gemm", [flat, f"{prefix}_w", f"{prefix}_b"], [f"{prefix}_logits"])
        )
        nodes.append(helper.make_node("Softmax", [f"{prefix}_logits"], [name], axis=-1))
        grafted.graph.node.extend(nodes)
        output = helper.make_tensor_value_info(
            name, onnx.TensorProto.FLOAT, [None, weight.shape[1]]
        )
        output.type.tensor_type.shape.dim[0].CopyFrom(batch_dim)
        grafted.graph.output.append(output)
        taken |= new
    check_model(grafted, "the model with exit heads")
    return grafted


def check_model(model: onnx.ModelProto, what: str) -> None:
    try:
        onnx.checker.check_model(model)
    except onnx.checker.ValidationError as exc:
        raise ModelError(f"{what} is not a valid ONNX model: {exc}") from exc


def infer_shapes(model: onnx.ModelProto) -> onnx.ModelProto:
    try:
        return onnx.shape_inference.infer_shapes(model)
    except Exception as exc:
        raise ModelError(f"shape inference failed on the model: {exc}") from exc


def value_shapes(model: onnx.ModelProto) -> dict[str, tuple[int, tuple[int | str, ...] | None]]:
    values = [*model.graph.input, *model.graph.value_info, *model.graph.output]
    shapes: dict[str, tuple[int, tuple[int | str, ...] | None]] = {}
    for value in values:
        tensor = value.type.tensor_type
        dims = None
        if tensor.HasField("shape"):
            dims = tuple(
                d.dim_value if d.HasField("dim_value") else d.dim_param for d in tensor.shape.dim
            )
        shapes[value.name] = (tensor.elem_type, dims)
    return shapes


def all_names(model: onnx.ModelProto) -> set[str]:
    graph = model.graph
    names = {i.name for i in graph.input} | {i.name for i in graph.initializer}
    for node in graph.node:
        names.update(node.output)
    return names
