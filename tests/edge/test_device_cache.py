"""``run --cache`` on the device: repeats are answered there, with no compute or network.

The edge and the cloud are called in process ([Note: the next tier in process] in
tierflow/runtime/upstream.py); ``tierflow run`` reaches them as servers.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tierflow.cache.config import build_cache, parse_cache_spec


def test_exact_repeats_are_answered_on_the_device(tmp_path: Path, rt: Any) -> None:
    split = rt.cnn(tmp_path / "plan", {"device-edge": "raw", "edge-cloud": "raw"})
    a, b, c = split.sample(seed=21, count=3)
    stream = [a, b, a, c, b, a]
    cache = build_cache(parse_cache_spec("exact:1MiB"))
    with rt.device(split.plan_dir, window=1, cache=cache) as device:
        results = [r.unwrap() for r in device.run_stream(stream)]
    hits = [r.cache_hit for r in results]
    assert hits == [False, False, True, False, True, True]
    first = {0: results[0], 1: results[1]}
    for index, source in ((2, 0), (4, 1), (5, 0)):
        hit = results[index]
        assert hit.answered_by == "device" and hit.exit is None
        assert hit.bytes == {"device-edge": 0, "edge-cloud": 0}
        assert hit.ms["edge"] == 0 and hit.ms["cloud"] == 0
        np.testing.assert_array_equal(hit.outputs["y"], first[source].outputs["y"])
        np.testing.assert_array_equal(hit.outputs["y"], split.reference(stream[index])["y"])
    assert all(r.answered_by == "cloud" for r, h in zip(results, hits, strict=True) if not h)
    assert cache is not None and cache.stats().hits == 3


def test_near_identical_frames_hit_the_approximate_cache(tmp_path: Path, rt: Any) -> None:
    split = rt.cnn(tmp_path / "plan", {"device-edge": "raw", "edge-cloud": "raw"})
    frame, other = split.sample(seed=22, count=2)
    nudged = {"x": frame["x"] + np.float32(1e-4)}
    cache = build_cache(parse_cache_spec("approx:1MiB,threshold=0.01"))
    with rt.device(split.plan_dir, window=1, cache=cache) as device:
        missed, near, far = (r.unwrap() for r in device.run_stream([frame, nudged, other]))
    assert not missed.cache_hit and near.cache_hit and not far.cache_hit
    assert near.answered_by == "device" and near.bytes["device-edge"] == 0
    np.testing.assert_array_equal(near.outputs["y"], missed.outputs["y"])
    assert far.answered_by == "cloud"


@pytest.mark.integration
def test_run_cache_marks_hits_in_the_report(tmp_path: Path, rt: Any) -> None:
    split = rt.cnn(tmp_path / "plan", {"device-edge": "raw", "edge-cloud": "raw"})
    a, b = split.sample(seed=23, count=2)
    requests = tmp_path / "in.npz"
    np.savez(requests, x=np.concatenate([a["x"], b["x"], a["x"], a["x"]]))
    report = tmp_path / "r.jsonl"
    with rt.tiers(split.plan_dir) as (edge, _, _):
        command = [sys.executable, "-m", "tierflow.cli", "run", "--plan", str(split.plan_dir)]
        command += ["--edge", edge, "--input", str(requests), "--report", str(report)]
        command += ["--window", "1", "--cache", "exact:1MiB"]
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in report.read_text().splitlines()]
    assert [line["cache_hit"] for line in lines] == [False, False, True, True]
    assert [line["answered_by"] for line in lines] == ["cloud", "cloud", "device", "device"]
    refused = subprocess.run(
        [*command[:-1], "redis://127.0.0.1:1/0?budget=1MiB"], capture_output=True, text=True
    )
    assert refused.returncode == 2 and "shared by servers" in refused.stderr
