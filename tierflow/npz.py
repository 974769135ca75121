"""Reading ``IN.npz`` into requests: the one reader ``plan --sample`` and ``run`` share.

``IN.npz`` holds one array per model input with a leading request axis (docs/design.md,
"Command line"); a calibration file may add a ``labels`` array. Planning and
running read it with these functions, so a file that plans also runs, row for row.

[Note: request rows]
Request ``i`` of input ``name`` is ``a[i]`` kept as an array of its own rank, so the row
of a scalar input (an audio model's ``sr: int64[]``, stored as ``a.shape == (N,)``) stays
0-D; ``np.ascontiguousarray`` would make it 1-D. When every input of rank one or more has
exactly one dimension fewer than the model declares, each row gains a batch dimension of
1 (rank-0 inputs never do); ``OUT.npz`` then drops it again. Inputs must agree on that:
some rows with and some without a batch dimension is an error, never a guess.

Only numpy is needed: the device runtime reads requests with it.
"""

from __future__ import annotations

import zipfile
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from tierflow.errors import InputError

LABELS = "labels"


_ZIP_MAGIC = (b"PK\x03\x04", b"PK\x05\x06")  # a zip's first member; an empty zip
_NPY_MAGIC = b"\x93NUMPY"


def read_archive(path: str | Path, what: str = "input file") -> dict[str, np.ndarray]:
    """Every array in the ``.npz`` archive at ``path``; one clear InputError otherwise.

    A ``.npy`` file (one array, where an archive of named arrays is expected) and a file
    that is no zip archive are told apart before numpy reads them: ``np.load`` returns a
    ``.npy`` as a bare array (no context manager) and takes any other file for a pickle.
    ``what`` names the file in messages ("input file", "calibration data").
    """
    path = Path(path)
    try:
        with path.open("rb") as file:
            head = file.read(len(_NPY_MAGIC))
    except FileNotFoundError as exc:
        raise InputError(f"{what} {path} does not exist") from exc
    except OSError as exc:
        raise InputError(f"cannot read {what} {path}: {exc.strerror or exc}") from exc
    expected = "one array per model input, as numpy.savez(PATH, NAME=array, ...) writes"
    if head.startswith(_NPY_MAGIC):
        raise InputError(
            f"{what} {path} is a .npy file (a single unnamed array); expected an .npz "
            f"archive of {expected}"
        )
    if not head.startswith(_ZIP_MAGIC):
        found = "is empty" if not head else f"starts with {head!r}"
        raise InputError(f"{what} {path} is not an .npz archive (it {found}); expected {expected}")
    try:
        with np.load(path, allow_pickle=False) as archive:
            arrays = {name: archive[name] for name in archive.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise InputError(f"cannot read {what} {path} as .npz: {exc}") from exc
    for name, array in arrays.items():
        if not isinstance(array, np.ndarray):  # a zip member that is no .npy
            raise InputError(f"{what} {path} holds {name!r}, which is not a .npy array")
    return arrays


def read_arrays(path: str | Path) -> dict[str, np.ndarray]:
    """Every array in ``path`` except ``labels``; each with a non-empty request axis."""
    arrays = {name: a for name, a in read_archive(path).items() if name != LABELS}
    if not arrays:
        raise InputError(f"input file {path} holds no input arrays")
    for name, array in arrays.items():
        if array.ndim == 0 or array.shape[0] == 0:
            raise InputError(
                f"array {name!r} in {path} has shape {array.shape}; expected a leading "
                "request axis with at least one request"
            )
    return arrays


def request_count(arrays: Mapping[str, np.ndarray], names: Sequence[str], path: str | Path) -> int:
    """The number of requests: the same along the first axis of every named input."""
    missing = [name for name in names if name not in arrays]
    if missing:
        raise InputError(
            f"{path} lacks model inputs {missing}: expected arrays {list(names)}, "
            f"found {sorted(arrays)}"
        )
    counts = {name: int(arrays[name].shape[0]) for name in names}
    if len(set(counts.values())) != 1:
        raise InputError(
            f"every input in {path} needs the same number of requests on its first axis; "
            f"found {counts}"
        )
    return next(iter(counts.values()))


def adds_batch(
    arrays: Mapping[str, np.ndarray], ranks: Mapping[str, int | None], path: str | Path
) -> bool:
    """Whether rows gain a batch dimension of 1 (see [Note: request rows]).

    ``ranks`` maps each model input to its declared rank, None where unknown (its rows
    are then taken as they are).
    """
    votes: dict[str, bool] = {}
    for name, rank in ranks.items():
        row_rank = arrays[name].ndim - 1
        if rank is None or rank == 0:
            if rank == 0 and row_rank != 0:
                raise InputError(
                    f"input {name!r} is a scalar; {path} holds requests of shape "
                    f"{arrays[name].shape[1:]} (expected an array of shape (N,))"
                )
            continue
        if row_rank == rank:
            votes[name] = False
        elif row_rank == rank - 1:
            votes[name] = True
        else:
            raise InputError(
                f"input {name!r} has rank {rank}; {path} holds requests of rank {row_rank} "
                f"(shape {arrays[name].shape[1:]}); expected rank {rank} or {rank - 1}"
            )
    if len(set(votes.values())) > 1:
        raise InputError(
            f"inputs in {path} disagree on a batch dimension: model ranks {dict(ranks)}, "
            f"request ranks { {n: arrays[n].ndim - 1 for n in ranks} }"
        )
    return any(votes.values())


def request(
    arrays: Mapping[str, np.ndarray],
    ranks: Mapping[str, int | None],
    index: int,
    *,
    batch: bool,
) -> dict[str, np.ndarray]:
    """Request ``index``: one contiguous array per input, of the row's own rank.

    With ``batch`` a row one dimension short of its input's rank gains a leading 1.
    """
    feeds: dict[str, np.ndarray] = {}
    for name, rank in ranks.items():
        row = np.array(arrays[name][index], copy=True, order="C")
        feeds[name] = row[np.newaxis] if batch and row.ndim + 1 == rank else row
    return feeds


def read_requests(
    path: str | Path, ranks: Mapping[str, int | None]
) -> tuple[list[dict[str, np.ndarray]], bool]:
    """The requests in ``path`` for inputs of these ranks, and whether a batch was added."""
    arrays = read_arrays(path)
    count = request_count(arrays, list(ranks), path)
    batch = adds_batch(arrays, ranks, path)
    return [request(arrays, ranks, i, batch=batch) for i in range(count)], batch
