"""The generation benchmark's pure parts: goals judged from rows, summary, tables, plots.

A row is one strategy at one device-edge link (``rtt_ms``, ``mbit``; device-only runs
once, with ``rtt_ms`` None) as :meth:`GenerationRun.to_dict` gives it, plus the run's
``rounds`` (round trips after the prefill), ``draft_s`` (seconds the device spent
drafting) and ``memory`` per tier. :func:`verdict` judges issue 19's goals on them and
says, where one is missed, by how much and why, from the same figures.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tierflow.demos import generation_setup as setup

Row = Mapping[str, Any]

#: The markers of the generation benchmark's section of RESULTS.md.
SECTION_START = "<!-- generation:start (written by python -m benchmarks.generation) -->"
SECTION_END = "<!-- generation:end -->"

#: Issue 19's goals for drafts, judged at every device-edge RTT of at least GOAL_RTT_MS.
GOAL_RTT_MS = 30.0
GOAL_ACCEPTANCE = 0.60
GOAL_ROUND_TRIPS = 2.0
GOAL_TOKENS_PER_S = 1.6
HEADERS = (
    "RTT ms",
    "Mbit/s",
    "strategy",
    "TTFT ms",
    "ms/token",
    "tokens/s",
    "round trips/token",
    "device-edge B/token",
    "edge-cloud B/token",
    "drafts kept",
    "acceptance rate",
    "agrees",
)


def _pairs(rows: Sequence[Row]) -> list[tuple[Row, Row]]:
    """(split, split+draft) at each link of RTT >= GOAL_RTT_MS, in grid order."""
    at: dict[tuple[float, float], dict[str, Row]] = {}
    for row in rows:
        if row.get("rtt_ms") is not None and row["rtt_ms"] >= GOAL_RTT_MS:
            at.setdefault((row["rtt_ms"], row["mbit"]), {})[row["strategy"]] = row
    return [
        (pair["split"], pair["split+draft"])
        for _, pair in sorted(at.items())
        if "split" in pair and "split+draft" in pair
    ]


def _where(row: Row) -> str:
    return f"{row['rtt_ms']:g} ms, {row['mbit']:g} Mbit/s"


def draft_figures(split: Row, drafted: Row) -> dict[str, float]:
    """What one split+draft row did per round, against its split row, from their figures."""
    rounds = max(drafted["rounds"], 1)
    decode_tokens = drafted["tokens"] - drafted["prompts"]  # after each prompt's first
    round_ms = drafted["ms_per_token"] * decode_tokens / rounds
    draft_ms = drafted["draft_s"] * 1e3 / rounds
    return {
        "tokens_per_round": decode_tokens / rounds,
        "drafts_per_round": drafted["drafted"] / rounds,
        "round_ms": round_ms,
        "draft_ms": draft_ms,
        "trip_ms": round_ms - draft_ms,
        "split_ms_per_token": split["ms_per_token"],
    }


def _goal(goal: str, met: bool, detail: str, why: Sequence[str] = ()) -> dict[str, Any]:
    return {"goal": goal, "met": met, "detail": detail, "why": list(why)}


def verdict(rows: Sequence[Row], budgets: Mapping[str, int]) -> list[dict[str, Any]]:
    """Issue 19's goals, each met or not, with the figures and (if missed) the reasons."""
    goals = []
    large = [r for r in rows if r["model"] == "large"]
    differ = [r for r in large if r["agreement"] != 1.0]
    goals.append(
        _goal(
            "greedy output identical to the large model's everywhere",
            bool(large) and not differ,
            f"{len(large) - len(differ)} of {len(large)} runs of the large model equal its "
            "unsplit greedy output token for token"
            + "".join(
                f"; {r['strategy']} at {_where(r)}: {r['agreement']:.1%}" for r in differ[:5]
            ),
        )
    )
    pairs = _pairs(rows)
    checks = (
        (
            "drafts accepted (acceptance rate)",
            GOAL_ACCEPTANCE,
            lambda s, d: d["acceptance_rate"] or 0.0,
            "{:.0%}",
        ),
        (
            "fewer round trips per token than the split without drafts",
            GOAL_ROUND_TRIPS,
            lambda s, d: s["round_trips_per_token"] / max(d["round_trips_per_token"], 1e-9),
            "{:.2f}x",
        ),
        (
            "tokens per second against the split without drafts",
            GOAL_TOKENS_PER_S,
            lambda s, d: d["tokens_per_s"] / s["tokens_per_s"],
            "{:.2f}x",
        ),
    )
    for name, target, value, shown in checks:
        goal = f"{name} >= {shown.format(target)} at RTT >= {GOAL_RTT_MS:g} ms"
        if not pairs:
            goals.append(_goal(goal, False, "no link of that RTT was measured"))
            continue
        values = [(value(s, d), s, d) for s, d in pairs]
        worst = min(values, key=lambda v: v[0])
        missed = sorted((v for v in values if v[0] < target), key=lambda v: v[0])
        detail = f"lowest {shown.format(worst[0])} at {_where(worst[1])} over {len(values)} links"
        if missed:
            detail += f"; {len(missed)} below, short by {shown.format(target - worst[0])}"
        why = [_why(name, s, d) for _, s, d in missed[:3]]
        goals.append(_goal(goal, not missed, detail, why))
    goals.append(_memory_goal(rows, budgets))
    return goals


