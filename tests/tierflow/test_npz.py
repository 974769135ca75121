"""IN.npz rows as plan and run read them ([Note: request rows] in tierflow/npz.py)."""

from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np
import pytest

from tierflow.errors import InputError
from tierflow.npz import read_archive, read_arrays, read_requests


def test_scalar_rows_stay_scalar_and_others_gain_a_batch(tmp_path: Path) -> None:
    path = tmp_path / "in.npz"
    x = np.arange(6, dtype=np.float32).reshape(3, 2)
    np.savez(path, x=x, sr=np.array([16000, 8000, 16000]), labels=np.arange(3))
    requests, batch = read_requests(path, {"x": 2, "sr": 0})
    assert batch
    assert [r["sr"].shape for r in requests] == [()] * 3
    assert [int(r["sr"]) for r in requests] == [16000, 8000, 16000]
    assert [r["x"].shape for r in requests] == [(1, 2)] * 3
    np.testing.assert_array_equal(requests[2]["x"][0], x[2])
    assert all(r["x"].flags.c_contiguous for r in requests)
    requests, batch = read_requests(path, {"x": 1, "sr": 0})
    assert not batch and requests[0]["x"].shape == (2,)


def test_disagreeing_or_wrong_ranks_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "in.npz"
    np.savez(path, a=np.zeros((2, 3)), b=np.zeros((2, 1, 3)), s=np.zeros((2, 1)))
    with pytest.raises(InputError, match="disagree on a batch dimension"):
        read_requests(path, {"a": 2, "b": 2})
    with pytest.raises(InputError, match="'s' is a scalar"):
        read_requests(path, {"s": 0})
    with pytest.raises(InputError, match="rank 4"):
        read_requests(path, {"a": 4})
    with pytest.raises(InputError, match="lacks model inputs"):
        read_requests(path, {"c": 1})
    np.savez(path, a=np.zeros((2, 3)), b=np.zeros((3, 3)))
    with pytest.raises(InputError, match="same number of requests"):
        read_requests(path, {"a": 2, "b": 2})
    np.savez(path, a=np.zeros(()))
    with pytest.raises(InputError, match="leading request axis"):
        read_arrays(path)


def test_what_is_not_an_npz_archive_is_named(tmp_path: Path) -> None:
    single = tmp_path / "in.npy"
    np.save(single, np.zeros((2, 3), np.float32))
    with pytest.raises(InputError, match=r"in\.npy is a \.npy file .*expected an \.npz archive"):
        read_arrays(single)
    text = tmp_path / "in.csv"
    text.write_text("1,2,3\n")
    with pytest.raises(InputError, match=r"is not an \.npz archive \(it starts with b'1,2,3"):
        read_arrays(text)
    (tmp_path / "empty.npz").write_bytes(b"")
    with pytest.raises(InputError, match=r"is not an \.npz archive \(it is empty\)"):
        read_arrays(tmp_path / "empty.npz")
    with zipfile.ZipFile(tmp_path / "notes.zip", "w") as archive:
        archive.writestr("readme.txt", "not an array")
    with pytest.raises(InputError, match=r"holds 'readme\.txt', which is not a \.npy array"):
        read_arrays(tmp_path / "notes.zip")
    with pytest.raises(InputError, match=r"calibration data .* is a \.npy file"):
        read_archive(single, "calibration data")
    with pytest.raises(InputError, match=r"cannot read input file .*: Is a directory"):
        read_arrays(tmp_path)
