"""``--link-emulation trace=FILE.csv``: a mid-stream rate step shows in requests.

The tiers run in this process, the device's link replaying the trace on a clock that
never sleeps ([Note: the next tier in process] in tierflow/runtime/upstream.py), as
``tierflow run --link-emulation`` sets it (:func:`resolve_links`); the command over gRPC
with a trace is taken end to end in test_segments.py (a switch back after a rate drop).
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import numpy as np

from tierflow.link.emulation import LinkEmulation, resolve_links
from tierflow.options import RuntimeOptions
from tierflow.plan import load_plan


def test_a_trace_that_steps_the_rate_mid_stream_changes_transfer_time(
    tmp_path: Path, rt: Any
) -> None:
    split = rt.cnn(tmp_path / "plan", {"device-edge": "raw", "edge-cloud": "raw"})
    samples = split.sample(seed=11, count=40)
    # h1 is 2 KiB a request: ~55 ms at 300 kbit/s, ~0.2 ms at 100 Mbit/s. With one request
    # in flight at most 19 fit in the first second, so the stream spans the step up.
    (tmp_path / "up.csv").write_text("seconds,rate,rtt\n0,300kbit,2ms\n1,100mbit,2ms\n")
    emulation = LinkEmulation.parse(f"trace={tmp_path / 'up.csv'}")
    links = resolve_links(load_plan(split.plan_dir).links, emulation)
    clock = rt.clock()  # moves on as the link carries each request
    with (
        rt.in_process(split.plan_dir, clock=clock) as tiers,
        tiers.device(window=1, options=RuntimeOptions(links=links)) as device,
    ):
        results = [r.unwrap() for r in device.run_stream(samples)]
    rates = [r.rate_bps["device-edge"] for r in results]
    transfers = [r.links["device-edge"]["transfer_ms"] for r in results]
    slow = [i for i, rate in enumerate(rates) if rate < 400e3]
    fast = [i for i, rate in enumerate(rates) if rate > 50e6]
    # Requests went at the trace's rates, the slow ones first, then the fast; at most one
    # (sent across the step) went partly at each.
    assert slow and fast and max(slow) < min(fast)
    assert len(results) - len(slow) - len(fast) <= 1 and min(fast) - max(slow) <= 2
    whole = slow[:-1]  # the last slow one may have been sent across the step
    assert whole and all(250e3 < rates[i] <= 301e3 for i in whole)
    assert all(transfers[i] >= 50 for i in whole)
    assert statistics.median(transfers[i] for i in slow) > 100 * max(transfers[i] for i in fast)
    assert 15 <= len(slow) <= 19  # the first second held as many as the trace's rate lets
    for feeds, result in zip(samples, results, strict=True):
        np.testing.assert_array_equal(result.outputs["y"], split.reference(feeds)["y"])
