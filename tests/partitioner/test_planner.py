"""The planner glue: profiles + search -> split, verified, plan directory on disk."""

from __future__ import annotations

from typing import Any

import pytest

from tierflow.link.spec import LinkSpec
from tierflow.partitioner.graph import ModelGraph, load_model
from tierflow.partitioner.plan_options import PlanOptions
from tierflow.partitioner.planner import make_plan
from tierflow.partitioner.profile import Profile, profile_model
from tierflow.partitioner.tier_profiles import complete_profiles
from tierflow.plan import load_plan

pytestmark = pytest.mark.integration

_CACHE: dict[str, tuple[ModelGraph, Profile]] = {}


def _setup(zoo_exports: Any, name: str = "resnet18") -> tuple[ModelGraph, Profile]:
    if name not in _CACHE:
        graph = load_model(zoo_exports.path(name, dynamo=False))
        _CACHE[name] = (graph, profile_model(graph, time_budget_s=1.0))
    return _CACHE[name]


def _links(de: str, ec: str) -> dict[str, LinkSpec]:
    return {"device-edge": LinkSpec.parse(de), "edge-cloud": LinkSpec.parse(ec)}


def test_plan_directory_is_valid_and_matches_the_ranking(zoo_exports: Any, tmp_path: Any) -> None:
    graph, base = _setup(zoo_exports)
    profiles = {"device": base.emulate(4.0), "edge": base, "cloud": base.emulate(0.5)}
    options = PlanOptions(links=_links("20mbit,10ms", "200mbit,30ms"), codec="auto")
    outcome = make_plan(graph, profiles, options, tmp_path / "plan")
    plan = load_plan(tmp_path / "plan")
    best = outcome.result.best
    assert outcome.verified_bitwise is True
    assert plan.model_sha256 == graph.sha256
    assert [s.tier for s in plan.segments] == list(best.tiers)
    assert plan.estimate["latency_s"] == pytest.approx(best.latency_s)
    assert set(plan.estimate["compute_s"]) == {"device", "edge", "cloud"}
    assert plan.estimate["verified"]["bitwise_equal"] is True
    assert plan.cuts == tuple(graph.cuts[c].position for c in best.cuts)
    assert plan.links["device-edge"].rate_bps == 20e6
    for name, codec in best.codec.items():
        assert plan.codec[name] == codec
    assert set(outcome.result.baselines) == {"device-only", "edge-only", "cloud-only"}


def test_memory_budget_holds_on_the_real_segment(zoo_exports: Any, tmp_path: Any) -> None:
    graph, base = _setup(zoo_exports)
    profiles = {"device": base, "edge": base, "cloud": base}
    total = graph.weight_bytes(0, len(graph.cuts) - 1)
    budget = total // 3
    options = PlanOptions(links=_links("1kbit,10ms", "1kbit,10ms"), memory={"device": budget})
    outcome = make_plan(graph, profiles, options, tmp_path / "plan")
    a = outcome.result.best.cuts[0]
    assert 0 < a < len(graph.cuts) - 1  # the slow link wants all on the device; memory says no
    assert graph.weight_bytes(0, a) + graph.peak_activation_bytes(0, a) <= budget
    assert outcome.plan.segments[0].tier == "device"


def test_a_codec_missing_from_the_profiles_is_measured(zoo_exports: Any, tmp_path: Any) -> None:
    graph, base = _setup(zoo_exports, "chain_cnn")
    profiles = {"device": base.emulate(2.0), "edge": base, "cloud": base}
    options = PlanOptions(links=_links("1mbit,1ms", "1mbit,1ms"), codec="zstd:9", verify=False)
    outcome = make_plan(graph, profiles, options, tmp_path / "plan")
    assert outcome.notes and "zstd:9" in outcome.notes[0]
    assert set(outcome.plan.codec.values()) <= {"zstd:9", "raw"}
    assert outcome.verified_bitwise is None


def test_missing_tiers_are_profiled_here_and_emulated(zoo_exports: Any) -> None:
    graph, base = _setup(zoo_exports, "chain_cnn")
    profiles, notes = complete_profiles(
        graph, {"device": base}, emulation={"edge": 3.0, "cloud": 1.0}, time_budget_s=0.5
    )
    assert profiles["device"] is base
    assert profiles["edge"].machine.emulated and profiles["edge"].slowdown == 3.0
    assert not profiles["cloud"].machine.emulated
    assert len(notes) == 2 and "edge" in notes[0] and "3x slower" in notes[0]
