"""Link estimates and the per-request plan choice: tracks a step, does not flap, says why."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import replace

import pytest

from tierflow.device.switching import (
    LinkEstimator,
    PlanSelector,
    backlog_s,
    predicted_s,
    rate_ceiling,
)
from tierflow.errors import UsageError
from tierflow.link.spec import LinkSpec
from tierflow.plan import Plan, PlanSet, SegmentSpec

EC = LinkSpec(1e9, 0.03)


def _plan(tier: str) -> Plan:
    return Plan(
        model_file="m.onnx",
        model_sha256="a" * 64,
        inputs=("x",),
        outputs=("y",),
        segments=(SegmentSpec(tier, f"seg-{tier}.onnx", ("x",), ("y",)),),
    )


def _point(rate: float) -> dict[str, LinkSpec]:
    return {"device-edge": LinkSpec(rate, 0.01), "edge-cloud": EC}


def _set() -> PlanSet:
    """Plan 0 (device) below 10 Mbit/s device-edge, plan 1 (edge) from 10 Mbit/s up."""
    slow = tuple(_point(r) for r in (1e6, 2e6, 5e6))
    fast = tuple(_point(r) for r in (10e6, 20e6, 50e6, 100e6, 200e6))
    return PlanSet((_plan("device"), _plan("edge")), (slow, fast), default=1)


def test_the_estimate_tracks_a_rate_step_within_20_percent_after_a_second() -> None:
    estimator = LinkEstimator(LinkSpec(200e6, 0.01))
    t = 0.0
    for _ in range(20):  # 200 Mbit/s: 100 kB take 4 ms
        estimator.observe(t, 100_000, 0.004)
        t += 0.05
    assert estimator.estimate().rate_bps == pytest.approx(200e6, rel=0.01)
    step = t
    while t < step + 1.0:  # then 2 Mbit/s: 100 kB take 0.4 s
        estimator.observe(t, 100_000, 0.4)
        t += 0.1
    assert estimator.estimate().rate_bps == pytest.approx(2e6, rel=0.2)


def test_one_odd_transfer_moves_the_estimate_only_a_little() -> None:
    estimator = LinkEstimator(LinkSpec(20e6, 0.01))
    for i in range(50):
        estimator.observe(i * 0.01, 10_000, 0.004)  # 20 Mbit/s
    estimator.observe(0.5, 10_000, 0.4)  # one stall, 100x slower
    assert estimator.estimate().rate_bps > 10e6
    estimator.observe(0.6, 0, 1.0)  # nothing sent: no information
    estimator.observe(0.6, 10_000, 0.0)
    assert math.isfinite(estimator.estimate().rate_bps)
    estimator.observe_rtt(0.7, 0.05)
    assert 0.01 < estimator.estimate().rtt_s <= 0.05


def test_the_selector_switches_after_the_hold_and_says_why() -> None:
    selector = PlanSelector(_set(), hold_s=0.5)
    assert selector.current == 1  # the set's default
    assert not selector.choose(0.0, _point(100e6)).switched
    assert not selector.choose(1.0, _point(2e6)).switched  # a new candidate: hold
    assert not selector.choose(1.4, _point(2e6)).switched
    choice = selector.choose(1.6, _point(2e6))
    assert choice.switched and choice.index == 0 == selector.current
    assert "device-edge 2mbit,10ms" in choice.reason and "plan 0" in choice.reason
    # And back when the link recovers.
    selector.choose(2.0, _point(150e6))
    assert selector.choose(2.6, _point(150e6)).index == 1


def test_an_estimate_near_the_border_does_not_flap() -> None:
    selector = PlanSelector(_set(), hold_s=0.0)
    # 7 and 8 Mbit/s sit between the regions (5 and 10 Mbit/s): never clearly better.
    switches = sum(
        selector.choose(i * 0.1, _point(7e6 if i % 2 else 8e6)).switched for i in range(100)
    )
    assert switches == 0 and selector.current == 1
    # A candidate that stops being better before the hold ends resets the hold.
    selector = PlanSelector(_set(), hold_s=0.5)
    selector.choose(0.0, _point(1e6))
    selector.choose(0.3, _point(100e6))
    assert not selector.choose(0.6, _point(1e6)).switched
    assert selector.choose(1.1, _point(1e6)).switched


def test_a_set_of_one_never_switches_and_bad_settings_are_usage_errors() -> None:
    selector = PlanSelector(PlanSet((_plan("device"),)))
    assert selector.choose(5.0, _point(1e3)) == selector.choose(9.0, _point(1e9))
    assert selector.current == 0
    with pytest.raises(UsageError):
        PlanSelector(_set(), margin=-1)
    with pytest.raises(UsageError):
        LinkEstimator(LinkSpec(1e6), half_life_s=0)


def test_a_switch_that_needs_a_fetch_waits_the_fetch_time_longer() -> None:
    """Plan 0's device segment is 1 MB away: at 2 Mbit/s that adds 4 s to the hold."""
    selector = PlanSelector(_set(), hold_s=0.5)
    slow = _point(2e6)
    fetch = [1_000_000, 0]
    assert not selector.choose(0.0, slow, fetch).switched
    assert selector.candidate == 0  # the device fetches its segments meanwhile
    assert not selector.choose(4.4, slow, fetch).switched  # 0.5 s + 4 s not yet over
    assert selector.choose(4.6, slow, fetch).switched
    assert selector.candidate is None
    # Once the segments are here, only the hold is left.
    again = PlanSelector(_set(), hold_s=0.5)
    again.choose(0.0, slow, fetch)
    assert again.choose(0.6, slow, [0, 0]).switched


