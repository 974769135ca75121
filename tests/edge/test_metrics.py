"""``--metrics-port``: an edge's and a cloud's metrics parsed as Prometheus would.

Requests go through both; an early exit on the edge answers some. The metrics' text is
parsed with prometheus_client's own parser and the counts must match the requests sent:
with the tiers in process ([Note: the next tier in process] in
tierflow/runtime/upstream.py), and end to end with an edge and a cloud process scraped over
HTTP, the edge taking its options from a ``--config`` file (the metrics port among
them), the cloud from flags.
"""

from __future__ import annotations

import urllib.request
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from tierflow.device.client import DeviceClient
from tierflow.plan import load_plan
from tierflow.rpc import tier_pb2
from tierflow.runtime.metrics import TierMetrics
from tierflow.runtime.server import watch_metrics
from tierflow.transport.wire import grpc_options

prometheus = pytest.importorskip("prometheus_client.parser")
exposition = pytest.importorskip("prometheus_client.exposition")


def _metrics_address(server: Any) -> str:
    """The second stdout line of ``tierflow serve``: where its metrics are.

    ``read_line`` keeps what the pipe held beyond the first line, so a line printed right
    after it is not lost in a buffer; it waits at most 30 s.
    """
    line = server.read_line(30)
    assert " metrics on http://" in line, line
    return line.rsplit(" on ", 1)[1].strip()


def _scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(url, timeout=10) as response:
        return _parse(response.read().decode())


