"""Between the codec and gRPC: tensors and typed errors as wire messages; channel options.

Every gRPC server and channel in tierflow is built with :data:`GRPC_OPTIONS` (or
:func:`grpc_options` for another message-size limit), so that the limits on both ends
agree: a message the sender may send, the receiver may receive.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import grpc
import numpy as np
from google.protobuf.message import DecodeError

from tierflow.codec.base import (
    DEFAULT_MAX_TENSOR_BYTES,
    Checked,
    CodecSpec,
    EncodedTensor,
    ImageNorm,
    check,
    decode,
    decoded_nbytes,
    encode,
)
from tierflow.errors import (
    CodecError,
    DeadlineError,
    InputError,
    PlanError,
    RemoteError,
    StateLostError,
    TierflowError,
    TransportError,
)
from tierflow.link.spec import LINKS, TIERS
from tierflow.rpc import tier_pb2, tier_pb2_grpc

# Where requests enter a tier their deadline is checked ([Note: one deadline]).
from tierflow.transport.deadline import check_deadline as check_deadline

logger = logging.getLogger(__name__)

#: Default limit on one gRPC message, each way.
DEFAULT_MESSAGE_BYTES = 256 * 1024 * 1024
#: Default bound on all tensors of one message together, once decoded: without it, one
#: 256 MiB message of small zstd frames could each declare a legal 1 GiB tensor.
DEFAULT_MAX_DECODED_BYTES = 2 * DEFAULT_MAX_TENSOR_BYTES
#: Longest tensor name accepted from the wire.
MAX_NAME_CHARS = 1024
#: Longest codec text accepted from the wire (valid ones are far shorter).
MAX_CODEC_CHARS = 64
# Framing a message may add around its tensors' payloads (names, shapes, timings, ids).
_MESSAGE_OVERHEAD = 64 * 1024
_TENSOR_OVERHEAD = 2 * 1024


def zstd_bound(nbytes: int) -> int:
    """Largest zstd frame for ``nbytes`` of input (ZSTD_compressBound, plus header and checksum)."""
    margin = (128 * 1024 - nbytes) >> 11 if nbytes < 128 * 1024 else 0
    return nbytes + (nbytes >> 8) + margin + 32


def message_size_limit(max_tensor_bytes: int, tensors: int = 1) -> int:
    """Bytes a message carrying ``tensors`` tensors of up to ``max_tensor_bytes`` can take.

    Uses the worst case of every codec (incompressible data through zstd, int8c params
    are far smaller than the payload they describe), so a sender never exceeds it.
    """
    if max_tensor_bytes < 0 or tensors < 0:
        raise ValueError(f"sizes must not be negative, got {max_tensor_bytes} and {tensors}")
    per_tensor = zstd_bound(max_tensor_bytes) + _TENSOR_OVERHEAD
    return tensors * per_tensor + _MESSAGE_OVERHEAD


def grpc_options(max_message_bytes: int = DEFAULT_MESSAGE_BYTES) -> list[tuple[str, int]]:
    """Options for ``grpc.server(options=...)`` and ``grpc.insecure_channel(options=...)``.

    Message-size limits both ways; keepalive pings every 20 s (10 s to answer) even
    between requests, so a dead peer on a long-lived stream is noticed, and servers
    accept pings that often (the server default would answer them with GOAWAY).
    """
    limit = min(int(max_message_bytes), 2**31 - 1)
    return [
        ("grpc.max_send_message_length", limit),
        ("grpc.max_receive_message_length", limit),
        ("grpc.keepalive_time_ms", 20_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
        ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ]


#: What every tierflow server and channel uses.
GRPC_OPTIONS: list[tuple[str, int]] = grpc_options()

#: The codec that carries a tensor's bytes as they are.
RAW = CodecSpec.parse("raw")


def to_proto(tensor: EncodedTensor) -> tier_pb2.Tensor:
    """The wire message for an encoded tensor."""
    return tier_pb2.Tensor(
        name=tensor.name,
        dtype=tensor.dtype,
        shape=list(tensor.shape),
        codec=tensor.codec,
        params=tensor.params,
        data=tensor.data,
    )


def from_proto(
    message: tier_pb2.Tensor, *, max_bytes: int = DEFAULT_MAX_TENSOR_BYTES
) -> EncodedTensor:
    """An encoded tensor from the wire, its header validated (see ``codec.check_header``)."""
    return received(message, max_bytes=max_bytes)[0]


def received(
    message: tier_pb2.Tensor, *, max_bytes: int = DEFAULT_MAX_TENSOR_BYTES
) -> tuple[EncodedTensor, Checked]:
    """An encoded tensor from the wire and its checked header, for ``decode(checked=...)``."""
    if not isinstance(message, tier_pb2.Tensor):
        raise CodecError(f"expected a tierflow.rpc.Tensor message, got {type(message).__name__}")
    if len(message.name) > MAX_NAME_CHARS:
        raise CodecError(
            f"tensor name of {len(message.name)} characters, expected at most {MAX_NAME_CHARS}"
        )
    if len(message.codec) > MAX_CODEC_CHARS:
        raise CodecError(f"codec text of {len(message.codec)} characters is not a codec")
    tensor = EncodedTensor(
        name=message.name,
        dtype=message.dtype,
        shape=tuple(message.shape),
        codec=message.codec,
        params=message.params,
        data=message.data,
    )
    return tensor, check(tensor, max_bytes=max_bytes)


def encode_tensors(
    arrays: Mapping[str, np.ndarray], spec: CodecSpec | str
) -> list[tier_pb2.Tensor]:
    """Encode named arrays with one codec, in the mapping's order."""
    codec = CodecSpec.of(spec)
    return [to_proto(encode(name, array, codec)) for name, array in arrays.items()]


