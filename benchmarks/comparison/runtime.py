"""Strategies run through the real runtime: device client, edge and cloud servers, gRPC.

The composed measurements of ``comparison.measure`` leave out what only the real runtime
has: protobuf serialisation, gRPC, threads handing requests over, the link shaper's
sleeps. Here a strategy's plan is written as a real plan directory, a cloud and an
edge ``TierServer`` serve it on 127.0.0.1 (port 0) with the emulated links and
slowdowns, and a ``DeviceClient`` sends the requests one at a time (window 1: latency,
not throughput). The p50 of the device's wall time is compared with the composed p50
of the same plan on the same requests.
"""

from __future__ import annotations

import logging
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from tierflow.device.client import DeviceClient
from tierflow.edge.forwarding import Forwarding
from tierflow.link.spec import LINKS, LinkSpec
from tierflow.options import RuntimeOptions
from tierflow.plan import ExitSpec, Plan, SegmentSpec, save_plan
from tierflow.runtime.server import TierServer

logger = logging.getLogger(__name__)


def write_plan(
    graph: Any,
    cuts: tuple[int, int],
    codec: Mapping[str, str],
    links: Mapping[str, LinkSpec],
    plan_dir: Path,
) -> Plan:
    """A plan directory for cuts ``(a, b)`` and ``codec``, as ``tierflow plan`` writes one."""
    from tierflow.partitioner.split import save_split_plan, split_model

    return save_split_plan(
        graph,
        split_model(graph, cuts),
        plan_dir,
        cuts=cuts,
        codec=codec,
        links=links,
        estimate={"source": "benchmark"},
    )


@contextmanager
def serving(
    plan_dir: Path,
    links: Mapping[str, LinkSpec],
    slowdown: Mapping[str, float],
    cache: Any = None,
) -> Iterator[DeviceClient]:
    """The plan served by a cloud and an edge on 127.0.0.1 (``cache`` on the edge), and a
    device client sending one request at a time; everything stopped afterwards."""

    def options(tier: str) -> RuntimeOptions:
        return RuntimeOptions(slowdown=slowdown[tier], links=links, workers=1)

    cloud = TierServer.from_plan("cloud", plan_dir, "127.0.0.1:0", options=options("cloud"))
    edge: TierServer | None = None
    try:
        cloud.start()
        edge = TierServer.from_plan(
            "edge",
            plan_dir,
            "127.0.0.1:0",
            forwarder=Forwarding(cloud.address),
            cache=cache,
            options=options("edge"),
        )
        edge.start()
        with DeviceClient(plan_dir, edge.address, options=options("device"), window=1) as client:
            yield client
    finally:
        if edge is not None:
            edge.stop(0.5)
        cloud.stop(0.5)


def run_plan(
    plan_dir: Path,
    links: Mapping[str, LinkSpec],
    slowdown: Mapping[str, float],
    requests: Sequence[Mapping[str, np.ndarray]],
) -> dict[str, Any]:
    """Serve ``plan_dir`` on the three tiers and time ``requests`` one by one."""
    with serving(plan_dir, links, slowdown) as client:
        client.infer(requests[0])  # warm the stream and the sessions
        totals: list[float] = []
        answered: list[str] = []
        for inputs in requests:
            result = client.infer(inputs)
            totals.append(result.ms["total"])
            answered.append(result.answered_by or "")
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


# --------------------------------------------------------------------------- exits