def test_far_outside_the_current_plans_region_the_hold_is_short() -> None:
    """Plan 1 covers 10-200 Mbit/s: 0.5 Mbit/s is 1.3 decades off, 2 Mbit/s only 0.7."""
    far = PlanSelector(_set(), hold_s=0.5, far=1.0, far_hold_s=0.1)
    assert not far.choose(0.0, _point(0.5e6)).switched  # still one look to confirm it
    assert far.choose(0.15, _point(0.5e6)).switched
    near = PlanSelector(_set(), hold_s=0.5, far=1.0, far_hold_s=0.1)
    near.choose(0.0, _point(2e6))
    assert not near.choose(0.15, _point(2e6)).switched  # near the border: the full hold
    assert near.choose(0.55, _point(2e6)).switched
    with pytest.raises(UsageError):
        PlanSelector(_set(), margin=0.1, far=0.05)
    with pytest.raises(UsageError):
        PlanSelector(_set(), far_hold_s=-1.0)
    assert PlanSelector(_set(), hold_s=0.05).far_hold_s == 0.05  # never longer than the hold


def _fast_estimator() -> LinkEstimator:
    estimator = LinkEstimator(LinkSpec(200e6, 0.03))
    for i in range(20):  # 200 Mbit/s: 150 kB take 6 ms
        estimator.observe(i * 0.2, 150_000, 0.006)
    return estimator


def test_an_upload_that_outlives_its_expectation_lowers_the_estimate_at_once() -> None:
    estimator = _fast_estimator()
    # The link dropped to 2 Mbit/s at 4.0 s: the upload started then is still crossing
    # 0.4 s later, when an answer takes 0.1 s once a request has crossed.
    ceiling = rate_ceiling(4.4, [(150_000, 4.0)], answer_s=0.1)
    assert ceiling == pytest.approx(150_000 * 8 / 0.3)  # 4 Mbit/s: at most that
    estimator.bound(ceiling)
    assert estimator.estimate().rate_bps == pytest.approx(4e6)
    # The selector sees the drop now, not once the slow uploads are answered.
    selector = PlanSelector(_set())
    assert not selector.choose(
        4.4, {"device-edge": estimator.estimate(), "edge-cloud": EC}
    ).switched
    choice = selector.choose(4.9, {"device-edge": estimator.estimate(), "edge-cloud": EC})
    assert choice.switched and choice.index == 0


