"""Writing the benchmark's results: ``results.json`` rows, ``RESULTS.md`` and the plots.

Rows are plain dicts (see ``comparison/run.py`` for their fields). Plots use matplotlib's Agg
backend: no display is needed.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks.comparison import strategies as _strategies
from benchmarks.generation import report as generation_report
from benchmarks.lib import RESULTS
from benchmarks.lib.report import load_words, ms

#: Every strategy a row may have, in the order tables and legends show them.
#: (JPEG's quality sweep has its own table in the fidelity section, not a column here.)
STRATEGIES = (
    *_strategies.STRATEGIES[:5],
    "tierflow-budget",
    "tierflow-budget-98",
    "tierflow-budget-95",
    "tierflow-budget-90",
    "tierflow-split",
    *_strategies.STRATEGIES[5:],
    "cloud-only-jpeg",
    "cloud-only-png",
    "tierflow-bottleneck",
    "tierflow-lowbit",
)

Row = dict[str, Any]

_COLOURS = {
    "device-only": "#7f7f7f",
    "cloud-only": "#1f77b4",
    "cloud-only-compressed": "#17becf",
    "single-split": "#ff7f0e",
    "tierflow": "#2ca02c",
    "tierflow-exits": "#d62728",
    "tierflow-budget": "#9467bd",
    "tierflow-budget-98": "#a58bd0",
    "tierflow-budget-95": "#b7a2da",
    "tierflow-budget-90": "#c9b9e4",
    "tierflow-split": "#ff9896",
    "cloud-only-jpeg": "#bcbd22",
    "cloud-only-png": "#8c564b",
    "tierflow-bottleneck": "#e377c2",
    "tierflow-lowbit": "#aec7e8",
}
_TIER_COLOURS = {"device": "#9467bd", "edge": "#ff7f0e", "cloud": "#1f77b4"}


def write_json(rows: Sequence[Row], path: Path) -> None:
    path.write_text(json.dumps(list(rows), indent=1, sort_keys=False) + "\n")


def write_meta(meta: Mapping[str, Any], extras: Mapping[str, Any], path: Path) -> None:
    """Everything that is not a row: machine, emulation, models, overhead figures."""
    data = {k: v for k, v in meta.items() if k != "method"}
    data["overheads"] = dict(extras)
    path.write_text(json.dumps(data, indent=1, default=str) + "\n")


def _models(rows: Sequence[Row]) -> list[str]:
    seen: list[str] = []
    for row in rows:
        if row["model"] not in seen:
            seen.append(row["model"])
    return seen


def _bandwidths(rows: Sequence[Row]) -> list[float]:
    return sorted({float(r["bandwidth_mbit"]) for r in rows})


def _find(rows: Sequence[Row], model: str, mbit: float, strategy: str) -> Row | None:
    for row in rows:
        if row["model"] == model and row["bandwidth_mbit"] == mbit and row["strategy"] == strategy:
            return row
    return None


def _grid(count: int) -> tuple[int, int]:
    cols = min(3, count)
    return math.ceil(count / cols), cols


def _has_exits(rows: Sequence[Row], model: str) -> bool:
    return any(r["model"] == model and r.get("exits_used") for r in rows)


def plot_latency(rows: Sequence[Row], path: Path) -> None:
    """Latency against device-edge bandwidth, one line per strategy, one panel per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = _models(rows)
    nrows, ncols = _grid(len(models))
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.2 * ncols, 4.0 * nrows), squeeze=False)
    for ax, model in zip(axes.flat, models, strict=False):
        for strategy in STRATEGIES:
            points = sorted(
                (r["bandwidth_mbit"], r["p50_ms"])
                for r in rows
                if r["model"] == model and r["strategy"] == strategy
            )
            if not points:
                continue
            xs, ys = zip(*points, strict=True)
            style = "-" if strategy.startswith("tierflow") else "--"
            width = 2.4 if strategy == "tierflow" else 1.4
            ax.plot(
                xs, ys, style, marker="o", ms=4, lw=width, label=strategy, color=_COLOURS[strategy]
            )
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(model)
        ax.set_xlabel("device-edge bandwidth (Mbit/s)")
        ax.set_ylabel("p50 latency (ms)")
        ax.grid(True, which="both", alpha=0.3)
    for ax in list(axes.flat)[len(models) :]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), frameon=False)
    fig.suptitle("Median request latency per strategy (lower is better)")
    fig.tight_layout(rect=(0, 0.05, 1, 0.96))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_cuts(rows: Sequence[Row], path: Path) -> None:
    """Where tierflow's cuts fall: share of the model's compute on each tier, per bandwidth."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = _models(rows)
    nrows, ncols = _grid(len(models))
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.2 * ncols, 3.8 * nrows), squeeze=False)
    for ax, model in zip(axes.flat, models, strict=False):
        mine = [r for r in rows if r["model"] == model and r["strategy"] == "tierflow"]
        mine.sort(key=lambda r: r["bandwidth_mbit"])
        labels = [f"{r['bandwidth_mbit']:g}" for r in mine]
        positions = list(range(len(mine)))
        bottom = [0.0] * len(mine)
        for tier in ("device", "edge", "cloud"):
            share = [r["compute_share"][tier] for r in mine]
            ax.bar(positions, share, bottom=bottom, color=_TIER_COLOURS[tier], label=tier)
            bottom = [b + s for b, s in zip(bottom, share, strict=True)]
        for i, r in enumerate(mine):
            a, b = r["cuts"]
            codec = r.get("codec_used", {})
            lines = [f"{a}|{b} of {r['last_cut']}"] + [
                f"{'de' if link == 'device-edge' else 'ec'} {c}" for link, c in codec.items()
            ]
            ax.text(
                i,
                0.5,
                "\n".join(lines),
                ha="center",
                va="center",
                fontsize=6.5,
                bbox={"boxstyle": "round,pad=0.2", "fc": "white", "ec": "none", "alpha": 0.85},
            )
        ax.set_xticks(positions, labels)
        ax.set_ylim(0, 1)
        ax.set_title(model)
        ax.set_xlabel("device-edge bandwidth (Mbit/s)")
        ax.set_ylabel("share of model compute")
    for ax in list(axes.flat)[len(models) :]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=3, frameon=False)
    fig.suptitle(
        "Where tierflow's chosen cuts fall: share of the model's compute per tier, "
        "cuts a|b and link codecs (de = device-edge, ec = edge-cloud)"
    )
    fig.tight_layout(rect=(0, 0.05, 1, 0.96))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_speedup(rows: Sequence[Row], path: Path) -> None:
    """tierflow's speedup over the best baseline at each bandwidth, one line per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for index, model in enumerate(_models(rows)):
        colour = f"C{index}"
        for strategy, style in (("tierflow", "-"), ("tierflow-exits", ":")):
            points = sorted(
                (r["bandwidth_mbit"], r["speedup_vs_best_baseline"])
                for r in rows
                if r["model"] == model and r["strategy"] == strategy
            )
            if not points or (strategy == "tierflow-exits" and not _has_exits(rows, model)):
                continue
            xs, ys = zip(*points, strict=True)
            label = model if strategy == "tierflow" else f"{model} with exits + cache"
            ax.plot(xs, ys, style, marker="o", color=colour, label=label)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("device-edge bandwidth (Mbit/s)")
    ax.set_ylabel("speedup (best baseline p50 / tierflow p50)")
    ax.set_title("tierflow against the best baseline at each bandwidth", fontsize=11)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_regret(rows: Sequence[Row], path: Path) -> None:
    """tierflow's regret at every point, one group of bars per model, with the 5% target."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = _models(rows)
    bandwidths = _bandwidths(rows)
    width = 0.8 / max(len(bandwidths), 1)
    fig, ax = plt.subplots(figsize=(8, 4))
    for j, mbit in enumerate(bandwidths):
        values = []
        for model in models:
            row = _find(rows, model, mbit, "tierflow")
            values.append(100 * row["regret"] if row else 0.0)
        positions = [i + (j - (len(bandwidths) - 1) / 2) * width for i in range(len(models))]
        ax.bar(positions, values, width, label=f"{mbit:g} Mbit/s")
    ax.axhline(5.0, color="red", lw=1, ls="--", label="5% target")
    ax.set_xticks(range(len(models)), models)
    ax.set_ylabel("regret (%)")
    ax.set_title("tierflow's measured p50 over the best measured plan's, minus one", fontsize=11)
    ax.legend(fontsize=8, ncol=3)
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _x(value: float | None) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return f"{value:.2f}×"


def markdown(rows: Sequence[Row], meta: Mapping[str, Any], sections: Sequence[str]) -> str:
    """RESULTS.md: setup, summary, per-model tables, plots and the extra ``sections``."""
    out: list[str] = []
    out.append("# tierflow benchmark results\n")
    out.append(
        f"Generated by `{meta['command']}` on {meta['date']} in {meta['wall_s']:.0f} s "
        f"({'quick' if meta['quick'] else 'full'} mode, {meta['requests']} requests per "
        "point). Raw figures: `results.json` (one row per model × bandwidth × strategy); "
        "machine, emulation and overhead figures: `results_meta.json`.\n"
    )
    out.append("## Machine and emulation\n")
    machine = meta["machine"]
    out.append(
        f"Machine: {machine['cpu']}, {machine['cores']} cores (shared with other jobs while "
        f"measuring), Python {machine['python']}, ONNX Runtime {machine['onnxruntime']}."
    )
    load = meta.get("load_average")
    if load:
        out.append(f"{load_words(load)} of the run (2 cores).")
        per_model = [
            f"{m['name']} {m['load_average']['start'][0]:.1f}–{m['load_average']['end'][0]:.1f}"
            for m in meta["models"]
            if "load_average" in m
        ]
        if per_model:
            out.append(
                "Load while each model was measured (start–end): " + ", ".join(per_model) + ". "
                "Other jobs shared the cores throughout; stage times are the calling thread's "
                "CPU time (below), so the ratios hold, while wall-clock parts (profiles, the "
                "runtime pass) are inflated by the load."
            )
    out.append("")
    emulation = meta["emulation"]
    out.append("| tier | ORT threads | slowdown vs this machine | stands for |")
    out.append("|---|---|---|---|")
    for spec in emulation["tiers"].values():
        out.append(
            f"| {spec['name']} | {spec['threads']} | {spec['slowdown']:g}× | {spec['stands_for']} |"
        )
    out.append("")
    rates = ", ".join(
        f"{v['rate_mbit']:g} Mbit/s ({v['rtt_ms']:g} ms RTT)"
        for v in emulation["device_edge"].values()
    )
    ec = emulation["edge_cloud"]
    out.append(
        f"Device-edge link swept over {rates}. Edge-cloud link fixed at "
        f"{ec['rate_mbit']:g} Mbit/s, {ec['rtt_ms']:g} ms RTT. "
        f"No memory budgets: every plan is feasible.\n"
    )
    out.append(
        "Models (exported once to ONNX; trained ones carry the verdict, random-weight ones "
        "measure time alone):\n"
    )
    for model in meta["models"]:
        weights = (
            f"trained weights, inputs {model.get('input_source', 'real')}"
            if model.get("trained")
            else "**random weights: time only, left out of the verdict**"
        )
        out.append(
            f"- **{model['name']}** ({weights}): {model['description']} — {model['cuts']} "
            f"candidate cuts, {model['measured_pairs']} of "
            f"{model['cuts'] * (model['cuts'] + 1) // 2} cut pairs measured "
            f"({model['plans_compared']} plans with codecs)."
        )
    out.append("")
    out.append(meta["method"])
    out.append("")
    out.append("## Summary\n")
    out.append(trained_line(rows) + "\n")
    out.append(
        "Each cell is the range over the swept bandwidths of baseline p50 / tierflow p50 "
        "(>1: tierflow faster). 'best baseline' is the fastest of device-only, cloud-only, "
        "cloud-only-compressed and single-split at each bandwidth; 'exits + cache' is "
        "tierflow-exits against tierflow on the same requests (p50; exits on the demo model "
        "only, see below). Regret = tierflow's measured p50 / best measured plan's p50 − 1.\n"
    )
    out.append(
        "| model | vs device-only | vs cloud-only | vs cloud-only-compressed | "
        "vs single-split | vs best baseline | exits + cache | max regret | mean regret |"
    )
    out.append("|---|---|---|---|---|---|---|---|---|")
    for model in _models(rows):
        mine = [r for r in rows if r["model"] == model and r["strategy"] == "tierflow"]
        exits = [r for r in rows if r["model"] == model and r["strategy"] == "tierflow-exits"]
        if not mine:
            continue
        regrets = [r["regret"] for r in mine]
        label = model if mine[0].get("trained_weights") else f"{model} (random: time only)"
        out.append(
            f"| {label} | {_span(mine, 'speedup_vs_device_only')} | "
            f"{_span(mine, 'speedup_vs_cloud_only')} | "
            f"{_span(mine, 'speedup_vs_cloud_only_compressed')} | "
            f"{_span(mine, 'speedup_vs_single_split')} | "
            f"{_span(mine, 'speedup_vs_best_baseline')} | "
            f"{_span(exits, 'speedup_vs_tierflow_same_requests')} | "
            f"{max(regrets):.1%} | {sum(regrets) / len(regrets):.1%} |"
        )
    out.append("")
    out.append(_headline(rows))
    out.append("")
    out.append("![latency against bandwidth](latency_vs_bandwidth.png)\n")
    out.append("![where the cuts fall](cuts.png)\n")
    out.append("![speedup over the best baseline](speedup.png)\n")
    out.append("![regret at every point](regret.png)\n")
    out.append("## Per model\n")
    strategies = [s for s in STRATEGIES if any(r["strategy"] == s for r in rows)]
    for model in _models(rows):
        out.append(f"### {model}\n")
        out.append("p50 latency in ms, fidelity in brackets (p90 in the JSON):\n")
        out.append("| Mbit/s | " + " | ".join(strategies) + " |")
        out.append("|---" * (len(strategies) + 1) + "|")
        for mbit in _bandwidths([r for r in rows if r["model"] == model]):
            cells = []
            for strategy in strategies:
                row = _find(rows, model, mbit, strategy)
                cells.append(f"{ms(row['p50_ms'])} ({_fidelity(row)})" if row else "–")
            out.append(f"| {mbit:g} | " + " | ".join(cells) + " |")
        out.append("")
        out.append("tierflow's plan at each point, against the best measured plan:\n")
        out.append(
            "| Mbit/s | cuts (a,b)/last | codecs | predicted ms | measured ms | "
            "best measured plan | best ms | regret | ×device | ×cloud | ×single-split |"
        )
        out.append("|---|---|---|---|---|---|---|---|---|---|---|")
        for mbit in _bandwidths([r for r in rows if r["model"] == model]):
            row = _find(rows, model, mbit, "tierflow")
            if row is None:
                continue
            best = row["best_measured"]
            out.append(
                f"| {mbit:g} | {row['cuts'][0]},{row['cuts'][1]}/{row['last_cut']} | "
                f"{_codecs(row['codec_used'])} | {ms(row['predicted_ms'])} | "
                f"{ms(row['p50_ms'])} | {best['cuts'][0]},{best['cuts'][1]} "
                f"{_codecs(best['codec'])} | {ms(best['p50_ms'])} | {row['regret']:.1%} | "
                f"{_x(row['speedup_vs_device_only'])} | {_x(row['speedup_vs_cloud_only'])} | "
                f"{_x(row['speedup_vs_single_split'])} |"
            )
        out.append("")
    out.extend(sections)
    out.extend(rate_fidelity_section())
    out.extend(generation_section())
    out.extend(tenancy_section())
    return "\n".join(out) + "\n"


def generation_section() -> list[str]:
    """The generation benchmark's section from its last committed run (none if absent)."""
    path = RESULTS / "generation.json"
    if not path.exists():
        return []
    return ["", *generation_report.results_section(json.loads(path.read_text()))]


