"""The feature codec: what a tensor looks like when it crosses a link.

A codec is a :class:`CodecSpec` — an optional *quantiser* (``fp16``, ``int8``, ``int8c``)
followed by an optional lossless *compressor* (``zstd`` or ``shuffle+zstd`` at a level).
:func:`encode` turns an array into an :class:`EncodedTensor` (the fields of the wire
``Tensor`` message), :func:`decode` turns it back, and :func:`measure` reports the ratio,
speed and error that the cost model uses to choose a codec per link.

See [Note: codec wire format] for what the bytes are and [Note: decoding hostile input]
for why decoding can never crash, hang or allocate more than its bound. The schemes
themselves (quantisers, byte shuffle, zstd) live in :mod:`tierflow.codec_schemes`;
their public names are re-exported here.

Only numpy and zstandard are needed: every tier imports this module.

[Note: codec wire format]
``data`` is the tensor's elements in C order, little-endian, after quantisation, then
(optionally) byte-shuffled and compressed as one zstd frame that records its content
size and a checksum. ``params`` holds the quantiser's parameters as little-endian
float32 values. The decoded tensor has ``dtype`` and ``shape`` exactly.

* ``fp16``: floats become float16 (numpy's ``astype``: values beyond ±65504 overflow to
  ±inf, tiny values flush towards zero, NaN and inf are kept). Decodes to ``dtype``.
* ``int8``: per-tensor affine. ``params`` = ``(scale, offset)``; element codes ``q`` are
  uint8 and decode to ``offset + q * scale``, so ``|x - decoded| <= scale / 2`` (plus the
  rounding of the output dtype) for every finite ``x`` of a float16/float32 tensor;
  float64 tensors add the float32 rounding of ``offset`` (at most ``|offset| * 2**-23``).
  ``scale = (max - min) / 255`` over the finite elements (rounded up, with ``offset`` the
  minimum rounded down), so a constant tensor has ``scale == 0`` and decodes exactly.
  Non-finite values cannot be represented: ``+inf`` saturates to the largest finite
  element, ``-inf`` to the smallest, and ``NaN`` decodes as the smallest (``offset``); a
  tensor with no finite element decodes as zeros. float64 values beyond the float32 range
  cannot be int8-quantised (a CodecError: use fp16 or a lossless codec).
* ``int8c``: per-channel affine, as ``int8`` but one ``(scale, offset)`` pair per channel:
  ``params`` = all scales, then all offsets. The channel axis is 1 for tensors of 4 or
  more dimensions (NCHW convolution features) and the last axis for 2-D and 3-D tensors
  (``(batch, features)`` and ``(batch, tokens, hidden)``); 0-D and 1-D tensors have a single
  channel, like ``int8``.
* ``shuffle``: the bytes of each element are transposed into byte planes (all first
  bytes, then all second bytes, ...) before zstd: the exponent bytes of floats are
  alike, so the planes usually compress better (see benchmarks/codec_bench.py). It is
  lossless and costs one copy each way.

Only floating tensors (float16/32/64) are quantised; other dtypes (int64 indices, bool
masks, ...) go through the lossless part alone, and ``EncodedTensor.codec`` names what
was actually applied (``int8+zstd`` on an int64 tensor is recorded as ``zstd``; ``fp16``
on a float16 tensor, a no-op, is dropped the same way).

[Note: decoding hostile input]
A receiver cannot trust a message. Before anything is allocated, :func:`decode` checks
that the dtype is in the allow-list, the codec parses and fits the dtype, the shape has
at most 32 non-negative dimensions, the decoded size (elements times item size) is at
most ``max_bytes`` (and so is the product of the nonzero dimensions, which numpy also
needs to fit), and ``params`` has exactly the length the quantiser needs. A raw
payload must have exactly the expected length. A zstd payload must be one frame whose
header declares exactly the expected size (zstd allocates what the header says, so the
header is checked first; a frame without a declared size is refused), with no trailing
bytes; the frame's checksum catches corruption. Quantiser parameters must be finite,
scales non-negative, and the values they decode to must fit the dtype. Every failure
is a :class:`~tierflow.errors.CodecError`.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tierflow.codec_schemes import (
    QUANTISER_SCHEMES,
    channel_axis,
    compress_payload,
    decompress_payload,
    shuffle_bytes,
    unshuffle_bytes,
    wire_dtype,
)
from tierflow.errors import CodecError, UsageError

__all__ = [
    "ALLOWED_DTYPES",
    "COMPRESSORS",
    "DEFAULT_LEVEL",
    "DEFAULT_MAX_TENSOR_BYTES",
    "LOSSLESS_CODECS",
    "MAX_LEVEL",
    "MAX_NDIM",
    "MIN_LEVEL",
    "PLANNER_CODECS",
    "QUANTISERS",
    "CodecSpec",
    "CodecStats",
    "EncodedTensor",
    "channel_axis",
    "check_header",
    "decode",
    "decoded_nbytes",
    "encode",
    "measure",
    "shuffle_bytes",
    "unshuffle_bytes",
]

QUANTISERS: tuple[str, ...] = ("none", "fp16", "int8", "int8c")
COMPRESSORS: tuple[str, ...] = ("none", "zstd", "shuffle+zstd")
DEFAULT_LEVEL = 3
MIN_LEVEL = 1
MAX_LEVEL = 22

#: The codecs ``--codec auto`` chooses among (DESIGN.md, command line contract).
PLANNER_CODECS: tuple[str, ...] = ("raw", "zstd", "fp16", "fp16+zstd", "int8", "int8+zstd")
#: Codecs whose round trip is bit-exact for every dtype.
LOSSLESS_CODECS: tuple[str, ...] = ("raw", "zstd", "shuffle+zstd")
#: Largest decoded tensor a decoder accepts unless told otherwise.
DEFAULT_MAX_TENSOR_BYTES = 1 << 30
#: Most dimensions a decoded tensor may have.
MAX_NDIM = 32

#: dtypes that may cross a link (numpy names, as ``EncodedTensor.dtype`` carries them).
ALLOWED_DTYPES: tuple[str, ...] = (
    "bool",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "float32",
    "float64",
    "complex64",
    "complex128",
)
_FLOAT_DTYPES = frozenset({"float16", "float32", "float64"})

_VALID_FORMS = (
    "raw, zstd, zstd:LEVEL, shuffle+zstd[:LEVEL], fp16, int8 or int8c, each optionally "
    "followed by +zstd[:LEVEL] or +shuffle+zstd[:LEVEL] (e.g. fp16+zstd:5, int8c+zstd); "
    f"LEVEL is {MIN_LEVEL}..{MAX_LEVEL}"
)


# --------------------------------------------------------------------------- spec


@dataclass(frozen=True)
class CodecSpec:
    """How features are encoded on a link: quantiser, compressor and zstd level.

    ``level`` only matters with a compressor; without one it is normalised to the
    default so that equal codecs compare equal (``parse(str(s)) == s`` always holds).
    """

    quant: str
    compress: str
    level: int = DEFAULT_LEVEL

    def __post_init__(self) -> None:
        if self.quant not in QUANTISERS:
            raise UsageError(
                f"unknown quantiser {self.quant!r}: expected one of {', '.join(QUANTISERS)}"
            )
        if self.compress not in COMPRESSORS:
            raise UsageError(
                f"unknown compressor {self.compress!r}: expected one of {', '.join(COMPRESSORS)}"
            )
        if isinstance(self.level, bool) or not isinstance(self.level, int):
            raise UsageError(f"zstd level must be an integer, got {self.level!r}")
        if not MIN_LEVEL <= self.level <= MAX_LEVEL:
            raise UsageError(
                f"zstd level must be within {MIN_LEVEL}..{MAX_LEVEL}, got {self.level}"
            )
        if self.compress == "none" and self.level != DEFAULT_LEVEL:
            object.__setattr__(self, "level", DEFAULT_LEVEL)

    @classmethod
    def parse(cls, text: str) -> CodecSpec:
        """Read codec text such as ``raw``, ``zstd:9``, ``int8+zstd`` or ``fp16+shuffle+zstd``."""
        if not isinstance(text, str):
            raise UsageError(f"codec must be text, got {text!r}")
        parts = text.strip().lower().split("+")
        if parts == ["raw"]:
            return cls("none", "none")
        quant = "none"
        if parts and parts[0] in QUANTISERS[1:]:
            quant = parts.pop(0)
        compress = "none"
        level = DEFAULT_LEVEL
        if parts and parts[0] == "shuffle":
            compress = "shuffle+zstd"
            parts.pop(0)
            if not parts or not parts[0].startswith("zstd"):
                raise UsageError(f"malformed codec {text!r}: shuffle must be followed by +zstd")
        if parts and parts[0].startswith("zstd"):
            name, sep, level_text = parts.pop(0).partition(":")
            if name != "zstd" or (sep and not level_text.isdigit()):
                raise UsageError(f"malformed codec {text!r}: expected one of {_VALID_FORMS}")
            compress = "zstd" if compress == "none" else compress
            if sep:
                level = int(level_text)
                if not MIN_LEVEL <= level <= MAX_LEVEL:
                    raise UsageError(
                        f"malformed codec {text!r}: zstd level must be within "
                        f"{MIN_LEVEL}..{MAX_LEVEL}, got {level}"
                    )
        if parts or (quant == "none" and compress == "none"):
            raise UsageError(f"malformed codec {text!r}: expected one of {_VALID_FORMS}")
        return cls(quant, compress, level)

    @classmethod
    def of(cls, spec: CodecSpec | str) -> CodecSpec:
        """Accept either a spec or its text (what the public functions take)."""
        return spec if isinstance(spec, CodecSpec) else cls.parse(spec)

    @property
    def lossless(self) -> bool:
        return self.quant == "none"

    def lossless_part(self) -> CodecSpec:
        """This codec without its quantiser: what non-float tensors get."""
        return CodecSpec("none", self.compress, self.level)

    def __str__(self) -> str:
        parts = [] if self.quant == "none" else [self.quant]
        if self.compress != "none":
            zstd = "zstd" if self.level == DEFAULT_LEVEL else f"zstd:{self.level}"
            parts.append(zstd if self.compress == "zstd" else f"shuffle+{zstd}")
        return "+".join(parts) or "raw"

    def to_dict(self) -> dict[str, Any]:
        return {"quant": self.quant, "compress": self.compress, "level": self.level}

    @classmethod
    def from_dict(cls, data: Any) -> CodecSpec:
        if not isinstance(data, dict):
            raise UsageError(f"malformed codec {data!r}: expected an object")
        try:
            return cls(str(data["quant"]), str(data["compress"]), data.get("level", DEFAULT_LEVEL))
        except KeyError as exc:
            raise UsageError(f"malformed codec {data!r}: expected quant and compress") from exc


# --------------------------------------------------------------------------- tensors


@dataclass(frozen=True)
class EncodedTensor:
    """One encoded tensor: exactly the fields of the wire ``Tensor`` message."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    codec: str
    params: bytes
    data: bytes

    @property
    def nbytes(self) -> int:
        """Bytes this tensor puts on the link (payload and parameters)."""
        return len(self.data) + len(self.params)


