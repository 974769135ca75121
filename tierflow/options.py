"""How a tier runs: one :class:`RuntimeOptions`, built once from the command line.

The runners, the tier service, the servers and the device client all read the same
settings (ONNX Runtime threads and optimization level, emulated slowdown and links, size
limits, TLS and tokens); they take them as one frozen value instead of each repeating
the keyword list. This module knows nothing of a command line: ``tierflow serve``,
``run``, ``device`` and ``generate`` declare their flags with
``tierflow.cli.runtime_arguments.add_runtime_arguments``, whose defaults are read from
``RuntimeOptions()`` (so ``--help`` shows the defaults a library user gets, written once),
and make the value from the parsed flags with
``tierflow.cli.runtime_arguments.runtime_options``; a library user makes one directly, or
varies one with :func:`dataclasses.replace`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from tierflow.codec.base import DEFAULT_MAX_TENSOR_BYTES
from tierflow.errors import UsageError
from tierflow.link.spec import LinkSpec
from tierflow.link.trace import LinkTrace
from tierflow.onnxrt.inference import (
    DEFAULT_OPTIMIZATION,
    check_optimization,
)
from tierflow.onnxrt.providers import CPU
from tierflow.state.store import default_state_budget
from tierflow.transport.security import Security
from tierflow.transport.wire import DEFAULT_MESSAGE_BYTES

#: Streams a tier serves at once, all peers together ([Note: stream admission] in
#: tierflow/runtime/admission.py).
DEFAULT_MAX_STREAMS = 1024
#: Streams a tier serves at once from one peer (host).
DEFAULT_MAX_STREAMS_PER_PEER = 256
#: Requests a tier accepts in flight (all streams together) before answering OVERLOADED.
DEFAULT_MAX_IN_FLIGHT = 1024
#: Seconds a reply may wait for its client to read before the stream is cancelled.
DEFAULT_REPLY_TIMEOUT_S = 5.0
#: Seconds a stream with nothing in flight stays open without a message (see
#: [Note: stream admission] in tierflow/runtime/admission.py).
DEFAULT_STREAM_IDLE_S = 60.0
#: Seconds a tier keeps a session's state without a request (see
#: [Note: session state on a tier] in tierflow/state/store.py).
DEFAULT_STATE_IDLE_S = 600.0
#: Decode steps of different sessions run as one call at most; 1 turns batching off (see
#: [Note: the step batcher] in tierflow/runtime/batching.py).
DEFAULT_MAX_BATCH = 16
#: The longest ``--batch-delay`` accepted: a step waits at most this for company.
MAX_BATCH_DELAY_S = 0.1


@dataclass(frozen=True)
class RuntimeOptions:
    """The settings every runtime part reads; checked when made.

    ``threads``: ONNX Runtime intra-op threads per request (0: one per core).
    ``slowdown``: run this many times slower than this machine (emulation; >= 1).
    ``optimization``: ONNX Runtime level ([Note: optimization level and exactness] in
    ``tierflow.onnxrt.inference``). ``workers``: requests a server runs at once (None: one per
    core). ``links``: the links to emulate by name, fixed or traced (``tierflow.link.emulation``),
    read-only.
    ``max_tensor_bytes`` / ``max_message_bytes``: the largest decoded tensor and gRPC
    message accepted. ``max_in_flight``: requests a server holds before answering
    OVERLOADED. ``max_streams`` / ``max_streams_per_peer``: streams a server serves at
    once in all and from one host ([Note: stream admission] in ``tierflow.runtime.admission``).
    ``reply_timeout``: seconds a reply may wait for a client that does not read before
    its stream is cancelled ([Note: slow readers] in ``tierflow.runtime.replies``).
    ``security``: TLS and tokens (``tierflow.transport.security``). ``providers``: ONNX
    Runtime execution providers in order of preference (``tierflow.onnxrt.providers``).
    ``state_budget``: bytes of session state the tier keeps, all sessions together (None:
    no bound; by default a share of the machine's memory), ``state_share`` each owner's
    part of it (None: an equal split among the owners holding state), and
    ``state_idle_s`` how long a session's state is kept without a request ([Note: session
    state on a tier] in ``tierflow.state.store``).
    ``segment_budget``: bytes of segment files the tier keeps (None: no bound; see
    [Note: segments on demand] in ``tierflow.runtime.segment_store``).
    ``max_batch``: decode steps of different sessions run as one call at most (1: none),
    ``batch_delay_s`` how long a step may wait for company when other sessions are
    active, ``batch_padding`` whether steps of different past lengths are padded into one
    call (not bit-exact; [Note: batching exactness] in ``tierflow.runtime.batching``).
    """

    threads: int = 1
    slowdown: float = 1.0
    optimization: str = DEFAULT_OPTIMIZATION
    workers: int | None = None
    links: Mapping[str, LinkSpec | LinkTrace] = field(default_factory=dict)
    max_tensor_bytes: int = DEFAULT_MAX_TENSOR_BYTES
    max_message_bytes: int = DEFAULT_MESSAGE_BYTES
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT
    max_streams: int = DEFAULT_MAX_STREAMS
    max_streams_per_peer: int = DEFAULT_MAX_STREAMS_PER_PEER
    reply_timeout: float = DEFAULT_REPLY_TIMEOUT_S
    security: Security = field(default_factory=Security)
    providers: tuple[str, ...] = (CPU,)
    segment_budget: int | None = None
    state_budget: int | None = field(default_factory=default_state_budget)
    state_share: int | None = None
    state_idle_s: float = DEFAULT_STATE_IDLE_S
    stream_idle_s: float = DEFAULT_STREAM_IDLE_S
    max_batch: int = DEFAULT_MAX_BATCH
    batch_delay_s: float = 0.0
    batch_padding: bool = False

    def __post_init__(self) -> None:
        if self.threads < 0:
            raise UsageError(f"threads must be >= 0 (0: one per core), got {self.threads}")
        if not self.slowdown >= 1.0:
            raise UsageError(f"slowdown must be at least 1.0, got {self.slowdown}")
        check_optimization(self.optimization)
        if self.workers is not None and self.workers < 1:
            raise UsageError(f"workers must be >= 1, got {self.workers}")
        limits = ("max_tensor_bytes", "max_message_bytes", "max_in_flight", "max_streams")
        for name in (*limits, "max_streams_per_peer"):
            if getattr(self, name) < 1:
                raise UsageError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 < self.reply_timeout < float("inf"):
            raise UsageError(f"reply_timeout must be a positive number, got {self.reply_timeout}")
        if not self.providers:
            raise UsageError("providers must name at least one execution provider")
        if self.segment_budget is not None and self.segment_budget < 0:
            raise UsageError(f"segment_budget must be >= 0, got {self.segment_budget}")
        if self.state_budget is not None and self.state_budget < 0:
            raise UsageError(f"state_budget must be >= 0, got {self.state_budget}")
        if self.state_share is not None and self.state_share < 1:
            raise UsageError(f"state_share must be >= 1, got {self.state_share}")
        if not 0 < self.state_idle_s < float("inf"):
            raise UsageError(f"state_idle_s must be a positive number, got {self.state_idle_s}")
        if not 0 < self.stream_idle_s < float("inf"):
            raise UsageError(f"stream_idle_s must be a positive number, got {self.stream_idle_s}")
        if self.max_batch < 1:
            raise UsageError(f"max_batch must be >= 1 (1: no batching), got {self.max_batch}")
        if not 0 <= self.batch_delay_s <= MAX_BATCH_DELAY_S:
            raise UsageError(
                f"batch_delay_s must be between 0 and {MAX_BATCH_DELAY_S:g} s, "
                f"got {self.batch_delay_s}"
            )
        object.__setattr__(self, "links", MappingProxyType(dict(self.links)))
        object.__setattr__(self, "providers", tuple(self.providers))
