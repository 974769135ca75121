"""Graph analysis: loading models as users have them, static shapes, candidate cuts."""

from __future__ import annotations

import hashlib
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx.external_data_helper
import pytest
from onnx import TensorProto, helper, numpy_helper

from tierflow.errors import InputError, ModelError, UsageError
from tierflow.partitioner.graph import (
    Cut,
    TensorInfo,
    load_model,
    load_sample,
    node_uses,
    parse_shape_option,
)
from tierflow.partitioner.split import split_model, verify_split


def _const(name: str, array: np.ndarray) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(array, name))


def _save(model: onnx.ModelProto, path: Path) -> Path:
    onnx.save(model, str(path))
    return path


def _opset11_cnn(batch: int | str = "N") -> onnx.ModelProto:
    """Conv-Relu-Flatten-MatMul-Add with every weight in a Constant node, opset 11."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((4, 3, 3, 3)).astype(np.float32)
    b = rng.standard_normal(4).astype(np.float32)
    fc = rng.standard_normal((4 * 6 * 6, 5)).astype(np.float32)
    fb = rng.standard_normal(5).astype(np.float32)
    nodes = [
        _const("w", w),
        _const("b", b),
        _const("fc", fc),
        _const("fb", fb),
        helper.make_node("Conv", ["x", "w", "b"], ["conv"]),
        helper.make_node("Relu", ["conv"], ["relu"]),
        helper.make_node("Flatten", ["relu"], ["flat"]),
        helper.make_node("MatMul", ["flat", "fc"], ["mm"]),
        helper.make_node("Add", ["mm", "fb"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "opset11_cnn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 5])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)], ir_version=6)


def _if_model() -> onnx.ModelProto:
    """An If whose branches read outer-scope activations ``a``, ``b`` and initializer ``w``."""
    then_branch = helper.make_graph(
        [
            helper.make_node("Add", ["a", "b"], ["t1"]),
            helper.make_node("Mul", ["t1", "w"], ["t_out"]),
        ],
        "then",
        [],
        [helper.make_tensor_value_info("t_out", TensorProto.FLOAT, [1, 4])],
    )
    else_branch = helper.make_graph(
        [helper.make_node("Mul", ["a", "b"], ["e_out"])],
        "else",
        [],
        [helper.make_tensor_value_info("e_out", TensorProto.FLOAT, [1, 4])],
    )
    nodes = [
        helper.make_node("Relu", ["x"], ["a"]),
        helper.make_node("Sigmoid", ["a"], ["b"]),
        helper.make_node("ReduceSum", ["x"], ["s"], keepdims=0),
        _const("zero", np.array(0.0, np.float32)),
        helper.make_node("Greater", ["s", "zero"], ["cond"]),
        helper.make_node("If", ["cond"], ["c"], then_branch=then_branch, else_branch=else_branch),
        helper.make_node("Neg", ["c"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "if_model",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
        initializer=[numpy_helper.from_array(np.full((1, 4), 3.0, np.float32), "w")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def _all_pairs_bitwise(graph: Any, inputs: dict[str, np.ndarray] | None = None) -> None:
    n = len(graph.cuts)
    for a in range(n):
        for b in range(a, n):
            result = verify_split(graph, split_model(graph, (a, b)), inputs)
            assert result.bitwise_equal, (a, b, result)


# --- hand-built models ------------------------------------------------------------------


def test_opset11_constant_node_weights(tmp_path: Path) -> None:
    graph = load_model(_save(_opset11_cnn(), tmp_path / "m.onnx"))
    assert graph.inputs[0].shape == (1, 3, 8, 8)  # symbolic batch defaults to 1
    assert graph.outputs[0].shape == (1, 5)
    weights = {"w", "b", "fc", "fb"}
    for cut in graph.cuts:
        assert not weights & set(cut.tensors)
    # Cuts around the cheap Relu and Flatten are equivalent: only the last survives; the
    # one between MatMul and its bias Add collapses onto the model output.
    assert [graph.nodes[c.position - 1].output[0] for c in graph.cuts[1:]] == ["flat", "y"]
    expected = 4 * (4 * 3 * 3 * 3 + 4 + 144 * 5 + 5)
    assert graph.weight_bytes(0, len(graph.cuts) - 1) == expected
    assert graph.weight_bytes(0, 1) == 4 * (4 * 3 * 3 * 3 + 4)
    _all_pairs_bitwise(graph)


def test_nodes_out_of_order_are_sorted(tmp_path: Path) -> None:
    model = _opset11_cnn()
    reordered = list(reversed(model.graph.node))
    del model.graph.node[:]
    model.graph.node.extend(reordered)
    graph = load_model(_save(model, tmp_path / "m.onnx"))
    seen = {"x"}
    for node in graph.nodes:
        assert all(name in seen for name in node.input)
        seen.update(node.output)
    _all_pairs_bitwise(graph)


def test_symbolic_dims_need_a_shape(tmp_path: Path) -> None:
    graph = helper.make_graph(
        [
            helper.make_node("Relu", ["x"], ["r"]),
            helper.make_node("GlobalAveragePool", ["r"], ["y"]),
        ],
        "symbolic",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, "H", "W"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3, 1, 1])],
    )
    path = _save(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "s.onnx"
    )
    with pytest.raises(ModelError, match=r"unknown dimension 2 \(H\).*--shape x="):
        load_model(path)
    fixed = load_model(path, shapes={"x": (2, 3, 5, 7)})
    assert fixed.inputs[0].shape == (2, 3, 5, 7)
    assert fixed.tensors["r"].shape == (2, 3, 5, 7)
    assert fixed.outputs[0].shape == (2, 3, 1, 1)
    sample = {"x": np.random.default_rng(1).standard_normal((4, 1, 3, 6, 6)).astype(np.float32)}
    from_sample = load_model(path, sample=sample)
    assert from_sample.inputs[0].shape == (1, 3, 6, 6)
    assert np.array_equal(from_sample.representative_inputs()["x"], sample["x"][0])
    with pytest.raises(UsageError, match="not an input"):
        load_model(path, shapes={"nope": (1,)})
    with pytest.raises(UsageError, match="dimensions"):
        load_model(path, shapes={"x": (1, 3, 5)})
    # Rows one dimension short gain a batch of 1, as `tierflow run` reads them.
    unbatched = {"x": sample["x"][:, 0]}
    assert load_model(path, sample=unbatched).inputs[0].shape == (1, 3, 6, 6)
    with pytest.raises(InputError, match="rank 4"):
        load_model(path, sample={"x": np.zeros((2, 6, 6), np.float32)})


def test_wrong_declared_shapes_are_not_trusted(tmp_path: Path) -> None:
    model = _opset11_cnn(batch=1)
    model.graph.output[0].CopyFrom(helper.make_tensor_value_info("y", TensorProto.FLOAT, [7, 99]))
    model.graph.value_info.append(
        helper.make_tensor_value_info("relu", TensorProto.FLOAT, [1, 2, 3])
    )
    graph = load_model(_save(model, tmp_path / "wrong.onnx"))
    assert graph.outputs[0].shape == (1, 5)
    assert graph.tensors["relu"].shape == (1, 4, 6, 6)
    segments = split_model(graph, (1, 2))
    declared = segments[-1][1].graph.output[0].type.tensor_type.shape
    assert [d.dim_value for d in declared.dim] == [1, 5]
    assert verify_split(graph, segments).bitwise_equal


def test_if_node_is_atomic_and_outer_scope_reads_count(tmp_path: Path) -> None:
    graph = load_model(_save(_if_model(), tmp_path / "if.onnx"))
    if_index = next(i for i, n in enumerate(graph.nodes) if n.op_type == "If")
    assert set(node_uses(graph.nodes[if_index])) == {"cond", "a", "b", "w"}
    sigmoid = next(i for i, n in enumerate(graph.nodes) if n.op_type == "Sigmoid")
    for cut in graph.cuts:
        if sigmoid < cut.position <= if_index:
            assert {"a", "b"} <= set(cut.tensors), cut  # branches read them: they cross
        assert "w" not in cut.tensors
    assert any(c.position == if_index for c in graph.cuts)
    for x in (np.full((1, 4), 0.5, np.float32), np.full((1, 4), -0.5, np.float32)):
        _all_pairs_bitwise(graph, {"x": x})


def test_loop_body_reading_outer_scope_is_atomic(tmp_path: Path) -> None:
    body = helper.make_graph(
        [
            helper.make_node("Identity", ["cond_in"], ["cond_out"]),
            helper.make_node("Add", ["acc_in", "a"], ["acc_out"]),
        ],
        "body",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
            helper.make_tensor_value_info("acc_in", TensorProto.FLOAT, [1, 4]),
        ],
        [
            helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
            helper.make_tensor_value_info("acc_out", TensorProto.FLOAT, [1, 4]),
        ],
    )
    nodes = [
        helper.make_node("Relu", ["x"], ["a"]),
        helper.make_node("Sigmoid", ["x"], ["s"]),
        helper.make_node("Loop", ["trip", "", "s"], ["acc"], body=body),
        helper.make_node("Neg", ["acc"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "loop",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
        initializer=[numpy_helper.from_array(np.array(3, np.int64), "trip")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 16)])
    loaded = load_model(_save(model, tmp_path / "loop.onnx"))
    loop = next(i for i, n in enumerate(loaded.nodes) if n.op_type == "Loop")
    before_loop = [c for c in loaded.cuts if 0 < c.position <= loop]
    assert before_loop and all("a" in c.tensors for c in before_loop)
    _all_pairs_bitwise(loaded)


@pytest.mark.integration
def test_initializers_listed_as_inputs_are_constants(zoo_exports: Any, tmp_path: Path) -> None:
    import torch

    module, example = zoo_exports.module("chain_cnn")
    path = tmp_path / "kept.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.onnx.export(
            module,
            example,
            str(path),
            dynamo=False,
            keep_initializers_as_inputs=True,
            input_names=["input"],
        )
    assert len(onnx.load(str(path)).graph.input) > 1
    graph = load_model(path)
    assert [i.name for i in graph.inputs] == ["input"]
    last = len(graph.cuts) - 1
    for a in range(0, last + 1, 3):
        assert verify_split(graph, split_model(graph, (a, last))).bitwise_equal


@pytest.mark.integration
def test_not_onnx_truncated_and_missing_files(tmp_path: Path, zoo_exports: Any) -> None:
    text = tmp_path / "notes.onnx"
    text.write_text("these are not the weights you are looking for\n")
    with pytest.raises(ModelError, match=r"notes\.onnx"):
        load_model(text)
    source = _save(_opset11_cnn(), tmp_path / "good.onnx").read_bytes()
    for keep in (len(source) // 2, len(source) - 7, 10):
        truncated = tmp_path / f"cut{keep}.onnx"
        truncated.write_bytes(source[:keep])
        with pytest.raises(ModelError, match=rf"cut{keep}\.onnx"):
            load_model(truncated)
    empty = tmp_path / "empty.onnx"
    empty.write_bytes(b"")
    with pytest.raises(ModelError, match="empty"):
        load_model(empty)
    with pytest.raises(ModelError, match="does not exist"):
        load_model(tmp_path / "absent.onnx")
    external = zoo_exports.path("chain_cnn", dynamo=False, external=True)
    lonely = tmp_path / "lonely"
    lonely.mkdir()
    shutil.copy(external, lonely / external.name)
    with pytest.raises(ModelError, match="external"):
        load_model(lonely / external.name)


def test_invalid_graph_is_a_model_error(tmp_path: Path) -> None:
    model = _opset11_cnn()
    model.graph.node.append(helper.make_node("Relu", ["nowhere"], ["z"]))
    with pytest.raises(ModelError, match="nowhere"):
        load_model(_save(model, tmp_path / "dangling.onnx"))
    model = _opset11_cnn()
    model.graph.node.append(helper.make_node("NoSuchOp", ["y"], ["z"]))
    with pytest.raises(ModelError, match="invalid ONNX graph"):
        load_model(_save(model, tmp_path / "unknown_op.onnx"))


def test_activation_bytes_and_liveness(tmp_path: Path) -> None:
    graph = helper.make_graph(
        [
            helper.make_node("Relu", ["x"], ["r1"]),
            helper.make_node("Relu", ["r1"], ["r2"]),
            helper.make_node("Exp", ["r2"], ["e"]),
            helper.make_node("Sigmoid", ["e"], ["s"]),
            helper.make_node("Concat", ["x", "s"], ["y"], axis=1),
        ],
        "live",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16])],
    )
    path = _save(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "l.onnx"
    )
    loaded = load_model(path)
    # x stays live to the Concat: every interior cut carries it plus the chain's tensor.
    for cut in loaded.cuts[1:-1]:
        assert cut.tensors[0] == "x" and len(cut.tensors) == 2 and cut.nbytes == 64
    last = len(loaded.cuts) - 1
    # Whole model: x, one chain tensor and the next live together (96), then x+s+y = 128.
    assert loaded.peak_activation_bytes(0, last) == 128
    assert loaded.weight_bytes(0, last) == 0
    one_tensor = load_model(path, max_cut_tensors=1)
    assert [c.position for c in one_tensor.cuts] == [0, len(one_tensor.nodes)]


@pytest.mark.integration
def test_sha256_covers_external_data(tmp_path: Path, zoo_exports: Any) -> None:
    inline = zoo_exports.path("chain_cnn", dynamo=False)
    assert load_model(inline).sha256 == hashlib.sha256(inline.read_bytes()).hexdigest()
    source = zoo_exports.path("chain_cnn", dynamo=False, external=True)
    copy = tmp_path / "copy"
    shutil.copytree(source.parent, copy)
    first = load_model(copy / source.name).sha256
    assert first != hashlib.sha256(source.read_bytes()).hexdigest()
    data = copy / (source.name + ".data")
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 1
    data.write_bytes(bytes(raw))
    assert load_model(copy / source.name).sha256 != first


# --- zoo models: cut structure ----------------------------------------------------------


@pytest.mark.integration
@pytest.mark.parametrize("dynamo", [True, False], ids=["dynamo", "legacy"])
@pytest.mark.parametrize("name", ["chain_cnn", "resnet18", "mobilenet_v2", "transformer_encoder"])
def test_cut_invariants(zoo_exports: Any, name: str, dynamo: bool) -> None:
    graph = load_model(zoo_exports.path(name, dynamo=dynamo))
    assert graph.cuts[0].position == 0
    assert graph.cuts[0].tensors == tuple(i.name for i in graph.inputs)
    assert graph.cuts[-1].position == len(graph.nodes)
    assert graph.cuts[-1].tensors == tuple(o.name for o in graph.outputs)
    positions = [c.position for c in graph.cuts]
    assert positions == sorted(set(positions))
    assert [c.index for c in graph.cuts] == list(range(len(graph.cuts)))
    initializers = {t.name for t in graph.model.graph.initializer}
    constant_outputs = {n.output[0] for n in graph.nodes if n.op_type == "Constant"}
    for cut in graph.cuts:
        assert 1 <= len(cut.tensors) <= 3
        assert not (initializers | constant_outputs) & set(cut.tensors)  # constants never cross
        assert cut.nbytes == sum(graph.tensors[t].nbytes for t in cut.tensors)
        if 0 < cut.position < len(graph.nodes):
            assert graph.nodes[cut.position].op_type != "Relu"  # cut after the Relu, not before
    # Cuts never separate a node from data it needs.
    for cut in graph.cuts[1:-1]:
        before = {o for n in graph.nodes[: cut.position] for o in n.output} | set(graph.tensors)
        needed_after = {u for n in graph.nodes[cut.position :] for u in node_uses(n)}
        crossing = needed_after & before & set(graph.tensors)
        crossing -= {o for n in graph.nodes[cut.position :] for o in n.output}
        assert crossing <= set(cut.tensors)


@pytest.mark.integration
@pytest.mark.parametrize("dynamo", [True, False], ids=["dynamo", "legacy"])
def test_residual_blocks_cut_one_tensor_between_two_inside(zoo_exports: Any, dynamo: bool) -> None:
    graph = load_model(zoo_exports.path("resnet18", dynamo=dynamo))
    producer = {o: i for i, n in enumerate(graph.nodes) for o in n.output}
    interior = graph.cuts[1:-1]
    assert {len(c.tensors) for c in interior} == {1, 2}
    block_outputs = [
        c
        for c in interior
        if len(c.tensors) == 1
        and graph.nodes[producer[c.tensors[0]]].op_type == "Relu"
        and graph.nodes[producer[graph.nodes[producer[c.tensors[0]]].input[0]]].op_type == "Add"
    ]
    assert len(block_outputs) == 8  # one per BasicBlock
    for cut in interior:
        if len(cut.tensors) == 2:
            # Inside a block: one of the two is on the skip path, read again by the Add
            # (directly, or through the downsampling 1x1 conv).
            consumers = {
                graph.nodes[i].op_type
                for i in range(cut.position, len(graph.nodes))
                for t in cut.tensors
                if t in graph.nodes[i].input
            }
            assert "Add" in consumers or "Conv" in consumers
    assert len([c for c in interior if len(c.tensors) == 2]) >= 8


@pytest.mark.integration
@pytest.mark.parametrize("dynamo", [True, False], ids=["dynamo", "legacy"])
def test_transformer_cuts_carry_hidden_state_and_mask(zoo_exports: Any, dynamo: bool) -> None:
    graph = load_model(zoo_exports.path("transformer_encoder", dynamo=dynamo))
    assert [i.shape for i in graph.inputs] == [(1, 8), (1, 8)]  # symbolic batch -> 1
    hidden_and_mask = [
        c
        for c in graph.cuts
        if len(c.tensors) == 2
        and sorted(graph.tensors[t].shape for t in c.tensors)[-1] == (1, 8, 16)
        and any(int(np.prod(graph.tensors[t].shape)) == 8 for t in c.tensors)
    ]
    assert len(hidden_and_mask) >= 2  # before the first layer and between the layers
    one_tensor = load_model(
        zoo_exports.path("transformer_encoder", dynamo=dynamo), max_cut_tensors=1
    )
    assert all(len(c.tensors) == 1 for c in one_tensor.cuts[1:])  # cuts[0]: both inputs


# --- option parsing ---------------------------------------------------------------------


def test_parse_shape_option() -> None:
    assert parse_shape_option("images=1x3x640x640") == ("images", (1, 3, 640, 640))
    assert parse_shape_option("a=b=7") == ("a=b", (7,))
    for bad in ("images", "=1x3", "x=1x0", "x=1xx3", "x=", "x=-1"):
        with pytest.raises(UsageError, match="--shape"):
            parse_shape_option(bad)


def test_load_sample(tmp_path: Path) -> None:
    path = tmp_path / "in.npz"
    np.savez(path, x=np.ones((3, 1, 4), np.float32), labels=np.arange(3))
    sample = load_sample(path)
    assert list(sample) == ["x"] and sample["x"].shape == (3, 1, 4)
    with pytest.raises(InputError, match="does not exist"):
        load_sample(tmp_path / "absent.npz")
    (tmp_path / "bad.npz").write_text("nope")
    with pytest.raises(InputError, match=r"bad\.npz"):
        load_sample(tmp_path / "bad.npz")
    np.savez(tmp_path / "labels_only.npz", labels=np.arange(3))
    with pytest.raises(InputError, match="no input arrays"):
        load_sample(tmp_path / "labels_only.npz")


def test_records_round_trip_and_sample_dtype_is_checked(tmp_path: Path) -> None:
    path = _save(_opset11_cnn(), tmp_path / "m.onnx")
    graph = load_model(path)
    for cut in graph.cuts:
        assert Cut.from_dict(cut.to_dict()) == cut
    info = graph.tensors[graph.cuts[1].tensors[0]]
    assert TensorInfo.from_dict(info.to_dict()) == info
    with pytest.raises(ModelError, match="malformed"):
        Cut.from_dict({"index": 0})
    with pytest.raises(InputError, match="complex64"):
        load_model(path, sample={"x": np.zeros((1, 1, 3, 8, 8), np.complex64)})


def test_external_data_outside_the_model_directory_is_refused(tmp_path: Path) -> None:
    model = _opset11_cnn()
    tensor = numpy_helper.from_array(np.ones((5,), np.float32), "fb")
    onnx.external_data_helper.set_external_data(tensor, "../elsewhere.bin")
    tensor.ClearField("raw_data")
    model.graph.node[3].attribute[0].t.CopyFrom(tensor)
    (tmp_path / "elsewhere.bin").write_bytes(np.ones(5, np.float32).tobytes())
    inner = tmp_path / "inner"
    inner.mkdir()
    with pytest.raises(ModelError, match="outside its directory"):
        load_model(_save(model, inner / "m.onnx"))
