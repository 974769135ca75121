"""Splitting: chained segments reproduce the whole model bit for bit; files and specs."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from tierflow.errors import PlanError
from tierflow.partitioner.extract import SegmentExtractor
from tierflow.partitioner.graph import ModelGraph, load_model
from tierflow.partitioner.split import (
    extract_segment,
    run_segments,
    session,
    split_model,
    verify_split,
    write_segments,
)
from tierflow.plan import Plan, SegmentSpec

MODELS = ("chain_cnn", "resnet18", "mobilenet_v2", "transformer_encoder")

_GRAPHS: dict[tuple[str, bool, bool], ModelGraph] = {}


def _graph(zoo_exports: Any, name: str, dynamo: bool, external: bool = False) -> ModelGraph:
    key = (name, dynamo, external)
    if key not in _GRAPHS:
        _GRAPHS[key] = load_model(zoo_exports.path(name, dynamo=dynamo, external=external))
    return _GRAPHS[key]


def _cut_pairs(graph: ModelGraph) -> list[tuple[int, int]]:
    """Pairs covering every tier layout: all three busy, and each tier (or two) empty."""
    last = len(graph.cuts) - 1
    a, b = max(1, last // 3), max(1, 2 * last // 3)
    return [(a, b), (0, 0), (last, last), (a, a), (0, b), (a, last), (1, last - 1)]


@pytest.mark.integration
@pytest.mark.parametrize("dynamo", [True, False], ids=["dynamo", "legacy"])
@pytest.mark.parametrize("name", MODELS)
def test_split_equals_unsplit_bitwise(zoo_exports: Any, name: str, dynamo: bool) -> None:
    graph = _graph(zoo_exports, name, dynamo)
    for pair in _cut_pairs(graph):
        segments = split_model(graph, pair)
        result = verify_split(graph, segments)
        assert result.bitwise_equal, (name, dynamo, pair, result)
        assert result.max_abs_diff == 0.0
        assert result.outputs == tuple(o.name for o in graph.outputs)


@pytest.mark.integration
@pytest.mark.parametrize(("name", "dynamo"), [("resnet18", True), ("chain_cnn", False)])
def test_split_with_external_data(zoo_exports: Any, name: str, dynamo: bool) -> None:
    path = zoo_exports.path(name, dynamo=dynamo, external=True)
    assert (path.parent / (path.name + ".data")).is_file()
    graph = _graph(zoo_exports, name, dynamo, external=True)
    inline = _graph(zoo_exports, name, dynamo)
    assert [c.tensors for c in graph.cuts] == [c.tensors for c in inline.cuts]
    for pair in _cut_pairs(graph):
        assert verify_split(graph, split_model(graph, pair)).bitwise_equal, pair


@pytest.mark.integration
@pytest.mark.parametrize("dynamo", [True, False], ids=["dynamo", "legacy"])
def test_chain_matches_the_original_file_and_torch(zoo_exports: Any, dynamo: bool) -> None:
    """The analysed model (shapes fixed, Shape nodes folded) still computes the original."""
    import torch

    path = zoo_exports.path("transformer_encoder", dynamo=dynamo)
    graph = _graph(zoo_exports, "transformer_encoder", dynamo)
    module, example = zoo_exports.module("transformer_encoder")
    feeds = {"input": example[0].numpy(), "mask": example[1].numpy()}
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    original = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    want = original.run(None, feeds)[0]
    got = run_segments(split_model(graph, (3, len(graph.cuts) - 3)), feeds)
    assert got["output"].tobytes() == want.tobytes()
    with torch.no_grad():
        reference = module(*example).numpy()
    np.testing.assert_allclose(got["output"], reference, rtol=1e-4, atol=1e-5)


@pytest.mark.integration
def test_segments_are_valid_models_with_source_opsets(zoo_exports: Any) -> None:
    graph = _graph(zoo_exports, "resnet18", True)
    last = len(graph.cuts) - 1
    segments = split_model(graph, (4, last - 4))
    assert [spec.tier for spec, _ in segments] == ["device", "edge", "cloud"]
    assert [spec.file for spec, _ in segments] == [
        "00-device.onnx",
        "01-edge.onnx",
        "02-cloud.onnx",
    ]
    for spec, model in segments:
        onnx.checker.check_model(model, full_check=True)
        assert model.ir_version == graph.model.ir_version
        assert list(model.opset_import) == list(graph.model.opset_import)
        assert [v.name for v in model.graph.input] == list(spec.inputs)
        assert [v.name for v in model.graph.output] == list(spec.outputs)
    assert segments[0][0].inputs == tuple(i.name for i in graph.inputs)
    assert segments[1][0].inputs == graph.cuts[4].tensors
    assert segments[-1][0].outputs == tuple(o.name for o in graph.outputs)
    plan = Plan(
        model_file="model.onnx",
        model_sha256=graph.sha256,
        inputs=tuple(i.name for i in graph.inputs),
        outputs=tuple(o.name for o in graph.outputs),
        segments=tuple(spec for spec, _ in segments),
    )
    assert len(plan.segments) == 3


@pytest.mark.integration
def test_empty_tiers_are_dropped_and_files_numbered_in_order(zoo_exports: Any) -> None:
    graph = _graph(zoo_exports, "chain_cnn", True)
    last = len(graph.cuts) - 1
    only_cloud = split_model(graph, (0, 0))
    assert [(s.tier, s.file) for s, _ in only_cloud] == [("cloud", "00-cloud.onnx")]
    no_edge = split_model(graph, (3, 3))
    assert [(s.tier, s.file) for s, _ in no_edge] == [
        ("device", "00-device.onnx"),
        ("cloud", "01-cloud.onnx"),
    ]
    only_device = split_model(graph, (last, last))
    assert [s.tier for s, _ in only_device] == ["device"]
    assert len(only_device[0][1].graph.node) == len(graph.nodes)


@pytest.mark.integration
def test_passthrough_tensors_cross_a_segment_unchanged(zoo_exports: Any) -> None:
    """A skip connection spanning a whole segment is both its input and its output."""
    graph = _graph(zoo_exports, "resnet18", True)
    two = [c.index for c in graph.cuts if len(c.tensors) == 2]
    pairs = [(a, b) for a, b in itertools.pairwise(two) if b == a + 1]
    pairs = [(a, b) for a, b in pairs if set(graph.cuts[a].tensors) & set(graph.cuts[b].tensors)]
    assert pairs, "a residual block interior has consecutive cuts sharing the skip tensor"
    a, b = pairs[0]
    segments = split_model(graph, (a, b))
    edge = next(model for spec, model in segments if spec.tier == "edge")
    shared = set(graph.cuts[a].tensors) & set(graph.cuts[b].tensors)
    assert shared <= {v.name for v in edge.graph.input} & {v.name for v in edge.graph.output}
    assert verify_split(graph, segments).bitwise_equal


@pytest.mark.integration
def test_write_segments_files_that_load_and_run(zoo_exports: Any, tmp_path: Path) -> None:
    graph = _graph(zoo_exports, "resnet18", True, external=True)
    segments = split_model(graph, (3, 9))
    write_segments(segments, tmp_path / "plan")
    files = sorted(p.name for p in (tmp_path / "plan").iterdir())
    # The model's weights lie in a data file: each segment's lie in its own beside it.
    assert files == sorted(n for spec, _ in segments for n in (spec.file, spec.file + ".data"))
    loaded = [(spec, onnx.load(str(tmp_path / "plan" / spec.file))) for spec, _ in segments]
    feeds = graph.representative_inputs(seed=3)
    whole = session(graph.model).run(None, feeds)[0]
    assert run_segments(loaded, feeds)["output"].tobytes() == whole.tobytes()


@pytest.mark.integration
def test_extract_segment_and_split_reject_bad_cut_indices(zoo_exports: Any) -> None:
    graph = _graph(zoo_exports, "chain_cnn", True)
    with pytest.raises(PlanError, match="ascending"):
        split_model(graph, (5, 2))
    with pytest.raises(PlanError, match="ascending"):
        split_model(graph, (1, len(graph.cuts)))
    with pytest.raises(PlanError, match="need 2 cut indices"):
        split_model(graph, (1,))
    with pytest.raises(PlanError):
        extract_segment(graph, 3, 3)
    model = extract_segment(graph, 0, len(graph.cuts) - 1)
    assert len(model.graph.node) == len(graph.nodes)


@pytest.mark.integration
def test_run_segments_reports_missing_inputs(zoo_exports: Any) -> None:
    graph = _graph(zoo_exports, "chain_cnn", True)
    segments = split_model(graph, (3, 6))
    with pytest.raises(PlanError, match="needs"):
        run_segments(segments[1:], graph.representative_inputs())


def test_segments_carry_the_local_functions_they_call(tmp_path: Path) -> None:
    """A model-local function goes with the segment that calls it (and only there)."""
    from onnx import TensorProto, helper

    scale = helper.make_function(
        "local",
        "ScaledTanh",
        ["v"],
        ["r"],
        [helper.make_node("Tanh", ["v"], ["t"]), helper.make_node("Add", ["t", "t"], ["r"])],
        [helper.make_opsetid("", 17)],
    )
    nodes = [
        helper.make_node("Relu", ["x"], ["a"]),
        helper.make_node("Sigmoid", ["a"], ["b"]),
        helper.make_node("ScaledTanh", ["b"], ["c"], domain="local"),
        helper.make_node("Neg", ["c"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "functions",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("local", 1)],
        functions=[scale],
    )
    onnx.save(model, tmp_path / "f.onnx")
    loaded = load_model(tmp_path / "f.onnx")
    extractor = SegmentExtractor(loaded.model)
    first, second = extractor.extract(["x"], ["b"]), extractor.extract(["b"], ["y"])
    assert [f.name for f in first.functions] == [] and [n.op_type for n in first.graph.node] == [
        "Relu",
        "Sigmoid",
    ]
    assert [f.name for f in second.functions] == ["ScaledTanh"]
    chained = [
        (SegmentSpec("device", "0.onnx", ("x",), ("b",)), first),
        (SegmentSpec("cloud", "1.onnx", ("b",), ("y",)), second),
    ]
    assert verify_split(loaded, chained).bitwise_equal


def test_splitting_uses_only_public_onnx_api() -> None:
    """onnx's private Extractor internals were renamed between releases (1.16 to 1.19)."""
    import ast

    import tierflow.partitioner as package

    for path in Path(package.__path__[0]).glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                bases = [ast.unparse(b) for b in node.bases]
                assert not any(b.startswith("onnx.") for b in bases), (path.name, node.name)
            if isinstance(node, ast.Attribute) and ast.unparse(node).startswith("onnx."):
                assert not node.attr.startswith("_"), (path.name, ast.unparse(node))
