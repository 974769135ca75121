"""Rate against fidelity on trained models: bytes per request for every codec at every cut.

    python -m benchmarks.rate_fidelity              # the committed run (~13 min, 2 shared cores)
    python -m benchmarks.rate_fidelity --quick      # fewer requests (~7 min)
    python -m benchmarks.rate_fidelity --report-only  # redraw from the JSON, no measuring

Random-weight networks say nothing about fidelity, so this measures the two trained
models tierflow has (real weights only):

- ``orientation``: the page orientation classifier (PP-LCNet, ``tierflow.zoo.real``) on
  held-out document pages turned by 0-270 degrees (``tierflow.zoo.samples``), 224x224;
- ``digits-camera``: the demo's trained digits classifier behind its camera stem
  (``tierflow.zoo.digits_camera``), on 224x224 RGB frames of the held-out digits;
- ``layout``: the document layout detector (PicoDet, ``tierflow.zoo.real``, 800x608) on
  rendered document pages; a detector's answer is its boxes, so its fidelity is box
  agreement (``tierflow.zoo.agreement.box_agreement``: boxes matched one to one at IoU
  >= 0.5 with the same class, per page), not top-1. Its cuts are the input and the first
  shrinking cuts only (``LAYOUT_CUTS``): each runs the whole detector head per page.

For each candidate cut and each codec the planner knows (``EXACT_PLANNER_CODECS``,
``LOSSY_PLANNER_CODECS`` and the ``drop+`` codecs of ``LOW_BIT_CODECS``) it records the
bytes the device sends per request (the encoded tensors of the cut: payload and codec
parameters, as ``EncodedTensor.nbytes`` counts them) and the **fidelity**: the share of
held-out requests whose top-1 class equals the exact model's, measured by the planner's
own :class:`~tierflow.partitioner.fidelity_probe.FidelityProbe` (the device's segment,
the codec applied for real, the rest of the model). At the input it adds JPEG's quality
sweep, WebP and PNG (the image travels as an image, as ``--image-input`` plans send it),
and for ``orientation`` the learned bottlenecks of ``bottleneck.py``'s committed
run (``results/bottleneck.json``). Two Pareto fronts are marked: bytes against fidelity
(which sending the logits always wins), and the same counting the device's compute.

Cuts are subsampled on the larger model: the input, the first cut (the least device
compute), then every cut whose raw tensors are smaller than those of every earlier cut (a
later cut that sends more raw bytes also costs the device more compute); the JSON lists
which. Exact codecs decode to the very same tensors as ``raw`` (checked on every
request), so they share its fidelity measurement.

Bytes are what crosses the device-edge link; whether fewer bytes make a faster plan also
depends on the device's compute before the cut (``prefix_ms_here``, the median ONNX
Runtime time of the device's segment on one core of this machine; the device is emulated
10x slower, see ``bottleneck.py`` for composed latencies). Writes
``results/rate_fidelity.json``, one plot per model, ``RATE_FIDELITY.md``, and the
delimited rate-fidelity section of ``RESULTS.md``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.lib import RESULTS, timing
from benchmarks.lib.report import replace_section
from benchmarks.lib.splits import shrinking_cuts

logger = logging.getLogger(__name__)

RESULTS_JSON = RESULTS / "rate_fidelity.json"
REPORT_MD = RESULTS / "RATE_FIDELITY.md"
SECTION_START = "<!-- rate-fidelity:start (written by python -m benchmarks.rate_fidelity) -->"
SECTION_END = "<!-- rate-fidelity:end -->"
MODELS = ("orientation", "digits-camera", "layout")
IMAGE_CODECS = (
    "jpeg:5",
    "jpeg:10",
    "jpeg:20",
    "jpeg:30",
    "jpeg:50",
    "jpeg:70",
    "jpeg:90",
    "jpeg:95",
    "webp:50",
    "webp:75",
    "webp:90",
    "png",
)
IMAGENET = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))


def feature_codecs() -> tuple[str, ...]:
    """The planner's exact and lossy codecs, then the low-bit ones it does not try itself."""
    from tierflow.codec.spec import EXACT_PLANNER_CODECS, LOSSY_PLANNER_CODECS, LOW_BIT_CODECS

    known = EXACT_PLANNER_CODECS + LOSSY_PLANNER_CODECS
    return known + tuple(c for c in LOW_BIT_CODECS if c not in known)


