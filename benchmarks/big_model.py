"""A decoder of real size: Qwen2-0.5B's shapes, 2.5 GB of weights, planned, served and timed.

The benchmark builds the decoder from a ``transformers`` config with random weights and
exports it with optimum (:mod:`tierflow.zoo.hf_decoders`; the ``hf`` extra), then does as a
user would:

1. ``tierflow plan`` under ``/usr/bin/time -v`` with a phone-class device
   (``device=800MiB edge=1GiB cloud=1GiB``): planning's wall time and peak memory against
   the weights (goals: 15 minutes on 2 cores, 2.5x the weights: [Note: weights stay on
   disk] in partitioner/weights.py), the plan it chose, its bit-for-bit check; and the same
   command with budgets that leave one tier the whole model (cloud-only, device-only);
2. each plan served on three processes (``tierflow serve cloud``, ``serve edge``, and
   ``tierflow generate --json`` as the device), every one emulated as the plan assumed
   (``--threads 1``, ``--slowdown`` 4/2/1, ``--link-emulation plan``), greedy, ``--runs``
   times: time to first token, ms per token, tokens per second, bytes per token on each
   link and where a step's time goes (``parts_ms``), beside the plan's prediction
   (``plan.json``'s ``estimate.decoder``), and the tokens against the unsplit model's own.

Bytes per token are counted as ``generate --json`` counts them: what each link carried up,
the prompt's hidden states included, over the tokens made. The times are wall times on a
2-core machine: a tier's compute is what ONNX Runtime takes on one thread when it has a
core to itself, and the profile measures it so (thread CPU time); other work on the machine
stretches the measured times and not the predicted ones, so each run records the load
average, and the table gives the model's own figure with each tier's compute taken from the
runtime's timings ("model on measured compute") to tell the two apart.

Usage::

    python -m benchmarks.big_model [--work DIR] [--model MODEL.onnx]
                                   [--reuse-plans [LAYOUT ...]] [--runs 3]
                                   [--inline-model MODEL.onnx]

The export (about 6 minutes, 5.5 GB) is kept in ``--work`` and reused; ``--model`` takes
one made before. ``--reuse-plans`` serves the plans an earlier run left in
``--work/plans`` (with the planning figures it recorded) instead of planning again: all of
them, or the layouts named (``--reuse-plans cloud-only device-only`` plans the three-tier
split again and serves the other two as they are).
``--inline-model`` also plans a model whose weights are inside its ``.onnx`` file (under
2 GB), for planning's peak memory over its weights. It writes ``big_model.json`` and
``BIG_MODEL.md`` in the results folder beside it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks.lib import RESULTS as RESULTS_DIR
from benchmarks.lib.decoder_estimates import predicted as plan_estimate
from benchmarks.lib.report import load_average, load_span, load_words
from tierflow.link.spec import LINKS, TIERS
from tierflow.runtime.processes import ServeProcess
from tierflow.zoo.hf_decoders import QWEN2_0_5B, export_decoder

RESULTS = RESULTS_DIR / "big_model.json"
REPORT = RESULTS_DIR / "BIG_MODEL.md"
#: Each layout's memory budgets: a phone-class device, and one tier given the whole model.
LAYOUTS: dict[str, tuple[str, ...]] = {
    "three-tier": ("device=800MiB", "edge=1GiB", "cloud=1GiB"),
    "cloud-only": ("device=1MiB", "edge=1MiB", "cloud=8GiB"),
    "device-only": ("device=8GiB", "edge=1MiB", "cloud=1MiB"),
}
#: The planner's default emulation ([Note: emulating a slower tier]): what plans assume.
SLOWDOWN = {"device": 4.0, "edge": 2.0, "cloud": 1.0}
#: Seconds a server of a 2.5 GB segment gets to load it (the default is for small models).
START_TIMEOUT_S = 300.0


def timed(argv: list[str], log: Path) -> dict[str, Any]:
    """Run ``argv`` under ``/usr/bin/time -v``; its exit status, wall time and peak memory."""
    started = time.monotonic()
    with log.open("w") as out:
        done = subprocess.run(
            ["/usr/bin/time", "-v", *argv], stdout=out, stderr=subprocess.STDOUT, check=False
        )
    text = log.read_text()
    peak = re.search(r"Maximum resident set size \(kbytes\): (\d+)", text)
    return {
        "exit_status": done.returncode,
        "wall_s": round(time.monotonic() - started, 1),
        "peak_rss_bytes": int(peak.group(1)) * 1024 if peak else None,
        "load_before": load_average()[0],
    }


def weight_bytes(model: Path) -> int:
    """The model's files: the graph and, beside it, its external data (if any)."""
    return sum(p.stat().st_size for p in model.parent.glob(model.name + "*"))


