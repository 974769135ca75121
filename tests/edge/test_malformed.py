"""Hostile and malformed requests get typed error replies; the tier keeps serving.

The tier's answers are checked in process ([Note: the next tier in process] in
tierflow/runtime/upstream.py); a message over gRPC's size limit needs a server.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import zstandard

from tierflow.options import RuntimeOptions
from tierflow.plan import load_plan
from tierflow.rpc import tier_pb2, tier_pb2_grpc
from tierflow.runtime.server import TierServer
from tierflow.runtime.tier import Tier
from tierflow.runtime.upstream import LocalUpstream
from tierflow.transport.wire import encode_tensors, grpc_options

CLOUD_SEGMENT = 2  # the cnn's cloud segment reads h2: float32[1x8x8x8]


def _request(plan_id: str, **tensors: np.ndarray) -> tier_pb2.Request:
    return tier_pb2.Request(
        id="r", plan_id=plan_id, segment=CLOUD_SEGMENT, tensors=encode_tensors(tensors, "raw")
    )


def _h2(dtype: Any = np.float32, shape: tuple[int, ...] = (1, 8, 8, 8)) -> np.ndarray:
    return np.random.default_rng(0).standard_normal(shape).astype(dtype)


def _exchange(
    stub: tier_pb2_grpc.TierStub, requests: list[tier_pb2.Request]
) -> list[tier_pb2.Reply]:
    """Send ``requests`` on one stream (ids made unique); return the replies in order."""
    for index, request in enumerate(requests):
        request.id = f"q{index}"
    replies = {r.id: r for r in stub.Infer(iter(requests), timeout=20)}
    assert sorted(replies) == sorted(r.id for r in requests)  # exactly one reply each
    return [replies[r.id] for r in requests]


LIMITS = RuntimeOptions(max_message_bytes=1 << 20, max_tensor_bytes=1 << 20)


@pytest.fixture
def local_cloud(tmp_path: Path, rt: Any) -> Iterator[tuple[LocalUpstream, str]]:
    """The cloud in this process, as the edge sends to it."""
    split = rt.cnn(tmp_path / "plan", {"device-edge": "zstd", "edge-cloud": "zstd"})
    plan = load_plan(split.plan_dir)
    cloud = Tier("cloud", plan, split.plan_dir, options=LIMITS)
    cloud.load()
    try:
        yield LocalUpstream(cloud, me="edge"), plan.plan_id
    finally:
        cloud.close(0.5)


@pytest.fixture
def cloud(tmp_path: Path, rt: Any) -> Iterator[tuple[tier_pb2_grpc.TierStub, str]]:
    split = rt.cnn(tmp_path / "plan", {"device-edge": "zstd", "edge-cloud": "zstd"})
    plan = load_plan(split.plan_dir)
    server = TierServer(Tier("cloud", plan, split.plan_dir, options=LIMITS), "127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(server.address, options=grpc_options(8 << 20))
    try:
        yield tier_pb2_grpc.TierStub(channel), plan.plan_id
    finally:
        channel.close()
        server.stop(0.5)


def _code(reply: tier_pb2.Reply) -> str:
    assert reply.HasField("error"), reply
    assert reply.error.tier == "cloud"
    return str(tier_pb2.ErrorCode.Name(reply.error.code))


def test_malformed_requests_get_typed_errors_and_the_tier_goes_on(local_cloud: Any) -> None:
    cloud, plan_id = local_cloud
    garbage = _request(plan_id, h2=_h2())
    garbage.tensors[0].data = b"not a tensor"
    bomb = _request(plan_id, h2=_h2())
    # 64 MiB of zeros compress to a few KiB; the frame declares 64 MiB.
    bomb.tensors[0].codec = "zstd"
    bomb.tensors[0].data = zstandard.ZstdCompressor().compress(bytes(64 << 20))
    huge = _request(plan_id, h2=_h2())
    del huge.tensors[0].shape[:]
    huge.tensors[0].shape.extend([1 << 16, 1 << 16])
    wrong_segment = _request(plan_id, h2=_h2())
    wrong_segment.segment = 1
    duplicated = _request(plan_id, h2=_h2())
    duplicated.tensors.append(duplicated.tensors[0])
    late = _request(plan_id, h2=_h2())
    late.deadline_unix_s = time.time() - 1
    cases = [
        (_request(plan_id, h2=_h2()), None),
        (garbage, "CODEC"),
        (_request(plan_id, h2=_h2(np.float64)), "INVALID_INPUT"),
        (_request(plan_id, h2=_h2(shape=(1, 8, 4, 4))), "INVALID_INPUT"),
        (_request("0123456789abcdef", h2=_h2()), "PLAN_MISMATCH"),
        (bomb, "CODEC"),
        (huge, "CODEC"),
        (wrong_segment, "INVALID_INPUT"),
        (_request(plan_id, other=_h2()), "INVALID_INPUT"),
        (duplicated, "INVALID_INPUT"),  # two tensors where the plan expects one
        (late, "DEADLINE_EXCEEDED"),
        (_request(plan_id, h2=_h2()), None),
    ]
    replies = [cloud.submit(request).future.result() for request, _ in cases]
    for (_, expected), reply in zip(cases, replies, strict=True):
        if expected is None:
            assert not reply.HasField("error") and reply.answered_by == "cloud"
            assert [t.name for t in reply.outputs] == ["y"]
        else:
            assert _code(reply) == expected, reply.error.message
            assert reply.error.message  # says what was expected and found
    assert "expected" in replies[2].error.message and "float64" in replies[2].error.message


@pytest.mark.integration
def test_a_message_over_the_size_limit_is_refused_and_the_server_still_serves(
    cloud: Any,
) -> None:
    stub, plan_id = cloud
    oversized = _request(plan_id, h2=_h2())
    oversized.tensors[0].params = bytes(2 << 20)  # the server takes at most 1 MiB messages
    with pytest.raises(grpc.RpcError) as info:
        _exchange(stub, [oversized])
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    (reply,) = _exchange(stub, [_request(plan_id, h2=_h2())])
    assert not reply.HasField("error")