@dataclass
class Subject:
    """One trained model with its held-out requests, as the probe takes them.

    ``agree`` (a detector's) scores each request from the exact and the changed outputs
    in [0, 1]; without it fidelity is top-1 agreement, the probe's own.
    """

    name: str
    path: Path
    graph: Any
    requests: list[dict[str, np.ndarray]]
    images: dict[str, Any]
    inputs: str
    agree: Callable[[Sequence[np.ndarray], Sequence[np.ndarray]], float] | None = None


#: How many of the layout detector's shrinking cuts are measured (beside the input), and
#: with which feature codecs: each point decodes every page's boxes (seconds a page here).
LAYOUT_CUTS = 2
LAYOUT_CODECS = ("raw", "fp16+zstd", "int8+zstd", "int4+zstd", "int2+zstd")


def layout(count: int) -> Subject:
    """The layout detector on ``count`` rendered document pages, judged by its boxes."""
    from tierflow.codec.base import ImageNorm
    from tierflow.partitioner.fidelity_probe import sample_requests
    from tierflow.partitioner.graph import load_model
    from tierflow.zoo import agreement, real, samples

    path = real.model_path("layout")
    graph = load_model(path)
    pages = samples.document_pages(count, seed=303)
    requests = sample_requests(graph.inputs, real.requests("layout", pages))

    decoded: dict[int, Any] = {}  # the exact boxes of a page, decoded once

    def boxes_agree(exact: Sequence[np.ndarray], changed: Sequence[np.ndarray]) -> float:
        key = id(exact[0])  # the probe keeps each page's exact outputs: one object each
        if key not in decoded:
            decoded[key] = (exact[0], agreement.layout_boxes(list(exact))[0])
        want = decoded[key][1]
        (got,) = agreement.layout_boxes(list(changed))
        return float(agreement.box_agreement([want], [got])[0])

    return Subject(
        "layout",
        path,
        graph,
        requests,
        {graph.inputs[0].name: ImageNorm(mean=IMAGENET[0], std=IMAGENET[1])},
        f"{count} rendered document pages (Pillow, bundled font, sample-photo figures, ruled "
        "tables), 800x608; fidelity = box agreement (IoU >= 0.5, same class)",
        boxes_agree,
    )


def orientation(count: int) -> Subject:
    """The page orientation classifier on ``count`` held-out turned pages."""
    from tierflow.codec.base import ImageNorm
    from tierflow.partitioner.fidelity_probe import sample_requests
    from tierflow.partitioner.graph import load_model
    from tierflow.zoo import real, samples

    path = real.model_path("orientation")
    graph = load_model(path)
    pages, _ = samples.rotated_pages(count, seed=202)  # bottleneck_bench's held-out seed
    requests = sample_requests(graph.inputs, real.requests("orientation", pages))
    name = graph.inputs[0].name
    return Subject(
        "orientation",
        path,
        graph,
        requests,
        {name: ImageNorm(mean=IMAGENET[0], std=IMAGENET[1])},
        f"{count} held-out document pages (Pillow, bundled font, sample-photo figures), "
        "224x224 crops turned 0-270 degrees",
    )


def camera_model_path() -> Path:
    """The demo's trained digits model with the camera stem, cached next to it (as the demo)."""
    from tierflow.zoo import digits
    from tierflow.zoo.digits_camera import camera_model

    return camera_model(digits.build_demo_model())


