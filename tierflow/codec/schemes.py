"""The codec's schemes: the quantisers and the lossless compressor behind the interface.

:mod:`tierflow.codec.base` is the interface (:class:`~tierflow.codec.spec.CodecSpec`, ``encode``,
``decode``, ``measure``); each scheme here is a small class or pair of functions it
dispatches to. A :class:`Quantiser` turns a float array into stored elements plus
parameters and back (:class:`Fp16`; :class:`Affine` codes of 8 bits per tensor or per
channel, of 4 or 2 bits per channel, packed two or four to a byte); the
compressor shuffles bytes and runs zstd (:func:`compress_payload`,
:func:`decompress_payload`). What the bytes are is [Note: codec wire format] and what a
decoder checks is [Note: decoding hostile input], both in :mod:`tierflow.codec.base`.

Only numpy and zstandard are needed: every tier imports this module.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

import numpy as np
import zstandard

from tierflow.codec.spec import CodecSpec
from tierflow.errors import CodecError


@functools.lru_cache(maxsize=64)
def wire_dtype(name: str) -> np.dtype[Any]:
    return np.dtype(name).newbyteorder("<")


# --------------------------------------------------------------------------- quantisers


class Quantiser:
    """Turns a float array into stored elements plus parameters, and back.

    This base class is the identity: what ``none`` (no quantiser) does.
    """

    stored: str | None = None  # dtype of the stored elements; None = the tensor's own
    bits = 0  # codes narrower than a byte are packed; 0: whole stored elements

    def stored_dtype(self, dtype: str) -> np.dtype[Any]:
        return wire_dtype(self.stored or dtype)

    def payload_len(self, count: int, dtype: str) -> int:
        """Bytes that ``count`` stored elements take on the wire."""
        if self.bits:
            per_byte = 8 // self.bits
            return -(-count // per_byte)
        return count * self.stored_dtype(dtype).itemsize

    def pack(self, stored: np.ndarray) -> np.ndarray:
        """Stored elements as the bytes of the wire (codes packed, first in the low bits)."""
        flat = stored.reshape(-1)
        if not self.bits:
            return flat.view(np.uint8)
        per_byte = 8 // self.bits
        padded = np.zeros(-(-flat.size // per_byte) * per_byte, np.uint8)
        padded[: flat.size] = flat
        lanes = padded.reshape(-1, per_byte)
        packed = lanes[:, 0].copy()
        for lane in range(1, per_byte):
            packed |= lanes[:, lane] << np.uint8(lane * self.bits)
        return packed

    def unpack(self, raw: np.ndarray, count: int, dtype: str) -> np.ndarray:
        """Inverse of :meth:`pack`: ``count`` stored elements (1-D) from exactly their bytes."""
        if not self.bits:
            return raw.view(self.stored_dtype(dtype))
        codes = np.take(_unpack_table(self.bits), raw, axis=0).reshape(-1)
        if codes[count:].any():
            raise CodecError(f"packed {self.bits}-bit codes have nonzero padding bits")
        return codes[:count]

    def params_len(self, shape: tuple[int, ...]) -> int:
        return 0

    def encode(self, array: np.ndarray) -> tuple[bytes, np.ndarray]:
        return b"", array

    def decode(
        self, stored: np.ndarray, params: bytes, shape: tuple[int, ...], dtype: str
    ) -> np.ndarray:
        return stored


class Fp16(Quantiser):
    stored = "float16"

    def encode(self, array: np.ndarray) -> tuple[bytes, np.ndarray]:
        with np.errstate(over="ignore", under="ignore", invalid="ignore"):
            return b"", array.astype("<f2")

    def decode(
        self, stored: np.ndarray, params: bytes, shape: tuple[int, ...], dtype: str
    ) -> np.ndarray:
        return stored.astype(np.dtype(dtype))


@functools.lru_cache(maxsize=4)
def _unpack_table(bits: int) -> np.ndarray:
    """(256, 8 // bits): the codes packed in each byte value, lowest bits first.

    A table lookup (``np.take``) unpacks ~10x faster than broadcasting the shifts.
    """
    shifts = np.arange(8 // bits, dtype=np.uint8) * np.uint8(bits)
    table = (np.arange(256, dtype=np.uint8)[:, None] >> shifts) & np.uint8((1 << bits) - 1)
    table.flags.writeable = False
    return table


def channel_axis(ndim: int) -> int | None:
    """The channel axis of a tensor with ``ndim`` dimensions (None: one channel).

    Used by the per-channel quantisers (``int8c``, ``int4``, ``int2``) and ``drop``.
    """
    if ndim >= 4:
        return 1
    if ndim >= 2:
        return ndim - 1
    return None


class Affine(Quantiser):
    """Affine codes of ``bits`` (8, 4 or 2) bits; per tensor, or per channel."""

    stored = "uint8"

    def __init__(self, per_channel: bool, bits: int = 8) -> None:
        self.per_channel = per_channel
        self.bits = 0 if bits == 8 else bits
        self.levels = (1 << bits) - 1
        self.name = f"int{bits}"

    def _axis(self, ndim: int) -> int | None:
        return channel_axis(ndim) if self.per_channel else None

    def channels(self, shape: tuple[int, ...]) -> int:
        axis = self._axis(len(shape))
        return 1 if axis is None else shape[axis]

    def params_len(self, shape: tuple[int, ...]) -> int:
        return 8 * self.channels(shape)

    def encode(self, array: np.ndarray) -> tuple[bytes, np.ndarray]:
        axis = self._axis(array.ndim)
        reduce = None if axis is None else tuple(i for i in range(array.ndim) if i != axis)
        work = np.float64 if array.dtype == np.float64 else np.float32
        if array.size == 0:
            count = self.channels(array.shape)
            params = np.zeros(2 * count, "<f4").tobytes()
            return params, np.zeros(array.shape, np.uint8)
        finite = bool(np.isfinite(array).all())
        if finite:
            low = np.min(array, axis=reduce, keepdims=True)
            high = np.max(array, axis=reduce, keepdims=True)
        else:
            mask = np.isfinite(array)
            low = np.min(array, axis=reduce, keepdims=True, where=mask, initial=np.inf)
            high = np.max(array, axis=reduce, keepdims=True, where=mask, initial=-np.inf)
            none = ~np.isfinite(low)  # a channel with no finite element at all
            low = np.where(none, 0.0, low)
            high = np.where(none, 0.0, high)
        low64 = low.astype(np.float64)
        high64 = high.astype(np.float64)
        largest = float(np.finfo(np.float32).max)
        if low64.min() < -largest or high64.max() > largest:
            raise CodecError(
                f"cannot {self.name}-quantise: the value range exceeds float32 "
                f"(min {float(low64.min())}, max {float(high64.max())})"
            )
        # Offset rounded down in float32 so that no element lies below it.
        offset = low64.astype(np.float32)
        offset = np.where(
            offset.astype(np.float64) > low64, np.nextafter(offset, np.float32(-np.inf)), offset
        )
        # Scale rounded up in float32 so that offset + levels * scale reaches the maximum.
        span = np.maximum(high64 - offset.astype(np.float64), 0.0)
        scale = (span / self.levels).astype(np.float32)
        short = scale.astype(np.float64) * self.levels < span
        scale = np.where(short, np.nextafter(scale, np.float32(np.inf)), scale)
        assert np.isfinite(scale).all() and np.isfinite(offset).all(), (scale, offset)
        scale64 = scale.astype(np.float64)
        inverse = np.divide(1.0, scale64, out=np.zeros_like(scale64), where=scale64 > 0)
        if work == np.float32 and inverse.max() > np.finfo(np.float32).max:
            work = np.float64  # subnormal scales: 1/scale overflows float32
        codes = np.empty(array.shape, work)
        with np.errstate(invalid="ignore", over="ignore"):
            np.subtract(array, offset.astype(work), out=codes)
            np.multiply(codes, inverse.astype(work), out=codes)
            np.rint(codes, out=codes)
            np.clip(codes, 0, self.levels, out=codes)
            if not finite:
                codes[np.isnan(codes)] = 0
        params = np.concatenate([scale.ravel(), offset.ravel()]).astype("<f4").tobytes()
        return params, codes.astype(np.uint8)

    def decode(
        self, stored: np.ndarray, params: bytes, shape: tuple[int, ...], dtype: str
    ) -> np.ndarray:
        count = self.channels(shape)
        values = np.frombuffer(params, "<f4")
        if not np.isfinite(values).all():
            bad = int((~np.isfinite(values)).sum())
            raise CodecError(
                f"malformed {self.name} parameters: {bad} non-finite scales or offsets"
            )
        scale, offset = values[:count], values[count:]
        if (scale < 0).any():
            raise CodecError(f"malformed {self.name} parameters: negative scale {scale.min()}")
        if count:
            top = offset.astype(np.float64) + self.levels * scale.astype(np.float64)
            reach = max(float(np.abs(offset).max()), float(np.abs(top).max()))
            largest = float(np.finfo(np.float16 if dtype == "float16" else np.float32).max)
            if reach > largest * (1 + 2**-10):
                raise CodecError(
                    f"malformed {self.name} parameters: values up to {reach:g} do not fit {dtype}"
                )
        axis = self._axis(len(shape))
        if axis is None:
            scale = scale.reshape(())
            offset = offset.reshape(())
        else:
            view = [1] * len(shape)
            view[axis] = count
            scale = scale.reshape(view)
            offset = offset.reshape(view)
        work = np.float64 if dtype == "float64" else np.float32
        out = np.empty(stored.shape, work)
        np.multiply(stored, scale.astype(work), out=out)
        np.add(out, offset.astype(work), out=out)
        if out.dtype == np.dtype(dtype):
            return out
        with np.errstate(over="ignore"):  # within the margin above float16's largest
            return out.astype(dtype)


QUANTISER_SCHEMES: dict[str, Quantiser] = {
    "none": Quantiser(),
    "fp16": Fp16(),
    "int8": Affine(per_channel=False),
    "int8c": Affine(per_channel=True),
    "int4": Affine(per_channel=True, bits=4),
    "int2": Affine(per_channel=True, bits=2),
}


# --------------------------------------------------------------------------- compressors

_local = threading.local()


def _compressor(level: int) -> zstandard.ZstdCompressor:
    """A compressor for ``level``, one per thread (zstd contexts are not thread-safe)."""
    cache: dict[int, zstandard.ZstdCompressor] | None = getattr(_local, "compressors", None)
    if cache is None:
        cache = _local.compressors = {}
    if level not in cache:
        # threads=0: no worker threads — features are small and latency matters.
        cache[level] = zstandard.ZstdCompressor(
            level=level, write_content_size=True, write_checksum=True, threads=0
        )
    return cache[level]


def _decompressor() -> zstandard.ZstdDecompressor:
    dctx: zstandard.ZstdDecompressor | None = getattr(_local, "decompressor", None)
    if dctx is None:
        dctx = _local.decompressor = zstandard.ZstdDecompressor()
    return dctx


def shuffle_bytes(buffer: np.ndarray, itemsize: int) -> np.ndarray:
    """Byte planes of a contiguous array: all first bytes, then all second bytes, ..."""
    flat = buffer.reshape(-1).view(np.uint8)
    if itemsize == 1:
        return flat
    return np.ascontiguousarray(flat.reshape(-1, itemsize).T).reshape(-1)


def unshuffle_bytes(planes: np.ndarray, itemsize: int) -> np.ndarray:
    """Inverse of :func:`shuffle_bytes`: the elements' bytes back in order (uint8)."""
    if itemsize == 1:
        return planes
    return np.ascontiguousarray(planes.reshape(itemsize, -1).T).reshape(-1)


def compress_payload(stored: np.ndarray, spec: CodecSpec) -> bytes:
    if spec.compress == "none":
        return stored.tobytes()
    if spec.compress == "shuffle+zstd":
        stored = shuffle_bytes(stored, stored.dtype.itemsize)
    return _compressor(spec.level).compress(stored.reshape(-1).view(np.uint8).data)


def decompress_payload(
    data: bytes, spec: CodecSpec, expected: int, *, at_least: int | None = None
) -> np.ndarray:
    """The stored bytes as uint8, after checking the frame ([Note: decoding hostile input]).

    The payload must hold exactly ``expected`` bytes, or, with ``at_least``, between
    ``at_least`` and ``expected`` (a sparse payload, whose length its bitmap decides).
    """
    lowest = expected if at_least is None else at_least
    wanted = f"{expected}" if at_least is None else f"{lowest}..{expected}"
    if spec.compress == "none":
        if not lowest <= len(data) <= expected:
            raise CodecError(f"raw payload has {len(data)} bytes, expected {wanted}")
        return np.frombuffer(data, np.uint8)
    try:
        declared = zstandard.frame_content_size(data)
    except zstandard.ZstdError as exc:
        raise CodecError(f"zstd payload is not a zstd frame ({len(data)} bytes): {exc}") from exc
    if declared < 0:
        raise CodecError("zstd frame does not declare its content size; refusing to decode it")
    if not lowest <= declared <= expected:
        raise CodecError(f"zstd frame declares {declared} bytes, expected {wanted}")
    try:
        raw = _decompressor().decompress(data, max_output_size=declared, allow_extra_data=False)
    except zstandard.ZstdError as exc:
        raise CodecError(f"corrupt zstd payload: {exc}") from exc
    if len(raw) != declared:
        raise CodecError(f"zstd frame held {len(raw)} bytes, declared {declared}")
    return np.frombuffer(raw, np.uint8)
