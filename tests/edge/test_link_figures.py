"""Link figures in the report: waiting is apart from transfer, and failures send 0 bytes.

See [Note: honest link figures] in tierflow/link/emulation.py. The tiers run in this
process on emulated links whose clock never sleeps ([Note: the next tier in process] in
tierflow/runtime/upstream.py); the integration test at the end takes requests over gRPC
to a peer that was never reached.
"""

from __future__ import annotations

import socket
import statistics
from pathlib import Path
from typing import Any

import pytest

from tierflow.device.client import DeviceClient, Result
from tierflow.edge.forwarding import Forwarding
from tierflow.errors import TransportError
from tierflow.link.spec import LINKS, LinkSpec
from tierflow.options import RuntimeOptions
from tierflow.runtime.server import TierServer

RATE_BPS = 5e6


def test_requests_handed_while_the_link_is_busy_report_its_rate_and_their_queueing_apart(
    tmp_path: Path, rt: Any
) -> None:
    split = rt.cnn(tmp_path / "plan", {"device-edge": "raw", "edge-cloud": "raw"})
    samples = split.sample(seed=11, count=48)
    links = {link: LinkSpec(RATE_BPS, 0.002) for link in LINKS}
    clock = rt.clock(runs=False)  # every request handed at one moment, as a full window
    with (
        rt.in_process(split.plan_dir, clock=clock, links=links) as tiers,
        tiers.device(window=16, options=RuntimeOptions(links=links)) as dev,
    ):
        results = [r.unwrap() for r in dev.run_stream(samples)]
    for link in LINKS:
        rates = [r.rate_bps[link] for r in results]
        # h1 and h2 are 2 KiB each: 3.3 ms on the link, while the others wait their turn.
        assert all(rate == pytest.approx(RATE_BPS) for rate in rates), (link, rates)
        assert all(r.links[link]["transfer_ms"] == pytest.approx(3.3, 0.05) for r in results)
    waits = [r.links["device-edge"]["queue_ms"] for r in results]
    transfer_ms = statistics.median(r.links["device-edge"]["transfer_ms"] for r in results)
    assert waits == pytest.approx([i * transfer_ms for i in range(len(results))])
    assert max(waits) > 3 * transfer_ms  # they did queue behind the link ...
    for result in results:  # ... and that wait is in ms["queue"], not in the network time
        assert result.ms["queue"] >= result.links["device-edge"]["queue_ms"]
        parts = sum(result.ms[key] for key in ("device", "edge", "cloud", "queue", "network"))
        assert abs(parts - result.ms["total"]) < 1.0 or result.ms["network"] == 0.0
    # The old figure, bytes over waiting plus transfer, understates the link this much:
    slowest = max(results, key=lambda r: r.links["device-edge"]["queue_ms"])
    both_s = sum(slowest.links["device-edge"].values()) / 1e3
    assert slowest.bytes["device-edge"] * 8 / both_s < 0.5 * RATE_BPS


def test_a_report_line_keeps_the_link_figures(tmp_path: Path, rt: Any) -> None:
    split = rt.cnn(tmp_path / "plan", {"device-edge": "raw", "edge-cloud": "raw"})
    with rt.device(split.plan_dir) as device:
        result = device.infer(split.sample(seed=12)[0])
    again = Result.from_dict(result.to_dict())
    assert again.links == result.links and set(again.links) == set(LINKS)
    assert again.ms == result.ms and "queue" in again.ms
    assert result.bytes["device-edge"] > 0 and result.rate_bps["device-edge"] > 0
    assert result.bytes["edge-cloud"] > 0 and result.rate_bps["edge-cloud"] > 0


def test_requests_that_never_left_for_a_closed_tier_report_no_bytes(
    tmp_path: Path, rt: Any
) -> None:
    split = rt.cnn(tmp_path / "plan", {"device-edge": "raw", "edge-cloud": "raw"})
    with rt.in_process(split.plan_dir) as tiers, tiers.device(deadline_s=10.0) as device:
        tiers.cloud.close(0)
        failed = device.submit(split.sample(seed=13)[0]).result()
        # The edge got the features, but nothing went on to the cloud.
        assert failed.error is not None
        assert failed.bytes == {"device-edge": failed.bytes["device-edge"], "edge-cloud": 0}
        assert failed.bytes["device-edge"] > 0 and failed.rate_bps["edge-cloud"] == 0.0
        tiers.edge.close(0)
        lost = device.submit(split.sample(seed=14)[0]).result()
    assert isinstance(lost.error, TransportError)
    assert lost.bytes == {link: 0 for link in LINKS}
    assert lost.rate_bps == {link: 0.0 for link in LINKS}


@pytest.mark.integration
def test_requests_that_never_left_report_no_bytes(tmp_path: Path, rt: Any) -> None:
    """Over gRPC: a peer that was never reached got nothing ([Note: honest link figures])."""
    split = rt.cnn(tmp_path / "plan", {"device-edge": "raw", "edge-cloud": "raw"})
    # A port bound but not listening: connecting there is refused. A port merely found
    # free could be reached by TCP self-connect (a client whose own port is the target).
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        nowhere = f"127.0.0.1:{holder.getsockname()[1]}"
        edge = TierServer.from_plan(
            "edge",
            split.plan_dir,
            "127.0.0.1:0",
            forwarder=Forwarding(nowhere),
            options=RuntimeOptions(workers=2),
        )
        edge.start()
        try:
            with DeviceClient(split.plan_dir, edge.address, deadline_s=10.0) as device:
                failed = device.submit(split.sample(seed=13)[0]).result()
        finally:
            edge.stop(0.5)
        # The edge got the features, but nothing reached the cloud.
        assert failed.error is not None
        assert failed.bytes == {"device-edge": failed.bytes["device-edge"], "edge-cloud": 0}
        assert failed.bytes["device-edge"] > 0 and failed.rate_bps["edge-cloud"] == 0.0
        with DeviceClient(split.plan_dir, nowhere, deadline_s=10.0) as device:
            lost = device.submit(split.sample(seed=14)[0]).result()
        assert isinstance(lost.error, TransportError)
        assert lost.bytes == {link: 0 for link in LINKS}
        assert lost.rate_bps == {link: 0.0 for link in LINKS}