def digits_camera(count: int) -> Subject:
    """The demo's digits classifier on ``count`` 224x224 frames of the held-out digits."""
    from tierflow.codec.base import ImageNorm
    from tierflow.partitioner.fidelity_probe import sample_requests
    from tierflow.partitioner.graph import load_model
    from tierflow.zoo.digits_camera import FRAME_INPUT, digit_frames, frame_tensor

    path = camera_model_path()
    graph = load_model(path)
    frames, _ = digit_frames("heldout", count)
    requests = sample_requests(graph.inputs, {FRAME_INPUT: frame_tensor(frames)[:, None]})
    return Subject(
        "digits-camera",
        path,
        graph,
        requests,
        {FRAME_INPUT: ImageNorm(mean=(0.0,) * 3, std=(1.0,) * 3)},
        f"{count} held-out scikit-learn digits as 224x224 RGB camera frames (pixel / 255)",
    )


def sent_bytes(
    tensors: Mapping[str, np.ndarray], codec: str, images: Mapping[str, Any]
) -> tuple[int, dict[str, np.ndarray]]:
    """Bytes on the wire for ``tensors`` sent with ``codec``, and what the receiver decodes.

    As the runtime sends them (:func:`tierflow.partitioner.image_inputs.crossed_with`):
    with an image codec the image inputs travel as images and anything else losslessly.
    """
    from tierflow.codec.base import CodecSpec, decode, encode

    spec = CodecSpec.parse(codec)
    plain = spec.lossless_part() if spec.image else spec
    total, decoded = 0, {}
    for name, array in tensors.items():
        norm = images.get(name) if spec.image else None
        encoded = encode(name, array, spec, image=norm) if norm else encode(name, array, plain)
        total += encoded.nbytes
        decoded[name] = decode(encoded, max_bytes=max(1 << 30, 4 * array.nbytes))
    return total, decoded


def prefix_ms(subject: Subject, cut: int, requests: int = 5, repeats: int = 3) -> float:
    """Median CPU time here of the device's segment ``[0, cut)`` (the runtime's session)."""
    from tierflow.partitioner.split import extract_segment

    if cut == 0:
        return 0.0
    session = timing.session(extract_segment(subject.graph, 0, cut))
    names = [i.name for i in session.get_inputs()]
    times = []
    for request in subject.requests[:requests]:
        _, ms = timing.cpu_ms(repeats, session.run, None, {n: request[n] for n in names})
        times.append(ms)
    return statistics.median(times)


def measure(subject: Subject, cuts: Sequence[int]) -> list[dict[str, Any]]:
    """Every codec at every cut (and the image codecs at the input): bytes and fidelity."""
    from tierflow.codec.base import CodecSpec
    from tierflow.partitioner.fidelity import FidelityBudget
    from tierflow.partitioner.fidelity_probe import FidelityProbe

    probe = FidelityProbe(subject.graph, subject.requests, images=subject.images)
    last = probe.last
    budget = FidelityBudget("top1", 1.0)
    points: list[dict[str, Any]] = []
    for a in cuts:
        cut = subject.graph.cuts[a]
        device_ms = prefix_ms(subject, a)
        known = LAYOUT_CODECS if subject.name == "layout" else feature_codecs()
        codecs = known + (IMAGE_CODECS if a == 0 else ())
        raw_score = None
        started = time.perf_counter()
        for codec in codecs:
            exact = CodecSpec.parse(codec).bit_exact
            sizes = []
            for index in range(len(probe.requests)):
                features = probe.crossing(a, index)
                size, decoded = sent_bytes(features, codec, subject.images)
                sizes.append(size)
                if exact and not all(
                    np.array_equal(decoded[n], features[n], equal_nan=True) for n in features
                ):
                    raise AssertionError(f"exact codec {codec} changed the tensors at cut {a}")
            if exact and raw_score is not None:
                fidelity, bit_exact = raw_score
            elif subject.agree is not None:
                fidelity, bit_exact = judged(subject, probe, a, codec)
                if exact:
                    raw_score = (fidelity, bit_exact)
            else:
                measured = probe.measure((a, last), {"device-edge": codec}, budget).score
                fidelity, bit_exact = measured.value, measured.bitwise_equal
                if exact:
                    raw_score = (fidelity, bit_exact)
            points.append(
                {
                    "cut": a,
                    "position": cut.position,
                    "tensors": list(cut.tensors),
                    "raw_bytes": cut.nbytes,
                    "codec": codec,
                    "kind": (
                        "image" if CodecSpec.parse(codec).image else "input" if a == 0 else "split"
                    ),
                    "bytes": float(np.mean(sizes)),
                    "fidelity": fidelity,
                    "bit_exact": bool(bit_exact),
                    "prefix_ms_here": device_ms,
                }
            )
        logger.info(
            "[rate] %s cut %d (%s): %d codecs in %.0f s",
            subject.name,
            a,
            cut.tensors[0],
            len(codecs),
            time.perf_counter() - started,
        )
    return points


