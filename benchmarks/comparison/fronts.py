"""Rate-fidelity fronts on the trained models, and where a split plan pays.

Pure functions of results.json rows (plus one plotting function), so ``comparison/run.py`` and
``comparison/run.py --refold`` draw the same thing from the same rows:

- :func:`front`: at one model and rate, every row as a point (fidelity, composed p50):
  tierflow's plans under each budget (``tierflow``, exact; ``tierflow-budget``, top1=99%;
  ``-98``, ``-95``, ``-90``), the uploads (raw, ``int8+zstd``, JPEG quality 5-95, WebP,
  PNG) and device-only; a point is on the front when no other is at least as faithful
  and faster.
- :func:`where_splits_pay`: per model, device speed and rate, tierflow's fastest *split*
  plan (the device runs part of the model and sends a feature) against the fastest upload
  at least as faithful, and against ``cloud-only-jpeg`` (q90) where that is no more
  faithful than the split. Other device speeds are composed from the same measurements
  (:func:`at_device_speed`: the device's share of a row scaled), for the plans chosen for
  the benchmark's device; a planner told of another device might choose other plans, so
  these ratios are what those plans give, not the best possible.

Only rows with trained weights are used: a random network's top-1 says nothing about
what a codec does to a trained one.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.lib.report import ms

Row = dict[str, Any]

#: tierflow's plans on the fronts (the exits rows run another workload).
TIERFLOW_PLANS = (
    "tierflow",
    "tierflow-budget",
    "tierflow-budget-100",
    "tierflow-budget-98",
    "tierflow-budget-95",
    "tierflow-budget-90",
    "tierflow-split",
    "tierflow-bottleneck",
    "tierflow-lowbit",
)
#: Device speeds (times slower than this machine's core) the split table is composed at;
#: the benchmark's own device is 10x (``lib.emulation``).
DEVICE_SLOWDOWNS = (2.0, 5.0, 10.0, 20.0)
BENCH_SLOWDOWN = 10.0
#: Rates the fronts are drawn at (the issue's 1-50 Mbit/s).
FRONT_MBIT = (1.0, 5.0, 20.0, 50.0)
EPS = 1e-12


def kind(row: Row) -> str:
    """``tierflow``, ``upload`` (the input sent as it is or as an image), ``device-only`` or
    ``other`` (single-split, exits)."""
    name = row["strategy"]
    if name in TIERFLOW_PLANS:
        return "tierflow"
    if name == "device-only":
        return "device-only"
    if name.startswith("cloud-only"):
        return "upload"
    return "other"


def is_split(row: Row) -> bool:
    """Whether the device runs part of the model and sends a feature (not the input, not
    the answer)."""
    if row["strategy"] in ("tierflow-bottleneck", "tierflow-lowbit"):
        return True
    cuts = row.get("cuts") or [0, 0]
    last = row.get("last_cut")
    return cuts[0] > 0 and (last is None or cuts[0] < last)


def at_device_speed(row: Row, slowdown: float, base: float = BENCH_SLOWDOWN) -> float | None:
    """The row's p50 on a device ``slowdown`` times slower than this machine instead of
    ``base``: its device share (``device_ms_here``, measured here) scaled. None when the
    row does not carry its device share (rows folded from another benchmark)."""
    here = row.get("device_ms_here")
    if here is None:
        return None if slowdown != base else float(row["p50_ms"])
    return float(row["p50_ms"]) + (slowdown - base) * float(here)


def trained_models(rows: Sequence[Row]) -> list[str]:
    """The models with trained weights, in the rows' order."""
    return list(dict.fromkeys(r["model"] for r in rows if r.get("trained_weights")))


