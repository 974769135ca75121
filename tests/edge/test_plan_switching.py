"""Switching plans mid-stream: the device-edge rate drops 100x and comes back.

See [Note: switching plans on the device] in device/adaptation.py.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import numpy as np
import onnx.utils
import pytest

from tierflow.link.spec import LinkSpec
from tierflow.onnxrt.inference import open_session
from tierflow.plan import Plan, PlanSet, SegmentSpec, load_plan, save_plan_set
from tierflow.runtime.segment_runner import SegmentRunner, TierRunner


def _plan_set(split: Any) -> tuple[Plan, Plan]:
    """The cnn's split (2 KiB crosses device-edge) and a plan that sends 32 bytes instead.

    ``fast`` is device conv | edge conv | cloud head, best at 200 Mbit/s; ``slow`` runs
    both convolutions and the pooling on the device, shares their segment files with
    ``fast``, and sends only the pooled features: best at 2 Mbit/s.
    """
    directory = split.plan_dir
    fast = load_plan(directory)
    rtt = 0.02
    fast = Plan(
        fast.model_file,
        fast.model_sha256,
        fast.inputs,
        fast.outputs,
        fast.segments,
        links={"device-edge": LinkSpec(200e6, rtt)},
        codec=fast.codec,
    )
    model = str(directory / fast.model_file)
    onnx.utils.extract_model(model, str(directory / "pool.onnx"), ["h2"], ["f"])
    onnx.utils.extract_model(model, str(directory / "head.onnx"), ["f"], ["y"])
    conv1, conv2, _ = fast.segments
    slow = Plan(
        fast.model_file,
        fast.model_sha256,
        fast.inputs,
        fast.outputs,
        (
            conv1,
            SegmentSpec("device", conv2.file, conv2.inputs, conv2.outputs),
            SegmentSpec("device", "pool.onnx", ("h2",), ("f",)),
            SegmentSpec("cloud", "head.onnx", ("f",), ("y",)),
        ),
        codec=fast.codec,
    )
    regions = (({"device-edge": LinkSpec(200e6, rtt)},), ({"device-edge": LinkSpec(2e6, rtt)},))
    save_plan_set(PlanSet((fast, slow), regions), directory)
    return fast, slow


@pytest.mark.integration
def test_a_rate_drop_and_recovery_switches_plans_both_ways_losing_nothing(
    tmp_path: Path, rt: Any
) -> None:
    from tierflow.cli.main import main

    split = rt.cnn(tmp_path / "plan", {"device-edge": "raw", "edge-cloud": "raw"})
    fast, slow = _plan_set(split)
    # Each request takes at least 10 ms (half the RTT, one at a time), so the stream lasts
    # 2.6 s or more: past the drop, the rise, and the hold of each switch after them.
    count = 260
    samples = split.sample(seed=41, count=count)
    np.savez(tmp_path / "in.npz", x=np.concatenate([s["x"] for s in samples]))
    trace = tmp_path / "trace.csv"
    trace.write_text("seconds,rate,rtt\n0,200mbit,20ms\n0.4,2mbit,20ms\n1.4,200mbit,20ms\n")
    with rt.tiers(split.plan_dir) as (edge, _, cloud):
        assert cloud.tier.opened_plans == [fast.plan_id]  # the other opens when asked for
        args = ["run", "--plan", str(split.plan_dir), "--edge", edge, "--window", "1"]
        args += ["--input", str(tmp_path / "in.npz"), "--output", str(tmp_path / "out.npz")]
        args += ["--report", str(tmp_path / "r.jsonl"), "--link-emulation", f"trace={trace}"]
        assert main(args) == 0
        assert sorted(cloud.tier.opened_plans) == sorted([fast.plan_id, slow.plan_id])
    lines = [json.loads(line) for line in (tmp_path / "r.jsonl").read_text().splitlines()]
    lines.sort(key=lambda line: int(line["id"]))
    assert [int(line["id"]) for line in lines] == list(range(count))  # one answer each
    assert all(line["error"] is None and line["answered_by"] == "cloud" for line in lines)
    plans = [line["plan"] for line in lines]
    runs = [plans[0]] + [b for a, b in itertools.pairwise(plans) if a != b]
    assert runs == [fast.plan_id, slow.plan_id, fast.plan_id]  # both ways, no flapping
    switches = [i for i, line in enumerate(lines) if line["switch"]]
    assert switches == [i for i in range(1, count) if plans[i] != plans[i - 1]]
    assert "2" in lines[switches[0]]["switch"]  # why: the estimate it switched on
    sent = {p: {line["bytes"]["device-edge"] for line in lines if line["plan"] == p} for p in runs}
    assert max(sent[slow.plan_id]) * 10 < min(sent[fast.plan_id])
    reference = open_session(split.model_path)  # the unsplit model, at the tiers' settings
    with np.load(tmp_path / "out.npz") as out:
        for i, feeds in enumerate(samples):
            np.testing.assert_array_equal(out["y"][i], reference.run(["y"], feeds)[0][0])


def test_plans_of_a_set_open_a_shared_segment_file_once(tmp_path: Path, rt: Any) -> None:
    split = rt.cnn(tmp_path / "plan", {"device-edge": "raw", "edge-cloud": "raw"})
    fast, slow = _plan_set(split)
    sessions: dict[Path, SegmentRunner] = {}
    first = TierRunner(fast, split.plan_dir, "device", sessions=sessions)
    second = TierRunner(slow, split.plan_dir, "device", sessions=sessions)
    assert first.segments[0][2] is second.segments[0][2]  # conv1: one session
    assert len(sessions) == 3  # conv1, conv2 and the pooling, each opened once
