"""``tierflow demo``: the three tiers on this machine, on the built-in model, no arguments.

What it does, in order (each step prints what it measured):

1. builds the demo model once (a residual CNN trained on scikit-learn's digits; see
   ``tierflow.zoo.digits``), then reuses the cached copy, and puts a camera's
   preprocessing in front of it (``tierflow.zoo.digits_camera``): requests are 224x224
   RGB frames of the held-out digits, as a camera app would send them;
2. adds early exits to a copy of it (heads trained on the model's own answers,
   thresholds calibrated for at most 1% disagreement), also cached;
3. profiles both on this machine, emulating a slow device, a medium edge and a fast
   cloud (fewer threads, and a slowdown factor that the runtimes reproduce by sleeping);
4. plans them for emulated links, with the frame declared an image input (so sending it
   as PNG is among the exact candidates), prints the ranked tables, and says what it
   chose and why (its prediction against each single tier's);
5. writes six plans — tierflow's choice, the same with early exits, device-only,
   edge-only, cloud-only and ``cloud-only-jpeg`` (the frame uploaded as JPEG quality 90,
   what a camera app does today) — and for each starts the cloud and the edge as two
   real processes, runs the device in this process and streams the held-out frames
   through them with live progress;
6. ends with one table: accuracy, agreement with the exact model, p50/p95 latency,
   pipelined throughput, bytes per link and which tier answered, measured in the same
   run for every strategy. With --json that table is one JSON object on stdout and
   the steps go to stderr.

Every process it starts (``tierflow.runtime.processes.ServeProcess``) is stopped on the way out,
also on errors and Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tierflow.cli.helptext import HelpFormatter, examples
from tierflow.cli.paths import output_file
from tierflow.codec.base import ImageNorm
from tierflow.errors import UsageError
from tierflow.link.spec import LINKS, TIERS, LinkOption, LinkSpec, apply_links
from tierflow.runtime.processes import ServeProcess
from tierflow.tuning import tune_for_latency

logger = logging.getLogger(__name__)

# How the demo emulates its three tiers on one machine: ONNX Runtime threads, and how
# many times slower than this machine each tier runs. See [Note: the demo's margin].
EMULATION: dict[str, tuple[int, float]] = {
    "device": (1, 50.0),
    "edge": (1, 2.0),
    "cloud": (1, 1.0),
}
# A low-power camera device (50x slower than one core here), an edge box on the same
# site (2x), a cloud core; Wi-Fi to that edge (20 Mbit/s up, 4 ms round trip), a
# metro/WAN link from there to the cloud.
#
# [Note: the demo's margin]
# The demo shows a split, so its setting must make the split win by a margin that this
# machine's speed and load cannot flip. The link's costs are fixed (a 4 ms round trip)
# while compute scales with the machine: on a fast, idle machine a 20x device computed
# the whole model in about 6.4 ms, and device-only beat device -> edge (about 7.5 ms,
# mostly the round trip) in 3 runs of 3. Load only slows compute, which favours the
# split; a faster machine is what flips it. At 50x the device's whole model costs 2.5x
# the split on this 2-core machine (about 37 against 15 ms predicted), and about 1.6x on
# a machine three times as fast (its camera stage, a fifth of the model, stays on the
# device). A slower device still would widen the margin, but the uploads' PNG encoding
# runs on it too, and the whole demo's run time grows with it. The demo prints its choice
# and this comparison (:func:`choice_note`), so a run that chose otherwise says why.
DEFAULT_LINKS: dict[str, str] = {"device-edge": "20mbit,4ms", "edge-cloud": "200mbit,20ms"}
SERVER_START_TIMEOUT_S = 60.0
# The camera frame is pixel / 255 on three channels; frames for the planner's sample.
FRAME_NORM = ImageNorm(mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0))
SAMPLE_REQUESTS = 8
# What a camera app does today: upload the frame as JPEG, quality 90.
JPEG_BASELINE = "jpeg:90"
#: The strategies, in the order the results table lists them.
STRATEGIES = (
    "tierflow",
    "tierflow+exits",
    "device-only",
    "edge-only",
    "cloud-only",
    "cloud-only-jpeg",
)
#: The columns of the results table (printed, and written by --results-md).
RESULT_HEADERS = (
    "strategy",
    "accuracy",
    "agrees",
    "p50 ms",
    "p95 ms",
    "req/s",
    "device-edge B/req",
    "edge-cloud B/req",
    "answered by",
    "failed",
)


@dataclass
class StrategyRun:
    """What one strategy did over the held-out set."""

    name: str
    latencies_ms: list[float] = field(default_factory=list)
    correct: int = 0
    agree: int = 0  # answers whose top-1 class is the exact model's
    tiers: tuple[str, ...] = ()  # the tiers the plan runs on
    codec: dict[str, str] = field(default_factory=dict)  # each used link's codec
    answered: int = 0
    failed: int = 0
    bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(LINKS, 0))
    answered_by: dict[str, int] = field(default_factory=dict)
    exits: int = 0
    throughput_rps: float = 0.0

    def percentile(self, q: float) -> float:
        return float(np.percentile(self.latencies_ms, q)) if self.latencies_ms else float("nan")

    def to_dict(self) -> dict[str, Any]:
        """The row of the results table as data (``tierflow demo --json``)."""
        n = max(self.answered, 1)
        answered = bool(self.latencies_ms)
        return {
            "strategy": self.name,
            "requests": self.answered + self.failed,
            "failed": self.failed,
            "accuracy": self.correct / n,
            "agreement": self.agree / n,
            "tiers": list(self.tiers),
            "codec": dict(self.codec),
            "p50_ms": self.percentile(50) if answered else None,
            "p95_ms": self.percentile(95) if answered else None,
            "throughput_rps": self.throughput_rps,
            "bytes_per_request": {link: nbytes / n for link, nbytes in self.bytes.items()},
            "answered_by": dict(self.answered_by),
            "exits": self.exits,
        }


#: ``tierflow demo --help``: the module docstring's steps as a reader of a terminal reads
#: them (no reStructuredText, no class names).
DESCRIPTION = """\
The three tiers on this machine, on the built-in model, no arguments:

