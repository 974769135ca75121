"""The feature codec: what a tensor looks like when it crosses a link.

A codec is a :class:`CodecSpec` — optionally ``drop+`` (constant channels) and
``sparse+`` (zeros skipped), an optional *quantiser* (``fp16``, ``int8``, ``int8c``,
``int4``, ``int2``), an optional lossless *compressor* (``zstd`` or ``shuffle+zstd`` at a
level) — or an *image codec* (``jpeg:Q``, ``webp:Q``, ``png``) for a normalised image input.
:func:`encode` turns an array into an :class:`EncodedTensor` (the fields of the wire
``Tensor`` message), :func:`decode` turns it back, and :func:`measure` reports the ratio,
speed and error that the cost model uses to choose a codec per link.

See [Note: codec wire format] for what the bytes are ([Note: image codecs] in
:mod:`tierflow.codec.image` for images) and [Note: decoding hostile input] for why
decoding can never crash, hang or allocate more than its bound. The grammar of codec
text is in :mod:`tierflow.codec.spec`, the pipeline of stages in
:mod:`tierflow.codec.stages`, the quantisers and zstd in :mod:`tierflow.codec.schemes`,
the image codecs in :mod:`tierflow.codec.image`; their public names are re-exported here.

Only numpy and zstandard are needed: every tier imports this module.

[Note: codec wire format]
A codec is a pipeline of stages, written in this order (the grammar is in
:mod:`tierflow.codec.spec`): ``drop+`` (constant channels leave), ``sparse+`` (zero
elements are skipped), a quantiser, a compressor; e.g. ``int8+zstd``,
``sparse+int4+zstd``, ``drop+sparse+int8c``. The sender runs them in order, the
receiver undoes them in reverse. ``data`` is the tensor's elements in C order,
little-endian, after the stages, then (optionally) compressed as one zstd frame that
records its content size and a checksum. ``params`` holds the stages' parameters, drop's
first, then the quantiser's, as little-endian float32 values (drop's mask excepted).
The decoded tensor has ``dtype`` and ``shape`` exactly.

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
* ``int4`` and ``int2``: per-channel affine like ``int8c`` with 15 and 3 steps:
  ``scale = (max - min) / 15`` (``/ 3``) per channel, the same ``|x - decoded| <= scale /
  2`` bound and the same treatment of non-finite values. The codes are packed two (four)
  to a byte in C order, the first element in the lowest bits; the last byte's unused
  bits must be zero.
* ``sparse``: ``data`` starts with a bitmap of the elements that are not +0.0 (one bit per
  element in C order, ``ceil(n / 8)`` bytes, least significant bit first, unused bits
  zero), followed by those elements only, as the quantiser stores them (packed codes
  for ``int4``/``int2``). Skipped elements decode to +0.0 exactly; the others keep the
  quantiser's bound (the quantiser's scales are computed over the whole tensor, zeros
  included, so a post-ReLU tensor loses nothing to them). Without a quantiser it is
  lossless (``-0.0`` is kept as a value). The payload's length follows from the bitmap;
  the decoder accepts only ``bitmap + popcount * element`` bytes.
* ``drop``: channels (the axis above; a 0-D or 1-D tensor is one channel) whose elements
  all have the same bits, a finite value that float32 holds exactly, leave the payload:
  ``params`` begins with a bitmap of the dropped channels (one bit per channel, least
  significant first, padded with zero bits to whole 4-byte words), then each dropped
  channel's value as float32, then the quantiser's parameters for the tensor of the
  kept channels, which is what the rest of the pipeline encodes. Lossless: a dropped
  channel decodes to its value exactly.
* ``shuffle``: the bytes of each stored element are transposed into byte planes (all
  first bytes, then all second bytes, ...) before zstd: the exponent bytes of floats are
  alike, so the planes usually compress better (see benchmarks/codec_speed.py). It is
  lossless and costs one copy each way. With ``sparse`` only the values are shuffled;
  packed codes are single bytes, so there is nothing to shuffle.

Measured on the demo model's trained features (benchmarks/demo_codecs.py, 17 cuts,
360 held-out requests; medians over the cuts, bytes against fp32): ``int8+zstd`` 6.3x,
``int4+zstd`` 9.2x and ``int2+zstd`` 18.5x fewer bytes; ``int4`` changed no answer,
``int2`` 0.8 points of accuracy at its worst cut. ``sparse+`` and ``drop+`` add little
there behind zstd (6.5x and 6.3x with int8, against 6.3x), which already squeezes runs of
zeros and constant channels. Per-channel codecs lose on tiny tensors: a (1, 64) vector
carries 8 parameter bytes per channel (0.48x); the planner measures each cut.

Only floating tensors (float16/32/64) go through ``drop``, ``sparse`` and quantisers;
other dtypes (int64 indices, bool masks, ...) go through the compressor alone, and
``EncodedTensor.codec`` names what was actually applied (``sparse+int8+zstd`` on an
int64 tensor is recorded as ``zstd``; ``fp16`` on a float16 tensor, a no-op, is dropped
the same way). Image codecs (``jpeg:Q``, ``webp:Q``, ``png``) stand alone: see
[Note: image codecs] in :mod:`tierflow.codec.image`.

[Note: decoding hostile input]
A receiver cannot trust a message. Before anything is allocated, :func:`decode` checks
that the dtype is in the allow-list, the codec parses and fits the dtype, the shape has
at most 32 non-negative dimensions, the decoded size (elements times item size) is at
most ``max_bytes`` (and so is the product of the nonzero dimensions, which numpy also
needs to fit), and ``params`` has exactly the length the stages need (drop's channel
bitmap is read from ``params`` for that: at most one bit and one float per channel,
unused bits zero, values finite and within the dtype). A raw payload must have exactly
the expected length (a sparse one: between its bitmap and the bitmap plus every
element). A zstd payload must be one frame whose header declares exactly the expected
size (within the same range for a sparse one: zstd allocates what the header says, so
the header is checked first; a frame without a declared size is refused), with no
trailing bytes; the frame's checksum catches corruption. A sparse payload's values must
then be exactly as many as its bitmap's set bits, and packed codes' padding bits zero.
Quantiser parameters must be finite, scales non-negative, and the values they decode
to must fit the dtype. So decoding never allocates more than a few times the declared
size. Every failure is a :class:`~tierflow.errors.CodecError`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tierflow.codec.image import (
    IMAGE_CODECS,
    ImageNorm,
    check_image_shape,
    decode_images,
    encode_images,
)
from tierflow.codec.schemes import channel_axis, shuffle_bytes, unshuffle_bytes, wire_dtype
from tierflow.codec.spec import (
    COMPRESSORS,
    DEFAULT_LEVEL,
    EXACT_PLANNER_CODECS,
    LOSSLESS_CODECS,
    LOSSY_PLANNER_CODECS,
    LOW_BIT_CODECS,
    MAX_LEVEL,
    MIN_LEVEL,
    PLANNER_CODECS,
    QUANTISERS,
    CodecSpec,
)
from tierflow.codec.stages import Layout, decode_payload, encode_payload, layout
from tierflow.errors import CodecError, UsageError

__all__ = [
    "ALLOWED_DTYPES",
    "COMPRESSORS",
    "DEFAULT_LEVEL",
    "DEFAULT_MAX_TENSOR_BYTES",
    "EXACT_PLANNER_CODECS",
    "IMAGE_CODECS",
    "LOSSLESS_CODECS",
    "LOSSY_PLANNER_CODECS",
    "LOW_BIT_CODECS",
    "MAX_LEVEL",
    "MAX_NDIM",
    "MIN_LEVEL",
    "PLANNER_CODECS",
    "QUANTISERS",
    "CodecSpec",
    "CodecStats",
    "EncodedTensor",
    "ImageNorm",
    "channel_axis",
    "check_header",
    "decode",
    "decoded_nbytes",
    "encode",
    "measure",
    "shuffle_bytes",
    "unshuffle_bytes",
]

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
#: Each allowed dtype in the wire's byte order, and its name: an array of one of these
#: travels ``raw`` as its own bytes.
_WIRE_NAMES = {wire_dtype(name): name for name in ALLOWED_DTYPES}


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


def encode(
    name: str, array: np.ndarray, spec: CodecSpec | str, *, image: ImageNorm | None = None
) -> EncodedTensor:
    """Encode one tensor with ``spec`` (see [Note: codec wire format]).

    Non-float tensors skip the quantiser; ``codec`` of the result says what was applied.
    Any byte order and memory layout is accepted; the wire is C-ordered little-endian.
    An image codec needs ``image``, the tensor's normalisation, and a float tensor (see
    [Note: image codecs]); other codecs ignore ``image``.
    """
    codec = CodecSpec.of(spec)
    arr = np.asarray(array)
    if str(codec) == "raw" and arr.dtype in _WIRE_NAMES:
        # No stage to apply: the array's bytes, C-ordered, are the payload. The general
        # way below takes 2-3 times as long for a decode step's few small tensors.
        return EncodedTensor(
            name=name,
            dtype=_WIRE_NAMES[arr.dtype],
            shape=arr.shape,
            codec="raw",
            params=b"",
            data=arr.tobytes(),
        )
    dtype = arr.dtype.name
    if dtype not in ALLOWED_DTYPES:
        raise CodecError(
            f"cannot encode tensor {name!r} of dtype {arr.dtype}: expected one of "
            f"{', '.join(ALLOWED_DTYPES)}"
        )
    if codec.image:
        return _encode_image(name, arr, codec, image)
    if dtype not in _FLOAT_DTYPES:
        codec = codec.lossless_part()
    elif codec.quant == "fp16" and dtype == "float16":
        codec = dataclasses.replace(codec, quant="none")
    arr = np.asarray(arr, dtype=wire_dtype(dtype), order="C")
    params, data = encode_payload(arr, codec)
    return EncodedTensor(
        name=name,
        dtype=dtype,
        shape=tuple(int(d) for d in arr.shape),
        codec=str(codec),
        params=params,
        data=data,
    )


def _encode_image(
    name: str, arr: np.ndarray, codec: CodecSpec, norm: ImageNorm | None
) -> EncodedTensor:
    if norm is None:
        raise CodecError(
            f"image codec {codec} for tensor {name!r} needs its normalisation (image=ImageNorm)"
        )
    if arr.dtype.name not in _FLOAT_DTYPES:
        raise CodecError(
            f"image codec {codec} encodes float tensors; tensor {name!r} is {arr.dtype.name}"
        )
    return EncodedTensor(
        name=name,
        dtype=arr.dtype.name,
        shape=tuple(int(d) for d in arr.shape),
        codec=str(codec),
        params=norm.to_params(),
        data=encode_images(arr, codec.quant, codec.quality, norm),
    )


#: A header checked: the tensor's codec and, but for image codecs, its payload's layout.
Checked = tuple[CodecSpec, "Layout | None"]


def check_header(tensor: EncodedTensor, *, max_bytes: int = DEFAULT_MAX_TENSOR_BYTES) -> CodecSpec:
    """Validate everything but the payload itself; return the tensor's codec.

    Cheap (no allocation proportional to the tensor), so receivers call it on every
    message first. See [Note: decoding hostile input].
    """
    return _check(tensor, max_bytes)[0]


def check(tensor: EncodedTensor, *, max_bytes: int = DEFAULT_MAX_TENSOR_BYTES) -> Checked:
    """:func:`check_header`, keeping what it found for :func:`decode` (no second check)."""
    return _check(tensor, max_bytes)


def _check(tensor: EncodedTensor, max_bytes: int) -> tuple[CodecSpec, Layout | None]:
    """The codec and, but for image codecs, the checked layout of the payload; a header
    seen before is not checked again ([Note: headers seen before])."""
    header = (tensor.name, tensor.dtype, tensor.shape, tensor.codec, tensor.params, max_bytes)
    if len(tensor.params) > _REMEMBERED_PARAMS_BYTES:
        return _checked(*header)
    return _remembered(*header)


def _checked(
    name: str, dtype: str, shape: tuple[int, ...], codec_text: str, params: bytes, max_bytes: int
) -> tuple[CodecSpec, Layout | None]:
    """The check of a header's fields (:func:`_check`)."""
    what = f"tensor {name!r}"
    if dtype not in ALLOWED_DTYPES:
        raise CodecError(f"{what} has dtype {dtype!r}: expected one of {', '.join(ALLOWED_DTYPES)}")
    try:
        codec = CodecSpec.parse(codec_text)
    except UsageError as exc:
        raise CodecError(f"{what}: {exc}") from exc
    if (codec.quant != "none" or codec.sparse or codec.drop) and dtype not in _FLOAT_DTYPES:
        raise CodecError(f"{what}: codec {codec} quantises, but its dtype {dtype} is not float")
    if len(shape) > MAX_NDIM:
        raise CodecError(f"{what} has {len(shape)} dimensions, expected at most {MAX_NDIM}")
    if not all(isinstance(d, int) and d >= 0 for d in shape):
        raise CodecError(f"{what} has shape {shape}: dimensions must be non-negative integers")
    size = math.prod(shape) * np.dtype(dtype).itemsize
    if size > max_bytes:
        raise CodecError(
            f"{what} of shape {shape} and dtype {dtype} would decode to {size} bytes, "
            f"more than the limit of {max_bytes}"
        )
    # numpy refuses shapes whose dimensions multiply past its index range even when one
    # of them is zero, so the nonzero ones must fit the bound too.
    if math.prod(d for d in shape if d) * np.dtype(dtype).itemsize > max(max_bytes, 1):
        raise CodecError(f"{what} has shape {shape}: its dimensions are too large")
    if codec.image:
        check_image_shape(shape, ImageNorm.from_params(params))
        return codec, None
    try:
        return codec, layout(codec, shape, dtype, params)
    except CodecError as exc:
        raise CodecError(f"{what}: {exc}") from exc


