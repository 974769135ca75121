"""Three cloud replicas behind one edge, balanced round robin, sharing one Redis cache.

The edge's ``--upstream`` is a gRPC target list (``ipv4:H:P1,H:P2,H:P3``); see
[Note: replicas] in ``tierflow.transport.stream_client``: a stream on each replica's own
channel, requests in turn, so each replica serves every third request whatever the
machine's load. One replica is killed (SIGKILL) while a device stream runs: every request
gets exactly one answer (its outputs bit-exact, or a typed error), later requests all
succeed on the two left, and each replica's metrics show it served its share. A request
answered before by the dead replica is then a cache hit on another one: the cache is
shared.
"""

from __future__ import annotations

import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tierflow.device.client import DeviceClient, Result
from tierflow.edge.forwarding import Forwarding
from tierflow.errors import RemoteError, TransportError, UsageError
from tierflow.options import RuntimeOptions
from tierflow.runtime.server import TierServer
from tierflow.transport.security import Security

pytestmark = pytest.mark.integration


def _scrape_needs() -> Any:
    pytest.importorskip("redis")
    return pytest.importorskip("prometheus_client.parser")


def _metrics_address(server: Any) -> str:
    line = server.read_line(30)
    assert " metrics on http://" in line, line
    return line.rsplit(" on ", 1)[1].strip()


def _served(url: str) -> float:
    """Requests this replica answered, as its Prometheus endpoint counts them."""
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return sum(
        sample.value
        for family in _scrape_needs().text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "tierflow_requests_total" and sample.labels.get("tier") == "cloud"
    )


def _check(split: Any, feeds: dict[str, np.ndarray], result: Result) -> None:
    assert result.error is None, result.error
    np.testing.assert_array_equal(result.outputs["y"], split.reference(feeds)["y"])


@pytest.mark.slow
@pytest.mark.redis
def test_replicas_share_the_load_and_survive_one_killed(
    tmp_path: Path, rt: Any, redis_servers: Any
) -> None:
    _scrape_needs()
    split = rt.cnn(tmp_path / "plan", {"device-edge": "raw", "edge-cloud": "raw"})
    _, redis_url = redis_servers()
    cache = f"{redis_url}?budget=4MiB&namespace=replicas"
    before, during, after = (split.sample(seed=seed, count=24) for seed in (21, 22, 23))
    with rt.processes() as serve:
        clouds = [
            serve("cloud", split.plan_dir, "--cache", cache, "--metrics-port", "0")
            for _ in range(3)
        ]
        metrics = [_metrics_address(cloud) for cloud in clouds]
        targets = ",".join(cloud.address for cloud in clouds)
        edge = serve("edge", split.plan_dir, "--upstream", f"ipv4:{targets}", "--workers", "2")
        with DeviceClient(split.plan_dir, edge.address, deadline_s=20.0, window=6) as device:
            first = list(device.run_stream(before))
            shares = [_served(url) for url in metrics]

            tickets = [device.submit(feeds) for feeds in during[:12]]
            clouds[0].kill()
            tickets += [device.submit(feeds) for feeds in during[12:]]
            second = [ticket.result() for ticket in tickets]

            time.sleep(0.5)  # the edge's channel notices the dead replica
            third = list(device.run_stream(after))
            again = device.submit(before[0]).result()
            later = [_served(url) for url in metrics[1:]]

    for feeds, result in zip(before, first, strict=True):
        _check(split, feeds, result)
    # Three streams, one on each replica's channel, in turn: each took a third.
    assert shares == [8, 8, 8], shares

    # Killed mid-stream: one answer per request, bit-exact or a typed error naming why.
    assert len(second) == len(during)
    for feeds, result in zip(during, second, strict=True):
        if result.error is None:
            _check(split, feeds, result)
        else:
            assert isinstance(result.error, (RemoteError, TransportError)), result.error
    assert sum(result.error is None for result in second) >= len(during) // 2

    # Afterwards: every request succeeds, on both replicas left.
    for feeds, result in zip(after, third, strict=True):
        _check(split, feeds, result)
    # Replica 2's stream took every third request all along; the dead one's stream moved
    # to the next replica alive, replica 1 (and the repeat below went to one of them).
    gained = [now - then for now, then in zip(later, shares[1:], strict=True)]
    assert gained[0] >= 16 and gained[1] >= 8 and sum(gained) <= 2 * len(during) + 1, gained

    # The cache is shared: an answer stored by any replica serves the same input again.
    _check(split, before[0], again)
    assert again.cache_hit


def test_replicas_over_mutual_tls_are_checked_against_one_name(
    tmp_path: Path, rt: Any, tls_files: dict[str, Path]
) -> None:
    """An address list names no host: the replicas' certificates carry --tls-server-name."""
    split = rt.cnn(tmp_path / "plan")
    samples = split.sample(seed=24, count=4)
    server = Security(
        tls_cert=str(tls_files["server_cert"]),
        tls_key=str(tls_files["server_key"]),
        tls_ca=str(tls_files["ca"]),
    )
    device = RuntimeOptions(
        security=Security(
            tls_cert=str(tls_files["client_cert"]),
            tls_key=str(tls_files["client_key"]),
            tls_ca=str(tls_files["ca"]),
        )
    )
    clouds = [
        TierServer.from_plan(
            "cloud",
            split.plan_dir,
            "127.0.0.1:0",
            options=RuntimeOptions(workers=1, security=server),
        )
        for _ in range(2)
    ]
    for cloud in clouds:
        cloud.start()
    targets = "ipv4:" + ",".join(cloud.address for cloud in clouds)
    try:
        unnamed = TierServer.from_plan(
            "edge",
            split.plan_dir,
            "127.0.0.1:0",
            forwarder=Forwarding(targets),
            options=RuntimeOptions(security=server),
        )
        with pytest.raises(UsageError, match="--tls-server-name"):
            unnamed.start()
        named = Security(**{**server.to_dict(), "server_name": "localhost"})
        edge = TierServer.from_plan(
            "edge",
            split.plan_dir,
            "127.0.0.1:0",
            forwarder=Forwarding(targets),
            options=RuntimeOptions(security=named),
        )
        edge.start()
        try:
            with DeviceClient(split.plan_dir, edge.address, options=device) as client:
                results = list(client.run_stream(samples))
        finally:
            edge.stop(0.5)
    finally:
        for cloud in clouds:
            cloud.stop(0.5)
    for feeds, result in zip(samples, results, strict=True):
        _check(split, feeds, result)