1. builds the demo model once (a residual CNN trained on scikit-learn's digits), then
   reuses the cached copy, with a camera's preprocessing in front of it: requests are
   224x224 RGB frames of the held-out digits, as a camera app would send them;
2. adds early exits to a copy of it (heads trained on the model's own answers,
   thresholds calibrated for at most 1% disagreement), also cached;
3. profiles both here, emulating a slow device (50x), an edge (2x) and a cloud;
4. plans them for emulated links, prints the ranked plans and says what it chose and why;
5. writes six plans (tierflow's choice, the same with early exits, device-only,
   edge-only, cloud-only, and cloud-only-jpeg: the frame uploaded as JPEG quality 90),
   starts the cloud and the edge of each as two real processes and streams the held-out
   frames through them;
6. ends with one table measured in the same run: accuracy, agreement with the exact
   model, p50/p95 latency, throughput, bytes per link and which tier answered. With
   --json that table is one JSON object on stdout and the steps go to stderr.

Every process it starts is stopped on the way out, also on errors and Ctrl-C."""


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="run the three tiers on this machine on the built-in model",
        description=DESCRIPTION,
        epilog=examples(
            "tierflow demo",
            "# a slower, farther link, 200 requests per strategy, plans kept in demo/",
            "tierflow demo --link device-edge=2mbit,40ms --requests 200 --workdir demo/",
            "# a byte-level decoder family: text streamed from the split, with and without drafts",
            "tierflow demo --generate",
        ),
        formatter_class=HelpFormatter,
    )
    parser.add_argument(
        "--requests",
        type=int,
        default=0,
        help="held-out requests per strategy; 0: the whole held-out set",
    )
    parser.add_argument(
        "--link",
        type=LinkOption.parse,
        action="append",
        default=[],
        metavar="NAME=RATE[,RTT]",
        help="emulated link, repeatable; a rate alone keeps that link's RTT "
        "(default: device-edge=20mbit,4ms, edge-cloud=200mbit,20ms)",
    )
    parser.add_argument(
        "--window",
        type=int,
        default=16,
        help="requests in flight for the pipelined throughput pass",
    )
    parser.add_argument(
        "--workdir",
        type=Path,
        default=None,
        help="where plans and logs go (default: a temporary folder, removed afterwards)",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="print the results as one JSON object on stdout (the steps go to stderr)",
    )
    parser.add_argument(
        "--results-md",
        type=output_file,
        default=None,
        metavar="FILE.md",
        help="also write the results (table, comparisons, predictions) as Markdown to "
        "FILE.md; the README embeds demos/demo-results.md, written so",
    )
    parser.add_argument(
        "--generate",
        action="store_true",
        help="the generation demo instead: a byte-level decoder family trained on the "
        "standard library, the large model split over the three tiers, text streamed as it "
        "comes, with and without the small model drafting on the device, over links "
        "emulated as device-edge=20mbit,30ms and edge-cloud=200mbit,20ms unless --link says",
    )
    parser.add_argument(
        "--max-tokens", type=int, default=64, help="--generate: tokens generated per prompt"
    )
    parser.add_argument(
        "--prompts", type=int, default=1, help="--generate: held-out prompts per strategy"
    )
    parser.set_defaults(handler=run_demo, extra="train")  # the extra a missing import names


def run_demo(args: argparse.Namespace) -> int:
    if args.generate:
        from tierflow.demos.generation_setup import DEFAULT_LINKS as GENERATE_LINKS

        if args.requests or args.results_md is not None:
            raise UsageError("--requests and --results-md are the digits demo's, not --generate's")
        if not 1 <= args.max_tokens <= 256 or not 1 <= args.prompts <= 32:
            raise UsageError("--max-tokens must be within 1..256 and --prompts within 1..32")
        defaults = {name: LinkSpec.parse(text) for name, text in GENERATE_LINKS.items()}
    else:
        defaults = {name: LinkSpec.parse(text) for name, text in DEFAULT_LINKS.items()}
    links = apply_links(defaults, args.link)
    if args.requests < 0 or args.window < 1:
        raise UsageError("--requests must be >= 0 and --window >= 1")
    with ExitStack() as stack:
        if args.workdir is None:
            workdir = Path(tempfile.mkdtemp(prefix="tierflow-demo-"))
            stack.callback(shutil.rmtree, workdir, ignore_errors=True)
        else:
            workdir = args.workdir
            workdir.mkdir(parents=True, exist_ok=True)
        if args.generate:
            from tierflow.demos.generate import run_generate_demo

            return run_generate_demo(
                links, workdir, prompts=args.prompts, max_tokens=args.max_tokens, as_json=args.json
            )
        if args.json:  # the steps' output goes to stderr, one JSON object to stdout
            with contextlib.redirect_stdout(sys.stderr):
                runs, notes = _demo(links, workdir, args.requests, args.window)
            report = {
                "links": {name: str(spec) for name, spec in links.items()},
                "strategies": [run.to_dict() for run in runs],
            }
            print(json.dumps(report))
        else:
            runs, notes = _demo(links, workdir, args.requests, args.window)
    if args.results_md is not None:
        text = results_markdown(runs, notes, links, args.window)
        try:
            args.results_md.write_text(text)
        except OSError as exc:
            raise UsageError(f"--results-md {args.results_md}: cannot write it: {exc}") from exc
    return 0 if all(r.failed == 0 for r in runs) else 1


def _step(number: int, text: str) -> None:
    print(f"\n[{number}/6] {text}", flush=True)


def _demo(
    links: Mapping[str, LinkSpec], workdir: Path, requests: int, window: int
) -> tuple[list[StrategyRun], list[str]]:
    """Steps 1-6; returns what each strategy did and the comparisons printed after it."""
    from tierflow.partitioner.exits.plan import load_planning_graph
    from tierflow.partitioner.fidelity_probe import FidelityProbe, sample_requests
    from tierflow.partitioner.plan_options import PlanOptions
    from tierflow.partitioner.plan_writing import write_plan
    from tierflow.partitioner.ranking import rank, score_plan
    from tierflow.partitioner.report import plan_table
    from tierflow.zoo.digits import build_demo_model
    from tierflow.zoo.digits_camera import (
        FRAME_INPUT,
        FRAME_SIZE,
        camera_model,
        digit_frames,
        frame_tensor,
    )

    _step(1, "demo model: a residual CNN trained on scikit-learn's digits, fed camera frames")
    demo = build_demo_model(progress=_epoch_printer, status=_status_printer)
    meta = demo.meta
    how = "trained now" if demo.built else f"cached in {demo.directory}"
    print(
        f"  {how}: {meta.params:,} parameters, held-out accuracy {meta.accuracy:.1%} (32x32), "
        f"{demo.model_path.stat().st_size:,} bytes"
    )
    frames, labels = digit_frames("heldout", requests)
    camera_path = camera_model(demo)
    exact_top1 = _top1(camera_path, frames)
    print(
        f"  requests: {FRAME_SIZE}x{FRAME_SIZE} RGB frames of the {len(labels)} held-out digits "
        f"({frame_tensor(frames[:1]).nbytes:,} bytes as float32); the model greys and pools "
        f"them to 32x32 first: held-out accuracy {np.mean(exact_top1 == labels):.1%}"
    )

    _step(2, "early exits: heads trained on the model's own answers, thresholds calibrated")
    exited_path = camera_model(demo, _exited_model(demo), "camera-exits")

    _step(3, "profiling on this machine, emulating the three tiers")
    for tier in TIERS:
        threads, slowdown = EMULATION[tier]
        print(f"  {tier:<6} {threads} thread, {slowdown:g}x slower than this machine")
    graph = load_planning_graph(camera_path)
    profiles = _emulated_profiles(graph, "model")
    exit_graph = load_planning_graph(exited_path)
    exit_profiles = _emulated_profiles(exit_graph, "model with exits")
    print(f"  {len(graph.cuts)} candidate cuts, {len(graph.nodes)} nodes")

    _step(4, "planning for " + ", ".join(f"{n} {links[n]}" for n in LINKS))
    options = PlanOptions(links=links, images={FRAME_INPUT: FRAME_NORM})
    sample = {FRAME_INPUT: frame_tensor(digit_frames("train", SAMPLE_REQUESTS)[0])}
    probe = FidelityProbe(graph, sample_requests(graph.inputs, sample), images=options.images)
    result, notes = rank(graph, profiles, options, probe=probe)
    for note in notes:
        print(f"  {note}")
    print(_indent(plan_table(result, {})))
    print(f"  {choice_note(result)}")
    exit_probe = FidelityProbe(
        exit_graph, sample_requests(exit_graph.inputs, sample), images=options.images
    )
    exit_result, _ = rank(exit_graph, exit_profiles, options, probe=exit_probe)
    print("  with early exits, the best plans are:")
    print(_indent(plan_table(exit_result, {})))
    # The uploads send the frame as a camera app would: PNG (exact for 8-bit pixels, the
    # smallest exact form of these frames) or JPEG quality 90.
    last = len(graph.cuts) - 1
    feeds = probe.requests[0]

    def upload(cuts: tuple[int, int], codec: str) -> Any:
        return score_plan(graph, profiles, options, cuts, dict.fromkeys(LINKS, codec), feeds)

    plans = {
        "tierflow": (graph, profiles, result.best),
        "tierflow+exits": (exit_graph, exit_profiles, exit_result.best),
        "device-only": (graph, profiles, result.baselines["device-only"]),
        "edge-only": (graph, profiles, upload((0, last), "png")),
        "cloud-only": (graph, profiles, upload((0, 0), "png")),
        "cloud-only-jpeg": (graph, profiles, upload((0, 0), JPEG_BASELINE)),
    }
    assert tuple(plans) == STRATEGIES
    plan_dirs = {}
    for name, (plan_graph, plan_profiles, estimate) in plans.items():
        outcome = write_plan(plan_graph, plan_profiles, options, estimate, workdir / name)
        plan_dirs[name] = outcome.plan_dir
        codecs = ", ".join(f"{k} {v}" for k, v in estimate.codec.items()) or "no link"
        print(
            f"  wrote {name} plan: {' -> '.join(estimate.tiers)} ({codecs}; "
            f"predicted {estimate.latency_s * 1e3:.1f} ms)"
        )

    _step(5, f"streaming {len(labels)} held-out frames through each strategy")
    tune_for_latency()  # this process is the device, as in `tierflow run`
    runs = []
    for name in plans:
        estimate = plans[name][2]
        run = StrategyRun(name, tiers=estimate.tiers, codec=estimate.codec)
        _run_strategy(run, plan_dirs[name], links, frames, labels, exact_top1, window, workdir)
        runs.append(run)

    _step(6, "results, measured side by side in this run")
    print(_indent(_results_table(runs)))
    print(f"  {_legend(window)}")
    notes = _comparisons(runs, {name: estimate for name, (_, _, estimate) in plans.items()})
    for note in notes:
        print(f"  {note}")
    return runs, notes


def choice_note(result: Any) -> str:
    """What the planner chose and why, in one sentence: its parts, against each single tier.

    ``result`` is the planner's ``SearchResult``. See [Note: the demo's margin].
    """
    best = result.best
    parts = []
    for tier in TIERS:  # in the order a request meets them
        if tier in best.tiers:
            parts.append(f"{tier} computes {best.compute_s[tier] * 1e3:.1f} ms")
        for name, cost in best.links.items():
            if name.startswith(f"{tier}-") and cost.used:
                parts.append(
                    f"{name} carries {cost.bytes:,.0f} B as {cost.codec} "
                    f"in {cost.total_s * 1e3:.1f} ms"
                )
    against = []
    for name, baseline in result.baselines.items():
        if baseline.tiers == best.tiers and baseline.cuts == best.cuts:
            continue
        ratio = baseline.latency_s / best.latency_s if best.latency_s > 0 else float("inf")
        against.append(f"{name} {baseline.latency_s * 1e3:.1f} ms ({ratio:.2f}x)")
    text = (
        f"chose {' -> '.join(best.tiers)}, predicted {best.latency_s * 1e3:.1f} ms "
        f"({', '.join(parts)})"
    )
    return text + (f"; against {', '.join(against)}" if against else "")


def _legend(window: int) -> str:
    return (
        "agrees: share of requests whose answer is the exact model's (top-1); "
        f"req/s: {window} requests in flight"
    )


def _comparisons(runs: Sequence[StrategyRun], estimates: Mapping[str, Any]) -> list[str]:
    """tierflow's plan against each baseline, and the planner's predictions, as sentences."""
    by_name = {run.name: run for run in runs}
    best = estimates["tierflow"]
    notes = [f"tierflow's plan runs on {len(best.tiers)} tier(s): {' -> '.join(best.tiers)}"]
    mine = by_name["tierflow"]
    for other in ("edge-only", "cloud-only-jpeg", "cloud-only", "device-only"):
        theirs = by_name[other]
        same = best.tiers == estimates[other].tiers and best.codec == estimates[other].codec
        note = " (the same plan: the difference is measurement noise)" if same else ""
        ratio = theirs.percentile(50) / mine.percentile(50)
        lower = f"{ratio:.2f}x lower" if ratio >= 1 else f"{1 / ratio:.2f}x higher"
        notes.append(
            f"tierflow against {other}: p50 {mine.percentile(50):.1f} against "
            f"{theirs.percentile(50):.1f} ms ({lower}), {mine.throughput_rps:.1f} against "
            f"{theirs.throughput_rps:.1f} req/s{note}"
        )
    predicted = ", ".join(
        f"{run.name} {estimates[run.name].latency_s * 1e3:.1f} against {run.percentile(50):.1f}"
        for run in runs
    )
    notes.append(f"predicted against measured p50, ms: {predicted}")
    return notes


def _top1(model_path: Path, frames: np.ndarray) -> np.ndarray:
    """The exact model's top-1 class for each frame, in ONNX Runtime, in batches."""
    from tierflow.onnxrt.inference import open_session
    from tierflow.zoo.digits_camera import FRAME_INPUT, frame_tensor

    session = open_session(model_path)
    output = session.get_outputs()[0].name
    return np.concatenate(
        [
            np.argmax(session.run([output], {FRAME_INPUT: frame_tensor(frames[i : i + 32])})[0], 1)
            for i in range(0, len(frames), 32)
        ]
    )


