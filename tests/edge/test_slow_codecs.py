"""An emulated slower tier is slower at its codec work too, as its profile says.

See [Note: emulating a slower tier] in tierflow/runtime/segment_runner.py.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import pytest

from tierflow.device.client import DeviceClient
from tierflow.options import RuntimeOptions

pytestmark = pytest.mark.integration

SLOWDOWN = 20.0


def _codec_ms(rt: Any, plan_dir: Path, slowdown: float, samples: list[Any]) -> dict[str, float]:
    """Median codec time of each tier over ``samples`` (the first one warms up), with a
    device, an edge and a cloud all ``slowdown`` times slower than this machine."""
    with (
        rt.tiers(plan_dir, workers=1, slowdown=slowdown) as (edge, _, _),
        DeviceClient(plan_dir, edge, options=RuntimeOptions(slowdown=slowdown)) as client,
    ):
        results = [client.infer(sample).unwrap() for sample in samples]
    return {
        tier: statistics.median(r.timings[tier]["codec_ms"] for r in results[1:])
        for tier in ("device", "edge")
    }


def test_a_slower_tier_encodes_and_decodes_slower(tmp_path: Path, rt: Any) -> None:
    # zstd on 256 KiB each way: the device encodes, the edge decodes and encodes again.
    split = rt.wide(tmp_path / "plan", width=65536, codec="zstd")
    samples = split.sample(seed=3, count=6)
    fast = _codec_ms(rt, split.plan_dir, 1.0, samples)
    slow = _codec_ms(rt, split.plan_dir, SLOWDOWN, samples)
    for tier in ("device", "edge"):
        # Without the emulation the two differ by noise only; with it, by about 20x.
        assert slow[tier] > 5 * fast[tier], (tier, fast, slow)