def judged(subject: Subject, probe: Any, a: int, codec: str) -> tuple[float, bool]:
    """Mean of ``subject.agree`` over the requests for the split at ``a`` with ``codec``,
    and whether every output matched bit for bit."""
    from tierflow.partitioner.fidelity import request_bitwise

    assert subject.agree is not None
    scores, exact = [], True
    for index in range(len(probe.requests)):
        reference = probe.reference(index)
        got = probe.run_split((a, probe.last), {"device-edge": codec}, index)
        names = probe.outputs
        scores.append(subject.agree([reference[n] for n in names], [got[n] for n in names]))
        exact = exact and request_bitwise(reference, got)
    return float(np.mean(scores)), exact


def bottleneck_points(path: Path) -> list[dict[str, Any]]:
    """The learned bottlenecks of ``bottleneck.py``'s committed run, as points."""
    if not path.exists():
        return []
    data = json.loads(path.read_text())
    return [
        {
            "cut": None,
            "position": b["cut_position"],
            "tensors": [b["at"]],
            "raw_bytes": None,
            "codec": f"bottleneck k={b['channels']} {b['bits']}-bit + zstd",
            "kind": "bottleneck",
            "bytes": b["bytes"],
            "fidelity": b["fidelity"],
            "bit_exact": False,
            "prefix_ms_here": b["device_ms_here"],
            "source": "bottleneck.json",
            "requests": data.get("heldout_pages"),
        }
        for b in data.get("bottlenecks", [])
    ]


def split_verdict(path: Path) -> dict[str, Any] | None:
    """From ``bottleneck.py``'s run: the best split against JPEG per rate, and why."""
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    if "physics" not in data:
        return None
    return {
        "source": "bottleneck.json",
        "sentence": data["physics"]["sentence"],
        "rates": [
            {
                key: v.get(key)
                for key in (
                    "bandwidth_mbit",
                    "bottleneck",
                    "bottleneck_fidelity",
                    "jpeg_same_fidelity",
                    "speedup_vs_jpeg_same_fidelity",
                    "speedup_vs_jpeg90",
                    "jpeg90_fidelity",
                    "faithful_split",
                    "faithful_split_fidelity",
                    "faithful_jpeg_same_fidelity",
                    "faithful_speedup_vs_jpeg_same_fidelity",
                    "faithful_speedup_vs_jpeg90",
                    "tierflow_plan",
                    "tierflow_fidelity",
                    "tierflow_speedup_vs_fastest_upload",
                    "tierflow_speedup_vs_jpeg90",
                )
            }
            for v in data.get("verdict", [])
        ],
    }


