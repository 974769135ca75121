"""The comparison benchmark: tierflow against device-only, cloud-only and single-split.

    python benchmarks/run.py            # full run (~20 min), writes benchmarks/RESULTS.md
    python benchmarks/run.py --quick    # small models, 3 bandwidths, a couple of minutes

For each model of the suite (``bench_models``) it profiles the model as the planner
would, asks every strategy (``strategies``) for its plan at each device-edge bandwidth,
measures a wide set of candidate plans on real requests (``bench_measure``: all cut
pairs of a cut sample that always holds every strategy's cuts), and reports each
strategy's measured latency, tierflow's regret against the best measured plan, the cost
model's prediction error, early exits and caches on the demo model (``bench_exits``),
the runtime itself over gRPC at a subset of points (``bench_runtime``) and the other
engineers' overhead benchmarks. Results: ``results.json`` (rows), ``RESULTS.md`` and
PNG plots in the output folder.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import platform
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import bench_emulation as emu  # noqa: E402
import bench_measure  # noqa: E402
import bench_models  # noqa: E402
import bench_report  # noqa: E402
import strategies  # noqa: E402

from tierflow.codec import PLANNER_CODECS  # noqa: E402
from tierflow.links import TIERS  # noqa: E402

logger = logging.getLogger("benchmarks.run")
# The benchmark's own modules, whose progress lines are shown (the tiers' are not).
BENCH_MODULES = ("bench_measure", "bench_exits", "bench_runtime", "bench_overheads", "bench_models")

Row = dict[str, Any]
SAMPLE_SEED = 7  # the profiling sample, never measured
EXIT_SEED = 1  # the tierflow-exits workload (plans are measured on seed 0)

METHOD = """## How it was measured

Each strategy is a plan (cuts `a ≤ b`: device runs cuts `[0,a)`, edge `[a,b)`, cloud
`[b,last)`, plus a codec per link). The planner's choices come from profiles measured on
this machine by `tierflow.partitioner.profile.profile_model` (1 thread) and scaled to each
tier's slowdown, exactly as `tierflow plan` does for emulated tiers.

