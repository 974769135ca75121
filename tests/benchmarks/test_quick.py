"""The comparison benchmark's ``--quick`` mode runs end to end, so it never rots.

One run (module-scoped) writes into a temporary folder; the tests check what a reader of
``RESULTS.md`` and ``results.json`` relies on, against the issue's contract.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
STRATEGIES = {
    "device-only",
    "cloud-only",
    "cloud-only-compressed",
    "single-split",
    "tierflow",
    "tierflow-budget",
    "tierflow-exits",
}
# The image-input models also get the image-upload baselines: JPEG's quality sweep (5-95)
# and WebP's.
JPEG_SWEEP = {f"cloud-only-jpeg-q{q}": q for q in (5, 10, 20, 30, 50, 75, 95)}
WEBP_SWEEP = {f"cloud-only-webp-q{q}": q for q in (50, 75, 90)}
IMAGE_STRATEGIES = {"cloud-only-jpeg", "cloud-only-png", *JPEG_SWEEP, *WEBP_SWEEP}
IMAGE_MODELS = {"resnet18", "digits-camera", "efficientnet-lite0"}
MODELS = {
    "resnet18",
    "transformer",
    "demo-digits",
    "digits-camera",
    "efficientnet-lite0",
    "minilm-topics",
}
# The trained models also get tierflow-split (the budgeted plan on a smaller device) and
# tierflow's plans under the lower budgets (the rest of the rate-fidelity front).
TRAINED_MODELS = {"demo-digits", "digits-camera", "efficientnet-lite0", "minilm-topics"}
LOWER_BUDGETS = {"tierflow-budget-98", "tierflow-budget-95", "tierflow-budget-90"}
# Folded in from bottleneck.py's committed results/bottleneck.json.
BOTTLENECK_MODEL = "orientation"
CONTRACT = (
    "model",
    "bandwidth_mbit",
    "strategy",
    "p50_ms",
    "regret",
    "cuts",
    "last_cut",
    "fidelity",
)


# One quick run takes about a minute, more on a fresh machine (the demo model is trained
# and cached on first use).
def quick(test: Callable[..., None]) -> Callable[..., None]:
    """Mark a test that uses the quick run: slow, with room for the run in its timeout."""
    return pytest.mark.timeout(900)(pytest.mark.slow(test))


@pytest.fixture(scope="module")
def quick_run(
    tmp_path_factory: pytest.TempPathFactory, demo_build: tuple[Any, list[Any]]
) -> tuple[Path, list[dict[str, Any]]]:
    # demo_build: the run's demo model is trained by its fixture, which the benchmark reuses.
    out = tmp_path_factory.mktemp("bench")
    env = dict(os.environ, MPLBACKEND="Agg")
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.comparison", "--quick", "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    rows = json.loads((out / "results.json").read_text())
    return out, rows


@pytest.mark.integration
@quick
def test_rows_cover_every_model_strategy_and_bandwidth(
    quick_run: tuple[Path, list[dict[str, Any]]],
) -> None:
    _, all_rows = quick_run
    for row in all_rows:
        for key in CONTRACT:
            assert key in row, (key, row)
        assert row["p50_ms"] > 0
    rows = [
        r
        for r in all_rows
        if r["model"] != BOTTLENECK_MODEL and r["strategy"] != "tierflow-bottleneck"
    ]
    assert {r["model"] for r in rows} == MODELS
    assert {r["strategy"] for r in rows} == (
        STRATEGIES | IMAGE_STRATEGIES | LOWER_BUDGETS | {"tierflow-split"}
    )
    assert {r["model"] for r in rows if r["strategy"] == "tierflow-split"} == TRAINED_MODELS
    for row in rows:  # issue 21: every row says what it is measured on
        assert row["trained_weights"] == (row["model"] in TRAINED_MODELS), row
        assert row["input_source"].startswith("real" if row["trained_weights"] else "synth")
    for r in rows:  # its device cannot hold the whole model: never device-only
        if r["strategy"] == "tierflow-split":
            assert r["cuts"][0] < r["last_cut"] and r["device_memory_budget"] > 0, r
    bandwidths = {r["bandwidth_mbit"] for r in rows}
    assert len(bandwidths) >= 3
    seen = {(r["model"], r["bandwidth_mbit"], r["strategy"]) for r in rows}
    expected = (
        len(bandwidths)
        * (
            len(MODELS) * len(STRATEGIES)
            + len(IMAGE_MODELS) * len(IMAGE_STRATEGIES)
            + len(TRAINED_MODELS)  # tierflow-split
        )
        + len(TRAINED_MODELS) * len(LOWER_BUDGETS)  # --quick: at one rate only
    )
    assert len(seen) == len(rows) == expected
    for model in IMAGE_MODELS:
        assert {r["strategy"] for r in rows if r["model"] == model} >= IMAGE_STRATEGIES


@pytest.mark.integration
@quick
def test_every_row_has_a_measured_fidelity(
    quick_run: tuple[Path, list[dict[str, Any]]],
) -> None:
    """Fidelity is a share in [0, 1] on every row; tierflow's exact plans are bit-exact."""
    from tierflow.codec.base import EXACT_PLANNER_CODECS

    _, rows = quick_run
    for row in rows:
        assert row["fidelity"] is not None and 0.0 <= row["fidelity"] <= 1.0, row
    for row in rows:
        if row["model"] == BOTTLENECK_MODEL:
            continue
        assert row["fidelity_requests"] >= 5, row
        if row["strategy"] == "tierflow":
            assert set(row["codec_used"].values()) <= set(EXACT_PLANNER_CODECS), row
            assert row["bit_exact"] and row["fidelity"] == 1.0, row
        if row["bit_exact"]:
            assert row["fidelity"] == 1.0, row