def plan(
    model: Path, plan_dir: Path, budgets: Sequence[str], settings: Sequence[str], log: Path
) -> dict[str, Any]:
    """``tierflow plan`` as a user runs it: its figures, the plan chosen, its check.

    ``settings``: the decoder's flags (``--context``, ``--prompt-tokens``, ``--max-tokens``).
    """
    argv = [
        sys.executable, "-m", "tierflow.cli.main", "plan", str(model), "-o", str(plan_dir),
        *settings, "--json", *(f"--memory={b}" for b in budgets),
    ]  # fmt: skip
    run = timed(argv, log)
    record: dict[str, Any] = {**run, "argv": argv[2:], "budgets": list(budgets)}
    weights = weight_bytes(model)
    record["weight_bytes"] = weights
    if run["peak_rss_bytes"]:
        record["peak_over_weights"] = round(run["peak_rss_bytes"] / weights, 2)
    text = log.read_text()
    start = text.find("{\n")
    if run["exit_status"] != 0 or start < 0:
        record["last_line"] = text.strip().splitlines()[-1] if text.strip() else ""
        return record
    report = json.JSONDecoder().raw_decode(text[start:])[0]
    best = (report.get("ranked") or [{}])[0]
    keys = ("cuts", "codec", "ttft_s", "per_token_s", "tokens_per_s", "bytes_per_token")
    record["chosen"] = {key: best.get(key) for key in keys}
    record["predicted_baselines"] = {
        name: {key: e.get(key) for key in ("ttft_s", "per_token_s")}
        for name, e in (report.get("baselines") or {}).items()
    }
    record["verified"] = report.get("verified")
    record["notes"] = report.get("notes")
    record["files"] = {p.name: p.stat().st_size for p in sorted(plan_dir.iterdir())}
    return record


def predicted(plan_dir: Path, prompt_tokens: int, max_tokens: int) -> dict[str, Any]:
    """The plan's estimate, in the units ``generate --json`` measures (bytes per token as
    :func:`benchmarks.decoder_cost.predicted` counts them), with its tiers and tokens/s."""
    want = plan_estimate(plan_dir, prompt_tokens, max_tokens)
    segments = json.loads((plan_dir / "plan.json").read_text())["segments"]
    want["tiers"] = sorted({s["tier"] for s in segments}, key=TIERS.index)
    generation_ms = want["ttft_ms"] + (max_tokens - 1) * want["ms_per_token"]
    want["tokens_per_s"] = max_tokens * 1e3 / generation_ms
    return want


def generate(
    plan_dir: Path, edge: str | None, prompt: Sequence[int], max_tokens: int, log: Path
) -> dict[str, Any]:
    """One ``tierflow generate --json`` on the device, emulated as the plan assumed."""
    argv = [
        sys.executable, "-m", "tierflow.cli", "generate", "--plan", str(plan_dir),
        *(["--edge", edge] if edge else []), "--prompt-ids", ",".join(map(str, prompt)),
        "--max-tokens", str(max_tokens), "--threads", "1", "--slowdown",
        str(SLOWDOWN["device"]), "--link-emulation", "plan", "--json",
    ]  # fmt: skip
    load = load_average()[0]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=1800, check=False)
    log.write_text(done.stderr + done.stdout)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = done.stderr.strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(f"generate on {plan_dir} failed ({done.returncode}): {tail[0]}")
    report = json.loads(lines[-1])
    report["load_before"] = round(load, 2)
    report["load_after"] = load_average()[0]
    return report


