"""The device's plan choice from what its links do ([Note: switching plans on the device]),
on a fake clock: answers feed the estimates, an idle probe's figures switch the plan and
the next request names it, an upload left unanswered lowers the estimate at once.

No channel, no thread: the stream is absent (there is nothing to send), replies are
futures completed by the test, and the clock moves only when the test moves it.
"""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace

import pytest

from tierflow.device import adaptation
from tierflow.device.adaptation import Adaptation
from tierflow.link.emulation import Transfer
from tierflow.link.spec import LinkSpec
from tierflow.plan import Plan, PlanSet, SegmentSpec
from tierflow.rpc import tier_pb2
from tierflow.runtime.segment_store import SegmentStore
from tierflow.transport.stream_client import Sent

EC = LinkSpec(1e9, 0.03)
DEVICE, EDGE = 0, 1


class _Clock:
    def __init__(self) -> None:
        self.now = 500.0

    def monotonic(self) -> float:
        return self.now


def _plan(tier: str) -> Plan:
    return Plan(
        model_file="m.onnx",
        model_sha256="a" * 64,
        inputs=("x",),
        outputs=("y",),
        segments=(SegmentSpec(tier, f"seg-{tier}.onnx", ("x",), ("y",)),),
    )


def _plans() -> PlanSet:
    """Plan 0 (the device alone) below 10 Mbit/s device-edge, plan 1 (the edge) above."""

    def point(rate: float) -> dict[str, LinkSpec]:
        return {"device-edge": LinkSpec(rate, 0.01), "edge-cloud": EC}

    slow = tuple(point(r) for r in (1e6, 2e6, 5e6))
    fast = tuple(point(r) for r in (10e6, 20e6, 50e6, 100e6, 200e6))
    return PlanSet((_plan("device"), _plan("edge")), (slow, fast), default=EDGE)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    fake = _Clock()
    monkeypatch.setattr(adaptation, "time", fake)
    return fake


def _adaptation(tmp_path: Path, answers: list[tier_pb2.Reply] | None = None) -> Adaptation:
    plans = _plans()
    return Adaptation(
        plans,
        SegmentStore(tmp_path, plans, tier="device"),
        SimpleNamespace(),  # type: ignore[arg-type]  # a stream is there; nothing is sent
        adaptive=True,
        idle_probe_s=None,
        on_answer=(answers if answers is not None else []).append,
    )


def _upload(at: float, nbytes: int, rate_bps: float | None, wire_id: str) -> Sent:
    """A request handed to the device-edge link at ``at``; crossed at ``rate_bps`` (None:
    still on its way)."""
    transfer = Transfer(nbytes, queued=at, started=at, handed=True)
    if rate_bps is not None:
        transfer.left = at + nbytes * 8 / rate_bps
    return Sent(Future(), transfer, wire_id)


def test_answers_feed_each_links_estimate_from_what_crossed_it(
    tmp_path: Path, clock: _Clock
) -> None:
    answers: list[tier_pb2.Reply] = []
    device = _adaptation(tmp_path, answers)
    assert device.choose() == (EDGE, None)
    for n in range(30):  # a request every 50 ms: 100 kB at 40 Mbit/s up, 1 MB at 80 down
        sent = _upload(clock.now, 100_000, 40e6, f"r{n}")
        device.sent(sent)
        clock.now += 0.05
        up = tier_pb2.LinkStat(link="edge-cloud", bytes=1_000_000, send_ms=100.0, rate_bps=80e6)
        sent.future.set_result(tier_pb2.Reply(id=sent.wire_id, links=[up]))
    assert len(answers) == 30
    assert device.estimators["device-edge"].estimate().rate_bps == pytest.approx(40e6, rel=0.02)
    assert device.estimators["edge-cloud"].estimate().rate_bps == pytest.approx(80e6, rel=0.02)
    assert device.choose() == (EDGE, None)  # 40 Mbit/s is the edge plan's region


def test_a_failed_request_feeds_no_estimate(tmp_path: Path, clock: _Clock) -> None:
    answers: list[tier_pb2.Reply] = []
    device = _adaptation(tmp_path, answers)
    before = device.estimators["device-edge"].estimate()
    sent = _upload(clock.now, 100_000, 1e6, "lost")
    device.sent(sent)
    clock.now += 1.0
    sent.future.set_exception(RuntimeError("the edge went away"))
    assert answers == [] and device.estimators["device-edge"].estimate() == before


def test_an_idle_probe_that_sees_a_drop_switches_and_the_next_request_says_so(
    tmp_path: Path, clock: _Clock
) -> None:
    device = _adaptation(tmp_path)
    assert device.choose() == (EDGE, None)
    for _ in range(10):  # probes 0.25 s apart find 2 Mbit/s: 64 KiB in 0.26 s
        clock.now += 0.25
        device._probed(clock.now, 65_536, 65_536 * 8 / 2e6, 0.02)
    assert device.estimators["device-edge"].estimate().rate_bps == pytest.approx(2e6, rel=0.2)
    clock.now += 0.01
    index, why = device.choose()
    assert index == DEVICE
    assert why is not None and why.startswith("idle probe: ")
    assert device.choose() == (DEVICE, None)  # named once, by the first request after it


def test_an_upload_unanswered_for_too_long_lowers_the_estimate_at_once(
    tmp_path: Path, clock: _Clock
) -> None:
    """At 200 Mbit/s a 1 MB upload crosses in 40 ms and is answered 10 ms later; one out
    for 2 s has crossed at 8 Mbit over at most 2 s less 1.5 times that 10 ms."""
    device = _adaptation(tmp_path)
    for n in range(10):
        sent = _upload(clock.now, 1_000_000, 200e6, f"r{n}")
        device.sent(sent)
        clock.now += 0.05
        sent.future.set_result(tier_pb2.Reply(id=sent.wire_id))
    assert device.choose() == (EDGE, None)
    stuck = _upload(clock.now, 1_000_000, None, "stuck")
    device.sent(stuck)
    clock.now += 2.0  # no answer: about 4 Mbit/s at most, whatever the mean says
    assert device.choose() == (EDGE, None)  # the device plan's region is closer: the hold starts
    estimate = device.estimators["device-edge"].estimate()
    assert device.estimators["device-edge"].bounded
    assert estimate.rate_bps == pytest.approx(8e6 / (2.0 - 1.5 * 0.01))
    assert device.candidate() == (EDGE, DEVICE)
    clock.now += 0.6  # still unanswered past the hold (no cost model in these plans)
    index, why = device.choose()
    assert index == DEVICE and why
