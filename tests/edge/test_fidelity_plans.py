"""Plans made under a fidelity budget, served by the tiers: exact by default, the budget met.

The model is an MLP whose first input element is a large constant it ignores, so int8 on
the input flips answers while fp16 does not; the device is made slow and the links
narrow, so sending the input compressed is what the planner wants. Both sides run at
the tiers' ONNX Runtime optimisation level (see [Note: optimization level and
exactness] in tierflow/onnxrt/inference.py). The tiers are called in process.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tierflow.codec.base import CodecSpec
from tierflow.link.spec import LinkSpec
from tierflow.onnxrt.inference import open_session
from tierflow.partitioner.fidelity import FidelityBudget
from tierflow.partitioner.graph import load_model
from tierflow.partitioner.plan_options import PlanOptions
from tierflow.partitioner.planner import make_plan
from tierflow.partitioner.profile import profile_model

WIDTH = 1024
LINKS = {"device-edge": LinkSpec.parse("1mbit,1ms"), "edge-cloud": LinkSpec.parse("1mbit,1ms")}


def _mlp(path: Path) -> Path:
    rng = np.random.default_rng(0)
    w0 = (rng.standard_normal((WIDTH, 64)) / np.sqrt(WIDTH)).astype(np.float32)
    w0[0, :] = 0.0
    w1 = (rng.standard_normal((64, 10)) / 8.0).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w0"], ["m"]),
            helper.make_node("Relu", ["m"], ["h"]),
            helper.make_node("MatMul", ["h", "w1"], ["y"]),
        ],
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, WIDTH])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 10])],
        [numpy_helper.from_array(w0, "w0"), numpy_helper.from_array(w1, "w1")],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def _sample(count: int, seed: int) -> dict[str, np.ndarray]:
    x = np.random.default_rng(seed).standard_normal((count, 1, WIDTH)).astype(np.float32)
    x[:, 0, 0] = 1000.0
    return {"x": x}


@pytest.fixture(scope="module")
def planned(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, dict[str, Any]]:
    path = _mlp(tmp_path_factory.mktemp("fidelity-plans") / "mlp.onnx")
    graph = load_model(path)
    base = profile_model(graph, time_budget_s=0.3)
    # A unit's measured time can be near 0 on a loaded machine (it is what is left after
    # the call overhead), so the slow device gets a floor of 0.1 s a unit as well.
    slow_units = tuple(replace(u, compute_s=max(u.compute_s * 1e4, 0.1)) for u in base.units)
    slow = replace(base, units=slow_units)
    return path, graph, {"device": slow, "edge": base.emulate(2.0), "cloud": base}


def _serve(rt: Any, plan_dir: Path, requests: list[dict[str, np.ndarray]]) -> list[Any]:
    with rt.device(plan_dir, window=8) as device:  # the tiers in process
        return [r.unwrap() for r in device.run_stream(requests)]


def _reference(path: Path, requests: list[dict[str, np.ndarray]]) -> list[np.ndarray]:
    """The unsplit model's outputs at the tiers' optimisation level and thread count."""
    session = open_session(path)
    return [session.run(["y"], feeds)[0] for feeds in requests]


def _requests(sample: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
    return [{"x": row} for row in sample["x"]]


def test_the_default_plan_is_bit_exact_through_the_tiers(
    planned: Any, tmp_path: Path, rt: Any
) -> None:
    path, graph, profiles = planned
    outcome = make_plan(graph, profiles, PlanOptions(links=LINKS), tmp_path / "plan")
    assert outcome.plan.segments[0].tier != "device"  # the input crosses a link ...
    assert all(CodecSpec.parse(c).lossless for c in outcome.plan.codec.values())  # ... exactly
    requests = _requests(_sample(12, 1))
    results = _serve(rt, tmp_path / "plan", requests)
    for expected, result in zip(_reference(path, requests), results, strict=True):
        assert result.outputs["y"].dtype == expected.dtype
        np.testing.assert_array_equal(result.outputs["y"], expected)


def test_a_top1_budget_holds_on_held_out_requests_through_the_tiers(
    planned: Any, tmp_path: Path, rt: Any
) -> None:
    path, graph, profiles = planned
    options = PlanOptions(links=LINKS, fidelity=FidelityBudget.parse("top1=98%"))
    outcome = make_plan(graph, profiles, options, tmp_path / "plan", sample=_sample(100, 2))
    assert any(not CodecSpec.parse(c).lossless for c in outcome.plan.codec.values())
    held_out = _requests(_sample(100, 3))  # requests the planner did not see
    results = _serve(rt, tmp_path / "plan", held_out)
    agree = sum(
        int(result.outputs["y"].argmax() == expected.argmax())
        for expected, result in zip(_reference(path, held_out), results, strict=True)
    )
    assert agree >= 98, f"{agree} of 100 held-out requests agree"