def _why(name: str, split: Row, drafted: Row) -> str:
    """Why a pair missed a draft goal, computed from its figures."""
    f = draft_figures(split, drafted)
    per_draft = (drafted["accepted"] / drafted["drafted"]) if drafted["drafted"] else 0.0
    kept = f["tokens_per_round"] - 1
    if name.startswith("drafts"):
        return (
            f"{_where(drafted)}: {drafted['accepted']} of the {drafted['judged']} drafts the "
            f"large model judged were kept ({f['drafts_per_round']:.1f} drafted a round; "
            f"{per_draft:.0%} of all drafts, those after a rejection never judged)"
        )
    if name.startswith("fewer"):
        return (
            f"{_where(drafted)}: a round trip gave {f['tokens_per_round']:.2f} tokens "
            f"({kept:.2f} drafts kept + the large model's own)"
        )
    return (
        f"{_where(drafted)}: a round took {f['round_ms']:.1f} ms ({f['draft_ms']:.1f} ms "
        f"drafting on the device, {f['trip_ms']:.1f} ms the round trip and the tiers) for "
        f"{f['tokens_per_round']:.2f} tokens, {f['round_ms'] / f['tokens_per_round']:.1f} ms "
        f"a token against {f['split_ms_per_token']:.1f} ms without drafts"
    )


def _memory_goal(rows: Sequence[Row], budgets: Mapping[str, int]) -> dict[str, Any]:
    """Each tier's weights plus KV cache at the planned context within its budget."""
    over = []
    worst = (0.0, "")
    checked = 0
    for row in rows:
        for tier, held in (row.get("memory") or {}).items():
            budget = budgets.get(tier)
            if budget is None:
                continue
            if row["strategy"] == "cloud-only":
                continue  # over the cloud's budget by design: a comparison only
            checked += 1
            share = held["at_context"] / budget
            if share > worst[0]:
                worst = (share, f"{row['strategy']} {tier}")
            if held["at_context"] > budget:
                over.append(
                    f"{row['strategy']} on the {tier}: {_mib(held['at_context'])} "
                    f"({_mib(held['weights'])} weights, {_mib(held['kv_at_context'])} KV cache "
                    f"at the context) against {_mib(budget)}"
                )
    detail = (
        f"{checked} tier figures; the fullest, {worst[1]}, at {worst[0]:.0%} of its budget "
        "(cloud-only, over the cloud's budget by design, is a comparison and not judged)"
    )
    return _goal(
        "per-tier memory (weights + KV cache at the planned context) within the budgets "
        "planned for",
        checked > 0 and not over,
        detail,
        over,
    )


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.2f} MiB"


def verdict_lines(goals: Sequence[Mapping[str, Any]]) -> list[str]:
    lines = []
    for goal in goals:
        mark = "met" if goal["met"] else "NOT met"
        lines.append(f"- {goal['goal']}: {mark} ({goal['detail']})")
        lines += [f"  - why: {why}" for why in goal["why"]]
    return lines