def tenancy_section() -> list[str]:
    """The multi-tenant benchmark's section from its last committed run (none if absent)."""
    path = RESULTS / "tenancy.json"
    if not path.exists():
        return []
    from benchmarks import tenancy

    return ["", *tenancy.results_section(json.loads(path.read_text()))]


def trained_line(rows: Sequence[Row]) -> str:
    """Which figures come from trained models and which from random ones (issue 21)."""
    trained = list(dict.fromkeys(r["model"] for r in rows if r.get("trained_weights")))
    random = list(dict.fromkeys(r["model"] for r in rows if not r.get("trained_weights")))
    counts = [
        int(r["fidelity_requests"])
        for r in rows
        if r.get("trained_weights")
        and r.get("fidelity_requests")
        and r["strategy"] != "tierflow-exits"
    ]
    text = (
        "**Trained models** (real weights shipped in packages or trained by the demo, real "
        f"inputs; every verdict, front and goal figure below): {', '.join(trained) or 'none'}"
    )
    if counts:
        text += f", fidelity on {min(counts)}-{max(counts)} held-out requests per row"
    text += ". "
    if random:
        text += (
            f"**Random weights, time only** (latency rows kept, fidelity meaningless, left out "
            f"of the verdict and the fronts): {', '.join(random)}."
        )
    return text


