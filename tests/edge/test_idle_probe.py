"""Idle probes: an idle device keeps its device-edge estimate fresh, a busy one never probes.

See [Note: idle probes] in device/probing.py.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import grpc
import onnx.utils
import pytest

from tierflow.device.client import DeviceClient
from tierflow.device.probing import MAX_PROBE_BYTES, MIN_PROBE_BYTES, IdleProber, probe_size
from tierflow.link.spec import LinkSpec
from tierflow.link.trace import LinkTrace, TraceStep
from tierflow.options import RuntimeOptions
from tierflow.plan import Plan, PlanSet, SegmentSpec, load_plan, save_plan_set


def _plan_set(split: Any) -> tuple[Plan, Plan]:
    """The cnn's split, best at 200 Mbit/s, and one sending 32 bytes, best at 2 Mbit/s."""
    directory = split.plan_dir
    base = load_plan(directory)
    model = str(directory / base.model_file)
    onnx.utils.extract_model(model, str(directory / "pool.onnx"), ["h2"], ["f"])
    onnx.utils.extract_model(model, str(directory / "head.onnx"), ["f"], ["y"])
    conv1, conv2, _ = base.segments
    fast_links = {"device-edge": LinkSpec(200e6, 0.02)}
    fast = Plan(*_common(base), base.segments, links=fast_links, codec=base.codec)
    slow_segments = (
        conv1,
        SegmentSpec("device", conv2.file, conv2.inputs, conv2.outputs),
        SegmentSpec("device", "pool.onnx", ("h2",), ("f",)),
        SegmentSpec("cloud", "head.onnx", ("f",), ("y",)),
    )
    slow = Plan(*_common(base), slow_segments, codec=base.codec)
    regions = (({"device-edge": LinkSpec(200e6, 0.02)},), ({"device-edge": LinkSpec(2e6, 0.02)},))
    save_plan_set(PlanSet((fast, slow), regions), directory)
    return fast, slow


def _common(plan: Plan) -> tuple[str, str, tuple[str, ...], tuple[str, ...]]:
    return plan.model_file, plan.model_sha256, plan.inputs, plan.outputs


def _rate(device: DeviceClient) -> float:
    return device.estimators["device-edge"].estimate().rate_bps


def test_probe_sizes_are_bounded() -> None:
    assert probe_size(0.0) == MIN_PROBE_BYTES
    assert probe_size(2e6) == 5000  # 20 ms at 2 Mbit/s
    assert probe_size(1e12) == MAX_PROBE_BYTES


@pytest.mark.integration
def test_an_idle_device_learns_a_rate_drop_from_probes_and_a_busy_one_never_probes(
    tmp_path: Path, rt: Any
) -> None:
    split = rt.cnn(tmp_path / "plan", {"device-edge": "raw", "edge-cloud": "raw"})
    fast, slow = _plan_set(split)
    # The link drops 100x a moment after it opens; no request crosses it then.
    trace = LinkTrace((TraceStep(0, LinkSpec(200e6, 0.02)), TraceStep(0.3, LinkSpec(2e6, 0.02))))
    options = RuntimeOptions(links={"device-edge": trace})
    samples = split.sample(seed=61, count=100)
    with (
        rt.tiers(split.plan_dir) as (edge, _, _),
        DeviceClient(split.plan_dir, edge, options=options, window=1, idle_probe_s=0.15) as device,
    ):
        assert device.prober is not None and _rate(device) == 200e6  # the plan's link
        first = device.infer(samples[0])
        assert first.plan == fast.plan_id
        ends = time.monotonic() + 10.0
        while _rate(device) > 2.4e6 and time.monotonic() < ends:
            time.sleep(0.05)
        assert _rate(device) == pytest.approx(2e6, rel=0.2)  # learnt from probes alone
        assert device.prober.probes >= 1 and device.prober.failures == 0
        time.sleep(0.6)  # past the selector's hold, still idle
        # Busy: requests back to back for 1 s and more (each waits 10 ms to cross the link).
        started = time.monotonic()
        results = list(device.run_stream(samples[1:]))
        busy_s = time.monotonic() - started
        last = device.prober.last_started
        assert last is not None and last < started  # none began while requests flowed
    assert busy_s > 4 * device.prober.idle_s
    assert results[0].plan == slow.plan_id  # the first request after the pause switched
    assert results[0].switch is not None and all(r.ok for r in results)


def test_probes_back_off_while_the_link_stays_idle() -> None:
    with grpc.insecure_channel("127.0.0.1:9") as channel:  # never used: nothing started
        prober = IdleProber(
            channel, busy=lambda: False, rate=lambda: 1e6, report=lambda *_: None, idle_s=1.0
        )
        assert [prober.interval(n) for n in range(7)] == [1, 2, 4, 8, 16, 30, 30]


@pytest.mark.integration
def test_a_device_answering_alone_keeps_probing_and_sees_the_link_recover(
    tmp_path: Path, rt: Any
) -> None:
    split = rt.cnn(tmp_path / "plan", {"device-edge": "raw", "edge-cloud": "raw"})
    base = load_plan(split.plan_dir)
    fast = Plan(*_common(base), base.segments, codec=base.codec)
    alone = tuple(SegmentSpec("device", s.file, s.inputs, s.outputs) for s in base.segments)
    local = Plan(*_common(base), alone, codec=base.codec)
    regions = (({"device-edge": LinkSpec(200e6, 0.02)},), ({"device-edge": LinkSpec(2e6, 0.02)},))
    save_plan_set(PlanSet((fast, local), regions), split.plan_dir)
    # Slow from 0.3 s (the device goes local: nothing crosses), fast again from 2 s.
    steps = [(0.0, 200e6), (0.3, 2e6), (2.0, 200e6)]
    trace = LinkTrace(tuple(TraceStep(t, LinkSpec(rate, 0.02)) for t, rate in steps))
    options = RuntimeOptions(links={"device-edge": trace})
    sample = split.sample(seed=62, count=1)[0]
    with (
        rt.tiers(split.plan_dir) as (edge, _, _),
        DeviceClient(split.plan_dir, edge, options=options, window=1, idle_probe_s=0.2) as device,
    ):
        assert device.prober is not None
        opened = time.monotonic()
        results = []
        while time.monotonic() - opened < 3.6:
            results.append(device.infer(sample))
            time.sleep(0.05)
        probes = device.prober.probes
    plans = [r.plan for r in results]
    went = plans.index(local.plan_id)  # the slow link sent it local
    assert fast.plan_id in plans[went:]  # and probes showed it the link was back
    # Local from about 0.9 s to 2.5 s: probes 0.2 s apart. Backing off (0.2, 0.4, 0.8,
    # 1.6 s after the last transfer) would have seen the recovery only at about 3.9 s.
    assert probes >= 5
