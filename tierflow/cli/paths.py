"""Where a command writes: checked when the option is parsed, before any work.

``run --report out/r.jsonl`` into a folder that does not exist used to run every
request and then end in a traceback; ``plan -o`` into a place it cannot write profiled
the model first. :func:`output_file` and :func:`output_folder` are those options'
``type=``: they try the place the way the command will use it (a file created and removed
in the folder that will hold the output), so that a missing folder, a file where a folder
is expected or a folder this user cannot write is one line before anything runs. Nothing
is left behind, and a folder ``plan -o`` will create is not created here.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from tierflow.errors import UsageError, shown

#: What ``device --results`` takes for standard output.
STDOUT = "-"


def output_file(text: str) -> Path:
    """A file a command will write: its folder exists and takes files; it is no folder."""
    path = Path(text)
    if path.is_dir():
        raise UsageError(f"cannot write {_shown(text)}: it is a folder; expected a file name")
    _check_folder(text, path.parent if str(path.parent) else Path("."))
    return path


def output_file_or_stdout(text: str) -> str:
    """:func:`output_file`, or ``-`` for standard output (kept as the text)."""
    return text if text == STDOUT else str(output_file(text))


def output_folder(text: str) -> Path:
    """A folder a command will create (with its parents) or fill: the nearest part of it
    that exists is a folder that takes files."""
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise UsageError(f"cannot write {_shown(text)}: it is a file; expected a folder")
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    _check_folder(text, existing)
    return path


def _shown(path: str | Path) -> str:
    return shown(str(path), limit=500)  # a path in full: clipped, it would not say where


def _check_folder(text: str, folder: Path) -> None:
    if not folder.exists():
        raise UsageError(f"cannot write {_shown(text)}: the folder {_shown(folder)} does not exist")
    if not folder.is_dir():
        raise UsageError(f"cannot write {_shown(text)}: {_shown(folder)} is not a folder")
    try:
        with tempfile.TemporaryFile(dir=folder, prefix=".tierflow-write-check-"):
            pass
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise UsageError(
            f"cannot write {_shown(text)}: the folder {_shown(folder)} takes no files "
            f"({reason.lower()})"
        ) from exc