def test_an_upload_within_its_expectation_says_nothing() -> None:
    estimator = _fast_estimator()
    # 6 ms on the link and 0.1 s for the answer: 0.05 s out is nothing unusual, nor is
    # an upload that has not begun to cross yet (queued behind another).
    in_flight = [(150_000, 3.95), (150_000, 4.2)]
    ceiling = rate_ceiling(4.0, in_flight, answer_s=0.1)
    assert ceiling is None
    estimator.bound(ceiling)
    assert estimator.estimate().rate_bps == pytest.approx(200e6, rel=0.01)
    # Out for its 6 ms upload and its answer's 0.1 s: the bound (240 Mbit/s) is above
    # the measured rate and does not raise it.
    estimator.bound(rate_ceiling(4.105, [(150_000, 4.0)], answer_s=0.1))
    assert estimator.estimate().rate_bps == pytest.approx(200e6, rel=0.01)


def test_completed_transfers_still_set_the_rate_under_a_bound() -> None:
    estimator = _fast_estimator()
    estimator.bound(4e6)
    # The bound is kept apart: the measured mean is untouched by it.
    assert estimator.measured().rate_bps == pytest.approx(200e6, rel=0.01)
    for i in range(10):  # the uploads come back: 2 Mbit/s measured
        estimator.observe(5.0 + i * 0.2, 150_000, 0.6)
    estimator.bound(None)  # nothing unanswered for too long any more
    assert estimator.estimate().rate_bps == pytest.approx(2e6, rel=0.2)
    # And when the link recovers, measurements raise the estimate past an old bound's value.
    for i in range(10):
        estimator.observe(8.0 + i * 0.2, 150_000, 0.006)
    assert estimator.estimate().rate_bps == pytest.approx(200e6, rel=0.2)
    estimator.bound(math.inf)  # no bound: ignored
    estimator.bound(-1.0)
    assert estimator.estimate() == estimator.measured()


def test_the_hold_counts_from_when_the_current_plan_stopped_fitting() -> None:
    """A falling estimate crosses the middle plan's region on its way to the slow one."""
    regions = (
        tuple(_point(r) for r in (1e6, 2e6)),
        tuple(_point(r) for r in (5e6, 10e6)),
        tuple(_point(r) for r in (20e6, 50e6, 100e6, 200e6)),
    )
    plans = PlanSet((_plan("device"), _plan("edge"), _plan("cloud")), regions, default=2)
    selector = PlanSelector(plans, hold_s=0.5, far=1.0, far_hold_s=0.1)
    assert not selector.choose(0.0, _point(8e6)).switched  # near: plan 1 waits its hold
    assert selector.candidate == 1
    choice = selector.choose(0.2, _point(1e6))  # far now, and beaten for 0.2 s already
    assert choice.switched and choice.index == 0
    # An estimate back inside the current region ends the wait.
    selector = PlanSelector(plans, hold_s=0.5)
    selector.choose(0.0, _point(8e6))
    selector.choose(0.3, _point(100e6))
    assert selector.candidate is None
    assert not selector.choose(0.6, _point(8e6)).switched  # the hold starts again


# [Note: a backlog on the link] in device/switching.py


def test_the_backlog_is_what_a_fifo_link_still_has_to_send_at_the_estimated_rate() -> None:
    # Two 250 kB uploads handed over at 0 s and 0.1 s, at 2 Mbit/s: 1 s each, one after
    # the other, so the link is busy until 2 s.
    queued = [(250_000, 0.1, None), (250_000, 0.0, 0.0)]
    assert backlog_s(0.5, queued, 2e6) == pytest.approx(1.5)
    assert backlog_s(2.5, [(250_000, 0.1, 1.0), (250_000, 0.0, 0.0)], 2e6) == 0.0
    # An upload handed over after the link went idle starts then, not at the first's end.
    assert backlog_s(3.0, [(250_000, 0.0, 0.0), (25_000, 2.9, 2.9)], 2e6) == pytest.approx(0.0)
    assert backlog_s(2.95, [(250_000, 0.0, 0.0), (25_000, 2.9, 2.9)], 2e6) == pytest.approx(0.05)
    assert backlog_s(0.5, [], 2e6) == 0.0
    assert backlog_s(0.5, queued, 0.0) == 0.0  # no rate known: no claim


