"""Tests for the codecs that spend computation to save bandwidth: int4, int2, sparse, drop."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from tierflow.codec.base import (
    LOW_BIT_CODECS,
    CodecSpec,
    EncodedTensor,
    channel_axis,
    decode,
    encode,
    measure,
)
from tierflow.errors import CodecError

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FLOATS = ("float16", "float32", "float64")
LOSSY_STAGES = [
    CodecSpec(quant, compress, sparse=sparse, drop=drop)
    for quant in ("int8", "int8c", "int4", "int2")
    for compress in ("none", "zstd", "shuffle+zstd")
    for sparse in (False, True)
    for drop in (False, True)
]
LOSSLESS_STAGES = [
    CodecSpec("none", compress, sparse=sparse, drop=drop)
    for compress in ("none", "zstd", "shuffle+zstd")
    for sparse in (False, True)
    for drop in (False, True)
    if sparse or drop
]


@st.composite
def features(draw: st.DrawFn, finite: bool = True) -> np.ndarray:
    """Float arrays like post-ReLU features: many exact zeros, some constant channels,
    -0.0, and (unless ``finite``) NaN and infinities."""
    dtype = draw(st.sampled_from(FLOATS))
    shape = draw(hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=5))
    bound = 60000.0 if dtype == "float16" else 2.0**60
    width = 16 if dtype == "float16" else 32 if dtype == "float32" else 64
    values = st.floats(-bound, bound, width=width) if finite else st.floats(width=width)
    elements = st.one_of(st.just(0.0), st.just(-0.0), st.just(1.5), values)
    array = draw(hnp.arrays(dtype, shape, elements=elements))
    axis = channel_axis(array.ndim)
    if axis is not None and array.size and draw(st.booleans()):
        index = [slice(None)] * array.ndim
        index[axis] = draw(st.integers(0, array.shape[axis] - 1))
        array[tuple(index)] = draw(st.sampled_from([0.0, 2.25, -7.0]))
    return array


def per_channel_scale(encoded: EncodedTensor, spec: CodecSpec, array: np.ndarray) -> np.ndarray:
    """The scale that applies to each element (shape broadcastable to ``array``)."""
    params = encoded.params
    axis = channel_axis(array.ndim)
    channels = 1 if axis is None else array.shape[axis]
    kept = np.ones(channels, bool)
    if spec.drop:
        head = 4 * -(-channels // 32)
        dropped = np.unpackbits(np.frombuffer(params[:head], np.uint8), bitorder="little")
        kept = ~dropped[:channels].astype(bool)
        params = params[head + 4 * int((~kept).sum()) :]
    values = np.frombuffer(params, "<f4").astype(np.float64)
    scale = np.zeros(channels)
    if spec.quant == "int8":  # one scale for the whole (kept) tensor
        scale[kept] = values[0]
    elif axis is None:
        scale[:] = values[0] if kept.all() else 0.0
    else:
        scale[kept] = values[: len(values) // 2]
    if axis is None:
        return scale.reshape(())
    view = [1] * array.ndim
    view[axis] = channels
    return scale.reshape(view)


def check_bound(array: np.ndarray, decoded: np.ndarray, scale: np.ndarray) -> None:
    """``|x - decoded| <= scale / 2``, plus the arithmetic's rounding, on finite ``x``."""
    x = array.astype(np.float64)
    y = decoded.astype(np.float64)
    finite = np.isfinite(x)
    eps = float(np.finfo(np.float64 if array.dtype == np.float64 else np.float32).eps)
    slack = 8 * eps * np.abs(x) + 2.0**-23 * np.abs(x) * (array.dtype == np.float64)
    if array.dtype == np.float16:
        slack = slack + np.abs(y) * float(np.finfo(np.float16).eps)
    error = np.where(finite, np.abs(x - y), 0.0)
    assert np.all(error <= np.broadcast_to(scale, x.shape) / 2 + slack)


# --------------------------------------------------------------------------- bounds


