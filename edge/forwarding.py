"""The edge's way to the cloud: send a request on, pass what comes back down its stream.

:class:`Forwarding` is the edge's :class:`~tierflow.runtime.tier.Forwarder`: the one
:class:`~tierflow.runtime.upstream.Upstream` to the cloud every device's requests share
(a long-lived gRPC stream, or the cloud's tier in this process), the segment files
fetched from it ([Note: segments on demand] in tierflow/runtime/segment_store.py). What
comes back is taken through the pipeline's way down (:meth:`Pipeline.came_down`: the
cloud's reply, or the edge's answer without it, [Note: answering without the next tier]
in tierflow/runtime/pipeline.py); what the edge adds is its error for a device when it
has no answer of its own (``UPSTREAM_UNAVAILABLE``), a line when the cloud goes and comes
back, and its timing and link figures on the reply.

[Note: checking the next tier at start]
An edge checks, as it starts, that the cloud answers at ``--upstream`` (a health check
within a few seconds). If it does not, the edge still starts, with a warning that names
the address: the cloud may come up later, and the channel keeps trying. Until it has been
reached once, requests that need it fail (or fall back) with a message saying that the
cloud at that address was never reached, not that it went away.
"""

from __future__ import annotations

import logging
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tierflow.errors import TierflowError, TransportError, UsageError
from tierflow.options import RuntimeOptions
from tierflow.rpc import tier_pb2
from tierflow.runtime.pipeline import Down, Onward, Pipeline
from tierflow.runtime.replies import Send
from tierflow.runtime.segment_store import SegmentSource
from tierflow.runtime.upstream import StreamUpstream, Upstream
from tierflow.transport.stream_client import Sent
from tierflow.transport.wire import error_to_proto

logger = logging.getLogger(__name__)

#: How long an edge waits at start for the cloud's health check (see
#: [Note: checking the next tier at start]).
UPSTREAM_CHECK_S = 3.0


class Forwarding:
    """Requests from the edge to the cloud at ``address`` (a target list for replicas), or
    through ``upstream`` when given (the cloud in this process: [Note: the next tier in
    process] in tierflow/runtime/upstream.py)."""

    def __init__(
        self, address: str = "", *, peer: str = "cloud", upstream: Upstream | None = None
    ) -> None:
        if upstream is None and not address:
            raise UsageError(f"the edge forwards to the {peer}: give its address or upstream")
        self.address = upstream.address if upstream is not None else address
        self.peer = upstream.peer if upstream is not None else peer
        self.tier = "edge"
        self.upstream = upstream
        self._lost = False  # the next tier was found gone and has not answered since

    def open(self, tier: str, options: RuntimeOptions) -> None:
        """Open the stream to the next tier; warn if it does not answer yet."""
        self.tier = tier
        if self.upstream is None:
            upstream = StreamUpstream(self.address, me=tier, peer=self.peer, options=options)
            self.upstream = upstream
            self._check(upstream.stream.channel)

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

    def segment_source(self) -> SegmentSource | None:
        assert self.upstream is not None, "open first"
        return self.upstream.segment_source()

    def close(self, timeout: float) -> None:
        if self.upstream is not None:
            self.upstream.close(timeout=timeout)

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
        sent = pipeline.send(
            self.upstream,
            index,
            onward,
            deadline=local_deadline,
            on_reply=lambda sent: self._forwarded(
                sent, pipeline, index, onward, request_id, timing, send
            ),
        )
        if isinstance(sent, Down):  # refused at once: the next tier is known to be down
            reply = self._passed_down(pipeline, index, sent)
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
        got: tier_pb2.Reply | BaseException
        try:
            got = sent.future.result()
        except Exception as exc:  # a failure, a cancelled future, a bug: still one reply
            got = exc
        reply = self._passed_down(pipeline, index, pipeline.came_down(index, onward, got))
        reply.id = request_id
        reply.timings.append(timing)
        reply.links.append(sent.transfer.stat(pipeline.up_link or ""))
        send(reply)

    def _passed_down(self, pipeline: Pipeline, index: int, down: Down) -> tier_pb2.Reply:
        """The reply the edge writes for what came down: the cloud's, or the edge's own
        answer without it, or an error."""
        if down.gone is not None:
            return self._without_upstream(pipeline, index, down, down.gone)
        if down.failure is not None:
            return tier_pb2.Reply(error=error_to_proto(down.failure, self.tier))
        assert down.reply is not None
        if self._lost and not down.reply.HasField("error"):
            self._lost = False
            logger.info("[%s] the %s answers again", self.tier, self.peer)
        return down.reply

    def _without_upstream(
        self, pipeline: Pipeline, index: int, down: Down, cause: TierflowError
    ) -> tier_pb2.Reply:
        """The reply to a request the next tier cannot take ([Note: answering without the
        next tier]): the edge's exit's answer, or UPSTREAM_UNAVAILABLE for the device."""
        if not self._lost:
            self._lost = True
            how = "from its exits" if down.answered is not None else "UPSTREAM_UNAVAILABLE"
            logger.warning(
                "[%s] the %s is unavailable (%s); answering %s", self.tier, self.peer, cause, how
            )
        if down.answered is not None:
            return pipeline.answer(index, down.answered)
        missing = TransportError(f"the {self.peer} is unavailable: {cause}")
        error = error_to_proto(missing, self.tier)
        error.code = tier_pb2.ErrorCode.UPSTREAM_UNAVAILABLE
        plan_id = pipeline.plans.plans[index].plan_id
        return tier_pb2.Reply(plan_id=plan_id, error=error)
