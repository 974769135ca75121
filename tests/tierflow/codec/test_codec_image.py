"""Tests for the image codecs: jpeg:Q, webp:Q and png on normalised image tensors."""

from __future__ import annotations

import struct
import sys
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from tierflow.codec.base import (
    CodecSpec,
    EncodedTensor,
    ImageNorm,
    decode,
    encode,
    measure,
)
from tierflow.errors import CodecError, UsageError

FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
IMAGENET = ImageNorm(mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225))
GREY = ImageNorm(mean=(0.5,), std=(0.25,), scale=255.0, layout="NHWC")


@pytest.fixture(scope="module")
def photos() -> np.ndarray:
    """Two real 64x64 RGB crops (N, H, W, C) of scikit-learn's bundled sample photos."""
    sklearn_datasets = pytest.importorskip("sklearn.datasets")
    images = sklearn_datasets.load_sample_images().images
    return np.stack([image[200:264, 300:364] for image in images])


def normalise(pixels: np.ndarray, norm: ImageNorm, dtype: str = "float32") -> np.ndarray:
    """(N, H, W, C) uint8 pixels as the decoder normalises them, in ``norm.layout``."""
    work = np.float64 if dtype == "float64" else np.float32
    mean = np.asarray(norm.mean, np.float32).astype(work)
    std = np.asarray(norm.std, np.float32).astype(work)
    values = (pixels.astype(work) / work(np.float32(norm.scale)) - mean) / std
    if norm.layout == "NCHW":
        values = values.transpose(0, 3, 1, 2)
    return np.ascontiguousarray(values.astype(dtype))


# --------------------------------------------------------------------------- spec


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("jpeg:90", CodecSpec("jpeg", "none", quality=90)),
        ("JPEG:1", CodecSpec("jpeg", "none", quality=1)),
        ("webp:75", CodecSpec("webp", "none", quality=75)),
        ("png", CodecSpec("png", "none")),
    ],
)
def test_image_codecs_parse_and_print_back(text: str, expected: CodecSpec) -> None:
    spec = CodecSpec.parse(text)
    assert spec == expected
    assert spec.image
    assert CodecSpec.parse(str(spec)) == spec
    assert CodecSpec.from_dict(spec.to_dict()) == spec


@pytest.mark.parametrize(
    "text",
    ["jpeg", "jpeg:0", "jpeg:101", "jpeg:x", "jpeg:", "png:5", "webp", "jpeg:90+zstd", "int8+png"],
)
def test_malformed_image_codecs_are_refused(text: str) -> None:
    with pytest.raises(UsageError, match=r"expected|must"):
        CodecSpec.parse(text)


def test_only_png_is_lossless_and_no_image_codec_is_bit_exact() -> None:
    assert CodecSpec.parse("png").lossless
    assert not CodecSpec.parse("jpeg:100").lossless
    assert not CodecSpec.parse("webp:100").lossless
    assert not any(CodecSpec.parse(t).bit_exact for t in ("png", "jpeg:90", "webp:90"))
    assert CodecSpec.parse("zstd").bit_exact and not CodecSpec.parse("int8").bit_exact
    with pytest.raises(UsageError, match="quality"):
        CodecSpec("int8", "none", quality=5)
    with pytest.raises(UsageError, match="combined"):
        CodecSpec("png", "zstd")
    with pytest.raises(UsageError, match="combined"):
        CodecSpec("jpeg", "none", quality=90, sparse=True)


def test_image_norm_validates_and_round_trips() -> None:
    assert ImageNorm.from_dict(IMAGENET.to_dict()) == IMAGENET
    assert ImageNorm.from_dict({"mean": [0.5], "std": [0.5]}).layout == "NCHW"
    for bad in (
        {"mean": (0.5, 0.5), "std": (1.0, 1.0)},
        {"mean": (0.5,), "std": (0.0,)},
        {"mean": (0.5,), "std": (1.0, 1.0, 1.0)},
        {"mean": (float("nan"),), "std": (1.0,)},
        {"mean": (0.5,), "std": (1.0,), "scale": -1.0},
        {"mean": (0.5,), "std": (1.0,), "layout": "CHW"},
    ):
        with pytest.raises(UsageError):
            ImageNorm(**bad)  # type: ignore[arg-type]
    with pytest.raises(UsageError):
        ImageNorm.from_dict({"std": [1.0]})


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
@pytest.mark.parametrize("norm", [IMAGENET, GREY], ids=["rgb-nchw", "grey-nhwc"])
def test_png_reproduces_a_normalised_tensor_bit_for_bit(
    photos: np.ndarray, norm: ImageNorm, dtype: str
) -> None:
    pixels = photos if norm.channels == 3 else photos[..., :1]
    tensor = normalise(pixels, norm, dtype)
    encoded = encode("input", tensor, "png", image=norm)
    assert encoded.codec == "png"
    decoded = decode(encoded)
    assert decoded.dtype == tensor.dtype and decoded.shape == tensor.shape
    assert decoded.tobytes() == tensor.tobytes()


