"""Stream admission: idle streams cost no worker; a peer beyond its cap is told OVERLOADED.

Streams, peers and their caps are gRPC's; a request's refusal before its tensors are read
is the tier's, checked with the tiers in process ([Note: the next tier in process] in
tierflow/runtime/upstream.py).
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from tierflow.edge.forwarding import Forwarding
from tierflow.errors import RemoteError
from tierflow.options import RuntimeOptions
from tierflow.plan import load_plan
from tierflow.rpc import tier_pb2, tier_pb2_grpc
from tierflow.runtime.segment_runner import TierRunner
from tierflow.runtime.server import TierServer
from tierflow.runtime.upstream import LocalUpstream
from tierflow.transport.stream_client import StreamClient
from tierflow.transport.wire import decode_tensors, grpc_options, put_tensors

STREAMS = pytest.mark.integration


def _device_request(plan_dir: Path, feeds: dict[str, np.ndarray]) -> tier_pb2.Request:
    """What a device sends the edge for ``feeds``: the device segment run here."""
    plan = load_plan(plan_dir)
    outcome = TierRunner(plan, plan_dir, "device").run(feeds)
    request = tier_pb2.Request(plan_id=plan.plan_id, segment=outcome.next_segment)
    put_tensors(request.tensors, outcome.tensors, plan.link_codec("device-edge"))
    return request


@contextlib.contextmanager
def _tiers(plan_dir: Path, options: RuntimeOptions) -> Iterator[TierServer]:
    cloud = TierServer.from_plan(
        "cloud", plan_dir, "127.0.0.1:0", options=RuntimeOptions(workers=2)
    )
    cloud.start()
    edge = TierServer.from_plan(
        "edge", plan_dir, "127.0.0.1:0", forwarder=Forwarding(cloud.address), options=options
    )
    try:
        edge.start()
        yield edge
    finally:
        edge.stop(0)
        cloud.stop(0)


class _IdleStreams:
    """Streams opened on one channel that never send a request until closed."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address, options=grpc_options())
        self.stub = tier_pb2_grpc.TierStub(self.channel)
        self.calls: list[tuple[threading.Event, Any]] = []

    def open(self, count: int) -> None:
        for _ in range(count):
            stop = threading.Event()

            def nothing(stop: threading.Event = stop) -> Iterator[tier_pb2.Request]:
                stop.wait()
                yield from ()

            self.calls.append((stop, self.stub.Infer(nothing())))

    def close_one(self) -> None:
        stop, call = self.calls.pop()
        stop.set()
        call.cancel()

    def close(self) -> None:
        while self.calls:
            self.close_one()
        self.channel.close()


def _wait_for(condition: Any, what: str, timeout: float = 20.0) -> None:
    ends = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > ends:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


@STREAMS
def test_a_hundred_idle_streams_do_not_delay_a_device(tmp_path: Path, rt: Any) -> None:
    """With 100 streams held open and silent, a device's request is answered in time, exactly."""
    split = rt.cnn(tmp_path / "plan")
    feeds = split.sample(0)[0]
    with _tiers(split.plan_dir, RuntimeOptions(workers=2)) as edge:
        idle = _IdleStreams(edge.address)
        device = StreamClient(edge.address, me="device", peer="edge")
        try:
            idle.open(100)
            admission = edge.service.admission
            _wait_for(lambda: admission.open_streams == 100, "the edge to hold 100 streams")
            started = time.monotonic()
            sent = device.submit(_device_request(split.plan_dir, feeds), deadline=started + 3.0)
            reply = sent.future.result(timeout=10)
            assert not reply.HasField("error"), reply.error
            assert reply.answered_by == "cloud"
            outputs = decode_tensors(reply.outputs)
            np.testing.assert_array_equal(outputs["y"], split.reference(feeds)["y"])
            assert admission.open_streams == 101  # the idle ones were still open
        finally:
            device.close(timeout=1)
            idle.close()


