"""One session factory: the tiers' options, ModelError on failure, the only opener."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from tierflow.errors import ModelError, UsageError
from tierflow.onnxrt.inference import OPTIMIZATION_LEVELS, open_session, session_options

ROOT = Path(__file__).resolve().parents[3]
# Everything that runs models: the packages, the benchmarks and the scripts.
SOURCES = (
    "tierflow",
    "device",
    "edge",
    "cloud",
    "partitioner",
    "demos",
    "zoo",
    "benchmarks",
    "scripts",
)


def _relu(path: Path) -> Path:
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "relu",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def test_a_session_runs_with_the_options_asked_for(tmp_path: Path) -> None:
    path = _relu(tmp_path / "relu.onnx")
    for model in (path, path.read_bytes()):
        session = open_session(model, threads=2, optimization="basic")
        (y,) = session.run(["y"], {"x": np.array([-1.0, 2.0], np.float32)})
        np.testing.assert_array_equal(y, [0.0, 2.0])
        options = session.get_session_options()
        assert options.intra_op_num_threads == 2
        assert options.graph_optimization_level == OPTIMIZATION_LEVELS["basic"]
    assert session_options(0, "all").intra_op_num_threads == 0


def test_load_failures_are_model_errors_naming_what(tmp_path: Path) -> None:
    broken = tmp_path / "broken.onnx"
    broken.write_bytes(b"not a model")
    with pytest.raises(ModelError, match=r"cannot load segment 3: \S"):
        open_session(broken, what="segment 3")
    with pytest.raises(ModelError, match=f"cannot load {tmp_path / 'missing.onnx'}"):
        open_session(tmp_path / "missing.onnx")
    with pytest.raises(ModelError, match="cannot load the model"):
        open_session(b"\x00garbage")
    with pytest.raises(UsageError, match="expected one of disabled, basic, extended, all"):
        open_session(_relu(tmp_path / "relu.onnx"), optimization="fastest")


def _calls_and_names() -> tuple[list[str], list[str]]:
    """Where ``InferenceSession(...)`` is called, and where OPTIMIZATION_LEVELS is assigned."""
    calls: list[str] = []
    assigned: list[str] = []
    for folder in SOURCES:
        for path in sorted((ROOT / folder).rglob("*.py")):
            where = str(path.relative_to(ROOT))
            for node in ast.walk(ast.parse(path.read_text(), where)):
                if isinstance(node, ast.Call):
                    func = node.func
                    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                    if name == "InferenceSession":
                        calls.append(where)
                targets = node.targets if isinstance(node, ast.Assign) else []
                if isinstance(node, ast.AnnAssign):
                    targets = [node.target]
                if any(getattr(t, "id", "") == "OPTIMIZATION_LEVELS" for t in targets):
                    assigned.append(where)
    return calls, assigned


def test_sessions_are_opened_and_levels_named_in_one_place() -> None:
    calls, assigned = _calls_and_names()
    assert calls == ["tierflow/onnxrt/inference.py"]
    assert assigned == ["tierflow/onnxrt/inference.py"]