@pytest.mark.integration
@quick
def test_image_baselines_send_the_input_as_an_image(
    quick_run: tuple[Path, list[dict[str, Any]]],
) -> None:
    _, rows = quick_run
    for row in rows:
        if row["strategy"] not in IMAGE_STRATEGIES or row["model"] == BOTTLENECK_MODEL:
            continue
        quality = 90 if row["strategy"] == "cloud-only-jpeg" else JPEG_SWEEP.get(row["strategy"])
        webp = WEBP_SWEEP.get(row["strategy"])
        codec = f"webp:{webp}" if webp else "png" if quality is None else f"jpeg:{quality}"
        assert row.get("quality") == quality
        assert row["cuts"] == [0, 0]
        assert row["codec_used"] == {"device-edge": codec, "edge-cloud": codec}
        raw = next(
            r
            for r in rows
            if r["strategy"] == "cloud-only"
            and r["model"] == row["model"]
            and r["bandwidth_mbit"] == row["bandwidth_mbit"]
        )
        # 8-bit pictures are at most a quarter of their float32 tensor, JPEG well below.
        assert row["bytes"]["device-edge"] < raw["bytes"]["device-edge"] / 4
        assert row["parts_ms"]["device-edge codec"] > 0
        if row["strategy"] == "cloud-only-png":  # the requests are 8-bit pictures
            assert row["bit_exact"], row


@pytest.mark.integration
@quick
def test_bottleneck_rows_are_folded_in(
    quick_run: tuple[Path, list[dict[str, Any]]],
) -> None:
    _, rows = quick_run
    mine = [r for r in rows if r["model"] == BOTTLENECK_MODEL]
    assert {r["strategy"] for r in mine} >= {
        "tierflow-bottleneck",
        "cloud-only-jpeg",
        "cloud-only-png",
    }
    for row in mine:
        if row["strategy"] == "cloud-only-jpeg":
            assert row["codec_used"]["device-edge"] == "jpeg:90"


