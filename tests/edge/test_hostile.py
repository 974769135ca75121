"""Poison deadlines, many-tensor and undecodable messages: typed errors in bounded time.

What a tier decides about a request it has read (a deadline it cannot hold, more tensors
than the plan names) is checked with the tiers in process ([Note: the next tier in
process] in tierflow/runtime/upstream.py); bytes that are no message, a message larger than
any plan's request, and a deadline the edge enforces on a stalled cloud need gRPC.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from tierflow.edge.forwarding import Forwarding
from tierflow.errors import InputError
from tierflow.options import RuntimeOptions
from tierflow.plan import load_plan
from tierflow.rpc import tier_pb2, tier_pb2_grpc
from tierflow.runtime.segment_runner import TierRunner
from tierflow.runtime.server import TierServer
from tierflow.runtime.tier import Tier
from tierflow.runtime.upstream import LocalUpstream
from tierflow.transport.stream_client import StreamClient
from tierflow.transport.wire import encode_tensors, grpc_options, put_tensors

#: Deadlines no timer can hold: not finite, before the epoch, or further than a day ahead.
POISONS = (float("inf"), 1e300, float("nan"), -1.0)


def _code(reply: tier_pb2.Reply) -> str:
    assert reply.HasField("error"), reply
    return str(tier_pb2.ErrorCode.Name(reply.error.code))


def _edge_request(plan_dir: Path, feeds: dict[str, np.ndarray]) -> tier_pb2.Request:
    """What a device sends the edge for ``feeds``: the device segment run here."""
    plan = load_plan(plan_dir)
    outcome = TierRunner(plan, plan_dir, "device").run(feeds)
    request = tier_pb2.Request(plan_id=plan.plan_id, segment=outcome.next_segment)
    put_tensors(request.tensors, outcome.tensors, plan.link_codec("device-edge"))
    return request


def _copy(request: tier_pb2.Request, request_id: str, deadline: float) -> tier_pb2.Request:
    copy = tier_pb2.Request()
    copy.CopyFrom(request)
    copy.id, copy.deadline_unix_s = request_id, deadline
    return copy


def test_poison_deadlines_are_refused_and_a_sound_request_is_answered(
    tmp_path: Path, rt: Any
) -> None:
    """inf, 1e300, NaN, negative and a year ahead are INVALID_INPUT at the edge, before
    anything is forwarded; the same request with a sound deadline is answered."""
    split = rt.cnn(tmp_path / "plan")
    good = _edge_request(split.plan_dir, split.sample(0)[0])
    with rt.in_process(split.plan_dir) as tiers:
        edge = LocalUpstream(tiers.edge, me="device")
        poisons = [*POISONS, time.time() + 1e7]
        sent = [edge.submit(_copy(good, f"p{i}", d)) for i, d in enumerate(poisons)]
        replies = [s.future.result() for s in sent]
        sound = edge.submit(_copy(good, "sound", time.time() + 60)).future.result()
        assert tiers.cloud.in_flight == 0
    for reply in replies:
        assert _code(reply) == "INVALID_INPUT" and reply.error.tier == "edge"
        assert "deadline" in reply.error.message
    assert not sound.HasField("error") and sound.answered_by == "cloud"


@pytest.mark.integration
def test_a_late_request_fails_at_the_edge_while_the_cloud_stalls(tmp_path: Path, rt: Any) -> None:
    """The edge's own deadline answers a request its stalled cloud never does."""
    split = rt.cnn(tmp_path / "plan")
    good = _edge_request(split.plan_dir, split.sample(0)[0])
    with rt.processes() as start:
        cloud = start("cloud", split.plan_dir)
        edge = TierServer.from_plan(
            "edge",
            split.plan_dir,
            "127.0.0.1:0",
            forwarder=Forwarding(cloud.address),
            options=RuntimeOptions(workers=2),
        )
        edge.start()
        channel = grpc.insecure_channel(edge.address, options=grpc_options())
        os.kill(cloud.process.pid, signal.SIGSTOP)  # a stalled cloud: only deadlines answer
        try:
            stub = tier_pb2_grpc.TierStub(channel)
            poison = _copy(good, "poison", float("inf"))
            late = _copy(good, "late", time.time() + 0.5)
            started = time.monotonic()
            replies = {r.id: r for r in stub.Infer(iter([poison, late]), timeout=20)}
            elapsed = time.monotonic() - started
            assert _code(replies["poison"]) == "INVALID_INPUT"
            # Enforced by the edge's deadline thread: the cloud never answers.
            assert _code(replies["late"]) == "DEADLINE_EXCEEDED"
            assert replies["late"].error.tier == "edge"
            assert elapsed < 5.0
        finally:
            os.kill(cloud.process.pid, signal.SIGCONT)
            channel.close()
            edge.stop(0)


