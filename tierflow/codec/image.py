"""Image codecs: a normalised image tensor crosses a link as JPEG, WebP or PNG.

A camera app uploads its frame as JPEG, not as a float tensor; these codecs let tierflow
do the same with a model's image input. The sender turns the float tensor back into
8-bit pixels (undoing ``(pixel / scale - mean) / std``), encodes each image of the batch,
and the receiver decodes the pixels and normalises them again into the model's tensor
(dtype, shape and layout restored). :class:`ImageNorm` is the normalisation; it travels
in ``params`` so that decoding needs nothing but the message.

The libraries are optional (the ``image`` extra): JPEG goes through ``simplejpeg``
(libjpeg-turbo), WebP and PNG through Pillow, each imported only when used.

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
error is measured: :func:`measure`, benchmarks/image_codecs.py). ``CodecSpec.lossless``
is True for ``png``; ``CodecSpec.bit_exact`` only for the codecs without a quantiser.

Libraries, chosen by measurement (benchmarks/image_codecs.py: twelve 224x224 crops
of scikit-learn's two sample photos, quality 90, 4:2:0, one core, medians): simplejpeg
1.9 (libjpeg-turbo) encodes and decodes in 0.28 + 0.37 ms, Pillow 13 (also
libjpeg-turbo, through its own image object) in 0.47 + 0.70 ms, for the same bytes
(13.3 against 13.2 KB median): 1.8x faster end to end (1.6x in a first run on two crops).
So JPEG uses simplejpeg; WebP and PNG, which simplejpeg lacks, use Pillow (WebP costs
~13 ms to encode and 3-9 ms to decode there, for bytes close to JPEG's: JPEG is the
codec to prefer on a slow device). Both are in the ``image`` extra (``pip install
'tierflow[image]'``) and imported only when an image codec is used; without them it is a
CodecError naming the extra. Decoding checks, before any pixel is decompressed, that the
payload splits into exactly N images and that each image's header declares the shape's
height, width and mode (simplejpeg's ``decode_jpeg_header``; a Pillow plugin's image
class, opened directly so that no other format is guessed): the declared shape is within
``max_bytes``, so the pixels are too, which is why Pillow's process-wide
``MAX_IMAGE_PIXELS`` is not relied on (opening the plugin class directly also skips its
process-wide warning). Any failure of
a decoder on hostile bytes is a CodecError.
"""

from __future__ import annotations

import importlib
import io
import math
import struct
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

from tierflow.errors import CodecError, UsageError
from tierflow.extras import install_hint

IMAGE_CODECS: tuple[str, ...] = ("jpeg", "webp", "png")
#: Image codecs that take a quality (1..100).
QUALITY_CODECS: tuple[str, ...] = ("jpeg", "webp")
LAYOUTS: tuple[str, ...] = ("NCHW", "NHWC")
#: Largest side an image codec carries (JPEG's own limit is 65500, WebP's 16383).
MAX_SIDE = 16383
_LENGTH = struct.Struct("<I")
# WebP's effort (0..6): 0 encodes a 224x224 photo ~2.4x faster than the default 4 for
# ~8% more bytes. PNG's zlib level 1 is ~1.8x faster than the default 6 for ~6% more.
_WEBP_METHOD = 0
_PNG_LEVEL = 1


