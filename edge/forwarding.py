"""The edge's way to the cloud: send a request on, pass its reply down, answer without it.

:class:`Forwarding` is the edge's :class:`~tierflow.runtime.service.Forwarder`: the one
long-lived stream to the cloud (``tierflow.transport.stream_client``) every device's
requests share, the segment files fetched over the same channel ([Note: segments on
demand] in tierflow/runtime/segment_store.py), and what the edge answers when the cloud
is gone ([Note: answering without the next tier]).

[Note: answering without the next tier]
When the next tier cannot be reached (the stream to it broke, it is known to be down, or
it answered UNAVAILABLE because it is stopping), a request that has already crossed to
this tier still gets one answer from here. If the plan has an early exit on this tier,
the request's scores at that exit (checked and found not confident enough) are the
answer, marked with ``Reply.fallback`` (why), never cached. Otherwise the reply is an
``UPSTREAM_UNAVAILABLE`` error: the device, which still holds the request's inputs,
finishes it with a plan of its set that does not need the missing tier ([Note: losing a
tier] in device/fallback.py). The features computed here are not sent back: the
device would need the missing tier's segment files to use them, and a plan without that
tier reproduces the model from the inputs bit for bit anyway.

[Note: checking the next tier at start]
An edge checks, as it starts, that the cloud answers at ``--upstream`` (a health check
within a few seconds). If it does not, the edge still starts, with a warning that names
the address: the cloud may come up later, and the channel keeps trying. Until it has been
reached once, requests that need it fail (or fall back) with a message saying that the
cloud at that address was never reached, not that it went away.
"""

from __future__ import annotations

import contextlib
import logging
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tierflow.errors import TierflowError, TransportError, is_gone, is_missing
from tierflow.options import RuntimeOptions
from tierflow.rpc import tier_pb2
from tierflow.runtime.pipeline import Answered, Onward, Pipeline
from tierflow.runtime.segment_store import SegmentSource
from tierflow.runtime.service import Send
from tierflow.runtime.upstream import connect, segment_source
from tierflow.transport.stream_client import Sent, StreamClient
from tierflow.transport.wire import decode_tensors, error_from_proto, error_to_proto

logger = logging.getLogger(__name__)

#: How long an edge waits at start for the cloud's health check (see
#: [Note: checking the next tier at start]).
UPSTREAM_CHECK_S = 3.0


