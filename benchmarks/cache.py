"""Feature-cache benchmark: hit rates on a stream of similar frames, and hit vs miss latency.

The stream is the demo model's held-out digits played as short video clips: every frame
of a clip is the clip's image with fresh sensor noise (sometimes shifted by a pixel), and
now and then the previous frame again, unchanged (a static scene). The model is split at
the single-tensor cut nearest the middle of its node order: the "device" half makes the
feature, the cloud half (ONNX Runtime, one thread) is what a cache hit saves.

For each cache (none, exact, approximate with an offline-calibrated threshold,
approximate calibrating itself online, and Redis when ``redis-server`` is installed) it
runs the stream request by request as the cloud would (look up; on a miss compute and
store) and reports hit rates, how often a cached answer's top-1 class differs from the
computed one, and median latencies of hits and misses. The approximate threshold is
calibrated on a stream made from the training images, never the held-out ones.

The demo model is small: its cloud half runs in about a tenth of a millisecond, which is
close to what hashing a feature costs. To show what a hit saves on a model of real size,
the same stream (scaled to RGB) also runs through ResNet-18 from the model zoo (seeded
weights, ``--resnet-size`` input), split the same way.

    python -m benchmarks.cache [--clips 360] [--frames 8] [--target 0.01]

Prints an aligned table and writes ``benchmarks/results/cache.json``.
"""

from __future__ import annotations

import os

# One BLAS thread, as a cloud server sharing its cores should run (see [Note: search
# cost] in tierflow.cache.approx); set before numpy loads BLAS.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from benchmarks import lib
from benchmarks.lib import timing
from tierflow.cache.approx import (
    ApproxCache,
    calibrate_threshold,
    nearest,
    signature,
)
from tierflow.cache.base import CacheAnswer, FeatureCache, cache_key
from tierflow.cache.memory import MemoryCache
from tierflow.cli.table import format_table
from tierflow.units import format_size

RESULTS = lib.RESULTS / "cache.json"
BUDGET = 64 << 20


