"""Models whose If branches hold LSTMs and shape tensors differently, planned end to end.

See [Note: shapes that follow a branch] in partitioner/shapes.py: a stateful audio model
loads in ONNX Runtime as shipped, and must still load after its input shapes are fixed.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from tierflow.cli.main import main
from tierflow.errors import ModelError
from tierflow.partitioner.graph import load_model
from tierflow.partitioner.split import split_model, verify_split

HIDDEN, SAMPLES = 4, 6


def _constant(name: str, value: Any) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.array(value)))


def _unsqueeze(tag: str, axes: list[int]) -> onnx.GraphProto:
    nodes = [
        _constant(f"{tag}_axes", axes),
        helper.make_node("Unsqueeze", ["a", f"{tag}_axes"], [f"{tag}_u"]),
    ]
    return helper.make_graph(
        nodes, tag, [], [helper.make_tensor_value_info(f"{tag}_u", TensorProto.FLOAT, None)]
    )


def _lstm(tag: str, squeeze: bool, rng: np.random.Generator) -> onnx.GraphProto:
    """An LSTM over ``u``: rank 3 at 16 kHz; at 8 kHz ``u`` has rank 4 and is squeezed first."""
    weights = [
        numpy_helper.from_array(
            (rng.standard_normal((1, 4 * HIDDEN, SAMPLES)) * 0.5).astype(np.float32), f"{tag}_W"
        ),
        numpy_helper.from_array(
            (rng.standard_normal((1, 4 * HIDDEN, HIDDEN)) * 0.5).astype(np.float32), f"{tag}_R"
        ),
    ]
    nodes = []
    source = "u"
    if squeeze:
        nodes += [
            _constant(f"{tag}_axes", [1]),
            helper.make_node("Squeeze", ["u", f"{tag}_axes"], [f"{tag}_x"]),
        ]
        source = f"{tag}_x"
    nodes.append(
        helper.make_node(
            "LSTM",
            [source, f"{tag}_W", f"{tag}_R", "", "", "h0", "c0"],
            [f"{tag}_y", f"{tag}_h", f"{tag}_c"],
            hidden_size=HIDDEN,
            name=f"_if_{tag}_branch_LSTM",
        )
    )
    outputs = [helper.make_tensor_value_info(f"{tag}_h", TensorProto.FLOAT, None)]
    return helper.make_graph(nodes, tag, [], outputs, initializer=weights)


def _audio_model(path: Path) -> Path:
    """tanh(x W0) -> If(sr == 16000) unsqueeze once/twice -> If LSTM -> Gemm; frames = sr / 8000.

    The sample rate also sets a Reshape (``sr // 8000`` frames), so sr = 0 or 1 fails.
    """
    rng = np.random.default_rng(7)
    nodes = [
        helper.make_node("MatMul", ["x", "w0"], ["m"]),
        helper.make_node("Tanh", ["m"], ["a"]),
        _constant("rate", 16000),
        helper.make_node("Equal", ["sr", "rate"], ["is16k"]),
        helper.make_node(
            "If",
            ["is16k"],
            ["u"],
            then_branch=_unsqueeze("once", [0]),
            else_branch=_unsqueeze("twice", [0, 1]),
        ),
        helper.make_node(
            "If",
            ["is16k"],
            ["h"],
            then_branch=_lstm("then", False, rng),
            else_branch=_lstm("else", True, rng),
        ),
        helper.make_node("Relu", ["h"], ["r"]),
        _constant("frame_rate", 8000),
        helper.make_node("Div", ["sr", "frame_rate"], ["frames"]),
        _constant("minus_one", [-1]),
        _constant("zero_axis", [0]),
        helper.make_node("Unsqueeze", ["frames", "zero_axis"], ["frames1"]),
        helper.make_node("Concat", ["frames1", "minus_one"], ["frame_shape"], axis=0),
        helper.make_node("Reshape", ["r", "frame_shape"], ["y"], allowzero=1),
    ]
    inputs = [
        helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", SAMPLES]),
        helper.make_tensor_value_info("sr", TensorProto.INT64, []),
        helper.make_tensor_value_info("h0", TensorProto.FLOAT, [1, "batch", HIDDEN]),
        helper.make_tensor_value_info("c0", TensorProto.FLOAT, [1, "batch", HIDDEN]),
    ]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["frames", "rest"])]
    w0 = numpy_helper.from_array(rng.standard_normal((SAMPLES, SAMPLES)).astype(np.float32), "w0")
    graph = helper.make_graph(nodes, "audio", inputs, outputs, initializer=[w0])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def _request(sr: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(sr)
    return {
        "x": rng.standard_normal((1, SAMPLES)).astype(np.float32),
        "sr": np.array(sr, np.int64),
        "h0": np.zeros((1, 1, HIDDEN), np.float32),
        "c0": np.zeros((1, 1, HIDDEN), np.float32),
    }


def test_fixed_shapes_keep_a_model_with_branching_lstms_loadable(tmp_path: Path) -> None:
    path = _audio_model(tmp_path / "audio.onnx")
    shipped = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    requests = [_request(16000), _request(8000)]
    sample = {name: np.stack([r[name] for r in requests]) for name in requests[0]}
    graph = load_model(path, sample=sample, max_cut_tensors=4)  # sr, h0, c0 cross with m
    assert graph.inputs[0].shape == (1, SAMPLES)
    # The rank of u and h depends on sr: no cut carries them, no value_info declares them.
    assert all(not {"u", "h", "r"} & set(cut.tensors) for cut in graph.cuts)
    assert not {"u", "h", "r"} & {v.name for v in graph.model.graph.value_info}
    assert len(graph.cuts) >= 3
    ort.InferenceSession(graph.model.SerializeToString(), providers=["CPUExecutionProvider"])
    for a in range(len(graph.cuts)):
        for b in range(a, len(graph.cuts)):
            segments = split_model(graph, (a, b))
            for feeds in requests:
                assert verify_split(graph, segments, feeds).bitwise_equal, (a, b, feeds["sr"])
                (expected,) = shipped.run(["y"], feeds)
                assert verify_split(graph, segments, feeds).outputs == ("y",)
                assert expected.shape == (
                    int(feeds["sr"]) // 8000,
                    HIDDEN // (int(feeds["sr"]) // 8000),
                )


def test_plan_from_a_sample_and_a_shape_that_needs_one(tmp_path: Path, capsys: Any) -> None:
    path = _audio_model(tmp_path / "audio.onnx")
    requests = [_request(16000), _request(8000)]
    np.savez(tmp_path / "in.npz", **{n: np.stack([r[n] for r in requests]) for n in requests[0]})
    code = main(
        ["plan", str(path), "-o", str(tmp_path / "plan"), "--sample", str(tmp_path / "in.npz")]
    )
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "verified: split reproduces the model bit-for-bit" in out
    shapes = ["--shape", "x=1x6", "--shape", "h0=1x1x4", "--shape", "c0=1x1x4"]
    code = main(["plan", str(path), "-o", str(tmp_path / "plan2"), *shapes])
    _, err = capsys.readouterr()
    assert code == 2
    assert "integer input(s) 'sr' were filled with 0 or 1" in err and "--sample IN.npz" in err
    assert err.count("\n") == 1
    with pytest.raises(ModelError, match="'sr'"):
        load_model(path, shapes={"x": (1, 6), "h0": (1, 1, 4), "c0": (1, 1, 4)})


# --- the whole network inside one If: the published streaming VAD's shape ---------------
#
# The audio model above keeps the LSTM's input computed outside its If (``u`` follows the
# first If, so its shape is never declared). In the VAD the If's branches compute
# everything from the fixed ``input`` (Pad, Conv, Slice, the exporter's squeeze-If, LSTM),
# so ONNX Runtime at "basic" and above folds shapes inside the branch the sample does not
# take: at 576 samples the 8 kHz branch keeps two time steps, its squeeze does nothing and
# its LSTM meets a rank-4 input. See [Note: shapes a branch reads].

_EXPORTERS = ["torchscript", pytest.param("dynamo", marks=pytest.mark.slow)]


@pytest.fixture(scope="module")
def vad(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Exports the streaming VAD (once per form); torch is only needed here."""
    pytest.importorskip("torch")
    from tierflow.zoo.vad import export_vad

    directory = tmp_path_factory.mktemp("vad")

    @functools.cache
    def export(exporter: str, scale_input: bool = False) -> Path:
        path = directory / f"{exporter}-{int(scale_input)}.onnx"
        return export_vad(path, dynamo=exporter == "dynamo", scale_input=scale_input)

    return export


def _vad_sample(path: Path, count: int = 3) -> Path:
    from tierflow.zoo.vad import FRAME, HIDDEN

    rng = np.random.default_rng(3)
    np.savez(
        path,
        input=rng.standard_normal((count, 1, FRAME[16000])).astype(np.float32),
        state=(rng.standard_normal((count, 2, 1, HIDDEN)) * 0.1).astype(np.float32),
        sr=np.full(count, 16000, np.int64),
    )
    return path


@pytest.mark.integration
@pytest.mark.parametrize("exporter", _EXPORTERS)
def test_a_whole_graph_inside_an_if_plans_and_chains_exactly(
    tmp_path: Path, capsys: Any, vad: Callable[..., Path], exporter: str
) -> None:
    path = vad(exporter)
    model = onnx.load(path)
    assert [n.op_type for n in model.graph.node if n.op_type != "Constant"][-1] == "If"
    sample = _vad_sample(tmp_path / "vad.npz")
    code = main(["plan", str(path), "-o", str(tmp_path / "plan"), "--sample", str(sample)])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "verified: split reproduces the model bit-for-bit on 3 inputs" in out
    arrays = dict(np.load(sample))
    graph = load_model(path, sample=arrays)
    # The segments declare what the If reads as the model shipped it.
    shipped = {v.name: v.type for v in model.graph.input}
    assert {v.name: v.type for v in graph.model.graph.input} == shipped
    requests = [{name: np.asarray(arrays[name][i]) for name in arrays} for i in range(3)]
    for a in range(len(graph.cuts)):
        for b in range(a, len(graph.cuts)):
            segments = split_model(graph, (a, b))
            for _, segment in segments:  # "basic" and above failed to load the If's segment
                ort.InferenceSession(
                    segment.SerializeToString(), providers=["CPUExecutionProvider"]
                )
            for feeds in requests:
                assert verify_split(graph, segments, feeds, level="extended").bitwise_equal


@pytest.mark.integration
def test_a_tensor_the_if_reads_keeps_its_shipped_shape(vad: Callable[..., Path]) -> None:
    """A Mul before the If: its output is declared as the unfixed model infers it."""
    path = vad("torchscript", scale_input=True)
    from tierflow.zoo.vad import FRAME, HIDDEN

    rng = np.random.default_rng(4)
    sample = {
        "input": rng.standard_normal((2, 1, FRAME[16000])).astype(np.float32),
        "state": np.zeros((2, 2, 1, HIDDEN), np.float32),
        "sr": np.full(2, 16000, np.int64),
    }
    graph = load_model(path, sample=sample)
    (scaled,) = [n.output[0] for n in graph.model.graph.node if n.op_type == "Mul"]
    declared = {v.name: v for v in graph.model.graph.value_info}[scaled]
    dims = declared.type.tensor_type.shape.dim
    assert len(dims) == 2 and not any(d.HasField("dim_value") for d in dims)
    assert graph.tensors[scaled].shape == (1, FRAME[16000])  # costed at the sample's shape
    feeds = {name: np.asarray(sample[name][0]) for name in sample}
    for a in range(len(graph.cuts)):
        for b in range(a, len(graph.cuts)):
            segments = split_model(graph, (a, b))
            for _, segment in segments:
                ort.InferenceSession(
                    segment.SerializeToString(), providers=["CPUExecutionProvider"]
                )
            assert verify_split(graph, segments, feeds, level="extended").bitwise_equal


def test_the_shape_a_branch_reads_is_not_folded_to_the_samples(tmp_path: Path) -> None:
    """Shape(x) read by an If stays a Shape: folded, it would fix x's shape in both branches.

    The else branch squeezes axis 1, valid only for one sample per row; the sample takes
    the then branch with four. Folded to the constant [1, 4], Shape(x) would make ONNX
    Runtime refuse the else branch at load ("Dimension of input 1 must be 1").
    """
    reshape = helper.make_node("Reshape", ["x", "s"], ["r"])
    then_branch = helper.make_graph(
        [reshape, helper.make_node("ReduceSum", ["r"], ["y_then"], keepdims=0)],
        "sum",
        [],
        [helper.make_tensor_value_info("y_then", TensorProto.FLOAT, None)],
    )
    else_branch = helper.make_graph(
        [
            helper.make_node("Reshape", ["x", "s"], ["r_else"]),
            _constant("axis", [1]),
            helper.make_node("Squeeze", ["r_else", "axis"], ["y_else"]),
        ],
        "squeeze",
        [],
        [helper.make_tensor_value_info("y_else", TensorProto.FLOAT, None)],
    )
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("If", ["flag"], ["y"], then_branch=then_branch, else_branch=else_branch),
    ]
    inputs = [
        helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "n"]),
        helper.make_tensor_value_info("flag", TensorProto.BOOL, []),
    ]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch"])]
    graph = helper.make_graph(nodes, "shape_if", inputs, outputs)
    path = tmp_path / "shape_if.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    sample = {"x": np.ones((2, 1, 4), np.float32), "flag": np.array([True, True])}
    loaded = load_model(path, sample=sample)
    assert [n.op_type for n in loaded.model.graph.node] == ["Shape", "If"]
    ort.InferenceSession(loaded.model.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {"x": sample["x"][0], "flag": np.array(True)}
    assert verify_split(loaded, split_model(loaded, (0, 1)), feeds).bitwise_equal