def front(rows: Sequence[Row], model: str, mbit: float) -> list[Row]:
    """Every trained row at one point as (strategy, kind, fidelity, p50), with ``pareto``:
    no other point is at least as faithful and strictly faster."""
    here = [
        r
        for r in rows
        if r["model"] == model
        and float(r["bandwidth_mbit"]) == mbit
        and r.get("trained_weights")
        and kind(r) != "other"
        and r.get("fidelity") is not None
    ]
    points = [
        {
            "strategy": r["strategy"],
            "kind": kind(r),
            "fidelity": float(r["fidelity"]),
            "fidelity_lower_95": r.get("fidelity_lower_95"),
            "p50_ms": float(r["p50_ms"]),
            "cuts": list(r.get("cuts") or []),
            "codec": dict(r.get("codec_used") or {}),
            "split": is_split(r),
        }
        for r in here
    ]
    for p in points:
        p["pareto"] = not any(
            q is not p
            and q["fidelity"] >= p["fidelity"] - EPS
            and q["p50_ms"] < p["p50_ms"] * (1 - 1e-9)
            for q in points
        )
    return sorted(points, key=lambda p: (-p["fidelity"], p["p50_ms"]))


def best_split(
    splits: Sequence[tuple[Row, float]], uploads: Sequence[tuple[Row, float]]
) -> tuple[Row, float, tuple[Row, float] | None]:
    """The split that gains most over the fastest upload at least as faithful as it, that
    upload (None when none is as faithful: the split wins on fidelity), from (row, ms)
    pairs. A split no upload matches ranks first, the more faithful first; then by ratio."""

    def rival(split: tuple[Row, float]) -> tuple[Row, float] | None:
        faithful = [u for u in uploads if u[0]["fidelity"] >= split[0]["fidelity"] - EPS]
        return min(faithful, key=lambda u: u[1]) if faithful else None

    def rank(split: tuple[Row, float]) -> tuple[float, float]:
        other = rival(split)
        ratio = float("inf") if other is None else other[1] / split[1]
        return (ratio, float(split[0]["fidelity"]))

    chosen = max(splits, key=rank)
    return chosen[0], chosen[1], rival(chosen)


def where_splits_pay(
    rows: Sequence[Row], slowdowns: Sequence[float] = DEVICE_SLOWDOWNS
) -> list[Row]:
    """Per trained model, device speed and rate: tierflow's split that gains most over the
    fastest upload at least as faithful (:func:`best_split`; ``speedup``), and against
    ``cloud-only-jpeg`` q90 (``speedup_vs_jpeg90``, when q90 is no more faithful than the
    split). ``pays`` when it beats every upload at equal or better fidelity."""
    out: list[Row] = []
    for model in trained_models(rows):
        mine = [r for r in rows if r["model"] == model and r.get("fidelity") is not None]
        for slowdown in slowdowns:
            for mbit in sorted({float(r["bandwidth_mbit"]) for r in mine}):
                here = [r for r in mine if float(r["bandwidth_mbit"]) == mbit]
                timed = [(r, at_device_speed(r, slowdown)) for r in here]
                splits = [
                    (r, t)
                    for r, t in timed
                    if t is not None and kind(r) == "tierflow" and is_split(r)
                ]
                uploads = [(r, t) for r, t in timed if t is not None and kind(r) == "upload"]
                if not splits or not uploads:
                    continue
                split, split_ms, best = best_split(splits, uploads)
                jpeg = next(
                    ((r, t) for r, t in uploads if r["strategy"] == "cloud-only-jpeg"), None
                )
                device_only = next((t for r, t in timed if kind(r) == "device-only"), None)
                entry: Row = {
                    "model": model,
                    "device_slowdown": slowdown,
                    # Not an upload, but what the same device answers in alone.
                    "device_only_ms": device_only,
                    "bandwidth_mbit": mbit,
                    "split": split["strategy"],
                    "split_cuts": list(split.get("cuts") or []),
                    "split_codec": dict(split.get("codec_used") or {}),
                    "split_ms": split_ms,
                    "split_fidelity": split["fidelity"],
                    "upload": best[0]["strategy"] if best else None,
                    "upload_ms": best[1] if best else None,
                    "upload_fidelity": best[0]["fidelity"] if best else None,
                    # No upload is as faithful: the split wins on fidelity; speedup is None.
                    "speedup": best[1] / split_ms if best else None,
                    "speedup_vs_jpeg90": (
                        jpeg[1] / split_ms
                        if jpeg and jpeg[0]["fidelity"] <= split["fidelity"] + EPS
                        else None
                    ),
                    "jpeg90_fidelity": jpeg[0]["fidelity"] if jpeg else None,
                }
                entry["pays"] = best is None or entry["speedup"] > 1.0
                out.append(entry)
    return out