def _exited_model(demo: Any) -> Path:
    """The demo model with calibrated early exits, made once next to the cached model."""
    from tierflow.partitioner.exits.add import add_exits
    from tierflow.partitioner.exits.metadata import read_exits

    sha = demo.meta.sha256.get("model.onnx", "")[:12]
    path = demo.directory / f"model-exits-{sha}.onnx"
    if path.is_file():
        exits = read_exits(path)
        print(f"  cached in {path}")
    else:
        exited = add_exits(demo.model_path, demo.calib_path)
        partial = path.with_suffix(".partial")
        exited.save(partial)
        partial.replace(path)
        exits = list(exited.exits)
        print(_indent(exited.table()))
    for info in exits:
        if info.threshold <= 1.0:
            print(f"  {info.name} after {info.at}: leaves when confidence >= {info.threshold:.3f}")
    return path


def _emulated_profiles(graph: Any, what: str) -> dict[str, Any]:
    """Profile ``graph`` once on this machine and derive each tier's emulated profile."""
    from tierflow.partitioner.profile import profile_model
    from tierflow.partitioner.report import Progress

    progress = Progress(f"  profiling the {what}")
    try:
        base = profile_model(graph, threads=1, progress=progress)
    finally:
        progress.close()
    return {tier: base.emulate(EMULATION[tier][1], threads=EMULATION[tier][0]) for tier in TIERS}


