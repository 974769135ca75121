"""The comparison benchmark's ``--quick`` mode runs end to end, so it never rots.

One run (module-scoped) writes into a temporary folder; the tests check what a reader of
``RESULTS.md`` and ``results.json`` relies on, against the issue's contract.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
STRATEGIES = {
    "device-only",
    "cloud-only",
    "cloud-only-compressed",
    "single-split",
    "tierflow",
    "tierflow-exits",
}
MODELS = {"vgg-like", "resnet18", "mobilenetv2", "transformer", "demo-digits"}

# One quick run takes about a minute, more on a fresh machine (the demo model is trained
# and cached on first use).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    out = tmp_path_factory.mktemp("bench")
    env = dict(os.environ, MPLBACKEND="Agg")
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "run.py"), "--quick", "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    rows = json.loads((out / "results.json").read_text())
    return out, rows


def test_rows_cover_every_model_strategy_and_bandwidth(
    quick_run: tuple[Path, list[dict[str, Any]]],
) -> None:
    _, rows = quick_run
    assert {r["model"] for r in rows} == MODELS
    assert {r["strategy"] for r in rows} == STRATEGIES
    bandwidths = {r["bandwidth_mbit"] for r in rows}
    assert len(bandwidths) >= 3
    for row in rows:
        for key in ("model", "bandwidth_mbit", "strategy", "p50_ms"):
            assert key in row, (key, row)
        assert row["p50_ms"] > 0
    seen = {(r["model"], r["bandwidth_mbit"], r["strategy"]) for r in rows}
    assert len(seen) == len(rows) == len(MODELS) * len(bandwidths) * len(STRATEGIES)


def test_tierflow_rows_report_regret_against_the_best_measured_plan(
    quick_run: tuple[Path, list[dict[str, Any]]],
) -> None:
    _, rows = quick_run
    tierflow = [r for r in rows if r["strategy"] == "tierflow"]
    for row in tierflow:
        best = row["best_measured"]["p50_ms"]
        assert row["regret"] >= 0
        assert row["regret"] == pytest.approx(row["p50_ms"] / best - 1)
        assert row["plans_compared"] > 1


def test_no_strategy_beats_the_best_measured_plan(
    quick_run: tuple[Path, list[dict[str, Any]]],
) -> None:
    """The measured best is the minimum over plans that include every planned strategy."""
    _, rows = quick_run
    for row in rows:
        if row["strategy"] in ("tierflow-exits",):
            continue
        best = next(
            r["best_measured"]["p50_ms"]
            for r in rows
            if r["strategy"] == "tierflow"
            and r["model"] == row["model"]
            and r["bandwidth_mbit"] == row["bandwidth_mbit"]
        )
        assert row["p50_ms"] >= best * (1 - 1e-9), row


def test_device_only_needs_no_link_and_cloud_only_does(
    quick_run: tuple[Path, list[dict[str, Any]]],
) -> None:
    _, rows = quick_run
    for row in rows:
        if row["strategy"] == "device-only":
            assert row["codec_used"] == {}
            assert row["cuts"][0] == row["cuts"][1] == row["last_cut"]
        if row["strategy"] == "cloud-only":
            assert row["cuts"] == [0, 0]
            assert row["codec_used"] == {"device-edge": "raw", "edge-cloud": "raw"}


def test_cloud_only_gets_faster_with_bandwidth(
    quick_run: tuple[Path, list[dict[str, Any]]],
) -> None:
    """Sending the raw input is dominated by the link, so more bandwidth must help."""
    _, rows = quick_run
    for model in MODELS:
        points = sorted(
            (r["bandwidth_mbit"], r["p50_ms"])
            for r in rows
            if r["model"] == model and r["strategy"] == "cloud-only"
        )
        latencies = [p for _, p in points]
        assert latencies[0] > latencies[-1], (model, points)


def test_demo_exits_leave_early_and_keep_accuracy(
    quick_run: tuple[Path, list[dict[str, Any]]],
) -> None:
    _, rows = quick_run
    exits = [r for r in rows if r["model"] == "demo-digits" and r["strategy"] == "tierflow-exits"]
    assert exits
    for row in exits:
        assert row["exits_used"]
        assert row["exit_rate"] > 0
        assert row["accuracy"] >= row["accuracy_without_exits"] - 0.05


def test_report_and_plots_are_written(quick_run: tuple[Path, list[dict[str, Any]]]) -> None:
    out, _ = quick_run
    text = (out / "RESULTS.md").read_text()
    for needle in ("Machine and emulation", "Summary", "regret", "slowdown", "RTT"):
        assert needle in text
    for name in ("latency_vs_bandwidth.png", "cuts.png", "speedup.png"):
        data = (out / name).read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) > 10_000
