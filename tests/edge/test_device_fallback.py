"""Device fallback: with the edge gone the device answers alone, then uses the edge again.

The edge is called in process ([Note: the next tier in process] in
tierflow/runtime/upstream.py) where it is only stopped or closed; an edge that cannot be
reached, or is killed mid-stream and comes back, runs as a process.

See [Note: device fallback] in device/fallback.py.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tierflow.device.client import DeviceClient
from tierflow.errors import TransportError
from tierflow.onnxrt.inference import open_session
from tierflow.plan import Plan, PlanSet, SegmentSpec, load_plan, save_plan, save_plan_set


def _with_device_only_plan(split: Any) -> Plan:
    """Add a plan running the whole model on the device to the split's directory."""
    split_plan = load_plan(split.plan_dir)
    whole = SegmentSpec("device", split_plan.model_file, split_plan.inputs, split_plan.outputs)
    alone = Plan(
        split_plan.model_file,
        split_plan.model_sha256,
        split_plan.inputs,
        split_plan.outputs,
        (whole,),
    )
    save_plan_set(PlanSet((split_plan, alone)), split.plan_dir)
    return alone


@pytest.mark.parametrize("how", ["stopping", "closed"])
def test_the_device_answers_alone_while_the_edge_is_down(tmp_path: Path, rt: Any, how: str) -> None:
    split = rt.cnn(tmp_path / "plan", {"device-edge": "raw", "edge-cloud": "raw"})
    alone = _with_device_only_plan(split)
    samples = split.sample(seed=31, count=6)
    with rt.in_process(split.plan_dir) as tiers, tiers.device(window=1) as device:
        assert device.fallback_plan == alone
        before = [device.infer(feeds) for feeds in samples[:3]]
        if how == "stopping":  # answers UNAVAILABLE ("stopping") from now on
            assert tiers.edge.drain(0.0)
        else:  # known down: nothing is sent
            tiers.edge.close()
        during = [device.submit(feeds).result() for feeds in samples[3:6]]
    assert all(r.answered_by == "cloud" and not r.fallback for r in before)
    for feeds, result in zip(samples[3:6], during, strict=True):
        result.unwrap()
        assert result.fallback and result.answered_by == "device"
        assert result.plan == alone.plan_id
        assert result.fallback_reason is not None and "the edge is unavailable (" in (
            result.fallback_reason
        )
        assert result.bytes == {"device-edge": 0, "edge-cloud": 0}
        np.testing.assert_array_equal(result.outputs["y"], split.reference(feeds)["y"])
        assert result.to_dict()["fallback"] is True


@pytest.mark.parametrize("how", ["stopping", "closed"])
def test_without_a_device_only_plan_requests_fail(tmp_path: Path, rt: Any, how: str) -> None:
    split = rt.cnn(tmp_path / "plan", {"device-edge": "raw", "edge-cloud": "raw"})
    with rt.in_process(split.plan_dir) as tiers, tiers.device(deadline_s=10.0) as device:
        assert device.fallback_plan is None
        if how == "stopping":
            assert tiers.edge.drain(0.0)
        else:
            tiers.edge.close()
        result = device.submit(split.sample(seed=32)[0]).result()
    assert isinstance(result.error, TransportError) and not result.fallback
    assert "edge" in str(result.error)


@pytest.mark.integration
def test_killing_the_edge_mid_stream_turns_the_rest_into_device_answers(
    tmp_path: Path, rt: Any
) -> None:
    split = rt.cnn(tmp_path / "plan", {"device-edge": "raw", "edge-cloud": "raw"})
    alone = _with_device_only_plan(split)
    samples = split.sample(seed=33, count=24)

    def stream(edge: Any) -> Iterator[dict[str, np.ndarray]]:
        for i, feeds in enumerate(samples):
            if i == 8:
                edge.kill()  # SIGKILL, mid-stream: requests are in flight
            yield feeds

    with rt.processes() as start:
        cloud = start("cloud", split.plan_dir)
        edge = start("edge", split.plan_dir, "--upstream", cloud.address)
        with DeviceClient(split.plan_dir, edge.address, window=4, deadline_s=10.0) as device:
            results = list(device.run_stream(stream(edge)))
            start("edge", split.plan_dir, "--upstream", cloud.address, listen=edge.address)
            for _ in range(200):  # the channel reconnects within its backoff
                back = device.submit(samples[0]).result()
                if not back.fallback:
                    break
                time.sleep(0.05)
    assert [r.id for r in results] == [str(i) for i in range(len(samples))]  # one answer each
    for feeds, result in zip(samples, results, strict=True):
        result.unwrap()
        np.testing.assert_array_equal(result.outputs["y"], split.reference(feeds)["y"])
    assert all(r.answered_by == "cloud" and not r.fallback for r in results[:4])
    late = results[8:]  # sent after the kill
    assert all(r.fallback and r.answered_by == "device" and r.plan == alone.plan_id for r in late)
    assert all(r.fallback_reason and "edge" in r.fallback_reason for r in late)
    assert back.answered_by == "cloud" and not back.fallback


def test_without_a_device_only_plan_a_device_exit_answers(tmp_path: Path, rt: Any) -> None:
    # The exit head runs on the device (threshold 1: never confident); the cloud the rest.
    split = rt.cnn(tmp_path / "plan", {"device-edge": "raw", "edge-cloud": "raw"}, 1.0)
    conv1, conv2, head = load_plan(split.plan_dir).segments
    ours = dataclasses.replace(
        load_plan(split.plan_dir), segments=(conv1, dataclasses.replace(conv2, tier="device"), head)
    )
    save_plan(ours, split.plan_dir)
    first = open_session(split.plan_dir / conv1.file)
    second = open_session(split.plan_dir / conv2.file)
    samples = split.sample(seed=34, count=4)
    with rt.in_process(split.plan_dir) as tiers, tiers.device(deadline_s=10.0) as device:
        assert device.fallback_plan is None
        before = device.submit(samples[0]).result()
        tiers.edge.close()
        during = [device.submit(feeds).result() for feeds in samples[1:]]
    assert before.answered_by == "cloud" and not before.fallback
    for feeds, result in zip(samples[1:], during, strict=True):
        result.unwrap()
        assert (result.answered_by, result.exit, result.fallback) == ("device", "exit_edge", True)
        assert result.fallback_reason is not None and "edge" in result.fallback_reason
        (h1,) = first.run(["h1"], feeds)
        (scores,) = second.run(["exit_edge"], {"h1": h1})
        np.testing.assert_array_equal(result.outputs["exit_edge"], scores)
