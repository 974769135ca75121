"""Rate-fidelity fronts, where splits pay, and the verdict on trained models only: pure
functions of results.json rows, fed synthetic rows."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from benchmarks.comparison import fidelity as bench_fidelity
from benchmarks.comparison import fronts as bench_fronts


def _row(
    strategy: str,
    p50: float,
    fidelity: float,
    *,
    model: str = "m",
    mbit: float = 5.0,
    cuts: tuple[int, int] = (0, 0),
    device_ms: float | None = 0.0,
    trained: bool = True,
    codec: str = "raw",
) -> dict[str, Any]:
    return {
        "model": model,
        "bandwidth_mbit": mbit,
        "strategy": strategy,
        "p50_ms": p50,
        "fidelity": fidelity,
        "cuts": list(cuts),
        "last_cut": 10,
        "codec_used": {"device-edge": codec, "edge-cloud": codec},
        "device_ms_here": device_ms,
        "trained_weights": trained,
    }


def test_kinds_and_splits() -> None:
    assert bench_fronts.kind(_row("cloud-only-jpeg-q30", 1, 1)) == "upload"
    assert bench_fronts.kind(_row("tierflow-budget-95", 1, 1)) == "tierflow"
    assert bench_fronts.kind(_row("device-only", 1, 1, cuts=(10, 10))) == "device-only"
    assert bench_fronts.kind(_row("single-split", 1, 1)) == "other"
    assert bench_fronts.is_split(_row("tierflow", 1, 1, cuts=(3, 10)))
    assert not bench_fronts.is_split(_row("tierflow", 1, 1, cuts=(10, 10)))  # device-only
    assert not bench_fronts.is_split(_row("tierflow", 1, 1, cuts=(0, 4)))  # input sent
    assert bench_fronts.is_split({**_row("tierflow-bottleneck", 1, 1), "last_cut": None})


def test_device_speed_scales_only_the_device_share() -> None:
    row = _row("tierflow", 100.0, 1.0, cuts=(3, 10), device_ms=4.0)
    assert bench_fronts.at_device_speed(row, 10.0) == 100.0
    assert bench_fronts.at_device_speed(row, 20.0) == pytest.approx(140.0)
    assert bench_fronts.at_device_speed(row, 2.0) == pytest.approx(68.0)
    folded = {**row, "device_ms_here": None}
    assert bench_fronts.at_device_speed(folded, 10.0) == 100.0
    assert bench_fronts.at_device_speed(folded, 2.0) is None


def test_front_marks_points_no_other_beats_on_both_axes() -> None:
    rows = [
        _row("tierflow", 50.0, 1.0, cuts=(10, 10)),
        _row("tierflow-budget-95", 20.0, 0.96, cuts=(3, 10)),
        _row("cloud-only-jpeg", 30.0, 0.9),  # slower and less faithful than -95
        _row("cloud-only-png", 60.0, 1.0),  # as faithful as tierflow, slower
        _row("single-split", 1.0, 1.0),  # not on a front: other
        _row("cloud-only-jpeg", 1.0, 0.1, model="random", trained=False),
    ]
    points = {p["strategy"]: p for p in bench_fronts.front(rows, "m", 5.0)}
    assert set(points) == {"tierflow", "tierflow-budget-95", "cloud-only-jpeg", "cloud-only-png"}
    assert points["tierflow"]["pareto"] and points["tierflow-budget-95"]["pareto"]
    assert not points["cloud-only-jpeg"]["pareto"] and not points["cloud-only-png"]["pareto"]
    assert bench_fronts.front(rows, "random", 5.0) == []


def test_a_split_pays_against_the_fastest_upload_as_faithful() -> None:
    rows = [
        _row("tierflow-budget", 40.0, 0.99, cuts=(3, 10), device_ms=2.0, codec="int8+zstd"),
        _row("cloud-only-jpeg", 30.0, 0.90, device_ms=0.5),  # faster but less faithful
        _row("cloud-only-jpeg-q95", 60.0, 0.99, device_ms=0.5),
        _row("cloud-only-png", 80.0, 1.0, device_ms=1.0),
    ]
    (at2, at10, at20) = bench_fronts.where_splits_pay(rows, (2.0, 10.0, 20.0))
    assert at10["upload"] == "cloud-only-jpeg-q95" and at10["speedup"] == pytest.approx(1.5)
    assert at10["pays"] and at10["speedup_vs_jpeg90"] == pytest.approx(30.0 / 40.0)
    # A faster device takes 16 ms off the split and 4 ms off the JPEG's encode.
    assert at2["speedup"] == pytest.approx(56.0 / 24.0)
    # A slower one: 40 + 20 = 60 ms against 60 + 5 = 65 ms.
    assert at20["speedup"] == pytest.approx(65.0 / 60.0)
    (summary,) = bench_fronts.summary([at2, at10, at20])
    assert summary["pays_at"] == [(2.0, 5.0), (10.0, 5.0), (20.0, 5.0)]
    assert summary["best"] is at2


def test_a_split_no_upload_matches_pays_on_fidelity_and_a_slow_one_does_not() -> None:
    rows = [
        _row("tierflow", 90.0, 1.0, cuts=(4, 10), device_ms=5.0),
        _row("cloud-only-jpeg", 30.0, 0.95),
    ]
    (entry,) = bench_fronts.where_splits_pay(rows, (10.0,))
    assert entry["upload"] is None and entry["speedup"] is None and entry["pays"]
    rows.append(_row("cloud-only", 45.0, 1.0))
    (entry,) = bench_fronts.where_splits_pay(rows, (10.0,))
    assert entry["upload"] == "cloud-only" and not entry["pays"]
    assert entry["speedup"] == pytest.approx(0.5)


def test_the_verdict_judges_trained_models_only() -> None:
    rows = [
        _row("tierflow", 50.0, 1.0, model="random", trained=False),
        _row("cloud-only-jpeg", 10.0, 1.0, model="random", trained=False),
        _row("tierflow", 50.0, 1.0, model="real"),
        _row("cloud-only-jpeg", 60.0, 1.0, model="real"),
    ]
    (entry,) = bench_fidelity.verdict(rows)
    assert entry["model"] == "real" and entry["holds"]


def test_section_reads_the_table() -> None:
    rows = [
        _row("tierflow-budget", 40.0, 0.99, cuts=(3, 10), device_ms=2.0, codec="int8+zstd"),
        _row("cloud-only-jpeg-q95", 60.0, 0.99),
    ]
    text = "\n".join(bench_fronts.section(rows, ["front_m.png"]))
    assert "![front_m.png](front_m.png)" in text
    assert "1.50x" in text and "cloud-only-jpeg-q95" in text


def test_trained_bottleneck_rows_compose_as_run_py_and_fold_the_fastest(tmp_path: Path) -> None:
    import json

    from benchmarks import bottleneck_trained
    from benchmarks.lib import emulation as emu

    point = {
        "at": "t",
        "channels": 8,
        "bits": 4,
        "bytes": 2500.0,
        "device_ms_here": 3.0,
        "zstd_ms_here": 0.1,
        "unzstd_ms_here": 0.05,
        "cloud_ms": 9.0,
        "fidelity": 0.9,
    }
    slower = {**point, "channels": 16, "bytes": 5000.0, "fidelity": 0.95}
    rows = bottleneck_trained.rows_for("m", [point, slower], 300, "real: views")
    assert len(rows) == 2 * len(emu.FULL_BANDWIDTHS)
    first = rows[0]
    links = emu.links_at(first["bandwidth_mbit"])
    wire = sum(2500.0 * 8 / link.rate_bps + link.rtt_s for link in links.values()) * 1e3
    assert first["p50_ms"] == pytest.approx(30.0 + 1.0 + 0.05 + wire + 9.0)
    assert first["trained_weights"] and first["fidelity_requests"] == 300
    assert first["fidelity_lower_95"] < 0.9 and first["device_ms_here"] == pytest.approx(3.1)
    path = tmp_path / "bt.json"
    path.write_text(json.dumps({"rows": rows}))
    folded = bench_fidelity.trained_bottleneck_rows(path)
    assert [r["bandwidth_mbit"] for r in folded] == sorted(emu.FULL_BANDWIDTHS)
    assert all(r["variant"].startswith("k=8 ") for r in folded)  # fewer bytes: faster
    assert bench_fidelity.trained_bottleneck_rows(tmp_path / "absent.json") == []
    # Each ImageNet classifier's run in its own file; every one is folded, model by model.
    other = bottleneck_trained.rows_for("n", [slower], 300, "real: views")
    (tmp_path / "bottleneck_trained-n.json").write_text(json.dumps({"rows": other}))
    path.rename(tmp_path / "bottleneck_trained.json")
    files = bench_fidelity.trained_bottleneck_files(tmp_path)
    assert [f.name for f in files] == ["bottleneck_trained.json", "bottleneck_trained-n.json"]
    both, _ = bench_fidelity.bottleneck_rows(tmp_path / "absent.json", trained=files)
    assert sorted({r["model"] for r in both}) == ["m", "n"]
    assert len(both) == 2 * len(emu.FULL_BANDWIDTHS)
    assert {r["variant"][:4] for r in both if r["model"] == "n"} == {"k=16"}


def test_goal_reasons_name_the_split_and_its_device_work() -> None:
    rows = [
        _row("cloud-only-jpeg", 90.0, 0.75),
        _row("tierflow-budget-90", 80.0, 0.93, cuts=(4, 10), device_ms=8.0),
        _row("tierflow-budget", 150.0, 0.99, cuts=(6, 10), device_ms=10.0),
        _row("tierflow-budget-95", 40.0, 0.60, cuts=(5, 10), device_ms=1.0),  # less faithful
        _row("cloud-only-jpeg", 10.0, 0.75, mbit=100.0),  # above 50 Mbit/s: not the goal
    ]
    (reason,) = bench_fronts.goal_reasons(rows)
    assert reason["needed_ms"] == pytest.approx(60.0)
    assert reason["split"] == "tierflow-budget-90" and reason["split_device_ms"] == 80.0
    assert reason["speedup"] == pytest.approx(90.0 / 80.0) and not reason["met"]
    rows[1] = _row("tierflow-budget-90", 50.0, 0.93, cuts=(4, 10), device_ms=3.0)
    (reason,) = bench_fronts.goal_reasons(rows)
    assert reason["met"] and reason["speedup"] == pytest.approx(1.8)


def test_the_split_that_gains_most_is_shown_not_the_fastest() -> None:
    rows = [
        # fastest split, but less faithful than a fast JPEG: it loses
        _row("tierflow-bottleneck", 90.0, 0.43, cuts=(2, 10), device_ms=5.0),
        _row("tierflow-budget-90", 150.0, 0.94, cuts=(4, 10), device_ms=8.0),
        _row("cloud-only-jpeg-q20", 60.0, 0.46),
        _row("cloud-only-png", 240.0, 1.0),
    ]
    (entry,) = bench_fronts.where_splits_pay(rows, (10.0,))
    assert entry["split"] == "tierflow-budget-90" and entry["upload"] == "cloud-only-png"
    assert entry["speedup"] == pytest.approx(1.6) and entry["pays"]


def test_accuracy_lines_give_the_exact_model_and_the_ranges() -> None:
    rows = [
        {**_row("tierflow", 50.0, 1.0), "accuracy": 0.62, "exact_accuracy": 0.62},
        {**_row("tierflow-budget-90", 40.0, 0.9), "accuracy": 0.58, "exact_accuracy": 0.62},
        {**_row("cloud-only-jpeg", 30.0, 0.8), "accuracy": 0.5, "exact_accuracy": 0.62},
        _row("tierflow", 10.0, 1.0, model="unlabelled"),
    ]
    (head, line, _) = bench_fronts.accuracy_lines(rows)
    assert "labels" in head
    assert line == "- **m**: exact model 0.620, tierflow's plans 0.580-0.620, uploads 0.500-0.500."
