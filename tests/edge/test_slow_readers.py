"""A client that sends requests but never reads its replies costs nobody else anything.

See [Note: slow readers] in tierflow/runtime/replies.py: the edge's thread that receives the
cloud's replies never waits for one device, and the stream that does not read is
cancelled once a reply has waited ``reply_timeout`` for it.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from tierflow.edge.forwarding import Forwarding
from tierflow.link.spec import LinkSpec
from tierflow.options import RuntimeOptions
from tierflow.plan import load_plan
from tierflow.rpc import tier_pb2, tier_pb2_grpc
from tierflow.runtime.segment_runner import TierRunner
from tierflow.runtime.server import TierServer
from tierflow.transport.stream_client import StreamClient
from tierflow.transport.wire import decode_tensors, grpc_options, put_tensors

pytestmark = pytest.mark.integration

REPLY_TIMEOUT_S = 1.0


def _device_request(plan_dir: Path, feeds: dict[str, np.ndarray], rid: str) -> tier_pb2.Request:
    plan = load_plan(plan_dir)
    outcome = TierRunner(plan, plan_dir, "device").run(feeds)
    request = tier_pb2.Request(id=rid, plan_id=plan.plan_id, segment=outcome.next_segment)
    put_tensors(request.tensors, outcome.tensors, plan.link_codec("device-edge"))
    return request


@contextlib.contextmanager
def _tiers(plan_dir: Path, links: dict[str, LinkSpec]) -> Iterator[TierServer]:
    options = RuntimeOptions(workers=2, reply_timeout=REPLY_TIMEOUT_S, links=links)
    cloud = TierServer.from_plan("cloud", plan_dir, "127.0.0.1:0", options=options)
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


@pytest.mark.parametrize("links", [{}, {"device-edge": LinkSpec(10e9)}], ids=["direct", "shaped"])
def test_a_client_that_never_reads_delays_no_device_and_is_cancelled(
    tmp_path: Path, rt: Any, links: dict[str, LinkSpec]
) -> None:
    """Replies written directly, and through an emulated link's queue (one writer thread)."""
    split = rt.wide(tmp_path / "plan")  # 256 KB replies: a few fill any HTTP/2 window
    feeds = split.sample(0, count=2)
    slow_request = _device_request(split.plan_dir, feeds[0], "slow")
    expected = split.reference(feeds[1])["y"]
    with _tiers(split.plan_dir, links) as edge:
        channel = grpc.insecure_channel(edge.address, options=grpc_options())
        device = StreamClient(edge.address, me="device", peer="edge")
        sent_all = threading.Event()
        hang_up = threading.Event()

        def flood() -> Iterator[tier_pb2.Request]:
            yield from [slow_request] * 80  # 20 MB of replies, none of them read
            sent_all.set()
            hang_up.wait(30)  # keep the stream open from this side

        try:
            slow = tier_pb2_grpc.TierStub(channel).Infer(flood())
            assert sent_all.wait(10), "the edge did not take the slow client's requests"
            sent_at = time.monotonic()
            time.sleep(0.3)  # the edge's writes to the slow client are stuck by now
            device_request = _device_request(split.plan_dir, feeds[1], "device")
            for _ in range(5):
                started = time.monotonic()
                sent = device.submit(device_request, deadline=started + 2.0)
                reply = sent.future.result(timeout=5)
                assert not reply.HasField("error"), reply.error
                assert time.monotonic() - started < 2.0
                np.testing.assert_array_equal(decode_tensors(reply.outputs)["y"], expected)
            admission = edge.service.admission
            while admission.open_streams > 1 and time.monotonic() - sent_at < 10:
                time.sleep(0.01)
            assert admission.open_streams == 1  # the device's stream only
            assert time.monotonic() - sent_at < REPLY_TIMEOUT_S + 2.0
            received = 0
            with pytest.raises(grpc.RpcError) as ended:
                for _ in slow:  # what reached the client before the cancel, then the end
                    received += 1
            assert ended.value.code() == grpc.StatusCode.CANCELLED
            assert received < 80
        finally:
            hang_up.set()
            device.close(timeout=1)
            channel.close()
