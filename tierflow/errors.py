"""The one error hierarchy of tierflow.

Every error a user can cause or meet is a :class:`TierflowError`; the CLI prints its
message on one line and exits non-zero, never with a traceback. Errors from gRPC, ONNX
and ONNX Runtime are translated where they enter (``raise PlanError(...) from exc``).
Messages say what was expected and what was found.

    TierflowError
    ├── UsageError          bad command-line values: unknown tier/link names, malformed
    │                       rates, sizes, RTTs, shapes
    │   └── ProviderError   an ONNX Runtime execution provider that is unknown or not
    │                       available here (the message lists the available ones)
    ├── ModelError          not an ONNX file, truncated, invalid graph, unsupported ops,
    │                       unknown symbolic dimensions
    ├── ProfileError        malformed profile, or a profile made for another model
    ├── PlanError           malformed plan directory, a budget nothing fits, a plan that
    │                       does not match the model
    │   └── SegmentError    a segment file fetched from another tier differs from the
    │                       sha256 in plan.json, is not offered there, or does not fit
    │                       --segment-budget
    ├── InputError          request inputs with the wrong names, shapes or dtypes
    │   └── StateError      a session used as it cannot be: named with another plan than
    │                       its own, a step out of order, a prompt longer than the context
    ├── StateLostError      a tier no longer holds a session's state at the request's
    │                       position (evicted, idle too long, restarted): the device
    │                       replays the session (wire code STATE_LOST)
    ├── CodecError          corrupt, oversized or hostile encoded tensors (including
    │                       decompression bombs)
    ├── CacheError          a feature-cache backend failed or was misconfigured
    ├── MissingExtraError   an optional dependency is not installed; says which extra
    │                       brings it (``pip install 'tierflow[plan]'``)
    └── TransportError      a tier could not be reached or went away mid-stream
        ├── DeadlineError   a request was not answered within its deadline
        └── RemoteError     another tier answered a request with an error; ``code``
                            names its kind (one of the ``ErrorCode`` names in the proto)

Asserts are only for internal invariants, never for user input.
"""

from __future__ import annotations


class TierflowError(Exception):
    """Base class of every error tierflow raises on purpose."""


class UsageError(TierflowError):
    """A command-line value is malformed or names something that does not exist."""


class ProviderError(UsageError):
    """An execution provider is unknown, or not offered by the installed onnxruntime."""


class ModelError(TierflowError):
    """An ONNX model cannot be loaded, analysed or run as given."""


class ProfileError(TierflowError):
    """A profile file is malformed or belongs to another model."""


class PlanError(TierflowError):
    """A plan cannot be made, read or used."""


class SegmentError(PlanError):
    """A segment file cannot be had as the plan describes it (``runtime.segment_store``)."""


class InputError(TierflowError):
    """Inputs of a request do not match what the model expects."""


class StateError(InputError):
    """A session is used in a way its state cannot follow."""


class StateLostError(TierflowError):
    """A tier does not hold the session's state at the request's position any more."""


class CodecError(TierflowError):
    """An encoded tensor is corrupt, oversized or not what it claims to be."""


class CacheError(TierflowError):
    """A feature cache backend failed."""


class MissingExtraError(TierflowError):
    """An optional dependency is missing: ``module``, installed by the extra ``extra``."""

    def __init__(self, message: str, *, module: str, extra: str) -> None:
        super().__init__(message)
        self.module = module
        self.extra = extra


class TransportError(TierflowError):
    """A tier could not be reached, or the stream to it broke."""


class DeadlineError(TransportError):
    """A request was not answered within its deadline."""


class RemoteError(TransportError):
    """Another tier answered a request with an error.

    ``code`` is the name of the wire ``ErrorCode`` (for example ``"INVALID_INPUT"``),
    ``tier`` the tier that raised it.
    """

    def __init__(self, message: str, *, code: str = "INTERNAL", tier: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.tier = tier


# How a tier reads another tier's failure: by the wire code of a RemoteError, here once.

#: Wire codes that mean a tier is gone: the one called (``UNAVAILABLE``, an edge stopping)
#: or the one after it (``UPSTREAM_UNAVAILABLE``). Not late, not a bad request.
GONE_CODES = ("UNAVAILABLE", "UPSTREAM_UNAVAILABLE")


def is_state_lost(error: BaseException | None) -> bool:
    """Whether another tier answered that it no longer holds a session's state there."""
    return isinstance(error, RemoteError) and error.code == "STATE_LOST"


def is_upstream_gone(error: BaseException | None) -> bool:
    """Whether the next tier answered that the tier after it is gone (the cloud, to a device)."""
    return isinstance(error, RemoteError) and error.code == "UPSTREAM_UNAVAILABLE"


def is_gone(error: BaseException | None) -> bool:
    """Whether another tier answered that a tier is gone (one of :data:`GONE_CODES`)."""
    return isinstance(error, RemoteError) and error.code in GONE_CODES


def is_missing(error: BaseException | None) -> bool:
    """Whether a failure means a tier is not there: it said so (:func:`is_gone`), or it
    could not be reached or went away (not late, not a bad request)."""
    if isinstance(error, RemoteError):
        return error.code in GONE_CODES
    return isinstance(error, TransportError) and not isinstance(error, DeadlineError)


#: Most characters of a value an error message quotes (see :func:`shown`).
SHOWN_CHARS = 60


def shown(value: object, limit: int = SHOWN_CHARS) -> str:
    """``value`` as an error message quotes it: its ``repr``, clipped to about ``limit``.

    A message says what was found, but a value can be a whole file (a profile given where
    a link was expected, 10 KB of JSON) or a line of junk: the message keeps its start and
    says how long it was, so that the error stays one readable line.
    """
    text = value if isinstance(value, str) else repr(value)
    if len(text) <= limit:
        return repr(value)
    head = repr(text[: max(limit - 3, 1)])
    return f"{head[:-1]}...{head[-1]} ({len(text):,} characters)"