def serve_and_generate(
    plan_dir: Path, tiers: Sequence[str], prompt: Sequence[int], max_tokens: int, runs: int,
    logs: Path,
) -> list[dict[str, Any]]:  # fmt: skip
    """``runs`` generations through the plan's tiers, each tier its own process."""
    emulate = ["--threads", "1", "--link-emulation", "plan"]
    name = plan_dir.name
    with contextlib.ExitStack() as stack:
        edge = None
        if set(tiers) != {"device"}:
            cloud = stack.enter_context(
                ServeProcess("cloud", plan_dir, *emulate, "--slowdown", str(SLOWDOWN["cloud"]),
                             log=logs / f"{name}-cloud.log", timeout=START_TIMEOUT_S)
            )  # fmt: skip
            edge = stack.enter_context(
                ServeProcess("edge", plan_dir, *emulate, "--slowdown", str(SLOWDOWN["edge"]),
                             "--upstream", cloud.address, log=logs / f"{name}-edge.log",
                             timeout=START_TIMEOUT_S)
            ).address  # fmt: skip
        return [
            generate(plan_dir, edge, prompt, max_tokens, logs / f"{name}-generate-{i}.log")
            for i in range(runs)
        ]


def _median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else 0.0


def measured(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Medians over the runs, as ``generate --json`` reported each."""

    def tokens_per_s(run: Mapping[str, Any]) -> float:
        count = len(run["tokens"])
        return count * 1e3 / (run["ttft_ms"] + (count - 1) * run["ms_per_token"])

    return {
        "ttft_ms": _median([r["ttft_ms"] for r in runs]),
        "ms_per_token": _median([r["ms_per_token"] for r in runs]),
        "tokens_per_s": _median([tokens_per_s(r) for r in runs]),
        "bytes_per_token": {
            link: _median([r["bytes_per_token"].get(link, 0.0) for r in runs]) for link in LINKS
        },
        "parts_ms": {
            point: {
                part: _median([r["parts_ms"][point][part] for r in runs])
                for part in runs[0]["parts_ms"][point]
            }
            for point in ("prefill", "step")
        },
        "same_tokens_every_run": all(r["tokens"] == runs[0]["tokens"] for r in runs),
        "tokens": runs[0]["tokens"],
        "load": [r["load_before"] for r in runs],
    }


def on_measured_compute(want: Mapping[str, Any], got: Mapping[str, Any], point: str) -> float:
    """The model's figure at ``point`` with each tier's compute as the runtime timed it:
    its links, round trips and answers kept, its profile's compute swapped out."""
    key = "ttft_ms" if point == "prefill" else "ms_per_token"
    rest = want[key] - sum(want[f"{point}_ms"].values())
    return rest + sum(got["parts_ms"][point][t] for t in TIERS)


def _ratio(got: float, want: float) -> str:
    return f"{got / want:.2f}x" if want else "-"


def table(serving: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Markdown: predicted against measured medians, and each layout against the split."""
    lines = [
        "| layout | tiers | TTFT ms predicted / measured (measured/predicted) "
        "| ms/token predicted / measured (ratio) | tokens/s predicted / measured "
        "| B/token device-edge predicted / measured | B/token edge-cloud "
        "| step compute ms D/E/C predicted | measured | TTFT / ms/token, model on measured "
        "compute (ratio) | same tokens as unsplit | load |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, row in serving.items():
        want, got = row["predicted"], row["measured"]
        bytes_ = [
            f"{want['bytes_per_token'][k]:.0f} / {got['bytes_per_token'][k]:.0f}" for k in LINKS
        ]
        compute_want = "/".join(f"{want['step_ms'][t]:.1f}" for t in TIERS)
        compute_got = "/".join(f"{got['parts_ms']['step'][t]:.1f}" for t in TIERS)
        model = on_measured_compute(want, got, "step")
        first = on_measured_compute(want, got, "prefill")
        lines.append(
            f"| {name} | {'+'.join(want['tiers'])} "
            f"| {want['ttft_ms']:.0f} / {got['ttft_ms']:.0f} "
            f"({_ratio(got['ttft_ms'], want['ttft_ms'])}) "
            f"| {want['ms_per_token']:.1f} / {got['ms_per_token']:.1f} "
            f"({_ratio(got['ms_per_token'], want['ms_per_token'])}) "
            f"| {want['tokens_per_s']:.2f} / {got['tokens_per_s']:.2f} | {bytes_[0]} | {bytes_[1]} "
            f"| {compute_want} | {compute_got} "
            f"| {first:.0f} ({_ratio(got['ttft_ms'], first)}) / "
            f"{model:.1f} ({_ratio(got['ms_per_token'], model)}) "
            f"| {row.get('same_as_unsplit')} | {', '.join(f'{x:.1f}' for x in got['load'])} |"
        )
    if "three-tier" in serving:
        split = serving["three-tier"]["measured"]
        want = serving["three-tier"]["predicted"]
        errors = [abs(split[k] / want[k] - 1) for k in ("ttft_ms", "ms_per_token")]
        lines.append(
            f"\nThe cost model's goal, TTFT and ms/token within 25% of what generate measures "
            f"on the three-tier plan: {'met' if max(errors) <= 0.25 else 'not met'} (off by "
            f"{errors[0]:.0%} and {errors[1]:.0%})."
        )
        for name, row in serving.items():
            if name == "three-tier":
                continue
            other = row["measured"]
            lines.append(
                f"\nthree-tier against {name}, measured: TTFT "
                f"{_ratio(split['ttft_ms'], other['ttft_ms'])}, ms/token "
                f"{_ratio(split['ms_per_token'], other['ms_per_token'])}, tokens/s "
                f"{_ratio(split['tokens_per_s'], other['tokens_per_s'])}"
            )
    return lines


def reference_tokens(model: Path, prompt: Sequence[int], max_tokens: int, context: int) -> list:
    """The unsplit model's greedy tokens, in one ONNX Runtime session as the tiers run."""
    from tierflow.greedy import reference_generate

    return list(reference_generate(model, prompt, max_tokens, context=context).tokens)


def markdown(result: Mapping[str, Any]) -> str:
    settings = result["settings"]
    planning = result["plans"].get("three-tier", {})
    lines = [
        "# A decoder of real size over three tiers (issue 27)",
        "",
        "`python -m benchmarks.big_model` (module docstring: what and how). Qwen2-0.5B's shapes",
        f"({result['model']['parameters'] / 1e6:.0f}M parameters, random weights, exported by "
        f"optimum; {result['weight_bytes'] / 1e9:.2f} GB of weights), `--context "
        f"{settings['context']}`, a prompt of {settings['prompt_tokens']} tokens, "
        f"{settings['max_tokens']} generated greedily, median of {settings['runs']} runs per "
        "layout; tiers emulated as planned (device 4x, edge 2x slower than one core here, "
        "links device-edge 20 Mbit/s 10 ms, edge-cloud 200 Mbit/s 30 ms, on all three "
        f"processes). Run {result['stamp']} on {result['cores']} cores, "
        f"{load_words(result.get('load_average'))}; each run's own in the last column.",
        "",
        f"Planning the three-tier split (`{' '.join(LAYOUTS['three-tier'])}`): "
        f"{planning.get('wall_s')} s, peak {(planning.get('peak_rss_bytes') or 0) / 1e9:.2f} GB "
        f"= {planning.get('peak_over_weights')}x the weights (goals: 900 s, 2.5x); "
        f"cuts {planning.get('chosen', {}).get('cuts')}, verified "
        f"{(planning.get('verified') or {}).get('bitwise_equal')} bit for bit.",
    ]
    inline = result.get("inline_model")
    if inline:
        lines.append(
            f"A model with its weights inside the file ({inline['weight_bytes'] / 1e9:.2f} GB): "
            f"{inline.get('wall_s')} s, peak {(inline.get('peak_rss_bytes') or 0) / 1e9:.2f} GB "
            f"= {inline.get('peak_over_weights')}x."
        )
    lines += ["", *table(result["serving"]), "", *READING, ""]
    return "\n".join(lines)


#: How to read the table, whatever the run measured.
READING = (
    "Reading it: bytes per token are counted on both sides as `generate --json` counts "
    "them (what each link carried up, the prompt's hidden states included, over the tokens "
    "made). The predicted compute is each tier's profile: ONNX Runtime on one thread, timed "
    "by the thread's CPU time, times the tier's slowdown; the measured one is wall time, "
    "which other work on the shared 2-core machine stretches (a tier emulated 2x or 4x "
    "slower sleeps for the rest, which load does not stretch, so the cloud shows load "
    "most). The column 'model on measured compute' keeps the model's links, round trips "
    "and answers and takes each tier's compute from the runtime's own timings "
    "(`parts_ms`): where it matches the measured time and the plain prediction does not, "
    "the gap is the machine's load, not the model.",
)


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.big_model", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--work", type=Path, default=Path("/tmp/tierflow-big-model"))
    parser.add_argument("--model", type=Path, help="an export made before (model.onnx)")
    parser.add_argument(
        "--reuse-plans",
        nargs="*",
        choices=tuple(LAYOUTS),
        metavar="LAYOUT",
        help="serve these layouts' plans already in --work/plans (no name: every one there) "
        "instead of planning them again",
    )
    parser.add_argument("--layouts", nargs="+", choices=tuple(LAYOUTS), default=list(LAYOUTS))
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--inline-model", type=Path, help="also plan this model (weights inside)")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    model = args.model or args.work / "qwen2" / "model.onnx"
    export: dict[str, Any] = {"reused": model.exists()}
    if not model.exists():
        started = time.monotonic()
        export_decoder(QWEN2_0_5B, model.parent)
        export["wall_s"] = round(time.monotonic() - started, 1)
    plans, logs = args.work / "plans", args.work / "logs"
    plans.mkdir(exist_ok=True)
    logs.mkdir(exist_ok=True)
    started_load = load_average()
    result: dict[str, Any] = {
        "stamp": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cores": os.cpu_count(),
        "model": {"shape": QWEN2_0_5B.to_dict(), "parameters": QWEN2_0_5B.parameters},
        "weight_bytes": weight_bytes(model),
        "export": export,
        "settings": {
            "context": args.context,
            "prompt_tokens": args.prompt_tokens,
            "max_tokens": args.max_tokens,
            "runs": args.runs,
            "slowdown": SLOWDOWN,
            "threads": 1,
            "link_emulation": "plan, on all three processes",
        },
        "plans": {},
        "serving": {},
    }
    settings = [
        "--context", str(args.context), "--prompt-tokens", str(args.prompt_tokens),
        "--max-tokens", str(args.max_tokens),
    ]  # fmt: skip
    for name in args.layouts:
        plan_dir, record = plans / name, plans / f"{name}.json"
        reuse = args.reuse_plans is not None and (not args.reuse_plans or name in args.reuse_plans)
        if reuse and record.exists() and (plan_dir / "plan.json").exists():
            result["plans"][name] = {**json.loads(record.read_text()), "reused": True}
            continue
        print(f"planning {name} ...", flush=True)
        figures = plan(model, plan_dir, LAYOUTS[name], settings, logs / f"plan-{name}.log")
        record.write_text(json.dumps(figures, indent=2) + "\n")
        result["plans"][name] = figures
        if figures["exit_status"] != 0:
            print(f"planning {name} failed: {figures.get('last_line')}", file=sys.stderr)
    if args.inline_model:
        inline_dir = args.work / "inline-plan"
        result["inline_model"] = plan(
            args.inline_model, inline_dir, LAYOUTS["three-tier"], settings,
            logs / "plan-inline.log",
        )  # fmt: skip
    rng = random.Random(1)
    prompt = [rng.randrange(QWEN2_0_5B.vocab) for _ in range(args.prompt_tokens)]
    for name in args.layouts:
        plan_dir = plans / name
        if not (plan_dir / "plan.json").exists():
            continue
        want = predicted(plan_dir, args.prompt_tokens, args.max_tokens)
        print(f"serving {name} ({'+'.join(want['tiers'])}) ...", flush=True)
        runs = serve_and_generate(plan_dir, want["tiers"], prompt, args.max_tokens, args.runs, logs)
        result["serving"][name] = {"predicted": want, "measured": measured(runs), "runs": runs}
    if result["serving"]:
        reference = reference_tokens(model, prompt, args.max_tokens, args.context)
        result["reference_tokens"] = reference
        for row in result["serving"].values():
            row["same_as_unsplit"] = all(r["tokens"] == reference for r in row["runs"])
    result["load_average"] = load_span(started_load)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    text = markdown(result)
    REPORT.write_text(text)
    print(text)
    failed = any(p.get("exit_status") for p in result["plans"].values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
