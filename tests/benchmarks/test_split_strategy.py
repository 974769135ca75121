"""tierflow-split's device memory budget, the split goal's codec kinds, and folding one
model's rows from another run (``comparison/run.py --refold --fold-from``)."""

from __future__ import annotations

from typing import Any

import pytest

from tierflow.codec.base import CodecStats
from tierflow.link.spec import LinkSpec
from tierflow.partitioner.cost import Problem, build_tables
from tierflow.partitioner.profile import CutProfile, MachineInfo, Profile, UnitProfile
from tierflow.partitioner.search import search


def _profile(weights: list[int], peaks: list[int]) -> Profile:
    machine = MachineInfo("test", "cpu", 1, 1, 1.0, False, "0")
    cuts = tuple(
        CutProfile(i, i, (f"t{i}",), 4000, {"raw": CodecStats("raw", 1.0, 0.0, 0.0, 0.0)})
        for i in range(len(weights) + 1)
    )
    units = tuple(
        UnitProfile(i, 0.01, w, p) for i, (w, p) in enumerate(zip(weights, peaks, strict=True))
    )
    return Profile(machine, "model.onnx", "0" * 64, cuts, units, 0.0)


def test_device_budget_is_a_fraction_of_the_whole_model_and_rules_out_device_only() -> None:
    from benchmarks.comparison.strategies import device_memory_budget

    # A camera stem whose input peak dominates, then layers whose weights do.
    profile = _profile([600, 10_000, 400_000, 500_000], [600_000, 100_000, 50_000, 20_000])
    budget = device_memory_budget(profile)
    profiles = {t: profile for t in ("device", "edge", "cloud")}
    links = {
        "device-edge": LinkSpec(rate_bps=1e9, rtt_s=0.001),
        "edge-cloud": LinkSpec(rate_bps=1e9, rtt_s=0.001),
    }
    tables = build_tables(Problem(profiles=profiles, links=links, codecs=("raw",)))
    assert budget == int(0.5 * tables.memory["device"][0, 4])  # the cost model's own count
    assert budget == 755_300
    fitting = Problem(profiles=profiles, links=links, codecs=("raw",), memory={"device": budget})
    plans = {e.cuts for e in search(fitting, top=50).ranked}
    assert (4, 4) not in plans and max(a for a, _ in plans) == 2  # the first layers
    with pytest.raises(ValueError):
        device_memory_budget(profile, 1.0)


def _row(strategy: str, codec: dict[str, str], ms: float, fidelity: float = 1.0) -> dict[str, Any]:
    return {
        "model": "m",
        "bandwidth_mbit": 5.0,
        "strategy": strategy,
        "p50_ms": ms,
        "fidelity": fidelity,
        "cuts": [1, 9] if strategy != "cloud-only-jpeg" else [0, 0],
        "codec_used": codec,
        "trained_weights": True,
    }


def test_split_goal_counts_low_bit_and_learned_codecs_only() -> None:
    from benchmarks.comparison.fidelity import split_goal

    jpeg = _row("cloud-only-jpeg", {"device-edge": "jpeg:90", "edge-cloud": "jpeg:90"}, 60.0)
    fp16 = _row("tierflow-split", {"device-edge": "fp16"}, 20.0)
    goal = split_goal([jpeg, fp16])
    assert goal["best"] is None and not goal["met"]
    assert goal["best_other_lossy"]["codec_kind"] == "lossy"
    assert goal["best_other_lossy"]["speedup"] == pytest.approx(3.0)
    int2 = _row("tierflow-split", {"device-edge": "int2+zstd"}, 30.0)
    goal = split_goal([jpeg, fp16, int2])
    assert goal["met"] and goal["best"]["codec_kind"] == "low-bit"
    assert goal["best"]["speedup"] == pytest.approx(2.0)
    int2["fidelity"] = 0.98  # below the JPEG upload's fidelity: not at the same fidelity
    assert not split_goal([jpeg, fp16, int2])["met"]


def test_fold_models_takes_every_row_of_the_new_runs_models_and_names_the_run() -> None:
    from benchmarks.comparison.run import FOLDED, fold_models

    old = [
        {"model": "a", "strategy": "tierflow", "p50_ms": 1.0},
        {"model": "b", "strategy": "tierflow", "p50_ms": 2.0},
        {"model": "b", "strategy": "tierflow-exits", "p50_ms": 3.0},
        {"model": "b", "strategy": "tierflow-bottleneck", "measured": FOLDED},
    ]
    meta = {"command": "full", "date": "d0", "models": [{"name": "a"}, {"name": "b", "x": 0}]}
    new = [
        {"model": "b", "strategy": "tierflow", "p50_ms": 5.0},
        {"model": "b", "strategy": "tierflow-split", "p50_ms": 4.0},
        {"model": "b", "strategy": "tierflow-bottleneck", "measured": FOLDED},
    ]
    new_meta = {"command": "only b", "date": "d1", "models": [{"name": "b", "x": 1}]}
    rows, data = fold_models(old, meta, new, new_meta)
    assert [(r["model"], r["strategy"], r["p50_ms"]) for r in rows] == [
        ("a", "tierflow", 1.0),
        ("b", "tierflow", 5.0),
        ("b", "tierflow-split", 4.0),
    ]
    assert data["models"] == [{"name": "a"}, {"name": "b", "x": 1}]
    assert data["model_runs"] == {
        "a": {"command": "full", "date": "d0"},
        "b": {"command": "only b", "date": "d1"},
    }
    with pytest.raises(ValueError):
        fold_models(old, meta, [], {"command": "x", "date": "d", "models": []})