@FAST
@given(array=features(), spec=st.sampled_from(LOSSY_STAGES))
def test_quantisers_stay_within_half_a_step_after_every_stage(
    array: np.ndarray, spec: CodecSpec
) -> None:
    encoded = encode("x", array, spec)
    decoded = decode(encoded)
    assert encoded.codec == str(spec)
    assert decoded.dtype == array.dtype and decoded.shape == array.shape
    check_bound(array, decoded, per_channel_scale(encoded, spec, array))
    bits = array.view(f"u{array.dtype.itemsize}")
    if spec.sparse:  # skipped elements (+0.0 exactly) come back exactly
        assert np.all(decoded[bits == 0].view(bits.dtype) == 0)


@FAST
@given(array=features(finite=False), spec=st.sampled_from(LOSSLESS_STAGES))
def test_sparse_and_drop_alone_are_bit_exact(array: np.ndarray, spec: CodecSpec) -> None:
    encoded = encode("x", array, spec)
    decoded = decode(encoded)
    assert spec.lossless and spec.bit_exact
    assert decoded.dtype == array.dtype and decoded.tobytes() == array.tobytes()


@FAST
@given(array=features(), bits=st.sampled_from([4, 2]))
def test_low_bit_scale_spans_each_channel(array: np.ndarray, bits: int) -> None:
    encoded = encode("x", array, f"int{bits}")
    scale = per_channel_scale(encoded, CodecSpec.parse(f"int{bits}"), array)
    axis = channel_axis(array.ndim)
    if array.size:
        reduce = None if axis is None else tuple(i for i in range(array.ndim) if i != axis)
        span = np.max(array, reduce, keepdims=True).astype(np.float64) - np.min(
            array, reduce, keepdims=True
        )
        assert np.all(scale * ((1 << bits) - 1) >= span.reshape(np.shape(scale)) - 1e-30)


# --------------------------------------------------------------------------- bytes


def relu_features(seed: int = 0) -> np.ndarray:
    """(2, 16, 8, 8) float32 post-ReLU-like features with 4 dead (all-zero) channels."""
    rng = np.random.default_rng(seed)
    array = np.maximum(rng.standard_normal((2, 16, 8, 8)), 0).astype(np.float32)
    array[:, :4] = 0.0
    return array


def test_low_bit_codes_are_packed_low_bits_first() -> None:
    array = np.array([[0.0, 1.0, 2.0, 3.0, 3.0]], np.float32)  # one channel per column
    assert encode("x", array.T, "int2").data == bytes([0b11100100, 0b11])
    assert len(encode("x", relu_features(), "int4").data) == 2 * 16 * 8 * 8 // 2
    assert len(encode("x", relu_features(), "int2").data) == 2 * 16 * 8 * 8 // 4


def test_sparse_and_drop_shrink_relu_features() -> None:
    array = relu_features()
    sizes = {c: encode("x", array, c).nbytes for c in ("int8", "sparse+int8", "drop+int8")}
    nonzero = int(np.count_nonzero(array))
    assert sizes["sparse+int8"] == array.size // 8 + nonzero + 8
    assert sizes["drop+int8"] == 2 * 12 * 8 * 8 + 4 + 4 * 4 + 8  # mask, 4 values, params
    assert sizes["sparse+int8"] < sizes["int8"] and sizes["drop+int8"] < sizes["int8"]


def test_drop_keeps_float64_constants_float32_cannot_hold() -> None:
    array = np.zeros((1, 3, 2, 2))
    array[:, 1] = 0.1  # not a float32 value: stays in the payload
    array[:, 2] = 0.5
    encoded = encode("x", array, "drop")
    assert len(encoded.data) == 4 * 8  # channels 0 and 2 dropped
    assert decode(encoded).tobytes() == array.tobytes()