def summary(table: Sequence[Row]) -> list[Row]:
    """Per model: where (device speed, rate) the split pays, and the best ratio over the
    fastest upload as faithful and over JPEG q90."""
    out: list[Row] = []
    for model in dict.fromkeys(e["model"] for e in table):
        mine = [e for e in table if e["model"] == model]
        ratios = [e for e in mine if e["speedup"] is not None]
        jpeg = [e for e in mine if e["speedup_vs_jpeg90"] is not None]
        out.append(
            {
                "model": model,
                "pays_at": [(e["device_slowdown"], e["bandwidth_mbit"]) for e in mine if e["pays"]],
                "points": len(mine),
                "best": max(ratios, key=lambda e: e["speedup"]) if ratios else None,
                "best_vs_jpeg90": max(jpeg, key=lambda e: e["speedup_vs_jpeg90"]) if jpeg else None,
            }
        )
    return out


def goal_reasons(rows: Sequence[Row], target: float = 1.5, max_mbit: float = 50.0) -> list[Row]:
    """Why a split does or does not reach ``target`` x over ``cloud-only-jpeg`` (q90) at equal
    or better fidelity, per trained model with a JPEG upload and rate up to ``max_mbit``:
    the time the split must beat (q90's p50 / target), the fastest split at least as
    faithful as q90, and the device work that split does before a byte leaves (its device
    share at the benchmark's 10x device). Computed from the rows, never asserted."""
    out: list[Row] = []
    for model in trained_models(rows):
        for mbit in sorted({float(r["bandwidth_mbit"]) for r in rows if r["model"] == model}):
            if mbit > max_mbit:
                continue
            here = [r for r in rows if r["model"] == model and float(r["bandwidth_mbit"]) == mbit]
            jpeg = next((r for r in here if r["strategy"] == "cloud-only-jpeg"), None)
            if jpeg is None:
                continue
            splits = [
                r
                for r in here
                if kind(r) == "tierflow" and is_split(r) and r["fidelity"] >= jpeg["fidelity"] - EPS
            ]
            best = min(splits, key=lambda r: r["p50_ms"]) if splits else None
            device = (
                BENCH_SLOWDOWN * float(best["device_ms_here"])
                if best is not None and best.get("device_ms_here") is not None
                else None
            )
            out.append(
                {
                    "model": model,
                    "bandwidth_mbit": mbit,
                    "jpeg_ms": float(jpeg["p50_ms"]),
                    "jpeg_fidelity": float(jpeg["fidelity"]),
                    "needed_ms": float(jpeg["p50_ms"]) / target,
                    "split": best["strategy"] if best else None,
                    "split_ms": float(best["p50_ms"]) if best else None,
                    "split_fidelity": float(best["fidelity"]) if best else None,
                    "split_device_ms": device,
                    "speedup": float(jpeg["p50_ms"]) / float(best["p50_ms"]) if best else None,
                    "met": best is not None
                    and float(jpeg["p50_ms"]) / float(best["p50_ms"]) >= target,
                }
            )
    return out