@dataclass(frozen=True)
class ImageNorm:
    """How an image tensor was made from 8-bit pixels: ``(pixel / scale - mean) / std``.

    ``mean`` and ``std`` have one value per channel (1 or 3); ``layout`` says where the
    channels are in the 4-D tensor (``NCHW`` or ``NHWC``).
    """

    mean: tuple[float, ...]
    std: tuple[float, ...]
    scale: float = 255.0
    layout: str = "NCHW"

    def __post_init__(self) -> None:
        try:
            mean = tuple(float(m) for m in self.mean)
            std = tuple(float(s) for s in self.std)
            scale = float(self.scale)
        except (TypeError, ValueError) as exc:
            raise UsageError(f"malformed image normalisation: {exc}") from exc
        if len(mean) not in (1, 3) or len(std) != len(mean):
            raise UsageError(
                "image normalisation needs 1 or 3 means and as many stds, "
                f"got {len(mean)} and {len(std)}"
            )
        values = (*mean, *std, scale)
        if not all(math.isfinite(v) and abs(v) < 1e30 for v in values):
            raise UsageError(f"image normalisation values must be finite, got {values}")
        if min(std) <= 0 or scale <= 0:
            raise UsageError(f"image std and scale must be positive, got {std} and {scale}")
        if self.layout not in LAYOUTS:
            raise UsageError(
                f"image layout must be one of {', '.join(LAYOUTS)}, got {self.layout!r}"
            )
        object.__setattr__(self, "mean", mean)
        object.__setattr__(self, "std", std)
        object.__setattr__(self, "scale", scale)

    @property
    def channels(self) -> int:
        return len(self.mean)

    @property
    def axis(self) -> int:
        return 1 if self.layout == "NCHW" else 3

    def to_dict(self) -> dict[str, Any]:
        return {
            "mean": list(self.mean),
            "std": list(self.std),
            "scale": self.scale,
            "layout": self.layout,
        }

    @classmethod
    def from_dict(cls, data: Any) -> ImageNorm:
        if not isinstance(data, dict):
            raise UsageError(f"malformed image normalisation {data!r}: expected an object")
        try:
            return cls(
                mean=tuple(data["mean"]),
                std=tuple(data["std"]),
                scale=data.get("scale", 255.0),
                layout=str(data.get("layout", "NCHW")),
            )
        except (KeyError, TypeError) as exc:
            raise UsageError(f"malformed image normalisation {data!r}: {exc}") from exc

    def to_params(self) -> bytes:
        """The wire ``params``: float32 mean..., std..., scale, layout (0 NCHW, 1 NHWC)."""
        layout = float(LAYOUTS.index(self.layout))
        return np.array([*self.mean, *self.std, self.scale, layout], "<f4").tobytes()

    @classmethod
    def from_params(cls, params: bytes) -> ImageNorm:
        """Read ``params`` back; any fault is a CodecError."""
        if len(params) not in (16, 32):
            raise CodecError(
                f"image codec needs 16 or 32 parameter bytes (1 or 3 channels), found {len(params)}"
            )
        values = np.frombuffer(params, "<f4").astype(np.float64)
        channels = (len(values) - 2) // 2
        if values[-1] not in (0.0, 1.0):
            raise CodecError(f"image codec layout code must be 0 or 1, found {values[-1]}")
        try:
            return cls(
                mean=tuple(values[:channels]),
                std=tuple(values[channels : 2 * channels]),
                scale=float(values[-2]),
                layout=LAYOUTS[int(values[-1])],
            )
        except UsageError as exc:
            raise CodecError(f"malformed image codec parameters: {exc}") from exc


def check_image_shape(shape: tuple[int, ...], norm: ImageNorm) -> tuple[int, int, int, int]:
    """(N, H, W, C) of an image tensor of ``shape``, or a CodecError saying why not."""
    if len(shape) != 4:
        raise CodecError(f"image codecs carry 4-D {norm.layout} tensors, got shape {shape}")
    if norm.layout == "NCHW":
        count, channels, height, width = shape
    else:
        count, height, width, channels = shape
    if channels != norm.channels:
        raise CodecError(
            f"image tensor of shape {shape} ({norm.layout}) has {channels} channels, "
            f"its normalisation {norm.channels}"
        )
    if not (0 < height <= MAX_SIDE and 0 < width <= MAX_SIDE):
        raise CodecError(f"image sides must be within 1..{MAX_SIDE}, got {height}x{width}")
    return count, height, width, channels


# --------------------------------------------------------------------------- libraries


def _import(name: str) -> ModuleType:
    """Import an image library; missing, it is a CodecError naming the extra.

    A CodecError rather than a MissingExtraError: to the tier that meets it, a message it
    cannot decode is a codec failure of that message, answered as such.
    """
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise CodecError(
            f"image codecs need {name.split('.')[0]}, which is not installed: "
            f"{install_hint('image')}"
        ) from exc


