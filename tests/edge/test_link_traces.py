"""``tierflow run --link-emulation trace=FILE.csv``: a mid-stream rate step shows in requests."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytestmark = pytest.mark.integration


def test_a_trace_that_steps_the_rate_mid_stream_changes_transfer_time(
    tmp_path: Path, rt: Any
) -> None:
    from tierflow.cli.main import main

    split = rt.cnn(tmp_path / "plan", {"device-edge": "raw", "edge-cloud": "raw"})
    samples = split.sample(seed=11, count=40)
    np.savez(tmp_path / "in.npz", **{"x": np.concatenate([s["x"] for s in samples])})
    # h1 is 2 KiB a request: ~55 ms at 300 kbit/s, ~0.2 ms at 100 Mbit/s. With one request
    # in flight at most 19 fit in the first second, so the stream spans the step up.
    (tmp_path / "up.csv").write_text("seconds,rate,rtt\n0,300kbit,2ms\n1,100mbit,2ms\n")
    with rt.tiers(split.plan_dir) as (edge, _, _):
        args = ["run", "--plan", str(split.plan_dir), "--edge", edge, "--window", "1"]
        args += ["--input", str(tmp_path / "in.npz"), "--output", str(tmp_path / "out.npz")]
        args += ["--report", str(tmp_path / "r.jsonl")]
        assert main([*args, "--link-emulation", f"trace={tmp_path / 'up.csv'}"]) == 0
    lines = [json.loads(line) for line in (tmp_path / "r.jsonl").read_text().splitlines()]
    lines.sort(key=lambda line: int(line["id"]))
    rates = [line["rate_bps"]["device-edge"] for line in lines]
    totals = [line["ms"]["total"] for line in lines]
    slow = [i for i, rate in enumerate(rates) if rate < 400e3]
    fast = [i for i, rate in enumerate(rates) if rate > 50e6]
    # Requests went at the trace's rates, the slow ones first, then the fast; at most one
    # (sent across the step) went partly at each.
    assert slow and fast and max(slow) < min(fast)
    assert len(lines) - len(slow) - len(fast) <= 1 and min(fast) - max(slow) <= 2
    whole = slow[:-1]  # the last slow one may have been sent across the step
    assert whole and all(250e3 < rates[i] <= 301e3 for i in whole)
    assert all(totals[i] >= 50 for i in whole)
    assert statistics.median(totals[i] for i in slow) > statistics.median(totals[i] for i in fast)
    with np.load(tmp_path / "out.npz") as out:
        for i, feeds in enumerate(samples):
            np.testing.assert_array_equal(out["y"][i], split.reference(feeds)["y"][0])
