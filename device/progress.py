"""What ``tierflow run`` has answered so far, kept on disk as it goes, for ``--resume``.

``OUT.npz`` is a zip and cannot grow request by request, so a run appends each answered
request's outputs to ``OUT.npz.partial`` as soon as it has them, and writes ``OUT.npz``
from it at the end (then removes it). A run that is killed keeps the partial file;
``tierflow run --resume`` reads it back, runs only the requests not answered yet and
finishes ``OUT.npz`` as if nothing had happened. See [Note: partial output file].

[Note: partial output file]
A sequence of records, each an 8-byte little-endian length then an ``.npz`` (numpy's own
format, read without pickle) holding the request's index as ``__request__`` and its
outputs under their names. A record cut short by a kill is dropped on reading (and the
file truncated there), so appending after it stays well formed. Failed requests are not
recorded: a resumed run tries them again.
"""

from __future__ import annotations

import io
import os
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import BinaryIO

import numpy as np

from tierflow.errors import UsageError

INDEX_KEY = "__request__"
_LENGTH = struct.Struct("<Q")
# A record larger than this is not one this module wrote: the file is not a partial file.
_MAX_RECORD_BYTES = 1 << 36


def partial_path(output: str | Path) -> Path:
    """Where the answered outputs of a run writing ``output`` are kept while it runs."""
    return Path(f"{output}.partial")


def read_partial(path: Path, *, repair: bool = False) -> dict[int, dict[str, np.ndarray]]:
    """The outputs recorded in ``path`` by request index.

    ``repair`` truncates a record cut short by a kill, so that appending can go on (only
    while no run writes the file).
    """
    answered: dict[int, dict[str, np.ndarray]] = {}
    if not path.exists():
        return answered
    good = 0
    with path.open("rb") as file:
        while True:
            head = file.read(_LENGTH.size)
            if len(head) < _LENGTH.size:
                break
            (length,) = _LENGTH.unpack(head)
            if length > _MAX_RECORD_BYTES:
                raise UsageError(f"{path} is not a tierflow partial output file")
            blob = file.read(length)
            if len(blob) < length:
                break
            try:
                with np.load(io.BytesIO(blob), allow_pickle=False) as record:
                    index = int(record[INDEX_KEY])
                    answered[index] = {n: record[n] for n in record.files if n != INDEX_KEY}
            except (ValueError, OSError, KeyError) as exc:
                raise UsageError(f"{path}: unreadable record at byte {good}: {exc}") from exc
            good = file.tell()
    if repair and good != path.stat().st_size:
        os.truncate(path, good)
    return answered


class PartialWriter:
    """Appends answered requests to a partial output file ([Note: partial output file])."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file: BinaryIO = path.open("ab")

    def add(self, index: int, outputs: Mapping[str, np.ndarray]) -> None:
        """Record request ``index``'s outputs; on disk (in the OS) when this returns."""
        buffer = io.BytesIO()
        np.savez(buffer, **{INDEX_KEY: np.int64(index)}, **dict(outputs))  # type: ignore[arg-type]
        blob = buffer.getvalue()
        self._file.write(_LENGTH.pack(len(blob)) + blob)
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> PartialWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