class Forwarding:
    """Requests from the edge to the cloud at ``address`` (a target list for replicas)."""

    def __init__(self, address: str, *, peer: str = "cloud") -> None:
        self.address = address
        self.peer = peer
        self.tier = "edge"
        self.upstream: StreamClient | None = None
        self._lost = False  # the next tier was found gone and has not answered since
        # Stores the next tier's answers in this tier's cache, off the replies' way.
        self._storing = ThreadPoolExecutor(1, thread_name_prefix="edge-cache-store")

    def open(self, tier: str, options: RuntimeOptions) -> None:
        """Open the channel and its stream; warn if the next tier does not answer yet."""
        self.tier = tier
        self.upstream = connect(self.address, me=tier, peer=self.peer, options=options)
        self._check(self.upstream.channel)

    def _check(self, channel: grpc.Channel) -> None:
        """[Note: checking the next tier at start]."""
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=UPSTREAM_CHECK_S)
        except grpc.RpcError as exc:
            detail = exc.details() if isinstance(exc, grpc.Call) else str(exc)
            logger.warning(
                "[%s] the %s at %s does not answer (%s); serving anyway, requests that "
                "need it fail until it is up",
                self.tier,
                self.peer,
                self.address,
                detail,
            )
        else:
            logger.info("[%s] the %s at %s answers", self.tier, self.peer, self.address)

    def segment_source(self) -> SegmentSource:
        assert self.upstream is not None, "open first"
        return segment_source(self.upstream)

    def close(self, timeout: float) -> None:
        if self.upstream is not None:
            self.upstream.close(timeout=timeout)
        self._storing.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ forwarding

    def forward(
        self,
        pipeline: Pipeline,
        index: int,
        onward: Onward,
        request_id: str,
        timing: tier_pb2.TierTiming,
        send: Send,
    ) -> tier_pb2.Reply | None:
        """Send ``onward`` to the next tier; its reply goes to ``send`` with this tier's
        timing and link figures added. A next tier known to be down is answered for at once."""
        assert self.upstream is not None, "open first"
        deadline = onward.request.deadline_unix_s
        local_deadline = None
        if deadline:
            local_deadline = time.monotonic() + max(deadline - time.time(), 0.0)
        try:
            self.upstream.submit(
                onward.request,
                deadline=local_deadline,
                nbytes=onward.nbytes,
                on_reply=lambda sent: self._forwarded(
                    sent, pipeline, index, onward, request_id, timing, send
                ),
            )
        except TransportError as exc:  # known to be down: no waiting for it
            reply = self._without_upstream(pipeline, index, onward, exc)
            reply.timings.append(timing)
            return reply
        return None

    def _forwarded(
        self,
        sent: Sent,
        pipeline: Pipeline,
        index: int,
        onward: Onward,
        request_id: str,
        timing: tier_pb2.TierTiming,
        send: Send,
    ) -> None:
        """The next tier answered (or failed): add this tier's figures and pass it down."""
        gone: TierflowError | None = None
        try:
            reply = sent.future.result()
            if reply.HasField("error"):  # [Note: answering without the next tier]
                answered = error_from_proto(reply.error)
                gone = answered if is_gone(answered) else None
        except TierflowError as exc:
            reply = _error_reply(request_id, exc, self.tier)
            gone = exc if is_missing(exc) else None
        except Exception as exc:  # a cancelled future, a bug: still one reply
            reply = _error_reply(request_id, exc, self.tier)
        if gone is not None:
            reply = self._without_upstream(pipeline, index, onward, gone)
        elif self._lost and not reply.HasField("error"):
            self._lost = False
            logger.info("[%s] the %s answers again", self.tier, self.peer)
        reply.id = request_id
        reply.timings.append(timing)
        reply.links.append(sent.transfer.stat(pipeline.up_link or ""))
        send(reply)
        cacheable = not (reply.HasField("error") or reply.cache_hit or reply.fallback)
        if onward.key is not None and cacheable:
            outputs = list(reply.outputs)
            with contextlib.suppress(RuntimeError):  # shut down: the edge is stopping
                self._storing.submit(self._store, pipeline, onward, outputs, reply.exit or None)

    def _store(
        self,
        pipeline: Pipeline,
        onward: Onward,
        outputs: list[tier_pb2.Tensor],
        exit_name: str | None,
    ) -> None:
        """Keep the next tier's answer in this tier's cache (off the reply's way)."""
        assert onward.key is not None
        try:
            pipeline.store(onward.key, onward.features, decode_tensors(outputs), exit_name)
        except Exception:
            logger.exception("[%s] could not cache the %s's answer", self.tier, self.peer)

    def _without_upstream(
        self, pipeline: Pipeline, index: int, onward: Onward, cause: TierflowError
    ) -> tier_pb2.Reply:
        """The reply to a request the next tier cannot take ([Note: answering without the
        next tier])."""
        unconfident = onward.unconfident
        if not self._lost:
            self._lost = True
            how = "from its exits" if unconfident is not None else "UPSTREAM_UNAVAILABLE"
            logger.warning(
                "[%s] the %s is unavailable (%s); answering %s", self.tier, self.peer, cause, how
            )
        if unconfident is None:
            missing = TransportError(f"the {self.peer} is unavailable: {cause}")
            error = error_to_proto(missing, self.tier)
            error.code = tier_pb2.ErrorCode.UPSTREAM_UNAVAILABLE
            plan_id = pipeline.plans.plans[index].plan_id
            return tier_pb2.Reply(plan_id=plan_id, error=error)
        name, scores = unconfident
        reply = pipeline.answer(index, Answered({name: np.asarray(scores)}, name))
        reply.fallback = (
            f"the {self.peer} is unavailable ({cause}); answered at the {self.tier}'s exit"
        )
        return reply


def _error_reply(request_id: str, exc: BaseException, tier: str) -> tier_pb2.Reply:
    return tier_pb2.Reply(id=request_id, error=error_to_proto(exc, tier))