# --------------------------------------------------------------------------- encode/decode


def encode(name: str, array: np.ndarray, spec: CodecSpec | str) -> EncodedTensor:
    """Encode one tensor with ``spec`` (see [Note: codec wire format]).

    Non-float tensors skip the quantiser; ``codec`` of the result says what was applied.
    Any byte order and memory layout is accepted; the wire is C-ordered little-endian.
    """
    codec = CodecSpec.of(spec)
    arr = np.asarray(array)
    dtype = arr.dtype.name
    if dtype not in ALLOWED_DTYPES:
        raise CodecError(
            f"cannot encode tensor {name!r} of dtype {arr.dtype}: expected one of "
            f"{', '.join(ALLOWED_DTYPES)}"
        )
    if codec.quant != "none" and (
        dtype not in _FLOAT_DTYPES or (codec.quant == "fp16" and dtype == "float16")
    ):
        codec = codec.lossless_part()
    arr = np.asarray(arr, dtype=wire_dtype(dtype), order="C")
    params, stored = QUANTISER_SCHEMES[codec.quant].encode(arr)
    return EncodedTensor(
        name=name,
        dtype=dtype,
        shape=tuple(int(d) for d in arr.shape),
        codec=str(codec),
        params=params,
        data=compress_payload(stored, codec),
    )


