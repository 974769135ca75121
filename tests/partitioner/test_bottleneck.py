"""Learned bottlenecks on a tiny convnet built in the test: graft, cut, train, measure."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tierflow.errors import ModelError, UsageError
from tierflow.partitioner.bottleneck.add import add_bottleneck, choose_cut
from tierflow.partitioner.bottleneck.graft import BottleneckWeights, graft, read_bottleneck
from tierflow.partitioner.graph import load_model
from tierflow.partitioner.split import split_model, verify_split


def _convnet(path: Path, seed: int = 0) -> Path:
    """x [N,4,8,8] -> conv 8 -> relu (feat) -> conv 8 -> relu -> pool -> gemm 3 -> y."""
    rng = np.random.default_rng(seed)

    def init(name: str, *shape: int) -> onnx.TensorProto:
        return numpy_helper.from_array(rng.normal(0, 0.4, shape).astype(np.float32), name)

    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["feat"]),
        helper.make_node("Conv", ["feat", "w2", "b2"], ["c2"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c2"], ["r2"]),
        helper.make_node("GlobalAveragePool", ["r2"], ["pooled"]),
        helper.make_node("Flatten", ["pooled"], ["flat"]),
        helper.make_node("Gemm", ["flat", "w3", "b3"], ["y"], transB=1),
    ]
    graph = helper.make_graph(
        nodes,
        "convnet",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 3])],
        [
            *(init("w1", 8, 4, 3, 3), init("b1", 8), init("w2", 8, 8, 3, 3)),
            *(init("b2", 8), init("w3", 3, 8), init("b3", 3)),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save_model(model, str(path))
    return path


def _weights(k: int, c: int, bits: int, seed: int = 1) -> BottleneckWeights:
    rng = np.random.default_rng(seed)
    shapes = {
        "enc_w": (k, c, 3, 3),
        "enc_b": (k,),
        "dec1_w": (2 * c, k, 3, 3),
        "dec1_b": (2 * c,),
        "dec2_w": (c, 2 * c, 1, 1),
        "dec2_b": (c,),
    }
    arrays = {name: rng.normal(0, 1, shape) for name, shape in shapes.items()}
    return BottleneckWeights.from_dict({"channels": k, "bits": bits, "relu": True, **arrays})


def test_the_codes_become_a_cut_and_the_split_there_is_exact(tmp_path: Path) -> None:
    model = onnx.load(str(_convnet(tmp_path / "m.onnx")))
    grafted, code = graft(model, "feat", _weights(2, 8, 4))
    path = tmp_path / "bn.onnx"
    onnx.save_model(grafted, str(path))
    graph = load_model(path)
    (cut,) = [c for c in graph.cuts if c.tensors == (code,)]
    assert graph.tensors[code].dtype == "uint8" and cut.nbytes == 2 * 8 * 8
    segments = split_model(graph, (cut.index, cut.index))
    assert [spec.tier for spec, _ in segments] == ["device", "cloud"]
    assert verify_split(graph, segments).bitwise_equal
    import onnxruntime as ort

    extra = onnx.load(str(path))
    extra.graph.output.append(onnx.ValueInfoProto(name=code))
    session = ort.InferenceSession(extra.SerializeToString(), providers=["CPUExecutionProvider"])
    x = np.random.default_rng(2).normal(0, 1, (5, 4, 8, 8)).astype(np.float32)
    _, codes = session.run(None, {"x": x})
    assert codes.dtype == np.uint8 and codes.max() <= 15


def test_weights_that_do_not_fit_together_are_refused() -> None:
    good = _weights(2, 8, 4)
    broken = {**good.__dict__, "dec1_w": good.dec1_w[:, :1]}
    with pytest.raises(ModelError, match="dec1_w"):
        BottleneckWeights.from_dict(broken)
    with pytest.raises(ModelError, match="bits"):
        BottleneckWeights.from_dict({**good.__dict__, "bits": 9})


def test_the_cut_is_named_or_chosen(tmp_path: Path) -> None:
    graph = load_model(_convnet(tmp_path / "m.onnx"))
    assert choose_cut(graph, "feat").tensors == ("feat",)
    # Unnamed: the cut within the first half of the compute (feat: 18k of 55k MACs).
    assert choose_cut(graph, None).tensors == ("feat",)
    with pytest.raises(UsageError, match="candidates"):
        choose_cut(graph, "pooled")
    with pytest.raises(UsageError, match="not a cut"):
        choose_cut(graph, "nonexistent")


@pytest.mark.integration
def test_add_bottleneck_trains_measures_and_records_its_points(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from tierflow.zoo.bottleneck_train import TorchTrainer, TrainSettings

    path = _convnet(tmp_path / "m.onnx")
    x = np.random.default_rng(3).normal(0, 1, (40, 1, 4, 8, 8)).astype(np.float32)
    trainer = TorchTrainer(TrainSettings(steps=30))
    result = add_bottleneck(
        path, {"x": x}, at="feat", channels=[4, 2], bits=[8, 2], trainer=trainer, target=0.5
    )
    assert result.distillation.startswith("features + outputs")
    assert [(p.channels, p.bits) for p in result.points] == [(4, 8), (4, 2), (2, 8), (2, 2)]
    assert result.measured_on == 12 and result.trained_on == 28
    for point in result.points:
        assert point.code_bytes == point.channels * 64
        assert point.packed_bytes == point.channels * 64 * point.bits // 8
        assert 0.0 <= point.agreement <= 1.0
    chosen = result.points[result.chosen]
    meeting = [p for p in result.points if p.agreement >= 0.5]
    if meeting:
        assert chosen.zstd_bytes == min(p.zstd_bytes for p in meeting)
    saved = result.save(tmp_path / "bn.onnx")
    recorded = read_bottleneck(saved)
    assert recorded["code"] == "feat.bottleneck.codes" and len(recorded["points"]) == 4
    assert "tierflow bottleneck" not in result.table().splitlines()[0]
    assert "* written" in result.table()