@FAST
@given(
    pixels=hnp.arrays(np.float64, (2, 5, 7, 3), elements=st.floats(-20, 275)),
    layout=st.sampled_from(["NCHW", "NHWC"]),
)
def test_png_moves_values_by_at_most_half_a_pixel_level(pixels: np.ndarray, layout: str) -> None:
    norm = ImageNorm(mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225), layout=layout)
    tensor = normalise(pixels.astype(np.float32), norm)  # between levels, beyond the range
    decoded = decode(encode("x", tensor, "png", image=norm)).astype(np.float64)
    std = np.asarray(norm.std).reshape((1, 3, 1, 1) if layout == "NCHW" else (1, 1, 1, 3))
    mean = np.asarray(norm.mean).reshape(std.shape)
    low, high = (0 / 255 - mean) / std, (255 / 255 - mean) / std
    target = np.clip(tensor.astype(np.float64), low, high)  # out-of-range values saturate
    bound = 0.5 / (255 * std) + 1e-5
    assert (np.abs(decoded - target) <= bound).all()


@pytest.mark.parametrize("codec", ["jpeg:90", "jpeg:30", "webp:80"])
@pytest.mark.parametrize("norm", [IMAGENET, GREY], ids=["rgb-nchw", "grey-nhwc"])
def test_lossy_image_codecs_restore_the_tensor_and_save_bytes(
    photos: np.ndarray, norm: ImageNorm, codec: str
) -> None:
    pixels = photos if norm.channels == 3 else photos[..., :1]
    tensor = normalise(pixels, norm)
    encoded = encode("input", tensor, codec, image=norm)
    decoded = decode(encoded)
    assert decoded.dtype == tensor.dtype and decoded.shape == tensor.shape
    # JPEG has no fixed bound (4:2:0 chroma moves sharp colour edges by tens of levels;
    # these crops are textured: Pillow's JPEG at q90 is off by 4-7 levels on average).
    level = 1 / (255 * np.asarray(norm.std).min())
    assert np.abs(decoded - tensor).mean() <= 12 * level
    assert encoded.nbytes < encode("input", tensor, "int8+zstd").nbytes


def test_jpeg_quality_trades_bytes_for_error(photos: np.ndarray) -> None:
    tensor = normalise(photos, IMAGENET)
    sizes, errors = [], []
    for quality in (20, 60, 95):
        encoded = encode("x", tensor, f"jpeg:{quality}", image=IMAGENET)
        sizes.append(encoded.nbytes)
        errors.append(float(np.abs(decode(encoded) - tensor).mean()))
    assert sizes == sorted(sizes) and errors == sorted(errors, reverse=True)


def test_empty_batch_round_trips() -> None:
    tensor = np.zeros((0, 3, 8, 8), np.float32)
    encoded = encode("x", tensor, "jpeg:90", image=IMAGENET)
    assert encoded.data == b""
    assert decode(encoded).shape == (0, 3, 8, 8)


def test_measure_reports_image_codecs(photos: np.ndarray) -> None:
    tensor = normalise(photos, IMAGENET)
    stats = measure("jpeg:90", [tensor], repeats=1, image=IMAGENET)
    assert stats.codec == "jpeg:90" and stats.ratio > 5 and stats.max_abs_error > 0
    assert measure("png", [tensor], repeats=1, image=IMAGENET).max_abs_error == 0.0


# --------------------------------------------------------------------------- misuse


def test_image_codec_needs_a_normalisation_and_a_float_image_tensor() -> None:
    tensor = np.zeros((1, 3, 8, 8), np.float32)
    with pytest.raises(CodecError, match="ImageNorm"):
        encode("x", tensor, "jpeg:90")
    with pytest.raises(CodecError, match="float"):
        encode("x", tensor.astype(np.uint8), "png", image=IMAGENET)
    with pytest.raises(CodecError, match="channels"):
        encode("x", tensor, "png", image=GREY)
    with pytest.raises(CodecError, match="4-D"):
        encode("x", tensor[0], "png", image=IMAGENET)
    # other codecs ignore the normalisation
    assert encode("x", tensor, "int8", image=IMAGENET).codec == "int8"


def test_missing_library_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "simplejpeg", None)
    with pytest.raises(CodecError, match=r"pip install 'tierflow\[image\]'"):
        encode("x", np.zeros((1, 3, 8, 8), np.float32), "jpeg:90", image=IMAGENET)


# --------------------------------------------------------------------------- hostile input


