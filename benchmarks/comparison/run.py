"""The comparison benchmark: tierflow against device-only, cloud-only and single-split.

    python -m benchmarks.comparison            # full run (~20 min): benchmarks/results/RESULTS.md
    python -m benchmarks.comparison --quick    # small models, 3 bandwidths, a couple of minutes
    python -m benchmarks.comparison --refold   # fold bottleneck.py's rows in again, no measuring
    python -m benchmarks.comparison --models digits-camera --no-overheads --out /tmp/dc
    python -m benchmarks.comparison --refold --fold-from /tmp/dc   # that model's rows from /tmp/dc

For each model of the suite (``lib.models``) it profiles the model as the planner
would, asks every strategy (``strategies``) for its plan at each device-edge bandwidth,
measures a wide set of candidate plans on real requests (``comparison.measure``: all cut
pairs of a cut sample that always holds every strategy's cuts), and reports each
strategy's measured latency and fidelity (``comparison.fidelity``: the share of requests whose
top-1 answer is the exact model's, each plan run with its codecs applied), the image
baselines (``cloud-only-jpeg``, ``cloud-only-png``) for image-input models, the
``tierflow-bottleneck`` rows of ``bottleneck.py``'s committed run, the verdict
"tierflow never slower than any baseline of equal or better fidelity", tierflow's regret
against the best measured exact plan, the cost
model's prediction error, early exits and caches on the demo model (``comparison.exit_strategy``),
the runtime itself over gRPC at a subset of points (``comparison.runtime``) and the other
engineers' overhead benchmarks (``comparison.overheads``). Results: ``results.json`` (one
row per model × bandwidth × strategy), ``results_meta.json`` (machine, emulation, models,
overhead figures), ``RESULTS.md`` (``comparison.report`` tables, ``comparison.sections`` text) and
PNG plots in the output folder.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import logging
import os
import platform
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.comparison import fidelity as bench_fidelity
from benchmarks.comparison import fronts as bench_fronts
from benchmarks.comparison import measure as bench_measure
from benchmarks.comparison import report as bench_report
from benchmarks.comparison import sections as bench_sections
from benchmarks.comparison import strategies
from benchmarks.lib import RESULTS, models
from benchmarks.lib import emulation as emu
from benchmarks.lib.report import load_average, load_span
from tierflow.codec.base import EXACT_PLANNER_CODECS
from tierflow.link.spec import TIERS

logger = logging.getLogger(__name__)
# The benchmark's own modules, whose progress lines are shown (the tiers' are not).
Row = dict[str, Any]
SAMPLE_SEED = 7  # the profiling sample, never measured
EXIT_SEED = 1  # the tierflow-exits workload (plans are measured on seed 0)
PLANNER_SEED = 11  # tierflow-budget's planner sample (random networks; trained: training split)
#: Held-out requests each trained model's row fidelity is measured on in a full run: a
#: share near 0.97 to about +-2% (95% bound), and enough to tell 95% from 99% apart.
TRAINED_FIDELITY_REQUESTS = 300
# Where the strategies also run through the real runtime (model -> bandwidths).
RUNTIME_POINTS_QUICK: dict[str, tuple[float, ...]] = {"demo-digits": (20.0,)}
RUNTIME_POINTS_FULL: dict[str, tuple[float, ...]] = {
    "demo-digits": (1.0, 5.0, 20.0, 100.0, 1000.0),
    "resnet18": (20.0, 100.0),
    "transformer": (20.0,),
}


def machine() -> dict[str, Any]:
    import onnxruntime

    from tierflow.partitioner.profile import machine_info

    info = machine_info(1)
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
    spread = max(max_cuts - len(chosen), 4)
    while True:
        grid = {round(float(v)) for v in np.linspace(0, last, spread + 2)}
        if len(chosen | grid) >= max(max_cuts, len(chosen) + 4) or spread > last:
            return sorted(chosen | grid)
        spread += 1


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
    model: models.BenchModel,
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
    path = models.export(model, args.work_dir)
    specs = [(i.name, i.dtype, tuple(i.shape)) for i in load_model(path).inputs]
    # Profile on a realistic request, as `tierflow profile --sample` would: codec ratios on
    # random inputs say little about real features. It is not one of the measured requests.
    sample = models.requests(model, specs, 1, seed=SAMPLE_SEED)[0]
    graph = load_model(path, sample={name: value[None] for name, value in sample.items()})
    last = len(graph.cuts) - 1
    logger.info("[bench] %s: %d cuts, profiling", model.name, last + 1)
    base = profile_model(graph, threads=1, time_budget_s=args.profile_budget)
    profiles = {tier: base.emulate(emu.TIER_SPECS[tier].slowdown) for tier in TIERS}

    images = bench_fidelity.image_norms(model, graph)
    probe = None
    if args.budget_sample:
        planner_sample = models.planner_sample(model, specs, args.budget_sample, seed=PLANNER_SEED)
        probe = bench_fidelity.planner_probe(graph, planner_sample, images)
    choices: dict[float, dict[str, strategies.Choice]] = {}
    # Per rate, tierflow's plan under each fidelity budget (strategy -> choice); random
    # networks get the top1=99% plan only (their rows measure time alone).
    budgeted: dict[float, dict[str, strategies.Choice]] = {}
    budgets = (
        strategies.BUDGETS
        if model.trained
        else {"tierflow-budget": strategies.BUDGETS["tierflow-budget"]}
    )
    # --quick plans the lower budgets (the rest of a trained model's rate-fidelity front)
    # at the middle rate only; the full run plans them at every rate.
    front_mbit = bandwidths[len(bandwidths) // 2]
    split: dict[float, strategies.Choice] = {}
    # tierflow-split's device holds the first layers, not the model (trained models only).
    device_memory = (
        strategies.device_memory_budget(base) if probe is not None and model.trained else None
    )
    planner_notes: list[str] = []
    required: set[int] = set()
    # Codecs measured at one cut only: the image uploads on the input, the budgeted plans'.
    extra: dict[int, list[str]] = {}
    if images:
        extra[0] = list(bench_fidelity.IMAGE_BASELINES.values())
    for mbit in bandwidths:
        problem = strategies.problem_at(profiles, emu.links_at(mbit))
        from tierflow.partitioner.cost import build_tables

        tables = build_tables(problem)
        choices[mbit] = strategies.choose(tables)
        for choice in choices[mbit].values():
            required.update(choice.cuts)
        for est in search(problem, top=5, tables=tables).ranked:
            required.update(est.cuts)
        if probe is not None:
            budgeted[mbit] = {}
            for strategy, budget in budgets.items():
                if args.quick and strategy != "tierflow-budget" and mbit != front_mbit:
                    continue
                began = time.perf_counter()
                choice, notes = strategies.choose_within_budget(
                    graph, profiles, emu.links_at(mbit), probe, images, budget
                )
                planner_notes += [
                    f"{mbit:g} Mbit/s {budget}: {n}" for n in notes if "fidelity" in n
                ]
                logger.info(
                    "[bench] %s %g Mbit/s: %s (%s) plans %s %s in %.1f s",
                    model.name,
                    mbit,
                    strategy,
                    budget,
                    choice.cuts,
                    choice.codec,
                    time.perf_counter() - began,
                )
                budgeted[mbit][strategy] = dataclasses.replace(choice, strategy=strategy)
            if device_memory is not None:
                split[mbit], _ = strategies.choose_within_budget(
                    graph, profiles, emu.links_at(mbit), probe, images, device_memory=device_memory
                )
                logger.info(
                    "[bench] %s %g Mbit/s: tierflow-split (device %d B) plans %s %s",
                    model.name,
                    mbit,
                    device_memory,
                    split[mbit].cuts,
                    split[mbit].codec,
                )
            for choice in (*budgeted[mbit].values(), *([split[mbit]] if mbit in split else [])):
                required.update(choice.cuts)
                for link, cut in zip(("device-edge", "edge-cloud"), choice.cuts, strict=True):
                    if cut < last and choice.codec[link] not in strategies.TABLE_CODECS:
                        extra.setdefault(cut, []).append(choice.codec[link])
    cuts = select_cuts(last, required, args.max_cuts)
    pairs = [(a, b) for a in cuts for b in cuts if a <= b]
    requests = models.requests(model, specs, args.requests)
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
        strategies.TABLE_CODECS,
        rounds=args.rounds,
        progress=lambda what: logger.debug("[bench] %s", what),
        extra_codecs=extra,
        images=images,
    )
    # Fidelity on held-out requests (never the planner's sample), at least the measured ones.
    # The trained models are small, and their fidelity is what the split goal is judged on.
    count = max(
        args.fidelity_requests,
        args.requests,
        TRAINED_FIDELITY_REQUESTS if model.trained and not args.quick else 0,
    )
    held_out = models.requests(model, specs, count)
    truth = models.labels(model, count)
    fidelity = bench_fidelity.RowFidelity(graph, held_out, images)
    slow = slowdowns()
    rows: list[Row] = []
    plans_compared = 0
    for mbit in bandwidths:
        links = emu.links_at(mbit)
        # The best measured plan with exact codecs: what tierflow's exact plan competes with.
        best, plans_compared = bench_measure.best_plan(measured, links, slow, EXACT_PLANNER_CODECS)
        point: dict[str, bench_measure.Composed] = {}
        for name, choice in choices[mbit].items():
            point[name] = bench_measure.compose(measured, *choice.cuts, choice.codec, links, slow)
        planned: list[tuple[str, strategies.Choice | None]] = list(choices[mbit].items())
        at = len(choices[mbit])
        for strategy, choice in budgeted.get(mbit, {}).items():
            point[strategy] = bench_measure.compose(
                measured, *choice.cuts, choice.codec, links, slow
            )
            planned.insert(at, (strategy, choice))
            at += 1
        if mbit in split:
            choice = split[mbit]
            point["tierflow-split"] = bench_measure.compose(
                measured, *choice.cuts, choice.codec, links, slow
            )
            planned.insert(at, ("tierflow-split", choice))
        if images:
            for name, codec in bench_fidelity.IMAGE_BASELINES.items():
                both = {"device-edge": codec, "edge-cloud": codec}
                point[name] = bench_measure.compose(measured, 0, 0, both, links, slow)
                planned.append((name, None))
        for name, planned_choice in planned:
            composed = point[name]
            row: Row = {
                "model": model.name,
                "bandwidth_mbit": mbit,
                "strategy": name,
                "p50_ms": composed.p50_ms,
                "p90_ms": composed.p90_ms,
                "predicted_ms": planned_choice.predicted_s * 1e3 if planned_choice else None,
                "prediction_error": (
                    planned_choice.predicted_s * 1e3 / composed.p50_ms - 1.0
                    if planned_choice
                    else None
                ),
                "cuts": list(composed.cuts),
                "last_cut": last,
                "codec_used": composed.codec,
                "bytes": composed.bytes,
                "parts_ms": composed.parts_ms,
                "compute_share": compute_share(base, *composed.cuts),
                "device_edge_rtt_ms": links["device-edge"].rtt_s * 1e3,
                "gap_to_best": composed.p50_ms / best.p50_ms - 1.0,
                # Against the best measured exact plan (below zero: a lossy plan beat it).
                "regret": composed.p50_ms / best.p50_ms - 1.0,
                "measured": "composed",
                "requests": len(requests),
                "trained_weights": model.trained,
                "timing_only": not model.trained,
                "input_source": model.input_source,
                "device_ms_here": bench_measure.device_ms_here(
                    measured, composed.cuts[0], composed.codec.get("device-edge")
                ),
            }
            fidelity.add_to(row, truth)
            quality = bench_fidelity.jpeg_quality(composed.codec.get("device-edge", ""))
            if name in bench_fidelity.IMAGE_BASELINES and quality is not None:
                row["quality"] = quality
            if name in strategies.BUDGETS or name == "tierflow-split":
                chosen = (
                    strategies.SPLIT_BUDGET
                    if name == "tierflow-split"
                    else strategies.BUDGETS[name]
                )
                row["budget"] = str(chosen)
                row["budget_sample_requests"] = args.budget_sample
            if name == "tierflow-split":
                row["device_memory_budget"] = device_memory
                row["device_memory_fraction"] = strategies.SPLIT_MEMORY_FRACTION
            for other in ("device-only", "cloud-only", "cloud-only-compressed", "single-split"):
                key = "speedup_vs_" + other.replace("-", "_")
                row[key] = point[other].p50_ms / composed.p50_ms
            jpeg = point.get(bench_fidelity.JPEG_BASELINE)
            if jpeg is not None:
                row["speedup_vs_cloud_only_jpeg"] = jpeg.p50_ms / composed.p50_ms
            if name == "tierflow":
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
        "cuts": last + 1,
        "measured_cuts": len(cuts),
        "measured_pairs": len(pairs),
        "plans_compared": plans_compared,
        "measure_s": measured.seconds,
        "seconds": time.perf_counter() - started,
        "profile_correction": base.calibration.get("correction"),
        "image_inputs": {name: norm.to_dict() for name, norm in images.items()},
        "trained": model.trained,
        "fidelity_requests": len(held_out),
        "budget": str(strategies.BUDGET) if probe is not None else None,
        "budgets": {k: str(v) for k, v in budgets.items()} if probe is not None else {},
        "budget_sample_requests": args.budget_sample if probe is not None else 0,
        "budget_notes": planner_notes,
        "split_device_memory": device_memory,
    }
    logger.info(
        "[bench] %s done in %.1f s (measuring %.1f s)",
        model.name,
        info["seconds"],
        measured.seconds,
    )
    context = {
        "graph": graph,
        "base": base,
        "profiles": profiles,
        "choices": choices,
        "measured": measured,
        "images": images,
    }
    return rows, info, context


def planner_exit_points(exited: Path, graph: Any) -> tuple[Any, ...]:
    """The exits as ``tierflow plan`` sees them (cut and calibrated rate of each).

    They come from the planner's own reading of the model with exits, whose trunk must
    have the very cuts of ``graph`` (the model the profiles were made for).
    """
    from tierflow.partitioner.exits.plan import exit_points, load_planning_graph

    trunk = load_planning_graph(exited)
    mine = [(c.position, tuple(c.tensors)) for c in graph.cuts]
    theirs = [(c.position, tuple(c.tensors)) for c in trunk.cuts]
    if mine != theirs:
        raise RuntimeError(
            f"the planner's trunk of {exited} has {len(theirs)} cuts, the demo model "
            f"{len(mine)}: the exits cannot be placed on the profiled cuts"
        )
    points, notes = exit_points(trunk)
    for note in notes:
        logger.info("[bench] %s", note)
    return points


def exit_workload_size(model: models.BenchModel, args: argparse.Namespace) -> int:
    """Distinct requests in a model's tierflow-exits workload.

    A trained model's rows carry fidelity, so in a full run they stand on as many distinct
    held-out requests as its other rows (issue 21: at least 300); the demo's exits are
    judged on ``--exit-requests``; a random model's rows measure time alone.
    """
    if model.kind == "demo":
        return int(args.exit_requests)
    if model.trained and not args.quick:
        return max(TRAINED_FIDELITY_REQUESTS, int(args.requests))
    return max(int(args.requests), 8)


def exits_rows(
    model: models.BenchModel,
    context: dict[str, Any],
    rows: Sequence[Row],
    bandwidths: Sequence[float],
    args: argparse.Namespace,
) -> list[Row]:
    """tierflow-exits rows for one model: exits (demo model only) plus the edge cache."""
    from benchmarks.comparison import exit_strategy as bench_exits

    graph = context["graph"]
    heads: list[bench_exits.Head] = []
    labels: np.ndarray | None = None
    exited: Path | None = None
    exits: list[Any] = []
    exit_points: tuple[Any, ...] = ()
    if model.kind == "demo":
        _, exited, exits, _summary = bench_exits.exited_demo(args.work_dir)
        heads = bench_exits.exit_heads(exited, graph, exits)
        exit_points = planner_exit_points(exited, graph)
        from tierflow.zoo.digits import build_demo_model

        with np.load(build_demo_model().heldout_path) as data:
            labels = np.asarray(data["labels"])
    specs = [(i.name, i.dtype, tuple(i.shape)) for i in graph.inputs]
    unique = exit_workload_size(model, args)
    count = int(unique / (1 - bench_exits.REPEAT_SHARE))
    requests = models.requests(model, specs, unique, seed=EXIT_SEED)
    order = bench_exits.workload(count, unique)
    slow = slowdowns()
    walkers: dict[Any, bench_exits.PlanWalker] = {}
    exact_plans: dict[Any, bool] = {}
    out: list[Row] = []
    for mbit in bandwidths:
        choice = context["choices"][mbit]["tierflow"]
        if exit_points:  # the planner, told where requests leave, may choose another plan
            choice = strategies.choose_with_exits(
                context["profiles"], emu.links_at(mbit), exit_points
            )
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
            "predicted_ms": choice.predicted_s * 1e3,
            "prediction_error": choice.predicted_s * 1e3 / float(np.mean(point.latency_s) * 1e3)
            - 1.0,
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
            "trained_weights": model.trained,
            "timing_only": not model.trained,
            "input_source": model.input_source,
        }
        # The plain walk is the exact model's answer when the plan reproduces the model bit
        # for bit on these requests (measured here); then agreeing with it is fidelity.
        if key not in exact_plans:
            probe = bench_fidelity.RowFidelity(graph, requests, context["images"])
            exact_plans[key] = probe.of(choice.cuts, choice.codec)[1]
        row["bit_exact"] = exact_plans[key] and row["agreement_with_tierflow"] == 1.0
        row["fidelity"] = row["agreement_with_tierflow"] if exact_plans[key] else None
        row["fidelity_requests"] = len(order)
        row["regret"] = None
        if labels is not None:
            digits = models.demo_indices(unique, EXIT_SEED, len(labels))
            truth = labels[[digits[i] for i in order]]
            row["accuracy"] = float(np.mean(point.predicted == truth))
            row["accuracy_without_exits"] = float(np.mean(point.plain_predicted == truth))
        runtime_points = RUNTIME_POINTS_QUICK if args.quick else RUNTIME_POINTS_FULL
        figures: dict[str, Any] | None = None
        if exited is not None and mbit in runtime_points.get(model.name, ()):
            from benchmarks.comparison import runtime as bench_runtime

            try:
                figures = bench_runtime.runtime_exit_point(
                    graph,
                    exited,
                    exits,
                    choice.cuts,
                    choice.codec,
                    emu.links_at(mbit),
                    slow,
                    [requests[i] for i in order],
                    bench_exits.CACHE_BUDGET,
                )
            except Exception as exc:  # one failing point must not sink the whole run
                logger.exception("[bench] runtime run of tierflow-exits failed")
                row["runtime_error"] = f"{type(exc).__name__}: {exc}"
                figures = None
        if figures is not None:
            row["runtime_p50_ms"] = figures["p50_ms"]
            row["runtime_p90_ms"] = figures["p90_ms"]
            row["runtime_mean_ms"] = figures["mean_ms"]
            row["runtime_requests"] = figures["requests"]
            row["runtime_answered_by"] = figures["answered_by"]
            row["runtime_exit_rate"] = figures["exit_rate"]
            row["runtime_cache_hit_rate"] = figures["cache_hit_rate"]
            row["runtime_load"] = load_average()[0]
            logger.info(
                "[bench] runtime %s tierflow-exits %g Mbit/s: p50 %.1f ms (walked %.1f ms)",
                model.name,
                mbit,
                figures["p50_ms"],
                p50,
            )
        for other in ("device-only", "cloud-only", "cloud-only-compressed", "single-split"):
            base_row = next(
                r
                for r in rows
                if r["model"] == model.name
                and r["bandwidth_mbit"] == mbit
                and r["strategy"] == other
            )
            row["speedup_vs_" + other.replace("-", "_")] = base_row["p50_ms"] / p50
        row["speedup_vs_best_baseline"] = min(
            row["speedup_vs_" + other]
            for other in ("device_only", "cloud_only", "cloud_only_compressed", "single_split")
        )
        out.append(row)
    return out


def runtime_pass(
    model: models.BenchModel,
    context: dict[str, Any],
    rows: list[Row],
    args: argparse.Namespace,
) -> None:
    """Run the planned strategies through the real runtime at this model's subset of points.

    Adds ``runtime_p50_ms`` (and p90, requests) to the composed rows it ran.
    """
    from benchmarks.comparison import runtime as bench_runtime

    points = (RUNTIME_POINTS_QUICK if args.quick else RUNTIME_POINTS_FULL).get(model.name, ())
    graph = context["graph"]
    specs = [(i.name, i.dtype, tuple(i.shape)) for i in graph.inputs]
    requests = models.requests(model, specs, args.runtime_requests)
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
            row["runtime_load"] = load_average()[0]
            logger.info(
                "[bench] runtime %s %s %g Mbit/s: p50 %.1f ms (composed %.1f ms)",
                model.name,
                name,
                mbit,
                figures["p50_ms"],
                row["p50_ms"],
            )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.comparison",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="small models, 3 bandwidths, few requests (for the test)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS, help="where results and plots go")
    parser.add_argument(
        "--work-dir",
        type=Path,
        default=models.default_work_dir(),
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
        "--rounds",
        type=int,
        default=None,
        help="measuring passes per model, each stage keeping its fastest (default 1 quick, 2 full)",
    )
    parser.add_argument(
        "--max-cuts",
        type=int,
        default=None,
        help="cuts sampled per model (default 9 quick, 20 full)",
    )
    parser.add_argument(
        "--profile-budget",
        type=float,
        default=None,
        help="seconds of adaptive repeats while profiling a model",
    )
    parser.add_argument(
        "--fidelity-requests",
        type=int,
        default=None,
        help="held-out requests each row's fidelity is measured on (default 20 quick, 50 full; "
        "at least 300 for the trained models in a full run)",
    )
    parser.add_argument(
        "--budget-sample",
        type=int,
        default=100,
        help="the planner's sample for tierflow-budget (top1=99%% needs 100); 0: no "
        "tierflow-budget rows",
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
    parser.add_argument(
        "--refold",
        action="store_true",
        help="measure nothing: fold benchmarks.bottleneck's committed rows into the run already "
        "in --out again, recompute the verdict and the split goal, redraw RESULTS.md and plots",
    )
    parser.add_argument(
        "--fold-from",
        type=Path,
        default=None,
        help="with --refold: another run's folder (e.g. a --models run); the models it "
        "measured take all their rows from it, recorded in results_meta.json model_runs",
    )
    parser.add_argument(
        "--no-overheads",
        action="store_true",
        help="skip the transport, codec and planning overhead figures (exits and runtime "
        "passes still run)",
    )
    parser.add_argument(
        "--nice",
        type=int,
        default=0,
        help="change this process's CPU priority (negative: higher, needs root), so that "
        "other jobs on a shared machine disturb the wall-clock parts (profiling, the "
        "runtime pass) less",
    )
    parser.add_argument("-v", "--verbose", action="count", default=0)
    args = parser.parse_args(argv)
    args.requests = args.requests or (5 if args.quick else 15)
    args.rounds = args.rounds or (1 if args.quick else 2)
    args.runtime_requests = args.runtime_requests or (5 if args.quick else 10)
    args.exit_requests = args.exit_requests or (40 if args.quick else 300)
    args.fidelity_requests = args.fidelity_requests or (20 if args.quick else 50)
    args.max_cuts = args.max_cuts or (9 if args.quick else 20)
    args.profile_budget = args.profile_budget or (2.0 if args.quick else 20.0)
    return args


FOLDED = "composed by bottleneck.py"
#: Every folded row's ``measured`` starts so (bottleneck.py, bottleneck_trained.py).
FOLDED_PREFIX = "composed by "


def is_folded(row: Row) -> bool:
    """Whether ``row`` was folded in from another benchmark's run (refold replaces it)."""
    return str(row.get("measured", "")).startswith(FOLDED_PREFIX)


