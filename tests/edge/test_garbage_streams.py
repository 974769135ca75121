"""Streams that send garbage, and hosts that hold many streams (issue 28 finding 6): garbage
is no activity, a stream of it is closed after a few messages, the warnings about a peer
are rate-limited but counted, and hosts at their caps leave room for other hosts' devices
([Note: garbage on a stream] in tierflow/runtime/streams.py, [Note: stream admission])."""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from tierflow.codec.spec import CodecSpec
from tierflow.options import RuntimeOptions
from tierflow.plan import load_plan
from tierflow.rpc import tier_pb2, tier_pb2_grpc
from tierflow.runtime.server import TierServer
from tierflow.runtime.streams import GARBAGE_LIMIT
from tierflow.runtime.tier import Tier
from tierflow.transport.peer_warnings import WARNINGS
from tierflow.transport.wire import grpc_options, put_tensors

pytestmark = pytest.mark.integration

GARBAGE = b"\xff\xff\xff\xff"  # 4 bytes that do not parse


def _wait_for(condition: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    ends = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < ends, f"timed out waiting for {what}"
        time.sleep(0.01)


def _valid(plan_id: str, request_id: str) -> bytes:
    h2 = np.random.default_rng(0).standard_normal((1, 8, 8, 8)).astype(np.float32)
    request = tier_pb2.Request(id=request_id, plan_id=plan_id, segment=2)
    put_tensors(request.tensors, {"h2": h2}, CodecSpec.parse("raw"))
    return request.SerializeToString()


@pytest.fixture
def cloud(tmp_path: Path, rt: Any, request: Any) -> Iterator[tuple[TierServer, str, str]]:
    """A cloud serving the whole plan's last segment, also on [::1] (another host):
    (server, 127.0.0.1 address, [::1] address)."""
    settings = getattr(request, "param", {})
    split = rt.cnn(tmp_path / "plan")
    plan = load_plan(split.plan_dir)
    options = RuntimeOptions(workers=2, **settings)
    server = TierServer(Tier("cloud", plan, split.plan_dir, options=options), "127.0.0.1:0")
    other = server._server.add_insecure_port("[::1]:0")
    server.start()
    try:
        yield server, server.address, f"[::1]:{other}"
    finally:
        server.stop(0)


def _raw(channel: grpc.Channel) -> Any:
    return channel.stream_stream(
        "/tierflow.rpc.Tier/Infer",
        request_serializer=None,
        response_deserializer=tier_pb2.Reply.FromString,
    )


def test_a_trickle_of_garbage_is_closed_after_a_few_messages_with_few_lines(
    cloud: tuple[TierServer, str, str], caplog: pytest.LogCaptureFixture
) -> None:
    server, address, _ = cloud
    plan_id = server.tier.plan_id
    before = WARNINGS.counts("cloud")
    channel = grpc.insecure_channel(address, options=grpc_options())
    raw = _raw(channel)
    feeds: list[queue.SimpleQueue[bytes | None]] = []
    try:
        with caplog.at_level(logging.INFO):
            calls = []
            for _ in range(5):  # five streams from one host, 4 bytes every 20 ms each
                messages: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
                feeds.append(messages)
                calls.append(raw(iter(messages.get, None), timeout=20))
            for _ in range(3 * GARBAGE_LIMIT):
                for messages in feeds:
                    messages.put(GARBAGE)
                time.sleep(0.02)
            for call in calls:
                replies = []
                with pytest.raises(grpc.RpcError) as closed:
                    for reply in call:
                        replies.append(reply)
                assert closed.value.code() == grpc.StatusCode.CANCELLED
                assert len(replies) <= GARBAGE_LIMIT
                assert all(tier_pb2.ErrorCode.Name(r.error.code) == "CODEC" for r in replies)
        lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        undecodable_lines = [m for m in lines if "undecodable" in m and "closed" not in m]
        assert len(undecodable_lines) == 1  # one a peer, not one a message
        assert len([m for m in lines if "closed" in m]) == 1
        after = WARNINGS.counts("cloud")
        sent = 5 * GARBAGE_LIMIT
        undecodable = ("cloud", "undecodable")
        assert after[undecodable] - before.get(undecodable, 0) >= sent  # every one counted
        assert after[("cloud", "garbage_stream")] - before.get(("cloud", "garbage_stream"), 0) == 5
        _wait_for(lambda: server.service.admission.open_streams == 0, "the places given back")
        # A well-formed client of the same host is served.
        (reply,) = raw(iter([_valid(plan_id, "ok")]), timeout=10)
        assert reply.id == "ok" and not reply.HasField("error")
    finally:
        for messages in feeds:
            messages.put(None)
        channel.close()


def test_garbage_is_not_activity(cloud: tuple[TierServer, str, str]) -> None:
    """A stream's idle time counts from its last well-formed request, not its last message."""
    server, address, _ = cloud
    plan_id = server.tier.plan_id
    channel = grpc.insecure_channel(address, options=grpc_options())
    messages: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
    try:
        call = _raw(channel)(iter(messages.get, None), timeout=20)
        messages.put(_valid(plan_id, "first"))
        assert next(call).id == "first"
        answered = time.monotonic()
        time.sleep(0.5)
        for _ in range(GARBAGE_LIMIT - 1):  # under the limit: the stream stays open
            messages.put(GARBAGE)
            assert next(call).error.code == tier_pb2.ErrorCode.CODEC
        (reader,) = list(server.service.watchdog.readers)
        # The last garbage reply is written before its request counts as answered.
        _wait_for(lambda: reader.idle_for(time.monotonic()) > 0, "the last reply counted")
        assert reader.idle_for(time.monotonic()) >= time.monotonic() - answered - 0.05
        assert reader.idle_for(time.monotonic()) >= 0.45
        messages.put(_valid(plan_id, "second"))  # a well-formed one is activity again
        assert next(call).id == "second"
        _wait_for(lambda: reader.idle_for(time.monotonic()) < 0.45, "activity again")
    finally:
        messages.put(None)
        channel.close()


@pytest.mark.parametrize("cloud", [{"max_streams": 8, "max_streams_per_peer": 8}], indirect=True)
def test_a_host_holding_its_streams_leaves_room_for_another_hosts_device(
    cloud: tuple[TierServer, str, str],
) -> None:
    """Four hosts at their cap once filled the global cap; here one host may hold the
    global cap's open part and a share of its reserve, and a device of another host is
    still served."""
    server, address, other = cloud
    admission = server.service.admission
    channel = grpc.insecure_channel(address, options=grpc_options())
    stub = tier_pb2_grpc.TierStub(channel)
    parked: list[queue.SimpleQueue[tier_pb2.Request | None]] = []
    calls = []
    try:
        refused = None
        for _ in range(8):
            messages: queue.SimpleQueue[tier_pb2.Request | None] = queue.SimpleQueue()
            parked.append(messages)
            held = admission.open_streams
            call = stub.Infer(iter(messages.get, None))
            calls.append(call)

            def taken_or_refused(held: int = held, call: Any = call) -> bool:
                return admission.open_streams > held or bool(call.done())

            _wait_for(taken_or_refused, f"stream {len(calls)} to be taken or refused")
            if call.done():
                refused = call
                break
        assert refused is not None and refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert admission.open_streams == 6  # 8 - a reserve of 2
        with grpc.insecure_channel(other, options=grpc_options()) as device:
            raw = _raw(device)
            (reply,) = raw(iter([_valid(server.tier.plan_id, "device")]), timeout=10)
        assert reply.id == "device" and not reply.HasField("error"), reply.error
    finally:
        for messages in parked:
            messages.put(None)
        for call in calls:
            call.cancel()
        channel.close()
