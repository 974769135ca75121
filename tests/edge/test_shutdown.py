"""SIGTERM: new requests refused at once, those in flight drained, exit within grace + 1 s."""

from __future__ import annotations

import os
import queue
import re
import signal
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from tierflow.plan import load_plan
from tierflow.rpc import tier_pb2, tier_pb2_grpc
from tierflow.runtime.replies import StreamReplies
from tierflow.runtime.segment_runner import TierRunner
from tierflow.runtime.service import TierService
from tierflow.runtime.tier import Tier
from tierflow.transport.wire import grpc_options, put_tensors


def _edge_request(plan_dir: Path, request_id: str) -> tier_pb2.Request:
    plan = load_plan(plan_dir)
    feeds = {"x": np.random.default_rng(0).standard_normal((1, 3, 8, 8)).astype(np.float32)}
    outcome = TierRunner(plan, plan_dir, "device").run(feeds)
    request = tier_pb2.Request(id=request_id, plan_id=plan.plan_id, segment=outcome.next_segment)
    put_tensors(request.tensors, outcome.tensors, plan.link_codec("device-edge"))
    return request


class _Stream:
    """One Infer stream fed request by request; replies collected as they come."""

    def __init__(self, channel: grpc.Channel) -> None:
        self.outgoing: queue.SimpleQueue[tier_pb2.Request | None] = queue.SimpleQueue()
        self.call = tier_pb2_grpc.TierStub(channel).Infer(self._requests())
        self.replies: Iterator[tier_pb2.Reply] = iter(self.call)

    def _requests(self) -> Iterator[tier_pb2.Request]:
        while (request := self.outgoing.get()) is not None:
            yield request

    def send(self, request: tier_pb2.Request) -> None:
        self.outgoing.put(request)


@pytest.mark.integration
def test_sigterm_refuses_new_requests_at_once_and_drains_those_in_flight(
    tmp_path: Path, rt: Any
) -> None:
    split = rt.cnn(tmp_path / "plan")
    with rt.processes() as start:
        cloud = start("cloud", split.plan_dir)
        edge = start("edge", split.plan_dir, "--upstream", cloud.address, "--grace", "5")
        channel = grpc.insecure_channel(edge.address, options=grpc_options())
        stream = _Stream(channel)
        try:
            stream.send(_edge_request(split.plan_dir, "warm"))
            assert not next(stream.replies).HasField("error")
            os.kill(cloud.process.pid, signal.SIGSTOP)
            stream.send(_edge_request(split.plan_dir, "in-flight"))  # waits for the cloud
            time.sleep(0.3)
            edge.process.send_signal(signal.SIGTERM)
            time.sleep(0.3)
            stream.send(_edge_request(split.plan_dir, "late"))
            late = next(stream.replies)  # answered at once, though one is still in flight
            assert late.id == "late" and late.error.tier == "edge"
            assert tier_pb2.ErrorCode.Name(late.error.code) == "UNAVAILABLE"
            assert "stopping" in late.error.message
            os.kill(cloud.process.pid, signal.SIGCONT)
            drained = next(stream.replies)
            assert drained.id == "in-flight" and not drained.HasField("error")
            assert drained.answered_by == "cloud"
            assert edge.process.wait(5) == 0  # exits once nothing is in flight
        finally:
            os.kill(cloud.process.pid, signal.SIGCONT)
            stream.outgoing.put(None)
            channel.close()