def _encode_jpeg(pixels: np.ndarray, quality: int) -> bytes:
    simplejpeg = _import("simplejpeg")
    gray = pixels.shape[2] == 1
    data: bytes = simplejpeg.encode_jpeg(
        pixels,
        quality=quality,
        colorspace="GRAY" if gray else "RGB",
        colorsubsampling="Gray" if gray else "420",
    )
    return data


def _decode_jpeg(data: bytes, out: np.ndarray) -> None:
    simplejpeg = _import("simplejpeg")
    height, width, channels = out.shape
    try:
        found = simplejpeg.decode_jpeg_header(data)[:2]
    except Exception as exc:  # any failure of the decoder on hostile bytes
        raise CodecError(f"corrupt JPEG image: {exc}") from exc
    if tuple(found) != (height, width):
        raise CodecError(f"JPEG image is {found[0]}x{found[1]}, expected {height}x{width}")
    try:
        simplejpeg.decode_jpeg(data, colorspace="GRAY" if channels == 1 else "RGB", buffer=out)
    except Exception as exc:
        raise CodecError(f"corrupt JPEG image: {exc}") from exc


def _pil_encode(pixels: np.ndarray, fmt: str, **options: Any) -> bytes:
    image_mod = _import("PIL.Image")
    mode = "L" if pixels.shape[2] == 1 else "RGB"
    image = image_mod.fromarray(pixels[:, :, 0] if mode == "L" else pixels, mode=mode)
    buffer = io.BytesIO()
    image.save(buffer, fmt, **options)
    return buffer.getvalue()


def _pil_decode(data: bytes, out: np.ndarray, plugin: str, fmt: str) -> None:
    """Decode with one Pillow plugin, checking size and mode before the pixels load.

    The plugin's image class is used directly rather than ``Image.open``: no format is
    guessed, and the size is checked against the declared shape (itself within the
    decoder's byte bound) before anything is decompressed, which is a tighter guard
    than Pillow's global ``MAX_IMAGE_PIXELS`` (a warning, process-wide).
    """
    module = _import(f"PIL.{plugin}")
    height, width, channels = out.shape
    try:
        image = getattr(module, f"{plugin.removesuffix('ImagePlugin')}ImageFile")(io.BytesIO(data))
    except Exception as exc:
        raise CodecError(f"corrupt {fmt} image: {exc}") from exc
    modes = (
        ("L", "RGB") if channels == 1 and fmt == "WebP" else ("L",) if channels == 1 else ("RGB",)
    )
    if image.size != (width, height) or image.mode not in modes:
        raise CodecError(
            f"{fmt} image is {image.size[1]}x{image.size[0]} {image.mode}, "
            f"expected {height}x{width} {modes[0]}"
        )
    try:
        image.load()
        if image.mode != modes[0]:
            image = image.convert(modes[0])
        pixels = np.asarray(image)
    except Exception as exc:
        raise CodecError(f"corrupt {fmt} image: {exc}") from exc
    out[...] = pixels.reshape(out.shape)


_ENCODERS: dict[str, Callable[[np.ndarray, int], bytes]] = {
    "jpeg": _encode_jpeg,
    "webp": lambda p, q: _pil_encode(p, "WEBP", quality=q, method=_WEBP_METHOD),
    "png": lambda p, q: _pil_encode(p, "PNG", compress_level=_PNG_LEVEL),
}
_DECODERS: dict[str, Callable[[bytes, np.ndarray], None]] = {
    "jpeg": _decode_jpeg,
    "webp": lambda d, o: _pil_decode(d, o, "WebPImagePlugin", "WebP"),
    "png": lambda d, o: _pil_decode(d, o, "PngImagePlugin", "PNG"),
}


# --------------------------------------------------------------------------- encode/decode


