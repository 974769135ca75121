"""Writing results: a delimited section of a report, replaced in place.

Several suites write one section each of ``results/RESULTS.md`` (the comparison writes
the rest): each owns the text between its two markers and leaves everything else alone.
"""

from __future__ import annotations

from collections.abc import Sequence
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