def _status_printer(text: str) -> None:
    print(f"  {text}", flush=True)


def _epoch_printer(report: Any) -> None:
    print(
        f"  epoch {report.epoch}/{report.epochs}: loss {report.loss:.3f}, "
        f"held-out accuracy {report.heldout_accuracy:.1%}",
        flush=True,
    )


def _indent(text: str) -> str:
    return "\n".join(f"  {line}" for line in text.splitlines())


def _run_strategy(
    run: StrategyRun,
    plan_dir: Path,
    links: Mapping[str, LinkSpec],
    frames: np.ndarray,
    labels: np.ndarray,
    exact_top1: np.ndarray,
    window: int,
    workdir: Path,
) -> None:
    """Start the edge and cloud processes this plan needs, stream the requests, stop them."""
    from tierflow.device.client import DeviceClient
    from tierflow.options import RuntimeOptions
    from tierflow.plan import load_plan
    from tierflow.zoo.digits_camera import frame_tensor

    plan = load_plan(plan_dir)
    needs = {s.tier for s in plan.segments} - {"device"}
    threads, slowdown = EMULATION["device"]
    options = RuntimeOptions(threads=threads, slowdown=slowdown, links=links)
    with ExitStack() as stack:
        edge = None
        if needs:
            cloud = stack.enter_context(serve_tier("cloud", plan_dir, None, workdir))
            edge = stack.enter_context(serve_tier("edge", plan_dir, cloud, workdir))
        input_name = plan.inputs[0]

        def requests() -> Iterator[dict[str, np.ndarray]]:
            return ({input_name: frame_tensor(frames[i : i + 1])} for i in range(len(frames)))

        # Latency pass: one request at a time, as a user waiting for each answer sees it.
        with DeviceClient(plan_dir, edge, options=options, window=1) as client:
            for i, result in enumerate(client.run_stream(requests())):
                _account(run, result, int(labels[i]), int(exact_top1[i]))
                _live(run, i + 1, len(labels))
        if sys.stdout.isatty():
            print(flush=True)
        # Throughput pass: many requests in flight, so the tiers work as a pipeline.
        with DeviceClient(plan_dir, edge, options=options, window=window) as client:
            started = time.perf_counter()
            count = sum(1 for r in client.run_stream(requests()) if r.ok)
            run.throughput_rps = count / (time.perf_counter() - started)


