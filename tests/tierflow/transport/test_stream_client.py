"""StreamClient.submit's ``on_reply``: called once per request, with the Sent resolved,
whether the peer answered or the stream broke ([Note: the send comes last])."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from tierflow.errors import TransportError
from tierflow.rpc import tier_pb2, tier_pb2_grpc
from tierflow.transport.stream_client import Sent, StreamClient
from tierflow.transport.wire import grpc_options

pytestmark = pytest.mark.integration

WAIT_S = 10.0


class _Echo(tier_pb2_grpc.TierServicer):
    """Answers each request with its id; stops answering once ``mute`` is set."""

    def __init__(self) -> None:
        self.mute = threading.Event()

    def Infer(
        self, request_iterator: Iterator[tier_pb2.Request], context: grpc.ServicerContext
    ) -> Iterator[tier_pb2.Reply]:
        for request in request_iterator:
            if not self.mute.is_set():
                yield tier_pb2.Reply(id=request.id, plan_id=request.plan_id)


@pytest.fixture
def echo() -> Iterator[tuple[grpc.Server, _Echo, str]]:
    server = grpc.server(ThreadPoolExecutor(max_workers=4), options=grpc_options())
    servicer = _Echo()
    tier_pb2_grpc.add_TierServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield server, servicer, f"127.0.0.1:{port}"
    server.stop(None)


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
