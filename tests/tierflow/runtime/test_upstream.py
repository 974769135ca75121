"""The next tier up, one object for the device and the edge: over gRPC, or in process
([Note: the next tier in process] in tierflow/runtime/upstream.py)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from tierflow.codec.spec import CodecSpec
from tierflow.errors import SegmentError, TransportError
from tierflow.link.spec import LinkSpec
from tierflow.options import RuntimeOptions
from tierflow.plan import Plan, PlanSet, load_plan_set, save_plan
from tierflow.rpc import tier_pb2
from tierflow.runtime.pipeline import Down, Onward, Pipeline, up
from tierflow.runtime.replies import Send
from tierflow.runtime.tier import Tier
from tierflow.runtime.upstream import LocalUpstream, StreamUpstream, connect, segment_source
from tierflow.transport.peer_warnings import WARNINGS
from tierflow.transport.stream_client import Sent
from tierflow.transport.wire import decode_tensors, put_tensors

from ...tiny_plans import matmul_chain


@pytest.mark.integration  # a real channel, whose close waits for its threads
@pytest.mark.parametrize(
    ("me", "peer", "link"), [("device", "edge", "device-edge"), ("edge", "cloud", "edge-cloud")]
)
def test_a_tier_connects_to_the_next_over_the_link_between_them(
    me: str, peer: str, link: str
) -> None:
    spec = LinkSpec.parse("10mbps")
    options = RuntimeOptions(links={link: spec}, max_message_bytes=5 << 20)
    stream = connect("127.0.0.1:1", me=me, peer=peer, options=options)  # nothing listens
    try:
        assert (stream.me, stream.peer, stream.address) == (me, peer, "127.0.0.1:1")
        assert stream.shaper is not None
        assert stream.shaper.name == link and stream.shaper.spec == spec
        assert stream.max_message_bytes == 5 << 20
        source = segment_source(stream)
        assert source.peer == peer
    finally:
        stream.close()
    upstream = StreamUpstream("127.0.0.1:1", me=me, peer=peer, options=options)
    try:
        assert upstream.stream is not None and upstream.segment_source() is not None
        assert (upstream.peer, upstream.address) == (peer, "127.0.0.1:1")
    finally:
        upstream.close()


@pytest.fixture
def edge(tmp_path: Path) -> Iterator[Tier]:
    """An edge that answers the second of two identity MatMuls, loaded, in this process."""
    specs = matmul_chain(tmp_path, [("device", "device.onnx"), ("edge", "edge.onnx")])
    plan = Plan("m.onnx", "0" * 64, ("x",), ("y",), tuple(specs))
    save_plan(plan, tmp_path)
    tier = Tier("edge", PlanSet((plan,)), tmp_path, options=RuntimeOptions(workers=1))
    tier.load()
    yield tier
    tier.close()


def _request(tier: Tier, value: float) -> tier_pb2.Request:
    request = tier_pb2.Request(plan_id=tier.plan_id, segment=1)
    h = np.full((1, 4), value, np.float32)
    put_tensors(request.tensors, {"h": h}, CodecSpec.parse("raw"))
    return request


def test_a_request_in_process_gets_the_next_tiers_reply(edge: Tier) -> None:
    upstream = LocalUpstream(edge, me="device")
    called: list[Sent] = []
    request = _request(edge, 2.0)
    sent = upstream.submit(request, on_reply=called.append)
    assert sent.future.done() and called == [sent]
    reply = sent.future.result()
    assert reply.id == request.id == sent.wire_id and reply.answered_by == "edge"
    np.testing.assert_array_equal(decode_tensors(reply.outputs)["y"], np.full((1, 4), 2.0))
    assert [t.tier for t in reply.timings] == ["edge"]
    # A second request gets an id of its own; the link's figures are the bytes handed over.
    again = upstream.submit(_request(edge, 3.0), nbytes=16)
    assert again.wire_id != sent.wire_id
    assert again.transfer.stat("device-edge").bytes == 16
    assert edge.in_flight == 0  # each was counted answered
    assert upstream.stream is None and upstream.segment_source().peer == "edge"


def test_a_stopping_tier_answers_unavailable_and_a_closed_one_is_known_down(
    edge: Tier,
) -> None:
    upstream = LocalUpstream(edge, me="device")
    assert not upstream.known_down()
    assert edge.drain(0.0)
    reply = upstream.submit(_request(edge, 1.0)).future.result()
    assert tier_pb2.ErrorCode.Name(reply.error.code) == "UNAVAILABLE"
    assert "stopping" in reply.error.message
    edge.close()
    assert upstream.known_down()
    with pytest.raises(TransportError, match="is down"):
        upstream.submit(_request(edge, 1.0))


def test_a_bad_request_is_answered_with_its_error(edge: Tier) -> None:
    upstream = LocalUpstream(edge, me="device")
    request = _request(edge, 1.0)
    request.plan_id = "nope"
    reply = upstream.submit(request).future.result()
    assert tier_pb2.ErrorCode.Name(reply.error.code) == "PLAN_MISMATCH" and reply.id == request.id
    upstream.close()
    with pytest.raises(TransportError, match="closed"):
        upstream.submit(_request(edge, 1.0))


class _Boasting:
    """The real edge, its replies claiming a link rate no link has (as a hostile tier would)."""

    def __init__(self, tier: Tier) -> None:
        self.tier = tier
        self.name, self.plan_id = tier.name, tier.plan_id
        self.options, self.down_link = tier.options, tier.down_link
        self.metrics = tier.metrics
        self.closed = False

    def admit_request(self) -> tier_pb2.Error | None:
        return self.tier.admit_request()

    def hold(self, request: tier_pb2.Request, caller: str) -> Callable[[], None]:
        return self.tier.hold(request, caller)

    def answered(self) -> None:
        self.tier.answered()

    def handle(
        self, request: tier_pb2.Request, received: float, later: Send, caller: str = "local"
    ) -> tier_pb2.Reply | None:
        reply = self.tier.handle(request, received, later, caller)
        assert reply is not None
        reply.links.add(link="device-edge", bytes=2**62, send_ms=-1.0, rate_bps=float("nan"))
        return reply


def test_figures_no_tier_could_measure_are_dropped_in_process_too(edge: Tier) -> None:
    upstream = LocalUpstream(_Boasting(edge), me="device")
    before = WARNINGS.counts("device").get(("device", "reply_figures"), 0)
    reply = upstream.submit(_request(edge, 1.0)).future.result()
    assert list(reply.links) == [] and reply.answered_by == "edge"
    assert WARNINGS.counts("device").get(("device", "reply_figures"), 0) == before + 1


def test_the_pipeline_sends_up_and_a_next_tier_known_down_comes_down_at_once(
    edge: Tier, tmp_path: Path
) -> None:
    """:meth:`Pipeline.send`: what was sent, its reply to take down when it comes; or, the
    next tier known to be down, what came down for that at once (it is gone)."""
    device = Pipeline("device", edge.plans, tmp_path, RuntimeOptions())
    upstream = LocalUpstream(edge, me="device")
    onward = up(device.climb(0, inputs={"x": np.full((1, 4), 5.0, np.float32)}), _kept)
    assert isinstance(onward, Onward)
    sent = device.send(upstream, 0, onward, deadline=None)
    assert isinstance(sent, Sent)
    down = device.came_down(0, onward, sent.future.result())
    assert down.reply is not None and down.reply.answered_by == "edge"
    np.testing.assert_array_equal(decode_tensors(down.reply.outputs)["y"], np.full((1, 4), 5.0))
    edge.close()
    refused = device.send(upstream, 0, onward)
    assert isinstance(refused, Down) and refused.reply is None and refused.answered is None
    assert isinstance(refused.gone, TransportError) and "is down" in str(refused.gone)
    device.close()


def _kept(onward: Onward) -> Onward:
    return onward


class _Clock:
    """Link time that moves only when a link waits (``runs``), and never sleeps."""

    def __init__(self, runs: bool = True) -> None:
        self.now, self.runs = 100.0, runs

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        if self.runs:
            self.now += seconds


def _shaped_edge(tmp_path: Path, reply_link: LinkSpec | None) -> Tier:
    tmp_path.mkdir(exist_ok=True)
    specs = matmul_chain(tmp_path, [("device", "device.onnx"), ("edge", "edge.onnx")])
    plan = Plan("m.onnx", "0" * 64, ("x",), ("y",), tuple(specs))
    save_plan(plan, tmp_path)
    links = {} if reply_link is None else {"device-edge": reply_link}
    options = RuntimeOptions(workers=1, links=links)
    tier = Tier("edge", load_plan_set(tmp_path), tmp_path, options=options)
    tier.load()
    return tier


def test_a_request_in_process_crosses_the_emulated_link_both_ways(tmp_path: Path) -> None:
    """[Note: link shaping] in process: the request leaves when this tier's link has carried
    it and arrives half a round trip later; the reply comes back on the next tier's side."""
    up, down = LinkSpec(8e6, 0.010), LinkSpec(4e6, 0.010)  # 1 MB/s up, 0.5 MB/s down
    edge = _shaped_edge(tmp_path, down)
    clock = _Clock()
    options = RuntimeOptions(links={"device-edge": up})
    upstream = LocalUpstream(edge, me="device", options=options, clock=clock, sleep=clock.sleep)
    try:
        request = _request(edge, 2.0)
        sent = upstream.submit(request, nbytes=10_000)
        reply = sent.future.result()
        stat = sent.transfer.stat("device-edge")
        assert (stat.bytes, stat.queue_ms) == (10_000, 0.0)
        assert stat.send_ms == pytest.approx(10.0) and stat.rate_bps == pytest.approx(8e6)
        # 10 ms up and 5 ms across; the reply's bytes at 0.5 MB/s and 5 ms across.
        back_s = reply.ByteSize() / 0.5e6 + 0.005
        assert clock.now - 100.0 == pytest.approx(0.015 + back_s)
        np.testing.assert_array_equal(decode_tensors(reply.outputs)["y"], np.full((1, 4), 2.0))
    finally:
        edge.close()


