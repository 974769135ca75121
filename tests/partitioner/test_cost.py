"""The cost model on hand-made profiles: no models, no clocks."""

from __future__ import annotations

import pytest

from tierflow.errors import PlanError, ProfileError
from tierflow.link.spec import LinkSpec
from tierflow.partitioner.cost import Problem, build_tables, estimate
from tierflow.partitioner.profile import Profile
from tierflow.partitioner.search import search

LINKS = {"device-edge": LinkSpec(8e6, 0.010), "edge-cloud": LinkSpec(80e6, 0.030)}
RAW = {"device-edge": "raw", "edge-cloud": "raw"}


def three(profile: Profile, edge: float = 1.0, cloud: float = 1.0) -> dict[str, Profile]:
    return {"device": profile, "edge": profile.emulate(edge), "cloud": profile.emulate(cloud)}


def test_segment_time_is_overhead_plus_units(profile_factory) -> None:
    profile = profile_factory([0.1, 0.2, 0.3], [1000, 500, 200, 40], overhead_s=0.01)
    assert profile.segment_s(0, 3) == pytest.approx(0.61)
    assert profile.segment_s(1, 2) == pytest.approx(0.21)
    assert profile.segment_s(2, 2) == 0.0


def test_segment_time_counts_the_outputs_it_hands_back(profile_factory) -> None:
    base = profile_factory([0.1, 0.2, 0.3], [1000, 500, 200, 40], overhead_s=0.01)
    profile = Profile(**{**base.__dict__, "output_s_per_byte": 1e-6})
    assert profile.segment_s(0, 1) == pytest.approx(0.01 + 0.1 + 500e-6)
    assert profile.segment_s(1, 3) == pytest.approx(0.01 + 0.5 + 40e-6)
    assert profile.emulate(2.0).segment_s(1, 3) == pytest.approx(2 * (0.01 + 0.5 + 40e-6))
    assert Profile.from_dict(profile.to_dict()) == profile
    tables = build_tables(Problem(three(profile), LINKS))
    assert tables.segment_s["device"][0, 1] == pytest.approx(profile.segment_s(0, 1))
    assert tables.segment_s["edge"][1, 3] == pytest.approx(profile.segment_s(1, 3))


def test_device_only_pays_no_link_and_cloud_only_the_full_round_trip(profile_factory) -> None:
    profile = profile_factory([0.1, 0.2, 0.3], [1000, 500, 200, 40])
    tables = build_tables(Problem(three(profile), LINKS, codecs=("raw",)))
    device_only = estimate(tables, 3, 3, {})
    assert device_only.latency_s == pytest.approx(0.6)
    assert all(not cost.used for cost in device_only.links.values())
    assert device_only.codec == {}
    assert device_only.tiers == ("device",)

    cloud_only = estimate(tables, 0, 0, RAW)
    assert cloud_only.tiers == ("cloud",)
    # input up and answer back on both links, each with a full RTT.
    expected_links = (1000 + 40) * 8 / 8e6 + 0.010 + (1000 + 40) * 8 / 80e6 + 0.030
    assert cloud_only.latency_s == pytest.approx(0.6 + expected_links)
    assert cloud_only.links["device-edge"].raw_bytes == 1000
    assert cloud_only.links["edge-cloud"].raw_bytes == 1000


def test_breakdown_adds_up_to_the_latency(profile_factory) -> None:
    profile = profile_factory([0.1, 0.2, 0.3], [10**6, 5 * 10**5, 2 * 10**5, 40], overhead_s=0.005)
    problem = Problem(three(profile, edge=0.5, cloud=0.25), LINKS, codecs=("raw", "zstd"))
    result = estimate(build_tables(problem), 1, 2, {"device-edge": "zstd", "edge-cloud": "raw"})
    assert result.compute_s["device"] == pytest.approx(0.105)
    assert result.compute_s["edge"] == pytest.approx(0.005 * 0.5 + 0.1)
    assert result.compute_s["cloud"] == pytest.approx((0.005 + 0.3) * 0.25)
    de = result.links["device-edge"]
    assert de.bytes == pytest.approx(2.5e5)  # zstd ratio 2 on 500 kB
    assert de.encode_s == pytest.approx(0.5 * 0.01)  # on the device's speed
    assert de.decode_s == pytest.approx(0.5 * 0.005 * 0.5)  # on the edge's (2x faster)
    parts = sum(result.compute_s.values()) + sum(c.total_s for c in result.links.values())
    assert result.latency_s == pytest.approx(parts)
    assert result.codec == {"device-edge": "zstd", "edge-cloud": "raw"}