def test_an_upload_not_yet_crossing_shows_the_link_busy_whatever_the_rate() -> None:
    # At 20 Mbit/s the first 250 kB would have crossed by 0.1 s; the second has not begun
    # at 0.4 s, so the link is still busy: it needs at least its own 0.1 s from now.
    queued = [(250_000, 0.0, 0.0), (250_000, 0.05, None)]
    assert backlog_s(0.4, queued, 20e6) == pytest.approx(0.1)
    # Once it has begun (at 0.35 s), it is done 0.1 s after that.
    assert backlog_s(0.4, [(250_000, 0.0, 0.0), (250_000, 0.05, 0.35)], 20e6) == pytest.approx(0.05)


def _priced(tier: str, latency_s: float, wire_s: float, rate: float = 20e6) -> Plan:
    """A plan with the cost model's figures at ``rate`` device-edge (``wire_s`` of it)."""
    links = {"device-edge": {"wire_s": wire_s}} if wire_s else {}
    return replace(
        _plan(tier),
        links={"device-edge": LinkSpec(rate, 0.01), "edge-cloud": EC},
        estimate={"latency_s": latency_s, "links": links},
    )


def _priced_set() -> PlanSet:
    """Plan 0 runs alone in 300 ms; plan 1 sends 45 kB (18 ms at 20 Mbit/s) and takes 100 ms
    at 20 Mbit/s, 262 ms at 2 Mbit/s; its region covers 2-200 Mbit/s, plan 0's 0.5 Mbit/s."""
    local = _priced("device", 0.300, 0.0)
    remote = _priced("edge", 0.100, 0.018)
    regions = ((_point(0.5e6),), tuple(_point(r) for r in (2e6, 5e6, 20e6, 200e6)))
    return PlanSet((local, remote), regions, default=1)


def test_predictions_rescale_the_wire_time_to_the_estimated_rate() -> None:
    plans = _priced_set()
    assert predicted_s(plans.plans[1], _point(20e6)) == pytest.approx(0.100)
    assert predicted_s(plans.plans[1], _point(2e6)) == pytest.approx(0.100 + 0.018 * 9)
    assert predicted_s(plans.plans[0], _point(2e6)) == pytest.approx(0.300)
    assert predicted_s(_plan("edge"), _point(2e6)) is None  # no figures recorded


def test_a_backlog_detours_requests_to_a_plan_off_the_link_until_it_drains() -> None:
    selector = PlanSelector(_priced_set())
    slow = _point(2e6)  # plan 1: 262 ms on an idle link, plan 0: 300 ms
    assert selector.choose(0.0, slow).index == 1
    # 30 ms of queued uploads: 292 ms, still the faster ...
    assert selector.choose(0.1, slow, backlog=0.030).index == 1
    # ... 0.6 s are not: plan 1 would answer in 862 ms.
    choice = selector.choose(0.2, slow, backlog=0.6)
    assert choice.index == 0 and choice.detour and not choice.switched
    assert "backlog" in choice.reason and "plan 0" in choice.reason
    assert selector.current == 1 and selector.detour == 0  # not a switch: a detour
    again = selector.choose(0.4, slow, backlog=0.4)
    assert again.index == 0 and again.detour and again.reason == ""  # named once
    back = selector.choose(0.8, slow, backlog=0.0)
    assert back.index == 1 and not back.detour and "drained" in back.reason
    assert selector.detour is None
    assert selector.choose(1.0, slow).reason == ""