def decode_tensors(
    messages: Sequence[tier_pb2.Tensor],
    *,
    max_bytes: int = DEFAULT_MAX_TENSOR_BYTES,
    max_total_bytes: int = DEFAULT_MAX_DECODED_BYTES,
) -> dict[str, np.ndarray]:
    """Decode wire tensors into named arrays; duplicates and corruption are CodecErrors.

    ``max_bytes`` bounds each decoded tensor and ``max_total_bytes`` all of them
    together; every header is checked before any payload is decoded, so a bad last
    tensor costs no work (and no memory) on the first ones.
    """
    checked = [received(m, max_bytes=max_bytes) for m in messages]
    tensors = [tensor for tensor, _ in checked]
    names = [t.name for t in tensors]
    if len(set(names)) != len(names):
        duplicates = sorted({n for n in names if names.count(n) > 1})
        raise CodecError(f"tensors {duplicates} appear more than once in one message")
    total = sum(decoded_nbytes(t) for t in tensors)
    if total > max_total_bytes:
        raise CodecError(
            f"{len(tensors)} tensors would decode to {total} bytes together, more than the "
            f"limit of {max_total_bytes}"
        )
    return {t.name: decode(t, checked=c) for t, c in checked}


def put_tensors(
    field: Any,
    arrays: Mapping[str, np.ndarray],
    spec: CodecSpec,
    images: Mapping[str, ImageNorm] | None = None,
) -> int:
    """Encode ``arrays`` straight into a repeated ``Tensor`` field; return the bytes encoded.

    With an image codec, the arrays named in ``images`` travel as images (with their
    normalisation) and the others raw ([Note: image inputs] in :mod:`tierflow.plan`).

    Building each element in place copies the payload once. Appending separately built
    ``Tensor`` messages (``Request(tensors=[...])``) was measured about 30 times slower
    for a 1 MB tensor with the upb protobuf runtime (7 ms against 0.25 ms).
    """
    total = 0
    plain = spec.lossless_part() if spec.image else spec
    for name, array in arrays.items():
        norm = (images or {}).get(name) if spec.image else None
        tensor = encode(name, array, spec, image=norm) if norm else encode(name, array, plain)
        field.add(
            name=tensor.name,
            dtype=tensor.dtype,
            shape=tensor.shape,
            codec=tensor.codec,
            params=tensor.params,
            data=tensor.data,
        )
        total += tensor.nbytes
    return total


# Which wire ErrorCode each error becomes (first match; anything else is INTERNAL).
_CODES: tuple[tuple[type[TierflowError], str], ...] = (
    (StateLostError, "STATE_LOST"),
    (InputError, "INVALID_INPUT"),
    (CodecError, "CODEC"),
    (PlanError, "PLAN_MISMATCH"),
    (DeadlineError, "DEADLINE_EXCEEDED"),
    (TransportError, "UNAVAILABLE"),
)


