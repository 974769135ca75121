"""``benchmarks/lib/tiers.py``: a plan's cloud and edge served as processes, read as an
operator reads them (batch calls from the metrics text, peak memory), always stopped."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest
from onnx import helper

from benchmarks.lib.plans import Stage, chain_plan
from benchmarks.lib.tiers import (
    batch_calls,
    batch_seconds,
    batch_sizes,
    cpu_seconds,
    peak_rss,
    served,
)
from tierflow.runtime.batching import BatchStats

prometheus = pytest.importorskip("prometheus_client")


def test_batch_sizes_are_the_tiers_calls_by_steps_from_its_metrics_text() -> None:
    from tierflow.runtime.metrics import TierMetrics

    stats = [  # two plans' batchers
        BatchStats(sizes={1: 3, 8: 2}, seconds={1: 0.25, 8: 1.0}),
        BatchStats(sizes={8: 1}, seconds={8: 0.5}),
    ]
    metrics = TierMetrics("cloud", lambda: 0, batches=lambda: stats)
    text = prometheus.generate_latest(metrics.registry).decode()
    assert batch_sizes(text) == {1: 3, 8: 3}
    assert batch_seconds(text) == {1: 0.25, 8: 1.5}
    quiet = TierMetrics("edge", lambda: 0, batches=lambda: [])
    assert batch_sizes(prometheus.generate_latest(quiet.registry).decode()) == {}


def test_cpu_seconds_count_what_a_process_has_run() -> None:
    before = cpu_seconds()
    ends = time.process_time() + 0.05
    while time.process_time() < ends:  # 50 ms of work on this thread
        pass
    assert cpu_seconds() - before >= 0.03  # clock ticks of 10 ms
    assert cpu_seconds(os.getpid()) >= cpu_seconds() - 0.02


def test_peak_rss_is_this_process_high_water_mark() -> None:
    mine = peak_rss()
    assert mine > 1 << 20  # a Python process with numpy holds more than a MiB
    assert peak_rss(os.getpid()) >= mine


def _plan(directory: Path) -> Path:
    width = 8
    weights = {"w": np.eye(width, dtype=np.float32)}
    stages = [
        Stage("device", [helper.make_node("Relu", ["x"], ["h1"])], "h1", width),
        Stage("edge", [helper.make_node("Gemm", ["h1", "w"], ["h2"])], "h2", width),
        Stage("cloud", [helper.make_node("Relu", ["h2"], ["y"])], "y", width),
    ]
    return chain_plan(directory, width, stages, weights)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


@pytest.mark.integration
def test_served_tiers_answer_metrics_and_are_stopped_even_on_failure(tmp_path: Path) -> None:
    plan = _plan(tmp_path / "plan")
    with (
        pytest.raises(RuntimeError, match="the suite failed"),
        served(plan, ["--threads", "1"], tmp_path / "logs") as tiers,
    ):
        pids = [tier.pid for tier in tiers.tiers.values()]
        assert set(tiers.tiers) == {"cloud", "edge"} and tiers.edge.startswith("127.0.0.1:")
        assert all(_alive(pid) for pid in pids)
        assert batch_calls(tiers.tiers["cloud"].metrics) == ({}, {})  # not a decoder: no batcher
        assert peak_rss(tiers.tiers["cloud"].pid) > 0
        raise RuntimeError("the suite failed")
    assert not any(_alive(pid) for pid in pids)
    assert (tmp_path / "logs" / "cloud.log").exists() and (tmp_path / "logs" / "edge.log").exists()
