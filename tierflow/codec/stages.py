"""The codec's pipeline for tensors: drop constant channels, skip zeros, quantise, compress.

:mod:`tierflow.codec.base` is the interface; this module runs the stages a
:class:`~tierflow.codec.spec.CodecSpec` names, in order on the sender and in reverse on the
receiver: ``drop`` (channels constant on the tensor leave the payload; their values go
in ``params``), ``sparse`` (a bitmap of the nonzero elements, then those elements only),
the quantiser and the compressor (:mod:`tierflow.codec.schemes`). :func:`layout` reads
and checks everything a header declares before any allocation, as [Note: decoding
hostile input] requires; [Note: codec wire format] says what the bytes are.

Only numpy and zstandard are needed: every tier imports this module.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np

from tierflow.codec.schemes import (
    QUANTISER_SCHEMES,
    Quantiser,
    channel_axis,
    compress_payload,
    decompress_payload,
    shuffle_bytes,
    unshuffle_bytes,
)
from tierflow.codec.spec import CodecSpec
from tierflow.errors import CodecError

_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_NO_VALUES = np.zeros(0, np.float32)


def _channels(shape: tuple[int, ...]) -> tuple[int | None, int]:
    """The drop stage's channel axis and channel count (a 0-D/1-D tensor is one channel)."""
    axis = channel_axis(len(shape))
    return axis, 1 if axis is None else shape[axis]


