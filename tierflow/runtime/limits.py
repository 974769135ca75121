"""The largest message a tier takes: what its plans can legitimately send it, and no more.

[Note: a tier's largest request]
gRPC parses a message whole before the service sees it, and a message of two million tiny
tensors is cheap to send (57 MB) and dear to parse (the edge peaked at 535 MB and kept
1.3 GB after four). The tensor-count check on the request path comes too late for that.
So each tier tells gRPC the largest message its plans can send it, and gRPC refuses
anything larger as it arrives, before parsing (RESOURCE_EXHAUSTED). The bound is worked
out from ``plan.json`` alone (its ``"tensors"``: dtype and shape of every tensor a request
carries), before any segment is loaded:

* for each plan of the set, the tensors a request entering this tier carries
  (:meth:`~tierflow.plan.Plan.carried`), each at its raw size under the codec's worst
  case (zstd's bound over the raw bytes, plus a quantiser's parameters: at most the raw
  bytes again for the smallest tensors), and a session's first request's fixed states;
* a symbolic dimension is a decoder's context (``plan --context``) in a decoder plan, else
  unknown: a plan with a symbolic dimension outside a decoder, or written before tensors
  were recorded, gets no bound beyond ``--max-message-bytes``;
* the largest over the set's plans, times 1.25, plus 64 KiB for names, timings and
  framing, and never less than a probe's payload (:data:`PROBE_PAYLOAD_BYTES`:
  ``tierflow probe`` sends its payload up in one message).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np

from tierflow.plan import Plan, TensorShape
from tierflow.transport.wire import zstd_bound

#: Bytes a probe message may carry up (``tierflow probe --payload``, idle probes).
PROBE_PAYLOAD_BYTES = 4 * 1024 * 1024
#: What a request adds around its tensor bytes: names, headers, timings, framing.
_FRAMING_BYTES = 64 * 1024
#: Headroom over the computed bound.
_HEADROOM = 1.25


def tensor_bound(shape: TensorShape, symbolic: int | None) -> int | None:
    """The most bytes ``shape`` can put on a link; None when a dimension is unbounded."""
    dims = []
    for dim in shape.shape:
        if dim is None:
            if symbolic is None:
                return None
            dim = symbolic
        dims.append(dim)
    raw = math.prod(dims) * np.dtype(shape.dtype).itemsize
    return zstd_bound(raw) + raw // 4 + 1024  # worst codec, its parameters, the header


def plan_bound(plan: Plan, tier: str) -> int | None:
    """The largest request ``plan`` can send ``tier`` (None: it cannot be told)."""
    if not plan.tensors:
        return None
    symbolic = plan.decoder.context if plan.decoder is not None else None
    total = 0
    for name in plan.carried(plan.entry(tier)):
        shape = plan.tensors.get(name)
        size = None if shape is None else tensor_bound(shape, symbolic)
        if size is None:
            return None
        total += size
    for state in plan.states:
        if state.grows is None:  # a fixed state may come with a session's first request
            total += zstd_bound(state.nbytes(symbolic=1))
    return total


def receive_limit(plans: Iterable[Plan], tier: str, ceiling: int) -> int:
    """What gRPC at ``tier`` accepts: the plans' largest request with headroom, at most
    ``ceiling`` (``--max-message-bytes``) ([Note: a tier's largest request])."""
    bounds = [plan_bound(plan, tier) for plan in plans]
    if not bounds or any(b is None for b in bounds):
        return ceiling
    largest = max(b for b in bounds if b is not None)
    limit = int(largest * _HEADROOM) + _FRAMING_BYTES
    return min(ceiling, max(limit, PROBE_PAYLOAD_BYTES + _FRAMING_BYTES))