@pytest.mark.integration
def test_stream_clients_refuse_deadlines_their_timers_cannot_hold() -> None:
    client = StreamClient("127.0.0.1:1", me="device", peer="edge")
    try:
        for deadline in (float("inf"), float("nan")):
            with pytest.raises(InputError, match="deadline"):
                client.submit(tier_pb2.Request(), deadline=deadline)
        # A far but finite deadline is kept; the thread that enforces deadlines lives on.
        client.submit(tier_pb2.Request(), deadline=time.monotonic() + 1e300)
        time.sleep(0.05)
        assert client._sweeper.is_alive()
    finally:
        client.close(timeout=0.5)


@pytest.fixture
def cloud_stub(tmp_path: Path, rt: Any) -> Any:
    split = rt.cnn(tmp_path / "plan")
    plan = load_plan(split.plan_dir)
    tier = Tier("cloud", plan, split.plan_dir, options=RuntimeOptions(workers=1))
    server = TierServer(tier, "127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(server.address, options=grpc_options())
    raw = channel.stream_stream(
        "/tierflow.rpc.Tier/Infer",
        request_serializer=None,
        response_deserializer=tier_pb2.Reply.FromString,
    )
    try:
        yield raw, plan.plan_id
    finally:
        channel.close()
        server.stop(0.5)


def _valid(plan_id: str, request_id: str) -> bytes:
    h2 = np.random.default_rng(0).standard_normal((1, 8, 8, 8)).astype(np.float32)
    request = tier_pb2.Request(
        id=request_id, plan_id=plan_id, segment=2, tensors=encode_tensors({"h2": h2}, "raw")
    )
    return request.SerializeToString()


def test_many_tensor_messages_cost_no_more_than_the_plan_allows(tmp_path: Path, rt: Any) -> None:
    """A request of a hundred thousand one-element tensors is refused by its count, in
    bounded time, and the next request is answered."""
    split = rt.cnn(tmp_path / "plan")
    plan = load_plan(split.plan_dir)
    count = 100_000
    many = tier_pb2.Request(plan_id=plan.plan_id, segment=2)
    for _ in range(count):
        many.tensors.add(name="t", dtype="float32", shape=[1], codec="raw", data=bytes(4))
    with rt.in_process(split.plan_dir) as tiers:
        cloud = LocalUpstream(tiers.cloud, me="edge")
        started = time.monotonic()
        refused = cloud.submit(many).future.result()
        elapsed = time.monotonic() - started
        after = cloud.submit(tier_pb2.Request.FromString(_valid(plan.plan_id, ""))).future.result()
    assert _code(refused) == "INVALID_INPUT" and refused.error.tier == "cloud"
    assert f"carries {count}" in refused.error.message
    assert not after.HasField("error") and after.answered_by == "cloud"
    assert elapsed < 10.0


@pytest.mark.integration
def test_undecodable_messages_get_typed_errors_and_one_log_line_a_peer(
    cloud_stub: Any, caplog: pytest.LogCaptureFixture
) -> None:
    raw, plan_id = cloud_stub
    garbage = [b"\xff\xff\xff", b"\x0a\x05ab", b"\x12\x02\xc3\x28"]  # bad tag, short, bad UTF-8
    stream = [_valid(plan_id, "a"), *garbage, _valid(plan_id, "b")]
    with caplog.at_level(logging.INFO):
        replies = list(raw(iter(stream), timeout=20))
    assert len(replies) == len(stream)
    answered = {r.id: r for r in replies if r.id}
    assert sorted(answered) == ["a", "b"]
    assert not any(r.HasField("error") for r in answered.values())
    refused = [r for r in replies if not r.id]
    assert [_code(r) for r in refused] == ["CODEC"] * len(garbage)
    assert all("undecodable request" in r.error.message for r in refused)
    # One line for the peer, not one a message ([Note: warnings about a peer]).
    lines = [r for r in caplog.records if "undecodable" in r.getMessage()]
    assert len(lines) == 1
    assert not any(r.exc_info for r in caplog.records)


@pytest.mark.integration
def test_an_undecodable_probe_message_ends_its_probe_with_one_line(
    tmp_path: Path, rt: Any, caplog: pytest.LogCaptureFixture
) -> None:
    split = rt.cnn(tmp_path / "plan")
    tier = Tier(
        "cloud", load_plan(split.plan_dir), split.plan_dir, options=RuntimeOptions(workers=1)
    )
    server = TierServer(tier, "127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(server.address, options=grpc_options())
    probe = channel.stream_stream(
        "/tierflow.rpc.Tier/Probe",
        request_serializer=None,
        response_deserializer=tier_pb2.ProbeMessage.FromString,
    )
    try:
        with caplog.at_level(logging.INFO), pytest.raises(grpc.RpcError) as info:
            list(probe(iter([b"\xff\xff\xff"]), timeout=10))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert len([r for r in caplog.records if "undecodable" in r.getMessage()]) == 1
        assert not any(r.exc_info for r in caplog.records)
    finally:
        channel.close()
        server.stop(0)


def _peak_rss_bytes(pid: int) -> int:
    """The process's peak resident memory (VmHWM)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc: not Linux?")


@pytest.mark.integration
def test_a_message_larger_than_any_plan_request_is_refused_before_it_is_parsed(
    tmp_path: Path, rt: Any
) -> None:
    """Four 57 MB messages of two million tiny tensors each: gRPC refuses every one as it
    arrives ([Note: a tier's largest request]), the edge's memory never nears the 535 MB
    that parsing one took, and the edge still answers (issue 20, item 12)."""
    split = rt.cnn(tmp_path / "plan")
    plan = load_plan(split.plan_dir)
    assert plan.tensors  # what the bound is worked out from
    head = tier_pb2.Request(id="many", plan_id=plan.plan_id, segment=1).SerializeToString()
    one = tier_pb2.Request()
    one.tensors.add(name="t", dtype="float32", shape=[1], codec="raw", data=bytes(4))
    message = head + one.SerializeToString() * 2_000_000
    assert len(message) > 50_000_000
    with rt.processes() as start:
        cloud = start("cloud", split.plan_dir)
        edge = start("edge", split.plan_dir, "--upstream", cloud.address)
        channel = grpc.insecure_channel(edge.address, options=grpc_options())
        raw = channel.stream_stream(
            "/tierflow.rpc.Tier/Infer",
            request_serializer=None,
            response_deserializer=tier_pb2.Reply.FromString,
        )
        try:
            before = _peak_rss_bytes(edge.process.pid)
            for _ in range(4):
                with pytest.raises(grpc.RpcError) as refused:
                    list(raw(iter([message]), timeout=30))
                assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            peak = _peak_rss_bytes(edge.process.pid)
            assert peak < 400 * 1024 * 1024, f"edge peaked at {peak / 2**20:.0f} MiB"
            assert peak - before < 200 * 1024 * 1024
            good = _edge_request(split.plan_dir, split.sample(0)[0])
            good.id = "good"
            (reply,) = tier_pb2_grpc.TierStub(channel).Infer(iter([good]), timeout=20)
            assert not reply.HasField("error")
        finally:
            channel.close()