def fold_models(
    rows: list[Row], data: dict[str, Any], new_rows: list[Row], new_meta: dict[str, Any]
) -> tuple[list[Row], dict[str, Any]]:
    """Replace the rows and model entries of the models of another run (``new_rows``,
    ``new_meta``) in a run's ``rows`` and meta ``data``.

    Every model's rows then come from one run, named in ``data["model_runs"]`` (command and
    date; models not folded keep the run's own); models and rows follow the suite's order.
    Folded ``bottleneck.py`` rows are left out of both: the caller folds them in again.
    """
    names = {m["name"] for m in new_meta["models"]}
    if not names:
        raise ValueError("the run to fold from measured no model")
    runs = data.get("model_runs") or {
        m["name"]: {"command": data["command"], "date": data["date"]} for m in data["models"]
    }
    for name in names:
        runs[name] = {"command": new_meta["command"], "date": new_meta["date"]}
    kept = [r for r in rows if r["model"] not in names and not is_folded(r)]
    kept += [r for r in new_rows if r["model"] in names and not is_folded(r)]
    infos = {m["name"]: m for m in data["models"]}
    infos.update({m["name"]: m for m in new_meta["models"]})
    order = [m["name"] for m in data["models"]]
    order += [n for n in sorted(names) if n not in order]
    # A model new to the run takes its place in the suite's order (rows and tables follow).
    place = {m.name: i for i, m in enumerate(models.suite(quick=False))}
    order.sort(key=lambda n: place.get(n, len(place)))
    kept.sort(key=lambda r: order.index(r["model"]) if r["model"] in order else len(order))
    return kept, {**data, "models": [infos[n] for n in order], "model_runs": runs}


