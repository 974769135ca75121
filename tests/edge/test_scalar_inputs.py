"""A model with a rank-0 input (an audio model's ``sr: int64[]``), planned and served.

``plan --sample`` and ``run`` read IN.npz with one reader ([Note: request rows] in
tierflow/npz.py): a scalar input's rows stay 0-D on the device, across both links and in
every tier's segment. The tiers are called in process ([Note: the next tier in process] in
tierflow/runtime/upstream.py), the rows read and written as ``run`` does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from tierflow.cli.main import main
from tierflow.device.npz import load_requests, save_outputs
from tierflow.partitioner.graph import load_model
from tierflow.partitioner.split import save_split_plan, split_model
from tierflow.plan import load_plan


def _scalar_model(path: Path) -> Path:
    """y = W2 · tanh(W1 · relu(x * sr/16000)) * sr/16000: ``sr`` is read first and last."""
    rng = np.random.default_rng(3)
    weights = [
        numpy_helper.from_array(rng.standard_normal((8, 8)).astype(np.float32), "w1"),
        numpy_helper.from_array(rng.standard_normal((4, 8)).astype(np.float32), "w2"),
        numpy_helper.from_array(np.array(16000.0, np.float32), "rate"),
    ]
    nodes = [
        helper.make_node("Cast", ["sr"], ["srf"], to=TensorProto.FLOAT),
        helper.make_node("Div", ["srf", "rate"], ["scale"]),
        helper.make_node("Mul", ["x", "scale"], ["xs"]),
        helper.make_node("Relu", ["xs"], ["h"]),
        helper.make_node("Gemm", ["h", "w1"], ["g"], transB=1),
        helper.make_node("Tanh", ["g"], ["t"]),
        helper.make_node("Gemm", ["t", "w2"], ["u"], transB=1),
        helper.make_node("Cast", ["sr"], ["srf2"], to=TensorProto.FLOAT),
        helper.make_node("Div", ["srf2", "rate"], ["scale2"]),
        helper.make_node("Mul", ["u", "scale2"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "scalar",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8]),
            helper.make_tensor_value_info("sr", TensorProto.INT64, []),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
        weights,
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def test_a_scalar_input_plans_from_a_sample_and_runs_through_three_tiers(
    tmp_path: Path, rt: Any, capsys: Any
) -> None:
    model = _scalar_model(tmp_path / "scalar.onnx")
    rng = np.random.default_rng(4)
    # IN.npz as users write it: x without the batch axis (run re-adds it), sr one per request.
    x = rng.standard_normal((3, 8)).astype(np.float32)
    sr = np.array([16000, 8000, 16000], np.int64)
    np.savez(tmp_path / "in.npz", x=x, sr=sr)

    # `tierflow plan --sample` fixes the shapes from the same rows run will send.
    code = main(
        ["plan", str(model), "-o", str(tmp_path / "cli-plan"), "--sample", str(tmp_path / "in.npz")]
    )
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "verified: split reproduces the model bit-for-bit" in out

    # The same file through a plan with a segment on every tier; sr crosses both links.
    graph = load_model(model, sample={"x": x, "sr": sr})
    assert {i.name: i.shape for i in graph.inputs} == {"x": (1, 8), "sr": ()}
    last = len(graph.cuts) - 1
    cuts = (last // 3, 2 * last // 3)
    segments = split_model(graph, cuts)
    assert [spec.tier for spec, _ in segments] == ["device", "edge", "cloud"]
    assert "sr" in segments[1][0].inputs and "sr" in segments[2][0].inputs
    plan_dir = tmp_path / "plan"
    save_split_plan(graph, segments, plan_dir, cuts=cuts, codec={"device-edge": "zstd"})
    assert load_plan(plan_dir).inputs == ("x", "sr")

    plan = load_plan(plan_dir)
    with rt.device(plan_dir) as client:
        requests, batch_added = load_requests(tmp_path / "in.npz", plan, plan_dir)
        results = list(client.run_stream(requests))
    assert [r.answered_by for r in results] == ["cloud"] * 3
    assert batch_added and requests[0]["sr"].shape == ()
    save_outputs(tmp_path / "out.npz", results, plan, batch_added=batch_added)
    whole = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    with np.load(tmp_path / "out.npz") as result:
        y = result["y"]
    assert y.shape == (3, 4)
    for i in range(3):
        (expected,) = whole.run(["y"], {"x": x[i : i + 1], "sr": np.array(sr[i])})
        np.testing.assert_allclose(y[i], expected[0], rtol=1e-6)
