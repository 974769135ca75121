"""Design notes are spelled one way, and every note the code refers to exists.

Longer design reasoning lives in one named note, a line of its own reading
``[Note: name]`` (``# [Note: name]`` in a comment) followed by its text; code refers to
it as ``[Note: name]``, naming the module when it is elsewhere.
"""

from __future__ import annotations

import re
import subprocess
from collections import Counter
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parent.parent
NOTE = re.compile(r"\[Note: ([^\]]+)\]")
# Other spellings that crept in before: Note [name], (Note: ...), See Note ...
VARIANT = re.compile(r"Note \[|\(Note:|See Note\b|see Note\b")


def _sources() -> dict[str, str]:
    """Every tracked Python and Markdown file but this one (its patterns are no notes)."""
    listed = subprocess.run(
        ["git", "ls-files", "*.py", "*.md"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    this = Path(__file__).resolve()
    paths = {name: ROOT / name for name in listed}
    return {name: p.read_text() for name, p in paths.items() if p.is_file() and p.resolve() != this}


def test_every_referenced_note_is_defined_exactly_once() -> None:
    defined: Counter[str] = Counter()
    referenced: dict[str, str] = {}
    for name, text in _sources().items():
        for line in text.splitlines():
            header = line.strip().removeprefix("#").strip()
            match = NOTE.fullmatch(header)
            if match:
                defined[match.group(1)] += 1
        # A reference may wrap onto the next line, of a docstring or of a comment.
        for match in NOTE.finditer(re.sub(r"\s*\n\s*(#\s*)?", " ", text)):
            referenced.setdefault(match.group(1), name)
    assert not [note for note, count in defined.items() if count > 1]
    missing = {note: where for note, where in referenced.items() if note not in defined}
    assert not missing, f"notes referred to but never written: {missing}"


def _found(pattern: re.Pattern[str]) -> list[str]:
    """Each match of ``pattern`` in the sources, as ``file: 'text'``."""
    return [
        f"{name}: {match.group(0)!r}"
        for name, text in _sources().items()
        for match in pattern.finditer(text)
    ]


def test_notes_are_spelled_one_way() -> None:
    assert not _found(VARIANT)


# The project's first design and style guide live outside the repository; what the code
# and tests rely on is in docs/design.md and the README instead.
OUTSIDE = re.compile(r"\.\./shared\b|\bSTYLE\.md\b|\bDESIGN\.md\b")


def test_nothing_cites_a_file_outside_the_repository() -> None:
    assert not _found(OUTSIDE)
