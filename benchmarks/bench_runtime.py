"""Strategies run through the real runtime: device client, edge and cloud servers, gRPC.

The composed measurements of ``bench_measure`` leave out what only the real runtime
has: protobuf serialisation, gRPC, threads handing requests over, the link shaper's
sleeps. Here a strategy's plan is written as a real plan directory, a ``CloudServer``
and an ``EdgeServer`` serve it on 127.0.0.1 (port 0) with the emulated links and
slowdowns, and a ``DeviceClient`` sends the requests one at a time (window 1: latency,
not throughput). The p50 of the device's wall time is compared with the composed p50
of the same plan on the same requests.
"""

from __future__ import annotations

import logging
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tierflow.cloud.server import CloudServer
from tierflow.device.client import DeviceClient
from tierflow.edge.server import EdgeServer
from tierflow.links import LINKS, LinkSpec
from tierflow.plan import Plan, save_plan

logger = logging.getLogger(__name__)


def write_plan(
    graph: Any,
    cuts: tuple[int, int],
    codec: Mapping[str, str],
    links: Mapping[str, LinkSpec],
    plan_dir: Path,
) -> Plan:
    """A plan directory for cuts ``(a, b)`` and ``codec``, as ``tierflow plan`` writes one."""
    from tierflow.partitioner.split import split_model, write_segments

    segments = split_model(graph, cuts)
    write_segments(segments, plan_dir)
    plan = Plan(
        model_file=Path(graph.path).name,
        model_sha256=graph.sha256,
        inputs=tuple(i.name for i in graph.inputs),
        outputs=tuple(o.name for o in graph.outputs),
        segments=tuple(spec for spec, _ in segments),
        links=dict(links),
        codec={name: codec.get(name, "raw") for name in LINKS},
        estimate={"source": "benchmark"},
        cuts=tuple(graph.cuts[c].position for c in cuts),
    )
    save_plan(plan, plan_dir)
    return plan


def run_plan(
    plan_dir: Path,
    links: Mapping[str, LinkSpec],
    slowdown: Mapping[str, float],
    requests: Sequence[Mapping[str, np.ndarray]],
) -> dict[str, Any]:
    """Serve ``plan_dir`` on the three tiers and time ``requests`` one by one."""
    cloud = CloudServer(plan_dir, "127.0.0.1:0", slowdown=slowdown["cloud"], links=links, workers=1)
    edge: EdgeServer | None = None
    try:
        cloud.start()
        edge = EdgeServer(
            plan_dir,
            "127.0.0.1:0",
            upstream=cloud.address,
            slowdown=slowdown["edge"],
            links=links,
            workers=1,
        )
        edge.start()
        with DeviceClient(
            plan_dir, edge.address, slowdown=slowdown["device"], links=links, window=1
        ) as client:
            client.infer(requests[0])  # warm the stream and the sessions
            totals: list[float] = []
            answered: list[str] = []
            for inputs in requests:
                result = client.infer(inputs)
                totals.append(result.ms["total"])
                answered.append(result.answered_by or "")
    finally:
        if edge is not None:
            edge.stop(0.5)
        cloud.stop(0.5)
    return {
        "p50_ms": float(np.median(totals)),
        "p90_ms": float(np.percentile(totals, 90)),
        "answered_by": sorted(set(answered)),
        "requests": len(totals),
    }


def runtime_point(
    graph: Any,
    cuts: tuple[int, int],
    codec: Mapping[str, str],
    links: Mapping[str, LinkSpec],
    slowdown: Mapping[str, float],
    requests: Sequence[Mapping[str, np.ndarray]],
) -> dict[str, Any]:
    """Write the plan into a temporary folder, run it, clean up; figures and wall time."""
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="tierflow-bench-") as folder:
        write_plan(graph, cuts, codec, links, Path(folder))
        figures = run_plan(Path(folder), links, slowdown, requests)
    figures["seconds"] = time.perf_counter() - started
    return figures