def _edge_in_flight(edge: Any) -> Callable[[int], None]:
    """Waits until the edge holds that many requests not yet answered, as its metrics say
    (``tierflow_in_flight``; the edge runs with ``--metrics-port 0``)."""
    line = edge.read_line(30)  # the second line `tierflow serve` prints: where its metrics are
    assert " metrics on http://" in line, line
    url = line.rsplit(" on ", 1)[1].strip()

    def wait(count: int, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            with urllib.request.urlopen(url, timeout=10) as response:
                text = response.read().decode()
            found = re.search(r'^tierflow_in_flight\{tier="edge"\} (\S+)$', text, re.MULTILINE)
            assert found, text
            if float(found.group(1)) == count:
                return
            assert time.monotonic() < deadline, f"the edge holds {found.group(1)}, not {count}"
            time.sleep(0.02)

    return wait


@pytest.mark.integration
def test_sigterm_after_garbage_exits_within_grace_plus_one_second(tmp_path: Path, rt: Any) -> None:
    """Garbage from a client that went away, an idle stream, a request that never ends.

    SIGTERM goes once the edge holds that request, as its metrics say: a fixed sleep raced
    a loaded edge, which had not read the request yet, exited at once and failed the test.
    """
    pytest.importorskip("prometheus_client", reason="--metrics-port needs the metrics extra")
    split = rt.cnn(tmp_path / "plan")
    valid = _edge_request(split.plan_dir, "v").SerializeToString()
    grace = 1.0
    with rt.processes() as start:
        cloud = start("cloud", split.plan_dir)
        edge = start(
            "edge",
            split.plan_dir,
            *("--upstream", cloud.address, "--grace", str(grace), "--metrics-port", "0"),
        )
        in_flight = _edge_in_flight(edge)
        channel = grpc.insecure_channel(edge.address, options=grpc_options())
        raw = channel.stream_stream(
            "/tierflow.rpc.Tier/Infer",
            request_serializer=None,
            response_deserializer=tier_pb2.Reply.FromString,
        )
        garbage = [b"\xff\xff\xff", valid, b"\x0a\x05ab", valid, b"\x12\x02\xc3\x28"]
        cancelled = raw(iter(garbage))
        next(cancelled)
        cancelled.cancel()  # a client that sent garbage and went away
        idle_requests: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        idle = raw(iter(idle_requests.get, None))  # a device that keeps its stream open
        idle_requests.put(valid)
        assert not next(idle).HasField("error")
        in_flight(0)  # the garbage stream's requests too are answered
        os.kill(cloud.process.pid, signal.SIGSTOP)
        idle_requests.put(valid)  # in flight until the cloud wakes: never, here
        in_flight(1)
        try:
            started = time.monotonic()
            edge.process.send_signal(signal.SIGTERM)
            code = edge.process.wait(grace + 5)
            elapsed = time.monotonic() - started
            assert code == 0
            assert grace - 0.1 < elapsed < grace + 1.0, elapsed  # it waited for the request
        finally:
            os.kill(cloud.process.pid, signal.SIGCONT)
            idle_requests.put(None)
            channel.close()


class _OpenStream:
    """What a stream's replies ask of its gRPC context: the stream stays open."""

    def is_active(self) -> bool:
        return True


class _EndedStream:
    """A stream whose client has gone away."""

    def is_active(self) -> bool:
        return False


@pytest.mark.integration
def test_drain_waits_for_a_reply_handed_to_the_stream_writer(tmp_path: Path, rt: Any) -> None:
    """A reply made by another thread is answered only once written, not once handed over."""
    split = rt.cnn(tmp_path / "plan")
    tier = Tier("cloud", load_plan(split.plan_dir), split.plan_dir)
    service = TierService(tier)
    release = threading.Event()
    written: list[str] = []

    def slow_write(reply: tier_pb2.Reply) -> None:
        release.wait(5)
        written.append(reply.id)

    replies = StreamReplies(slow_write, "test-replies", _OpenStream())  # type: ignore[arg-type]
    service.watchdog.watch(replies)
    try:
        worker = threading.Thread(
            target=replies.put, args=(tier_pb2.Reply(id="r"),), kwargs={"own": False}
        )
        worker.start()  # not the stream's own thread: handed to the writer thread
        worker.join()
        assert tier.in_flight == 0
        assert not service.drain(0.2)  # the reply is not written yet
        release.set()
        assert service.drain(2.0)
        assert written == ["r"]
    finally:
        release.set()
        tier.close()


def test_a_stream_closed_with_a_reply_handed_to_its_writer_drops_it_quietly() -> None:
    """The writer thread finds the reply gone with the stream, and ends without an error."""
    for _ in range(20):
        replies = StreamReplies(
            lambda reply: None,
            "test-replies",
            _EndedStream(),  # type: ignore[arg-type]
        )
        worker = threading.Thread(
            target=replies.put, args=(tier_pb2.Reply(id="r"),), kwargs={"own": False}
        )
        worker.start()
        worker.join()
        replies.close()  # the client is gone: nothing waits for the writer
        assert replies._writer is not None
        replies._writer.join(2)
        assert not replies._writer.is_alive()
        assert replies.written()
