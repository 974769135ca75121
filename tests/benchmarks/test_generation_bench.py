"""The generation benchmark: its verdict on synthetic rows (fast), and a --quick run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks.generation import report

ROOT = Path(__file__).resolve().parents[2]

MIB = 2**20
BUDGETS = {"device": 2 * MIB, "edge": 2 * MIB, "cloud": 2 * MIB}


def row(strategy: str, rtt: float | None, **changes: Any) -> dict[str, Any]:
    """A row as the benchmark writes it: 2 prompts of 32 tokens."""
    base: dict[str, Any] = {
        "strategy": strategy,
        "model": "small" if strategy == "device-only" else "large",
        "rtt_ms": rtt,
        "mbit": None if rtt is None else 10.0,
        "prompts": 2,
        "tokens": 64,
        "ttft_ms": 100.0,
        "ms_per_token": 70.0,
        "tokens_per_s": 14.0,
        "round_trips_per_token": 1.0,
        "bytes_per_token": {"device-edge": 2000.0, "edge-cloud": 2000.0},
        "drafted": 0,
        "accepted": 0,
        "acceptance": None,
        "judged": 0,
        "acceptance_rate": None,
        "agreement": 1.0,
        "rounds": 62,
        "draft_s": 0.0,
        "memory": {
            "edge": {
                "weights": MIB,
                "kv": 100_000,
                "positions": 95,
                "kv_at_context": MIB,
                "at_context": 2 * MIB - 1,
                "planned": 2 * MIB,
            },
        },
    }
    if strategy == "split+draft":  # 62 tokens in 22 rounds of 4 drafts, 40 kept
        base.update(
            drafted=88,
            accepted=40,
            acceptance=40 / 88,
            judged=62,  # every round ended at a rejection: 40 kept + 22 rejected
            acceptance_rate=40 / 62,
            rounds=22,
            draft_s=0.5,
            ms_per_token=35.0,
            tokens_per_s=28.0,
            round_trips_per_token=24 / 64,
        )
    base.update(changes)
    return base


def grid(**draft_changes: Any) -> list[dict[str, Any]]:
    rows = [row("device-only", None, agreement=0.2, memory={})]
    for rtt in (5.0, 30.0, 100.0):
        rows += [row("cloud-only", rtt, memory={}), row("split", rtt)]
        rows.append(row("split+draft", rtt, **(draft_changes if rtt >= 30 else {})))
    return rows


def goals(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {
        g["goal"].split(" ")[0] + g["goal"].split(" ")[1]: g for g in report.verdict(rows, BUDGETS)
    }


def test_every_goal_met_on_rows_that_meet_them() -> None:
    judged = report.verdict(grid(), BUDGETS)
    assert [g["met"] for g in judged] == [True] * 5, judged
    assert "over 2 links" in judged[1]["detail"]  # RTT 30 and 100, not 5


def test_a_large_model_run_that_differs_fails_the_first_goal() -> None:
    rows = grid()
    rows[5]["agreement"] = 0.97
    first = report.verdict(rows, BUDGETS)[0]
    assert not first["met"] and "8 of 9" in first["detail"] and "97.0%" in first["detail"]
    # The small model alone is not held to it.
    assert report.verdict(grid(), BUDGETS)[0]["met"]


def test_missed_draft_goals_say_by_how_much_and_why() -> None:
    # 1.4x the split's 14 tokens/s; 30 of 52 judged drafts kept (58%)
    rows = grid(tokens_per_s=19.6, accepted=30, judged=52, acceptance_rate=30 / 52)
    by = goals(rows)
    accepted = by["draftsaccepted"]
    assert not accepted["met"] and "lowest 58%" in accepted["detail"]
    assert "short by 2%" in accepted["detail"]
    assert "30 of the 52 drafts the large model judged were kept" in accepted["why"][0]
    assert "4.0 drafted a round; 34% of all drafts" in accepted["why"][0]
    trips = by["fewerround"]
    assert trips["met"] and "2.67x" in trips["detail"]
    speed = by["tokensper"]
    assert not speed["met"] and "short by 0.20x" in speed["detail"]
    # 62 tokens after the first in 22 rounds at 35 ms a token: 98.6 ms a round, 22.7 ms
    # of it drafting (0.5 s over 22 rounds).
    assert "a round took 98.6 ms (22.7 ms drafting" in speed["why"][0]
    assert "2.82 tokens" in speed["why"][0] and "against 70.0 ms without drafts" in speed["why"][0]
    # At RTT 5 ms nothing is judged: a poor ratio there changes nothing.
    rows[3]["tokens_per_s"] = 1.0
    assert goals(rows)["tokensper"]["detail"] == speed["detail"]


def test_memory_over_a_budget_fails_but_cloud_only_is_not_judged() -> None:
    rows = grid()
    rows[1]["memory"] = {
        "cloud": {
            "weights": 2 * MIB,
            "kv": 1,
            "positions": 1,
            "kv_at_context": 2 * MIB,
            "at_context": 4 * MIB,
        }
    }
    assert report.verdict(rows, BUDGETS)[-1]["met"]  # cloud-only: a comparison only
    rows[2]["memory"]["edge"]["at_context"] = 3 * MIB
    memory = report.verdict(rows, BUDGETS)[-1]
    assert not memory["met"] and "split on the edge: 3.00 MiB" in memory["why"][0]
    assert "against 2.00 MiB" in memory["why"][0]


def test_no_link_at_the_goal_rtt_is_a_missed_goal_not_a_pass() -> None:
    rows = [r for r in grid() if r["rtt_ms"] is None or r["rtt_ms"] < 30]
    assert [g["met"] for g in report.verdict(rows, BUDGETS)][1:4] == [False] * 3


def test_tables_show_every_row_and_each_used_tier() -> None:
    rows = grid()
    cells = report.table_rows(rows)
    assert len(cells) == len(rows) and cells[0][:3] == ["-", "-", "device-only"]
    assert cells[6][-3:] == ["40/88 (45%)", "40/62 (65%)", "100.0%"]
    memory = report.memory_rows(rows, BUDGETS)
    assert [m[:2] for m in memory] == [["split", "edge"], ["split+draft", "edge"]]
    text = "\n".join(report.markdown_table(report.MEMORY_HEADERS, memory))
    assert "| split | edge | 1.00 MiB |" in text


def test_the_demo_and_the_benchmark_show_a_run_alike() -> None:
    from tierflow.demos.generate import HEADERS as DEMO_HEADERS
    from tierflow.demos.generate import result_rows

    drafted = row("split+draft", 30.0, tiers=["edge", "cloud"], blocks={"edge": [0, 1]})
    bench = dict(zip(report.HEADERS, report.table_rows([drafted])[0], strict=True))
    demo = dict(zip(DEMO_HEADERS, result_rows([drafted])[0], strict=True))
    shared = set(report.HEADERS) & set(DEMO_HEADERS)
    assert len(shared) == 9 and "agrees" in shared and "device-edge B/token" in shared
    assert {h: bench[h] for h in shared} == {h: demo[h] for h in shared}
    assert demo["drafts kept"] == "40/88 (45%)" and demo["blocks"] == "edge 0-1"


@pytest.mark.integration
def test_quick_run_writes_results_and_judges_them(byte_family: Any, tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.generation",
            "--quick",
            "--out",
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads((tmp_path / "generation.json").read_text())
    rows = results["rows"]
    assert {r["strategy"] for r in rows} == {"device-only", "cloud-only", "split", "split+draft"}
    assert len(rows) == 1 + 3 * 2  # device-only once, three strategies at two links
    for r in rows:
        if r["model"] == "large":
            assert r["agreement"] == 1.0, r  # computed token by token in the run
        assert r["tokens"] == 32 and r["tokens_per_s"] > 0
    drafted = [r for r in rows if r["strategy"] == "split+draft"]
    assert all(r["drafted"] > 0 and r["round_trips_per_token"] < 1 for r in drafted)
    split = next(r for r in rows if r["strategy"] == "split")
    assert set(split["memory"]) == {"device", "edge", "cloud"}
    assert all(m["kv"] > 0 for t, m in split["memory"].items() if t != "device")
    assert len(results["verdict"]) == 5 and results["verdict"][0]["met"]
    written = (tmp_path / "GENERATION.md").read_text()
    assert written.startswith("# Generation benchmark") and "## Memory per tier" in written
    assert "64 KiB), of which generation uses the last" in written
    assert (tmp_path / "generation.png").stat().st_size > 10_000
    assert "goals met" in done.stdout