@pytest.mark.integration
@quick
def test_budget_rows_state_their_budget_and_held_out_fidelity(
    quick_run: tuple[Path, list[dict[str, Any]]],
) -> None:
    """tierflow-budget plans under top1=99% on a sample of its own; its fidelity is measured
    on the held-out requests, as every row's is."""
    _, rows = quick_run
    budget = [
        r for r in rows if r["strategy"] == "tierflow-budget" and r["model"] != BOTTLENECK_MODEL
    ]
    assert {r["model"] for r in budget} == MODELS
    for row in budget:
        assert row["budget"] == "top1=99%" and row["budget_sample_requests"] >= 100
        assert row["fidelity_requests"] >= 20
        assert row["predicted_ms"] > 0
    lower = [r for r in rows if r["strategy"] in LOWER_BUDGETS and r["model"] != BOTTLENECK_MODEL]
    assert {r["model"] for r in lower} == TRAINED_MODELS
    assert {r["bandwidth_mbit"] for r in lower} == {20.0}  # --quick: the front at one rate
    for row in lower:
        assert row["budget"] == f"top1={row['strategy'].rsplit('-', 1)[1]}%"


@pytest.mark.integration
@quick
def test_verdict_and_goal_are_computed_and_printed(
    quick_run: tuple[Path, list[dict[str, Any]]],
) -> None:
    out, _ = quick_run
    meta = json.loads((out / "results_meta.json").read_text())
    assert meta["verdict"] and all("levels" in v for v in meta["verdict"])
    goal = meta["split_goal"]
    assert goal["target"] == 1.5 and isinstance(goal["met"], bool)
    text = (out / "RESULTS.md").read_text()
    assert "goal: a split plan" in text and "JPEG quality sweep" in text


@pytest.mark.integration
@quick
def test_tierflow_rows_report_regret_against_the_best_measured_plan(
    quick_run: tuple[Path, list[dict[str, Any]]],
) -> None:
    _, rows = quick_run
    tierflow = [r for r in rows if r["strategy"] == "tierflow"]
    for row in tierflow:
        best = row["best_measured"]["p50_ms"]
        assert row["regret"] >= 0
        assert row["regret"] == pytest.approx(row["p50_ms"] / best - 1)
        assert row["plans_compared"] > 1


@pytest.mark.integration
@quick
def test_no_strategy_beats_the_best_measured_plan(
    quick_run: tuple[Path, list[dict[str, Any]]],
) -> None:
    """The measured best is the minimum over plans with exact codecs, which include every
    exact strategy's plan (lossy baselines may beat it: they are not the same answer)."""
    from tierflow.codec.base import EXACT_PLANNER_CODECS

    _, rows = quick_run
    for row in rows:
        exact = set(row["codec_used"].values()) <= set(EXACT_PLANNER_CODECS)
        if row["strategy"] == "tierflow-exits" or row["model"] == BOTTLENECK_MODEL or not exact:
            continue
        best = next(
            r["best_measured"]["p50_ms"]
            for r in rows
            if r["strategy"] == "tierflow"
            and r["model"] == row["model"]
            and r["bandwidth_mbit"] == row["bandwidth_mbit"]
        )
        assert row["p50_ms"] >= best * (1 - 1e-9), row


@pytest.mark.integration
@quick
def test_device_only_needs_no_link_and_cloud_only_does(
    quick_run: tuple[Path, list[dict[str, Any]]],
) -> None:
    _, rows = quick_run
    for row in rows:
        if row["strategy"] == "device-only":
            assert row["codec_used"] == {}
            assert row["cuts"][0] == row["cuts"][1] == row["last_cut"]
        if row["strategy"] == "cloud-only":
            assert row["cuts"] == [0, 0]
            assert row["codec_used"] == {"device-edge": "raw", "edge-cloud": "raw"}


@pytest.mark.integration
@quick
def test_cloud_only_gets_faster_with_bandwidth(
    quick_run: tuple[Path, list[dict[str, Any]]],
) -> None:
    """Sending the raw input is dominated by the link, so more bandwidth must help."""
    _, rows = quick_run
    for model in MODELS:
        points = sorted(
            (r["bandwidth_mbit"], r["p50_ms"])
            for r in rows
            if r["model"] == model and r["strategy"] == "cloud-only"
        )
        latencies = [p for _, p in points]
        assert latencies[0] > latencies[-1], (model, points)


