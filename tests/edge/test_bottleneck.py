"""A learned bottleneck end to end: trained on the demo model, planned, served on three tiers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tierflow.cli.main import main
from tierflow.options import RuntimeOptions
from tierflow.plan import load_plan
from tierflow.runtime.segment_runner import SegmentRunner

pytestmark = pytest.mark.integration

pytest.importorskip("torch")


def test_a_grafted_bottleneck_splits_serves_and_reports_its_fidelity(
    demo_build: tuple[Any, list[Any]], tmp_path: Path, rt: Any, capsys: Any
) -> None:
    from tierflow.partitioner.graph import load_model

    demo, _ = demo_build
    calib = np.load(demo.directory / "calib.npz")
    data = tmp_path / "calib.npz"
    np.savez(data, image=calib["image"][:160])
    model = demo.directory / "model.onnx"
    grafted = tmp_path / "model-bn.onnx"
    args = ["bottleneck", "add", str(model), "--data", str(data), "-o", str(grafted)]
    args += ["--at", "relu_6", "--channels", "4", "--bits", "8", "--steps", "120", "--json"]
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    (point,) = report["points"]
    assert report["at"] == "relu_6" and report["code"] == "relu_6.bottleneck.codes"
    assert report["distillation"].startswith("features + outputs")
    assert point["code_bytes"] == 4 * 8 * 8 < report["feature_bytes"] == 64 * 8 * 8 * 4
    assert 0 < point["zstd_bytes"] <= 4 * 8 * 8 + 16
    assert report["measured_on"] == 48 and point["agreement"] >= 0.85

    # The partitioner sees the codes as a one-tensor cut, the cheapest after the input.
    graph = load_model(grafted)
    (code_cut,) = [c for c in graph.cuts if c.tensors == (report["code"],)]
    assert code_cut.nbytes == 256
    assert code_cut.nbytes < min(c.nbytes for c in graph.cuts[1 : code_cut.index])
    # A device that cannot hold the layers after the decoder's first convolution, behind a
    # slow link: the plan must send the codes.
    peak = max(graph.peak_activation_bytes(i, i + 1) for i in range(code_cut.index))
    fits = graph.weight_bytes(0, code_cut.index) + peak
    budget = fits + graph.weight_bytes(code_cut.index, code_cut.index + 1) // 2
    plan_dir = tmp_path / "plan"
    args = ["plan", str(grafted), "-o", str(plan_dir), "--codec", "zstd"]
    args += ["--link", "device-edge=200kbit,5ms", "--memory", f"device={budget}B"]
    assert main(args) == 0, capsys.readouterr().err
    plan = load_plan(plan_dir)
    assert plan.segments[0].tier == "device"
    assert list(plan.segments[0].outputs) == [report["code"]]

    # Served on three tiers: bit for bit the grafted model; against the exact model, the
    # agreement reported for held-out data.
    heldout = np.load(demo.directory / "heldout.npz")
    samples = [{"image": heldout["image"][i]} for i in range(24)]
    extended = RuntimeOptions(optimization="extended")
    whole = SegmentRunner(grafted, extended)
    exact = SegmentRunner(model, extended)
    with rt.device(plan_dir, tiers={"optimization": "extended"}, options=extended) as device:
        results = [r.unwrap() for r in device.run_stream(samples)]
    agree = []
    for feeds, result in zip(samples, results, strict=True):
        np.testing.assert_array_equal(result.outputs["logits"], whole.run(feeds)["logits"])
        assert 0 < result.bytes["device-edge"] <= 256 + 200
        agree.append(result.outputs["logits"].argmax() == exact.run(feeds)["logits"].argmax())
    assert np.mean(agree) >= 0.8