@dataclass(frozen=True)
class Split:
    """A model cut in two: ``head`` makes the feature, ``tail`` finishes the model."""

    head: ort.InferenceSession
    tail: ort.InferenceSession
    cut_tensors: tuple[str, ...]
    model_sha256: str
    feature_bytes: int

    def features(self, image: np.ndarray) -> dict[str, np.ndarray]:
        names = list(self.cut_tensors)
        values = self.head.run(names, {self.head.get_inputs()[0].name: image})
        return dict(zip(names, values, strict=True))

    def finish(self, features: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        names = [o.name for o in self.tail.get_outputs()]
        return dict(zip(names, self.tail.run(names, features), strict=True))


def load_split() -> tuple[Split, Any]:
    """The demo model (trained once and cached by the partitioner), split in two."""
    from tierflow.partitioner.graph import load_model
    from tierflow.partitioner.split import split_model
    from tierflow.zoo.digits import build_demo_model

    demo = build_demo_model()
    return _split_graph(load_model(demo.model_path), split_model), demo


def make_stream(
    images: np.ndarray, frames: int, rng: np.random.Generator, noise: float, repeat: float
) -> tuple[np.ndarray, np.ndarray]:
    """Clips of ``frames`` noisy frames per image; returns frames [n,1,1,H,W] and clip ids."""
    clip_ids = np.repeat(np.arange(len(images)), frames)
    stream = np.empty((len(clip_ids), *images.shape[1:]), dtype=np.float32)
    for i, clip in enumerate(clip_ids):
        if i % frames and rng.random() < repeat:
            stream[i] = stream[i - 1]  # nothing moved: the very same frame again
            continue
        frame = images[clip] + rng.normal(0, noise, images.shape[1:]).astype(np.float32)
        if rng.random() < 0.2:
            frame = np.roll(frame, int(rng.choice([-1, 1])), axis=-1)
        stream[i] = frame
    return stream, clip_ids


def top1(outputs: dict[str, np.ndarray]) -> int:
    """The top-1 class of the model's (first) output."""
    return int(np.argmax(next(iter(outputs.values()))))


def calibrate(split: Split, images: np.ndarray, args: argparse.Namespace) -> dict[str, Any]:
    """Threshold from a training-image stream: first frames stored, later frames queried."""
    rng = np.random.default_rng(args.seed + 1)
    stream, clips = make_stream(images, args.frames, rng, args.noise, repeat=0.0)
    feats = [split.features(frame) for frame in stream]
    sigs = np.stack([signature(f) for f in feats])
    labels = np.array([top1(split.finish(f)) for f in feats])
    first = np.flatnonzero(np.arange(len(clips)) % args.frames == 0)
    stored = first[: len(first) // 2]  # half the clips are in the cache, half are new
    later = np.flatnonzero(np.arange(len(clips)) % args.frames != 0)
    index, dist = nearest(sigs[stored], sigs[later])
    disagree = labels[stored][index] != labels[later]
    calibration = calibrate_threshold(dist, disagree, args.target)
    return calibration.to_dict()


@dataclass
class RunResult:
    hits: int = 0
    exact_hits: int = 0
    wrong: int = 0
    hit_ms: list[float] | None = None
    miss_ms: list[float] | None = None


def run_stream(
    split: Split,
    cache: FeatureCache | None,
    feats: list[dict[str, np.ndarray]],
    truth: list[int],
    approx_hits: Callable[[], int],
) -> RunResult:
    """Serve the stream as the cloud would; time each request end to end in the cloud."""
    result = RunResult(hit_ms=[], miss_ms=[])
    assert result.hit_ms is not None and result.miss_ms is not None
    for features, label in zip(feats, truth, strict=True):
        before = approx_hits()
        start = time.perf_counter()
        key = cache_key(split.model_sha256, "bench", 1, features)
        answer = cache.lookup(key, features) if cache is not None else None
        if answer is None:
            outputs = split.finish(features)
            if cache is not None:
                cache.store(key, features, CacheAnswer(outputs))
            result.miss_ms.append((time.perf_counter() - start) * 1e3)
            continue
        result.hit_ms.append((time.perf_counter() - start) * 1e3)
        result.hits += 1
        result.exact_hits += approx_hits() == before
        result.wrong += top1(answer.outputs) != label
    return result


@contextmanager
def redis_server() -> Iterator[str | None]:
    """A throw-away local redis-server, or None when the binary is not installed."""
    binary = shutil.which("redis-server")
    if binary is None:
        yield None
        return
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with tempfile.TemporaryDirectory() as directory:
        process = subprocess.Popen(
            [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", directory],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                    break
                except OSError:
                    time.sleep(0.05)
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            process.terminate()
            process.wait(timeout=10)


def median(values: list[float] | None) -> float | None:
    return float(np.median(values)) if values else None


def bench_model(
    label: str,
    split: Split,
    heldout: np.ndarray,
    calib_images: np.ndarray,
    args: argparse.Namespace,
    redis_url: str | None,
) -> dict[str, Any]:
    """Every cache on one model's held-out stream; the report's entry for that model."""
    print(
        f"[{label}] cloud starts at {', '.join(split.cut_tensors)} "
        f"({format_size(split.feature_bytes)} per feature); calibrating...",
        file=sys.stderr,
    )
    calibration = calibrate(split, calib_images, args)
    print(f"[{label}] calibration on training clips: {calibration}", file=sys.stderr)
    rng = np.random.default_rng(args.seed)
    stream, _ = make_stream(heldout, args.frames, rng, args.noise, args.repeat)
    feats = [split.features(frame) for frame in stream]
    truth = [top1(split.finish(f)) for f in feats]
    compute_ms = []
    for features in feats[:400]:
        start = time.perf_counter()
        split.finish(features)
        compute_ms.append((time.perf_counter() - start) * 1e3)
    compute = float(np.median(compute_ms))

    none: Callable[[], int] = lambda: 0  # noqa: E731
    caches: list[tuple[str, FeatureCache | None, Callable[[], int]]] = [("none", None, none)]
    caches.append((f"exact:{format_size(BUDGET)}", MemoryCache(BUDGET), none))
    offline = calibration["threshold"]
    if offline is not None:
        fixed = ApproxCache(BUDGET, threshold=offline)
        caches.append((f"approx:threshold={offline:.3f}", fixed, lambda: fixed.approx_hits))
    online = ApproxCache(BUDGET, target=args.target)
    caches.append((f"approx:target={args.target:g}", online, lambda: online.approx_hits))
    if redis_url is not None:
        from tierflow.cache.redis import RedisCache

        shared = RedisCache(redis_url, BUDGET, namespace=f"bench-{label}")
        shared.clear()
        caches.append((f"redis:{format_size(BUDGET)}", shared, none))
    rows: list[dict[str, Any]] = []
    for name, cache, approx in caches:
        result = run_stream(split, cache, feats, truth, approx)
        hit_ms, miss_ms = median(result.hit_ms), median(result.miss_ms)
        rows.append(
            {
                "cache": name,
                "requests": len(feats),
                "hit_rate": result.hits / len(feats),
                "exact_hits": result.exact_hits,
                "approx_hits": result.hits - result.exact_hits,
                "wrong_answers": result.wrong,
                "disagreement": result.wrong / result.hits if result.hits else 0.0,
                "hit_ms_median": hit_ms,
                "miss_ms_median": miss_ms,
                "compute_over_hit": compute / hit_ms if hit_ms else None,
                "threshold": getattr(cache, "threshold", None),
                "stats": cache.stats().to_dict() if cache is not None else None,
            }
        )
    return {
        "model": label,
        "sha256": split.model_sha256,
        "cut": {"tensors": list(split.cut_tensors), "feature_bytes": split.feature_bytes},
        "stream": {
            "clips": len(heldout),
            "frames_per_clip": args.frames,
            "noise": args.noise,
            "repeat": args.repeat,
            "requests": len(feats),
            "seed": args.seed,
        },
        "compute_ms_median": compute,
        "calibration": calibration,
        "rows": rows,
    }


def print_table(report: dict[str, Any]) -> None:
    compute = report["compute_ms_median"]
    print(
        f"\n{report['model']}: cloud computes from {', '.join(report['cut']['tensors'])} "
        f"({format_size(report['cut']['feature_bytes'])}), median compute {compute:.3f} ms, "
        f"{report['stream']['requests']} frames"
    )
    headers = ("cache", "hit rate", "exact", "approx", "wrong", "hit ms", "miss ms", "compute/hit")
    rows = []
    for row in report["rows"]:
        hit, miss, ratio = row["hit_ms_median"], row["miss_ms_median"], row["compute_over_hit"]
        rows.append(
            (
                row["cache"],
                f"{row['hit_rate']:.1%}",
                row["exact_hits"],
                row["approx_hits"],
                row["wrong_answers"],
                "-" if hit is None else f"{hit:.3f}",
                "-" if miss is None else f"{miss:.3f}",
                "-" if ratio is None else f"{ratio:.1f}x",
            )
        )
    print(format_table(headers, rows))


def resnet_split(size: int, directory: Path) -> Split:
    """ResNet-18 from the model zoo (seeded weights) at ``size``, split near its middle."""
    from tierflow.partitioner.graph import load_model
    from tierflow.partitioner.split import split_model
    from tierflow.zoo.models import export_onnx, resnet18

    module, example = resnet18(size=size)
    path = export_onnx(module, example, directory / "resnet18.onnx")
    graph = load_model(path)
    return _split_graph(graph, split_model)


def _split_graph(graph: Any, split_model: Any) -> Split:
    middle = len(graph.nodes) / 2
    single = [c for c in graph.cuts[1:-1] if len(c.tensors) == 1]
    cut = min(single, key=lambda c: (abs(c.position - middle), c.index))
    (_, head), (_, tail) = split_model(graph, [cut.index, cut.index])
    return Split(timing.session(head), timing.session(tail), cut.tensors, graph.sha256, cut.nbytes)


def as_rgb(images: np.ndarray, size: int) -> np.ndarray:
    """Digits [n,1,1,32,32] scaled (nearest) to [n,1,3,size,size] for an RGB model."""
    scale = size // images.shape[-1]
    big = np.kron(images, np.ones((scale, scale), dtype=np.float32))
    return np.repeat(big, 3, axis=2).astype(np.float32)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--clips", type=int, default=360, help="held-out images played as clips")
    parser.add_argument("--frames", type=int, default=8, help="frames per clip")
    parser.add_argument("--noise", type=float, default=0.1, help="sensor noise (image std units)")
    parser.add_argument("--repeat", type=float, default=0.3, help="chance a frame is unchanged")
    parser.add_argument("--target", type=float, default=0.01, help="approx disagreement target")
    parser.add_argument("--calib-clips", type=int, default=600, help="training images to calibrate")
    parser.add_argument(
        "--resnet-clips", type=int, default=60, help="clips for ResNet-18 (0: skip it)"
    )
    parser.add_argument("--resnet-size", type=int, default=128, help="ResNet-18 input size")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args(argv)

    split, demo = load_split()
    heldout = np.load(demo.heldout_path)["image"]
    calib = np.load(demo.calib_path)["image"]
    reports = []
    with redis_server() as redis_url:
        reports.append(
            bench_model(
                "digits-demo",
                split,
                heldout[: args.clips],
                calib[: args.calib_clips],
                args,
                redis_url,
            )
        )
        if args.resnet_clips > 0:
            with tempfile.TemporaryDirectory() as directory:
                resnet = resnet_split(args.resnet_size, Path(directory))
            size = args.resnet_size
            calib_clips = max(1, args.calib_clips // 4)
            reports.append(
                bench_model(
                    f"resnet18-{size}",
                    resnet,
                    as_rgb(heldout[: args.resnet_clips], size),
                    as_rgb(calib[:calib_clips], size),
                    args,
                    redis_url,
                )
            )
    for report in reports:
        print_table(report)
    output = {
        "benchmark": "cache",
        "budget_bytes": BUDGET,
        "target": args.target,
        "blas_threads": os.environ.get("OPENBLAS_NUM_THREADS"),
        "models": reports,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(output, indent=1) + "\n")
    print(f"\nwrote {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
