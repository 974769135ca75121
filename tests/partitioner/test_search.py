"""The plan search on hand-made profiles: the decisions a planner must get right."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierflow.errors import PlanError
from tierflow.link.spec import LinkSpec
from tierflow.partitioner.cost import Problem, build_tables, estimate
from tierflow.partitioner.profile import Profile
from tierflow.partitioner.search import Admission, search

from .conftest import make_profile

UNITS = [0.010, 0.020, 0.020, 0.010]
CUTS = [150_000, 800_000, 200_000, 50_000, 4_000]  # input, shrinking features, output


def tiers(device: Profile, edge: float, cloud: float) -> dict[str, Profile]:
    return {"device": device, "edge": device.emulate(edge), "cloud": device.emulate(cloud)}


def links(de_bps: float, ec_bps: float, de_rtt: float = 0.01, ec_rtt: float = 0.03):
    return {"device-edge": LinkSpec(de_bps, de_rtt), "edge-cloud": LinkSpec(ec_bps, ec_rtt)}


def test_a_very_slow_device_link_keeps_everything_on_the_device() -> None:
    device = make_profile(UNITS, CUTS).emulate(4.0)
    problem = Problem(tiers(device, 0.25, 0.1), links(100e3, 1e9), codecs=("raw", "zstd"))
    result = search(problem)
    assert result.best.tiers == ("device",)
    assert result.best.cuts == (4, 4)
    assert result.baselines["device-only"].latency_s == result.best.latency_s


def test_fast_links_and_a_slow_device_move_the_work_up() -> None:
    device = make_profile(UNITS, CUTS).emulate(20.0)
    problem = Problem(tiers(device, 1.0, 0.5), links(1e9, 1e10, 0.001, 0.002))
    result = search(problem)
    assert result.best.tiers == ("cloud",)
    assert result.best.cuts == (0, 0)
    assert result.best.latency_s < result.baselines["device-only"].latency_s


def test_a_slow_first_link_makes_the_device_shrink_the_feature_first() -> None:
    # Cut 2 carries 50 kB against 150 kB of input, after two cheap units.
    device = make_profile([0.001, 0.001, 0.05, 0.05], [150_000, 800_000, 50_000, 40_000, 4_000])
    problem = Problem(tiers(device.emulate(2.0), 0.1, 0.1), links(10e6, 1e9, 0.0, 0.0))
    best = search(problem).best
    assert best.cuts == (2, 4)
    assert best.links["device-edge"].raw_bytes == 50_000


def test_auto_codec_picks_compression_on_a_slow_link_and_raw_on_a_fast_one() -> None:
    device = make_profile(UNITS, CUTS)
    problem = Problem(
        tiers(device, 1.0, 1.0),
        links(1e6, 1e10, 0.0, 0.0),
        codecs=("raw", "zstd", "int8+zstd"),
    )
    result = search(problem)
    # Cloud-only: the edge runs nothing and forwards the device's int8+zstd as it came.
    cloud_only = result.baselines["cloud-only"]
    assert cloud_only.codec == {"device-edge": "int8+zstd", "edge-cloud": "int8+zstd"}
    assert cloud_only.links["device-edge"].decode_s == 0.0
    assert cloud_only.links["edge-cloud"].encode_s == 0.0
    # Where the edge works, its fast link to the cloud goes raw.
    splits = [e for e in search(problem, top=15).ranked if e.cuts[0] < e.cuts[1] < 4]
    assert splits
    assert all(e.links["edge-cloud"].codec == "raw" for e in splits)


def test_memory_budget_forces_the_feature_off_the_device() -> None:
    device = make_profile(
        UNITS,
        [150_000, 800_000, 20_000, 10_000, 4_000],
        weights=[1000, 5000, 20000, 40000],
        peaks=[10] * 4,
    )
    problem = Problem(
        tiers(device.emulate(1.0), 1.0, 1.0), links(100e3, 1e9), memory={"device": 7000}
    )
    result = search(problem)
    assert result.best.memory_bytes["device"] <= 7000
    assert result.best.cuts[0] == 2
    assert not result.baselines["device-only"].feasible


def test_throughput_objective_picks_the_balanced_pipeline() -> None:
    # Three equal units, equal tiers, free links: the pipeline spreads them out.
    device = make_profile([0.01] * 3, [10, 10, 10, 10])
    problem = Problem(tiers(device, 1.0, 1.0), links(1e12, 1e12, 0.0, 0.0), objective="throughput")
    best = search(problem).best
    assert best.period_s == pytest.approx(0.01)
    assert best.cuts == (1, 2)
    latency_best = search(Problem(tiers(device, 1.0, 1.0), links(1e12, 1e12, 0.0, 0.0))).best
    assert latency_best.tiers == ("device",)  # all plans cost 0.03 s: ties keep data local


def test_ties_break_deterministically_towards_lower_tiers() -> None:
    device = make_profile([0.0] * 4, [10] * 5)
    problem = Problem(tiers(device, 1.0, 1.0), links(1e15, 1e15, 0.0, 0.0))
    first = search(problem, top=50)
    second = search(problem, top=50)
    assert [e.cuts for e in first.ranked] == [e.cuts for e in second.ranked]
    assert first.best.cuts == (4, 4)


def test_nothing_fits_names_the_smallest_need_and_the_budget() -> None:
    device = make_profile([0.01] * 3, [100, 100, 100, 10], weights=[4096] * 3, peaks=[1024] * 3)
    problem = Problem(
        tiers(device, 1.0, 1.0),
        links(1e6, 1e6),
        memory={"device": 1024, "edge": 1024, "cloud": 1024},
    )
    with pytest.raises(PlanError, match=r"no plan fits the memory budgets \(device 1KiB"):
        search(problem)
    with pytest.raises(PlanError, match=r"smallest need is device 5KiB, edge 5KiB, cloud 5KiB"):
        search(problem)


_profiles = st.integers(min_value=1, max_value=6).flatmap(
    lambda n: st.tuples(
        st.lists(st.floats(0.0, 0.1), min_size=n, max_size=n),
        st.lists(st.integers(1, 10**6), min_size=n + 1, max_size=n + 1),
        st.lists(st.integers(0, 10**6), min_size=n, max_size=n),
        st.lists(st.integers(0, 10**6), min_size=n, max_size=n),
    )
)


@settings(max_examples=60, deadline=None)
@given(
    spec=_profiles,
    speeds=st.tuples(st.floats(0.05, 10.0), st.floats(0.05, 10.0), st.floats(0.05, 10.0)),
    rates=st.tuples(st.floats(1e4, 1e10), st.floats(1e4, 1e10)),
    budget=st.one_of(st.none(), st.integers(1, 3 * 10**6)),
    objective=st.sampled_from(["latency", "throughput"]),
)
def test_search_equals_brute_force_and_respects_the_budget(
    spec, speeds, rates, budget, objective
) -> None:
    unit_s, cut_bytes, weights, peaks = spec
    base = make_profile(unit_s, cut_bytes, overhead_s=0.001, weights=weights, peaks=peaks)
    profiles = {
        t: base.emulate(s) for t, s in zip(("device", "edge", "cloud"), speeds, strict=True)
    }
    memory = {} if budget is None else {"device": budget, "edge": budget}
    problem = Problem(
        profiles,
        links(*rates),
        memory=memory,
        objective=objective,
        codecs=("raw", "zstd", "int8+zstd"),
    )
    tables = build_tables(problem)
    last = len(unit_s)
    brute = [
        estimate(tables, a, b, {"device-edge": c1, "edge-cloud": c2})
        for a, b in itertools.combinations_with_replacement(range(last + 1), 2)
        for c1, c2 in itertools.product(problem.codecs, repeat=2)
    ]
    feasible = [e for e in brute if e.feasible]
    if not feasible:
        with pytest.raises(PlanError):
            search(problem, tables=tables)
        return
    result = search(problem, tables=tables)
    for plan in result.ranked:
        assert plan.feasible
        for tier, limit in memory.items():
            assert plan.memory_bytes[tier] <= limit
    best = min(e.score(objective) for e in feasible)
    assert result.best.score(objective) == pytest.approx(best, rel=1e-9, abs=1e-12)
    scores = [e.score(objective) for e in result.ranked]
    # Ranked by score; scores within 1e-12 s count as ties (broken by the rules above).
    assert all(x <= y + 1e-12 for x, y in itertools.pairwise(scores))


def _admitted(admission: Admission, plan: Any, codecs: tuple[str, ...]) -> bool:
    """Brute-force reading of an admission: may ``plan`` use its codecs at its cuts?"""
    a, b = plan.cuts
    last = plan.last
    cols = {name: codecs.index(cost.codec) for name, cost in plan.links.items() if cost.used}
    if a == b < last:  # the edge forwards: one crossing, the device-edge codec
        cols = {"device-edge": cols["device-edge"]}
    for name, cut in (("device-edge", a), ("edge-cloud", b)):
        if name in cols and not admission.allowed[name][cut, cols[name]]:
            return False
    if (
        len(cols) == 2
        and admission.lossy[cols["device-edge"]]
        and admission.lossy[cols["edge-cloud"]]
    ):
        key = (a, cols["device-edge"], b, cols["edge-cloud"])
        return admission.pairs.get(key, admission.pairs_default) and a < last and b < last
    return True


@settings(max_examples=40, deadline=None)
@given(
    spec=_profiles,
    rates=st.tuples(st.floats(1e4, 1e9), st.floats(1e4, 1e9)),
    objective=st.sampled_from(["latency", "throughput"]),
    seed=st.integers(0, 2**32 - 1),
    pairs_default=st.booleans(),
)
def test_search_with_an_admission_equals_brute_force(
    spec, rates, objective, seed, pairs_default
) -> None:
    unit_s, cut_bytes, _, _ = spec
    base = make_profile(unit_s, cut_bytes, overhead_s=0.001)
    codecs = ("raw", "zstd", "int8+zstd")
    problem = Problem(tiers(base, 0.5, 0.25), links(*rates), objective=objective, codecs=codecs)
    tables = build_tables(problem)
    n = len(cut_bytes)
    rng = np.random.default_rng(seed)
    allowed = {name: rng.random((n, 3)) < 0.6 for name in ("device-edge", "edge-cloud")}
    for table in allowed.values():
        table[:, :2] = True  # lossless codecs are always allowed
        table[n - 1, :] = True  # the output cut carries nothing
    pairs = {(a, 2, b, 2): bool(rng.random() < 0.5) for a in range(n) for b in range(a, n)}
    admission = Admission(allowed, (False, False, True), pairs, pairs_default)
    brute = [
        estimate(tables, a, b, {"device-edge": c1, "edge-cloud": c2})
        for a, b in itertools.combinations_with_replacement(range(n), 2)
        for c1, c2 in itertools.product(codecs, repeat=2)
    ]
    admitted = [e for e in brute if _admitted(admission, e, codecs)]
    result = search(problem, tables=tables, admission=admission, top=20)
    for plan in result.ranked:
        assert _admitted(admission, plan, codecs), (plan.cuts, plan.codec)
    best = min(e.score(objective) for e in admitted)
    assert result.best.score(objective) == pytest.approx(best, rel=1e-9, abs=1e-12)
