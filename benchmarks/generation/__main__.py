"""Generation benchmark: a decoder split over three tiers, with and without drafts, over links.

    python -m benchmarks.generation            # RTT 5-100 ms x 1-100 Mbit/s (~15 min)
    python -m benchmarks.generation --quick    # RTT 5 and 30 ms at 10 Mbit/s (~2 min)

The byte decoder family (``tierflow.zoo.bytelm_family``: small, medium and large, one
trunk read out after 2, 4 and 8 blocks, trained once on the standard library) is planned
as ``tierflow demo --generate`` plans it (``tierflow.demos.generation_setup``: the demo's
emulated tiers, device 20x, edge 2x, cloud 1x slower than one core here; 2 MiB of memory
per tier for a session, which no tier can hold the large model in, so the planner splits
it over all three; context 512). Four strategies generate greedily from held-out
prompts (the standard library's own sources, never trained on): cloud-only (the large
model in the cloud), device-only (the small model on the device), the planner's split of
the large model, and the split with the small model drafting on the device
(``--draft-tokens auto``). The cloud and the edge run in this process
(a cloud and an edge ``TierServer``, each with its slowdown), so that each tier's session
state can be read (``pipeline.states.nbytes``); the device-edge link is emulated at every
point of the grid (``RuntimeOptions(links=...)``), the edge-cloud link stays the demo's
200 Mbit/s, 20 ms.

Per strategy and link: time to first token (median over prompts), ms per token after
it (mean), tokens per second (all tokens over all generations' time), round trips per
token (requests that crossed the device-edge link), bytes per token on each link (what
the requests carried up, prefill included; greedy answers come back as the large
model's choices, not its logits), drafts kept (of all drafted), the acceptance rate (drafts
kept of those the large model judged: a draft after a rejection is never judged, and this
is the rate speculative decoding's papers quote and ``auto`` plans with), and agreement
with the large model's own greedy output, unsplit, computed token by token. Memory per
tier: the weights of the segment it runs (the draft's too, on the device) plus the KV
cache it held at the end of a generation, and that cache at the planned context (the
bytes per token held, times the context), against the budget the plan was made for. The
goals are judged by ``generation.report.verdict`` on the rows of this one run.
"""

from __future__ import annotations

import os

# The tiers run in this process: gRPC's C-core notices stay out of the output, as the CLI
# keeps them out of a tier's log; set before grpc is first imported.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

import argparse
import datetime
import json
import logging
import platform
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks.generation import report
from benchmarks.lib import RESULTS
from benchmarks.lib.report import load_average, load_span, load_words, replace_section
from tierflow.cli.table import format_table
from tierflow.demos import generation_setup as setup
from tierflow.link.spec import LinkSpec
from tierflow.options import RuntimeOptions

DOC = RESULTS / "GENERATION.md"
EDGE_CLOUD = "200mbit,20ms"


def grid(quick: bool) -> list[tuple[float, float]]:
    """(device-edge RTT ms, Mbit/s) points, in order."""
    if quick:
        return [(5.0, 10.0), (30.0, 10.0)]
    return [(rtt, rate) for rate in (1.0, 10.0, 100.0) for rtt in (5.0, 15.0, 30.0, 60.0, 100.0)]


def _options(tier: str, links: Mapping[str, LinkSpec]) -> RuntimeOptions:
    threads, slowdown = setup.EMULATION[tier]
    return RuntimeOptions(threads=threads, slowdown=slowdown, links=links, workers=2)


def segment_weights(plan_dir: Path) -> dict[str, int]:
    """Bytes of initializers in each tier's segment files."""
    import onnx
    from onnx import numpy_helper

    from tierflow.plan import load_plan

    held: dict[str, int] = {}
    for spec in load_plan(plan_dir).segments:
        model = onnx.load(str(plan_dir / spec.file))
        size = sum(numpy_helper.to_array(i).nbytes for i in model.graph.initializer)
        held[spec.tier] = held.get(spec.tier, 0) + int(size)
    return held


def model_weights(path: Path) -> int:
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(path))
    return int(sum(numpy_helper.to_array(i).nbytes for i in model.graph.initializer))


class MemoryProbe:
    """Reads each tier's session state once a generation ends, then drops it there."""

    def __init__(
        self, weights: Mapping[str, int], planned: Mapping[str, int], context: int
    ) -> None:
        self.weights = dict(weights)
        self.planned = dict(planned)
        self.context = context
        self.tiers: dict[str, Any] = {}  # tier -> its Pipeline
        self.held: dict[str, dict[str, int | None]] = {}

    def __call__(self, generator: Any) -> None:
        session = generator.target.session
        positions = len(generator.target.fed)
        kv = {tier: pipeline.states.nbytes for tier, pipeline in self.tiers.items()}
        kv["device"] = kv.get("device", 0)
        weights = dict(self.weights)
        if generator.draft is not None:
            kv["device"] += generator.draft.state_bytes
            weights["device"] = weights.get("device", 0) + model_weights(generator.draft.path)
        for pipeline in self.tiers.values():
            pipeline.states.drop(session)
        if self.held:
            return  # the first prompt's figures stand for the run
        for tier in sorted(set(weights) | set(kv), key=("device", "edge", "cloud").index):
            at_context = kv.get(tier, 0) / max(positions, 1) * self.context
            self.held[tier] = {
                "weights": weights.get(tier, 0),
                "kv": kv.get(tier, 0),
                "positions": positions,
                "kv_at_context": int(at_context),
                "at_context": int(weights.get(tier, 0) + at_context),
                "planned": self.planned.get(tier),
            }


