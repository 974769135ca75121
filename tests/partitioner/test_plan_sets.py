"""``tierflow plan --adaptive``: one directory, every plan best somewhere, shared segments."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest

from tierflow.cli.main import main
from tierflow.partitioner.graph import load_model
from tierflow.partitioner.profile import save_profile
from tierflow.partitioner.split import run_segments, session
from tierflow.plan import SegmentSpec, load_plan, load_plan_set

from ..profiles import graph_profile
from .conftest import write_mlp


@pytest.fixture(scope="module")
def model(tmp_path_factory: Any) -> Path:
    """An MLP whose features shrink (1024 -> 256 -> 64 -> 10): where to cut depends on rate."""
    path = tmp_path_factory.mktemp("model") / "mlp.onnx"
    return write_mlp(path, [1024, 256, 64, 10], batch=4, scale=0.05)


@pytest.fixture(scope="module")
def profiles(model: Path, tmp_path_factory: Any) -> list[str]:
    """``--profile`` options for every tier: given figures, so nothing is measured here.

    The device computes each layer in 2.5 ms, 0.5 ms and 0.1 ms, 50 times the edge and
    the cloud: a fast link makes offloading pay, a slow one does not.
    """
    graph = load_model(model)
    directory = tmp_path_factory.mktemp("profiles")
    cloud = graph_profile(graph, (5e-5, 1e-5, 2e-6))
    args = []
    for tier, profile in (("device", cloud.emulate(50.0)), ("edge", cloud), ("cloud", cloud)):
        args += ["--profile", f"{tier}={save_profile(profile, directory / f'{tier}.json')}"]
    return args


def test_plan_adaptive_writes_a_set_with_regions_and_shared_segments(
    model: Path, profiles: list[str], tmp_path: Path, capsys: Any
) -> None:
    out = tmp_path / "set"
    # 10 kbit/s makes sending anything cost seconds; 100 Gbit/s with no RTT makes it free
    # next to a device 50x slower than the edge and the cloud.
    args = ["plan", str(model), "-o", str(out), "--adaptive", *profiles]
    args += ["--grid", "device-edge=10kbit,100gbit/0ms", "--grid", "edge-cloud=100gbit/0ms"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "best plan by link rate" in printed and "A (default)" in printed
    plans = load_plan_set(out)
    data = json.loads((out / "plan.json").read_text())
    assert data["format"] == "tierflow.plan/2" and len(data["plans"]) == len(plans.plans)
    # 3 device-edge rates x 2 RTTs, 2 edge-cloud rates x 2 RTTs; each point in one region.
    assert sum(len(region) for region in plans.regions) == 3 * 2 * 2 * 2
    assert load_plan(out) == plans.plans[0]  # the plan for --link (20mbit,10ms) is the default
    slow = {"device-edge": (10e3, 0.0), "edge-cloud": (100e9, 0.0)}
    fast = {"device-edge": (100e9, 0.0), "edge-cloud": (100e9, 0.0)}

    def best_at(point: dict[str, tuple[float, float]]) -> int:
        return next(
            i
            for i, region in enumerate(plans.regions)
            for p in region
            if all((p[n].rate_bps, p[n].rtt_s) == point[n] for n in point)
        )

    assert [s.tier for s in plans.plans[best_at(slow)].segments] == ["device"]
    assert best_at(fast) != best_at(slow)
    # Segments that compute the same thing are one file, whatever tier runs them.
    named = [s.file for plan in plans.plans for s in plan.segments]
    files = sorted(p.name for p in out.iterdir() if p.suffix == ".onnx")
    assert files == sorted(set(named)) and len(files) < len(named)
    # Each segment's file is recorded with its sha256 and size (fetching checks them).
    for spec in (s for plan in plans.plans for s in plan.segments):
        data_ = (out / spec.file).read_bytes()
        assert (spec.sha256, spec.size) == (hashlib.sha256(data_).hexdigest(), len(data_))
    # Every plan of the set reproduces the model bit for bit.
    x = np.random.default_rng(1).standard_normal((4, 1024)).astype(np.float32)
    (want,) = session(onnx.load(model)).run(None, {"x": x})
    for plan in plans.plans:
        chain: list[tuple[SegmentSpec, onnx.ModelProto]] = [
            (spec, onnx.load(out / spec.file)) for spec in plan.segments
        ]
        got = run_segments(chain, {"x": x})["h2"]
        assert got.tobytes() == want.tobytes()
    # Planning again replaces the set whole; --grid needs --adaptive.
    assert main(["plan", str(model), "-o", str(out), *profiles]) == 0
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["plan.json", *(s.file for s in load_plan(out).segments)]
    )
    capsys.readouterr()
    assert main(["plan", str(model), "-o", str(out), "--grid", "device-edge=1mbit"]) == 2
    assert "add --adaptive" in capsys.readouterr().err
