"""The big-model benchmark's figures on synthetic generations (fast: no model, no servers)."""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks.big_model import measured, on_measured_compute, table


def run(ttft: float, per_token: float, *, step_cloud: float = 50.0) -> dict[str, Any]:
    """A ``generate --json`` line of 4 tokens, as the benchmark keeps it."""
    parts = {"device": 1.0, "edge": 20.0, "cloud": step_cloud, "queue": 0.1, "network": 40.0}
    return {
        "tokens": [1, 2, 3, 4],
        "ttft_ms": ttft,
        "ms_per_token": per_token,
        "bytes_per_token": {"device-edge": 100.0, "edge-cloud": 90.0},
        "parts_ms": {"prefill": dict(parts, cloud=200.0), "step": parts},
        "load_before": 1.0,
    }


PREDICTED = {
    "tiers": ["device", "edge", "cloud"],
    "ttft_ms": 300.0,
    "ms_per_token": 100.0,
    "tokens_per_s": 4e3 / 600.0,
    "bytes_per_token": {"device-edge": 100.0, "edge-cloud": 90.0},
    "prefill_ms": {"device": 1.0, "edge": 20.0, "cloud": 200.0},
    "step_ms": {"device": 1.0, "edge": 20.0, "cloud": 40.0},
}


def test_medians_tokens_per_second_and_the_model_on_measured_compute() -> None:
    got = measured([run(300.0, 100.0), run(500.0, 120.0, step_cloud=70.0), run(400.0, 110.0)])
    assert got["ttft_ms"] == 400.0 and got["ms_per_token"] == 110.0
    # 4 tokens: the first at TTFT, then 3 steps.
    assert got["tokens_per_s"] == pytest.approx(4e3 / (400.0 + 3 * 110.0))
    assert got["parts_ms"]["step"]["cloud"] == 50.0 and got["same_tokens_every_run"]
    # The model's 39 ms of links and round trips, with the runtime's 71 ms of compute.
    assert on_measured_compute(PREDICTED, got, "step") == pytest.approx(39.0 + 71.0)
    assert on_measured_compute(PREDICTED, got, "prefill") == pytest.approx(79.0 + 221.0)


def test_the_table_sets_each_layout_beside_its_prediction_and_the_split() -> None:
    slow = measured([run(600.0, 200.0)])
    serving = {
        "three-tier": {"predicted": PREDICTED, "measured": measured([run(330.0, 110.0)])},
        "cloud-only": {"predicted": PREDICTED, "measured": slow, "same_as_unsplit": True},
    }
    text = "\n".join(table(serving))
    assert "| three-tier | device+edge+cloud | 300 / 330 (1.10x) | 100.0 / 110.0 (1.10x)" in text
    assert "three-tier against cloud-only, measured: TTFT 0.55x, ms/token 0.55x" in text
    assert "on the three-tier plan: met (off by 10% and 10%)" in text