@pytest.mark.integration
@quick
def test_demo_exits_leave_early_and_keep_accuracy(
    quick_run: tuple[Path, list[dict[str, Any]]],
) -> None:
    _, rows = quick_run
    exits = [r for r in rows if r["model"] == "demo-digits" and r["strategy"] == "tierflow-exits"]
    assert exits
    for row in exits:
        assert row["exits_used"]
        assert row["exit_rate"] > 0
        assert row["accuracy"] >= row["accuracy_without_exits"] - 0.05
    # The real runtime ran the exit plan with its edge cache at one point, and the exits
    # and the cache answered there as in the walk.
    ran = [r for r in exits if "runtime_p50_ms" in r]
    assert ran, "no tierflow-exits point ran through the runtime"
    for row in ran:
        assert row["runtime_exit_rate"] == pytest.approx(row["exit_rate"], abs=0.1)
        assert row["runtime_cache_hit_rate"] == pytest.approx(row["cache_hit_rate"], abs=0.1)


@pytest.mark.integration
@quick
def test_report_and_plots_are_written(quick_run: tuple[Path, list[dict[str, Any]]]) -> None:
    out, _ = quick_run
    text = (out / "RESULTS.md").read_text()
    for needle in (
        "Machine and emulation",
        "Summary",
        "regret",
        "slowdown",
        "RTT",
        "Fidelity and the verdict",
        "verdict: tierflow never slower than any baseline of equal or better fidelity",
        "random weights",
    ):
        assert needle in text
    for name in ("latency_vs_bandwidth.png", "cuts.png", "speedup.png", "regret.png"):
        data = (out / name).read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) > 10_000


def test_compose_adds_compute_codec_and_link_costs() -> None:
    """A plan's latency is each tier's compute times its slowdown plus each used link's
    encode, decode, serialisation both ways and one RTT ([Note: how plans are measured])."""
    import numpy as np

    from benchmarks.comparison.measure import CodecSample, Measurements, compose
    from tierflow.link.spec import LinkSpec

    m = Measurements("m", last=3, requests=2, cuts=(0, 1, 3))
    m.prefix_s = {0: np.zeros(2), 1: np.array([0.001, 0.002]), 3: np.array([0.01, 0.01])}
    m.suffix_s = {0: np.array([0.01, 0.01]), 1: np.array([0.004, 0.006]), 3: np.zeros(2)}
    m.middle_s = {(1, 3): np.array([0.003, 0.003])}
    m.codecs = {
        1: {
            "int8": CodecSample(
                np.array([1e-4, 1e-4]), np.array([1000.0, 3000.0]), np.array([2e-4, 2e-4])
            )
        },
    }
    m.reply_bytes = 40
    links = {"device-edge": LinkSpec(8e6, 0.010), "edge-cloud": LinkSpec(80e6, 0.020)}
    slow = {"device": 10.0, "edge": 2.0, "cloud": 1.0}
    plan = compose(m, 1, 3, {"device-edge": "int8", "edge-cloud": "raw"}, links, slow)
    expected = (
        10 * np.array([0.001, 0.002])  # device [0, 1)
        + 2 * 0.003  # edge [1, 3)
        + 10 * 1e-4
        + 2 * 2e-4  # encode on the device, decode on the edge
        + np.array([1000.0, 3000.0]) * 8 / 8e6
        + 0.010  # bytes up, RTT/2 each way
        + 40 * 8 / 8e6  # the answer coming back
    )
    assert np.allclose(plan.latency_s, expected)
    assert plan.codec == {"device-edge": "int8"}  # the edge-cloud link is unused
    assert plan.p50_ms == pytest.approx(float(np.median(expected)) * 1e3)


