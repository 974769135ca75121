"""The feature codec: what a tensor looks like when it crosses a link.

A codec is a :class:`CodecSpec` — an optional *quantiser* (``fp16``, ``int8``, ``int8c``)
followed by an optional lossless *compressor* (``zstd`` or ``shuffle+zstd`` at a level),
or an *image codec* (``jpeg:Q``, ``webp:Q``, ``png``) for a normalised image input.
:func:`encode` turns an array into an :class:`EncodedTensor` (the fields of the wire
``Tensor`` message), :func:`decode` turns it back, and :func:`measure` reports the ratio,
speed and error that the cost model uses to choose a codec per link.

See [Note: codec wire format] for what the bytes are, [Note: image codecs] for images,
and [Note: decoding hostile input] for why decoding can never crash, hang or allocate
more than its bound. The schemes themselves (quantisers, byte shuffle, zstd) live in
:mod:`tierflow.codec_schemes`, the image codecs in :mod:`tierflow.codec_image`; their
public names are re-exported here.

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

[Note: image codecs]
``jpeg:Q`` (Q = 1..100), ``webp:Q`` and ``png`` carry a normalised image tensor (float16/
32/64, 4-D, ``NCHW`` or ``NHWC``, 1 or 3 channels) as 8-bit images, the way a camera app
uploads a frame. The sender needs the tensor's :class:`ImageNorm` (``x = (pixel / scale -
mean) / std`` per channel): it recovers the pixels as ``rint((x * std + mean) * scale)``
saturated to 0..255 (NaN to 0), and encodes each of the N images separately. ``data`` is
the N images in order, each prefixed by its length as a little-endian uint32, with
nothing after the last; ``params`` is float32 ``mean..., std..., scale, layout`` (layout
0.0 for NCHW, 1.0 for NHWC), so the receiver needs nothing but the message: it decodes
the pixels and computes ``(pixel / scale - mean) / std`` in float32 (float64 for a
float64 tensor), restoring dtype, shape and layout. JPEG is baseline 4:2:0 (grey images:
one component), WebP is lossy at effort 0 (a grey image travels as RGB and decodes to
its luminance), PNG is zlib level 1.

Error: ``png`` is lossless for 8-bit pixels: a tensor that is the normalisation of 8-bit
pixels decodes to within one float32 rounding, and bit for bit when it was computed as
the decoder does (float32 ``(pixel / scale - mean) / std``, mean and std float32);
values between pixel levels move by at most ``0.5 / (scale * std)``, and values outside
the pixels' range saturate. ``jpeg`` and ``webp`` are lossy with no fixed bound (their
error is measured: :func:`measure`, benchmarks/image_codec_bench.py). ``CodecSpec.lossless``
is True for ``png``; ``CodecSpec.bit_exact`` only for the codecs without a quantiser.

Libraries, chosen by measurement (224x224 crops of scikit-learn's two sample photos,
quality 90, one core, medians of 200): simplejpeg (libjpeg-turbo 3) encodes and decodes
in 0.33 + 0.46 ms, Pillow 13 (also libjpeg-turbo) in 0.53 + 0.72 ms, for the same bytes
(20.0 and 21.7 KB against 19.9 and 21.6 KB): 1.6x faster. So JPEG uses simplejpeg; WebP
and PNG, which simplejpeg lacks, use Pillow. Both are in the ``image`` extra (``pip
install 'tierflow[image]'``) and imported only when an image codec is used; without
them it is a CodecError naming the extra. Decoding checks, before any pixel is
decompressed, that the payload splits into exactly N images and that each image's
header declares the shape's height, width and mode (simplejpeg's
``decode_jpeg_header``; a Pillow plugin's image class, opened directly so that no other
format is guessed): the declared shape is within ``max_bytes``, so the pixels are too,
which is why Pillow's process-wide ``MAX_IMAGE_PIXELS`` is not relied on. Any failure of
a decoder on hostile bytes is a CodecError.

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

from tierflow.codec_image import (
    IMAGE_CODECS,
    QUALITY_CODECS,
    ImageNorm,
    check_image_shape,
    decode_images,
    encode_images,
)
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
    "IMAGE_CODECS",
    "LOSSLESS_CODECS",
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
    f"LEVEL is {MIN_LEVEL}..{MAX_LEVEL}; or an image codec jpeg:QUALITY, webp:QUALITY "
    "(QUALITY 1..100) or png"
)


# --------------------------------------------------------------------------- spec


@dataclass(frozen=True)
class CodecSpec:
    """How features are encoded on a link: quantiser, compressor and zstd level.

    ``level`` only matters with a compressor; without one it is normalised to the
    default so that equal codecs compare equal (``parse(str(s)) == s`` always holds).
    An image codec (``quant`` one of :data:`IMAGE_CODECS`) has no compressor, and
    ``quality`` (1..100) for ``jpeg`` and ``webp``; every other codec has quality 0.
    """

    quant: str
    compress: str
    level: int = DEFAULT_LEVEL
    quality: int = 0

    def __post_init__(self) -> None:
        if self.quant not in QUANTISERS + IMAGE_CODECS:
            raise UsageError(
                f"unknown quantiser {self.quant!r}: expected one of "
                f"{', '.join(QUANTISERS + IMAGE_CODECS)}"
            )
        if isinstance(self.quality, bool) or not isinstance(self.quality, int):
            raise UsageError(f"image quality must be an integer, got {self.quality!r}")
        if self.quant in QUALITY_CODECS and not 1 <= self.quality <= 100:
            raise UsageError(f"{self.quant} quality must be within 1..100, got {self.quality}")
        if self.quant not in QUALITY_CODECS and self.quality != 0:
            raise UsageError(f"codec {self.quant} takes no quality, got {self.quality}")
        if self.image and self.compress != "none":
            raise UsageError(f"image codec {self.quant} cannot be followed by a compressor")
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
        name, sep, quality = parts[0].partition(":")
        if name in IMAGE_CODECS:
            if len(parts) > 1 or (name in QUALITY_CODECS) != bool(sep):
                raise UsageError(f"malformed codec {text!r}: expected one of {_VALID_FORMS}")
            if sep and not (quality.isdigit() and 1 <= int(quality) <= 100):
                raise UsageError(f"malformed codec {text!r}: {name} quality must be within 1..100")
            return cls(name, "none", quality=int(quality) if sep else 0)
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
    def image(self) -> bool:
        """Whether this is an image codec (``jpeg:Q``, ``webp:Q``, ``png``)."""
        return self.quant in IMAGE_CODECS

    @property
    def lossless(self) -> bool:
        """Whether the codec keeps all information: no quantiser, or ``png``.

        ``png`` is lossless for 8-bit pixels, and so exact for a tensor normalised as
        the decoder does (see [Note: image codecs]); :attr:`bit_exact` is the stricter
        promise, for every tensor.
        """
        return self.quant in ("none", "png")

    @property
    def bit_exact(self) -> bool:
        """Whether every tensor of every dtype round-trips bit for bit."""
        return self.quant == "none"

    def lossless_part(self) -> CodecSpec:
        """This codec without its quantiser: what non-float tensors get."""
        return CodecSpec("none", self.compress, self.level)

    def __str__(self) -> str:
        if self.image:
            return f"{self.quant}:{self.quality}" if self.quality else self.quant
        parts = [] if self.quant == "none" else [self.quant]
        if self.compress != "none":
            zstd = "zstd" if self.level == DEFAULT_LEVEL else f"zstd:{self.level}"
            parts.append(zstd if self.compress == "zstd" else f"shuffle+{zstd}")
        return "+".join(parts) or "raw"

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"quant": self.quant, "compress": self.compress, "level": self.level}
        if self.quality:
            data["quality"] = self.quality
        return data

    @classmethod
    def from_dict(cls, data: Any) -> CodecSpec:
        if not isinstance(data, dict):
            raise UsageError(f"malformed codec {data!r}: expected an object")
        try:
            return cls(
                str(data["quant"]),
                str(data["compress"]),
                data.get("level", DEFAULT_LEVEL),
                data.get("quality", 0),
            )
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
    dtype = arr.dtype.name
    if dtype not in ALLOWED_DTYPES:
        raise CodecError(
            f"cannot encode tensor {name!r} of dtype {arr.dtype}: expected one of "
            f"{', '.join(ALLOWED_DTYPES)}"
        )
    if codec.image:
        return _encode_image(name, arr, codec, image)
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
    if codec.image:
        check_image_shape(shape, ImageNorm.from_params(tensor.params))
        return codec
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
    if codec.image:
        return decode_images(tensor.data, codec.quant, tensor.shape, tensor.dtype, tensor.params)
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


def measure(
    spec: CodecSpec | str,
    arrays: Sequence[np.ndarray],
    *,
    repeats: int = 3,
    image: ImageNorm | None = None,
) -> CodecStats:
    """Ratio, speed (median of ``repeats``) and worst error of a codec on ``arrays``.

    The error is over elements finite both before and after (fp16 overflow shows as inf).
    ``image`` is the arrays' normalisation, which image codecs need.
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
        encoded = [encode(f"t{i}", a, codec, image=image) for i, a in enumerate(arrays)]
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
        max_abs_error=0.0 if codec.bit_exact else error,
    )


def decoded_nbytes(tensor: EncodedTensor) -> int:
    """Decoded size in bytes that ``tensor`` declares (shape times item size)."""
    return math.prod(tensor.shape) * np.dtype(tensor.dtype).itemsize
