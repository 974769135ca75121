"""Early exits on the demo model: accuracy against the compute they save beyond the device.

Not a test. On the built-in demo model (a residual CNN on 32x32 digits) and its 360
held-out images, which neither the model nor the exit calibration ever saw:

1. exits are added with ``tierflow.partitioner.exits.add_exits`` on the demo's
   calibration file (from the training split), once per disagreement target, and also
   swept by one shared threshold for a denser curve;
2. the device runs the stem (the model up to its first one-tensor cut); everything after
   it is "compute beyond the device". The model with exits is cut at every exit's
   feature into pieces, each ending with its exit head, and each piece is timed in ONNX
   Runtime (1 thread, batch 1, median CPU time of the calling thread over many runs,
   so other jobs on the machine do not inflate it);
3. a request's compute beyond the device is the sum of the pieces it actually runs: up
   to the exit it leaves at (heads included), or all of them. The baseline is the same
   stretch of the model without exits, timed the same way.

Compute saved = 1 - mean compute with exits / baseline compute. Prints an aligned table
and writes ``benchmarks/results/exits.json`` and ``benchmarks/results/exits.png``.

    python -m benchmarks.exits [--cache-dir DIR] [--runs 300]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx.utils

from benchmarks import lib
from benchmarks.lib import timing
from tierflow.cli.table import format_table
from tierflow.partitioner.exits.add import add_exits, simulate_exits
from tierflow.partitioner.exits.cost import exit_cut_indices, expected_compute_fraction
from tierflow.partitioner.exits.metadata import ExitedModel, ExitInfo
from tierflow.partitioner.exits.points import exit_candidates
from tierflow.partitioner.graph import load_model
from tierflow.zoo.digits import build_demo_model

logger = logging.getLogger(__name__)

RESULTS = lib.RESULTS
TARGETS = (0.0025, 0.005, 0.01, 0.02, 0.05)
SHARED_THRESHOLDS = (0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.98, 0.99, 0.995, 0.999)


def _time_piece(model: onnx.ModelProto, feed: dict[str, np.ndarray], runs: int) -> float:
    """Median CPU seconds of one batch-1 run of ``model`` in ONNX Runtime (1 thread)."""
    session = timing.session(model)
    for _ in range(10):
        session.run(None, feed)
    times = []
    for _ in range(runs):
        start = time.thread_time()
        session.run(None, feed)
        times.append(time.thread_time() - start)
    return float(np.median(times))


def _extract(path: Path, inputs: Sequence[str], outputs: Sequence[str]) -> onnx.ModelProto:
    extractor = onnx.utils.Extractor(onnx.load(str(path)))
    return extractor.extract_model(list(inputs), list(outputs))


def _piece_costs(
    model_path: Path, boundaries: Sequence[str], heads: Sequence[str], sample: np.ndarray, runs: int
) -> list[float]:
    """Time the pieces ``boundaries[i] -> boundaries[i+1]`` (+ head i where given)."""
    from tierflow.partitioner.exits.heads import run_model

    full = onnx.load(str(model_path))
    values = run_model(full, {"image": sample}, [b for b in boundaries[:-1] if b != "image"])
    values["image"] = sample
    costs = []
    for i in range(len(boundaries) - 1):
        outputs = [boundaries[i + 1]] + ([heads[i]] if i < len(heads) else [])
        piece = _extract(model_path, [boundaries[i]], outputs)
        costs.append(_time_piece(piece, {boundaries[i]: values[boundaries[i]]}, runs))
    return costs


def _point(
    exited: ExitedModel | None,
    exits: Sequence[ExitInfo],
    model_path: Path,
    images: np.ndarray,
    labels: np.ndarray,
    piece_costs: Sequence[float],
    baseline: float,
) -> dict[str, Any]:
    """Accuracy, exit rates and compute beyond the device for one set of thresholds."""
    proto = exited.model if exited is not None else onnx.load(str(model_path))
    taken, predicted, outputs = simulate_exits(proto, {"image": images}, exits)
    full = outputs["logits"].argmax(axis=1)
    cumulative = np.cumsum(piece_costs)
    per_request = np.where(taken >= 0, cumulative[np.maximum(taken, 0)], cumulative[-1])
    rates = [float((taken == k).mean()) for k in range(len(exits))]
    return {
        "accuracy_full": float((full == labels).mean()),
        "accuracy": float((predicted == labels).mean()),
        "disagreement": float((predicted != full).mean()),
        "exit_rates": rates,
        "compute_s": float(per_request.mean()),
        "compute_saved": float(1.0 - per_request.mean() / baseline),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache-dir", type=Path, default=None, help="demo model cache")
    parser.add_argument("--runs", type=int, default=300, help="timed runs per piece")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)

    demo = build_demo_model(args.cache_dir)
    with np.load(demo.heldout_path) as heldout:
        images, labels = heldout["image"][:, 0], heldout["labels"]
    graph = load_model(demo.model_path)
    device_cut = exit_candidates(graph)[0]  # the stem's output: what the device sends
    work = Path(tempfile.mkdtemp(prefix="exits-bench-"))

    # Baseline: the model after the device's cut, no exits.
    sample = images[:1]
    baseline = _piece_costs(demo.model_path, [device_cut, "logits"], [], sample, args.runs)[0]

    points: list[dict[str, Any]] = []
    exited_by_target: dict[float, ExitedModel] = {}
    for target in TARGETS:
        exited = add_exits(graph, demo.calib_path, max_disagreement=target)
        exited_by_target[target] = exited
        path = exited.save(work / f"exits-{target}.onnx")
        at = [e.at for e in exited.exits]
        costs = _piece_costs(
            path, [device_cut, *at, "logits"], [e.name for e in exited.exits], sample, args.runs
        )
        point = _point(exited, exited.exits, path, images, labels, costs, baseline)
        cut_of = exit_cut_indices(graph, exited.exits)
        cuts = [cut_of[e.name] for e in exited.exits]
        predicted = (
            1.0
            - expected_compute_fraction(
                costs, [(k + 1, e.exit_rate) for k, e in enumerate(exited.exits)]
            )
            * sum(costs)
            / baseline
        )
        point.update(
            kind="target",
            target=target,
            thresholds=[e.threshold for e in exited.exits],
            exits=at,
            exit_cuts=cuts,
            piece_costs_s=costs,
            calibration_exit_rate=exited.summary["exit_rate"],
            predicted_compute_saved=predicted,
        )
        points.append(point)

    # A denser curve: one threshold for every exit, on the 1%-target heads.
    reference = exited_by_target[0.01]
    ref_path = work / "exits-0.01.onnx"
    ref_costs = points[TARGETS.index(0.01)]["piece_costs_s"]
    for threshold in SHARED_THRESHOLDS:
        shared = [ExitInfo(e.name, e.at, threshold) for e in reference.exits]
        point = _point(reference, shared, ref_path, images, labels, ref_costs, baseline)
        point.update(kind="shared", threshold=threshold)
        points.append(point)

    full_accuracy = points[0]["accuracy_full"]
    header = ("curve", "setting", "exit rates", "accuracy", "lost", "disagree", "saved")
    rows = []
    for p in points:
        setting = (
            f"target {100 * p['target']:.2f}%" if p["kind"] == "target" else f"t={p['threshold']}"
        )
        rows.append(
            (
                "calibrated" if p["kind"] == "target" else "shared t",
                setting,
                "/".join(f"{100 * r:.0f}" for r in p["exit_rates"]) + "%",
                f"{100 * p['accuracy']:.2f}%",
                f"{100 * (full_accuracy - p['accuracy']):+.2f}",
                f"{100 * p['disagreement']:.2f}%",
                f"{100 * p['compute_saved']:.1f}%",
            )
        )
    print(
        f"demo model: held-out accuracy {100 * full_accuracy:.2f}% on {len(labels)} images; "
        f"device runs up to {device_cut!r}; baseline beyond the device "
        f"{1e6 * baseline:.0f} us/request (ORT, 1 thread, CPU time)"
    )
    print(f"exits at {points[TARGETS.index(0.01)]['exits']}")
    print(format_table(header, rows, align="l" * len(header), rule=False))

    best = [p for p in points if full_accuracy - p["accuracy"] <= 0.01 + 1e-9]
    best_saved = max((p["compute_saved"] for p in best), default=0.0)
    print(
        f"most compute saved beyond the device at <= 1 point of accuracy lost: "
        f"{100 * best_saved:.1f}%"
    )

    args.out.mkdir(parents=True, exist_ok=True)
    record = {
        "model": {"accuracy": full_accuracy, "heldout": len(labels), "meta": demo.meta.to_dict()},
        "device_cut": device_cut,
        "baseline_compute_s": baseline,
        "compute": "ONNX Runtime CPU time of the pieces each request runs (1 thread, batch 1, "
        "median of runs), beyond the device's cut",
        "best_compute_saved_within_1pt": best_saved,
        "points": points,
    }
    (args.out / "exits.json").write_text(json.dumps(record, indent=2) + "\n")
    _plot(points, full_accuracy, args.out / "exits.png")
    print(f"wrote {args.out / 'exits.json'} and {args.out / 'exits.png'}")
    return 0


def _plot(points: Sequence[dict[str, Any]], full_accuracy: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for kind, label, marker in (
        ("target", "calibrated (disagreement target)", "o"),
        ("shared", "one shared threshold", "x"),
    ):
        chosen = sorted((p for p in points if p["kind"] == kind), key=lambda p: p["compute_saved"])
        ax.plot(
            [100 * p["compute_saved"] for p in chosen],
            [100 * p["accuracy"] for p in chosen],
            marker=marker,
            label=label,
        )
        if kind == "target":
            for p in chosen:
                ax.annotate(
                    f"{100 * p['target']:g}%",
                    (100 * p["compute_saved"], 100 * p["accuracy"]),
                    textcoords="offset points",
                    xytext=(4, -10),
                    fontsize=7,
                )
    ax.axhline(100 * full_accuracy, color="grey", linestyle="--", label="full model")
    ax.axhline(100 * full_accuracy - 1, color="grey", linestyle=":", label="1 point lost")
    ax.set_xlabel("compute saved beyond the device (%)")
    ax.set_ylabel("held-out accuracy (%)")
    ax.set_title("Early exits on the demo model (360 held-out digits)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
