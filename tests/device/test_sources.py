"""Frame sources: ``.npy`` arrays read from a real pipe, which cannot seek."""

from __future__ import annotations

import contextlib
import io
import os
import threading
from collections.abc import Iterator
from typing import BinaryIO

import numpy as np
import pytest

from tierflow.device.sources import Frame, stdin_frames
from tierflow.errors import InputError


def _npy(*arrays: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    for array in arrays:
        np.save(buffer, array)
    return buffer.getvalue()


def _through_a_pipe(data: bytes) -> Iterator[BinaryIO]:
    """The read end of an os.pipe that a thread fills with ``data``, then closes."""
    read_fd, write_fd = os.pipe()

    def write() -> None:
        # Blocks while the pipe is full: the reader drains it (or stops early: EPIPE).
        with contextlib.suppress(BrokenPipeError), os.fdopen(write_fd, "wb") as writer:
            writer.write(data)

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    with os.fdopen(read_fd, "rb") as reader:
        assert not reader.seekable()
        yield reader
    writer.join(timeout=10)


def _frames(data: bytes) -> list[Frame]:
    pipe = _through_a_pipe(data)
    try:
        return list(stdin_frames(next(pipe)))
    finally:
        pipe.close()


def test_npy_arrays_are_read_from_a_pipe() -> None:
    rng = np.random.default_rng(1)
    picture = rng.integers(0, 256, (224, 224, 3), dtype=np.uint8)  # 147 KiB: several pipe fills
    tensor = rng.standard_normal((1, 3, 32, 32)).astype(np.float32)
    column = np.asfortranarray(rng.standard_normal((5, 7)))
    scalar = np.array(16000, np.int64)
    big_endian = np.arange(6, dtype=">i4")
    frames = _frames(_npy(picture, tensor, column, scalar, big_endian))
    assert [f.source for f in frames] == [0, 1, 2, 3, 4]
    np.testing.assert_array_equal(frames[0].image, picture)
    for frame, array in zip(frames[1:], (tensor, column, scalar, big_endian), strict=True):
        assert frame.tensor is not None and frame.tensor.dtype == array.dtype
        np.testing.assert_array_equal(frame.tensor, array)


def test_an_empty_pipe_has_no_frames() -> None:
    assert _frames(b"") == []


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"P6\n224 224\n255\n", r"stdin item 0 is not a \.npy array: it starts with"),
        (_npy(np.ones(4))[:-3], r"stdin item 0 ends after 29 of its 32 data bytes"),
        (_npy(np.ones(4))[:20], r"stdin item 0 has a malformed \.npy header"),
        (_npy(np.ones(2)) + b"\x93NUMPY\x01", r"stdin item 1 is not a \.npy array"),
    ],
    ids=["ppm", "short-data", "short-header", "short-magic"],
)
def test_what_is_not_a_whole_npy_array_is_named(data: bytes, message: str) -> None:
    with pytest.raises(InputError, match=message):
        _frames(data)


def test_pickled_objects_are_refused() -> None:
    buffer = io.BytesIO()
    np.save(buffer, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(InputError, match="holds Python objects"):
        _frames(buffer.getvalue())