Plans are then **measured independently of those profiles**: the actual segment files
(cut out by the partitioner's `extract_segment`, which `split_model` writes into plan
directories) run in ONNX Runtime sessions configured as the runtime's (`session_options`,
1 intra-op thread) on every request, and each request's real crossing tensors are encoded
and decoded with every codec. A plan's latency for one request is composed from that
request's measured stage times: device/edge/cloud compute × the tier's slowdown (what the
runtime's `SegmentRunner` sleeps to emulate a slower tier), encode × sender slowdown,
decode × receiver slowdown, and the link model the runtime's link shaper enforces:
encoded bytes × 8 / rate + RTT (RTT/2 up, RTT/2 for the answer) + the answer's bytes /
rate on each link used. The link is therefore not a sleep but the shaper's arithmetic on
measured bytes; the compute and codec times are real runs. p50/p90 are over the
requests. The same measurements serve every bandwidth, so strategies are compared on
the very same requests and stage runs.

**Regret**: all cut pairs of a cut sample are measured (every cut for small graphs; for
larger ones every strategy's cuts at every bandwidth, the planner's top-5 plans, and cuts
spread evenly over the graph), each with all 36 codec pairs, and the best measured p50
among them is the reference. Regret = tierflow's measured p50 / best measured p50 − 1. It
is a lower bound on the true regret where the sample is not exhaustive (the table above
gives measured pairs per model).

Requests: smooth synthetic 8-bit images for the CNNs (low-resolution noise upsampled,
plus sensor noise, ImageNet-normalised), random token ids and padding masks for the
transformer, held-out digits for the demo model. `cloud-only-compressed` sends the input
as `int8+zstd` (per-tensor 8-bit quantisation, which is near-lossless for 8-bit images,
then zstd); `single-split` is Neurosurgeon's best device|cloud cut by the same cost model
restricted to two tiers with raw fp32 features (the edge only forwards).
"""


def machine() -> dict[str, Any]:
    import onnxruntime

    from tierflow.partitioner.profile import machine_info

    info = machine_info(1, 1.0)
    return {
        "cpu": info.cpu,
        "cores": os.cpu_count() or 1,
        "python": platform.python_version(),
        "onnxruntime": onnxruntime.__version__,
        "hostname": info.hostname,
    }


def slowdowns() -> dict[str, float]:
    return {tier: emu.TIER_SPECS[tier].slowdown for tier in TIERS}


def select_cuts(last: int, required: set[int], max_cuts: int) -> list[int]:
    """Every cut when there are few; else the required ones plus an even spread."""
    if last + 1 <= max_cuts:
        return list(range(last + 1))
    chosen = set(required) | {0, last}
    spare = max(max_cuts - len(chosen), 4)
    for value in np.linspace(0, last, spare + 2)[1:-1]:
        chosen.add(round(float(value)))
    return sorted(chosen)


def compute_share(profile: Any, a: int, b: int) -> dict[str, float]:
    """Share of the model's (unslowed) compute that each tier runs in plan ``(a, b)``."""
    units = [u.compute_s for u in profile.units]
    total = sum(units) or 1.0
    return {
        "device": sum(units[:a]) / total,
        "edge": sum(units[a:b]) / total,
        "cloud": sum(units[b:]) / total,
    }


def bench_model(
    model: bench_models.BenchModel,
    bandwidths: Sequence[float],
    args: argparse.Namespace,
) -> tuple[list[Row], dict[str, Any], dict[str, Any]]:
    """Profile, plan, measure and compose one model.

    Returns its rows, a summary for the report, and what the exits pass reuses (graph,
    profile, choices).
    """
    from tierflow.partitioner.graph import load_model
    from tierflow.partitioner.profile import profile_model
    from tierflow.partitioner.search import search

    started = time.perf_counter()
    path = bench_models.export(model, args.work_dir)
    specs = [(i.name, i.dtype, tuple(i.shape)) for i in load_model(path).inputs]
    # Profile on a realistic request, as `tierflow profile --sample` would: codec ratios on
    # random inputs say little about real features. It is not one of the measured requests.
    sample = bench_models.requests(model, specs, 1, seed=SAMPLE_SEED)[0]
    graph = load_model(path, sample={name: value[None] for name, value in sample.items()})
    last = len(graph.cuts) - 1
    logger.info("[bench] %s: %d cuts, profiling", model.name, last + 1)
    base = profile_model(graph, threads=1, time_budget_s=args.profile_budget)
    profiles = {tier: base.emulate(emu.TIER_SPECS[tier].slowdown) for tier in TIERS}

    choices: dict[float, dict[str, strategies.Choice]] = {}
    required: set[int] = set()
    for mbit in bandwidths:
        problem = strategies.problem_at(profiles, emu.links_at(mbit))
        from tierflow.partitioner.cost import build_tables

        tables = build_tables(problem)
        choices[mbit] = strategies.choose(tables)
        for choice in choices[mbit].values():
            required.update(choice.cuts)
        for est in search(problem, top=5, tables=tables).ranked:
            required.update(est.cuts)
    cuts = select_cuts(last, required, args.max_cuts)
    pairs = [(a, b) for a in cuts for b in cuts if a <= b]
    requests = bench_models.requests(model, specs, args.requests)
    logger.info(
        "[bench] %s: measuring %d cuts, %d pairs, %d requests",
        model.name,
        len(cuts),
        len(pairs),
        len(requests),
    )
    measured = bench_measure.measure_model(
        model.name,
        graph,
        requests,
        cuts,
        pairs,
        PLANNER_CODECS,
        progress=lambda what: logger.debug("[bench] %s", what),
    )
    slow = slowdowns()
    rows: list[Row] = []
    plans_compared = 0
    for mbit in bandwidths:
        links = emu.links_at(mbit)
        best, plans_compared = bench_measure.best_plan(measured, links, slow, PLANNER_CODECS)
        point: dict[str, bench_measure.Composed] = {}
        for name, choice in choices[mbit].items():
            point[name] = bench_measure.compose(measured, *choice.cuts, choice.codec, links, slow)
        for name, choice in choices[mbit].items():
            composed = point[name]
            row: Row = {
                "model": model.name,
                "bandwidth_mbit": mbit,
                "strategy": name,
                "p50_ms": composed.p50_ms,
                "p90_ms": composed.p90_ms,
                "predicted_ms": choice.predicted_s * 1e3,
                "prediction_error": choice.predicted_s * 1e3 / composed.p50_ms - 1.0,
                "cuts": list(choice.cuts),
                "last_cut": last,
                "codec_used": composed.codec,
                "bytes": composed.bytes,
                "parts_ms": composed.parts_ms,
                "compute_share": compute_share(base, *choice.cuts),
                "device_edge_rtt_ms": links["device-edge"].rtt_s * 1e3,
                "gap_to_best": composed.p50_ms / best.p50_ms - 1.0,
                "measured": "composed",
                "requests": len(requests),
            }
            for other in ("device-only", "cloud-only", "cloud-only-compressed", "single-split"):
                key = "speedup_vs_" + other.replace("-", "_")
                row[key] = point[other].p50_ms / composed.p50_ms
            if name == "tierflow":
                row["regret"] = composed.p50_ms / best.p50_ms - 1.0
                row["best_measured"] = {
                    "cuts": list(best.cuts),
                    "codec": best.codec,
                    "p50_ms": best.p50_ms,
                }
                row["plans_compared"] = plans_compared
                baselines = ("device-only", "cloud-only", "cloud-only-compressed", "single-split")
                row["speedup_vs_best_baseline"] = (
                    min(point[b].p50_ms for b in baselines) / composed.p50_ms
                )
            rows.append(row)
    info = {
        **model.to_dict(),
        "path": str(path),
        "cuts": last + 1,
        "measured_cuts": len(cuts),
        "measured_pairs": len(pairs),
        "plans_compared": plans_compared,
        "measure_s": measured.seconds,
        "seconds": time.perf_counter() - started,
        "profile_correction": base.calibration.get("correction"),
    }
    logger.info(
        "[bench] %s done in %.1f s (measuring %.1f s)",
        model.name,
        info["seconds"],
        measured.seconds,
    )
    context = {"graph": graph, "base": base, "choices": choices, "measured": measured}
    return rows, info, context


def exits_rows(
    model: bench_models.BenchModel,
    context: dict[str, Any],
    rows: Sequence[Row],
    bandwidths: Sequence[float],
    args: argparse.Namespace,
) -> list[Row]:
    """tierflow-exits rows for one model: exits (demo model only) plus the edge cache."""
    import bench_exits

    graph = context["graph"]
    heads: list[bench_exits.Head] = []
    labels: np.ndarray | None = None
    if model.kind == "demo":
        _, exited, exits, _summary = bench_exits.exited_demo(args.work_dir)
        heads = bench_exits.exit_heads(exited, graph, exits)
        from tierflow.partitioner.digits import build_demo_model

        with np.load(build_demo_model().heldout_path) as data:
            labels = np.asarray(data["labels"])
    specs = [(i.name, i.dtype, tuple(i.shape)) for i in graph.inputs]
    unique = args.exit_requests if model.kind == "demo" else max(args.requests, 8)
    count = int(unique / (1 - bench_exits.REPEAT_SHARE))
    requests = bench_models.requests(model, specs, unique, seed=EXIT_SEED)
    order = bench_exits.workload(count, unique)
    slow = slowdowns()
    walkers: dict[Any, bench_exits.PlanWalker] = {}
    out: list[Row] = []
    for mbit in bandwidths:
        choice = context["choices"][mbit]["tierflow"]
        key = (choice.cuts, tuple(sorted(choice.codec.items())))
        if key not in walkers:
            walkers[key] = bench_exits.PlanWalker(graph, choice.cuts, choice.codec, heads, slow)
        point = bench_exits.measure_point(walkers[key], requests, order, emu.links_at(mbit))
        p50 = float(np.median(point.latency_s) * 1e3)
        plain_p50 = float(np.median(point.plain_s) * 1e3)
        answered = {t: point.answered_by.count(t) / len(order) for t in TIERS}
        row: Row = {
            "model": model.name,
            "bandwidth_mbit": mbit,
            "strategy": "tierflow-exits",
            "p50_ms": p50,
            "p90_ms": float(np.percentile(point.latency_s, 90) * 1e3),
            "mean_ms": float(np.mean(point.latency_s) * 1e3),
            "cuts": list(choice.cuts),
            "last_cut": len(graph.cuts) - 1,
            "codec_used": {
                k: v
                for k, v in choice.codec.items()
                if (k == "device-edge" and choice.cuts[0] < len(graph.cuts) - 1)
                or (k == "edge-cloud" and choice.cuts[1] < len(graph.cuts) - 1)
            },
            "compute_share": compute_share(context["base"], *choice.cuts),
            "device_edge_rtt_ms": emu.device_edge(mbit).rtt_s * 1e3,
            "exits_used": [h.name for h in heads],
            "exit_rate": sum(e is not None for e in point.exits) / len(order),
            "cache_hit_rate": sum(point.hits) / len(order),
            "repeat_share": bench_exits.REPEAT_SHARE,
            "answered_by": answered,
            "requests": len(order),
            "measured": "walked",
            "tierflow_same_requests_p50_ms": plain_p50,
            "tierflow_same_requests_mean_ms": float(np.mean(point.plain_s) * 1e3),
            "speedup_vs_tierflow_same_requests": plain_p50 / p50,
            "agreement_with_tierflow": float(np.mean(point.predicted == point.plain_predicted)),
        }
        if labels is not None:
            digits = bench_models.demo_indices(unique, EXIT_SEED, len(labels))
            truth = labels[[digits[i] for i in order]]
            row["accuracy"] = float(np.mean(point.predicted == truth))
            row["accuracy_without_exits"] = float(np.mean(point.plain_predicted == truth))
        for other in ("device-only", "cloud-only", "cloud-only-compressed", "single-split"):
            base_row = next(
                r
                for r in rows
                if r["model"] == model.name
                and r["bandwidth_mbit"] == mbit
                and r["strategy"] == other
            )
            row["speedup_vs_" + other.replace("-", "_")] = base_row["p50_ms"] / p50
        out.append(row)
    return out


RUNTIME_POINTS_QUICK: dict[str, tuple[float, ...]] = {"demo-digits": (20.0,)}
RUNTIME_POINTS_FULL: dict[str, tuple[float, ...]] = {
    "demo-digits": (1.0, 5.0, 20.0, 100.0, 1000.0),
    "resnet18": (20.0, 100.0),
    "transformer": (20.0,),
}


def runtime_pass(
    model: bench_models.BenchModel,
    context: dict[str, Any],
    rows: list[Row],
    args: argparse.Namespace,
) -> None:
    """Run the planned strategies through the real runtime at this model's subset of points.

    Adds ``runtime_p50_ms`` (and p90, requests) to the composed rows it ran.
    """
    import bench_runtime

    points = (RUNTIME_POINTS_QUICK if args.quick else RUNTIME_POINTS_FULL).get(model.name, ())
    graph = context["graph"]
    specs = [(i.name, i.dtype, tuple(i.shape)) for i in graph.inputs]
    requests = bench_models.requests(model, specs, args.runtime_requests)
    for mbit in points:
        if mbit not in context["choices"]:
            continue
        for name, choice in context["choices"][mbit].items():
            row = next(
                r
                for r in rows
                if r["model"] == model.name
                and r["bandwidth_mbit"] == mbit
                and r["strategy"] == name
            )
            try:
                figures = bench_runtime.runtime_point(
                    graph, choice.cuts, choice.codec, emu.links_at(mbit), slowdowns(), requests
                )
            except Exception as exc:  # one failing point must not sink the whole run
                logger.exception(
                    "[bench] runtime run of %s %s at %g Mbit/s failed", model.name, name, mbit
                )
                row["runtime_error"] = f"{type(exc).__name__}: {exc}"
                continue
            row["runtime_p50_ms"] = figures["p50_ms"]
            row["runtime_p90_ms"] = figures["p90_ms"]
            row["runtime_requests"] = figures["requests"]
            row["runtime_answered_by"] = figures["answered_by"]
            row["runtime_load"] = os.getloadavg()[0]
            logger.info(
                "[bench] runtime %s %s %g Mbit/s: p50 %.1f ms (composed %.1f ms)",
                model.name,
                name,
                mbit,
                figures["p50_ms"],
                row["p50_ms"],
            )


def runtime_section(rows: Sequence[Row]) -> list[str]:
    ran = [r for r in rows if "runtime_p50_ms" in r or "runtime_error" in r]
    out = ["## The same plans through the real runtime\n"]
    if not ran:
        out.append("Not run (`--no-extras`).\n")
        return out
    out.append(
        "Each plan written as a plan directory and served by a `CloudServer` and an "
        "`EdgeServer` on 127.0.0.1 with the emulated links (the runtime's link shaper) and "
        "slowdowns (the runtime's sleeps), a `DeviceClient` sending requests one at a time; "
        "p50 of the device's wall time. The runtime adds gRPC, protobuf and thread hand-offs "
        "that the composed figures leave out; on this shared machine its wall-clock compute "
        "(and the sleeps scaled from it) also suffers from other jobs (1-minute load "
        "average given), which the composed CPU-time figures do not.\n"
    )
    out.append(
        "| model | Mbit/s | strategy | cuts | composed p50 ms | runtime p50 ms | "
        "runtime / composed | answered by | load |"
    )
    out.append("|---|---|---|---|---|---|---|---|---|")
    for r in ran:
        if "runtime_error" in r:
            out.append(
                f"| {r['model']} | {r['bandwidth_mbit']:g} | {r['strategy']} | "
                f"{r['cuts'][0]},{r['cuts'][1]} | {r['p50_ms']:.1f} | failed: "
                f"{r['runtime_error'][:80]} | | | |"
            )
            continue
        out.append(
            f"| {r['model']} | {r['bandwidth_mbit']:g} | {r['strategy']} | "
            f"{r['cuts'][0]},{r['cuts'][1]} | {r['p50_ms']:.1f} | {r['runtime_p50_ms']:.1f} | "
            f"{r['runtime_p50_ms'] / r['p50_ms']:.2f}× | {', '.join(r['runtime_answered_by'])} | "
            f"{r['runtime_load']:.1f} |"
        )
    out.append("")
    return out


def exits_section(rows: Sequence[Row]) -> list[str]:
    mine = [r for r in rows if r["strategy"] == "tierflow-exits"]
    out = ["## tierflow-exits: early exits and the edge's feature cache\n"]
    if not mine:
        out.append("Not run (`--no-extras`).\n")
        return out
    out.append(
        "tierflow's plan walked request by request as the runtime would run it "
        "(`bench_exits`): pieces cut at the plan's cuts and at every exit, each exit head "
        "checked on the tier that computes its feature, the plan's codec applied for real on "
        "each link, and the runtime's exact `MemoryCache` on the first tier after the device. "
        f"Workload: {int(mine[0]['repeat_share'] * 100)}% of requests repeat an earlier one "
        "exactly (a camera on a still scene). Exits are calibrated by "
        "`tierflow.partitioner.exits.add_exits` (≤1% disagreement with the full model) and "
        "exist **only on the demo model**: the zoo models have random weights, so exit heads "
        "on them would only mimic arbitrary predictions; there the row is tierflow plus the "
        "cache alone. 'tierflow, same requests' is the same walk with exits and cache off.\n"
    )
    out.append(
        "| model | Mbit/s | cuts | p50 ms | mean ms | tierflow same requests p50 / mean "
        "| ×tierflow (p50) | exit rate | cache hits | answered by (dev/edge/cloud) "
        "| accuracy (no exits) |"
    )
    out.append("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in mine:
        ans = r["answered_by"]
        acc = f"{r['accuracy']:.1%} ({r['accuracy_without_exits']:.1%})" if "accuracy" in r else "–"
        out.append(
            f"| {r['model']} | {r['bandwidth_mbit']:g} | {r['cuts'][0]},{r['cuts'][1]} | "
            f"{r['p50_ms']:.1f} | {r['mean_ms']:.1f} | {r['tierflow_same_requests_p50_ms']:.1f}"
            f" / {r['tierflow_same_requests_mean_ms']:.1f} | "
            f"{r['speedup_vs_tierflow_same_requests']:.2f}× | {r['exit_rate']:.0%} | "
            f"{r['cache_hit_rate']:.0%} | {ans['device']:.0%}/{ans['edge']:.0%}/"
            f"{ans['cloud']:.0%} | {acc} |"
        )
    out.append("")
    return out


def prediction_section(rows: Sequence[Row]) -> list[str]:
    out = [
        "### Cost model prediction error (per plan, this benchmark)\n",
        "Predicted latency of each strategy's plan (cost model on the profiles) against its "
        "measured p50: median and worst |error| over bandwidths and strategies.\n",
        "| model | median abs error | worst error | plans |",
        "|---|---|---|---|",
    ]
    for model in dict.fromkeys(r["model"] for r in rows):
        errors = [
            r["prediction_error"]
            for r in rows
            if r["model"] == model and r.get("prediction_error") is not None
        ]
        if not errors:
            continue
        worst = max(errors, key=abs)
        out.append(
            f"| {model} | {float(np.median(np.abs(errors))):.1%} | {worst:+.1%} | {len(errors)} |"
        )
    out.append("")
    return out


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="small models, 3 bandwidths, few requests (for the test)",
    )
    parser.add_argument("--out", type=Path, default=HERE, help="where results and plots go")
    parser.add_argument(
        "--work-dir",
        type=Path,
        default=bench_models.default_work_dir(),
        help="cache of exported models",
    )
    parser.add_argument("--models", nargs="*", default=None, help="only these models")
    parser.add_argument(
        "--bandwidths",
        nargs="*",
        type=float,
        default=None,
        help="device-edge rates in Mbit/s (from: "
        + ", ".join(f"{b:g}" for b in emu.FULL_BANDWIDTHS)
        + ")",
    )
    parser.add_argument(
        "--requests",
        type=int,
        default=None,
        help="requests per measured plan (default 5 quick, 15 full)",
    )
    parser.add_argument(
        "--max-cuts",
        type=int,
        default=None,
        help="cuts sampled per model (default 9 quick, 16 full)",
    )
    parser.add_argument(
        "--profile-budget",
        type=float,
        default=None,
        help="seconds of adaptive repeats while profiling a model",
    )
    parser.add_argument(
        "--exit-requests",
        type=int,
        default=None,
        help="distinct demo requests for tierflow-exits (default 40 quick, 300 full)",
    )
    parser.add_argument(
        "--runtime-requests",
        type=int,
        default=None,
        help="requests per point through the real runtime (default 5 / 10)",
    )
    parser.add_argument(
        "--no-extras", action="store_true", help="skip exits, runtime and overhead sections"
    )
    parser.add_argument("-v", "--verbose", action="count", default=0)
    args = parser.parse_args(argv)
    args.requests = args.requests or (5 if args.quick else 15)
    args.runtime_requests = args.runtime_requests or (5 if args.quick else 10)
    args.exit_requests = args.exit_requests or (40 if args.quick else 300)
    args.max_cuts = args.max_cuts or (9 if args.quick else 16)
    args.profile_budget = args.profile_budget or (2.0 if args.quick else 10.0)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING if args.verbose == 0 else logging.DEBUG,
        format="%(asctime)s %(message)s",
        datefmt="%H:%M:%S",
    )
    if args.verbose == 0:
        for name in (logger.name, *BENCH_MODULES):
            logging.getLogger(name).setLevel(logging.INFO)
    started = time.perf_counter()
    load_start = os.getloadavg()
    bandwidths = tuple(
        args.bandwidths or (emu.QUICK_BANDWIDTHS if args.quick else emu.FULL_BANDWIDTHS)
    )
    unknown = [b for b in bandwidths if b not in emu.DEVICE_EDGE_RTT_MS]
    if unknown:
        print(f"run.py: error: no RTT known for bandwidths {unknown}", file=sys.stderr)
        return 2
    models = bench_models.suite(args.quick)
    if args.models:
        models = [m for m in models if m.name in args.models]
    args.out.mkdir(parents=True, exist_ok=True)
    rows: list[Row] = []
    infos: list[dict[str, Any]] = []
    measured: list[Any] = []
    for model in models:
        model_rows, info, context = bench_model(model, bandwidths, args)
        rows.extend(model_rows)
        if not args.no_extras:
            started_exits = time.perf_counter()
            rows.extend(exits_rows(model, context, model_rows, bandwidths, args))
            info["exits_s"] = time.perf_counter() - started_exits
            started_runtime = time.perf_counter()
            runtime_pass(model, context, model_rows, args)
            info["runtime_s"] = time.perf_counter() - started_runtime
        measured.append(context["measured"])
        infos.append(info)
    sections: list[str] = []
    sections += exits_section(rows)
    sections += runtime_section(rows)
    sections += ["## Overheads and limits\n"]
    sections += prediction_section(rows)
    extras: dict[str, Any] = {}
    if not args.no_extras:
        import bench_overheads

        for name, part in (
            ("transport", lambda: bench_overheads.transport(args.quick)),
            ("codecs", lambda: bench_overheads.codecs(measured, args.quick)),
            ("planning", bench_overheads.planning),
        ):
            lines, figures = part()
            sections += lines
            extras[name] = figures
    else:
        sections += ["Transport, codec and planning figures not measured (`--no-extras`).\n"]
    command = "python benchmarks/run.py" + (" --quick" if args.quick else "")
    meta = {
        "command": command,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "wall_s": time.perf_counter() - started,
        "quick": args.quick,
        "requests": args.requests,
        "machine": machine(),
        "emulation": emu.describe(),
        "models": infos,
        "method": METHOD,
    }
    meta["load_average"] = {"start": load_start[0], "end": os.getloadavg()[0]}
    bench_report.write_json(rows, args.out / "results.json")
    bench_report.write_meta(meta, extras, args.out / "results_meta.json")
    bench_report.plot_latency(rows, args.out / "latency_vs_bandwidth.png")
    bench_report.plot_cuts(rows, args.out / "cuts.png")
    bench_report.plot_speedup(rows, args.out / "speedup.png")
    (args.out / "RESULTS.md").write_text(bench_report.markdown(rows, meta, sections))
    print(
        f"wrote {args.out / 'RESULTS.md'} and results.json ({len(rows)} rows) "
        f"in {time.perf_counter() - started:.0f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