def _mask_len(channels: int) -> int:
    """Bytes of the dropped-channel bitmap in ``params``: whole float32 slots."""
    return 4 * -(-channels // 32)


# --------------------------------------------------------------------------- drop


def drop_constant_channels(array: np.ndarray) -> tuple[bytes, np.ndarray]:
    """``params`` of the drop stage and the array without its constant channels.

    A channel is dropped when all its elements have the same bits, the value is finite
    and float32 holds it exactly (so that dropping is lossless for every float dtype).
    """
    axis, channels = _channels(array.shape)
    bits = array.view(_UNSIGNED[array.dtype.itemsize])
    if array.size == 0:
        constant = np.zeros(channels, bool)
        values = np.zeros(channels, np.float64)
    else:
        reduce = None if axis is None else tuple(i for i in range(array.ndim) if i != axis)
        constant = np.atleast_1d(bits.min(axis=reduce) == bits.max(axis=reduce))
        first = np.atleast_1d(array[(0,) * array.ndim] if axis is None else _first(array, axis))
        with np.errstate(over="ignore", invalid="ignore"):  # NaN is not exact: not dropped
            values = first.astype(np.float64)  # a NaN of another byte order warns here
            exact = np.isfinite(values) & (values.astype(np.float32).astype(np.float64) == values)
        constant &= exact
    mask = np.zeros(_mask_len(channels), np.uint8)
    mask[: -(-channels // 8)] = np.packbits(constant, bitorder="little")
    params = mask.tobytes() + values[constant].astype("<f4").tobytes()
    if not constant.any():
        return params, array
    if axis is None:
        return params, np.zeros(0, array.dtype)
    return params, np.ascontiguousarray(np.compress(~constant, array, axis=axis))


def _first(array: np.ndarray, axis: int) -> np.ndarray:
    """The first element of every channel."""
    index: list[Any] = [0] * array.ndim
    index[axis] = slice(None)
    return array[tuple(index)]


def _restore_channels(
    reduced: np.ndarray, shape: tuple[int, ...], dropped: np.ndarray, values: np.ndarray
) -> np.ndarray:
    axis, _ = _channels(shape)
    if not dropped.any():
        return reduced
    out = np.empty(shape, reduced.dtype)
    if axis is None:
        out[...] = values[0]
        return out
    moved = np.moveaxis(out, axis, 0)
    moved[~dropped] = np.moveaxis(reduced, axis, 0)
    moved[dropped] = values.astype(out.dtype).reshape((-1,) + (1,) * (len(shape) - 1))
    return out


# --------------------------------------------------------------------------- layout


class Layout(NamedTuple):
    """What a header declares, checked: the payload's bounds and the stages' parameters."""

    shape: tuple[int, ...]  # the tensor's shape
    kept_shape: tuple[int, ...]  # its shape once constant channels are dropped
    dropped: np.ndarray | None  # bool per channel (drop stage), else None
    values: np.ndarray  # the dropped channels' values (float32)
    quant_params: bytes
    bitmap_len: int  # sparse: bytes of the nonzero bitmap, else 0
    payload_max: int  # bytes the decompressed payload may have at most
    payload_min: int  # ... and at least


def layout(codec: CodecSpec, shape: tuple[int, ...], dtype: str, params: bytes) -> Layout:
    """Check ``params`` against ``shape`` for ``codec`` and derive the payload's bounds.

    Cheap: work and memory proportional to ``params`` (one value per channel at most).
    """
    quantiser = QUANTISER_SCHEMES[codec.quant]
    dropped: np.ndarray | None = None
    values = _NO_VALUES
    kept_shape = shape
    if codec.drop:
        axis, channels = _channels(shape)
        head = _mask_len(channels)
        if len(params) < head:
            raise CodecError(
                f"codec {codec} needs a {head}-byte channel mask in params, found {len(params)}"
            )
        mask = np.frombuffer(params, np.uint8, head)
        bits = np.unpackbits(mask, bitorder="little")
        if bits[channels:].any():
            raise CodecError("the dropped-channel mask marks channels beyond the tensor's")
        dropped = bits[:channels].astype(bool)
        count = int(dropped.sum())
        if len(params) < head + 4 * count:
            raise CodecError(f"codec {codec} needs {count} dropped-channel values in params")
        values = np.frombuffer(params, "<f4", count, head)
        if not np.isfinite(values).all():
            raise CodecError("a dropped channel's value is not finite")
        if dtype == "float16" and np.abs(values).max(initial=0) > np.finfo(np.float16).max:
            raise CodecError("a dropped channel's value does not fit float16")
        params = params[head + 4 * count :]
        if axis is None:
            kept_shape = (0,) if count else shape
        else:
            kept_shape = (*shape[:axis], channels - count, *shape[axis + 1 :])
    need = quantiser.params_len(kept_shape)
    if len(params) != need:
        raise CodecError(
            f"codec {codec} needs {need} quantiser parameter bytes, found {len(params)}"
        )
    elements = math.prod(kept_shape)
    bitmap_len = -(-elements // 8) if codec.sparse else 0
    payload_max = bitmap_len + quantiser.payload_len(elements, dtype)
    return Layout(
        shape=shape,
        kept_shape=kept_shape,
        dropped=dropped,
        values=values,
        quant_params=params,
        bitmap_len=bitmap_len,
        payload_max=payload_max,
        payload_min=bitmap_len if codec.sparse else payload_max,
    )


# --------------------------------------------------------------------------- pipeline


def _nonzero(array: np.ndarray) -> np.ndarray:
    """Elements whose bits are not all zero (-0.0 is kept: it is not +0.0's bits)."""
    return array.reshape(-1).view(_UNSIGNED[array.dtype.itemsize]) != 0


def encode_payload(array: np.ndarray, codec: CodecSpec) -> tuple[bytes, bytes]:
    """``params`` and ``data`` of a C-ordered little-endian array under ``codec``."""
    quantiser = QUANTISER_SCHEMES[codec.quant]
    params = b""
    if codec.drop:
        params, array = drop_constant_channels(array)
    quant_params, stored = quantiser.encode(array)
    params += quant_params
    if codec.sparse:
        keep = _nonzero(array)
        values = quantiser.pack(stored.reshape(-1)[keep])
        bitmap = np.packbits(keep, bitorder="little")
    else:
        values = quantiser.pack(stored)
        bitmap = np.zeros(0, np.uint8)
    if codec.compress == "shuffle+zstd" and not quantiser.bits:
        values = shuffle_bytes(values, stored.dtype.itemsize)
    payload = np.concatenate([bitmap, values]) if codec.sparse else values
    return params, compress_payload(payload, codec)


def decode_payload(
    data: bytes, codec: CodecSpec, plan: Layout, dtype: str, *, writable: bool
) -> np.ndarray:
    """The tensor of a payload whose header :func:`layout` checked; faults: CodecError."""
    quantiser = QUANTISER_SCHEMES[codec.quant]
    raw = decompress_payload(
        data, codec, plan.payload_max, at_least=plan.payload_min if codec.sparse else None
    )
    elements = math.prod(plan.kept_shape)
    keep: np.ndarray | None = None
    if codec.sparse:
        keep = np.unpackbits(raw[: plan.bitmap_len], count=elements, bitorder="little").view(bool)
        if np.unpackbits(raw[: plan.bitmap_len], bitorder="little")[elements:].any():
            raise CodecError("the sparse bitmap marks elements beyond the tensor's")
        stored_count = int(np.count_nonzero(keep))
        raw = raw[plan.bitmap_len :]
        if len(raw) != quantiser.payload_len(stored_count, dtype):
            raise CodecError(
                f"sparse payload holds {len(raw)} value bytes for {stored_count} nonzero "
                f"elements, expected {quantiser.payload_len(stored_count, dtype)}"
            )
    else:
        stored_count = elements
    stored = _unpack(quantiser, raw, codec, stored_count, dtype)
    if keep is not None:
        full = np.zeros(elements, stored.dtype)
        full[keep] = stored
        stored = full
    out = quantiser.decode(
        stored.reshape(plan.kept_shape), plan.quant_params, plan.kept_shape, dtype
    )
    if keep is not None and codec.quant != "none":
        out = np.array(out, dtype=np.dtype(dtype), order="C")
        out.reshape(-1)[~keep] = 0  # skipped elements are exactly +0.0
    if plan.dropped is not None:
        out = _restore_channels(
            np.asarray(out, dtype=np.dtype(dtype)), plan.shape, plan.dropped, plan.values
        )
    native = np.dtype(dtype)
    if out.dtype != native or not out.flags.c_contiguous or (writable and not out.flags.writeable):
        out = np.array(out, dtype=native, order="C")
    return out


def _unpack(
    quantiser: Quantiser, raw: np.ndarray, codec: CodecSpec, count: int, dtype: str
) -> np.ndarray:
    itemsize = quantiser.stored_dtype(dtype).itemsize
    if codec.compress == "shuffle+zstd" and not quantiser.bits:
        raw = unshuffle_bytes(raw, itemsize)
    return quantiser.unpack(raw, count, dtype)
