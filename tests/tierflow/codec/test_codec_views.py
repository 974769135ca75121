"""``decode(..., writable=False)``: what a tier decodes its features with (no copy for raw)."""

from __future__ import annotations

import numpy as np
import pytest

from tierflow.codec.base import decode, encode
from tierflow.errors import CodecError


@pytest.mark.parametrize("codec", ["raw", "zstd", "shuffle+zstd", "fp16", "int8+zstd"])
def test_a_view_decodes_the_same_values_as_a_copy(codec: str) -> None:
    array = np.random.default_rng(0).standard_normal((2, 3, 5)).astype(np.float32)
    tensor = encode("t", array, codec)
    view = decode(tensor, writable=False)
    copy = decode(tensor)
    np.testing.assert_array_equal(view, copy)
    assert view.dtype == copy.dtype and view.shape == copy.shape
    assert view.flags.c_contiguous and copy.flags.writeable


def test_a_raw_view_reads_the_payload_in_place() -> None:
    array = np.arange(12, dtype=np.int64).reshape(3, 4)
    tensor = encode("t", array, "raw")
    view = decode(tensor, writable=False)
    assert not view.flags.writeable  # a view of the immutable payload, not a copy
    assert np.frombuffer(tensor.data, np.uint8).ctypes.data == view.ctypes.data
    np.testing.assert_array_equal(view, array)


def test_a_view_is_validated_like_a_copy() -> None:
    tensor = encode("t", np.zeros((4, 4), np.float32), "raw")
    short = type(tensor)(**{**tensor.__dict__, "data": tensor.data[:-4]})
    with pytest.raises(CodecError, match="raw payload has 60 bytes, expected 64"):
        decode(short, writable=False)