def label_rows(rows: list[Row], entries: Sequence[dict[str, Any]]) -> None:
    """Give every row its model's ``trained_weights``, ``timing_only`` and ``input_source``
    where it lacks them (rows of a run made before a strategy carried them)."""
    infos = {m["name"]: m for m in entries}
    for row in rows:
        info = infos.get(row["model"])
        if info is None or "trained_weights" in row:
            continue
        row["trained_weights"] = bool(info.get("trained"))
        row["timing_only"] = not row["trained_weights"]
        if "input_source" in info:
            row["input_source"] = info["input_source"]


def adaptation_section() -> list[str]:
    """RESULTS.md's summary of the adaptation benchmark's last committed run, if any."""
    adaptation = RESULTS / "adaptation.json"
    if not adaptation.is_file():
        return []
    return [
        "## Live adaptation\n",
        "From `python -m benchmarks.adaptation`'s last committed run (not rerun by this script; "
        "tables, method and plots in [ADAPTATION.md](ADAPTATION.md)):\n",
        json.loads(adaptation.read_text())["summary"] + "\n",
    ]


def _transport_again(kept: str, extras: dict[str, Any]) -> str:
    """The transport section and figures from ``transport.py``'s last saved run.

    ``transport.py`` measures a hop against a relay with more rounds than a suite
    run gives it, so a refold takes its saved figures (``results/transport.json``) when
    they are newer than the run's own, recording them under ``overheads.transport``.
    """
    saved = RESULTS / "transport.json"
    heading = "### Transport overhead per hop and pipelined throughput"
    if not saved.is_file() or heading not in kept:
        return kept
    from benchmarks.comparison import overheads as bench_overheads

    lines, figures = bench_overheads.transport(quick=True)
    if extras.get("transport", {}).get("date") == figures.get("date"):
        return kept
    extras["transport"] = figures
    start = kept.index(heading)
    end = kept.find("\n### ", start + len(heading))
    end = len(kept) if end < 0 else end + 1
    return kept[:start] + "\n".join(lines).rstrip("\n") + "\n\n" + kept[end:]


