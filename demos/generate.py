"""``tierflow demo --generate``: a decoder family across device, edge and cloud, streaming text.

What it does, in order (each step prints what it measured):

1. builds the byte decoder family once (three byte-level decoders, one trunk read out
   after 2, 4 and 8 blocks, trained in about a minute on this Python's standard library;
   ``tierflow.zoo.bytelm_family``), then reuses the cached copy;
2. profiles the large and the small model here, emulating the demo's three tiers, and
   plans the large one for the links under a memory budget per tier that no tier can
   hold it in ([Note: where the byte family splits] in :mod:`.generation_setup`);
3. computes the large model's own greedy output for a held-out prompt, unsplit;
4. runs four strategies, streaming each one's text as it arrives: cloud-only (the large
   model in the cloud), device-only (the small model on the device), the planner's split
   of the large model, and the split with the small model drafting on the device
   ([Note: speculation] in device/speculation.py). The cloud and the edge run as
   two real processes for each plan; this process is the device;
5. ends with one table measured in the same run: time to first token, ms per token,
   tokens per second, round trips and bytes per token per link, drafts kept, and
   agreement with the large model's greedy output, computed token by token.
"""

from __future__ import annotations

import contextlib
import functools
import json
import sys
from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any, TextIO

from tierflow.demos import generation_setup as setup
from tierflow.demos.local import serve_tier
from tierflow.link.spec import LINKS, LinkSpec
from tierflow.units import format_size

STEPS = 5
#: The columns of the results table.
HEADERS = (
    "strategy",
    "model",
    "tiers",
    "blocks",
    "TTFT ms",
    "ms/token",
    "tokens/s",
    "round trips/token",
    "device-edge B/token",
    "edge-cloud B/token",
    "drafts kept",
    "agrees",
)


def run_generate_demo(
    links: Mapping[str, LinkSpec],
    workdir: Path,
    *,
    prompts: int,
    max_tokens: int,
    as_json: bool,
) -> int:
    """The demo's five steps; with ``as_json`` one JSON object on stdout, the rest on stderr.

    Returns 0 when every strategy ran and every row of the large model agreed with its
    greedy output on every token, else 1.
    """
    if as_json:
        with contextlib.redirect_stdout(sys.stderr):
            report = _demo(links, workdir, prompts, max_tokens, sys.stderr)
        print(json.dumps(report))
    else:
        report = _demo(links, workdir, prompts, max_tokens, sys.stdout)
    rows = report["strategies"]
    exact = all(r["agreement"] == 1.0 for r in rows if r["model"] == "large")
    return 0 if exact and len(rows) == len(setup.STRATEGIES) else 1


def plan_table(plans: setup.FamilyPlans) -> str:
    """The large model's ranked plans, as ``tierflow plan`` prints a decoder's: with the
    ``blocks`` column, the blocks (KV layers) each tier holds (``D- E0-3 C4-7``)."""
    from tierflow.partitioner.report import decoder_table

    return decoder_table(plans.large, plans.budgets, plans.large_blocks)


def _step(number: int, text: str) -> None:
    print(f"\n[{number}/{STEPS}] {text}", flush=True)


