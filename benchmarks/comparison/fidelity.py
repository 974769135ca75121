"""Fidelity of every benchmark row, the image-upload baselines, and the fidelity verdict.

A row's ``fidelity`` is the share of the benchmark's held-out fidelity requests whose
top-1 answer (argmax of every float output along its last axis,
:func:`tierflow.partitioner.fidelity.request_agrees`) equals the exact, unsplit model's.
It is measured, never assumed: each distinct plan (cuts and a codec per link) runs the
requests through its segments with the codecs applied for real
(:class:`tierflow.partitioner.fidelity_probe.FidelityProbe`, the planner's own probe),
and ``bit_exact`` says whether every output also matched bit for bit.

The image baselines (``cloud-only-jpeg`` at quality 90, its quality sweep
``cloud-only-jpeg-qNN``, ``cloud-only-png``) send the model's input as an 8-bit image
(:mod:`tierflow.codec.image`, with the input's :class:`~tierflow.codec.base.ImageNorm`); their
codec times and bytes are measured per request on the benchmark's requests as every
other codec's are (``comparison.measure.measure_codecs``). A JPEG row carries its ``quality``.

``tierflow-bottleneck`` rows come from ``bottleneck.py`` (a real trained classifier,
rows already in this shape with measured fidelity), folded in by :func:`bottleneck_rows`.

The verdict (:func:`verdict`) and the split goal (:func:`split_goal`) are computed from
the rows, never asserted.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.comparison.fronts import TIERFLOW_PLANS
from benchmarks.lib import RESULTS
from tierflow.codec.base import ImageNorm

logger = logging.getLogger(__name__)

Row = dict[str, Any]

#: JPEG's quality sweep on the input (5-95), beside ``cloud-only-jpeg`` (quality 90).
JPEG_SWEEP: tuple[int, ...] = (5, 10, 20, 30, 50, 75, 95)
#: WebP's qualities on the input (``cloud-only-webp-qNN``).
WEBP_SWEEP: tuple[int, ...] = (50, 75, 90)
JPEG_BASELINE = "cloud-only-jpeg"


def jpeg_strategy(quality: int) -> str:
    """The strategy of a JPEG upload at ``quality``: ``cloud-only-jpeg`` at 90 (what a camera
    app sends today), else ``cloud-only-jpeg-qNN``."""
    return JPEG_BASELINE if quality == 90 else f"{JPEG_BASELINE}-q{quality}"


#: The image-upload baselines: strategy -> the codec on both links.
IMAGE_BASELINES: dict[str, str] = {
    JPEG_BASELINE: "jpeg:90",
    **{jpeg_strategy(q): f"jpeg:{q}" for q in JPEG_SWEEP},
    **{f"cloud-only-webp-q{q}": f"webp:{q}" for q in WEBP_SWEEP},
    "cloud-only-png": "png",
}
#: Strategies whose plan is tierflow's own (the verdict compares them with the others).
TIERFLOW = (*TIERFLOW_PLANS, "tierflow-exits")
#: tierflow's rows the verdict judges (exits rows are measured on another workload;
#: ``tierflow-split`` is planned for a smaller device than the baselines run on).
VERDICT_STRATEGIES = tuple(name for name in TIERFLOW_PLANS if name != "tierflow-split")
#: The folded ``tierflow-lowbit`` row is the fastest low-bit split of at least this fidelity.
LOWBIT_FIDELITY = 0.99
#: The issue's goal for a split plan on a trained model: this many times faster than
#: ``cloud-only-jpeg`` at the same or better fidelity, at a rate within these bounds.
GOAL_SPEEDUP = 1.5
GOAL_MBIT = (1.0, 50.0)
#: The codecs the goal asks for ("a learned or low-bit codec"): the issue's lower-bit
#: quantisers (4-bit and 2-bit) and the learned bottleneck; fp16 and int8 splits are listed
#: as candidates but do not meet it.
LOW_BIT_QUANTS = ("int4", "int2")
GOAL_KINDS = ("learned", "low-bit")
#: tierflow's plans that may meet it: all but the exact one.
GOAL_STRATEGIES = tuple(name for name in TIERFLOW_PLANS if name != "tierflow")
BOTTLENECK_JSON = RESULTS / "bottleneck.json"
#: ``bottleneck_trained.py``'s runs: learned bottlenecks on the comparison's ImageNet classifiers,
#: one file each (``bottleneck_trained.json`` for EfficientNet-Lite0, the first;
#: ``bottleneck_trained-NAME.json`` for the others).
TRAINED_BOTTLENECK_JSON = BOTTLENECK_JSON.with_name("bottleneck_trained.json")


def trained_bottleneck_files(folder: Path = BOTTLENECK_JSON.parent) -> list[Path]:
    """Every committed ``bottleneck_trained.py`` run in ``folder``: the first classifier's
    (``bottleneck_trained.json``), then the others by name."""
    return sorted(
        folder.glob("bottleneck_trained*.json"),
        key=lambda p: (p.name != TRAINED_BOTTLENECK_JSON.name, p.name),
    )


# Which of bottleneck.json's strategies become results.json rows, and under which name.
_BOTTLENECK_STRATEGIES = {
    "cloud-only-jpeg": JPEG_BASELINE,  # quality 90
    "cloud-only-png": "cloud-only-png",
    "cloud-only (int8+zstd)": "cloud-only-compressed",
    # The planner's own choice under top1=98% there: named by its budget, as comparison/run.py's.
    "tierflow-budget": "tierflow-budget-98",
    "tierflow-budget-100": "tierflow-budget-100",  # ... and under top1=100%
    "tierflow-budget-90": "tierflow-budget-90",  # ... and under top1=90%
}


def image_norms(model: Any, graph: Any) -> dict[str, ImageNorm]:
    """The image inputs of a suite model and how they were normalised (empty: none).

    The random CNNs of the suite get ``lib.models.smooth_images``: 8-bit pixels
    normalised by ``lib.models.IMAGE_NORM``; the camera model 8-bit frames as pixel /
    255; the ImageNet classifiers' photo views as each was trained (EfficientNet-Lite0
    (pixel - 127) / 128, MobileNetV2 ImageNet's mean and std). The demo's
    digits are not 8-bit images (8x8 scans of 17 grey levels, upsampled), the
    transformer's inputs are tokens.
    """
    from benchmarks.lib import models

    if model.kind == "camera":
        return {graph.inputs[0].name: models.CAMERA_NORM}
    if model.kind == "imagenet":
        from tierflow.zoo import imagenet

        return {graph.inputs[0].name: imagenet.classifier(model.name).norm}
    if model.kind not in models.IMAGE_KINDS:
        return {}
    return {graph.inputs[0].name: models.IMAGE_NORM}


def jpeg_quality(codec: str) -> int | None:
    """The quality of a ``jpeg:Q`` codec, else None."""
    name, _, quality = codec.partition(":")
    return int(quality) if name == "jpeg" and quality.isdigit() else None


class RowFidelity:
    """Measures the fidelity of plans of one model on its requests, once per distinct plan.

    Each plan runs every request through its segments with its codecs applied (the
    planner's :class:`~tierflow.partitioner.fidelity_probe.FidelityProbe`); a row gets
    the share agreeing with the exact model's top-1, its one-sided 95% lower bound
    (Clopper-Pearson), whether every output matched bit for bit, and, where the requests
    have true answers (``truth``), the plan's task accuracy beside the exact model's.
    """

    def __init__(
        self,
        graph: Any,
        requests: Sequence[Mapping[str, np.ndarray]],
        images: Mapping[str, ImageNorm],
    ) -> None:
        from tierflow.partitioner.fidelity_probe import FidelityProbe

        self.probe = FidelityProbe(graph, [dict(r) for r in requests], images=images)
        self.last = len(graph.cuts) - 1
        self._seen: dict[tuple[Any, ...], PlanFidelity] = {}

    def measured(self, cuts: Sequence[int], codec: Mapping[str, str]) -> PlanFidelity:
        """The plan's agreement, bit-exactness and top-1 answers on every request."""
        from tierflow.partitioner.fidelity import request_agrees, request_bitwise

        a, b = int(cuts[0]), int(cuts[1])
        used = {
            link: codec.get(link, "raw")
            for link, cut in (("device-edge", a), ("edge-cloud", b))
            if cut < self.last
        }
        key = (a, b, tuple(sorted(used.items())))
        if key not in self._seen:
            agree, exact, answers = [], True, []
            for index in range(len(self.probe.requests)):
                reference = self.probe.reference(index)
                got = self.probe.run_split((a, b), used, index)
                agree.append(request_agrees(reference, got))
                exact = exact and request_bitwise(reference, got)
                answers.append(int(np.argmax(next(iter(got.values())))))
            self._seen[key] = PlanFidelity(agree, exact, answers)
        return self._seen[key]

    def of(self, cuts: Sequence[int], codec: Mapping[str, str]) -> tuple[float, bool]:
        """(top-1 share agreeing with the exact model, every output bit for bit equal)."""
        plan = self.measured(cuts, codec)
        return plan.fidelity, plan.bit_exact

    def add_to(self, row: Row, truth: np.ndarray | None = None) -> None:
        plan = self.measured(row["cuts"], row.get("codec_used", {}))
        row.update(plan.fields(truth))
        if truth is not None:
            exact = self.measured((self.last, self.last), {})
            row["exact_accuracy"] = exact.fields(truth)["accuracy"]


class PlanFidelity:
    """One plan's per-request agreement and answers on the held-out requests."""

    def __init__(self, agree: Sequence[bool], bit_exact: bool, answers: Sequence[int]) -> None:
        self.agree = list(agree)
        self.bit_exact = bit_exact
        self.answers = np.array(answers)

    @property
    def fidelity(self) -> float:
        return float(np.mean(self.agree))

    def fields(self, truth: np.ndarray | None) -> Row:
        """What a results.json row carries of it (accuracy only with ``truth``)."""
        from tierflow.partitioner.fidelity import lower_confidence_bound

        out: Row = {
            "fidelity": self.fidelity,
            "fidelity_lower_95": lower_confidence_bound(sum(self.agree), len(self.agree)),
            "bit_exact": self.bit_exact,
            "fidelity_requests": len(self.agree),
        }
        if truth is not None:
            out["accuracy"] = float(np.mean(self.answers == np.asarray(truth)))
        return out


def planner_probe(
    graph: Any, requests: Sequence[Mapping[str, np.ndarray]], images: Mapping[str, ImageNorm]
) -> Any:
    """The planner's fidelity probe on its own sample, remembering what it measured.

    ``tierflow-budget`` is planned once per bandwidth, and the search measures the same
    lossy crossings at many of them; a measurement depends only on the plan, the codecs
    and the budget, so each is run once.
    """
    from tierflow.partitioner.fidelity_probe import FidelityProbe

    class _RememberingProbe(FidelityProbe):
        _seen: dict[tuple[Any, ...], Any]

        def measure(self, cuts: Any, codec: Any, budget: Any, *, stop_early: bool = False) -> Any:
            key = (tuple(cuts), tuple(sorted(codec.items())), str(budget), stop_early)
            if key not in self._seen:
                self._seen[key] = super().measure(cuts, codec, budget, stop_early=stop_early)
            return self._seen[key]

    probe = _RememberingProbe(graph, [dict(r) for r in requests], images=images)
    probe._seen = {}
    return probe


def bottleneck_rows(
    path: Path = BOTTLENECK_JSON, trained: Sequence[Path] | None = None
) -> tuple[list[Row], dict[str, Any]]:
    """``bottleneck.py``'s last committed run as results.json rows (none if absent).

    Per rate: the fastest ``tierflow-bottleneck`` variant, the fastest low-bit split of
    at least ``LOWBIT_FIDELITY`` (``tierflow-lowbit``), the planner's ``tierflow-budget``
    choice and its choices under other budgets (``tierflow-budget-100``, top1=100%;
    ``tierflow-budget-90``, top1=90%), JPEG at quality 90 and its
    quality sweep, WebP (``cloud-only-webp-qNN``), PNG and the int8+zstd upload, each with
    the fidelity that run measured on its held-out requests.
    With ``trained`` (``bottleneck_trained.py``'s runs; default: every committed one), also
    the fastest learned bottleneck per rate on each of the comparison's ImageNet classifiers
    it ran on, composed there as ``run.py`` composes (the models' other rows are its own).
    Returns the rows and what the report says about their source.
    """
    files = trained_bottleneck_files() if trained is None else trained
    extra = [row for file in files for row in trained_bottleneck_rows(file)]
    if not path.exists():
        return extra, {}
    data = json.loads(path.read_text())
    out: list[Row] = []
    by_rate: dict[float, list[Row]] = {}
    for entry in data["rows"]:
        by_rate.setdefault(float(entry["bandwidth_mbit"]), []).append(entry)
    for mbit, rows in sorted(by_rate.items()):
        chosen: list[tuple[str, Row]] = []
        bottlenecks = [r for r in rows if r["strategy"] == "tierflow-bottleneck"]
        if bottlenecks:
            chosen.append(("tierflow-bottleneck", min(bottlenecks, key=lambda r: r["p50_ms"])))
        lowbit = [
            r
            for r in rows
            if r["strategy"] == "tierflow-lowbit" and r["fidelity"] >= LOWBIT_FIDELITY - 1e-12
        ]
        if lowbit:
            chosen.append(("tierflow-lowbit", min(lowbit, key=lambda r: r["p50_ms"])))
        for r in rows:
            if r["strategy"] in _BOTTLENECK_STRATEGIES:
                chosen.append((_BOTTLENECK_STRATEGIES[r["strategy"]], r))
            elif r["strategy"].startswith("cloud-only-jpeg:"):  # its quality sweep
                quality = jpeg_quality(str(r.get("codec", "")))
                if quality is not None and quality != 90:
                    chosen.append((jpeg_strategy(quality), r))
            elif r["strategy"].startswith("cloud-only-webp:"):
                chosen.append((r["strategy"].replace(":", "-q"), r))
        for name, r in chosen:
            row: Row = {
                "model": data.get("model", r["model"]),
                "bandwidth_mbit": mbit,
                "strategy": name,
                "p50_ms": r["p50_ms"],
                "regret": None,
                "cuts": list(r["cuts"]),
                "last_cut": None,
                "fidelity": r["fidelity"],
                "bit_exact": None,
                "fidelity_requests": r.get("requests"),
                "codec_used": dict(
                    r.get("codec_used") or {"device-edge": r["codec"], "edge-cloud": r["codec"]}
                ),
                "bytes": r.get("bytes", {}),
                "parts_ms": r.get("parts_ms", {}),
                "measured": "composed by bottleneck.py",
                "requests": r.get("requests"),
            }
            if "variant" in r:
                row["variant"] = r["variant"]
            quality = jpeg_quality(str(r.get("codec", "")))
            if quality is not None:
                row["quality"] = quality
            budget = data.get("planner", {}).get("budgets", {}).get(r["strategy"])
            if budget is not None:
                row["budget"] = budget
            row["trained_weights"] = True
            row["timing_only"] = False
            row["input_source"] = "real: " + str(data.get("inputs", "rendered document pages"))
            out.append(row)
    out += extra
    source = {
        "model": data.get("model"),
        "model_file": data.get("model_file"),
        "inputs": data.get("inputs"),
        "heldout_pages": data.get("heldout_pages"),
        "seconds": data.get("seconds"),
        "planner": data.get("planner", {}),
    }
    return out, source


def trained_bottleneck_rows(path: Path = TRAINED_BOTTLENECK_JSON) -> list[Row]:
    """Per model and rate, the fastest ``tierflow-bottleneck`` row of a
    ``bottleneck_trained.py`` run (none if absent); every variant stays in its JSON."""
    if not path.exists():
        return []
    rows = json.loads(path.read_text())["rows"]
    best: dict[tuple[str, float], Row] = {}
    for row in rows:
        key = (str(row["model"]), float(row["bandwidth_mbit"]))
        if key not in best or row["p50_ms"] < best[key]["p50_ms"]:
            best[key] = row
    return [best[k] for k in sorted(best)]


def learned_bottleneck_lines(
    orientation: Path = BOTTLENECK_JSON, trained: Sequence[Path] | None = None
) -> list[str]:
    """What the learned bottleneck reaches on each trained model it was trained on: every
    variant's bytes and held-out fidelity, from the bottleneck benchmarks' runs
    (``trained``: default every committed ``bottleneck_trained.py`` run)."""
    lines: list[str] = []
    files = trained_bottleneck_files() if trained is None else trained
    for path, key in ((orientation, "bottlenecks"), *((f, "points") for f in files)):
        if not path.exists():
            continue
        data = json.loads(path.read_text())
        held = data.get("heldout_pages") or data.get("heldout_views")
        variants = sorted(data.get(key, []), key=lambda b: b["bytes"])
        if not variants:
            continue
        best = max(variants, key=lambda b: b["fidelity"])
        lines.append(
            f"- **{data.get('model')}** (`{path.name}`, {held} held-out requests): "
            + "; ".join(
                f"k={b['channels']} {b['bits']}-bit at `{b['at']}` {b['bytes']:.0f} B, "
                f"fidelity {b['fidelity']:.3f}"
                for b in variants
            )
            + f". Best {best['fidelity']:.3f}."
        )
    if lines:
        lines.insert(
            0,
            "What the learned bottleneck (`tierflow bottleneck add`, trained on the planner's "
            "calibration requests, features distilled) reaches on each trained model it was "
            "tried on:\n",
        )
        lines.append("")
    return lines


def verdict(rows: Sequence[Row]) -> list[Row]:
    """At every model and bandwidth: is tierflow's best plan at each fidelity level at least
    as fast as every baseline of that fidelity or better?

    The levels are the fidelities of tierflow's rows at the point (``tierflow``, the exact
    plan; ``tierflow-budget``, the plan under a fidelity budget; ``tierflow-budget-100``,
    ``tierflow-budget-90``, ``tierflow-bottleneck`` and ``tierflow-lowbit``, folded from
    ``bottleneck.py``).
    At level ``f`` tierflow's best plan is its fastest row of fidelity ``>= f``; a baseline
    of fidelity ``>= f`` that is faster beats it there. One entry per (model, bandwidth):
    ``holds`` when no level is beaten, ``beaten_by`` the baselines that beat some level,
    ``levels`` each level's plan and what beat it, and ``tierflow_*`` the first beaten
    level's plan (else the most faithful one). Only models with trained weights are judged
    (``trained_weights``): a random network's top-1 says nothing about what a codec does
    to a trained one, so its rows measure time alone. Baselines faster than every tierflow plan
    of at least their fidelity, but less faithful than every plan they are faster than
    (a lossy upload against an exact plan), are a different trade-off: listed in
    ``faster_less_faithful``, not failures.
    """
    out: list[Row] = []
    rows = [r for r in rows if r.get("trained_weights")]
    points = sorted({(r["model"], float(r["bandwidth_mbit"])) for r in rows})
    for model, mbit in points:
        here = [r for r in rows if r["model"] == model and r["bandwidth_mbit"] == mbit]
        ours = [r for r in here if r["strategy"] in VERDICT_STRATEGIES]
        others = [r for r in here if r["strategy"] not in TIERFLOW]
        if not ours or not others:
            continue
        levels: list[Row] = []
        beaten: list[Row] = []
        for level in sorted({float(r["fidelity"]) for r in ours}, reverse=True):
            best = min(
                (r for r in ours if r["fidelity"] >= level - 1e-12),
                key=lambda r: (r["p50_ms"], VERDICT_STRATEGIES.index(r["strategy"])),
            )
            faster = [
                o
                for o in others
                if o["fidelity"] >= level - 1e-12 and o["p50_ms"] < best["p50_ms"] * (1 - 1e-9)
            ]
            levels.append(
                {
                    "fidelity": level,
                    "strategy": best["strategy"],
                    "p50_ms": best["p50_ms"],
                    "plan_fidelity": best["fidelity"],
                    "beaten_by": [_brief(o) for o in faster],
                }
            )
            beaten += [o for o in faster if o not in beaten]
        failing = [lv for lv in levels if lv["beaten_by"]]
        shown = failing[0] if failing else levels[0]
        comparable = [o for o in others if o["fidelity"] >= shown["plan_fidelity"] - 1e-12]
        fastest = min(comparable, key=lambda r: r["p50_ms"]) if comparable else None
        undominated = [
            o
            for o in others
            if o not in beaten
            and any(o["p50_ms"] < r["p50_ms"] for r in ours)
            and not any(
                r["fidelity"] >= o["fidelity"] - 1e-12 and r["p50_ms"] <= o["p50_ms"] for r in ours
            )
        ]
        out.append(
            {
                "model": model,
                "bandwidth_mbit": mbit,
                "tierflow_strategy": shown["strategy"],
                "tierflow_ms": shown["p50_ms"],
                "tierflow_fidelity": shown["plan_fidelity"],
                "fastest_comparable": fastest["strategy"] if fastest else None,
                "fastest_comparable_ms": fastest["p50_ms"] if fastest else None,
                "fastest_comparable_fidelity": fastest["fidelity"] if fastest else None,
                "levels": levels,
                "beaten_by": [_brief(o) for o in beaten],
                "faster_less_faithful": [_brief(o) for o in undominated],
                "holds": not beaten,
            }
        )
    return out


def _brief(row: Row) -> Row:
    return {"strategy": row["strategy"], "p50_ms": row["p50_ms"], "fidelity": row["fidelity"]}


def codec_kind(row: Row) -> str:
    """What a split row's feature codec is, for the split goal: ``learned`` (a grafted
    bottleneck), ``low-bit`` (4 bits or fewer a value: ``LOW_BIT_QUANTS``), else ``lossy``
    (fp16, int8, ...) or ``exact``."""
    from tierflow.codec.base import CodecSpec

    if row["strategy"] == "tierflow-bottleneck":
        return "learned"
    specs = [CodecSpec.parse(c) for c in row.get("codec_used", {}).values()]
    if any(s.quant in LOW_BIT_QUANTS for s in specs):
        return "low-bit"
    return "exact" if all(s.bit_exact for s in specs) else "lossy"


def split_goal(rows: Sequence[Row]) -> Row:
    """The issue's goal, computed: on a trained model, a split plan with a low-bit or learned
    codec at least ``GOAL_SPEEDUP`` times faster than ``cloud-only-jpeg`` at the same or
    better fidelity, at some rate within ``GOAL_MBIT``.

    Candidates are tierflow's rows (``GOAL_STRATEGIES``: ``tierflow-split`` is the budgeted
    plan on a device that cannot hold the whole model) on models
    with trained weights whose plan splits the model (the device runs part of it and sends
    a feature) with a lossy codec or a learned bottleneck. Returns the best ratio of a
    low-bit or learned one (``best``: the row, its ratio, the JPEG row's figures; None when
    there is none), the best other lossy one (``best_other_lossy``), every candidate point
    (each with its ``codec_kind``), and ``met``.
    """
    from tierflow.codec.base import CodecSpec

    candidates: list[Row] = []
    for row in rows:
        if row["strategy"] not in GOAL_STRATEGIES:
            continue
        rate = row["bandwidth_mbit"]
        if not row.get("trained_weights") or not GOAL_MBIT[0] <= rate <= GOAL_MBIT[1]:
            continue
        cuts = row.get("cuts") or [0, 0]
        # A bottleneck row's codec is the learned one's wire format, not a CodecSpec.
        if row["strategy"] != "tierflow-bottleneck":
            codecs = row.get("codec_used", {}).values()
            if cuts[0] == 0 or all(CodecSpec.parse(c).bit_exact for c in codecs):
                continue
        jpeg = next(
            (
                r
                for r in rows
                if r["model"] == row["model"]
                and r["bandwidth_mbit"] == row["bandwidth_mbit"]
                and r["strategy"] == JPEG_BASELINE
            ),
            None,
        )
        if jpeg is None or row["fidelity"] < jpeg["fidelity"] - 1e-12:
            continue
        candidates.append(
            {
                "codec_kind": codec_kind(row),
                "model": row["model"],
                "bandwidth_mbit": row["bandwidth_mbit"],
                "strategy": row["strategy"],
                "cuts": list(cuts),
                "codec": dict(row.get("codec_used", {})),
                "p50_ms": row["p50_ms"],
                "fidelity": row["fidelity"],
                "jpeg_p50_ms": jpeg["p50_ms"],
                "jpeg_fidelity": jpeg["fidelity"],
                "speedup": jpeg["p50_ms"] / row["p50_ms"],
            }
        )
    goal_kinds = [c for c in candidates if c["codec_kind"] in GOAL_KINDS]
    best = max(goal_kinds, key=lambda c: c["speedup"], default=None)
    return {
        "target": GOAL_SPEEDUP,
        "mbit": list(GOAL_MBIT),
        "best": best,
        # The fastest lossy split that is not low-bit or learned (fp16, int8): not the goal.
        "best_other_lossy": max(
            (c for c in candidates if c["codec_kind"] not in GOAL_KINDS),
            key=lambda c: c["speedup"],
            default=None,
        ),
        "candidates": candidates,
        "met": best is not None and best["speedup"] >= GOAL_SPEEDUP,
        "any_plan": _best_against_jpeg(rows),
    }


def _best_against_jpeg(rows: Sequence[Row]) -> list[Row]:
    """Per trained model: tierflow's largest p50 ratio over ``cloud-only-jpeg`` within
    ``GOAL_MBIT`` by any of its plans (device-only included) of equal or better fidelity."""
    out: list[Row] = []
    for model in dict.fromkeys(r["model"] for r in rows if r.get("trained_weights")):
        best: Row | None = None
        for row in rows:
            if row["model"] != model or row["strategy"] not in VERDICT_STRATEGIES:
                continue
            if not GOAL_MBIT[0] <= row["bandwidth_mbit"] <= GOAL_MBIT[1]:
                continue
            jpeg = next(
                (
                    r
                    for r in rows
                    if r["model"] == model
                    and r["bandwidth_mbit"] == row["bandwidth_mbit"]
                    and r["strategy"] == JPEG_BASELINE
                ),
                None,
            )
            if jpeg is None or row["fidelity"] < jpeg["fidelity"] - 1e-12:
                continue
            ratio = jpeg["p50_ms"] / row["p50_ms"]
            if best is None or ratio > best["speedup"]:
                best = {
                    "model": model,
                    "bandwidth_mbit": row["bandwidth_mbit"],
                    "strategy": row["strategy"],
                    "cuts": list(row.get("cuts") or []),
                    "codec": dict(row.get("codec_used", {})),
                    "p50_ms": row["p50_ms"],
                    "fidelity": row["fidelity"],
                    "jpeg_p50_ms": jpeg["p50_ms"],
                    "jpeg_fidelity": jpeg["fidelity"],
                    "speedup": ratio,
                }
        if best is not None:
            out.append(best)
    return out