def _account(run: StrategyRun, result: Any, label: int, exact: int) -> None:
    if not result.ok:
        run.failed += 1
        logger.warning("[demo] request %s failed: %s", result.id, result.error)
        return
    run.answered += 1
    run.latencies_ms.append(result.ms["total"])
    scores = next(iter(result.outputs.values()))
    run.correct += int(np.argmax(scores) == label)
    run.agree += int(np.argmax(scores) == exact)
    for link, nbytes in result.bytes.items():
        run.bytes[link] = run.bytes.get(link, 0) + nbytes
    who = result.answered_by or "?"
    run.answered_by[who] = run.answered_by.get(who, 0) + 1
    if result.exit:
        run.exits += 1


def _live(run: StrategyRun, done: int, total: int) -> None:
    """Redraw one progress line on a terminal; elsewhere print a line every quarter."""
    tty = sys.stdout.isatty()
    if not tty and done != total and done % max(total // 4, 1) != 0:
        return
    width = 30
    filled = width * done // total
    bar = "#" * filled + "." * (width - filled)
    line = (
        f"  {run.name:<15} [{bar}] {done}/{total}  p50 {run.percentile(50):7.2f} ms  "
        f"accuracy {run.correct / max(run.answered, 1):6.1%}  failed {run.failed}"
    )
    sys.stdout.write(f"\r{line}" if tty else f"{line}\n")
    sys.stdout.flush()


def _result_rows(runs: Sequence[StrategyRun]) -> list[list[str]]:
    """One row of cells per strategy, under :data:`RESULT_HEADERS`."""
    rows = []
    for run in runs:
        n = max(run.answered, 1)
        who = ", ".join(f"{t} {c}" for t, c in sorted(run.answered_by.items()))
        if run.exits:
            who += f" ({run.exits} at an exit)"
        rows.append(
            [
                run.name,
                f"{run.correct / n:.1%}",
                f"{run.agree / n:.1%}",
                f"{run.percentile(50):.2f}",
                f"{run.percentile(95):.2f}",
                f"{run.throughput_rps:.1f}",
                f"{run.bytes.get('device-edge', 0) / n:,.0f}",
                f"{run.bytes.get('edge-cloud', 0) / n:,.0f}",
                who,
                str(run.failed),
            ]
        )
    return rows


def _results_table(runs: Sequence[StrategyRun]) -> str:
    from tierflow.cli.table import format_table

    return format_table(list(RESULT_HEADERS), _result_rows(runs))


def results_markdown(
    runs: Sequence[StrategyRun], notes: Sequence[str], links: Mapping[str, LinkSpec], window: int
) -> str:
    """What ``--results-md`` writes: the run's setting, the results table, the comparisons.

    The README embeds ``demos/demo-results.md`` written so, between markers, unchanged
    (``tests/demos/test_readme_results.py`` checks it).
    """
    requests = max((run.answered + run.failed for run in runs), default=0)
    setting = ", ".join(f"{name}={spec}" for name, spec in links.items())
    cells = [list(RESULT_HEADERS), ["---"] * len(RESULT_HEADERS), *_result_rows(runs)]
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    lines = [
        f"`tierflow demo`, {requests} held-out frames per strategy, links {setting}, "
        f"on {os.cpu_count()} cores, load average {load:.1f} at the end "
        f"({time.strftime('%Y-%m-%d', time.gmtime())}):",
        "",
        *("| " + " | ".join(row) + " |" for row in cells),
        "",
        f"{_legend(window)}.",
        "",
        *(f"- {note}" for note in notes),
    ]
    return "\n".join(lines) + "\n"


@contextmanager
def serve_tier(tier: str, plan_dir: Path, upstream: str | None, workdir: Path) -> Iterator[str]:
    """Run ``tierflow serve TIER`` as a child process; yield its address; stop it after."""
    threads, slowdown = EMULATION[tier]
    args = ["--threads", str(threads), "--slowdown", str(slowdown), "--link-emulation", "plan"]
    if upstream:
        args += ["--upstream", upstream]
    log = workdir / f"{plan_dir.name}-{tier}.log"
    with ServeProcess(tier, plan_dir, *args, log=log, timeout=SERVER_START_TIMEOUT_S) as server:
        print(f"  started {tier} (pid {server.pid}) on {server.address}")
        yield server.address