def test_a_backlog_shorter_than_the_gain_keeps_the_plan() -> None:
    selector = PlanSelector(_priced_set())
    fast = _point(20e6)  # plan 1: 100 ms; 190 ms behind a backlog still beat 300 ms
    assert selector.choose(0.0, fast, backlog=0.190).index == 1
    choice = selector.choose(0.1, fast, backlog=0.210)  # 310 ms: now alone is faster
    assert choice.index == 0 and choice.detour


def test_no_detour_to_a_plan_that_needs_a_fetch_or_without_predictions() -> None:
    selector = PlanSelector(_priced_set())
    # Plan 0's files would come over the backlogged link itself.
    assert selector.choose(0.0, _point(2e6), [1_000, 0], backlog=1.0).index == 1
    unpriced = PlanSelector(_set())  # plans without the cost model's figures
    assert unpriced.choose(0.0, _point(20e6), backlog=5.0).index == 1
    # A plan already off the link has nothing to wait for.
    local = PlanSelector(_priced_set())
    local.choose(0.0, _point(0.1e6))
    assert local.choose(0.2, _point(0.1e6)).index == 0
    assert not local.choose(0.3, _point(0.1e6), backlog=5.0).detour


# The estimate's change detector: see [Note: a change detector in the estimate] in
# device/switching.py.


def test_two_transfers_off_the_same_way_restart_the_estimate() -> None:
    def settled(jump: float | None) -> LinkEstimator:
        estimator = LinkEstimator(LinkSpec(20e6, 0.03), jump=jump)
        for i in range(10):  # 20 Mbit/s: 50 kB take 20 ms
            estimator.observe(i * 0.2, 50_000, 0.02)
        return estimator

    detecting, plain = settled(2.0), settled(None)
    for estimator in (detecting, plain):  # then 4 Mbit/s: 50 kB take 0.1 s
        estimator.observe(2.0, 50_000, 0.1)
    # The first moves both halfway in log space (one half-life after the last) ...
    assert detecting.estimate().rate_bps == pytest.approx(math.sqrt(20e6 * 4e6))
    assert plain.estimate().rate_bps == pytest.approx(math.sqrt(20e6 * 4e6))
    for estimator in (detecting, plain):
        estimator.observe(2.2, 50_000, 0.1)
    # ... the second, still more than 2x off the same way, is taken as the new rate.
    assert detecting.estimate().rate_bps == pytest.approx(4e6)
    assert plain.estimate().rate_bps > 1.45 * 4e6  # without: still 50% off
    with pytest.raises(UsageError):
        LinkEstimator(LinkSpec(1e6), jump=1.0)


def test_noise_scattering_both_ways_and_one_odd_transfer_do_not_restart_it() -> None:
    estimator = LinkEstimator(LinkSpec(20e6, 0.03), jump=2.0)
    estimator.observe(0.0, 50_000, 0.02)  # 20 Mbit/s
    for i in range(1, 40):  # then 3x below, 3x above, in turn
        seconds = 0.02 * 3 if i % 2 else 0.02 / 3
        estimator.observe(i * 0.2, 50_000, seconds)
        assert 8e6 < estimator.estimate().rate_bps < 50e6
    # One stall, 100x slower, then the old rate again: as without the detector.
    estimates = []
    for jump in (2.0, None):
        steady = LinkEstimator(LinkSpec(20e6, 0.03), jump=jump)
        for i in range(10):
            steady.observe(i * 0.2, 50_000, 0.02)
        steady.observe(2.0, 50_000, 2.0)
        steady.observe(2.2, 50_000, 0.02)
        estimates.append(steady.estimate().rate_bps)
    assert estimates[0] == pytest.approx(estimates[1]) and estimates[0] > 5e6


# The priced hold: see [Note: a hold priced by the cost model] in device/switching.py.


