"""An emulated slower tier is slower at its codec work too, as its profile says.

See [Note: emulating a slower tier] in tierflow/segment_runner.py.
"""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tierflow.cloud.server import CloudServer
from tierflow.device.client import DeviceClient
from tierflow.edge.server import EdgeServer
from tierflow.options import RuntimeOptions

SLOWDOWN = 20.0


@contextlib.contextmanager
def _device(plan_dir: Path, slowdown: float) -> Iterator[DeviceClient]:
    """A device, an edge and a cloud, all ``slowdown`` times slower than this machine."""
    options = RuntimeOptions(workers=1, slowdown=slowdown)
    cloud = CloudServer(plan_dir, "127.0.0.1:0", options=options)
    cloud.start()
    edge = EdgeServer(plan_dir, "127.0.0.1:0", cloud.address, options=options)
    try:
        edge.start()
        with DeviceClient(plan_dir, edge.address, options=options) as client:
            yield client
    finally:
        edge.stop(0.5)
        cloud.stop(0.5)


def _codec_ms(plan_dir: Path, slowdown: float, samples: list[Any]) -> dict[str, float]:
    """Median codec time of each tier over ``samples`` (the first one warms up)."""
    with _device(plan_dir, slowdown) as client:
        results = [client.infer(sample).unwrap() for sample in samples]
    return {
        tier: statistics.median(r.timings[tier]["codec_ms"] for r in results[1:])
        for tier in ("device", "edge")
    }


def test_a_slower_tier_encodes_and_decodes_slower(tmp_path: Path, rt: Any) -> None:
    # zstd on 256 KiB each way: the device encodes, the edge decodes and encodes again.
    split = rt.wide(tmp_path / "plan", width=65536, codec="zstd")
    samples = split.sample(seed=3, count=6)
    fast = _codec_ms(split.plan_dir, 1.0, samples)
    slow = _codec_ms(split.plan_dir, SLOWDOWN, samples)
    for tier in ("device", "edge"):
        # Without the emulation the two differ by noise only; with it, by about 20x.
        assert slow[tier] > 5 * fast[tier], (tier, fast, slow)