def test_an_edge_that_runs_nothing_costs_one_encode_and_one_decode(profile_factory) -> None:
    profile = profile_factory([0.1, 0.2, 0.3], [10**6, 5 * 10**5, 2 * 10**5, 40], overhead_s=0.005)
    problem = Problem(three(profile, edge=0.5, cloud=0.25), LINKS, codecs=("raw", "zstd"))
    tables = build_tables(problem)
    # The edge forwards the device's zstd: codec["edge-cloud"] is not read.
    for a in (0, 1, 2):
        result = estimate(tables, a, a, {"device-edge": "zstd", "edge-cloud": "raw"})
        de, ec = result.links["device-edge"], result.links["edge-cloud"]
        assert result.codec == {"device-edge": "zstd", "edge-cloud": "zstd"}
        assert de.decode_s == 0.0 and ec.encode_s == 0.0  # nothing on the edge
        assert de.encode_s == pytest.approx(profile.cuts[a].nbytes / 1e6 * 0.01)  # device's
        assert ec.decode_s == pytest.approx(profile.cuts[a].nbytes / 1e6 * 0.005 * 0.25)
        assert de.bytes == ec.bytes == pytest.approx(profile.cuts[a].nbytes / 2)
        parts = sum(result.compute_s.values()) + de.total_s + ec.total_s
        assert result.compute_s["edge"] == 0.0
        assert result.latency_s == pytest.approx(parts)
    # The search scores such plans the same way: its cloud-only baseline is this estimate.
    searched = search(problem).baselines["cloud-only"]
    by_hand = min(
        (estimate(tables, 0, 0, {"device-edge": c}) for c in problem.codecs),
        key=lambda e: e.latency_s,
    )
    assert searched.latency_s == pytest.approx(by_hand.latency_s)
    assert searched.codec == by_hand.codec


def test_throughput_period_is_the_slowest_stage(profile_factory) -> None:
    profile = profile_factory([0.1, 0.2, 0.3], [1000, 500, 200, 40])
    tables = build_tables(Problem(three(profile), LINKS, objective="throughput"))
    result = estimate(tables, 1, 2, RAW)
    assert result.period_s == pytest.approx(0.3)
    assert result.throughput_rps == pytest.approx(1 / 0.3)
    assert result.latency_s > result.period_s


def test_memory_budget_marks_plans_infeasible(profile_factory) -> None:
    profile = profile_factory(
        [0.1, 0.2, 0.3], [1000, 500, 200, 40], weights=[100, 200, 300], peaks=[50, 80, 10]
    )
    tables = build_tables(Problem(three(profile), LINKS, memory={"device": 400}))
    assert estimate(tables, 2, 3, RAW).memory_bytes["device"] == 100 + 200 + 80
    assert estimate(tables, 2, 3, RAW).feasible
    assert not estimate(tables, 3, 3, RAW).feasible
    assert estimate(tables, 0, 0, RAW).memory_bytes["device"] == 0


def test_problem_rejects_mismatched_profiles_and_unknown_codecs(profile_factory) -> None:
    device = profile_factory([0.1, 0.2], [100, 50, 10])
    other = profile_factory([0.1, 0.2], [100, 50, 10], sha256="f" * 64)
    with pytest.raises(PlanError, match="another model"):
        Problem({"device": device, "edge": other, "cloud": device}, LINKS)
    with pytest.raises(PlanError, match="fp16"):
        Problem(three(device), LINKS, codecs=("raw", "fp16"))
    with pytest.raises(PlanError, match="cuts must satisfy"):
        estimate(build_tables(Problem(three(device), LINKS)), 2, 1, RAW)


def test_profile_round_trips_and_emulation_scales_times(profile_factory) -> None:
    profile = profile_factory([0.1, 0.2], [100, 50, 10], overhead_s=0.01)
    assert Profile.from_dict(profile.to_dict()) == profile
    slow = profile.emulate(4.0)
    assert slow.machine.emulated and slow.slowdown == 4.0
    assert slow.segment_s(0, 2) == pytest.approx(4 * 0.31)
    assert slow.cuts[1].codecs["zstd"].encode_s_per_mb == pytest.approx(0.04)
    assert slow.emulate(1.0).segment_s(0, 2) == pytest.approx(0.31)
    with pytest.raises(ProfileError, match="format"):
        Profile.from_dict({**profile.to_dict(), "format": "x"})
    with pytest.raises(ProfileError, match="units"):
        Profile.from_dict({**profile.to_dict(), "units": profile.to_dict()["units"][:1]})