#: Where the sections that markdown() appends anew from their own suites' JSON begin
#: (rate_fidelity, generation, tenancy), as a run of those suites wrote them into RESULTS.md.
APPENDED_SECTION_MARKS = (
    "<!-- rate-fidelity:start",
    "## Rate against fidelity",
    "<!-- generation:start",
    "<!-- tenancy-bench: start",
)


def without_appended_sections(kept: str) -> str:
    """``kept`` cut before the first section that markdown() appends again, wherever it is."""
    found = [kept.index(mark) for mark in APPENDED_SECTION_MARKS if mark in kept]
    return kept[: min(found)].rstrip("\n") + "\n" if found else kept


def refold(out: Path, fold_from: Path | None = None) -> int:
    """Fold ``results/bottleneck.json`` again into the run in ``out``, measuring nothing.

    The folded rows are replaced, the verdict and the split goal recomputed, and RESULTS.md
    redrawn: every part drawn from the rows is drawn again, the live adaptation summary is
    read again from ``results/adaptation.json``, and the measured overhead figures (from
    "## Overheads and limits" on) are kept as they were, but for transport, which is taken
    from ``transport.py``'s last saved run (:func:`_transport_again`).
    With ``fold_from`` (another run's folder), the models that run measured take their rows
    from it (:func:`fold_models`).
    """
    rows = [r for r in json.loads((out / "results.json").read_text()) if not is_folded(r)]
    data = json.loads((out / "results_meta.json").read_text())
    if fold_from is not None:
        rows, data = fold_models(
            rows,
            data,
            json.loads((fold_from / "results.json").read_text()),
            json.loads((fold_from / "results_meta.json").read_text()),
        )
    label_rows(rows, data["models"])
    folded, source = bench_fidelity.bottleneck_rows()
    rows.extend(folded)
    extras = data.pop("overheads", {})
    data["verdict"] = bench_fidelity.verdict(rows)
    data["split_goal"] = bench_fidelity.split_goal(rows)
    data["splits_pay"] = bench_fronts.summary(bench_fronts.where_splits_pay(rows))
    data["bottleneck_source"] = source
    data["refolded"] = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    for line in [
        *bench_sections.verdict_lines(data["verdict"]),
        bench_sections.goal_line(data["split_goal"]),
    ]:
        print(line)
    old = (out / "RESULTS.md").read_text()
    # The method text as the run wrote it (results_meta.json leaves it out).
    data["method"] = old[old.index("## How it was measured") : old.index("## Summary")].rstrip()
    kept = old[old.index("## Overheads and limits") :]
    kept = _transport_again(kept, extras)
    kept = without_appended_sections(kept)
    sections = bench_sections.fidelity_section(rows, data["verdict"], source, data["split_goal"])
    sections += bench_sections.jpeg_sweep_section(rows)
    sections += bench_fronts.section(rows, bench_fronts.plot_fronts(rows, out, out))
    sections += bench_fidelity.learned_bottleneck_lines()
    sections += bench_sections.exits_section(rows)
    sections += bench_sections.runtime_section(rows)
    runs = data.get("model_runs", {})
    from_other = sorted(n for n, r in runs.items() if r["command"] != data["command"])
    sections += [
        f"*The rows of `benchmarks.bottleneck` were folded in again on {data['refolded']} "
        "(`python -m benchmarks.comparison --refold`, nothing measured); the live adaptation "
        "summary is read again from its JSON and the overhead sections are kept as they were "
        "in RESULTS.md, transport's taken from `benchmarks.transport`'s last saved run.*\n",
        *(
            [
                "*Rows of "
                + ", ".join(
                    f"`{n}` from `{runs[n]['command']}` ({runs[n]['date']})" for n in from_other
                )
                + f"; every other model's from `{data['command']}` ({data['date']}) "
                "(`results_meta.json` `model_runs`).*\n"
            ]
            if from_other
            else []
        ),
        *adaptation_section(),
        kept,
    ]
    bench_report.write_json(rows, out / "results.json")
    bench_report.write_meta(data, extras, out / "results_meta.json")
    bench_report.plot_latency(rows, out / "latency_vs_bandwidth.png")
    bench_report.plot_cuts(rows, out / "cuts.png")
    bench_report.plot_speedup(rows, out / "speedup.png")
    bench_report.plot_regret(rows, out / "regret.png")
    text = bench_report.markdown(rows, data, sections)
    (out / "RESULTS.md").write_text(text.rstrip("\n") + "\n")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.fold_from is not None and not args.refold:
        print("benchmarks.comparison: error: --fold-from goes with --refold", file=sys.stderr)
        return 2
    if args.refold:
        return refold(args.out, args.fold_from)
    logging.basicConfig(
        level=logging.WARNING if args.verbose == 0 else logging.DEBUG,
        format="%(asctime)s %(message)s",
        datefmt="%H:%M:%S",
    )
    if args.verbose == 0:
        # Progress from every benchmark module (benchmarks.comparison.measure, ...).
        logging.getLogger("benchmarks").setLevel(logging.INFO)
    if args.nice:
        os.nice(args.nice)
    started = time.perf_counter()
    load_start = load_average()
    bandwidths = tuple(
        args.bandwidths or (emu.QUICK_BANDWIDTHS if args.quick else emu.FULL_BANDWIDTHS)
    )
    unknown = [b for b in bandwidths if b not in emu.DEVICE_EDGE_RTT_MS]
    if unknown:
        print(
            f"benchmarks.comparison: error: no RTT known for bandwidths {unknown}",
            file=sys.stderr,
        )
        return 2
    chosen = models.suite(args.quick)
    if args.models:
        chosen = [m for m in chosen if m.name in args.models]
    args.out.mkdir(parents=True, exist_ok=True)
    rows: list[Row] = []
    infos: list[dict[str, Any]] = []
    measured: list[Any] = []
    for model in chosen:
        load = load_average()
        model_rows, info, context = bench_model(model, bandwidths, args)
        info["load_average"] = load_span(load)
        rows.extend(model_rows)
        if not args.no_extras:
            started_exits = time.perf_counter()
            rows.extend(exits_rows(model, context, model_rows, bandwidths, args))
            info["exits_s"] = time.perf_counter() - started_exits
            started_runtime = time.perf_counter()
            runtime_pass(model, context, model_rows, args)
            info["runtime_s"] = time.perf_counter() - started_runtime
            logger.info(
                "[bench] %s: exits/cache %.1f s, runtime %.1f s",
                model.name,
                info["exits_s"],
                info["runtime_s"],
            )
        measured.append(context["measured"])
        infos.append(info)
    folded, bottleneck_source = bench_fidelity.bottleneck_rows()
    if args.models:
        folded = [r for r in folded if r["model"] in args.models]
    rows.extend(folded)
    verdict = bench_fidelity.verdict(rows)
    goal = bench_fidelity.split_goal(rows)
    for line in [*bench_sections.verdict_lines(verdict), bench_sections.goal_line(goal)]:
        print(line)
    sections: list[str] = []
    sections += bench_sections.fidelity_section(rows, verdict, bottleneck_source, goal)
    sections += bench_sections.jpeg_sweep_section(rows)
    sections += bench_fronts.section(rows, bench_fronts.plot_fronts(rows, args.out, args.out))
    sections += bench_fidelity.learned_bottleneck_lines()
    sections += bench_sections.exits_section(rows)
    sections += bench_sections.runtime_section(rows)
    sections += adaptation_section()
    sections += ["## Overheads and limits\n"]
    sections += bench_sections.prediction_section(rows)
    extras: dict[str, Any] = {}
    if not args.no_extras and not args.no_overheads:
        from benchmarks.comparison import overheads as bench_overheads

        for name, part in (
            ("transport", lambda: bench_overheads.transport(args.quick)),
            ("codecs", lambda: bench_overheads.codecs(measured, args.quick)),
            ("planning", bench_overheads.planning),
        ):
            began = time.perf_counter()
            try:
                lines, figures = part()
            except Exception as exc:  # another engineer's module changed: say so, go on
                logger.exception("[bench] %s figures failed", name)
                lines = [f"### {name}\n", f"Not measured: {type(exc).__name__}: {exc}\n"]
                figures = {"error": repr(exc)}
            sections += lines
            extras[name] = figures
            logger.info("[bench] %s figures in %.1f s", name, time.perf_counter() - began)
    else:
        sections += ["Transport, codec and planning figures not measured (`--no-extras`).\n"]
    chaos_json = RESULTS / "chaos.json"
    if chaos_json.exists():  # kept from chaos.py's last run (it is not run here)
        from benchmarks import chaos

        sections += chaos.markdown(json.loads(chaos_json.read_text()))
    command = (
        " ".join(["python -m benchmarks.comparison", *sys.argv[1:]])
        if argv is None
        else ("python -m benchmarks.comparison " + " ".join(argv))
    )
    meta = {
        "command": command,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "wall_s": time.perf_counter() - started,
        "quick": args.quick,
        "requests": args.requests,
        "machine": machine(),
        "emulation": emu.describe(),
        "models": infos,
        "method": bench_sections.METHOD.format(rounds=args.rounds),
        "verdict": verdict,
        "split_goal": goal,
        "splits_pay": bench_fronts.summary(bench_fronts.where_splits_pay(rows)),
        "bottleneck_source": bottleneck_source,
    }
    sections += bench_sections.LIMITS.splitlines()
    meta["load_average"] = load_span(load_start)
    bench_report.write_json(rows, args.out / "results.json")
    bench_report.write_meta(meta, extras, args.out / "results_meta.json")
    bench_report.plot_latency(rows, args.out / "latency_vs_bandwidth.png")
    bench_report.plot_cuts(rows, args.out / "cuts.png")
    bench_report.plot_speedup(rows, args.out / "speedup.png")
    bench_report.plot_regret(rows, args.out / "regret.png")
    (args.out / "RESULTS.md").write_text(bench_report.markdown(rows, meta, sections))
    print(
        f"wrote {args.out / 'RESULTS.md'} and results.json ({len(rows)} rows) "
        f"in {time.perf_counter() - started:.0f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