def _costed_set(remote_s: float) -> PlanSet:
    """Plan 0 runs alone in 300 ms; plan 1 is predicted ``remote_s`` at 0.7 Mbit/s (it sends
    2.5 kB: 1 ms at 20 Mbit/s); their regions are 0.5-1 and 2-200 Mbit/s."""
    local = _priced("device", 0.300, 0.0)
    remote = _priced("edge", remote_s - 0.001 * (20 / 0.7 - 1), 0.001)
    regions = (
        tuple(_point(r) for r in (0.5e6, 1e6)),
        tuple(_point(r) for r in (2e6, 5e6, 20e6, 200e6)),
    )
    return PlanSet((local, remote), regions, default=1)


def _switched_at(
    selector: PlanSelector, rates: Sequence[float], every: float = 0.05, bounded: bool = False
) -> float:
    """When ``selector`` leaves its plan, choosing every ``every`` s on these estimates
    (censored bounds if ``bounded``)."""
    for i, rate in enumerate(rates):
        if selector.choose(i * every, _point(rate), bounded=bounded).switched:
            return round(i * every, 3)
    return math.inf


def test_the_hold_ends_sooner_the_more_the_current_plan_is_predicted_to_lose() -> None:
    slow = [0.7e6] * 20  # 0.46 decade below plan 1's region: not far, the full hold is 0.5 s
    assert predicted_s(_costed_set(0.6).plans[1], _point(0.7e6)) == pytest.approx(0.6)

    def hold(remote_s: float, costly: float | None = 0.05) -> float:
        return _switched_at(PlanSelector(_costed_set(remote_s), costly=costly), slow)

    assert hold(0.600) == 0.1  # 100% slower: the short hold (two choices)
    assert hold(0.336) == 0.25  # 12% slower: 0.025 / 0.12 = 0.21 s, at the next choice
    assert hold(0.309) == 0.5  # 3% slower: the full hold
    assert hold(0.280) == 0.5  # faster, by the cost model: the regions still decide
    assert hold(0.600, costly=None) == 0.5  # not priced: the full hold
    unpriced = replace(_costed_set(0.6), plans=(_plan("device"), _plan("edge")))
    assert _switched_at(PlanSelector(unpriced), slow) == 0.5  # plans without predictions
    with pytest.raises(UsageError):
        PlanSelector(_set(), costly=0.0)


def test_a_bound_that_shows_the_current_plan_costly_switches_at_the_first_choice() -> None:
    """[Note: a bound needs no second look] in device/switching.py."""
    slow = [0.7e6] * 20  # plan 1 (sends 2.5 kB) is current; plan 0 sends nothing

    def hold(remote_s: float, bounded: bool, costly: float | None = 0.05) -> float:
        selector = PlanSelector(_costed_set(remote_s), costly=costly)
        return _switched_at(selector, slow, bounded=bounded)

    assert hold(0.600, bounded=True) == 0.0  # 100% slower at the bound: no second look
    assert hold(0.600, bounded=False) == 0.1  # an estimate from transfers: two choices
    assert hold(0.336, bounded=True) == 0.25  # 12% slower: priced as before
    assert hold(0.600, bounded=True, costly=None) == 0.5  # not priced: the full hold
    # A bound never speeds a switch to a plan that sends more over the link: below the
    # bound, that plan loses more, so the excess at the bound is not the least it costs.
    to_remote = replace(_costed_set(0.1), default=0)  # plan 0 is 3x slower at 50 Mbit/s
    assert _switched_at(PlanSelector(to_remote), [50e6] * 20, bounded=True) == 0.1


def test_the_estimate_says_whether_it_is_a_bound() -> None:
    estimator = LinkEstimator(LinkSpec(20e6, 0.01))
    assert not estimator.bounded
    estimator.bound(2e6)
    assert estimator.bounded and estimator.estimate().rate_bps == 2e6
    estimator.bound(50e6)  # above the mean of completed transfers: no bound in effect
    assert not estimator.bounded and estimator.estimate().rate_bps == pytest.approx(20e6)
    estimator.bound(None)
    assert not estimator.bounded