# [Note: headers seen before]
# The tensors of a plan's requests come with the same few headers (name, dtype, shape,
# codec, and the stage parameters of codecs that have none per tensor), request after
# request, so what a header's check found is kept: receiving a decoder step's six tensors
# took 58-61 µs with every header checked, 25 µs with the checks kept (2026-12-06), for
# each member of a batch at each tier. Only the checks that passed are kept (an error is
# raised again each time), a bounded number of them, and only for parameters short
# enough that no header makes the cache large: a quantiser's per-channel scales change
# with every tensor, and are checked each time.
_REMEMBERED_PARAMS_BYTES = 64
_remembered = functools.lru_cache(maxsize=1024)(_checked)


def decode(
    tensor: EncodedTensor,
    *,
    max_bytes: int = DEFAULT_MAX_TENSOR_BYTES,
    writable: bool = True,
    checked: Checked | None = None,
) -> np.ndarray:
    """Decode one tensor, validating it completely first; any fault is a CodecError.

    The result is a native-byte-order C-contiguous array of exactly ``tensor.shape`` and
    ``tensor.dtype``; fresh and writable unless ``writable`` is False, in which case it
    may be a read-only view of ``tensor.data`` (a raw payload is then not copied: a
    tier hands its features to ONNX Runtime, which only reads them, and a copy of a
    1 MB feature costs 0.1-0.3 ms). ``checked``: what :func:`check` found for this very
    tensor, so that its header is not checked twice.
    """
    codec, plan = checked if checked is not None else _check(tensor, max_bytes)
    if plan is None:
        return decode_images(tensor.data, codec.quant, tensor.shape, tensor.dtype, tensor.params)
    return decode_payload(tensor.data, codec, plan, tensor.dtype, writable=writable)