def verdict_lines(record: dict[str, Any]) -> list[str]:
    """The split-against-JPEG verdict of ``bottleneck.py`` for this model, if any."""
    verdict = record.get("split_verdict")
    if not verdict or not verdict["rates"]:
        return []
    rates = verdict["rates"]
    best = max(rates, key=lambda v: v["speedup_vs_jpeg_same_fidelity"])
    top = max(rates, key=lambda v: v["speedup_vs_jpeg90"])
    lines = [
        f"- **{record['model']}, split plans against the JPEG upload** (latency composed by "
        f"`python -m benchmarks.bottleneck`, {verdict['source']}): the best split at any rate from "
        f"{rates[0]['bandwidth_mbit']:g} to {rates[-1]['bandwidth_mbit']:g} Mbit/s is "
        f"{best['speedup_vs_jpeg_same_fidelity']:.2f}x the fastest JPEG as faithful "
        f"({best['bottleneck']} against {best['jpeg_same_fidelity']} at "
        f"{best['bandwidth_mbit']:g} Mbit/s); against JPEG q90 at most "
        f"{top['speedup_vs_jpeg90']:.2f}x ({top['bottleneck']} at "
        f"{top['bandwidth_mbit']:g} Mbit/s, fidelity {top['bottleneck_fidelity']:.3f} against "
        f"q90's {top['jpeg90_fidelity']:.3f}). {verdict['sentence']}",
    ]
    faithful = [v for v in rates if v.get("faithful_split")]
    if faithful:
        lines.append(
            "- The fastest split that keeps at least 99% agreement, against the fastest JPEG "
            "as faithful and against JPEG q90: "
            + ", ".join(
                f"{v['faithful_split']} at {v['bandwidth_mbit']:g} Mbit/s "
                f"({v['faithful_split_fidelity']:.3f}: "
                f"{v['faithful_speedup_vs_jpeg_same_fidelity']:.2f}x "
                f"{v['faithful_jpeg_same_fidelity']}, {v['faithful_speedup_vs_jpeg90']:.2f}x q90)"
                for v in faithful
            )
            + "."
        )
    planned = [v for v in rates if v.get("tierflow_plan")]
    if planned:
        lines.append(
            "- The planner's own choice under a fidelity budget with the image input "
            "declared (`tierflow-budget`) is "
            + ", ".join(
                f"{v['tierflow_plan']} at {v['bandwidth_mbit']:g} Mbit/s "
                f"({v['tierflow_speedup_vs_fastest_upload']:.2f}x the fastest upload as "
                f"faithful, {v['tierflow_speedup_vs_jpeg90']:.2f}x JPEG q90)"
                for v in planned
            )
            + ". Both are composed alike (an edge with no work forwards the bytes as a "
            "router does, and a plan that is an upload takes that upload's own figures): "
            "where the plan trails the fastest upload, the planner chose another codec on "
            "its calibration pages: a lower quality that keeps every held-out answer may "
            "miss the budget there (the planner is never shown the held-out pages)."
        )
    return lines


def mark_pareto(points: list[dict[str, Any]]) -> None:
    """Mark the fronts: ``pareto`` (bytes against fidelity) and ``pareto_compute``.

    ``pareto``: no other point sends fewer bytes at equal or better fidelity. Sending the
    logits is always on it, which is why ``pareto_compute`` also counts the device's
    compute before the cut: no other point is at least as good on bytes, device time and
    fidelity and better on one.
    """
    order = sorted(range(len(points)), key=lambda i: (points[i]["bytes"], -points[i]["fidelity"]))
    best = -1.0
    for i in order:
        points[i]["pareto"] = points[i]["fidelity"] > best
        best = max(best, points[i]["fidelity"])

    def key(p: dict[str, Any]) -> tuple[float, float, float]:
        return (p["bytes"], p["prefix_ms_here"], -p["fidelity"])

    for p in points:
        p["pareto_compute"] = not any(
            all(x <= y for x, y in zip(key(q), key(p), strict=True)) and key(q) != key(p)
            for q in points
        )


def label(point: dict[str, Any]) -> str:
    """What was sent, in words: 'jpeg:10 (input)', 'int4+zstd at cut 12', ..."""
    if point["kind"] == "bottleneck":
        return f"{point['codec']} at {point['tensors'][0]}"
    if point["cut"] == 0:
        return f"{point['codec']} (input)"
    return f"{point['codec']} at cut {point['cut']}"