def rate_fidelity_section() -> list[str]:
    """The rate-fidelity benchmark's section from its last committed run (none if absent)."""
    path = RESULTS / "rate_fidelity.json"
    if not path.exists():
        return []
    from benchmarks import rate_fidelity

    return ["", *rate_fidelity.results_section(json.loads(path.read_text()))]


def _fidelity(row: Row) -> str:
    value = row.get("fidelity")
    return "–" if value is None else f"{value:.2f}"


def _span(rows: Sequence[Row], key: str) -> str:
    values = [r[key] for r in rows if r.get(key) is not None]
    if not values:
        return "–"
    return f"{min(values):.2f}–{max(values):.2f}×"


def _headline(rows: Sequence[Row]) -> str:
    """One line per model: where tierflow wins most, whether it ever loses, worst regret."""
    lines = []
    for model in _models(rows):
        mine = [r for r in rows if r["model"] == model and r["strategy"] == "tierflow"]
        if not mine:
            continue
        top = max(mine, key=lambda r: r["speedup_vs_best_baseline"])
        low = min(mine, key=lambda r: r["speedup_vs_best_baseline"])
        worst = max(mine, key=lambda r: r["regret"])
        label = model if top.get("trained_weights") else f"{model} (random weights: time only)"
        text = (
            f"- **{label}**: largest win {top['speedup_vs_best_baseline']:.2f}× over the best "
            f"baseline at {top['bandwidth_mbit']:g} Mbit/s ({top['p50_ms']:.1f} ms against "
            f"{top['p50_ms'] * top['speedup_vs_best_baseline']:.1f} ms); "
        )
        if low["speedup_vs_best_baseline"] < 0.995:
            text += (
                f"slower than the best baseline at {low['bandwidth_mbit']:g} Mbit/s "
                f"({low['speedup_vs_best_baseline']:.2f}×); "
            )
        else:
            text += "never slower than the best baseline; "
        text += f"worst regret {worst['regret']:.1%} (at {worst['bandwidth_mbit']:g} Mbit/s)."
        lines.append(text)
    return "\n".join(lines) + "\n"


def _codecs(codec: Mapping[str, str]) -> str:
    if not codec:
        return "none"
    return ", ".join(f"{'de' if k == 'device-edge' else 'ec'}={v}" for k, v in codec.items())