def test_compose_charges_an_edge_that_runs_nothing_no_codec_time() -> None:
    """An edge that runs nothing forwards the device's bytes as they came ([Note: an edge
    that runs nothing] in tierflow/plan.py): one encode on the device, one decode on the
    cloud, the device-edge codec's bytes on both links, as the cost model charges."""
    import numpy as np

    from benchmarks.comparison.measure import CodecSample, Measurements, best_plan, compose
    from tierflow.link.spec import LinkSpec

    m = Measurements("m", last=3, requests=2, cuts=(0, 3))
    m.prefix_s = {0: np.zeros(2), 3: np.array([0.5, 0.5])}
    m.suffix_s = {0: np.array([0.01, 0.02]), 3: np.zeros(2)}
    jpeg = CodecSample(np.array([1e-3, 1e-3]), np.array([2000.0, 4000.0]), np.array([5e-4, 5e-4]))
    raw = CodecSample(np.zeros(2), np.array([60000.0, 60000.0]), np.zeros(2))
    m.codecs = {0: {"jpeg:30": jpeg, "raw": raw}}
    links = {"device-edge": LinkSpec(8e6, 0.010), "edge-cloud": LinkSpec(80e6, 0.020)}
    slow = {"device": 10.0, "edge": 2.0, "cloud": 1.0}
    # An older plan file may name another codec for edge-cloud: the edge forwards anyway.
    plan = compose(m, 0, 0, {"device-edge": "jpeg:30", "edge-cloud": "raw"}, links, slow)
    sent = np.array([2000.0, 4000.0]) * 8
    expected = (
        np.array([0.01, 0.02])  # the whole model on the cloud
        + 10 * 1e-3  # encoded once, on the device
        + 1 * 5e-4  # decoded once, on the cloud
        + sent / 8e6
        + sent / 80e6  # the same bytes on both links
        + 0.010
        + 0.020
    )
    assert np.allclose(plan.latency_s, expected)
    assert plan.codec == {"device-edge": "jpeg:30", "edge-cloud": "jpeg:30"}
    assert plan.bytes == {"device-edge": 3000.0, "edge-cloud": 3000.0}
    assert plan.parts_ms["device-edge codec"] == pytest.approx(10.0)
    assert plan.parts_ms["edge-cloud codec"] == pytest.approx(0.5)
    best, compared = best_plan(m, links, slow, ("raw", "jpeg:30"))
    assert best.cuts == (0, 0) and best.codec["device-edge"] == "jpeg:30"
    assert compared == 3  # (0, 0) with either codec, and device-only


def _row(
    strategy: str, ms: float, fidelity: float, model: str = "orientation", mbit: float = 5.0
) -> dict[str, Any]:
    """A results.json row as the verdict reads it."""
    return {
        "model": model,
        "bandwidth_mbit": mbit,
        "strategy": strategy,
        "p50_ms": ms,
        "fidelity": fidelity,
        "trained_weights": True,
    }


def test_verdict_compares_only_baselines_of_equal_or_better_fidelity() -> None:
    """A faster lossy baseline is no failure of an exact plan; a faster exact one is, and a
    point whose tierflow plan is slower than an equally faithful baseline fails."""
    from benchmarks.comparison.fidelity import verdict

    def row(model: str, strategy: str, ms: float, fidelity: float) -> dict[str, Any]:
        return _row(strategy, ms, fidelity, model, mbit=10.0)

    rows = [
        row("a", "tierflow", 50.0, 1.0),
        row("a", "cloud-only-jpeg", 30.0, 0.9),  # faster but lossy: not a failure
        row("a", "cloud-only-png", 60.0, 1.0),
        row("b", "tierflow", 50.0, 1.0),
        row("b", "cloud-only-png", 40.0, 1.0),  # faster and as faithful: a failure
        row("c", "tierflow-bottleneck", 80.0, 0.98),
        row("c", "cloud-only-jpeg", 70.0, 1.0),  # faster and more faithful: a failure
        row("c", "tierflow-exits", 10.0, 1.0),  # tierflow's own rows are not baselines
    ]
    by_model = {v["model"]: v for v in verdict(rows)}
    assert by_model["a"]["holds"]
    assert [b["strategy"] for b in by_model["a"]["faster_less_faithful"]] == ["cloud-only-jpeg"]
    assert not by_model["b"]["holds"]
    assert [b["strategy"] for b in by_model["b"]["beaten_by"]] == ["cloud-only-png"]
    assert not by_model["c"]["holds"]
    assert by_model["c"]["tierflow_strategy"] == "tierflow-bottleneck"


