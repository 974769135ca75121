"""Learned bottlenecks on the comparison benchmark's trained ImageNet classifiers.

    python -m benchmarks.bottleneck_trained                        # EfficientNet-Lite0
    python -m benchmarks.bottleneck_trained --model mobilenet-v2   # MobileNetV2
    python -m benchmarks.bottleneck_trained --quick    # fewer views, one bottleneck

``bottleneck.py`` measures the learned bottleneck (``tierflow bottleneck add``) on
the page orientation model; this does the same on ``comparison/run.py``'s ImageNet classifiers
(weights shipped in packages) so the issue's question, what the bottleneck reaches on
each trained model, is answered there too. It trains each configuration on
the planner's views of the shipped photos (``lib.models.planner_sample``: never
measured), grafts it, splits the grafted model at its codes, and measures on the very
held-out views ``comparison/run.py``'s rows are measured on (``lib.models.requests``, the first
300): bytes (zstd frame plus a 64-byte header), fidelity (top-1 agreement with the
exact model) with its 95% lower bound, and the device's and cloud's CPU time here
(``benchmarks.bottleneck.bottleneck_points``).

Latency is composed as ``comparison/run.py`` composes its rows (``lib.emulation``: device 10x
slower than this machine, the codes crossing device-edge at each rate and forwarded to
the cloud, one RTT per link, the rest of the model on the cloud at 1x), and the rows
(``tierflow-bottleneck``, one per configuration and rate) are folded into ``comparison/run.py``'s
results (``comparison.fidelity.bottleneck_rows``). Their parts were measured by this script,
the uploads they are compared with by ``comparison/run.py``: both are medians of the calling
thread's CPU time on this machine. The text model is not covered: the bottleneck
grafts convolutions on an image feature map. Writes ``results/bottleneck_trained.json``
(EfficientNet-Lite0) or ``results/bottleneck_trained-NAME.json``, which ``comparison/run.py``
folds in.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import bottleneck as bottleneck_bench
from benchmarks.lib import RESULTS, models, timing
from benchmarks.lib import emulation as emu

logger = logging.getLogger(__name__)

Config = tuple[str | None, int, int]
# Per model, (cut tensor or None for the tool's choice, code channels, bits), full run
# first, then --quick's. EfficientNet-Lite0: the tool's own choice (the first wide map,
# 96x56x56) lost every answer in a trial; these are the block outputs where the planner's
# int8/int4 splits fall (40x28x28 and 80x14x14). MobileNetV2: its block outputs of the
# same sizes (32x28x28 after block 6, 96x14x14 after block 13).
CONFIGS: dict[str, tuple[tuple[Config, ...], tuple[Config, ...]]] = {
    "efficientnet-lite0": (
        (
            ("/_blocks.3/_project_conv/Conv_output_0", 16, 4),
            ("/_blocks.5/_project_conv/Conv_output_0", 16, 4),
            ("/_blocks.5/_project_conv/Conv_output_0", 32, 4),
            ("/_blocks.5/_project_conv/Conv_output_0", 64, 4),
        ),
        (("/_blocks.5/_project_conv/Conv_output_0", 16, 4),),
    ),
    "mobilenet-v2": (
        (
            ("/features/features.6/Add_output_0", 16, 4),
            ("/features/features.13/Add_output_0", 16, 4),
            ("/features/features.13/Add_output_0", 32, 4),
            ("/features/features.13/Add_output_0", 64, 4),
        ),
        (("/features/features.13/Add_output_0", 16, 4),),
    ),
}


def out_json(model: str) -> Path:
    """Where a run on ``model`` is written (and where ``comparison/run.py`` finds it)."""
    if model == models.IMAGENET_MODEL.name:
        return RESULTS / "bottleneck_trained.json"
    return RESULTS / f"bottleneck_trained-{model}.json"


# Views: (calibration, held-out, timed).
VIEWS_FULL = (320, 300, 16)
VIEWS_QUICK = (64, 24, 4)


def rows_for(
    model: str, points: list[dict[str, Any]], requests: int, source: str
) -> list[dict[str, Any]]:
    """``tierflow-bottleneck`` rows at every benchmark rate, composed as the comparison does."""
    from tierflow.partitioner.fidelity import lower_confidence_bound

    device = emu.TIER_SPECS["device"].slowdown
    cloud = emu.TIER_SPECS["cloud"].slowdown
    out = []
    for mbit in emu.FULL_BANDWIDTHS:
        links = emu.links_at(mbit)
        for p in points:
            wire = (
                sum(p["bytes"] * 8.0 / link.rate_bps + link.rtt_s for link in links.values()) * 1e3
            )
            parts = {
                "device": device * p["device_ms_here"],
                "device-edge codec": device * p["zstd_ms_here"] + cloud * p["unzstd_ms_here"],
                "wire": wire,
                "cloud": cloud * p["cloud_ms"],
            }
            agreeing = round(p["fidelity"] * requests)
            out.append(
                {
                    "model": model,
                    "bandwidth_mbit": mbit,
                    "strategy": "tierflow-bottleneck",
                    "variant": f"k={p['channels']} {p['bits']}-bit at {p['at']}",
                    "p50_ms": sum(parts.values()),
                    "parts_ms": parts,
                    "regret": None,
                    "cuts": [],
                    "last_cut": None,
                    "codec_used": {
                        "device-edge": f"bottleneck k={p['channels']} {p['bits']}-bit+zstd"
                    },
                    "bytes": {"device-edge": p["bytes"], "edge-cloud": p["bytes"]},
                    "fidelity": p["fidelity"],
                    "fidelity_lower_95": lower_confidence_bound(agreeing, requests),
                    "fidelity_requests": requests,
                    "bit_exact": False,
                    "device_ms_here": p["device_ms_here"] + p["zstd_ms_here"],
                    "trained_weights": True,
                    "timing_only": False,
                    "input_source": source,
                    "measured": "composed by bottleneck_trained.py",
                    "requests": requests,
                }
            )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer views, one bottleneck")
    parser.add_argument(
        "--model",
        choices=[m.name for m in models.IMAGENET_MODELS],
        default=models.IMAGENET_MODEL.name,
        help="which of the comparison's ImageNet classifiers",
    )
    parser.add_argument("--out", type=Path, default=None, help="default: results/ by model")
    parser.add_argument("--steps", type=int, default=None, help="training steps (400 full)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    for name in ("tierflow.partitioner.graph", "tierflow.zoo.bottleneck_train"):
        logging.getLogger(name).setLevel(logging.WARNING)
    started = time.perf_counter()
    model = next(m for m in models.IMAGENET_MODELS if m.name == args.model)
    out = args.out or out_json(model.name)
    path = models.export(model, models.default_work_dir())
    calib_count, held_count, timed = VIEWS_QUICK if args.quick else VIEWS_FULL
    configs = CONFIGS[model.name][1 if args.quick else 0]
    # 150 steps kept 40-63% of the answers; 400 are still a few minutes per bottleneck.
    steps = args.steps or (30 if args.quick else 400)
    specs = [("input", "float32", (1, 3, 224, 224))]
    calib = np.concatenate(
        [r["input"] for r in models.planner_sample(model, specs, calib_count, seed=11)]
    )
    held = np.concatenate([r["input"] for r in models.requests(model, specs, held_count)])
    session = timing.session(path.read_bytes())
    exact = np.concatenate([session.run(None, {"input": row[None]})[0] for row in held])
    with tempfile.TemporaryDirectory() as scratch:
        points = bottleneck_bench.bottleneck_points(
            path, calib, held, exact, configs, steps, 3, Path(scratch), timed, input_name="input"
        )
    record = {
        "command": " ".join(["python -m benchmarks.bottleneck_trained", *sys.argv[1:]])
        if argv is None
        else " ".join(["python -m benchmarks.bottleneck_trained", *argv]),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "model": model.name,
        "model_file": path.name,
        "inputs": model.input_source,
        "calibration_views": calib_count,
        "heldout_views": held_count,
        "steps": steps,
        "points": points,
        "rows": rows_for(model.name, points, held_count, model.input_source),
        "seconds": time.perf_counter() - started,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1))
    for p in points:
        print(
            f"{model.name} bottleneck k={p['channels']} {p['bits']}-bit at {p['at']}: "
            f"{p['bytes']:.0f} B, fidelity {p['fidelity']:.3f}, device "
            f"{p['device_ms_here']:.1f} ms here, trained in {p['train_s']:.0f} s"
        )
    print(f"wrote {out} in {record['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
