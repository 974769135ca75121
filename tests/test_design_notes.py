"""Design notes are spelled one way, every note the code refers to exists where it is said
to be, and every path the code and the docs cite exists.

Longer design reasoning lives in one named note, a line of its own reading
``[Note: name]`` (``# [Note: name]`` in a comment) followed by its text; code refers to
it as ``[Note: name]``, naming the module when it is elsewhere: ``[Note: name] in
device/switching.py`` (a path from the repository's root), ``in tierflow.device.switching``
(the module) or ``in partitioner/`` (a folder holding it). Paths are written from the
repository's root: the tier folders are ``device/``, ``edge/``, ``cloud/``, not
``tierflow/device/`` (that is their import name, ``tierflow.device``).
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parent.parent
NOTE = re.compile(r"\[Note: ([^\]]+)\]")
# Other spellings that crept in before: Note [name], (Note: ...), See Note ...
VARIANT = re.compile(r"Note \[|\(Note:|See Note\b|see Note\b")


def _sources(*patterns: str) -> dict[str, str]:
    """Every tracked Python and Markdown file (and ``patterns``) but this one (its patterns
    are no notes), by its path from the repository's root."""
    listed = subprocess.run(
        ["git", "ls-files", "*.py", "*.md", *patterns],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    this = Path(__file__).resolve()
    paths = {name: ROOT / name for name in listed}
    return {
        name: p.read_text()
        for name, p in paths.items()
        if p.is_file() and not p.is_symlink() and p.resolve() != this
    }


def _flat(text: str) -> str:
    """``text`` with its line breaks (and a comment's ``#`` after one) as single spaces, so
    that a reference wrapping onto the next line reads as one."""
    return re.sub(r"\s*\n\s*(#:?\s*|//\s*)?", " ", text)


def _definitions() -> dict[str, str]:
    """Each note's name and the file that writes it."""
    return {
        match.group(1): name
        for name, text in _sources().items()
        for line in text.splitlines()
        if (match := NOTE.fullmatch(line.strip().removeprefix("#").strip()))
    }


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
        for match in NOTE.finditer(_flat(text)):
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


# A located reference: "[Note: name] in PLACE" or "[Note: name] (PLACE)", PLACE a path
# (with a slash) or a module (tierflow.x.y), maybe quoted as ``code`` or :mod:`code`.
LOCATED = re.compile(r"\[Note: ([^\]]+)\]\)?(?:,? in | \()(?::mod:)?[`']*([\w./-]*[\w/])")


def _package_dirs() -> dict[str, str]:
    """setuptools' package-dir: ``tierflow.device`` lives in ``device/``, and so on."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    mapping: dict[str, str] = pyproject["tool"]["setuptools"]["package-dir"]
    return mapping


def _module_file(module: str, package_dirs: dict[str, str]) -> str:
    """The path of ``module`` (``tierflow.device.switching``) from the repository's root."""
    package = max((p for p in package_dirs if module == p or module.startswith(p + ".")), key=len)
    rest = module.removeprefix(package).strip(".").replace(".", "/")
    base = "/".join(part for part in (package_dirs[package], rest) if part)
    return f"{base}/__init__.py" if (ROOT / base).is_dir() else f"{base}.py"


def _located_references() -> list[tuple[str, str, str]]:
    """Each ``(citing file, note, place)`` whose place is a path or a tierflow module."""
    return [
        (name, match.group(1), match.group(2))
        for name, text in _sources().items()
        for match in LOCATED.finditer(_flat(text))
        if "/" in match.group(2) or match.group(2).startswith("tierflow.")
    ]


def test_a_note_cited_in_a_place_is_written_there() -> None:
    defined = _definitions()
    package_dirs = _package_dirs()
    references = _located_references()
    assert len(references) > 100, "the pattern finds the references written today"
    wrong = []
    for name, note, place in references:
        path = place if "/" in place else _module_file(place, package_dirs)
        where = defined.get(note)
        if where is None:
            continue  # test_every_referenced_note_is_defined_exactly_once says so
        if not (where == path or (path.endswith("/") and where.startswith(path))):
            wrong.append(f"{name}: [Note: {note}] is cited in {place}, but written in {where}")
    assert not wrong, "\n".join(wrong)


# A path from the repository's root: a top-level folder, then a file with an extension or
# a folder with its closing slash ("device/switching.py", "demos/k8s/").
def _cited_paths() -> list[tuple[str, str]]:
    sources = _sources("*.proto", "*.toml", "*.sh", "*.yaml", "*.yml", "*.service", "scripts/*")
    tops = sorted({name.split("/")[0] for name in sources if "/" in name})
    path = re.compile(r"(?<![\w./$~-])((?:" + "|".join(map(re.escape, tops)) + r")/[\w./-]*)")
    cited = []
    for name, text in sources.items():
        if "_pb2" in name:
            continue  # generated: it names the proto by its import path (tierflow/rpc/...)
        for match in path.finditer(text):
            found = match.group(1).rstrip(".")
            if found.endswith("/") or re.search(r"\.\w+$", found):
                cited.append((name, found))
    return cited


def test_every_path_cited_in_code_and_docs_exists() -> None:
    cited = _cited_paths()
    assert any(found == "device/switching.py" for _, found in cited)
    missing = sorted({f"{name}: {found}" for name, found in cited if not (ROOT / found).exists()})
    assert not missing, "paths cited that do not exist:\n" + "\n".join(missing)
