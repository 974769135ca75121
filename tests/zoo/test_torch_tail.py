"""Torch's re-run of the layers after a cut matches ONNX Runtime, or says why it cannot."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tierflow.partitioner.graph import load_model

torch = pytest.importorskip("torch")

from tierflow.zoo.torch_tail import UnsupportedTail, build_tail, checked_tail  # noqa: E402


def _model(path: Path, last_op: str = "Softmax") -> Path:
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.normal(0, 0.5, (6, 3, 3, 3)).astype(np.float32), "w"),
        numpy_helper.from_array(rng.normal(0, 0.5, (6,)).astype(np.float32), "b"),
        numpy_helper.from_array(np.array([1, -1], np.int64), "shape"),
    ]
    nodes = [
        helper.make_node("Relu", ["x"], ["feat"]),
        helper.make_node("Conv", ["feat", "w", "b"], ["c"], pads=[1, 1, 1, 1], strides=[2, 2]),
        helper.make_node("HardSwish", ["c"], ["h"]),
        helper.make_node("MaxPool", ["h"], ["p"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Reshape", ["p", "shape"], ["flat"]),
        helper.make_node(last_op, ["flat"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "tail",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 24])],
        inits,
    )
    onnx.save_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


@pytest.mark.integration
def test_the_tail_matches_onnxruntime_and_carries_gradients(tmp_path: Path) -> None:
    import onnxruntime as ort

    path = _model(tmp_path / "m.onnx")
    graph = load_model(path)
    x = np.random.default_rng(1).normal(0, 1, (1, 3, 8, 8)).astype(np.float32)
    feature = np.maximum(x, 0)
    expected = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(
        None, {"x": x}
    )
    tail, how = checked_tail(graph.model, "feat", ["y"], feature, expected)
    assert tail is not None and how.startswith("features + outputs")
    start = torch.tensor(feature, requires_grad=True)
    (out,) = build_tail(graph.model, "feat", ["y"])(start)
    np.testing.assert_allclose(out.detach().numpy(), expected[0], rtol=1e-5, atol=1e-6)
    out[0, 0].backward()
    assert start.grad is not None and float(start.grad.abs().sum()) > 0


def test_an_unsupported_operator_means_features_only(tmp_path: Path) -> None:
    graph = load_model(_model(tmp_path / "m.onnx", last_op="Erf"))
    with pytest.raises(UnsupportedTail, match="Erf"):
        build_tail(graph.model, "feat", ["y"])
    tail, how = checked_tail(graph.model, "feat", ["y"], np.zeros((1, 3, 8, 8), np.float32), [])
    assert tail is None and "features only" in how and "Erf" in how
