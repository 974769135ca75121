"""Codec benchmark: ratio, speed and error of every feature codec.

Not a test: it prints one aligned table per data set and writes the figures to
``benchmarks/results/codec.json``. Data sets:

* ``cnn``: post-ReLU features of a small random-init conv net (numpy, three conv layers)
  run on handwritten digits (scikit-learn's bundled ``load_digits``, smoothly upsampled,
  with a little noise; synthetic blobs if scikit-learn is absent) — or the float arrays
  of ``--features FILE.npz`` (e.g. real features saved by a tier) instead;
* ``100KB`` and ``1MB``: float32 standard-normal tensors, the incompressible worst case.

Speeds are medians over ``--repeats`` runs, in MB/s of raw (decoded) data; one core.
Usage: ``python -m benchmarks.codec_speed [--features F.npz] [--repeats 5]``.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import zstandard

from benchmarks import lib
from tierflow.cli.table import format_table
from tierflow.codec.base import CodecSpec, CodecStats, measure

SCHEMES: tuple[str, ...] = (
    "raw",
    "zstd:1",
    "zstd",
    "zstd:9",
    "shuffle+zstd",
    "fp16",
    "fp16+zstd",
    "fp16+shuffle+zstd",
    "int8",
    "int8+zstd",
    "int8c",
    "int8c+zstd",
)
RESULTS = lib.RESULTS / "codec.json"


def _upsample(size: int, source: int) -> np.ndarray:
    """(size, source) matrix of linear interpolation from ``source`` to ``size`` pixels."""
    position = np.clip((np.arange(size) + 0.5) * source / size - 0.5, 0, source - 1)
    low = np.floor(position).astype(int)
    high = np.minimum(low + 1, source - 1)
    matrix = np.zeros((size, source))
    matrix[np.arange(size), low] += 1 - (position - low)
    matrix[np.arange(size), high] += position - low
    return matrix


def _images(count: int, size: int, rng: np.random.Generator) -> np.ndarray:
    """Camera-like images (count, 3, size, size): digits (or blobs) smoothly upsampled,
    plus a little sensor noise, so features are neither blocky nor pure noise."""
    try:
        from sklearn.datasets import load_digits

        small = load_digits().images[:count] / 16.0  # (count, 8, 8)
    except ImportError:
        yy, xx = np.mgrid[0:8, 0:8] / 8
        centres = rng.random((count, 2, 1, 1))
        small = np.exp(-((yy - centres[:, 0]) ** 2 + (xx - centres[:, 1]) ** 2) * 20)
    up = _upsample(size, small.shape[-1])
    images = up @ small @ up.T
    colour = np.stack([images * c for c in (1.0, 0.8, 0.6)], axis=1)
    colour += rng.normal(0, 0.02, colour.shape)
    return np.clip(colour, 0, 1).astype(np.float32)


def _conv_relu(x: np.ndarray, out_channels: int, stride: int, rng: np.random.Generator):
    """3x3 convolution (padding 1, He-initialised) followed by ReLU."""
    channels = x.shape[1]
    weight = rng.standard_normal((out_channels, channels, 3, 3)).astype(np.float32)
    weight *= np.sqrt(2.0 / (channels * 9))
    bias = rng.standard_normal(out_channels).astype(np.float32) * 0.1
    padded = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)))
    windows = np.lib.stride_tricks.sliding_window_view(padded, (3, 3), axis=(2, 3))
    windows = windows[:, :, ::stride, ::stride]  # (n, c, h, w, 3, 3)
    out = np.einsum("nchwij,ocij->nohw", windows, weight, optimize=True) + bias[:, None, None]
    return np.maximum(out, 0).astype(np.float32)


def cnn_features(seed: int = 0) -> list[np.ndarray]:
    """Features at three cuts of a small conv net: about 2 MB, 1 MB and 0.5 MB (float32)."""
    rng = np.random.default_rng(seed)
    x = _images(8, 64, rng)
    features = []
    for out_channels, stride in ((16, 1), (32, 2), (64, 2)):
        x = _conv_relu(x, out_channels, stride, rng)
        features.append(x)
    return features


def load_features(path: Path) -> list[np.ndarray]:
    with np.load(path) as data:
        arrays = [np.asarray(data[name]) for name in data.files if data[name].dtype.kind == "f"]
    if not arrays:
        sys.exit(f"codec_bench: {path} holds no float arrays")
    return arrays


def run(datasets: dict[str, list[np.ndarray]], repeats: int) -> dict[str, list[CodecStats]]:
    results: dict[str, list[CodecStats]] = {}
    for name, arrays in datasets.items():
        results[name] = [measure(CodecSpec.parse(s), arrays, repeats=repeats) for s in SCHEMES]
    return results


def table(name: str, arrays: list[np.ndarray], stats: list[CodecStats]) -> str:
    raw = sum(a.nbytes for a in arrays)
    zeros = sum(int((a == 0).sum()) for a in arrays) / max(sum(a.size for a in arrays), 1)
    headers = ("codec", "ratio", "encode MB/s", "decode MB/s", "max abs err")
    rows = [
        (
            s.codec,
            f"{s.ratio:.2f}",
            f"{1 / s.encode_s_per_mb:.0f}",
            f"{1 / s.decode_s_per_mb:.0f}",
            f"{s.max_abs_error:.3g}",
        )
        for s in stats
    ]
    title = f"{name}: {len(arrays)} tensor(s), {raw / 1e6:.3g} MB, {zeros:.0%} zeros"
    return title + "\n" + textwrap.indent(format_table(headers, rows), "  ")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Measure tierflow's feature codecs.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--features", type=Path, help=".npz of real features (replaces 'cnn')")
    parser.add_argument("--repeats", type=int, default=5, help="runs per figure (median)")
    parser.add_argument("--output", type=Path, default=RESULTS, help="JSON results file")
    args = parser.parse_args(argv)

    started = time.perf_counter()
    rng = np.random.default_rng(1)
    datasets = {
        "cnn" if args.features is None else args.features.name: (
            cnn_features() if args.features is None else load_features(args.features)
        ),
        "100KB": [rng.standard_normal(25_000).astype(np.float32)],
        "1MB": [rng.standard_normal(250_000).astype(np.float32)],
    }
    results = run(datasets, args.repeats)
    for name, stats in results.items():
        print(table(name, datasets[name], stats), end="\n\n")
    report: dict[str, Any] = {
        "machine": {
            "python": platform.python_version(),
            "platform": platform.platform(),
            "numpy": np.__version__,
            "zstandard": zstandard.__version__,
        },
        "repeats": args.repeats,
        "datasets": {
            name: {
                "shapes": [list(a.shape) for a in datasets[name]],
                "raw_bytes": sum(a.nbytes for a in datasets[name]),
                "codecs": [s.to_dict() for s in stats],
            }
            for name, stats in results.items()
        },
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.output} in {time.perf_counter() - started:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
