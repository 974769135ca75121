"""The next tier up, as the tier below sees it: one :class:`Upstream` for the device and the edge.

The device's way to the edge and the edge's way to the cloud are one kind of thing: send a
request, get its one reply (a future, [Note: one reply per request] in
tierflow/transport/stream_client.py), know when the next tier is down, fetch the segment
files this tier lacks. :class:`StreamUpstream` does it over gRPC: a long-lived
:class:`StreamClient` shaped as the link between the two tiers, with this tier's
message-size limit and its TLS and token setting for the next tier
(:meth:`Security.upstream`), the segment files fetched over the same channel ([Note:
segments on demand] in tierflow/runtime/segment_store.py). :class:`LocalUpstream` calls the
next tier in this process, with the same links and segment fetches ([Note: the next tier
in process]).

[Note: the next tier in process]
:class:`LocalUpstream` hands each request to the next tier
(:class:`~tierflow.runtime.tier.Tier`) on the caller's own thread, the way one of that
tier's streams would (admitted, its session held, handled, counted answered and in the
tier's metrics), with no channel, no gRPC service and no server: the request and its
reply cross as bytes, serialised and parsed as on the wire, so that each tier holds its
own copy. A reply that the tier above it sends on comes back on the same thread before
:meth:`submit` returns. So the device, the edge and the cloud run the whole request path
both ways in one process, and what happens on the way down (an exit answering, the next
tier gone, a cache filled, an error passed down) is tested without starting a server. The
next tier stopping (:meth:`Tier.drain <tierflow.runtime.tier.Tier.drain>`) answers UNAVAILABLE as
it does over gRPC; one that is closed is known to be down.

What a :class:`StreamUpstream` adds to the requests it carries, it adds here too:

* Emulated links ([Note: link shaping] in tierflow/link/emulation.py): the request is
  booked on a :class:`LinkShaper` for this tier's ``options.links`` and leaves when the
  link has carried it, its reply on the next tier's side of the link as that tier's
  options have it. Each request's :class:`Transfer` is its link figures ([Note: honest
  link figures]): the edge reports them on the reply as over gRPC. Unshaped, the crossing
  is the copy as bytes. The links run on ``clock`` and wait with ``sleep``: a test gives
  a fake pair, and the links are timed exactly and never sleep. Since the caller's thread
  carries the request through every tier, a request waits on a link only behind requests
  handed over while the link's clock stood still (a fake clock that nothing advances:
  requests handed at one moment, as a full window hands them).
* Segment files ([Note: segments on demand] in tierflow/runtime/segment_store.py):
  :meth:`segment_source` fetches through the next tier's own ``FetchSegment`` path
  (:meth:`Tier.segment_chunks <tierflow.runtime.tier.Tier.segment_chunks>`: checked,
  held, chunked and shaped on its link), each chunk crossing as bytes, with a
  :class:`LocalContext` for the call; a refusal comes back as the gRPC code a stub's
  caller gets (:class:`LocalCallError`), and a next tier closed during a fetch ends it
  UNAVAILABLE, as a stopped server does.

What stays over gRPC only: channels, TLS and tokens, stream admission ([Note: stream
admission] in tierflow/runtime/admission.py), deadlines swept while a request is
out (the caller's thread is the request's until its reply), requests sent again after a
connection broke, and health checks.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Generator, Iterator
from concurrent.futures import Future
from typing import TYPE_CHECKING, Protocol

import grpc

from tierflow.errors import TransportError
from tierflow.link.emulation import Clock, LinkShaper, Sleep, real_sleep
from tierflow.link.spec import upstream_link
from tierflow.rpc import tier_pb2
from tierflow.runtime.local_call import LocalCallError, LocalContext
from tierflow.runtime.replies import Send
from tierflow.runtime.segment_store import SegmentSource
from tierflow.transport.stream_client import Sent, StreamClient, check_figures

if TYPE_CHECKING:
    from tierflow.options import RuntimeOptions
    from tierflow.runtime.metrics import TierMetrics


class Upstream(Protocol):
    """The next tier up ([Note: the next tier in process] for the in-process one)."""

    #: The next tier's name ("edge", "cloud") and where it is.
    peer: str
    address: str

    @property
    def stream(self) -> StreamClient | None:
        """The gRPC stream to it (probes use its channel); None in process."""

    def submit(
        self,
        request: tier_pb2.Request,
        *,
        deadline: float | None = None,
        nbytes: int | None = None,
        on_reply: Callable[[Sent], None] | None = None,
    ) -> Sent:
        """Send ``request`` (its id is replaced); its one reply comes to the returned future
        ([Note: one reply per request]). Raises TransportError while it is known down."""

    def known_down(self) -> bool:
        """Whether the next tier is known to be down: a request would fail at once."""

    def segment_source(self) -> SegmentSource | None:
        """Where this tier fetches the segment files it lacks (None: nowhere)."""

    def close(self, timeout: float = 5.0) -> None:
        """Stop sending; wait up to ``timeout`` s for what is under way."""


class StreamUpstream:
    """The next tier over gRPC: one long-lived :class:`StreamClient` ([Note: one reply per
    request]) and the segment files fetched over its channel."""

    def __init__(self, address: str, *, me: str, peer: str, options: RuntimeOptions) -> None:
        self.stream = connect(address, me=me, peer=peer, options=options)
        self.peer = peer
        self.address = address

    def submit(
        self,
        request: tier_pb2.Request,
        *,
        deadline: float | None = None,
        nbytes: int | None = None,
        on_reply: Callable[[Sent], None] | None = None,
    ) -> Sent:
        return self.stream.submit(request, deadline=deadline, nbytes=nbytes, on_reply=on_reply)

    def known_down(self) -> bool:
        return self.stream.known_down()

    def segment_source(self) -> SegmentSource:
        return segment_source(self.stream)

    def close(self, timeout: float = 5.0) -> None:
        self.stream.close(timeout=timeout)


class NextTier(Protocol):
    """What :class:`LocalUpstream` needs of the next tier: the part of
    :class:`~tierflow.runtime.tier.Tier` its streams and its ``FetchSegment`` use (this
    module cannot import it: the tier's pipeline sends through an :class:`Upstream`)."""

    name: str
    plan_id: str
    options: RuntimeOptions
    metrics: TierMetrics | None

    @property
    def closed(self) -> bool: ...

    @property
    def down_link(self) -> str: ...

    def admit_request(self) -> tier_pb2.Error | None: ...

    def hold(self, request: tier_pb2.Request, caller: str) -> Callable[[], None]: ...

    def handle(
        self, request: tier_pb2.Request, received: float, later: Send, caller: str = "local"
    ) -> tier_pb2.Reply | None: ...

    def answered(self) -> None: ...

    def segment_chunks(
        self, request: tier_pb2.SegmentRequest, context: grpc.ServicerContext, shaper: LinkShaper
    ) -> Generator[tier_pb2.SegmentChunk, None, None]: ...


class LocalUpstream:
    """The next tier, ``tier``, called in this process ([Note: the next tier in process]).

    ``me`` names this tier; ``caller`` is who the next tier takes it for ([Note: who a
    caller is] in tierflow/transport/callers.py). ``options`` are this tier's: the link
    up to the next tier is emulated as ``options.links`` has it, the way back as the next
    tier's options have it, as over gRPC. ``clock`` and ``sleep`` are what the links are
    timed and waited on (a test's fake clock: emulated links that never sleep).
    """

    stream: StreamClient | None = None

    def __init__(
        self,
        tier: NextTier,
        *,
        me: str,
        caller: str = "local",
        options: RuntimeOptions | None = None,
        clock: Clock = time.monotonic,
        sleep: Sleep = real_sleep,
    ) -> None:
        link = upstream_link(me)
        assert link is not None, f"the {me} has no next tier"
        self.tier = tier
        self.me = me
        self.peer = tier.name
        self.address = f"in-process {tier.name}"
        self.caller = caller
        self.clock = clock
        self.sleep = sleep
        links = options.links if options is not None else {}
        #: The link up, as this tier's stream to the next would shape it.
        self.shaper = LinkShaper(link, links.get(link), clock=clock, sleep=sleep)
        # The way back, as the next tier's stream shapes its replies.
        self._replies = self._down_shaper()
        self._ids = itertools.count()
        self._closed = False

    def _down_shaper(self) -> LinkShaper:
        """The next tier's side of the link, as each of its streams and fetches shapes it."""
        down = self.tier.down_link
        spec = self.tier.options.links.get(down)
        return LinkShaper(down, spec, clock=self.clock, sleep=self.sleep)

    def submit(
        self,
        request: tier_pb2.Request,
        *,
        deadline: float | None = None,
        nbytes: int | None = None,
        on_reply: Callable[[Sent], None] | None = None,
    ) -> Sent:
        if self._closed:
            raise TransportError(f"the stream to the {self.peer} is closed")
        if self.known_down():
            raise TransportError(f"the {self.peer} at {self.address} is down; not sending")
        request.id = f"{self.me[0]}local-{next(self._ids)}"
        size = request.ByteSize() if nbytes is None else nbytes
        # [Note: link shaping]: the request leaves when the link has carried it.
        transfer = self.shaper.schedule(size)
        self.shaper.wait_until(transfer.arrives)
        if transfer.started is None:  # not shaped: the crossing is the copy as bytes
            transfer.started = self.clock()
        data = request.SerializeToString()
        crossed = tier_pb2.Request.FromString(data)
        if transfer.left is None:
            transfer.left = self.clock()
        transfer.handed = True
        future: Future[tier_pb2.Reply] = Future()
        sent = Sent(future, transfer, request.id, request, size, deadline)
        if on_reply is not None:
            future.add_done_callback(lambda _: on_reply(sent))
        self._serve(crossed, future)
        return sent

    def _serve(self, request: tier_pb2.Request, future: Future[tier_pb2.Reply]) -> None:
        """One request at the next tier, as one of its streams would take it."""
        tier = self.tier
        once = threading.Lock()

        def reply_with(reply: tier_pb2.Reply) -> None:
            if not once.acquire(blocking=False):
                return  # one reply per request
            data = reply.SerializeToString()
            if tier.metrics is not None:  # counted as the stream's reply is
                tier.metrics.observe_latency(received)
                tier.metrics.observe(reply, tier.down_link, len(data))
            tier.answered()
            if self._replies.spec is not None:  # the reply link, as the next tier shapes it
                self._replies.wait_until(self._replies.schedule(len(data)).arrives)
            reply = tier_pb2.Reply.FromString(data)
            check_figures(reply, self.me, self.peer, self.address)  # [Note: figures in a reply]
            future.set_result(reply)

        received = time.perf_counter()
        refusal = tier.admit_request()
        if refusal is not None:
            reply_with(tier_pb2.Reply(id=request.id, plan_id=tier.plan_id, error=refusal))
            return
        release = tier.hold(request, self.caller)
        try:
            reply = tier.handle(request, received, reply_with, self.caller)
        finally:
            release()
        if reply is not None:
            reply_with(reply)

    def known_down(self) -> bool:
        return self.tier.closed

    def segment_source(self) -> SegmentSource:
        """The next tier's ``FetchSegment`` called here, failing fast once it is closed."""
        return SegmentSource(self, self.peer, known_down=self.known_down, sleep=self.sleep)

    def FetchSegment(
        self, request: tier_pb2.SegmentRequest, timeout: float | None = None
    ) -> Iterator[tier_pb2.SegmentChunk]:
        """The next tier's chunks of a segment file, through its own ``FetchSegment`` path
        (:meth:`Tier.segment_chunks`), each crossing as bytes on the emulated link.

        A next tier that stops (is closed) during the call ends it UNAVAILABLE, as a
        server that stops does; its refusals come as :class:`LocalCallError`.
        """
        tier = self.tier
        request = tier_pb2.SegmentRequest.FromString(request.SerializeToString())
        context = LocalContext(f"local:{self.caller}", active=lambda: not tier.closed)
        chunks = tier.segment_chunks(request, context, self._down_shaper())
        try:
            for chunk in chunks:
                yield tier_pb2.SegmentChunk.FromString(chunk.SerializeToString())
        finally:
            chunks.close()
            context.end()
        if tier.closed:
            raise LocalCallError(grpc.StatusCode.UNAVAILABLE, f"the {self.peer} stopped")

    def close(self, timeout: float = 5.0) -> None:
        self._closed = True


def connect(address: str, *, me: str, peer: str, options: RuntimeOptions) -> StreamClient:
    """The stream from tier ``me`` to the next tier, ``peer`` at ``address``.

    A next tier that is not up yet fails requests, not this call ([Note: retries and
    failing fast] in tierflow/transport/stream_client.py).
    """
    link = upstream_link(me)
    assert link is not None, f"the {me} has no next tier"
    return StreamClient(
        address,
        me=me,
        peer=peer,
        shaper=LinkShaper(link, options.links.get(link)),
        max_message_bytes=options.max_message_bytes,
        security=options.security.upstream(),
    )


def segment_source(stream: StreamClient) -> SegmentSource:
    """Where this tier fetches the segment files it lacks: the next tier, over ``stream``'s
    channel, failing fast while the stream knows that tier is down."""
    return SegmentSource(stream.channel, stream.peer, known_down=stream.known_down)