def plot_fronts(rows: Sequence[Row], folder: Path, base: Path) -> list[str]:
    """One PNG per trained model: latency against fidelity at each rate of ``FRONT_MBIT``
    (tierflow's plans, the JPEG sweep as a line, WebP, PNG, raw/int8 uploads,
    device-only). Returns the paths relative to ``base``; [] without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ModuleNotFoundError:
        return []
    written: list[str] = []
    for model in trained_models(rows):
        rates = [m for m in FRONT_MBIT if front(rows, model, m)]
        if not rates:
            continue
        fig, axes = plt.subplots(1, len(rates), figsize=(4.2 * len(rates), 4), squeeze=False)
        for ax, mbit in zip(axes[0], rates, strict=True):
            points = front(rows, model, mbit)
            jpeg = sorted(
                (p for p in points if p["strategy"].startswith("cloud-only-jpeg")),
                key=lambda p: p["fidelity"],
            )
            ax.plot(
                [p["fidelity"] for p in jpeg], [p["p50_ms"] for p in jpeg], "o-", color="black",
                markersize=3, label="JPEG upload (q5-95)",
            )  # fmt: skip
            groups = (
                ("WebP upload", lambda p: "webp" in p["strategy"], "D", "grey"),
                ("PNG / raw / int8 upload", lambda p: p["kind"] == "upload"
                 and "jpeg" not in p["strategy"] and "webp" not in p["strategy"], "s", "tab:brown"),
                ("device-only", lambda p: p["kind"] == "device-only", "v", "tab:green"),
                ("tierflow plan (split)", lambda p: p["kind"] == "tierflow" and p["split"],
                 "*", "tab:red"),
                ("tierflow plan (no split)", lambda p: p["kind"] == "tierflow"
                 and not p["split"], "P", "tab:blue"),
            )  # fmt: skip
            for label, pick, marker, colour in groups:
                mine = [p for p in points if pick(p)]
                if mine:
                    ax.plot(
                        [p["fidelity"] for p in mine], [p["p50_ms"] for p in mine], marker,
                        color=colour, markersize=8 if marker == "*" else 5, label=label,
                        linestyle="none",
                    )  # fmt: skip
            for p in points:
                if p["kind"] == "tierflow":
                    ax.annotate(
                        p["strategy"].replace("tierflow-", "").replace("budget", "b"),
                        (p["fidelity"], p["p50_ms"]), fontsize=6, xytext=(3, 3),
                        textcoords="offset points",
                    )  # fmt: skip
            ax.set_yscale("log")
            ax.set_title(f"{mbit:g} Mbit/s", fontsize=9)
            ax.set_xlabel("fidelity (top-1 agreement, held-out)")
            ax.grid(alpha=0.3)
        axes[0][0].set_ylabel("composed p50 latency (ms, log)")
        axes[0][-1].legend(fontsize=6, loc="best")
        fig.suptitle(f"{model}: latency against fidelity (device 10x)", fontsize=10)
        fig.tight_layout()
        path = folder / f"front_{model}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(os.path.relpath(path, base))
    return written


def accuracy_lines(rows: Sequence[Row]) -> list[str]:
    """Per trained model with labels: the exact model's task accuracy on the held-out
    requests, and the range over tierflow's plans and over the uploads."""
    out: list[str] = []
    for model in trained_models(rows):
        mine = [r for r in rows if r["model"] == model and r.get("accuracy") is not None]
        exact = next((r["exact_accuracy"] for r in mine if "exact_accuracy" in r), None)
        if not mine or exact is None:
            continue
        parts = [f"- **{model}**: exact model {exact:.3f}"]
        for label, pick in (("tierflow's plans", "tierflow"), ("uploads", "upload")):
            values = [float(r["accuracy"]) for r in mine if kind(r) == pick]
            if values:
                parts.append(f"{label} {min(values):.3f}-{max(values):.3f}")
        out.append(", ".join(parts) + ".")
    if out:
        out.insert(0, "Task accuracy on the same held-out requests, where labels exist:\n")
        out.append("")
    return out


def _plan(entry: Row) -> str:
    codec = entry["split_codec"].get("device-edge", "")
    cuts = entry["split_cuts"]
    where = f"cut {cuts[0]}" if cuts else "learned"
    return f"{entry['split']} ({where}, {codec})" if codec else f"{entry['split']} ({where})"


