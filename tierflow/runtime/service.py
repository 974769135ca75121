"""The ``Tier`` gRPC service an edge or a cloud runs: its calls adapted onto the tier.

:class:`TierService` is the servicer of one :class:`~tierflow.runtime.tier.Tier` ([Note: a
request at a tier] in tierflow/runtime/tier.py), which holds no stream, channel or server.
Each call first takes its stream's place ([Note: stream admission] in
tierflow/runtime/admission.py); then ``Infer`` feeds the stream's requests to the tier and
writes their replies (:func:`~tierflow.runtime.streams.serve_stream`, [Note: a stream's
requests run at once] in tierflow/runtime/streams.py, [Note: slow readers] in
tierflow/runtime/replies.py), ``FetchSegment`` sends a segment file of the tier's ([Note:
segments on demand] in tierflow/runtime/segment_store.py), and ``Probe`` echoes ([Note:
probe credit] in tierflow/runtime/probe.py). Its
:class:`~tierflow.runtime.watchdog.StreamWatchdog` cancels the streams whose replies are
not read, or that went idle.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator

import grpc

from tierflow.link.emulation import LinkShaper
from tierflow.rpc import tier_pb2, tier_pb2_grpc
from tierflow.runtime.admission import StreamAdmission, peer_host
from tierflow.runtime.probe import ProbeCredit, echo
from tierflow.runtime.streams import ProbeActivity, serve_stream
from tierflow.runtime.tier import Tier
from tierflow.runtime.watchdog import StreamWatchdog
from tierflow.transport.callers import caller_of
from tierflow.transport.wire import Undecodable

logger = logging.getLogger(__name__)


class TierService(tier_pb2_grpc.TierServicer):
    """The ``Tier`` servicer of ``tier``, an edge or a cloud; load the tier before serving."""

    def __init__(self, tier: Tier) -> None:
        self.tier = tier
        options = tier.options
        self.admission = StreamAdmission(
            tier.name, options.max_streams, options.max_streams_per_peer
        )
        #: Cancels streams whose replies are not read, or that went idle.
        self.watchdog = StreamWatchdog(tier.name, options, tier.lock, tier.closed_event)
        self.probe_credit = ProbeCredit()
        #: The tokens that name callers ([Note: who a caller is] in tierflow/transport/callers.py).
        self.tokens = options.security.tokens()

    def drain(self, timeout: float) -> bool:
        """:meth:`Tier.drain <tierflow.runtime.tier.Tier.drain>`, each reply counted once it
        is written to its stream."""
        return self.tier.drain(timeout, lambda: self.watchdog.streams)

    def _admit(self, context: grpc.ServicerContext) -> None:
        """Take a place for this stream, or end it OVERLOADED ([Note: stream admission])."""
        peer = peer_host(context.peer())
        refusal = self.admission.admit(peer)
        if refusal is not None:
            logger.info("[%s] stream refused: %s", self.tier.name, refusal)
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, refusal)
        released = threading.Event()

        def release() -> None:
            if not released.is_set():
                released.set()
                self.admission.release(peer)

        if not context.add_callback(release):  # the call already ended
            release()

    def Infer(
        self,
        request_iterator: Iterator[tier_pb2.Request | Undecodable],
        context: grpc.ServicerContext,
        send_response: Callable[[tier_pb2.Reply | None], None] | None = None,
    ) -> Iterator[tier_pb2.Reply] | None:
        """Serve one stream ([Note: a stream's requests run at once]).

        With ``send_response`` (grpc's non-blocking handler form) replies are written by
        the threads that make them ([Note: slow readers]); without it (a grpc that does
        not offer that form), or with an emulated reply link, they go through a queue
        that the returned generator (or one writer thread) drains.
        """
        self._admit(context)
        caller = caller_of(context, self.tokens)
        return serve_stream(
            self.tier, self.watchdog, request_iterator, context, send_response, caller
        )

    def FetchSegment(
        self, request: tier_pb2.SegmentRequest, context: grpc.ServicerContext
    ) -> Iterator[tier_pb2.SegmentChunk]:
        """A segment file in chunks, for the tier below ([Note: segments on demand])."""
        self._admit(context)
        tier = self.tier
        shaper = LinkShaper(tier.down_link, tier.options.links.get(tier.down_link))
        yield from tier.segment_chunks(request, context, shaper)

    def Probe(
        self,
        request_iterator: Iterator[tier_pb2.ProbeMessage | Undecodable],
        context: grpc.ServicerContext,
    ) -> Iterator[tier_pb2.ProbeMessage]:
        """Echo ``reply_bytes`` bytes for each message; the tier's name goes in the metadata.

        What a probe may be sent is bounded per peer ([Note: probe credit] in
        tierflow/runtime/probe.py).
        """
        self._admit(context)
        context.send_initial_metadata((("tierflow-tier", self.tier.name),))
        watched = ProbeActivity(context)
        self.watchdog.track(watched)
        messages = watched.counted(request_iterator)
        try:
            yield from echo(self.tier.name, messages, context, self.probe_credit)
        finally:
            self.watchdog.untrack(watched)


# grpc calls a handler marked so with a third argument, a function that writes one reply
# (None: the final status) from any thread ([Note: slow readers]).
TierService.Infer.experimental_non_blocking = True  # type: ignore[attr-defined]
