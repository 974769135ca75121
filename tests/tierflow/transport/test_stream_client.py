"""StreamClient.submit's ``on_reply``: called once per request, with the Sent resolved,
whether the peer answered or the stream broke ([Note: the send comes last]); a list of
replicas takes the requests in turn, one stream on each ([Note: replicas])."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from tierflow.errors import TransportError
from tierflow.rpc import tier_pb2, tier_pb2_grpc
from tierflow.transport.stream_client import (
    Sent,
    StreamClient,
    replica_addresses,
    stream_count,
)
from tierflow.transport.wire import grpc_options

pytestmark = pytest.mark.integration

WAIT_S = 10.0


class _Echo(tier_pb2_grpc.TierServicer):
    """Answers each request with its id; stops answering once ``mute`` is set."""

    def __init__(self) -> None:
        self.mute = threading.Event()
        self.seen: list[str] = []  # the plan ids of the requests it answered

    def Infer(
        self, request_iterator: Iterator[tier_pb2.Request], context: grpc.ServicerContext
    ) -> Iterator[tier_pb2.Reply]:
        for request in request_iterator:
            if not self.mute.is_set():
                self.seen.append(request.plan_id)
                yield tier_pb2.Reply(id=request.id, plan_id=request.plan_id)


def _serve() -> tuple[grpc.Server, _Echo, str]:
    server = grpc.server(ThreadPoolExecutor(max_workers=4), options=grpc_options())
    servicer = _Echo()
    tier_pb2_grpc.add_TierServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, servicer, f"127.0.0.1:{port}"


@pytest.fixture
def echo() -> Iterator[tuple[grpc.Server, _Echo, str]]:
    server, servicer, address = _serve()
    yield server, servicer, address
    server.stop(None)


@pytest.fixture
def replicas() -> Iterator[list[tuple[grpc.Server, _Echo, str]]]:
    made = [_serve() for _ in range(3)]
    yield made
    for server, _, _ in made:
        server.stop(None)


@pytest.mark.parametrize(
    ("address", "listed", "streams"),
    [
        ("127.0.0.1:5", ["127.0.0.1:5"], 1),
        ("ipv4:127.0.0.1:5", ["ipv4:127.0.0.1:5"], 1),
        ("ipv4:10.0.0.1:5, 10.0.0.2:5", ["ipv4:10.0.0.1:5", "ipv4:10.0.0.2:5"], 2),
        ("ipv6:[::1]:5,[::1]:6", ["ipv6:[::1]:5", "ipv6:[::1]:6"], 2),
        ("dns:///cloud:5", ["dns:///cloud:5"], 4),
    ],
)
def test_a_list_of_replicas_gets_a_channel_and_a_stream_each(
    address: str, listed: list[str], streams: int
) -> None:
    assert replica_addresses(address) == listed
    assert stream_count(address) == streams


def test_replicas_take_the_requests_in_turn_whatever_the_timing(
    replicas: list[tuple[grpc.Server, _Echo, str]],
) -> None:
    """Each of three replicas answers every third request, and a session's requests all
    go to one replica: a stream is opened on its own replica's channel, not on whichever
    replica a shared channel had connected first (under load: [8, 16, 0] of 24)."""
    target = "ipv4:" + ",".join(address for _, _, address in replicas)
    client = StreamClient(target, me="edge", peer="cloud")
    try:
        sents = [client.submit(tier_pb2.Request(plan_id=f"r{i}")) for i in range(24)]
        sents += [
            client.submit(tier_pb2.Request(plan_id=f"s{name}", session=name))
            for name in ("a", "b", "c", "d")
            for _ in range(3)
        ]
        for sent in sents:
            sent.future.result(timeout=WAIT_S)
    finally:
        client.close()
    seen = [servicer.seen for _, servicer, _ in replicas]
    assert [len([p for p in s if p.startswith("r")]) for s in seen] == [8, 8, 8]
    for name in ("a", "b", "c", "d"):  # every request of a session on one replica
        assert sorted(len([p for p in s if p == f"s{name}"]) for s in seen) == [0, 0, 3]


def test_a_stream_whose_replica_died_opens_on_the_next_one(
    replicas: list[tuple[grpc.Server, _Echo, str]],
) -> None:
    target = "ipv4:" + ",".join(address for _, _, address in replicas)
    client = StreamClient(target, me="edge", peer="cloud")
    try:
        for sent in [client.submit(tier_pb2.Request(plan_id=f"a{i}")) for i in range(3)]:
            sent.future.result(timeout=WAIT_S)
        replicas[0][0].stop(None)
        answered = []
        for i in range(12):  # the first one on the dead replica's stream may fail, typed
            try:
                sent = client.submit(tier_pb2.Request(plan_id=f"b{i}"))
                answered.append(sent.future.result(timeout=WAIT_S).plan_id)
            except TransportError:
                pass
    finally:
        client.close()
    assert len(answered) >= 10
    after = [[p for p in servicer.seen if p.startswith("b")] for _, servicer, _ in replicas]
    assert after[0] == [] and len(after[1]) > len(after[2]) >= 4


def test_on_reply_gets_each_answered_request_once(echo: tuple[grpc.Server, _Echo, str]) -> None:
    _, _, address = echo
    calls: list[tuple[Sent, tier_pb2.Reply]] = []
    done = threading.Semaphore(0)

    def on_reply(sent: Sent) -> None:
        calls.append((sent, sent.future.result()))
        done.release()

    client = StreamClient(address, me="device", peer="edge")
    try:
        sents = [
            client.submit(tier_pb2.Request(plan_id=f"p{i}"), on_reply=on_reply) for i in range(5)
        ]
        for _ in sents:
            assert done.acquire(timeout=WAIT_S)
    finally:
        client.close()
    assert sorted(id(sent) for sent, _ in calls) == sorted(id(sent) for sent in sents)
    assert all(reply.plan_id == sent.request.plan_id for sent, reply in calls if sent.request)


def test_on_reply_gets_a_request_whose_stream_broke(echo: tuple[grpc.Server, _Echo, str]) -> None:
    server, servicer, address = echo
    servicer.mute.set()
    failed = threading.Event()
    errors: list[BaseException | None] = []

    def on_reply(sent: Sent) -> None:
        errors.append(sent.future.exception())
        failed.set()

    client = StreamClient(address, me="edge", peer="cloud")
    try:
        sent = client.submit(tier_pb2.Request(plan_id="p"), on_reply=on_reply)
        ends = time.monotonic() + WAIT_S
        while not sent.transfer.handed and time.monotonic() < ends:  # sent before it stops
            threading.Event().wait(0.01)
        server.stop(None)
        assert failed.wait(WAIT_S)
    finally:
        client.close()
    assert len(errors) == 1 and isinstance(errors[0], TransportError)