def section(rows: Sequence[Row], plots: Sequence[str]) -> list[str]:
    """RESULTS.md's fronts and where-splits-pay section, from the rows."""
    table = where_splits_pay(rows)
    out = [
        "## Rate-fidelity fronts and where splits pay (trained models)\n",
        "Latency (composed p50, device 10x slower than this machine) against fidelity "
        "(top-1 agreement with the exact model on the held-out requests) at each rate, for "
        "tierflow's plans under each budget (exact, top1=99/98/95/90%), the uploads (raw, "
        "`int8+zstd`, JPEG q5-95, WebP q50-90, PNG) and device-only; every point is a "
        "row of `results.json` (`benchmarks/comparison/fronts.py`). Only trained models.\n",
    ]
    out += [f"![{p}]({p})\n" for p in plots]
    out.append(
        "Where a split (the device runs part of the model and sends a feature) beats every "
        "upload at equal or better fidelity: of tierflow's split plans at each point, the "
        "one that gains most over the fastest upload at least as faithful as it (ratio > 1: "
        "the split is faster), composed at "
        "other device speeds from the same measurements (the device's share of each row "
        "scaled; the plans are those chosen for the 10x device, so a planner told of "
        "another device could do better, not worse). '–' means no upload is as faithful "
        "as the split. Device-only is not an upload; its time on the same device is in the "
        "last column (a fast device answers alone sooner than any split).\n"
    )
    unsplit = [m for m in trained_models(rows) if m not in {e["model"] for e in table}]
    if unsplit:
        out.append(
            "- No split among tierflow's plans (each sends its input or runs on the device) "
            "for: " + ", ".join(f"**{m}**" for m in unsplit) + "."
        )
    for entry in summary(table):
        best, jpeg = entry["best"], entry["best_vs_jpeg90"]
        where = ", ".join(f"{s:g}x/{m:g} Mbit/s" for s, m in entry["pays_at"]) or "nowhere"
        text = (
            f"- **{entry['model']}**: the split pays at {len(entry['pays_at'])} of "
            f"{entry['points']} (device speed, rate) points: {where}."
        )
        if best:
            text += (
                f" Largest ratio over the fastest upload as faithful: "
                f"{best['speedup']:.2f}x ({_plan(best)}, fidelity {best['split_fidelity']:.3f}, "
                f"{best['split_ms']:.1f} ms against {best['upload']} {best['upload_ms']:.1f} ms "
                f"at {best['upload_fidelity']:.3f}; device {best['device_slowdown']:g}x, "
                f"{best['bandwidth_mbit']:g} Mbit/s)."
            )
        if jpeg:
            text += (
                f" Against `cloud-only-jpeg` (q90) at no better fidelity: up to "
                f"{jpeg['speedup_vs_jpeg90']:.2f}x (device {jpeg['device_slowdown']:g}x, "
                f"{jpeg['bandwidth_mbit']:g} Mbit/s; q90 keeps {jpeg['jpeg90_fidelity']:.3f})."
            )
        out.append(text)
    out.append("")
    out += accuracy_lines(rows)
    reasons = goal_reasons(rows)
    if reasons:
        out.append(
            "The split goal (>= 1.5x over `cloud-only-jpeg`, q90, at equal or better "
            "fidelity, <= 50 Mbit/s), per trained image model and rate: the time a split "
            "must beat, the fastest split at least as faithful as q90, and the device work "
            "that split does before sending (10x device):\n"
        )
        out += [
            "| model | Mbit/s | q90 ms (fidelity) | needed ms | fastest split as faithful | "
            "ms (fidelity) | its device work ms | ratio |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in reasons:
            out.append(
                f"| {r['model']} | {r['bandwidth_mbit']:g} | {r['jpeg_ms']:.1f} "
                f"({r['jpeg_fidelity']:.3f}) | {r['needed_ms']:.1f} | {r['split'] or '–'} | "
                + (
                    "–"
                    if r["split_ms"] is None
                    else f"{r['split_ms']:.1f} ({r['split_fidelity']:.3f})"
                )
                + f" | {ms(r['split_device_ms'])} | "
                + ("–" if r["speedup"] is None else f"{r['speedup']:.2f}x")
                + " |"
            )
        out.append("")
    for model in dict.fromkeys(e["model"] for e in table):
        out += [
            f"### {model}: split against upload\n",
            "| device | Mbit/s | tierflow's split that gains most | fidelity | ms | fastest upload "
            "as faithful | fidelity | ms | ratio | vs q90 | device-only ms |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for e in (e for e in table if e["model"] == model):
            out.append(
                f"| {e['device_slowdown']:g}x | {e['bandwidth_mbit']:g} | {_plan(e)} | "
                f"{e['split_fidelity']:.3f} | {ms(e['split_ms'])} | {e['upload'] or '–'} | "
                + ("–" if e["upload_fidelity"] is None else f"{e['upload_fidelity']:.3f}")
                + f" | {ms(e['upload_ms'])} | "
                + ("–" if e["speedup"] is None else f"{e['speedup']:.2f}x")
                + " | "
                + ("–" if e["speedup_vs_jpeg90"] is None else f"{e['speedup_vs_jpeg90']:.2f}x")
                + f" | {ms(e['device_only_ms'])} |"
            )
        out.append("")
    return out