def test_verdict_judges_each_fidelity_level_of_tierflow() -> None:
    """With an exact and a budgeted plan, a baseline must beat the fastest tierflow plan of
    at most its own fidelity to count against tierflow."""
    from benchmarks.comparison.fidelity import verdict

    def row(model: str, strategy: str, ms: float, fidelity: float) -> dict[str, Any]:
        return _row(strategy, ms, fidelity, model)

    rows = [
        row("d", "tierflow", 50.0, 1.0),
        row("d", "tierflow-budget", 30.0, 0.99),
        # Faster than the exact plan and less faithful, slower than the budgeted one: a
        # trade-off tierflow offers no plan for, listed, not a failure.
        row("d", "cloud-only-jpeg", 40.0, 0.995),
        row("d", "cloud-only-jpeg-q30", 20.0, 0.95),  # faster, less faithful than both
        row("e", "tierflow", 50.0, 1.0),
        row("e", "tierflow-budget", 30.0, 0.99),
        row("e", "cloud-only-jpeg", 25.0, 0.995),  # beats the budgeted plan at its level
    ]
    by_model = {v["model"]: v for v in verdict(rows)}
    assert by_model["d"]["holds"]
    assert [b["strategy"] for b in by_model["d"]["faster_less_faithful"]] == [
        "cloud-only-jpeg",
        "cloud-only-jpeg-q30",
    ]
    assert [lv["fidelity"] for lv in by_model["d"]["levels"]] == [1.0, 0.99]
    assert not by_model["e"]["holds"]
    assert by_model["e"]["tierflow_strategy"] == "tierflow-budget"
    assert [b["strategy"] for b in by_model["e"]["beaten_by"]] == ["cloud-only-jpeg"]


def test_split_goal_counts_only_lossy_splits_of_trained_models_within_the_rates() -> None:
    from benchmarks.comparison.fidelity import split_goal

    def row(strategy: str, mbit: float, ms: float, cuts: list[int], codec: dict[str, str],
            trained: bool = True, fidelity: float = 1.0) -> dict[str, Any]:  # fmt: skip
        return {
            "model": "m" if trained else "random",
            "bandwidth_mbit": mbit,
            "strategy": strategy,
            "p50_ms": ms,
            "fidelity": fidelity,
            "cuts": cuts,
            "codec_used": codec,
            "trained_weights": trained,
        }

    jpeg = {"device-edge": "jpeg:90", "edge-cloud": "jpeg:90"}
    rows = [
        row("cloud-only-jpeg", 5.0, 40.0, [0, 0], jpeg),
        row("tierflow-budget", 5.0, 20.0, [3, 9], {"device-edge": "int4+zstd"}),
        row("cloud-only-jpeg", 20.0, 30.0, [0, 0], jpeg),
        row("tierflow-budget", 20.0, 5.0, [9, 9], {}),  # device-only: no split
        row("cloud-only-jpeg", 100.0, 30.0, [0, 0], jpeg),
        row("tierflow-budget", 100.0, 3.0, [3, 9], {"device-edge": "int8+zstd"}),  # too fast a link
        row("cloud-only-jpeg", 5.0, 90.0, [0, 0], jpeg, trained=False),
        row("tierflow-budget", 5.0, 9.0, [3, 9], {"device-edge": "int8"}, trained=False),
    ]
    goal = split_goal(rows)
    assert [(c["model"], c["bandwidth_mbit"]) for c in goal["candidates"]] == [("m", 5.0)]
    assert goal["best"]["speedup"] == pytest.approx(2.0)
    assert goal["met"]
    rows[1]["fidelity"] = 0.98  # less faithful than the JPEG upload: not the same fidelity
    assert split_goal(rows)["best"] is None and not split_goal(rows)["met"]


