"""Files of a model cache: written atomically, checked by sha256, built under a lock.

The digits demo (:mod:`.digits`) and the byte decoder family (:mod:`.bytelm_family`)
train once and cache what they trained; two callers at once must neither train twice
nor read a half-written file. Standard library only.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path


def sha256_file(path: Path) -> str:
    """The sha256 (hex) of a file, read in 1 MiB pieces."""
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


@contextlib.contextmanager
def exclusive_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created if needed) while inside."""
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def write_atomic(path: Path, write: Callable[[Path], object]) -> None:
    """Write through ``write(tmp)`` to a temporary file beside ``path``, then rename."""
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        write(tmp)
        os.chmod(tmp, 0o644)  # mkstemp makes files private; the cache is not secret
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
