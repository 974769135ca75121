"""The byte family's text: Python's own standard library sources, and bytes as token ids.

Every machine that runs tierflow has a Python standard library, so the corpus needs no
download: the top-level ``*.py`` files of :func:`sysconfig.get_paths` ``["stdlib"]``
(168 files, 4.7 MB on CPython 3.11), in sorted order. One file in ten, chosen by a hash of
its name, is held out; :func:`load_corpus` returns both parts as bytes and a digest of the
files it read (CPython versions differ, so the digest keys the trained models' cache).

Token ids are the bytes of UTF-8 text (:func:`encode`, :func:`decode`,
:class:`StreamDecoder`): no tokenizer file, and one vocabulary (256) for every size.
Standard library only: no numpy, no torch.
"""

from __future__ import annotations

import codecs
import hashlib
import sysconfig
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from tierflow.errors import ModelError

#: One file in this many is held out (by a CRC of its name, so the split never shifts).
HELDOUT_EVERY = 10


@dataclass(frozen=True)
class Corpus:
    """Training and held-out bytes, the files they came from and a digest of them all."""

    train: bytes
    heldout: bytes
    train_files: tuple[str, ...]
    heldout_files: tuple[str, ...]
    digest: str
    source: str


def stdlib_dir() -> Path:
    """This interpreter's standard library folder."""
    return Path(sysconfig.get_paths()["stdlib"])


def load_corpus(directory: Path | None = None) -> Corpus:
    """Read the standard library's top-level sources and split them into train and held-out.

    Files are joined with a blank line between them. Raises :class:`ModelError` when the
    folder holds no Python sources (a stripped interpreter).
    """
    root = directory or stdlib_dir()
    files = sorted(p for p in root.glob("*.py") if p.is_file())
    if not files:
        raise ModelError(f"no Python sources in {root}: the byte family trains on them")
    digest = hashlib.sha256()
    train: list[bytes] = []
    heldout: list[bytes] = []
    train_names: list[str] = []
    heldout_names: list[str] = []
    for path in files:
        data = path.read_bytes()
        digest.update(path.name.encode() + b"\0" + data)
        if zlib.crc32(path.name.encode()) % HELDOUT_EVERY == 0:
            heldout.append(data)
            heldout_names.append(path.name)
        else:
            train.append(data)
            train_names.append(path.name)
    if not train or not heldout:
        raise ModelError(f"{root} has too few Python sources to hold one in ten out")
    return Corpus(
        train=b"\n\n".join(train),
        heldout=b"\n\n".join(heldout),
        train_files=tuple(train_names),
        heldout_files=tuple(heldout_names),
        digest=digest.hexdigest(),
        source=str(root),
    )


def encode(text: str) -> list[int]:
    """Token ids of ``text``: its UTF-8 bytes."""
    return list(text.encode("utf-8"))


def decode(ids: Iterable[int]) -> str:
    """Text of token ids; bytes that are not valid UTF-8 become U+FFFD."""
    return bytes(ids).decode("utf-8", errors="replace")


class StreamDecoder:
    """Text of token ids as they arrive: a character split over tokens waits for its last byte."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token: int) -> str:
        """The text this token completes (often one character, sometimes none)."""
        return str(self._decoder.decode(bytes([token])))

    def flush(self) -> str:
        """Whatever an unfinished character left, as U+FFFD."""
        return str(self._decoder.decode(b"", final=True))