def write_exit_plan(
    graph: Any,
    exited_path: Path,
    exits: Sequence[Any],
    cuts: tuple[int, int],
    codec: Mapping[str, str],
    links: Mapping[str, LinkSpec],
    plan_dir: Path,
) -> Plan:
    """A plan with early exits: the model cut at the plan's cuts and at each exit's cut.

    ``graph`` is the model without exits (its cuts place the pieces), ``exited_path`` the
    same model with the exit heads grafted by ``add_exits`` (``exits`` its ``ExitInfo``s).
    Each piece is extracted from the exited model with its crossing tensors as outputs,
    plus the exit's probabilities when the piece ends at an exit's feature: the tier then
    checks that exit before running its next piece ([Note: exits in a plan] in
    ``tierflow.partitioner.exits.plan``). Exits the calibration disabled are left out.
    """
    import hashlib
    import itertools

    import onnx
    import onnx.shape_inference
    import onnx.utils

    from tierflow.partitioner.exits.cost import exit_cut_indices

    last = len(graph.cuts) - 1
    a, b = cuts
    at_cut = exit_cut_indices(graph, exits)
    enabled = {at_cut[e.name]: e for e in exits if e.name in at_cut and e.threshold <= 1.0}
    enabled = {cut: e for cut, e in enabled.items() if 0 < cut < last}
    proto = onnx.shape_inference.infer_shapes(onnx.load(str(exited_path)))
    extractor = onnx.utils.Extractor(proto)
    bounds = sorted({0, a, b, last, *enabled})
    specs: list[SegmentSpec] = []
    plan_dir.mkdir(parents=True, exist_ok=True)
    for start, end in itertools.pairwise(bounds):
        if graph.cuts[start].position == graph.cuts[end].position:
            continue
        tier = "device" if start < a else ("edge" if start < b else "cloud")
        inputs = list(graph.cuts[start].tensors)
        outputs = list(graph.cuts[end].tensors)
        exit_specs: tuple[ExitSpec, ...] = ()
        if end in enabled:
            outputs.append(enabled[end].name)
            exit_specs = (enabled[end].to_spec(),)
        model = extractor.extract_model(inputs, outputs)
        model.ir_version = proto.ir_version
        name = f"{len(specs):02d}-{tier}.onnx"
        onnx.save_model(model, str(plan_dir / name))
        specs.append(SegmentSpec(tier, name, tuple(inputs), tuple(outputs), exit_specs))
    plan = Plan(
        model_file=exited_path.name,
        model_sha256=hashlib.sha256(exited_path.read_bytes()).hexdigest(),
        inputs=tuple(i.name for i in graph.inputs),
        outputs=tuple(o.name for o in graph.outputs),
        segments=tuple(specs),
        links=dict(links),
        codec={name: codec.get(name, "raw") for name in LINKS},
        estimate={"source": "benchmark", "exits": [e.name for e in enabled.values()]},
        cuts=tuple(graph.cuts[c].position for c in cuts),
    )
    save_plan(plan, plan_dir)
    return plan


def run_exit_plan(
    plan_dir: Path,
    links: Mapping[str, LinkSpec],
    slowdown: Mapping[str, float],
    requests: Sequence[Mapping[str, np.ndarray]],
    cache_bytes: int,
) -> dict[str, Any]:
    """Serve an exit plan with a feature cache on the edge; time ``requests`` one by one."""
    from tierflow.cache.memory import MemoryCache

    with serving(plan_dir, links, slowdown, cache=MemoryCache(cache_bytes)) as client:
        results = [client.infer(inputs) for inputs in requests]
    totals = [r.ms["total"] for r in results]
    return {
        "p50_ms": float(np.median(totals)),
        "p90_ms": float(np.percentile(totals, 90)),
        "mean_ms": float(np.mean(totals)),
        "answered_by": sorted({r.answered_by or "" for r in results}),
        "exit_rate": sum(r.exit is not None for r in results) / len(results),
        "cache_hit_rate": sum(r.cache_hit for r in results) / len(results),
        "requests": len(results),
    }


def runtime_exit_point(
    graph: Any,
    exited_path: Path,
    exits: Sequence[Any],
    cuts: tuple[int, int],
    codec: Mapping[str, str],
    links: Mapping[str, LinkSpec],
    slowdown: Mapping[str, float],
    requests: Sequence[Mapping[str, np.ndarray]],
    cache_bytes: int,
) -> dict[str, Any]:
    """Write an exit plan into a temporary folder, serve it with an edge cache, run it."""
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="tierflow-bench-exits-") as folder:
        write_exit_plan(graph, exited_path, exits, cuts, codec, links, Path(folder))
        figures = run_exit_plan(Path(folder), links, slowdown, requests, cache_bytes)
    figures["seconds"] = time.perf_counter() - started
    return figures
