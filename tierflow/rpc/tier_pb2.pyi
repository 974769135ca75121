from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ErrorCode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ERROR_CODE_UNSPECIFIED: _ClassVar[ErrorCode]
    INVALID_INPUT: _ClassVar[ErrorCode]
    CODEC: _ClassVar[ErrorCode]
    PLAN_MISMATCH: _ClassVar[ErrorCode]
    UNAVAILABLE: _ClassVar[ErrorCode]
    DEADLINE_EXCEEDED: _ClassVar[ErrorCode]
    INTERNAL: _ClassVar[ErrorCode]
    OVERLOADED: _ClassVar[ErrorCode]
    UPSTREAM_UNAVAILABLE: _ClassVar[ErrorCode]
    STATE_LOST: _ClassVar[ErrorCode]
ERROR_CODE_UNSPECIFIED: ErrorCode
INVALID_INPUT: ErrorCode
CODEC: ErrorCode
PLAN_MISMATCH: ErrorCode
UNAVAILABLE: ErrorCode
DEADLINE_EXCEEDED: ErrorCode
INTERNAL: ErrorCode
OVERLOADED: ErrorCode
UPSTREAM_UNAVAILABLE: ErrorCode
STATE_LOST: ErrorCode

class Tensor(_message.Message):
    __slots__ = ("name", "dtype", "shape", "codec", "params", "data")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    codec: str
    params: bytes
    data: bytes
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., codec: _Optional[str] = ..., params: _Optional[bytes] = ..., data: _Optional[bytes] = ...) -> None: ...

class TierTiming(_message.Message):
    __slots__ = ("tier", "compute_ms", "codec_ms", "queue_ms")
    TIER_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    CODEC_MS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    tier: str
    compute_ms: float
    codec_ms: float
    queue_ms: float
    def __init__(self, tier: _Optional[str] = ..., compute_ms: _Optional[float] = ..., codec_ms: _Optional[float] = ..., queue_ms: _Optional[float] = ...) -> None: ...

class LinkStat(_message.Message):
    __slots__ = ("link", "bytes", "send_ms", "rate_bps", "queue_ms")
    LINK_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SEND_MS_FIELD_NUMBER: _ClassVar[int]
    RATE_BPS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    link: str
    bytes: int
    send_ms: float
    rate_bps: float
    queue_ms: float
    def __init__(self, link: _Optional[str] = ..., bytes: _Optional[int] = ..., send_ms: _Optional[float] = ..., rate_bps: _Optional[float] = ..., queue_ms: _Optional[float] = ...) -> None: ...

class Error(_message.Message):
    __slots__ = ("code", "message", "tier")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    code: ErrorCode
    message: str
    tier: str
    def __init__(self, code: _Optional[_Union[ErrorCode, str]] = ..., message: _Optional[str] = ..., tier: _Optional[str] = ...) -> None: ...

class Request(_message.Message):
    __slots__ = ("id", "plan_id", "segment", "tensors", "timings", "links", "deadline_unix_s", "session", "position", "initial_state", "keep_last", "choices_only", "on_behalf_of", "replay_to", "members")
    ID_FIELD_NUMBER: _ClassVar[int]
    PLAN_ID_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    LINKS_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    INITIAL_STATE_FIELD_NUMBER: _ClassVar[int]
    KEEP_LAST_FIELD_NUMBER: _ClassVar[int]
    CHOICES_ONLY_FIELD_NUMBER: _ClassVar[int]
    ON_BEHALF_OF_FIELD_NUMBER: _ClassVar[int]
    REPLAY_TO_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    id: str
    plan_id: str
    segment: int
    tensors: _containers.RepeatedCompositeFieldContainer[Tensor]
    timings: _containers.RepeatedCompositeFieldContainer[TierTiming]
    links: _containers.RepeatedCompositeFieldContainer[LinkStat]
    deadline_unix_s: float
    session: str
    position: int
    initial_state: _containers.RepeatedCompositeFieldContainer[Tensor]
    keep_last: int
    choices_only: bool
    on_behalf_of: str
    replay_to: int
    members: _containers.RepeatedCompositeFieldContainer[Request]
    def __init__(self, id: _Optional[str] = ..., plan_id: _Optional[str] = ..., segment: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ..., timings: _Optional[_Iterable[_Union[TierTiming, _Mapping]]] = ..., links: _Optional[_Iterable[_Union[LinkStat, _Mapping]]] = ..., deadline_unix_s: _Optional[float] = ..., session: _Optional[str] = ..., position: _Optional[int] = ..., initial_state: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ..., keep_last: _Optional[int] = ..., choices_only: _Optional[bool] = ..., on_behalf_of: _Optional[str] = ..., replay_to: _Optional[int] = ..., members: _Optional[_Iterable[_Union[Request, _Mapping]]] = ...) -> None: ...

class Reply(_message.Message):
    __slots__ = ("id", "plan_id", "outputs", "answered_by", "exit", "cache_hit", "timings", "links", "error", "fallback", "members")
    ID_FIELD_NUMBER: _ClassVar[int]
    PLAN_ID_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    ANSWERED_BY_FIELD_NUMBER: _ClassVar[int]
    EXIT_FIELD_NUMBER: _ClassVar[int]
    CACHE_HIT_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    LINKS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    id: str
    plan_id: str
    outputs: _containers.RepeatedCompositeFieldContainer[Tensor]
    answered_by: str
    exit: str
    cache_hit: bool
    timings: _containers.RepeatedCompositeFieldContainer[TierTiming]
    links: _containers.RepeatedCompositeFieldContainer[LinkStat]
    error: Error
    fallback: str
    members: _containers.RepeatedCompositeFieldContainer[Reply]
    def __init__(self, id: _Optional[str] = ..., plan_id: _Optional[str] = ..., outputs: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ..., answered_by: _Optional[str] = ..., exit: _Optional[str] = ..., cache_hit: _Optional[bool] = ..., timings: _Optional[_Iterable[_Union[TierTiming, _Mapping]]] = ..., links: _Optional[_Iterable[_Union[LinkStat, _Mapping]]] = ..., error: _Optional[_Union[Error, _Mapping]] = ..., fallback: _Optional[str] = ..., members: _Optional[_Iterable[_Union[Reply, _Mapping]]] = ...) -> None: ...

class ProbeMessage(_message.Message):
    __slots__ = ("seq", "payload", "reply_bytes")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    REPLY_BYTES_FIELD_NUMBER: _ClassVar[int]
    seq: int
    payload: bytes
    reply_bytes: int
    def __init__(self, seq: _Optional[int] = ..., payload: _Optional[bytes] = ..., reply_bytes: _Optional[int] = ...) -> None: ...

class SegmentRequest(_message.Message):
    __slots__ = ("file", "sha256", "offset", "chunk_bytes")
    FILE_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    file: str
    sha256: str
    offset: int
    chunk_bytes: int
    def __init__(self, file: _Optional[str] = ..., sha256: _Optional[str] = ..., offset: _Optional[int] = ..., chunk_bytes: _Optional[int] = ...) -> None: ...

class SegmentChunk(_message.Message):
    __slots__ = ("offset", "data", "size")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    offset: int
    data: bytes
    size: int
    def __init__(self, offset: _Optional[int] = ..., data: _Optional[bytes] = ..., size: _Optional[int] = ...) -> None: ...