def check_header(tensor: EncodedTensor, *, max_bytes: int = DEFAULT_MAX_TENSOR_BYTES) -> CodecSpec:
    """Validate everything but the payload itself; return the tensor's codec.

    Cheap (no allocation proportional to the tensor), so receivers call it on every
    message first. See [Note: decoding hostile input].
    """
    what = f"tensor {tensor.name!r}"
    if tensor.dtype not in ALLOWED_DTYPES:
        raise CodecError(
            f"{what} has dtype {tensor.dtype!r}: expected one of {', '.join(ALLOWED_DTYPES)}"
        )
    try:
        codec = CodecSpec.parse(tensor.codec)
    except UsageError as exc:
        raise CodecError(f"{what}: {exc}") from exc
    if codec.quant != "none" and tensor.dtype not in _FLOAT_DTYPES:
        raise CodecError(
            f"{what}: codec {codec} quantises, but its dtype {tensor.dtype} is not float"
        )
    shape = tensor.shape
    if len(shape) > MAX_NDIM:
        raise CodecError(f"{what} has {len(shape)} dimensions, expected at most {MAX_NDIM}")
    if not all(isinstance(d, int) and d >= 0 for d in shape):
        raise CodecError(f"{what} has shape {shape}: dimensions must be non-negative integers")
    size = math.prod(shape) * np.dtype(tensor.dtype).itemsize
    if size > max_bytes:
        raise CodecError(
            f"{what} of shape {shape} and dtype {tensor.dtype} would decode to {size} bytes, "
            f"more than the limit of {max_bytes}"
        )
    # numpy refuses shapes whose dimensions multiply past its index range even when one
    # of them is zero, so the nonzero ones must fit the bound too.
    if math.prod(d for d in shape if d) * np.dtype(tensor.dtype).itemsize > max(max_bytes, 1):
        raise CodecError(f"{what} has shape {shape}: its dimensions are too large")
    need = QUANTISER_SCHEMES[codec.quant].params_len(shape)
    if len(tensor.params) != need:
        raise CodecError(
            f"{what}: codec {codec} needs {need} parameter bytes, found {len(tensor.params)}"
        )
    return codec