# --------------------------------------------------------------------------- measuring


@dataclass(frozen=True)
class CodecStats:
    """A codec measured on real features; the cost model's input for one codec."""

    codec: str
    ratio: float
    encode_s_per_mb: float
    decode_s_per_mb: float
    max_abs_error: float

    def slower(self, factor: float) -> CodecStats:
        """These figures on a machine ``factor`` times slower: times scale, the ratio and
        the error stay (what a profile's emulated slowdown does to its codecs)."""
        return dataclasses.replace(
            self,
            encode_s_per_mb=self.encode_s_per_mb * factor,
            decode_s_per_mb=self.decode_s_per_mb * factor,
        )

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


def measure(
    spec: CodecSpec | str,
    arrays: Sequence[np.ndarray],
    *,
    repeats: int = 3,
    image: ImageNorm | None = None,
) -> CodecStats:
    """Ratio, speed (median of ``repeats``) and worst error of a codec on ``arrays``.

    The error is over elements finite both before and after (fp16 overflow shows as inf).
    ``image`` is the arrays' normalisation, which image codecs need. Times are this
    thread's CPU time: every codec computes on the calling thread (zstd without worker
    threads, Pillow, numpy), and other jobs on a shared machine cannot inflate it.
    """
    codec = CodecSpec.of(spec)
    if not arrays:
        raise UsageError("cannot measure a codec on no arrays")
    raw_bytes = sum(np.asarray(a).nbytes for a in arrays)
    encode_times: list[float] = []
    decode_times: list[float] = []
    encoded: list[EncodedTensor] = []
    for _ in range(max(1, repeats)):
        start = time.thread_time()
        encoded = [encode(f"t{i}", a, codec, image=image) for i, a in enumerate(arrays)]
        encode_times.append(time.thread_time() - start)
        start = time.thread_time()
        decoded = [
            decode(t, max_bytes=max(decoded_nbytes(t), DEFAULT_MAX_TENSOR_BYTES)) for t in encoded
        ]
        decode_times.append(time.thread_time() - start)
    error = max(_max_abs_error(np.asarray(a), d) for a, d in zip(arrays, decoded, strict=True))
    encoded_bytes = sum(t.nbytes for t in encoded)
    mb = max(raw_bytes, 1) / 1e6
    return CodecStats(
        codec=str(codec),
        ratio=max(raw_bytes, 1) / max(encoded_bytes, 1),
        encode_s_per_mb=statistics.median(encode_times) / mb,
        decode_s_per_mb=statistics.median(decode_times) / mb,
        max_abs_error=0.0 if codec.bit_exact else error,
    )


def decoded_nbytes(tensor: EncodedTensor) -> int:
    """Decoded size in bytes that ``tensor`` declares (shape times item size)."""
    return math.prod(tensor.shape) * np.dtype(tensor.dtype).itemsize