def test_measure_reports_low_bit_codecs() -> None:
    arrays = [relu_features(seed) for seed in range(3)]
    stats = {c: measure(c, arrays, repeats=1) for c in LOW_BIT_CODECS}
    assert all(s.ratio > 2 for s in stats.values())
    assert min(s.ratio for c, s in stats.items() if "int4" in c or "int2" in c) > 10
    assert stats["sparse+zstd"].max_abs_error == 0.0
    assert stats["int2+zstd"].max_abs_error > stats["sparse+int4+zstd"].max_abs_error > 0
    assert all(CodecSpec.parse(c) for c in LOW_BIT_CODECS)


# --------------------------------------------------------------------------- hostile input


@pytest.mark.parametrize(
    ("codec", "change", "message"),
    [
        ("int4", {"data": b"\x00" * 63 + b"\xf0"}, "padding"),  # a 127-element tensor
        ("int4", {"data": b"\x00" * 63}, "raw payload"),
        ("sparse+int8", {"data": b"\xff" * 15 + b"\x7f"}, "value bytes"),
        ("sparse+int8", {"data": b"\x00" * 15 + b"\x80"}, "beyond the tensor"),
        ("sparse", {"data": b"\x00" * 15}, "raw payload"),
        ("drop+int8", {"params": b"\x00\x00\x00"}, "channel mask"),
        ("drop+int8", {"params": b"\x01\x00\x00\x00"}, "dropped-channel values"),
        ("drop+int8", {"params": b"\x00\x00\x00\x80" + b"\x00" * 8}, "beyond the tensor"),
        ("drop+int8", {"params": b"\x01\x00\x00\x00\x00\x00\xc0\x7f" + b"\x00" * 8}, "finite"),
        ("drop+int8c", {"params": b"\x00\x00\x00\x00" + b"\x00" * 4}, "quantiser parameter"),
        ("sparse+int8", {"dtype": "int32"}, "not float"),
    ],
)
def test_decode_refuses_hostile_stages(codec: str, change: dict[str, object], message: str) -> None:
    array = np.linspace(0, 1, 127, dtype=np.float32).reshape(127, 1)
    tensor = dataclasses.replace(encode("x", array, codec), **change)  # type: ignore[arg-type]
    with pytest.raises(CodecError, match=message):
        decode(tensor)


def test_dropped_value_must_fit_float16() -> None:
    array = np.zeros((2, 3), np.float16)
    tensor = encode("x", array, "drop")
    big = (
        np.frombuffer(tensor.params[:4], np.uint8).tobytes()
        + np.array([1e6, 0, 0], "<f4").tobytes()
    )
    with pytest.raises(CodecError, match="float16"):
        decode(dataclasses.replace(tensor, params=big))


def test_sparse_frame_declaring_more_than_the_bound_is_refused() -> None:
    tensor = encode("x", relu_features(), "sparse+int8+zstd")
    bound = 2 * 16 * 8 * 8 // 8 + 2 * 16 * 8 * 8
    frame = zstandard.ZstdCompressor().compress(bytes(bound + 1))
    with pytest.raises(CodecError, match="declares"):
        decode(dataclasses.replace(tensor, data=frame))


@settings(max_examples=200, deadline=None)
@given(
    spec=st.sampled_from(LOSSY_STAGES + LOSSLESS_STAGES),
    field=st.sampled_from(["data", "params"]),
    position=st.integers(0, 1 << 16),
    value=st.integers(0, 255),
    cut=st.integers(0, 1 << 16),
)
def test_mutated_stages_raise_codec_error_or_decode_validly(
    spec: CodecSpec, field: str, position: int, value: int, cut: int
) -> None:
    tensor = encode("x", relu_features()[:, :6, :3, :3], spec)
    blob = bytearray(getattr(tensor, field))
    if blob:
        blob[position % len(blob)] = value
    if cut % 4 == 0:
        blob = blob[: cut % (len(blob) + 1)]
    try:
        decoded = decode(dataclasses.replace(tensor, **{field: bytes(blob)}), max_bytes=1 << 16)
    except CodecError:
        return
    assert decoded.shape == tensor.shape and decoded.dtype == np.float32
    assert math.prod(decoded.shape) == 2 * 6 * 3 * 3