@pytest.fixture(scope="module")
def good() -> EncodedTensor:
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, (2, 8, 8, 3), dtype=np.uint8)
    return encode("x", normalise(pixels, IMAGENET), "png", image=IMAGENET)


def with_(tensor: EncodedTensor, **change: object) -> EncodedTensor:
    fields = {f: getattr(tensor, f) for f in ("name", "dtype", "shape", "codec", "params", "data")}
    return EncodedTensor(**{**fields, **change})  # type: ignore[arg-type]


def png_header(width: int, height: int) -> bytes:
    """A PNG whose IHDR declares ``width`` x ``height`` RGB, with no pixel data at all."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    chunk = struct.pack(">I", len(ihdr)) + b"IHDR" + ihdr
    chunk += struct.pack(">I", zlib.crc32(b"IHDR" + ihdr))
    iend = struct.pack(">I", 0) + b"IEND" + struct.pack(">I", zlib.crc32(b"IEND"))
    return b"\x89PNG\r\n\x1a\n" + chunk + iend


def framed(*images: bytes) -> bytes:
    return b"".join(struct.pack("<I", len(i)) + i for i in images)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"params": b""}, "parameter bytes"),
        ({"params": np.array([0, 0, 0, 1, 1, 1, 255, 2], "<f4").tobytes()}, "layout"),
        ({"params": np.array([0, 0, 0, 1, -1, 1, 255, 0], "<f4").tobytes()}, "positive"),
        ({"params": np.array([0, 0, np.nan, 1, 1, 1, 255, 0], "<f4").tobytes()}, "finite"),
        ({"params": np.array([0, 1, 255, 0], "<f4").tobytes()}, "channels"),
        ({"dtype": "uint8"}, "not float"),
        ({"shape": (2, 3, 8)}, "4-D"),
        ({"shape": (2, 3, 0, 8)}, "sides"),
        ({"shape": (3, 3, 8, 8)}, "ends before image 2"),
        ({"shape": (1, 3, 8, 8)}, "after its 1 images"),
        ({"shape": (2, 3, 8, 9)}, "expected 8x9"),
        ({"shape": (2, 3, 100000, 100000)}, "would decode to"),
        ({"data": b"\x01"}, "ends before image 0"),
        ({"data": struct.pack("<I", 1 << 30)}, "declares"),
        ({"data": framed(b"not a png", b"nor this")}, "corrupt PNG"),
        ({"data": framed(png_header(50000, 50000), png_header(8, 8))}, "50000x50000"),
        ({"codec": "jpeg:90"}, "corrupt JPEG"),
        ({"codec": "webp:90"}, "corrupt WebP"),
    ],
)
def test_decode_refuses_hostile_images(
    good: EncodedTensor, change: dict[str, object], message: str
) -> None:
    with pytest.raises(CodecError, match=message):
        decode(with_(good, **change), max_bytes=1 << 24)


def test_truncated_pixel_data_is_a_codec_error(good: EncodedTensor) -> None:
    (length,) = struct.unpack_from("<I", good.data)
    first = good.data[4 : 4 + length]
    with pytest.raises(CodecError, match="corrupt PNG"):
        decode(with_(good, data=framed(first[: len(first) // 2], first)))


def test_mode_mismatch_is_refused(good: EncodedTensor) -> None:
    grey = encode("x", np.zeros((2, 8, 8, 1), np.float32), "png", image=GREY)
    with pytest.raises(CodecError, match="RGB, expected 8x8 L"):
        decode(with_(grey, data=good.data))
    jpeg = encode("x", np.zeros((2, 3, 8, 8), np.float32), "jpeg:90", image=IMAGENET)
    with pytest.raises(CodecError, match="expected 9x8"):
        decode(with_(jpeg, shape=(2, 3, 9, 8)))


@settings(max_examples=150, deadline=None)
@given(
    codec=st.sampled_from(["png", "jpeg:80", "webp:60"]),
    position=st.integers(0, 10_000),
    value=st.integers(0, 255),
    cut=st.integers(0, 10_000),
)
def test_mutated_images_raise_codec_error_or_decode_validly(
    codec: str, position: int, value: int, cut: int
) -> None:
    rng = np.random.default_rng(1)
    pixels = rng.integers(0, 256, (2, 8, 8, 3), dtype=np.uint8)
    tensor = encode("x", normalise(pixels, IMAGENET), codec, image=IMAGENET)
    data = bytearray(tensor.data)
    data[position % len(data)] = value
    data = data[: max(1, cut % (len(data) + 1))] if cut % 3 == 0 else data
    try:
        decoded = decode(with_(tensor, data=bytes(data)))
    except CodecError:
        return
    assert decoded.shape == tensor.shape and decoded.dtype == np.float32
