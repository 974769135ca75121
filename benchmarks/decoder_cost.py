"""The decoder cost model against the runtime: predicted and measured TTFT, ms/token and bytes.

For each plan directory given (``tierflow plan`` on a decoder wrote it), this starts the
cloud and the edge as processes with the plan's emulation (``--slowdown``, ``--link-emulation
plan``) and runs ``generate`` on the device here the same way, greedy, then prints the
plan's prediction (``plan.json``'s ``estimate.decoder``) beside what the generations
measured, with the parts of a step: each tier's compute as the runtime timed it, and the
rest (links, propagation, gRPC). Under a loaded machine the compute is what drifts from
the profile; the links follow the model.

    python -m benchmarks.decoder_cost PLAN_DIR [PLAN_DIR ...] --prompt-tokens 32 \
        --max-tokens 32 --runs 3 --write benchmarks/results/DECODER_COST.md

Plans are made beforehand, for example for a Qwen2-shaped decoder (hidden 896, 4 blocks,
vocabulary 32,000; ``tierflow.zoo.hf_decoders``)::

    tierflow plan model.onnx -o plan3/ --context 512 --max-tokens 32 --prompt-tokens 32 \
        --memory device=200MiB --memory edge=150MiB --memory cloud=300MiB --codec raw
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.lib.decoder_estimates import predicted
from benchmarks.lib.report import load_average
from tierflow.device.client import DeviceClient
from tierflow.device.generation import Generator
from tierflow.link.spec import LINKS
from tierflow.options import RuntimeOptions
from tierflow.plan import load_plan
from tierflow.runtime.processes import ServeProcess

#: The planner's default emulation ([Note: emulating a slower tier]): what plans assume.
SLOWDOWN = {"device": 4.0, "edge": 2.0, "cloud": 1.0}


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def measure(plan_dir: Path, prompt: list[int], max_tokens: int, runs: int) -> dict[str, Any]:
    """Generations through the plan's tiers, emulated as the plan assumed."""
    plan = load_plan(plan_dir)
    tiers = {spec.tier for spec in plan.segments}
    emulate = ["--threads", "1", "--link-emulation", "plan"]
    reports, steps, prefills = [], [], []
    with ServeProcess("cloud", plan_dir, *emulate, "--slowdown", str(SLOWDOWN["cloud"])) as cloud:
        edge_args = [*emulate, "--slowdown", str(SLOWDOWN["edge"]), "--upstream", cloud.address]
        with ServeProcess("edge", plan_dir, *edge_args) as edge:
            options = RuntimeOptions(threads=1, slowdown=SLOWDOWN["device"], links=plan.links)
            for _ in range(runs):
                address = edge.address if tiers != {"device"} else None
                with DeviceClient(plan_dir, address, options=options) as client:
                    generator = Generator(client)
                    reports.append(generator.generate(prompt, max_tokens))
                prefills.append(generator.target.results[0])
                steps.extend(generator.target.results[1:])

    def parts(results: list[Any]) -> dict[str, float]:
        out = {t: _median([r.ms.get(t, 0.0) for r in results]) for t in ("device", "edge", "cloud")}
        out["network"] = _median([r.ms.get("network", 0.0) for r in results])
        return out

    return {
        "ttft_ms": _median([r.ttft_ms for r in reports]),
        "ms_per_token": _median([r.ms_per_token for r in reports]),
        "bytes_per_token": {
            link: _median([r.bytes_per_token.get(link, 0.0) for r in reports]) for link in LINKS
        },
        "tokens": reports[0].tokens,
        "same_tokens": all(r.tokens == reports[0].tokens for r in reports),
        "prefill_ms": parts(prefills),
        "step_ms": parts(steps),
    }


def _error(measured: float, want: float) -> str:
    return f"{(want - measured) / measured:+.0%}" if measured else "-"


def table(rows: list[tuple[str, dict[str, Any], dict[str, Any]]]) -> str:
    lines = [
        "| plan | TTFT ms predicted / measured (error) | ms/token predicted / measured (error) "
        "| B/token device-edge | B/token edge-cloud | step compute ms D/E/C predicted "
        "| measured | step network ms measured | ms/token, the model on the measured compute |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, want, got in rows:
        de, ec = (
            f"{want['bytes_per_token'][k]:.0f} / {got['bytes_per_token'][k]:.0f}" for k in LINKS
        )
        compute = "/".join(f"{want['step_ms'][t]:.1f}" for t in ("device", "edge", "cloud"))
        measured = "/".join(f"{got['step_ms'][t]:.1f}" for t in ("device", "edge", "cloud"))
        # The model's links and overheads with each tier's compute as the runtime timed it.
        links = want["ms_per_token"] - sum(want["step_ms"].values())
        recomposed = links + sum(got["step_ms"][t] for t in ("device", "edge", "cloud"))
        lines.append(
            f"| {name} | {want['ttft_ms']:.0f} / {got['ttft_ms']:.0f} "
            f"({_error(got['ttft_ms'], want['ttft_ms'])}) | {want['ms_per_token']:.1f} / "
            f"{got['ms_per_token']:.1f} ({_error(got['ms_per_token'], want['ms_per_token'])}) "
            f"| {de} | {ec} | {compute} | {measured} | {got['step_ms']['network']:.1f} "
            f"| {recomposed:.1f} ({_error(got['ms_per_token'], recomposed)}) |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("plans", nargs="+", type=Path)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--write", type=Path, help="append the table to this Markdown file")
    args = parser.parse_args(argv)
    rng = random.Random(1)
    prompt = [rng.randrange(args.vocab) for _ in range(args.prompt_tokens)]
    rows = []
    for plan_dir in args.plans:
        got = measure(plan_dir, prompt, args.max_tokens, args.runs)
        want = predicted(plan_dir, args.prompt_tokens, args.max_tokens)
        rows.append((plan_dir.name, want, got))
        print(json.dumps({"plan": str(plan_dir), "predicted": want, "measured": got}))
    text = table(rows)
    print(text)
    if args.write:
        load = load_average()[0]
        stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        with args.write.open("a") as out:
            out.write(
                f"\n### {stamp}, load {load:.1f} on {os.cpu_count()} cores; prompt "
                f"{args.prompt_tokens} tokens, {args.max_tokens} generated, greedy, "
                f"median of {args.runs} runs (bytes predicted / measured)\n\n{text}\n"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
