"""Writing results: a delimited section of a report, the machine's load, a time's cell.

Several suites write one section each of ``results/RESULTS.md`` (the comparison writes
the rest): each owns the text between its two markers and leaves everything else alone.

[Note: load average in results]
Every suite records the machine's load one way, under ``load_average``: ``{"start": [1, 5,
15 minutes], "end": [...]}`` (:func:`load_span`), taken when the run began and when it
ended, and says it in its report with :func:`load_words`. Results written before this
hold the 1-minute figure alone, or only one of the two ends.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path


def replace_section(path: Path, start: str, end: str, section: Sequence[str]) -> None:
    """Put ``section`` (its first line ``start``, its last ``end``) into the file at
    ``path`` in place of the one between those markers, or append it; a missing file is
    left missing."""
    if not path.exists():
        return
    text = path.read_text()
    block = "\n".join(section) + "\n"
    if start in text and end in text:
        head, rest = text.split(start, 1)
        _, tail = rest.split(end, 1)
        text = head + block.rstrip("\n") + tail
    else:
        text = text.rstrip("\n") + "\n\n" + block
    path.write_text(text)


def ms(value: float | None) -> str:
    """A time in ms as a table cell: one decimal, whole from 1,000 up, ``–`` for none (or NaN)."""
    if value is None or math.isnan(value):
        return "–"
    return f"{value:,.1f}" if value < 1000 else f"{value:,.0f}"


def load_average() -> list[float]:
    """The 1-, 5- and 15-minute load averages now, to two places."""
    return [round(load, 2) for load in os.getloadavg()]


def load_span(start: Sequence[float]) -> dict[str, list[float]]:
    """A run's ``load_average`` record: ``start`` (:func:`load_average` as it began) and
    now ([Note: load average in results])."""
    return {"start": list(start), "end": load_average()}


def load_words(span: Mapping[str, Sequence[float]] | None) -> str:
    """``1-minute load average 1.4 at the start and 1.6 at the end`` (what the record
    holds; empty without one)."""
    ends = [
        f"{span[end][0]:.1f} at the {end}" for end in ("start", "end") if span and span.get(end)
    ]
    return f"1-minute load average {' and '.join(ends)}" if ends else ""