def error_to_proto(exc: BaseException, tier: str) -> tier_pb2.Error:
    """The wire error for an exception; a RemoteError keeps its code and tier."""
    if isinstance(exc, RemoteError):
        name = exc.code if exc.code in tier_pb2.ErrorCode.keys() else "INTERNAL"  # noqa: SIM118
        return tier_pb2.Error(code=name, message=str(exc), tier=exc.tier or tier)
    for kind, code in _CODES:
        if isinstance(exc, kind):
            return tier_pb2.Error(code=code, message=str(exc), tier=tier)
    return tier_pb2.Error(code="INTERNAL", message=f"{type(exc).__name__}: {exc}", tier=tier)


def error_from_proto(error: tier_pb2.Error) -> RemoteError:
    """The :class:`RemoteError` a caller sees for a wire error."""
    code = tier_pb2.ErrorCode.Name(error.code) if error.code in tier_pb2.ErrorCode.values() else ""
    tier = error.tier or "remote tier"
    return RemoteError(f"{tier}: {code or 'INTERNAL'}: {error.message}", code=code, tier=tier)


class Undecodable:
    """What a server's stream yields in place of a message that does not parse.

    gRPC would otherwise end the whole stream (and log a traceback) for one bad message;
    the service answers this one with a typed error instead and reads on.
    """

    __slots__ = ("message",)

    def __init__(self, message: str) -> None:
        self.message = message


def _tolerant(parse: Callable[[bytes], Any], what: str) -> Callable[[bytes], Any]:
    def deserialize(data: bytes) -> Any:
        try:
            return parse(data)
        except (DecodeError, ValueError) as exc:
            return Undecodable(f"undecodable {what} of {len(data)} bytes: {exc}")

    return deserialize


def add_tier_servicer(servicer: tier_pb2_grpc.TierServicer, server: grpc.Server) -> None:
    """``add_TierServicer_to_server``, but a message that does not parse becomes
    :class:`Undecodable` in the stream instead of ending it (the stubs stay generated)."""
    handlers = {
        "Infer": grpc.stream_stream_rpc_method_handler(
            servicer.Infer,
            request_deserializer=_tolerant(tier_pb2.Request.FromString, "request"),
            response_serializer=tier_pb2.Reply.SerializeToString,
        ),
        "Probe": grpc.stream_stream_rpc_method_handler(
            servicer.Probe,
            request_deserializer=_tolerant(tier_pb2.ProbeMessage.FromString, "probe message"),
            response_serializer=tier_pb2.ProbeMessage.SerializeToString,
        ),
        "FetchSegment": grpc.unary_stream_rpc_method_handler(
            servicer.FetchSegment,
            request_deserializer=tier_pb2.SegmentRequest.FromString,
            response_serializer=tier_pb2.SegmentChunk.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("tierflow.rpc.Tier", handlers),)
    )
    server.add_registered_method_handlers("tierflow.rpc.Tier", handlers)


#: The largest time a timing may report (ms): a day.
MAX_FIGURE_MS = 86_400_000.0
#: The largest byte count and rate a link figure may report.
MAX_FIGURE_BYTES = 1 << 40
MAX_FIGURE_BPS = 1e13


def _timing_problem(timing: tier_pb2.TierTiming) -> str | None:
    """Why a tier's timing cannot have been measured (None: it can)."""
    for name in ("compute_ms", "codec_ms", "queue_ms"):
        value = getattr(timing, name)
        if not 0.0 <= value <= MAX_FIGURE_MS:  # NaN fails too
            return f"the {timing.tier}'s {name} is {value!r}: not a time"
    return None


def _link_problem(stat: tier_pb2.LinkStat) -> str | None:
    """Why a link's figures cannot have been measured (None: they can)."""
    if not 0 <= stat.bytes <= MAX_FIGURE_BYTES:
        return f"link {stat.link} reports {stat.bytes} bytes"
    for name in ("send_ms", "queue_ms"):
        value = getattr(stat, name)
        if not 0.0 <= value <= MAX_FIGURE_MS:
            return f"link {stat.link}'s {name} is {value!r}: not a time"
    if not 0.0 <= stat.rate_bps <= MAX_FIGURE_BPS:
        return f"link {stat.link}'s rate is {stat.rate_bps!r} bit/s"
    return None