def test_one_odd_estimate_adds_only_the_smaller_excess_to_the_loss() -> None:
    steady = [0.7e6] * 20  # plan 1 12% slower than plan 0
    odd = [0.7e6, 0.25e6, *steady]  # 0.25 Mbit/s once: plan 1 5x slower, 0.9 decade off
    assert _switched_at(PlanSelector(_costed_set(0.336)), odd) == 0.25
    assert _switched_at(PlanSelector(_costed_set(0.336)), steady) == 0.25


def _replay(
    trace: Sequence[tuple[float, float]],
    until: float,
    costly: float | None = 0.05,
    jump: float | None = 2.0,
) -> list[int]:
    """The plan of a request every 0.1 s on a link whose rate steps as ``trace`` says.

    Plan 1 sends 45 kB, seen by the estimate 20 ms after it crosses; a request on plan 0
    sends nothing, and a 4 KiB probe 0.25 s later takes its place (as the device's idle
    probes do). Deterministic: the time is an argument throughout.
    """
    estimator = LinkEstimator(LinkSpec(20e6, 0.01), jump=jump)
    selector = PlanSelector(_priced_set(), costly=costly)

    def rate(t: float) -> float:
        return [r for at, r in trace if at <= t][-1]

    seen: list[tuple[float, int, float]] = []  # when the estimate learns: (time, bytes, s)
    used = []
    for i in range(round(until / 0.1)):
        now = i * 0.1
        for item in sorted(s for s in seen if s[0] <= now):
            estimator.observe(*item)
            seen.remove(item)
        index = selector.choose(now, {**_point(1e6), "device-edge": estimator.estimate()}).index
        used.append(index)
        nbytes = 45_000 if index == 1 else 4096
        start = now if index == 1 else now + 0.25
        seconds = nbytes * 8 / rate(start)
        seen.append((start + seconds + 0.02, nbytes, seconds))
    return used


def test_a_replayed_drop_and_recovery_switches_once_each_way_and_sooner_when_priced() -> None:
    trace = [(0.0, 20e6), (1.0, 0.4e6), (3.0, 20e6)]
    priced = _replay(trace, 5.0)
    plain = _replay(trace, 5.0, costly=None, jump=None)
    for used in (priced, plain):
        runs = [used[0]] + [b for a, b in itertools.pairwise(used) if a != b]
        assert runs == [1, 0, 1]  # both ways, no flapping
    # The first 45 kB at 0.4 Mbit/s is seen at 1.92 s; plan 1 is then predicted 3x slower
    # than plan 0 (982 against 300 ms), so the priced hold leaves it after two choices.
    assert priced.index(0) == 21 and plain.index(0) == 25
    # Back up, plan 0 is predicted 3x slower; the probes' 4 KiB at 20 Mbit/s are 50x off.
    assert priced.index(1, 21) == 33 and plain.index(1, 25) == 36


def test_transfers_outside_physical_bounds_leave_the_estimate_alone() -> None:
    """Issue 28 finding 5: a reply's 2^62 link bytes moved the device's estimate."""
    estimator = LinkEstimator(LinkSpec(20e6, 0.01))
    before = estimator.estimate()
    for nbytes, seconds in [
        (2**62, 0.001),  # 2^62 bytes: no message is that large
        (10**9, 1e-9),  # 8e18 bit/s
        (1000, float("nan")),
        (1000, float("inf")),
        (1000, 1e308),
        (1000, -1.0),
        (1, 1e5),  # below a bit per second
        (-5, 0.01),
    ]:
        estimator.observe(1.0, nbytes, seconds)
    estimator.observe_rtt(1.0, 1e308)
    estimator.observe_rtt(1.0, float("nan"))
    assert estimator.estimate() == before
    estimator.observe(2.0, 25_000, 0.01)  # 20 Mbit/s: within bounds, counted
    assert estimator.measured().rate_bps == pytest.approx(20e6)
