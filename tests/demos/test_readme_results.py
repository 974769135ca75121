"""The README's demo results are a real run's, as ``tierflow demo --results-md`` wrote them.

``demos/demo-results.md`` is committed from a run of ``tierflow demo --results-md
demos/demo-results.md``; the README embeds it unchanged between the markers below. To
refresh both: run that command, then paste the file between the markers.
"""

from __future__ import annotations

import re
from pathlib import Path

from tierflow.demos.local import RESULT_HEADERS, STRATEGIES, StrategyRun, results_markdown
from tierflow.link.spec import LinkSpec

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "demos" / "demo-results.md"
BEGIN = "<!-- demo-results: begin (demos/demo-results.md, from tierflow demo --results-md) -->"
END = "<!-- demo-results: end -->"


def _table(text: str) -> list[list[str]]:
    """The cells of the one Markdown table in ``text``."""
    rows = [line for line in text.splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows]


def test_the_readme_embeds_the_committed_results_unchanged() -> None:
    readme = (ROOT / "README.md").read_text()
    assert readme.count(BEGIN) == 1 and readme.count(END) == 1, "one results block in README"
    embedded = readme.split(BEGIN)[1].split(END)[0]
    assert embedded.strip("\n") == RESULTS.read_text().strip("\n"), (
        "README.md's demo results differ from demos/demo-results.md: paste the file "
        "between the markers"
    )


def test_the_committed_results_have_the_demos_columns_and_strategies() -> None:
    text = RESULTS.read_text()
    header, separator, *rows = _table(text)
    assert tuple(header) == RESULT_HEADERS
    assert set(separator) == {"---"}
    assert tuple(row[0] for row in rows) == STRATEGIES
    assert all(len(row) == len(RESULT_HEADERS) for row in rows)
    assert re.match(r"`tierflow demo`, \d+ held-out frames per strategy, links ", text)
    for row in rows:
        assert row[-1] == "0", f"{row[0]}: the committed run had failures"


def _run(name: str, p50: float) -> StrategyRun:
    run = StrategyRun(name, latencies_ms=[p50, p50 * 1.5], correct=2, agree=2, answered=2)
    run.bytes = {"device-edge": 8192, "edge-cloud": 0}
    run.answered_by = {"edge": 2}
    run.throughput_rps = 50.0
    return run


def test_results_markdown_writes_the_table_the_demo_prints() -> None:
    runs = [_run(name, 10.0 + i) for i, name in enumerate(STRATEGIES)]
    links = {"device-edge": LinkSpec.parse("20mbit,4ms"), "edge-cloud": LinkSpec.parse("1gbit")}
    note = "tierflow against edge-only: p50 10.0 against 13.0 ms"
    text = results_markdown(runs, [note], links, 16)
    header, _, *rows = _table(text)
    assert tuple(header) == RESULT_HEADERS
    assert rows[0] == [
        "tierflow", "100.0%", "100.0%", "12.50", "14.75", "50.0", "4,096", "0", "edge 2", "0"
    ]  # fmt: skip
    assert text.startswith("`tierflow demo`, 2 held-out frames per strategy, links device-edge=")
    assert f"- {note}\n" in text
    assert "req/s: 16 requests in flight." in text


def test_the_readme_keeps_no_other_demo_table() -> None:
    """No hand-copied table beside the embedded one (the old one had a column, ``tiers
    (codec)``, that the demo never printed)."""
    readme = (ROOT / "README.md").read_text()
    outside = readme.split(BEGIN)[0] + readme.split(END)[-1]
    assert "| strategy |" not in outside