def _demo(
    links: Mapping[str, LinkSpec], workdir: Path, count: int, max_tokens: int, out: TextIO
) -> dict[str, Any]:
    from tierflow.partitioner.report import Progress
    from tierflow.tuning import tune_for_latency
    from tierflow.zoo.byte_corpus import decode
    from tierflow.zoo.bytelm_family import agreement_table, build_family

    _step(1, "decoder family: three byte-level decoders trained on the standard library")
    family = build_family(status=lambda text: print(f"  {text}", flush=True))
    if not family.built:
        print(f"  cached in {family.directory}")
    print(_indent(agreement_table(family.meta)))

    _step(2, "planning the large model for " + ", ".join(f"{n} {links[n]}" for n in LINKS))
    for tier, (threads, slowdown) in setup.EMULATION.items():
        print(f"  {tier:<6} {threads} thread, {slowdown:g}x slower than this machine")
    budgets = setup.budgets()
    print(
        "  memory per tier for a session: "
        + ", ".join(f"{t} {format_size(v)}" for t, v in budgets.items())
        + f"; context {setup.CONTEXT} tokens"
    )
    progress = Progress("  profiling the large and the small model")
    try:
        plans = setup.plan_family(family, links, workdir, progress=progress)
    finally:
        progress.close()
    print(_indent(plan_table(plans)))
    for name in setup.STRATEGIES[:3]:
        estimate = plans.estimate(name)
        print(
            f"  {name} plan: {' -> '.join(estimate.tiers)}, predicted TTFT "
            f"{estimate.ttft_s * 1e3:.1f} ms, {estimate.per_token_s * 1e3:.1f} ms per token"
            + ("" if estimate.feasible else " (over the memory budget: a comparison only)")
        )

    _step(3, f"the large model's own greedy output for {count} held-out prompt(s), unsplit")
    prompts = setup.heldout_prompts(count)
    references = setup.references(family, prompts, max_tokens)
    print(f"  prompt: {decode(prompts[0])!r}")
    print(f"  large model, greedy: {decode(references[0])!r}")

    _step(4, f"generating {max_tokens} tokens per prompt with each strategy")
    tune_for_latency()  # this process is the device, as in `tierflow generate`
    runs = _run_all(plans, family, links, workdir, prompts, references, max_tokens, out)

    _step(5, "results, measured side by side in this run")
    rows = [run.to_dict() for run in runs]
    print(_indent(results_table(rows)))
    notes = comparisons(rows, plans, family.meta)
    for note in notes:
        print(f"  {note}")
    return {
        "links": {name: str(spec) for name, spec in links.items()},
        "memory_budget": dict(budgets),
        "context": setup.CONTEXT,
        "max_tokens": max_tokens,
        "prompts": [decode(p) for p in prompts],
        "reference": [decode(r) for r in references],
        "strategies": rows,
        "notes": notes,
    }


def _run_all(
    plans: setup.FamilyPlans,
    family: Any,
    links: Mapping[str, LinkSpec],
    workdir: Path,
    prompts: Sequence[Sequence[int]],
    references: Sequence[Sequence[int]],
    max_tokens: int,
    out: TextIO,
) -> list[setup.GenerationRun]:
    """Each strategy on its plan's tiers (the split's processes serve both split rows)."""
    from tierflow.device.client import DeviceClient
    from tierflow.options import RuntimeOptions

    threads, slowdown = setup.EMULATION["device"]
    options = RuntimeOptions(threads=threads, slowdown=slowdown, links=links)
    runs = []
    for name in setup.STRATEGIES:
        if name == "split+draft":
            continue  # runs beside the split, on the same processes
        with ExitStack() as stack:
            edge = None
            plan_dir = plans.plan_dir(name)
            if name != "device-only":
                cloud = stack.enter_context(serve_tier("cloud", plan_dir, None, workdir))
                edge = stack.enter_context(serve_tier("edge", plan_dir, cloud, workdir))
            for strategy in (name, "split+draft") if name == "split" else (name,):
                draft = family.path("small") if strategy == "split+draft" else None
                run = setup.GenerationRun(strategy, setup.MODEL_OF[strategy])
                with DeviceClient(
                    plan_dir, edge, options=options, window=1, adaptive=False
                ) as client:
                    setup.measure(
                        run,
                        client,
                        prompts,
                        references,
                        max_tokens,
                        draft=draft,
                        on_token=functools.partial(_stream_first, strategy, out),
                    )
                print(file=out, flush=True)
                runs.append(run)
    order = {name: i for i, name in enumerate(setup.STRATEGIES)}
    return sorted(runs, key=lambda run: order[run.strategy])