def plot(record: dict[str, Any], folder: Path) -> str | None:
    """Log bytes against fidelity, one colour per cut, the Pareto front as a step line."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ModuleNotFoundError:
        return None
    points = record["points"]
    fig, ax = plt.subplots(figsize=(8, 5))
    jpeg = sorted((p for p in points if p["codec"].startswith("jpeg")), key=lambda p: p["bytes"])
    ax.plot(
        [p["bytes"] for p in jpeg],
        [p["fidelity"] for p in jpeg],
        "o-",
        color="black",
        label="input as JPEG (quality sweep)",
    )
    for p in jpeg:
        ax.annotate(p["codec"].split(":")[1], (p["bytes"], p["fidelity"]), fontsize=6)
    others = [p for p in points if p["kind"] == "image" and not p["codec"].startswith("jpeg")]
    ax.plot(
        [p["bytes"] for p in others],
        [p["fidelity"] for p in others],
        "D",
        color="grey",
        label="input as WebP / PNG",
    )
    cuts = sorted({p["cut"] for p in points if p["kind"] in ("input", "split")})
    colours = plt.get_cmap("viridis")(np.linspace(0, 0.9, len(cuts)))
    for colour, cut in zip(colours, cuts, strict=True):
        mine = [p for p in points if p["cut"] == cut and p["kind"] in ("input", "split")]
        ax.plot(
            [p["bytes"] for p in mine],
            [p["fidelity"] for p in mine],
            ".",
            color=colour,
            label="input tensor codecs" if cut == 0 else f"cut {cut} (pos {mine[0]['position']})",
        )
    learned = [p for p in points if p["kind"] == "bottleneck"]
    if learned:
        ax.plot(
            [p["bytes"] for p in learned],
            [p["fidelity"] for p in learned],
            "^",
            color="tab:red",
            markersize=8,
            label="learned bottleneck",
        )
    front = sorted((p for p in points if p["pareto"]), key=lambda p: p["bytes"])
    ax.step(
        [p["bytes"] for p in front],
        [p["fidelity"] for p in front],
        where="post",
        color="tab:orange",
        linewidth=1.2,
        label="Pareto front",
    )
    aware = [p for p in points if p["pareto_compute"]]
    ax.plot(
        [p["bytes"] for p in aware],
        [p["fidelity"] for p in aware],
        "o",
        markerfacecolor="none",
        markeredgecolor="tab:red",
        markersize=9,
        label="front counting device compute",
    )
    for p in aware:
        ax.annotate(
            label(p),
            (p["bytes"], p["fidelity"]),
            fontsize=6,
            xytext=(4, -9),
            textcoords="offset points",
        )
    ax.set_xscale("log")
    ax.set_xlabel("bytes per request over the device-edge link (log)")
    judged = "box" if record["model"] == "layout" else "top-1"
    ax.set_ylabel(f"fidelity ({judged} agreement with the exact model)")
    ax.set_title(f"{record['model']}: rate against fidelity ({record['requests']} held-out)")
    ax.legend(fontsize=6, loc="lower right", ncol=2)
    fig.tight_layout()
    path = folder / f"rate_fidelity_{record['model']}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return os.path.relpath(path, RESULTS)


def _front_rows(record: dict[str, Any], flag: str = "pareto") -> list[str]:
    rows = ["| sent | bytes | fidelity | device segment here (ms) |", "|---|---|---|---|"]
    for p in sorted((p for p in record["points"] if p[flag]), key=lambda p: p["bytes"]):
        rows.append(
            f"| {label(p)} | {p['bytes']:.0f} | {p['fidelity']:.3f} | {p['prefix_ms_here']:.1f} |"
        )
    return rows


def _smallest_at(record: dict[str, Any], floor: float) -> dict[str, dict[str, Any]]:
    """Per family (image upload, split at a cut, bottleneck): fewest bytes at >= ``floor``."""
    out: dict[str, dict[str, Any]] = {}
    for p in record["points"]:
        if p["fidelity"] < floor:
            continue
        family = "image" if p["kind"] == "image" else p["kind"]
        if family not in out or p["bytes"] < out[family]["bytes"]:
            out[family] = p
    return out


def _bytes(point: dict[str, Any]) -> float:
    return float(point["bytes"])


def summary_lines(data: dict[str, Any]) -> list[str]:
    """One sentence per model from the numbers: the front's ends and who is cheapest."""
    lines = []
    for record in data["models"]:
        cheapest = _smallest_at(record, 1.0)
        parts = [
            f"{family}: {label(p)}, {p['bytes']:.0f} B"
            for family, p in sorted(cheapest.items(), key=lambda kv: kv[1]["bytes"])
        ]
        front = sorted((p for p in record["points"] if p["pareto_compute"]), key=_bytes)
        lines.append(
            f"- **{record['model']}** ({record['requests']} held-out requests): fewest bytes "
            "at full agreement (1.000) per family: "
            + "; ".join(parts)
            + ". Front counting the device's compute too: "
            + "; ".join(
                f"{label(p)} {p['bytes']:.0f} B at {p['fidelity']:.3f} "
                f"({p['prefix_ms_here']:.1f} ms device segment here)"
                for p in front
            )
            + "."
        )
        lines += verdict_lines(record)
    return lines