def test_the_plan_at_top1_100_is_tierflows_plan_at_the_highest_level() -> None:
    """tierflow-budget-100 (the planner keeping every calibration answer) is one of
    tierflow's rows: at level 1.000 it, not the slow low-bit split, is tierflow's best plan,
    and an upload of that fidelity must beat it to count; without it the same upload beats
    the low-bit split there."""
    from benchmarks.comparison.fidelity import TIERFLOW, VERDICT_STRATEGIES, verdict

    for name in ("tierflow-budget-100", "tierflow-budget-90"):
        assert name in TIERFLOW and name in VERDICT_STRATEGIES

    rows = [
        _row("tierflow-budget", 70.0, 0.99),
        _row("tierflow-lowbit", 130.0, 1.0),
        _row("cloud-only-jpeg-q30", 80.0, 1.0),
        _row("cloud-only-jpeg-q5", 65.0, 0.95),  # faster, less faithful than every plan
    ]
    (without,) = verdict(rows)
    assert not without["holds"]
    assert [b["strategy"] for b in without["beaten_by"]] == ["cloud-only-jpeg-q30"]
    (with_it,) = verdict([*rows, _row("tierflow-budget-100", 80.0, 1.0)])
    assert with_it["holds"]
    assert with_it["levels"][0]["strategy"] == "tierflow-budget-100"
    (slower,) = verdict([*rows, _row("tierflow-budget-100", 85.0, 1.0)])
    assert [b["strategy"] for b in slower["beaten_by"]] == ["cloud-only-jpeg-q30"]


def test_bottleneck_fold_keeps_each_strategy_once_per_rate(tmp_path: Path) -> None:
    """bottleneck.py's rows become one row per strategy and rate: the fastest
    bottleneck, the fastest low-bit split of at least 99% agreement, the planner's budgeted
    plan with its codecs, and the uploads under results.json's names."""
    from benchmarks.comparison.fidelity import bottleneck_rows

    def row(strategy: str, ms: float, fidelity: float, codec: str, **extra: Any) -> dict[str, Any]:
        return {**_row(strategy, ms, fidelity), "codec": codec, "cuts": [0, 0], **extra}

    rows = [
        row("tierflow-bottleneck", 90.0, 0.98, "zstd (uint8 codes)", cuts=[9, 9]),
        row("tierflow-bottleneck", 80.0, 0.95, "zstd (uint8 codes)", cuts=[9, 9]),
        row("tierflow-lowbit", 50.0, 0.90, "int2+zstd", cuts=[4, 4]),  # too unfaithful
        row("tierflow-lowbit", 70.0, 1.00, "int4+zstd", cuts=[4, 4]),
        row("tierflow-lowbit", 75.0, 1.00, "int8+zstd", cuts=[2, 2]),
        row(
            "tierflow-budget",
            60.0,
            0.99,
            "jpeg:10 / jpeg:20",
            codec_used={"device-edge": "jpeg:10", "edge-cloud": "jpeg:20"},
        ),
        row("tierflow-budget-100", 62.0, 1.0, "jpeg:30", codec_used={"device-edge": "jpeg:30"}),
        row("cloud-only-jpeg", 65.0, 1.0, "jpeg:90"),
        row("cloud-only-jpeg:10", 55.0, 1.0, "jpeg:10"),
        row("cloud-only-webp:50", 58.0, 1.0, "webp:50"),
        row("cloud-only (zstd)", 300.0, 1.0, "zstd"),  # not a results.json strategy
    ]
    path = tmp_path / "bottleneck.json"
    path.write_text(json.dumps({"model": "orientation", "rows": rows}))
    folded, _ = bottleneck_rows(path, trained=[tmp_path / "absent.json"])
    by_name = {r["strategy"]: r for r in folded}
    assert len(by_name) == len(folded)
    assert set(by_name) == {
        "tierflow-bottleneck",
        "tierflow-lowbit",
        "tierflow-budget-98",  # bottleneck.py plans tierflow-budget under top1=98%
        "tierflow-budget-100",
        "cloud-only-jpeg",
        "cloud-only-jpeg-q10",
        "cloud-only-webp-q50",
    }
    assert by_name["tierflow-budget-100"]["codec_used"] == {"device-edge": "jpeg:30"}
    assert by_name["tierflow-bottleneck"]["p50_ms"] == 80.0
    assert by_name["tierflow-lowbit"]["codec_used"]["device-edge"] == "int4+zstd"
    assert by_name["tierflow-budget-98"]["codec_used"]["edge-cloud"] == "jpeg:20"
    assert by_name["cloud-only-jpeg-q10"]["quality"] == 10
    assert all(r["trained_weights"] for r in folded)
