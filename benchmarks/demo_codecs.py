"""Codecs on the demo model's real features: bytes on the wire against accuracy.

Not a test. For every interior cut of the demo model (a residual CNN on scikit-learn's
digits) it captures the features crossing the cut for the whole held-out set, encodes
them with each codec, decodes them, runs the rest of the model on what arrived, and
reports:

* ``ratio``: fp32 bytes over encoded bytes (per request, median over the cuts and, for
  the worst case, the lowest);
* ``top-1 agreement`` with the unsplit model and held-out ``accuracy`` (worst cut).

The issue's target: int8+zstd at least 4x fewer bytes than fp32, with its accuracy cost
stated; then the codecs that spend computation to save bandwidth (issue 9: ``int4``,
``int2``, ``sparse+`` and ``drop+`` stages, each with zstd behind), with their encode +
decode time per request. Prints one aligned table and writes
``benchmarks/results/demo_codec.json``.
Usage: ``python -m benchmarks.demo_codecs [--requests N]``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from benchmarks import lib
from benchmarks.lib import timing
from tierflow.cli.table import format_table
from tierflow.codec.base import LOW_BIT_CODECS, decode, encode
from tierflow.partitioner.graph import load_model
from tierflow.partitioner.split import extract_segment
from tierflow.zoo.digits import build_demo_model

CODECS: tuple[str, ...] = (
    "raw",
    "zstd",
    "shuffle+zstd",
    "fp16",
    "fp16+zstd",
    "int8",
    "int8+zstd",
    "int8c+zstd",
    "int4",
    "int2",
    *LOW_BIT_CODECS,
)
RESULTS = lib.RESULTS / "demo_codec.json"


def _run(session: ort.InferenceSession, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    names = [i.name for i in session.get_inputs()]
    return list(session.run(None, {name: feeds[name] for name in names}))


def measure(requests: int) -> dict[str, Any]:
    demo = build_demo_model()
    with np.load(demo.heldout_path) as heldout:
        images = heldout["image"][: requests or None]
        labels = heldout["labels"][: requests or None]
    graph = load_model(demo.model_path)
    input_name = graph.inputs[0].name
    last = len(graph.cuts) - 1
    full = timing.session(extract_segment(graph, 0, last))
    expected = np.array([int(np.argmax(_run(full, {input_name: x})[0])) for x in images])
    rows: list[dict[str, Any]] = []
    for cut in graph.cuts[1:-1]:
        head = timing.session(extract_segment(graph, 0, cut.index))
        rest = timing.session(extract_segment(graph, cut.index, last))
        head_names = [o.name for o in head.get_outputs()]
        features = [dict(zip(head_names, _run(head, {input_name: x}), strict=True)) for x in images]
        raw_bytes = sum(a.nbytes for a in features[0].values())
        for codec in CODECS:
            sent = 0
            top1 = []
            codec_s = 0.0
            for feats in features:
                arrived = {}
                started = time.perf_counter()
                for name, array in feats.items():
                    encoded = encode(name, array, codec)
                    sent += encoded.nbytes
                    arrived[name] = decode(encoded)
                codec_s += time.perf_counter() - started
                top1.append(int(np.argmax(_run(rest, arrived)[0])))
            got = np.array(top1)
            rows.append(
                {
                    "cut": cut.index,
                    "tensors": list(cut.tensors),
                    "codec": codec,
                    "fp32_bytes": raw_bytes,
                    "bytes_per_request": sent / len(features),
                    "ratio": raw_bytes * len(features) / sent,
                    "top1_agreement": float(np.mean(got == expected)),
                    "accuracy": float(np.mean(got == labels)),
                    "codec_ms_per_request": 1e3 * codec_s / len(features),
                }
            )
    return {
        "model": "demo-digits",
        "requests": len(images),
        "unsplit_accuracy": float(np.mean(expected == labels)),
        "cuts": len(graph.cuts) - 2,
        "rows": rows,
    }


def summary(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Per codec, over the cuts: median and lowest ratio, worst agreement and accuracy."""
    out = []
    for codec in CODECS:
        rows = [r for r in result["rows"] if r["codec"] == codec]
        ratios = [r["ratio"] for r in rows]
        out.append(
            {
                "codec": codec,
                "ratio_median": float(np.median(ratios)),
                "bytes_median": float(np.median([r["bytes_per_request"] for r in rows])),
                "codec_ms_median": float(np.median([r["codec_ms_per_request"] for r in rows])),
                "ratio_min": float(np.min(ratios)),
                "worst_top1_agreement": min(r["top1_agreement"] for r in rows),
                "worst_accuracy": min(r["accuracy"] for r in rows),
                "accuracy_cost_points": 100
                * (result["unsplit_accuracy"] - min(r["accuracy"] for r in rows)),
            }
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--requests", type=int, default=0, help="held-out requests (0: all)")
    parser.add_argument("--output", type=Path, default=RESULTS, help="JSON results file")
    args = parser.parse_args(argv)
    result = measure(args.requests)
    result["summary"] = summary(result)
    headers = [
        "codec",
        "ratio (median)",
        "ratio (lowest)",
        "bytes/request (median)",
        "enc+dec ms (median)",
        "top-1 agreement (worst cut)",
        "accuracy (worst cut)",
        "accuracy cost (points)",
    ]
    table = [
        [
            s["codec"],
            f"{s['ratio_median']:.2f}x",
            f"{s['ratio_min']:.2f}x",
            f"{s['bytes_median']:.0f}",
            f"{s['codec_ms_median']:.3f}",
            f"{s['worst_top1_agreement']:.2%}",
            f"{s['worst_accuracy']:.2%}",
            f"{s['accuracy_cost_points']:.2f}",
        ]
        for s in result["summary"]
    ]
    print(
        f"demo model, {result['requests']} held-out requests, {result['cuts']} interior cuts; "
        f"unsplit accuracy {result['unsplit_accuracy']:.2%}; ratio = fp32 bytes / bytes sent"
    )
    print(format_table(headers, table))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