def decode(
    tensor: EncodedTensor, *, max_bytes: int = DEFAULT_MAX_TENSOR_BYTES, writable: bool = True
) -> np.ndarray:
    """Decode one tensor, validating it completely first; any fault is a CodecError.

    The result is a native-byte-order C-contiguous array of exactly ``tensor.shape`` and
    ``tensor.dtype``; fresh and writable unless ``writable`` is False, in which case it
    may be a read-only view of ``tensor.data`` (a raw payload is then not copied: a
    tier hands its features to ONNX Runtime, which only reads them, and a copy of a
    1 MB feature costs 0.1-0.3 ms).
    """
    codec = check_header(tensor, max_bytes=max_bytes)
    quantiser = QUANTISER_SCHEMES[codec.quant]
    stored_dtype = quantiser.stored_dtype(tensor.dtype)
    count = math.prod(tensor.shape)
    raw = decompress_payload(tensor.data, codec, count * stored_dtype.itemsize)
    if codec.compress == "shuffle+zstd":
        raw = unshuffle_bytes(raw, stored_dtype.itemsize)
    stored = raw.view(stored_dtype).reshape(tensor.shape)
    out = quantiser.decode(stored, tensor.params, tensor.shape, tensor.dtype)
    native = np.dtype(tensor.dtype)
    if out.dtype != native or not out.flags.c_contiguous or (writable and not out.flags.writeable):
        out = np.array(out, dtype=native, order="C")
    return out