def _parse(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    samples = {}
    for family in prometheus.text_string_to_metric_families(text):
        for sample in family.samples:
            samples[sample.name, tuple(sorted(sample.labels.items()))] = sample.value
    return samples


def _total(samples: dict[Any, float], name: str, **labels: str) -> float:
    return sum(
        value
        for (sample, key), value in samples.items()
        if sample == name and all((k, v) in key for k, v in labels.items())
    )


def _read(metrics: TierMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """What a scrape of ``metrics`` would read."""
    return _parse(exposition.generate_latest(metrics.registry).decode())


def _check_counts(
    edge_seen: dict[Any, float], cloud_seen: dict[Any, float], results: list[Any], plan_dir: Path
) -> None:
    """What the edge's and the cloud's metrics must count after ``results`` (12 requests
    of the CNN split at threshold 0.2), in process or scraped from served tiers."""
    assert all(r.error is None for r in results), [r.error for r in results]
    exits = sum(1 for r in results if r.exit)
    forwarded = len(results) - exits
    assert 0 < exits < len(results), "threshold 0.2 lets 5 of these 12 requests exit"

    # Requests by outcome: the edge answered every request, the cloud those not exited.
    assert _total(edge_seen, "tierflow_requests_total", tier="edge") == len(results)
    assert _total(edge_seen, "tierflow_requests_total", outcome="exit") == exits
    assert _total(edge_seen, "tierflow_exits_total", exit="exit_edge") == exits
    assert _total(edge_seen, "tierflow_requests_total", outcome="ok", answered_by="cloud") == (
        forwarded
    )
    assert _total(cloud_seen, "tierflow_requests_total", tier="cloud", outcome="ok") == forwarded
    assert _total(edge_seen, "tierflow_cache_hits_total") == 0

    # Latency histograms: this tier's per request, and each tier's own parts.
    assert _total(edge_seen, "tierflow_request_seconds_count", tier="edge") == len(results)
    assert _total(edge_seen, "tierflow_request_seconds_sum", tier="edge") > 0
    edge_compute = _total(edge_seen, "tierflow_tier_seconds_count", tier="edge", part="compute")
    assert edge_compute == len(results)
    cloud_compute = _total(edge_seen, "tierflow_tier_seconds_count", tier="cloud", part="compute")
    assert cloud_compute == forwarded  # the cloud's timings, as the replies carried them
    assert _total(cloud_seen, "tierflow_request_seconds_count", tier="cloud") == forwarded

    # Bytes per link; the queue is empty once every request is answered.
    assert (
        _total(edge_seen, "tierflow_link_bytes_total", link="edge-cloud", direction="request") > 0
    )
    assert _total(edge_seen, "tierflow_link_bytes_total", link="device-edge", direction="reply") > 0
    assert _total(cloud_seen, "tierflow_link_bytes_total", link="edge-cloud", direction="reply") > 0
    assert _total(edge_seen, "tierflow_in_flight", tier="edge") == 0
    assert _total(cloud_seen, "tierflow_in_flight", tier="cloud") == 0
    assert np.isfinite(list(edge_seen.values())).all()
    # The segment files each tier holds (all of the plan's: the directory came whole).
    segments = load_plan(plan_dir).segments
    files = sum((plan_dir / s.file).stat().st_size for s in segments)
    assert _total(edge_seen, "tierflow_segment_bytes", tier="edge") == files
    assert _total(cloud_seen, "tierflow_segment_fetches", tier="cloud") == 0


def test_edge_and_cloud_count_requests_exits_times_and_bytes(tmp_path: Path, rt: Any) -> None:
    split = rt.cnn(tmp_path / "plan", {"device-edge": "zstd", "edge-cloud": "zstd"}, 0.2)
    samples = split.sample(seed=5, count=12)
    with rt.in_process(split.plan_dir) as tiers:
        edge_metrics, cloud_metrics = watch_metrics(tiers.edge), watch_metrics(tiers.cloud)
        with tiers.device(window=4) as device:
            results = list(device.run_stream(samples))
        edge_seen, cloud_seen = _read(edge_metrics), _read(cloud_metrics)

    _check_counts(edge_seen, cloud_seen, results, split.plan_dir)


@pytest.mark.integration
def test_edge_and_cloud_metrics(tmp_path: Path, rt: Any) -> None:
    split = rt.cnn(tmp_path / "plan", {"device-edge": "zstd", "edge-cloud": "zstd"}, 0.2)
    config = tmp_path / "edge.toml"
    with rt.processes() as serve:
        cloud = serve("cloud", split.plan_dir, "--metrics-port", "0")
        cloud_metrics = _metrics_address(cloud)
        config.write_text(f'upstream = "{cloud.address}"\nmetrics-port = 0\nworkers = 2\n')
        edge = serve("edge", split.plan_dir, "--config", str(config))
        edge_metrics = _metrics_address(edge)
        samples = split.sample(seed=5, count=12)
        with DeviceClient(split.plan_dir, edge.address, window=4) as device:
            results = list(device.run_stream(samples))
        with grpc.insecure_channel(cloud.address, options=grpc_options()) as channel:
            raw = channel.stream_stream(
                "/tierflow.rpc.Tier/Infer",
                request_serializer=None,
                response_deserializer=tier_pb2.Reply.FromString,
            )  # three messages that do not parse: counted, one line logged
            assert len(list(raw(iter([b"\xff\xff\xff"] * 3), timeout=10))) == 3
        edge_seen = _scrape(edge_metrics)
        cloud_seen = _scrape(cloud_metrics)

    _check_counts(edge_seen, cloud_seen, results, split.plan_dir)
    assert _total(edge_seen, "tierflow_link_rate_bps", link="edge-cloud") > 0
    undecodable = {"tier": "cloud", "kind": "undecodable"}
    assert _total(cloud_seen, "tierflow_peer_warnings_total", **undecodable) == 3
    assert _total(edge_seen, "tierflow_peer_warnings_total") == 0


@pytest.mark.integration
def test_metrics_port_without_the_extra_is_one_line(tmp_path: Path, rt: Any) -> None:
    """A runtime-only install: the option names the extra instead of a traceback."""
    import subprocess
    import sys

    split = rt.cnn(tmp_path / "plan")
    blocker = (
        "import sys\n"
        "from importlib.abc import MetaPathFinder\n"
        "class B(MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.startswith('prometheus_client'):\n"
        "            raise ModuleNotFoundError(name, name=name)\n"
        "sys.meta_path.insert(0, B())\n"
        "from tierflow.cli.main import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            blocker,
            "serve",
            "cloud",
            "--plan",
            str(split.plan_dir),
            "--metrics-port",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert done.stderr.strip() == (
        "tierflow serve cloud: error: --metrics-port needs prometheus_client, which is not "
        "installed: pip install 'tierflow[metrics]'"
    )