def table_rows(rows: Sequence[Row]) -> list[list[str]]:
    """One row of cells per strategy and link, under :data:`HEADERS`."""
    out = []
    for row in rows:
        figures = setup.figure_cells(row)
        out.append(
            [
                "-" if row["rtt_ms"] is None else f"{row['rtt_ms']:g}",
                "-" if row["mbit"] is None else f"{row['mbit']:g}",
                row["strategy"],
                *(figures[header] for header in HEADERS[3:]),
            ]
        )
    return out


def memory_rows(rows: Sequence[Row], budgets: Mapping[str, int]) -> list[list[str]]:
    """Per strategy and tier (first link measured): weights, KV cache, against the budget."""
    out, seen = [], set()
    for row in rows:
        if row["strategy"] in seen or not row.get("memory"):
            continue
        seen.add(row["strategy"])
        for tier, held in row["memory"].items():
            if not held["weights"] and not held["kv"]:
                continue  # a tier this plan does not use
            out.append(
                [
                    row["strategy"],
                    tier,
                    _mib(held["weights"]),
                    f"{held['kv'] / 1024:.0f} KiB at {held['positions']} tokens",
                    _mib(held["kv_at_context"]),
                    _mib(held["at_context"]),
                    _mib(budgets[tier]) if tier in budgets else "-",
                    _mib(held["planned"]) if held.get("planned") is not None else "-",
                ]
            )
    return out


MEMORY_HEADERS = (
    "strategy",
    "tier",
    "weights",
    "KV cache held",
    "KV at context",
    "weights + KV at context",
    "budget",
    "planned (with activations)",
)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    return [
        "| " + " | ".join(headers) + " |",
        "|" + "---|" * len(headers),
        *("| " + " | ".join(r) + " |" for r in rows),
    ]


def summary(results: Mapping[str, Any]) -> str:
    """A few lines: the verdict and the headline ratios at the plan's own link."""
    goals = results["verdict"]
    met = sum(1 for g in goals if g["met"])
    lines = [f"{met} of {len(goals)} goals met ({results['command']}, {results['date']}):", ""]
    lines += verdict_lines(goals)
    return "\n".join(lines)


def plot(rows: Sequence[Row], path: Path) -> None:
    """Tokens per second and time to first token against the device-edge RTT, per rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = sorted({r["mbit"] for r in rows if r["mbit"] is not None})
    figure, axes = plt.subplots(2, len(rates), figsize=(4.2 * len(rates), 6.4), squeeze=False)
    alone = next((r for r in rows if r["strategy"] == "device-only"), None)
    for column, rate in enumerate(rates):
        for line, (key, label) in enumerate((("tokens_per_s", "tokens/s"), ("ttft_ms", "TTFT ms"))):
            ax = axes[line][column]
            for strategy in ("cloud-only", "split", "split+draft"):
                points = sorted(
                    (r["rtt_ms"], r[key])
                    for r in rows
                    if r["strategy"] == strategy and r["mbit"] == rate and r[key] is not None
                )
                if points:
                    ax.plot(*zip(*points, strict=True), marker="o", label=strategy)
            if alone is not None and alone[key] is not None:
                ax.axhline(alone[key], color="grey", linestyle="--", label="device-only (small)")
            ax.set_xlabel("device-edge RTT, ms")
            ax.set_ylabel(label)
            ax.set_title(f"{rate:g} Mbit/s")
            ax.set_yscale("log")
            ax.grid(True, alpha=0.3)
    axes[0][0].legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def results_section(results: Mapping[str, Any]) -> list[str]:
    """RESULTS.md's delimited section: the verdict and the plot, a link to the rest."""
    return [
        SECTION_START,
        "## Generation across tiers (issue 19)\n",
        f"From `{results['command']}` ({results['date']}); every run, memory per tier and "
        "the method: [GENERATION.md](GENERATION.md), raw figures in "
        "`generation.json`.\n",
        summary(results),
        "",
        f"![generation: tokens per second and time to first token]({results['figure']})\n",
        SECTION_END,
    ]