def test_a_model_new_to_the_run_is_folded_in_at_its_place_in_the_suite() -> None:
    from benchmarks.comparison.run import fold_models

    old = [{"model": m, "strategy": "tierflow"} for m in ("efficientnet-lite0", "minilm-topics")]
    meta = {
        "command": "full",
        "date": "d0",
        "models": [{"name": "efficientnet-lite0"}, {"name": "minilm-topics"}],
    }
    new = [{"model": "mobilenet-v2", "strategy": "tierflow"}]
    new_meta = {"command": "one", "date": "d1", "models": [{"name": "mobilenet-v2"}]}
    rows, data = fold_models(old, meta, new, new_meta)
    expected = ["efficientnet-lite0", "mobilenet-v2", "minilm-topics"]
    assert [m["name"] for m in data["models"]] == expected
    assert [r["model"] for r in rows] == expected


def test_label_rows_fills_what_a_row_lacks_from_its_model() -> None:
    from benchmarks.comparison.run import is_folded, label_rows

    rows: list[dict[str, Any]] = [
        {"model": "real", "strategy": "tierflow-exits"},
        {"model": "random", "strategy": "tierflow-exits"},
        {"model": "real", "strategy": "tierflow", "trained_weights": False},  # kept
        {"model": "other", "strategy": "x"},  # no model entry: left alone
    ]
    models = [
        {"name": "real", "trained": True, "input_source": "real: photos"},
        {"name": "random", "trained": False, "input_source": "synthetic: noise"},
    ]
    label_rows(rows, models)
    assert rows[0]["trained_weights"] and not rows[0]["timing_only"]
    assert rows[0]["input_source"] == "real: photos"
    assert not rows[1]["trained_weights"] and rows[1]["timing_only"]
    assert rows[2]["trained_weights"] is False and "timing_only" not in rows[2]
    assert "trained_weights" not in rows[3]
    assert is_folded({"measured": "composed by bottleneck_trained.py"})
    assert not is_folded({"measured": "composed"})


def test_a_trained_models_exit_rows_stand_on_300_distinct_requests_in_a_full_run() -> None:
    """Issue 21, part 4: the tierflow-exits rows of trained models carry fidelity, so a full
    run walks as many distinct held-out requests as the model's other rows (it walked 15)."""
    import argparse

    from benchmarks.comparison.run import TRAINED_FIDELITY_REQUESTS, exit_workload_size, parse_args
    from benchmarks.lib import models

    full, quick = parse_args([]), parse_args(["--quick"])
    suite = {m.name: m for m in models.suite(quick=False)}
    assert TRAINED_FIDELITY_REQUESTS == 300
    for name in ("efficientnet-lite0", "mobilenet-v2", "minilm-topics", "digits-camera"):
        assert exit_workload_size(suite[name], full) == 300
        assert exit_workload_size(suite[name], quick) == 8  # --quick: 5 requests, at least 8
    assert exit_workload_size(suite["demo-digits"], full) == full.exit_requests == 300
    assert exit_workload_size(suite["resnet18"], full) == 15  # random: time only
    more = argparse.Namespace(**{**vars(full), "requests": 400})
    assert exit_workload_size(suite["mobilenet-v2"], more) == 400


def test_a_refold_takes_transport_from_transport_bench_once() -> None:
    from benchmarks.comparison.run import _transport_again
    from benchmarks.lib import RESULTS

    if not (RESULTS / "transport.json").is_file():
        pytest.skip("no saved transport run in benchmarks/results/")
    heading = "### Transport overhead per hop and pipelined throughput"
    kept = f"## Overheads and limits\n\n{heading}\n\nold figures\n\n### Codec ratio\n\nkept\n"
    extras: dict[str, Any] = {"transport": {"overhead": []}}
    again = _transport_again(kept, extras)
    assert "old figures" not in again
    assert "tierflow / relay" in again
    assert again.endswith("\n\n### Codec ratio\n\nkept\n")
    assert "date" in extras["transport"]
    assert _transport_again(again, extras) == again


def test_a_refold_draws_every_appended_section_once_from_its_json() -> None:
    from benchmarks.comparison.report import tenancy_section
    from benchmarks.comparison.run import without_appended_sections
    from benchmarks.lib import RESULTS

    kept = (
        "## Overheads and limits\n\nkept\n\n<!-- generation:start -->\nold\n"
        "<!-- tenancy-bench: start -->\nold\n<!-- tenancy-bench: end -->\n"
    )
    assert without_appended_sections(kept) == "## Overheads and limits\n\nkept\n"
    # The earliest mark cuts, whichever comes first in the text.
    late = "kept\n<!-- tenancy-bench: start -->\nx\n<!-- rate-fidelity:start -->\ny\n"
    assert without_appended_sections(late) == "kept\n"
    assert without_appended_sections("kept\n") == "kept\n"
    if not (RESULTS / "tenancy.json").is_file():
        pytest.skip("no saved tenancy run in benchmarks/results/")
    # Drawn again from tenancy.json, the section is the one the run wrote into RESULTS.md.
    drawn = "\n".join(tenancy_section()[1:])
    written = (RESULTS / "RESULTS.md").read_text()
    start = written.index("<!-- tenancy-bench: start -->")
    end = written.index("<!-- tenancy-bench: end -->") + len("<!-- tenancy-bench: end -->")
    assert drawn == written[start:end]