def run_strategy(
    strategy: str,
    plans: setup.FamilyPlans,
    family: Any,
    links: Mapping[str, LinkSpec],
    prompts: Sequence[Sequence[int]],
    references: Sequence[Sequence[int]],
    max_tokens: int,
) -> dict[str, Any]:
    """One strategy at one link, on in-process tiers started for it and stopped after."""
    from tierflow.device.client import DeviceClient
    from tierflow.edge.forwarding import Forwarding
    from tierflow.runtime.server import TierServer

    plan_dir = plans.plan_dir(strategy)
    estimate = plans.estimate(strategy)
    probe = MemoryProbe(segment_weights(plan_dir), estimate.memory_bytes, setup.CONTEXT)
    draft = family.path("small") if strategy == "split+draft" else None
    run = setup.GenerationRun(strategy, setup.MODEL_OF[strategy])
    cloud = edge = None
    try:
        if strategy != "device-only":
            cloud = TierServer.from_plan("cloud", plan_dir, options=_options("cloud", links))
            cloud.start()
            edge = TierServer.from_plan(
                "edge",
                plan_dir,
                forwarder=Forwarding(cloud.address),
                options=_options("edge", links),
            )
            edge.start()
            probe.tiers = {"edge": edge.tier.pipeline, "cloud": cloud.tier.pipeline}
        draft_s = 0.0

        def after(generator: Any) -> None:
            nonlocal draft_s
            probe(generator)
            if generator.draft is not None:
                draft_s += generator.draft.seconds

        with DeviceClient(
            plan_dir,
            edge.address if edge is not None else None,
            options=_options("device", links),
            window=1,
            adaptive=False,
        ) as client:
            probe.tiers["device"] = client.pipeline
            setup.measure(run, client, prompts, references, max_tokens, draft=draft, after=after)
    finally:
        if edge is not None:
            edge.stop(0)
        if cloud is not None:
            cloud.stop(0)
    row = run.to_dict()
    row["rounds"] = run.round_trips - len(prompts)  # each prompt's prefill is one
    row["draft_s"] = draft_s
    row["memory"] = probe.held
    row["predicted_ms_per_token"] = estimate.per_token_s * 1e3
    return row