def check_figures(message: tier_pb2.Request | tier_pb2.Reply) -> None:
    """Refuse timings and link figures no tier could have measured (an :class:`InputError`).

    At most one timing per tier and one figure per link, named as they are named; every
    time and rate finite, not negative and within a day (:data:`MAX_FIGURE_MS`); byte
    counts within :data:`MAX_FIGURE_BYTES`. A request of 20,000 timings of 1e308 ms is
    refused at once, before anything else is done with it.
    """
    if not message.timings and not message.links:  # a request as tierflow sends it
        return
    tiers = [timing.tier for timing in message.timings]
    if len(tiers) > len(TIERS) or len(set(tiers)) != len(tiers) or not set(tiers) <= set(TIERS):
        raise InputError(
            f"a message may carry one timing per tier ({', '.join(TIERS)}); this one carries "
            f"{len(tiers)}: {sorted(set(tiers))[:6]}"
        )
    for timing in message.timings:
        problem = _timing_problem(timing)
        if problem is not None:
            raise InputError(problem)
    links = [stat.link for stat in message.links]
    if len(links) > len(LINKS) or len(set(links)) != len(links) or not set(links) <= set(LINKS):
        raise InputError(
            f"a message may carry one figure per link ({', '.join(LINKS)}); this one carries "
            f"{len(links)}: {sorted(set(links))[:6]}"
        )
    for stat in message.links:
        problem = _link_problem(stat)
        if problem is not None:
            raise InputError(problem)


def clean_figures(reply: tier_pb2.Reply, me: str) -> list[str]:
    """Drop from ``reply`` the figures no tier above ``me`` could have measured; say why.

    [Note: figures in a reply]
    A reply carries each tier's timings and each link's figures, and the caller believes
    them: the device reports them (``run --json``, ``--report``) and feeds its link
    estimators with them; the edge's metrics count them. A tier that answered with NaN,
    infinite, 1e308 or negative times, 20,000 timings or a link of 2^62 bytes was once
    believed: ``run --json`` printed ``Infinity``, which is not JSON, and the device's
    bandwidth estimate moved. So the client end of every stream (the device's and the
    edge's, ``tierflow.transport.stream_client``) checks a reply's figures as a tier
    checks a request's (:func:`check_figures`), but keeps the answer: the outputs were
    made by the model, the figures only describe how. What fails is dropped, the whole
    timing or link entry: a timing of a tier that is not above ``me`` (the tiers above
    report their own; ``me`` adds its own after), a second timing of one tier, a link
    not sent from a tier above ``me``, one given twice, and any entry with a time or
    rate that is not finite, is negative or is beyond a day (:data:`MAX_FIGURE_MS`),
    a rate beyond :data:`MAX_FIGURE_BPS` or a byte count beyond
    :data:`MAX_FIGURE_BYTES`. Each reply with figures dropped is one warning, counted
    in the metrics ([Note: warnings about a peer] in tierflow/transport/peer_warnings.py).
    At most the first three reasons are returned, then how many more there were.
    """
    if not reply.timings and not reply.links:
        return []
    above = TIERS[TIERS.index(me) + 1 :] if me in TIERS else TIERS
    problems: list[str] = []
    seen: set[str] = set()
    timings = []
    for timing in reply.timings:
        if timing.tier not in above or timing.tier in seen:
            problem: str | None = f"a timing of {timing.tier[:32]!r} in a reply to the {me}"
        else:
            problem = _timing_problem(timing)
        if problem is None:
            seen.add(timing.tier)
            timings.append(timing)
        else:
            problems.append(problem)
    seen.clear()
    links = []
    for stat in reply.links:
        if stat.link not in LINKS or stat.link.split("-")[0] not in above or stat.link in seen:
            problem = f"a figure of link {stat.link[:32]!r} in a reply to the {me}"
        else:
            problem = _link_problem(stat)
        if problem is None:
            seen.add(stat.link)
            links.append(stat)
        else:
            problems.append(problem)
    if not problems:
        return []
    kept_timings = [_copy(timing, tier_pb2.TierTiming()) for timing in timings]
    kept_links = [_copy(stat, tier_pb2.LinkStat()) for stat in links]
    del reply.timings[:]
    reply.timings.extend(kept_timings)
    del reply.links[:]
    reply.links.extend(kept_links)
    if len(problems) > 3:
        problems = [*problems[:3], f"and {len(problems) - 3} more"]
    return problems


_M = TypeVar("_M", tier_pb2.TierTiming, tier_pb2.LinkStat)


def _copy(source: _M, into: _M) -> _M:
    into.CopyFrom(source)
    return into