def _stream_first(strategy: str, out: TextIO, prompt: int) -> setup.TokenHook | None:
    """The first prompt's generation is streamed; the others run quietly."""
    return _streamer(strategy, out) if prompt == 0 else None


def _streamer(strategy: str, out: TextIO) -> setup.TokenHook:
    """Writes a generation's text as its tokens arrive, continuation lines indented."""
    from tierflow.zoo.byte_corpus import StreamDecoder

    decoder = StreamDecoder()
    label = f"  {strategy:<12}| "
    out.write(label)
    out.flush()

    def write(token: int, draft_only: bool) -> None:
        text = decoder.feed(token)
        out.write(text.replace("\n", "\n" + " " * (len(label) - 2) + "| "))
        out.flush()

    return write


def result_rows(rows: Sequence[Mapping[str, Any]]) -> list[list[str]]:
    """One row of cells per strategy, under :data:`HEADERS`."""
    from tierflow.device.generation import layer_ranges

    cells = []
    for row in rows:
        figures = setup.figure_cells(row)
        cells.append(
            [
                row["strategy"],
                row["model"],
                " -> ".join(row["tiers"]),
                layer_ranges(row["blocks"]) or "-",
                *(figures[header] for header in HEADERS[4:]),
            ]
        )
    return cells


def results_table(rows: Sequence[Mapping[str, Any]]) -> str:
    from tierflow.cli.table import format_table

    return format_table(list(HEADERS), result_rows(rows))


def comparisons(
    rows: Sequence[Mapping[str, Any]], plans: setup.FamilyPlans, meta: Mapping[str, Any]
) -> list[str]:
    """The rows against each other and against the planner's predictions, as sentences."""
    by = {row["strategy"]: row for row in rows}
    split, draft, cloud = by["split"], by["split+draft"], by["cloud-only"]
    notes = [
        "agrees: tokens equal to the large model's own greedy output (unsplit, computed "
        "here) at the same position; tokens/s over the whole generation, first token "
        "included; blocks: the layers whose KV cache each tier keeps",
    ]
    if draft["tokens_per_s"] and split["tokens_per_s"] and draft["round_trips_per_token"]:
        notes.append(
            f"split+draft against split: {draft['tokens_per_s'] / split['tokens_per_s']:.2f}x "
            f"the tokens per second, "
            f"{split['round_trips_per_token'] / draft['round_trips_per_token']:.2f}x fewer "
            f"round trips per token, {draft['acceptance'] or 0:.0%} of the drafts kept"
        )
    if split["ms_per_token"] and cloud["ms_per_token"]:
        ratio = split["ms_per_token"] / cloud["ms_per_token"]
        held = plans.estimate("split").memory_bytes
        notes.append(
            f"split against cloud-only: {ratio:.2f}x its ms per token, with no tier holding "
            "more than "
            + format_size(max(held[t] for t in plans.estimate("split").tiers))
            + " (planned) where cloud-only holds "
            + format_size(plans.estimate("cloud-only").memory_bytes["cloud"])
            + " in the cloud"
        )
    small = by["device-only"]
    heldout = meta.get("agreement", {}).get("small_vs_large")
    notes.append(
        f"device-only (the small model alone) agrees with the large model on "
        f"{small['agreement']:.0%} of the tokens here; once one differs the texts part. "
        + (
            f"On the large model's own continuations of held-out prompts it picks the same "
            f"next byte {heldout:.0%} of the time: the chance that a draft is kept once those "
            "before it were, there"
            if heldout is not None
            else ""
        )
    )
    predicted = ", ".join(
        f"{name} {plans.estimate(name).per_token_s * 1e3:.1f} against "
        f"{setup.figure_cells(by[name])['ms/token']}"
        for name in ("cloud-only", "device-only", "split")
    )
    notes.append(f"predicted against measured ms per token: {predicted}")
    return notes


def _indent(text: str) -> str:
    return "\n".join(f"  {line}" for line in text.splitlines())