def results_section(data: dict[str, Any]) -> list[str]:
    """The delimited section of RESULTS.md: a summary, the plots, a link to the full report."""
    lines = [
        SECTION_START,
        "## Rate against fidelity (trained models)\n",
        "From `python -m benchmarks.rate_fidelity"
        f"{' --quick' if any(r['quick'] for r in data['models']) else ''}` "
        f"(last run {data['date']}); every point, the cuts measured and how: "
        "[RATE_FIDELITY.md](RATE_FIDELITY.md), raw figures in `rate_fidelity.json`.\n",
        *summary_lines(data),
        "",
    ]
    for record in data["models"]:
        if record.get("plot"):
            lines.append(f"![{record['model']}: rate against fidelity]({record['plot']})\n")
    lines.append(SECTION_END)
    return lines


def markdown(data: dict[str, Any]) -> str:
    """RATE_FIDELITY.md: method, per model the Pareto front and every point."""
    lines = [
        "# Rate against fidelity on trained models\n",
        "Generated by `python -m benchmarks.rate_fidelity"
        f"{' --quick' if any(r['quick'] for r in data['models']) else ''}` "
        f"(last run {data['date']}; each model's own date below). Raw figures: "
        "`rate_fidelity.json`. Method: the docstring of `benchmarks/rate_fidelity.py`; "
        "fidelity is the share of held-out requests whose top-1 class equals the exact "
        "model's, measured end to end by the planner's `FidelityProbe`; bytes are the "
        "encoded tensors the device sends per request (mean): payload and codec "
        "parameters, as `EncodedTensor.nbytes` counts them.\n",
        *summary_lines(data),
        "",
    ]
    for record in data["models"]:
        lines += [
            f"## {record['model']}\n",
            f"`{record['model_file']}` on {record['inputs']}; measured {record['date']} "
            f"in {record['seconds']:.0f} s{' (--quick)' if record['quick'] else ''}. "
            "Cuts measured: "
            f"{', '.join(str(c) for c in record['cuts'])} of {record['cut_count']} "
            f"({record['cut_note']}).\n",
        ]
        if record.get("plot"):
            lines.append(f"![{record['model']}]({record['plot']})\n")
        lines += [
            "Pareto front, bytes against fidelity (sending the last features always wins "
            "on bytes alone):\n",
            *_front_rows(record),
            "",
            "Pareto front counting the device's compute too (fewer bytes, less device "
            "time, higher fidelity: no other point is at least as good on all three):\n",
            *_front_rows(record, "pareto_compute"),
            "",
        ]
        lines += [
            "Every point:\n",
            "| cut (position) | codec | bytes | fidelity | bit-exact | device segment here (ms) |",
            "|---|---|---|---|---|---|",
        ]
        for p in record["points"]:
            where = "bottleneck" if p["cut"] is None else f"{p['cut']} ({p['position']})"
            lines.append(
                f"| {where} | {p['codec']} | {p['bytes']:.0f} | {p['fidelity']:.3f} | "
                f"{'yes' if p['bit_exact'] else 'no'} | {p['prefix_ms_here']:.2f} |"
            )
        lines.append("")
    return "\n".join(lines) + "\n"


def write_reports(data: dict[str, Any], out: Path) -> None:
    """The JSON, and (for the committed results folder) RATE_FIDELITY.md and RESULTS.md."""
    (out / "rate_fidelity.json").write_text(json.dumps(data, indent=1))
    if out.resolve() == RESULTS.resolve():
        REPORT_MD.write_text(markdown(data))
        replace_section(RESULTS / "RESULTS.md", SECTION_START, SECTION_END, results_section(data))


