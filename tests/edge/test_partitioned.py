"""Plans cut by the partitioner itself (load_model + split_model) run exactly on three tiers.

Bit-exact at ONNX Runtime's "extended" optimization level and below; at "all" fusions in
the unsplit model span cut boundaries ([Note: optimization level and exactness]).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tierflow.cli.main import main
from tierflow.options import RuntimeOptions
from tierflow.partitioner.graph import load_model
from tierflow.partitioner.split import save_split_plan, split_model
from tierflow.plan import Plan
from tierflow.runtime.segment_runner import SegmentRunner


def _torch_resnet(path: Path) -> Path:
    """A narrow ResNet-18 from the model zoo, exported by torch (legacy exporter: fast)."""
    pytest.importorskip("torch")
    from tierflow.zoo.models import export_onnx, resnet18

    module, example = resnet18(size=16, width=0.125, num_classes=10)
    return export_onnx(module, example, path, dynamo=False)


def _partitioned_plan(model_path: Path, plan_dir: Path) -> Plan:
    graph = load_model(model_path)
    last = len(graph.cuts) - 1
    cuts = (max(1, last // 3), max(2, 2 * last // 3))
    segments = split_model(graph, cuts)
    assert [spec.tier for spec, _ in segments] == ["device", "edge", "cloud"]
    codec = {"device-edge": "zstd", "edge-cloud": "shuffle+zstd"}
    return save_split_plan(graph, segments, plan_dir, cuts=cuts, codec=codec)


@pytest.mark.parametrize(
    "model",
    [pytest.param("torch-resnet18", marks=[pytest.mark.slow, pytest.mark.integration]), "residual"],
)
def test_partitioner_plans_reproduce_the_model_exactly(tmp_path: Path, rt: Any, model: str) -> None:
    if model == "residual":
        split = rt.residual(tmp_path / "source")
        model_path, shape = split.model_path, split.inputs["x"]
    else:
        model_path, shape = _torch_resnet(tmp_path / "resnet.onnx"), (1, 3, 16, 16)
    plan_dir = tmp_path / "plan"
    plan = _partitioned_plan(model_path, plan_dir)
    whole = SegmentRunner(model_path, RuntimeOptions(optimization="extended"))
    name = plan.inputs[0]
    rng = np.random.default_rng(5)
    samples = [{name: rng.standard_normal(shape).astype(np.float32)} for _ in range(4)]
    extended = {"optimization": "extended"}
    client = {"options": RuntimeOptions(optimization="extended")}
    with rt.device(plan_dir, grpc=model != "residual", tiers=extended, **client) as device:
        results = [r.unwrap() for r in device.run_stream(samples)]
    for feeds, result in zip(samples, results, strict=True):
        expected = whole.run(feeds)
        assert result.answered_by == "cloud"
        for key, value in expected.items():
            np.testing.assert_array_equal(result.outputs[key], value)


@pytest.mark.integration
def test_a_model_inside_one_if_serves_on_edge_and_cloud_processes(tmp_path: Path, rt: Any) -> None:
    """The streaming VAD's shape ([Note: shapes a branch reads]): the If on the cloud.

    The edge computes the If's condition from ``sr``; the cloud's segment is the If with
    both rates' networks, declared as the model shipped it, so it loads.
    """
    pytest.importorskip("torch")
    from tierflow.zoo.vad import FRAME, HIDDEN, export_vad

    model_path = export_vad(tmp_path / "vad.onnx", dynamo=False)
    rng = np.random.default_rng(8)
    count = 4
    inputs = {
        "input": rng.standard_normal((count, 1, FRAME[16000])).astype(np.float32),
        "state": (rng.standard_normal((count, 2, 1, HIDDEN)) * 0.1).astype(np.float32),
        "sr": np.full(count, 16000, np.int64),
    }
    np.savez(tmp_path / "in.npz", **inputs)
    graph = load_model(model_path, sample=inputs)
    segments = split_model(graph, (0, 1))
    assert [spec.tier for spec, _ in segments] == ["edge", "cloud"]
    assert [n.op_type for n in segments[1][1].graph.node if n.op_type != "Constant"] == ["If"]
    plan_dir = tmp_path / "plan"
    save_split_plan(graph, segments, plan_dir, cuts=(0, 1), codec={"edge-cloud": "zstd"})
    out, report = tmp_path / "out.npz", tmp_path / "r.jsonl"
    with rt.processes() as serve:
        cloud = serve("cloud", plan_dir)
        edge = serve("edge", plan_dir, "--upstream", cloud.address)
        args = ["--input", str(tmp_path / "in.npz"), "--output", str(out), "--report", str(report)]
        # Its state pair keeps the LSTM state on the cloud: the rows are one session's.
        args += ["--session", "vad"]
        assert main(["run", "--plan", str(plan_dir), "--edge", edge.address, *args]) == 0
        assert edge.stop() == 0 and cloud.stop() == 0
    whole = SegmentRunner(model_path)
    lines = [json.loads(line) for line in report.read_text().splitlines()]
    assert [line["answered_by"] for line in lines] == ["cloud"] * count
    state = np.asarray(inputs["state"][0])  # taken from the first row only
    with np.load(out) as answers:
        for i in range(count):
            feeds = {"input": inputs["input"][i], "state": state, "sr": np.asarray(inputs["sr"][i])}
            expected = whole.run(feeds)
            state = expected.pop("stateN")
            for name, value in expected.items():
                np.testing.assert_array_equal(answers[name][i], value)
