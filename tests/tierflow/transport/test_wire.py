"""Tests for tierflow.transport.wire: proto conversion, batch helpers, and gRPC message limits."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent import futures

import grpc
import numpy as np
import pytest
import zstandard

from tierflow.codec.base import CodecSpec, encode
from tierflow.errors import (
    CodecError,
    DeadlineError,
    InputError,
    PlanError,
    RemoteError,
    TransportError,
)
from tierflow.rpc import tier_pb2, tier_pb2_grpc
from tierflow.transport.wire import (
    DEFAULT_MESSAGE_BYTES,
    GRPC_OPTIONS,
    decode_tensors,
    encode_tensors,
    error_from_proto,
    error_to_proto,
    from_proto,
    grpc_options,
    message_size_limit,
    put_tensors,
    to_proto,
    zstd_bound,
)


@pytest.mark.parametrize("codec", ["raw", "zstd:7", "shuffle+zstd", "fp16+zstd", "int8c+zstd"])
def test_proto_round_trip_through_serialised_bytes(codec: str) -> None:
    array = np.linspace(-2, 2, 2 * 3 * 4 * 5, dtype=np.float32).reshape(2, 3, 4, 5)
    encoded = encode("features", array, codec)
    message = tier_pb2.Tensor.FromString(to_proto(encoded).SerializeToString())
    assert from_proto(message) == encoded
    assert list(message.shape) == [2, 3, 4, 5]
    assert message.codec == str(CodecSpec.parse(codec))


def test_encode_and_decode_tensors_keep_names_order_and_dtypes() -> None:
    arrays = {
        "hidden": np.arange(12, dtype=np.float32).reshape(3, 4),
        "mask": np.array([[True, False, True]]),
        "ids": np.arange(5, dtype=np.int64),
        "scalar": np.array(7.5),
    }
    messages = encode_tensors(arrays, "int8+zstd")
    assert [m.name for m in messages] == list(arrays)
    assert [m.codec for m in messages] == ["int8+zstd", "zstd", "zstd", "int8+zstd"]
    decoded = decode_tensors(messages)
    assert list(decoded) == list(arrays)
    for name, array in arrays.items():
        assert decoded[name].dtype == array.dtype and decoded[name].shape == array.shape
    assert np.array_equal(decoded["mask"], arrays["mask"])
    assert np.array_equal(decoded["ids"], arrays["ids"])
    assert np.abs(decoded["hidden"] - arrays["hidden"]).max() <= 11 / 255 / 2 + 1e-6
    assert decoded["scalar"] == 7.5


def test_put_tensors_builds_the_same_messages_as_encode_tensors() -> None:
    arrays = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(4, np.int64)}
    request = tier_pb2.Request()
    nbytes = put_tensors(request.tensors, arrays, CodecSpec.parse("zstd"))
    assert list(request.tensors) == encode_tensors(arrays, "zstd")
    assert nbytes == sum(len(t.data) + len(t.params) for t in request.tensors)


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (InputError("bad shape"), "INVALID_INPUT"),
        (CodecError("corrupt"), "CODEC"),
        (PlanError("other plan"), "PLAN_MISMATCH"),
        (DeadlineError("late"), "DEADLINE_EXCEEDED"),
        (TransportError("cloud gone"), "UNAVAILABLE"),
        (ValueError("a bug"), "INTERNAL"),
    ],
)
def test_errors_cross_the_wire_with_their_code_and_tier(error: Exception, code: str) -> None:
    wire = tier_pb2.Error.FromString(error_to_proto(error, "edge").SerializeToString())
    assert tier_pb2.ErrorCode.Name(wire.code) == code
    remote = error_from_proto(wire)
    assert (remote.code, remote.tier) == (code, "edge")
    assert str(error) in str(remote)
    # Passed on by a lower tier, it keeps the code and the tier that raised it.
    again = error_from_proto(error_to_proto(remote, "device"))
    assert (again.code, again.tier) == (code, "edge")


def test_an_unknown_wire_code_is_internal() -> None:
    remote = error_from_proto(tier_pb2.Error(code=99, message="?", tier=""))
    assert isinstance(remote, RemoteError)
    assert "INTERNAL" in str(remote)
    assert remote.tier == "remote tier"


def test_decode_tensors_refuses_duplicates() -> None:
    messages = encode_tensors({"a": np.zeros(3)}, "raw") * 2
    with pytest.raises(CodecError, match=r"\['a'\] appear more than once"):
        decode_tensors(messages)


def test_decode_tensors_checks_every_header_before_decoding() -> None:
    good, bad = encode_tensors({"a": np.zeros(3), "b": np.zeros(3)}, "raw")
    bad.shape[:] = [1 << 40]
    with pytest.raises(CodecError, match="limit"):
        decode_tensors([good, bad])
    with pytest.raises(CodecError, match="limit"):
        decode_tensors([good], max_bytes=8)


def test_decode_tensors_bounds_the_whole_message() -> None:
    frame = zstandard.ZstdCompressor(level=1).compress(bytes(1 << 20))
    bombs = [
        tier_pb2.Tensor(name=f"t{i}", dtype="uint8", shape=[1 << 20], codec="zstd", data=frame)
        for i in range(8)
    ]
    assert sum(m.ByteSize() for m in bombs) < 8 << 10  # 8 MiB declared in a few KiB
    with pytest.raises(CodecError, match="together"):
        decode_tensors(bombs, max_total_bytes=4 << 20)
    assert len(decode_tensors(bombs, max_total_bytes=8 << 20)) == 8


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("name", "n" * 2000, "name"),
        ("codec", "zstd" * 40, "codec"),
        ("codec", "bogus", "codec"),
        ("dtype", "object", "dtype"),
    ],
)
def test_from_proto_validates_the_header(field: str, value: str, message: str) -> None:
    proto = to_proto(encode("a", np.zeros(3, np.float32), "raw"))
    setattr(proto, field, value)
    with pytest.raises(CodecError, match=message):
        from_proto(proto)


def test_from_proto_refuses_other_messages() -> None:
    with pytest.raises(CodecError, match="Tensor"):
        from_proto(tier_pb2.Request())


def test_grpc_options_set_limits_and_keepalive() -> None:
    options = dict(GRPC_OPTIONS)
    assert options["grpc.max_send_message_length"] == DEFAULT_MESSAGE_BYTES
    assert options["grpc.max_receive_message_length"] == DEFAULT_MESSAGE_BYTES
    assert options["grpc.keepalive_time_ms"] > 0
    assert (
        options["grpc.http2.min_recv_ping_interval_without_data_ms"]
        <= options["grpc.keepalive_time_ms"]
    )
    assert dict(grpc_options(1 << 40))["grpc.max_send_message_length"] == 2**31 - 1


def test_message_size_limit_covers_incompressible_tensors() -> None:
    rng = np.random.default_rng(0)
    noise = rng.integers(0, 256, 1 << 20, dtype=np.uint8).view(np.float32)
    request = tier_pb2.Request(
        id="r" * 36,
        plan_id="p" * 16,
        tensors=encode_tensors({"a": noise, "b": noise[:1000]}, "zstd:1"),
    )
    assert request.tensors[0].ByteSize() > noise.nbytes  # zstd expanded it
    assert request.ByteSize() <= message_size_limit(noise.nbytes, tensors=2)
    assert zstd_bound(0) > 0 and zstd_bound(1 << 20) < (1 << 20) * 1.01
    with pytest.raises(ValueError):
        message_size_limit(-1)


class _Echo(tier_pb2_grpc.TierServicer):
    """Answers Probe with the payload it got (only the wire limits are under test)."""

    def Probe(
        self, request_iterator: Iterator[tier_pb2.ProbeMessage], context: grpc.ServicerContext
    ) -> Iterator[tier_pb2.ProbeMessage]:
        for message in request_iterator:
            yield tier_pb2.ProbeMessage(seq=message.seq, payload=message.payload)


@pytest.fixture
def echo_server() -> Iterator[tuple[int, int]]:
    """Two servers on 127.0.0.1: one with GRPC_OPTIONS, one with a 1 MiB limit."""
    servers = []
    ports = []
    for options in (GRPC_OPTIONS, grpc_options(1 << 20)):
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=options)
        tier_pb2_grpc.add_TierServicer_to_server(_Echo(), server)
        ports.append(server.add_insecure_port("127.0.0.1:0"))
        server.start()
        servers.append(server)
    yield ports[0], ports[1]
    for server in servers:
        server.stop(grace=None).wait()


@pytest.mark.integration
def test_options_let_messages_beyond_grpc_default_through(echo_server: tuple[int, int]) -> None:
    big_port, small_port = echo_server
    payload = bytes(8 << 20)  # twice gRPC's default 4 MiB receive limit
    with grpc.insecure_channel(f"127.0.0.1:{big_port}", options=GRPC_OPTIONS) as channel:
        stub = tier_pb2_grpc.TierStub(channel)
        replies = list(stub.Probe(iter([tier_pb2.ProbeMessage(seq=1, payload=payload)])))
        assert [len(r.payload) for r in replies] == [len(payload)]
    with grpc.insecure_channel(f"127.0.0.1:{small_port}", options=GRPC_OPTIONS) as channel:
        stub = tier_pb2_grpc.TierStub(channel)
        with pytest.raises(grpc.RpcError) as caught:
            list(stub.Probe(iter([tier_pb2.ProbeMessage(seq=1, payload=payload)])))
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_timings_and_link_figures_no_tier_could_measure_are_refused() -> None:
    """Issue 20, item 14: 20,000 timings of 1e308 ms, NaN rates, unknown names."""
    from tierflow.transport.wire import check_figures

    fine = tier_pb2.Request()
    fine.timings.add(tier="device", compute_ms=1.5, codec_ms=0.2, queue_ms=0.0)
    fine.links.add(link="device-edge", bytes=4096, send_ms=0.3, rate_bps=1e8)
    check_figures(fine)
    many = tier_pb2.Request()
    for _ in range(20_000):
        many.timings.add(tier="edge", compute_ms=1e308)
    bad_value = tier_pb2.Request()
    bad_value.timings.add(tier="edge", compute_ms=float("nan"))
    bad_rate = tier_pb2.Request()
    bad_rate.links.add(link="edge-cloud", rate_bps=float("inf"))
    unknown = tier_pb2.Request()
    unknown.links.add(link="moon-link")
    negative = tier_pb2.Reply()
    negative.links.add(link="device-edge", bytes=-5)
    for message, words in [
        (many, "one timing per tier"),
        (bad_value, "not a time"),
        (bad_rate, "rate is inf"),
        (unknown, "one figure per link"),
        (negative, "-5 bytes"),
    ]:
        with pytest.raises(InputError, match=words):
            check_figures(message)


def test_a_replys_figures_no_tier_above_could_measure_are_dropped_and_the_rest_kept() -> None:
    """Issue 28 finding 5: NaN, infinite, 1e308 and negative times, 20,000 timings and
    2^62 link bytes in a reply were believed."""
    from tierflow.transport.wire import clean_figures

    reply = tier_pb2.Reply(answered_by="cloud")
    reply.outputs.add(name="y", dtype="float32", shape=[1], codec="raw", data=b"\0" * 4)
    reply.timings.add(tier="cloud", compute_ms=2.0, codec_ms=0.5, queue_ms=0.1)
    reply.timings.add(tier="cloud", compute_ms=1.0)  # a second cloud timing
    reply.timings.add(tier="edge", compute_ms=1.0)  # the edge adds its own, later
    reply.links.add(link="edge-cloud", bytes=2**62, send_ms=1.0, rate_bps=1e8)
    outputs = list(reply.outputs)
    assert clean_figures(reply, "edge") == [
        "a timing of 'cloud' in a reply to the edge",
        "a timing of 'edge' in a reply to the edge",
        "a figure of link 'edge-cloud' in a reply to the edge",
    ]
    assert [(t.tier, t.compute_ms) for t in reply.timings] == [("cloud", 2.0)]
    assert not reply.links and list(reply.outputs) == outputs

    to_device = tier_pb2.Reply()
    to_device.timings.add(tier="edge", compute_ms=1.0)
    to_device.timings.add(tier="cloud", compute_ms=float("inf"))
    to_device.links.add(link="edge-cloud", bytes=2**62, send_ms=1.0)
    to_device.links.add(link="device-edge", bytes=100)  # the device measures its own
    problems = clean_figures(to_device, "device")
    assert problems[0] == "the cloud's compute_ms is inf: not a time"
    assert problems[1] == f"link edge-cloud reports {2**62} bytes"
    assert [t.tier for t in to_device.timings] == ["edge"] and not to_device.links

    many = tier_pb2.Reply()
    for value in (float("nan"), -1.0, 1e308, *([1.0] * 20_000)):
        many.timings.add(tier="cloud", queue_ms=value)
    problems = clean_figures(many, "edge")
    assert len(problems) == 4 and problems[-1] == "and 19999 more"
    assert [t.queue_ms for t in many.timings] == [1.0]

    fine = tier_pb2.Reply()
    fine.timings.add(tier="cloud", compute_ms=3.0)
    fine.links.add(link="edge-cloud", bytes=4096, send_ms=0.3, rate_bps=1e8)
    before = fine.SerializeToString()
    assert clean_figures(fine, "device") == [] and fine.SerializeToString() == before
