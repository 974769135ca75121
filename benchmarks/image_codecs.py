"""Image codecs on real photos: what a camera app uploads against tierflow's tensor codecs.

Not a test. The inputs are 224x224 crops of scikit-learn's two bundled sample photos
(``load_sample_images``: offline), normalised as an ImageNet model expects (float32
NCHW, ``(pixel / 255 - mean) / std``), one image per request. For every codec — the
JPEG quality sweep, WebP, PNG, and the tensor codecs (``int8+zstd`` and friends) on the
same normalised tensor — it reports bytes per request, the error against the exact
tensor (largest and mean, in pixel levels: normalised error x std x 255) and the encode
and decode time (medians, one core). A second table is the measurement behind the
choice of JPEG library ([Note: image codecs] in tierflow/codec/image.py): simplejpeg
against Pillow, both libjpeg-turbo, at quality 90.

Writes ``benchmarks/results/image_codec.json``.
Usage: ``python -m benchmarks.image_codecs [--repeats 20]``.
"""

from __future__ import annotations

import argparse
import functools
import io
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import lib
from tierflow.codec.base import ImageNorm, decode, encode
from tierflow.partitioner.report import format_table

RESULTS = lib.RESULTS / "image_codec.json"
NORM = ImageNorm(mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225))
CODECS: tuple[str, ...] = (
    "jpeg:30",
    "jpeg:50",
    "jpeg:70",
    "jpeg:80",
    "jpeg:90",
    "jpeg:95",
    "webp:50",
    "webp:80",
    "webp:90",
    "png",
    "raw",
    "zstd",
    "fp16+zstd",
    "int8+zstd",
    "int8c+zstd",
    "int4+zstd",
)
SIDE = 224


def photos() -> np.ndarray:
    """(12, 224, 224, 3) uint8 crops: top and bottom, left, middle and right of each photo."""
    from sklearn.datasets import load_sample_images

    crops = []
    for image in load_sample_images().images:
        height, width, _ = image.shape
        for top in (0, height - SIDE):
            for left in (0, (width - SIDE) // 2, width - SIDE):
                crops.append(image[top : top + SIDE, left : left + SIDE])
    return np.ascontiguousarray(np.stack(crops))


def normalise(pixels: np.ndarray) -> np.ndarray:
    """(1, 3, H, W) float32 of one (H, W, 3) uint8 image, as the decoder computes it."""
    mean = np.asarray(NORM.mean, np.float32)
    std = np.asarray(NORM.std, np.float32)
    values = (pixels.astype(np.float32) / np.float32(255) - mean) / std
    return np.ascontiguousarray(values.transpose(2, 0, 1)[None])


def _median_ms(function: Callable[[Any], Any], argument: Any, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function(argument)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def measure_codecs(tensors: list[np.ndarray], repeats: int) -> list[dict[str, Any]]:
    levels = (np.asarray(NORM.std) * 255).reshape(1, 3, 1, 1)
    rows = []
    for codec in CODECS:
        sizes, max_err, mean_err, enc_ms, dec_ms = [], [], [], [], []
        for tensor in tensors:
            encoded = encode("input", tensor, codec, image=NORM)
            error = np.abs(decode(encoded).astype(np.float64) - tensor) * levels
            sizes.append(encoded.nbytes)
            max_err.append(float(error.max()))
            mean_err.append(float(error.mean()))
            encoder = functools.partial(encode, "input", spec=codec, image=NORM)
            enc_ms.append(_median_ms(encoder, tensor, repeats))
            dec_ms.append(_median_ms(decode, encoded, repeats))
        rows.append(
            {
                "codec": codec,
                "bytes_median": float(np.median(sizes)),
                "bytes_min": int(min(sizes)),
                "bytes_max": int(max(sizes)),
                "ratio_to_fp32": float(tensors[0].nbytes / np.median(sizes)),
                "max_error_levels": max(max_err),
                "mean_error_levels": float(np.mean(mean_err)),
                "encode_ms": float(np.median(enc_ms)),
                "decode_ms": float(np.median(dec_ms)),
            }
        )
    return rows


def compare_jpeg_libraries(images: np.ndarray, repeats: int) -> list[dict[str, Any]]:
    """simplejpeg against Pillow at quality 90 (4:2:0 both), on the same pixels."""
    import simplejpeg
    from PIL import Image

    def pil_encode(pixels: np.ndarray) -> bytes:
        buffer = io.BytesIO()
        Image.fromarray(pixels).save(buffer, "JPEG", quality=90)
        return buffer.getvalue()

    def pil_decode(data: bytes) -> np.ndarray:
        return np.asarray(Image.open(io.BytesIO(data)))

    def sj_encode(pixels: np.ndarray) -> bytes:
        return bytes(simplejpeg.encode_jpeg(pixels, 90, "RGB", "420"))

    def sj_decode(data: bytes) -> np.ndarray:
        return np.asarray(simplejpeg.decode_jpeg(data, "RGB"))

    rows = []
    for name, enc, dec in (
        ("simplejpeg", sj_encode, sj_decode),
        ("pillow", pil_encode, pil_decode),
    ):
        sizes, enc_ms, dec_ms = [], [], []
        for pixels in images:
            data = enc(pixels)
            sizes.append(len(data))
            enc_ms.append(_median_ms(enc, pixels, repeats))
            dec_ms.append(_median_ms(dec, data, repeats))
        rows.append(
            {
                "library": name,
                "bytes_median": float(np.median(sizes)),
                "encode_ms": float(np.median(enc_ms)),
                "decode_ms": float(np.median(dec_ms)),
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--repeats", type=int, default=20, help="timed runs per image")
    parser.add_argument("--output", type=Path, default=RESULTS, help="JSON results file")
    args = parser.parse_args(argv)
    images = photos()
    tensors = [normalise(image) for image in images]
    rows = measure_codecs(tensors, args.repeats)
    libraries = compare_jpeg_libraries(images, args.repeats * 5)
    int8 = next(r for r in rows if r["codec"] == "int8+zstd")["bytes_median"]
    print(
        f"{len(images)} photo crops of {SIDE}x{SIDE}x3, ImageNet-normalised float32 NCHW "
        f"({tensors[0].nbytes} bytes); error in pixel levels; medians; one core"
    )
    print(
        format_table(
            [
                "codec",
                "bytes (median)",
                "min..max",
                "vs int8+zstd",
                "max err",
                "mean err",
                "enc ms",
                "dec ms",
            ],
            [
                [
                    r["codec"],
                    f"{r['bytes_median']:.0f}",
                    f"{r['bytes_min']}..{r['bytes_max']}",
                    f"{r['bytes_median'] / int8:.2f}x",
                    f"{r['max_error_levels']:.1f}",
                    f"{r['mean_error_levels']:.2f}",
                    f"{r['encode_ms']:.2f}",
                    f"{r['decode_ms']:.2f}",
                ]
                for r in rows
            ],
        )
    )
    print("\nJPEG library, quality 90, 4:2:0, on the same crops (medians)")
    print(
        format_table(
            ["library", "bytes", "encode ms", "decode ms", "enc+dec ms"],
            [
                [
                    r["library"],
                    f"{r['bytes_median']:.0f}",
                    f"{r['encode_ms']:.3f}",
                    f"{r['decode_ms']:.3f}",
                    f"{r['encode_ms'] + r['decode_ms']:.3f}",
                ]
                for r in libraries
            ],
        )
    )
    result = {
        "images": len(images),
        "side": SIDE,
        "normalisation": NORM.to_dict(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "rows": rows,
        "jpeg_libraries": libraries,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