# --------------------------------------------------------------------------- measuring


@dataclass(frozen=True)
class CodecStats:
    """A codec measured on real features; the cost model's input for one codec."""

    codec: str
    ratio: float
    encode_s_per_mb: float
    decode_s_per_mb: float
    max_abs_error: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "codec": self.codec,
            "ratio": self.ratio,
            "encode_s_per_mb": self.encode_s_per_mb,
            "decode_s_per_mb": self.decode_s_per_mb,
            "max_abs_error": self.max_abs_error,
        }

    @classmethod
    def from_dict(cls, data: Any) -> CodecStats:
        try:
            stats = cls(
                codec=str(CodecSpec.parse(data["codec"])),
                ratio=float(data["ratio"]),
                encode_s_per_mb=float(data["encode_s_per_mb"]),
                decode_s_per_mb=float(data["decode_s_per_mb"]),
                max_abs_error=float(data["max_abs_error"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise UsageError(f"malformed codec stats {data!r}: {exc}") from exc
        if not stats.ratio > 0 or stats.encode_s_per_mb < 0 or stats.decode_s_per_mb < 0:
            raise UsageError(f"malformed codec stats {data!r}: negative or zero figures")
        return stats


def _max_abs_error(original: np.ndarray, decoded: np.ndarray) -> float:
    if original.size == 0 or original.dtype.kind not in "fc":
        return 0.0 if np.array_equal(original, decoded) else math.inf
    both = np.isfinite(original) & np.isfinite(decoded)
    if not both.any():
        return 0.0
    diff = np.abs(original.astype(np.float64)[both] - decoded.astype(np.float64)[both])
    return float(diff.max())


def measure(spec: CodecSpec | str, arrays: Sequence[np.ndarray], *, repeats: int = 3) -> CodecStats:
    """Ratio, speed (median of ``repeats``) and worst error of a codec on ``arrays``.

    The error is over elements finite both before and after (fp16 overflow shows as inf).
    """
    codec = CodecSpec.of(spec)
    if not arrays:
        raise UsageError("cannot measure a codec on no arrays")
    raw_bytes = sum(np.asarray(a).nbytes for a in arrays)
    encode_times: list[float] = []
    decode_times: list[float] = []
    encoded: list[EncodedTensor] = []
    for _ in range(max(1, repeats)):
        start = time.perf_counter()
        encoded = [encode(f"t{i}", a, codec) for i, a in enumerate(arrays)]
        encode_times.append(time.perf_counter() - start)
        start = time.perf_counter()
        decoded = [
            decode(t, max_bytes=max(decoded_nbytes(t), DEFAULT_MAX_TENSOR_BYTES)) for t in encoded
        ]
        decode_times.append(time.perf_counter() - start)
    error = max(_max_abs_error(np.asarray(a), d) for a, d in zip(arrays, decoded, strict=True))
    encoded_bytes = sum(t.nbytes for t in encoded)
    mb = max(raw_bytes, 1) / 1e6
    return CodecStats(
        codec=str(codec),
        ratio=max(raw_bytes, 1) / max(encoded_bytes, 1),
        encode_s_per_mb=statistics.median(encode_times) / mb,
        decode_s_per_mb=statistics.median(decode_times) / mb,
        max_abs_error=0.0 if codec.lossless else error,
    )


def decoded_nbytes(tensor: EncodedTensor) -> int:
    """Decoded size in bytes that ``tensor`` declares (shape times item size)."""
    return math.prod(tensor.shape) * np.dtype(tensor.dtype).itemsize