def test_requests_handed_at_one_moment_wait_their_turn_on_the_link(tmp_path: Path) -> None:
    """[Note: honest link figures]: each waits behind the ones before (``queue_ms``), and
    its rate is over its own crossing only."""
    edge = _shaped_edge(tmp_path, None)
    clock = _Clock(runs=False)  # nothing moves it: every request handed at one moment
    options = RuntimeOptions(links={"device-edge": LinkSpec(8e6, 0.002)})
    upstream = LocalUpstream(edge, me="device", options=options, clock=clock, sleep=clock.sleep)
    try:
        stats = [
            upstream.submit(_request(edge, 1.0), nbytes=1_000).transfer.stat("device-edge")
            for _ in range(4)
        ]
    finally:
        edge.close()
    assert [s.queue_ms for s in stats] == pytest.approx([0.0, 1.0, 2.0, 3.0])
    assert all(s.send_ms == pytest.approx(1.0) for s in stats)
    assert all(s.rate_bps == pytest.approx(8e6) for s in stats)


def test_segments_come_in_process_through_the_next_tiers_fetch_on_its_link(
    tmp_path: Path,
) -> None:
    """[Note: segments on demand] in process: the next tier's ``FetchSegment`` path, its
    chunks shaped on its side of the link; a file it does not serve is refused."""
    edge = _shaped_edge(tmp_path / "edge", LinkSpec(8e6, 0.0))  # 1 MB/s down
    clock = _Clock()
    upstream = LocalUpstream(edge, me="device", clock=clock, sleep=clock.sleep)
    spec = edge.plan.segments[0]
    assert spec.size is not None
    here = tmp_path / "device"
    here.mkdir()
    try:
        source = upstream.segment_source()
        report = source.fetch(spec, here)
        assert (report.size, report.received, report.attempts) == (spec.size, spec.size, 1)
        assert (here / spec.file).read_bytes() == (tmp_path / "edge" / spec.file).read_bytes()
        assert clock.now - 100.0 == pytest.approx(spec.size / 1e6)  # each chunk on the link
        with pytest.raises(SegmentError, match="does not serve segment"):
            source.fetch(dataclasses.replace(spec, sha256="1" * 64), here)
        edge.close()
        with pytest.raises(TransportError, match="broke off 1 times"):  # known down: no retry
            source.fetch(dataclasses.replace(spec, file="edge.onnx"), here)
    finally:
        edge.close()