@STREAMS
def test_a_peer_beyond_its_stream_cap_is_answered_overloaded(tmp_path: Path, rt: Any) -> None:
    """The third stream from one host is refused OVERLOADED; a freed place serves again."""
    split = rt.cnn(tmp_path / "plan")
    request = _device_request(split.plan_dir, split.sample(1)[0])
    options = RuntimeOptions(workers=2, max_streams_per_peer=2)
    with _tiers(split.plan_dir, options) as edge:
        idle = _IdleStreams(edge.address)
        device = StreamClient(edge.address, me="device", peer="edge")
        try:
            idle.open(2)
            admission = edge.service.admission
            _wait_for(lambda: admission.open_streams == 2, "the edge to hold 2 streams")
            refused = device.submit(request, deadline=time.monotonic() + 5.0)
            with pytest.raises(RemoteError) as caught:
                refused.future.result(timeout=10)
            assert caught.value.code == "OVERLOADED"
            assert "at most 2 per peer" in str(caught.value)
            assert admission.open_streams == 2  # the refused stream took no place

            idle.close_one()
            _wait_for(lambda: admission.open_streams == 1, "a place to be given back")
            served = device.submit(request, deadline=time.monotonic() + 5.0)
            reply = served.future.result(timeout=10)
            assert not reply.HasField("error"), reply.error
        finally:
            device.close(timeout=1)
            idle.close()


def test_a_request_for_another_segment_is_refused_before_its_tensors_are_read(
    tmp_path: Path, rt: Any
) -> None:
    """100,000 tensors naming the wrong segment are refused without decoding them (a larger
    message than the plan allows is refused by gRPC before parsing: test_hostile.py)."""
    split = rt.cnn(tmp_path / "plan")
    plan = load_plan(split.plan_dir)
    request = tier_pb2.Request(id="many", plan_id=plan.plan_id, segment=2)
    for index in range(100_000):
        request.tensors.add(name=f"t{index}", dtype="float32", shape=[1], codec="raw", data=b"0000")
    with rt.in_process(split.plan_dir) as tiers:
        started = time.monotonic()
        reply = LocalUpstream(tiers.edge, me="device").submit(request).future.result()
        elapsed = time.monotonic() - started
    assert tier_pb2.ErrorCode.Name(reply.error.code) == "INVALID_INPUT"
    assert reply.error.tier == "edge" and "segment 2" in reply.error.message
    assert elapsed < 5.0


@STREAMS
def test_idle_streams_are_closed_and_their_places_given_back(tmp_path: Path, rt: Any) -> None:
    """Issue 20, item 13: a host holding every stream of its cap, idle, locks out the
    devices behind the same address until --stream-idle closes them."""
    split = rt.cnn(tmp_path / "plan")
    options = RuntimeOptions(workers=1, max_streams_per_peer=4, stream_idle_s=1.0)
    cloud = TierServer.from_plan("cloud", split.plan_dir, "127.0.0.1:0", options=options)
    cloud.start()
    channel = grpc.insecure_channel(cloud.address, options=grpc_options())
    stub = tier_pb2_grpc.TierStub(channel)
    idle: list[queue.SimpleQueue[tier_pb2.Request | None]] = []

    def park() -> Any:
        messages: queue.SimpleQueue[tier_pb2.Request | None] = queue.SimpleQueue()
        idle.append(messages)
        return stub.Infer(iter(messages.get, None))

    try:
        parked = [park() for _ in range(4)]
        _wait_for(lambda: cloud.service.admission.open_streams == 4, "four parked streams")
        refused = park()
        with pytest.raises(grpc.RpcError) as full:
            next(refused)
        assert full.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        for call in parked:  # closed by the tier within a second or two of idling
            with pytest.raises(grpc.RpcError) as closed:
                next(call)
            assert closed.value.code() == grpc.StatusCode.CANCELLED
        _wait_for(lambda: cloud.service.admission.open_streams == 0, "the places given back")
        ask = tier_pb2.ProbeMessage(seq=1, reply_bytes=8)  # another stream gets in again
        assert len(list(stub.Probe(iter([ask]), timeout=5))) == 1
    finally:
        for messages in idle:
            messages.put(None)
        channel.close()
        cloud.stop(0)