def report_only(out: Path) -> int:
    """Refresh the orientation's bottleneck points and verdict from bottleneck.json, redraw."""
    data = json.loads((out / "rate_fidelity.json").read_text())
    for record in data["models"]:
        if record["model"] == "orientation":
            measured = [p for p in record["points"] if p["kind"] != "bottleneck"]
            record["points"] = measured + bottleneck_points(out / "bottleneck.json")
            record["split_verdict"] = split_verdict(out / "bottleneck.json")
        mark_pareto(record["points"])
        record["plot"] = plot(record, out)
    write_reports(data, out)
    print("\n".join(summary_lines(data)))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer held-out requests")
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=MODELS)
    parser.add_argument("--out", type=Path, default=RESULTS, help="JSON and plots")
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="measure nothing: re-read bottleneck.json, redraw the plots and rewrite the reports",
    )
    args = parser.parse_args(argv)
    if args.report_only:
        return report_only(args.out)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    for name in ("tierflow.partitioner.graph", "tierflow.partitioner.fidelity_probe"):
        logging.getLogger(name).setLevel(logging.WARNING)
    import datetime

    started = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    counts = {
        "orientation": 16 if args.quick else 32,
        "digits-camera": 40 if args.quick else 80,
        "layout": 8 if args.quick else 32,
    }
    # Models not measured this time keep their records from the last run (--models).
    previous = args.out / "rate_fidelity.json"
    kept = (
        [r for r in json.loads(previous.read_text())["models"] if r["model"] not in args.models]
        if previous.exists()
        else []
    )
    records = []
    for name in args.models:
        began = time.perf_counter()
        makers = {"orientation": orientation, "digits-camera": digits_camera, "layout": layout}
        subject = makers[name](counts[name])
        all_cuts = len(subject.graph.cuts)
        if name == "orientation":
            cuts = [0, *shrinking_cuts(subject.graph)]
            note = (
                "subsampled: the input, the first cut and every cut smaller than all earlier "
                "ones, to fit a few minutes on two shared cores"
            )
        elif name == "layout":
            cuts = [0, *shrinking_cuts(subject.graph)][: LAYOUT_CUTS + 1]
            note = (
                f"the input and the first {LAYOUT_CUTS} shrinking cuts (the first cut, then "
                "each smaller than all earlier ones): every point runs the detector's head "
                "on every page"
            )
        else:
            cuts = list(range(all_cuts - 1))
            note = "every cut but the output"
        points = measure(subject, cuts)
        verdict = None
        if name == "orientation":
            points += bottleneck_points(args.out / "bottleneck.json")
            verdict = split_verdict(args.out / "bottleneck.json")
        mark_pareto(points)
        record = {
            "model": name,
            "model_file": subject.path.name,
            "inputs": subject.inputs,
            "requests": len(subject.requests),
            "cut_count": all_cuts - 1,
            "cuts": cuts,
            "cut_note": note,
            "points": points,
            "split_verdict": verdict,
            "seconds": time.perf_counter() - began,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "quick": args.quick,
        }
        record["plot"] = plot(record, args.out)
        records.append(record)
        print(f"\n{name}: Pareto front ({len(subject.requests)} held-out requests)")
        print("\n".join(_front_rows(record)))
        print("with device compute:")
        print("\n".join(_front_rows(record, "pareto_compute")))
    data = {
        "command": "python -m benchmarks.rate_fidelity" + (" --quick" if args.quick else ""),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "quick": args.quick,
        "seconds": time.perf_counter() - started,
        "codecs": list(feature_codecs()),
        "image_codecs": list(IMAGE_CODECS),
        "models": sorted(kept + records, key=lambda r: MODELS.index(r["model"])),
    }
    write_reports(data, args.out)
    print("\n".join(summary_lines(data)))
    print(f"wrote {args.out / 'rate_fidelity.json'} in {data['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