def _vector(values: tuple[float, ...], norm: ImageNorm, work: type) -> np.ndarray:
    """Per-channel values (rounded to float32, as they travel) shaped to broadcast."""
    shape = [1, 1, 1, 1]
    shape[norm.axis] = len(values)
    return np.asarray(values, np.float32).astype(work).reshape(shape)


def to_pixels(array: np.ndarray, norm: ImageNorm) -> np.ndarray:
    """8-bit pixels (N, H, W, C) of a normalised tensor: ``rint((x * std + mean) * scale)``,
    saturated to 0..255 (NaN becomes 0)."""
    check_image_shape(array.shape, norm)
    work = np.float64 if array.dtype == np.float64 else np.float32
    gain = np.asarray(norm.std, np.float64) * norm.scale
    bias = np.asarray(norm.mean, np.float64) * norm.scale
    # Clipping x first to what maps within -1..256 keeps every step finite (no overflow
    # to silence: np.errstate makes each ufunc call ~10x slower here); NaN passes through.
    low = _vector(tuple((-1.0 - bias) / gain), norm, work)
    high = _vector(tuple((256.0 - bias) / gain), norm, work)
    values = np.clip(array.astype(work), low, high)
    values *= _vector(tuple(gain), norm, work)
    values += _vector(tuple(bias), norm, work)
    np.rint(values, out=values)
    np.clip(values, 0, 255, out=values)
    values[np.isnan(values)] = 0
    codes = values.astype(np.uint8)
    if norm.layout == "NHWC":
        return codes
    # Channel by channel: numpy's strided transpose copy is ~30x slower at 224x224x3.
    count, channels, height, width = codes.shape
    pixels = np.empty((count, height, width, channels), np.uint8)
    for channel in range(channels):
        pixels[..., channel] = codes[:, channel]
    return pixels


def from_pixels(pixels: np.ndarray, norm: ImageNorm, dtype: str) -> np.ndarray:
    """The model's tensor of 8-bit ``pixels`` (N, H, W, C): ``(pixel / scale - mean) / std``
    computed in float32 (float64 for a float64 tensor), in ``norm.layout``."""
    work = np.float64 if dtype == "float64" else np.float32
    if norm.layout == "NCHW":
        pixels = pixels.transpose(0, 3, 1, 2)
    values = pixels.astype(work, order="C")
    np.divide(values, work(np.float32(norm.scale)), out=values)
    np.subtract(values, _vector(norm.mean, norm, work), out=values)
    np.divide(values, _vector(norm.std, norm, work), out=values)
    return np.ascontiguousarray(values.astype(dtype, copy=False))


def encode_images(array: np.ndarray, codec: str, quality: int, norm: ImageNorm) -> bytes:
    """The payload: each image encoded separately, each prefixed by its uint32 length."""
    pixels = to_pixels(array, norm)
    encoder = _ENCODERS[codec]
    parts: list[bytes] = []
    for image in pixels:
        data = encoder(image, quality)
        parts += [_LENGTH.pack(len(data)), data]
    return b"".join(parts)


def decode_images(
    data: bytes, codec: str, shape: tuple[int, ...], dtype: str, params: bytes
) -> np.ndarray:
    """Decode a payload of :func:`encode_images`; every fault is a CodecError."""
    norm = ImageNorm.from_params(params)
    count, height, width, channels = check_image_shape(shape, norm)
    pixels = np.empty((count, height, width, channels), np.uint8)
    view = memoryview(data)
    position = 0
    for index in range(count):
        if position + _LENGTH.size > len(view):
            raise CodecError(f"image payload ends before image {index} of {count}")
        (length,) = _LENGTH.unpack_from(view, position)
        position += _LENGTH.size
        if length > len(view) - position:
            raise CodecError(
                f"image {index} declares {length} bytes, only {len(view) - position} remain"
            )
        _DECODERS[codec](bytes(view[position : position + length]), pixels[index])
        position += length
    if position != len(view):
        raise CodecError(f"image payload has {len(view) - position} bytes after its {count} images")
    return from_pixels(pixels, norm, dtype)