def measure_all(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    from tierflow.zoo.bytelm_family import build_family

    family = build_family(status=lambda text: print(f"[bench] {text}", flush=True))
    plan_links = {n: LinkSpec.parse(t) for n, t in setup.DEFAULT_LINKS.items()}
    print(f"[bench] planning for {setup.DEFAULT_LINKS}, 2 MiB a tier", flush=True)
    plans = setup.plan_family(family, plan_links, workdir, max_tokens=args.max_tokens)
    prompts = setup.heldout_prompts(args.prompts)
    references = setup.references(family, prompts, args.max_tokens)
    rows: list[dict[str, Any]] = []
    alone = run_strategy(
        "device-only", plans, family, plan_links, prompts, references, args.max_tokens
    )
    rows.append({**alone, "rtt_ms": None, "mbit": None})
    for rtt, mbit in grid(args.quick):
        links = {
            "device-edge": LinkSpec.parse(f"{mbit:g}mbit,{rtt:g}ms"),
            "edge-cloud": LinkSpec.parse(EDGE_CLOUD),
        }
        for strategy in ("cloud-only", "split", "split+draft"):
            began = time.perf_counter()
            row = run_strategy(strategy, plans, family, links, prompts, references, args.max_tokens)
            rows.append({**row, "rtt_ms": rtt, "mbit": mbit})
            print(
                f"[bench] {rtt:g} ms, {mbit:g} Mbit/s, {strategy}: "
                f"{row['ms_per_token']:.1f} ms/token, {row['tokens_per_s']:.1f} tokens/s, "
                f"agrees {row['agreement']:.0%} ({time.perf_counter() - began:.0f} s)",
                flush=True,
            )
    split = plans.estimate("split")
    return {
        "benchmark": "generation",
        "quick": args.quick,
        "family": {k: family.meta[k] for k in ("models", "agreement", "train_seconds")},
        "plan": {
            "links": dict(setup.DEFAULT_LINKS),
            "tiers": list(split.tiers),
            "cuts": list(split.cuts),
            "memory_bytes": dict(split.memory_bytes),
            "predicted_ttft_ms": split.ttft_s * 1e3,
            "predicted_ms_per_token": split.per_token_s * 1e3,
        },
        "budgets": dict(plans.budgets),
        "context": setup.CONTEXT,
        "max_tokens": args.max_tokens,
        "prompts": [bytes(p).decode("utf-8", "replace") for p in prompts],
        "edge_cloud": EDGE_CLOUD,
        "emulation": {t: {"threads": th, "slowdown": s} for t, (th, s) in setup.EMULATION.items()},
        "rows": rows,
    }


def markdown(results: Mapping[str, Any]) -> str:
    """GENERATION.md: how it was measured, the verdict, every row, memory per tier."""
    method = (__doc__ or "").split("\n\n", 2)[2].strip()
    plan = results["plan"]
    lines = [
        "# Generation benchmark",
        "",
        f"Generated by `{results['command']}` on {results['date']} ({results['machine']}, "
        f"{results['seconds']:.0f} s, {load_words(results['load_average'])}); data in "
        "`generation.json`.",
        "",
        method,
        "",
        f"The split: {' -> '.join(plan['tiers'])} at cuts {plan['cuts']}, planned for "
        f"{plan['links']}: predicted time to first token {plan['predicted_ttft_ms']:.1f} ms "
        f"and {plan['predicted_ms_per_token']:.1f} ms per token. Prompts "
        f"({len(results['prompts'])}, {results['max_tokens']} tokens each): "
        + "; ".join(f"`{p!r}`" for p in results["prompts"]),
        "",
        "## Verdict",
        "",
        *report.verdict_lines(results["verdict"]),
        "",
        "## Every run",
        "",
        *report.markdown_table(report.HEADERS, report.table_rows(results["rows"])),
        "",
        *reading_notes(results),
        "",
        "## Memory per tier",
        "",
        "The first prompt's figures at the first link measured (the same plans at every link):",
        "",
        *report.markdown_table(
            report.MEMORY_HEADERS, report.memory_rows(results["rows"], results["budgets"])
        ),
        "",
        f"![tokens per second and time to first token]({results['figure']})",
        "",
    ]
    return "\n".join(lines)


def reading_notes(results: Mapping[str, Any]) -> list[str]:
    """What the table's figures count, and what the time to first token is made of."""
    prompt = len(results["prompts"][0].encode("utf-8")) if results["prompts"] else 0
    logits = prompt * 256 * 4  # the prefill's answer: float32 logits at every position
    rates = sorted({r["mbit"] for r in results["rows"] if r["mbit"] is not None})
    return [
        "Bytes per token are what the requests carried up each link, prefill included "
        "(hidden states and their companions, or token ids), over the tokens generated; "
        "the answers coming down (a step's logits, 1 KiB a position) are not in them. "
        f"They are why the time to first token grows as the rate falls: the prefill's "
        f"answer holds the logits of all {prompt} prompt positions ({logits / 1024:.0f} KiB), "
        "of which generation uses the last, and it crosses the device-edge link down at "
        "its rate: "
        + ", ".join(f"{logits * 8 / (m * 1e6) * 1e3:.0f} ms at {m:g} Mbit/s" for m in rates)
        + ".",
    ]


def render(results: dict[str, Any], out: Path) -> None:
    """The plot, GENERATION.md and RESULTS.md's section (for the committed folder), tables."""
    figure = out / "generation.png"
    report.plot(results["rows"], figure)
    committed = out.resolve() == RESULTS.resolve()
    results["figure"] = figure.name if committed else str(figure)
    (out / "generation.json").write_text(json.dumps(results, indent=1) + "\n")
    if committed:
        DOC.write_text(markdown(results))
        replace_section(
            RESULTS / "RESULTS.md",
            report.SECTION_START,
            report.SECTION_END,
            report.results_section(results),
        )
    else:
        (out / "GENERATION.md").write_text(markdown(results))
    print(format_table(list(report.HEADERS), report.table_rows(results["rows"])))
    print()
    print(
        format_table(
            list(report.MEMORY_HEADERS), report.memory_rows(results["rows"], results["budgets"])
        )
    )
    print("\n" + report.summary(results))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.generation",
        description=(__doc__ or "").splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="two links, one prompt, 32 tokens")
    parser.add_argument("--out", type=Path, default=RESULTS, help="JSON and plot folder")
    parser.add_argument("--prompts", type=int, default=None, help="prompts (default 3, quick 1)")
    parser.add_argument("--max-tokens", type=int, default=None, help="default 64, quick 32")
    parser.add_argument(
        "--render", action="store_true", help="measure nothing: redraw from OUT/generation.json"
    )
    args = parser.parse_args(argv)
    args.prompts = args.prompts or (1 if args.quick else 3)
    args.max_tokens = args.max_tokens or (32 if args.quick else 64)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.render:
        results = json.loads((args.out / "generation.json").read_text())
        results["verdict"] = report.verdict(results["rows"], results["budgets"])
        render(results, args.out)
        return 0
    started, load = time.perf_counter(), load_average()
    with tempfile.TemporaryDirectory(prefix="tierflow-gen-bench-") as workdir:
        results = measure_all(args, Path(workdir))
    command = "python -m benchmarks.generation" + (" --quick" if args.quick else "")
    results.update(
        command=command,
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        machine=f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        seconds=time.perf_counter() - started,
        load_average=load_span(load),
    )
    results["verdict"] = report.verdict(results["rows"], results["budgets"])
    render(results, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
