"""The client end of one long-lived ``Infer`` stream, with many requests in flight.

The device talks to the edge, and the edge to the cloud, through a :class:`StreamClient`:
one channel and one bidirectional stream, requests written as they come, replies matched
back to their requests by id. See [Note: one reply per request] for the guarantee it
gives its callers.

[Note: one reply per request]
Every :meth:`StreamClient.submit` returns a future that is resolved exactly once: with
the peer's ``Reply``; with a :class:`~tierflow.errors.TransportError` as soon as the
stream breaks (the peer died, the connection dropped, the peer refused the stream: a
:class:`~tierflow.errors.RemoteError` of code ``OVERLOADED`` when it serves too many
streams, see [Note: stream admission] in ``tierflow.runtime.admission``); or
with a :class:`~tierflow.errors.DeadlineError` when the request's deadline passes first
(within a few milliseconds: deadlines are swept in batches).
A broken stream is not reused: the next submit opens a new one on the same channel,
which reconnects by itself (with a short backoff, see :func:`channel_options`). Request ids
on the wire are assigned here, so callers' ids can never collide on a shared stream.
See [Note: retries and failing fast] for what happens while the peer is down.

[Note: retries and failing fast]
A request that cannot have reached the peer (its stream broke UNAVAILABLE before any
reply came, and the channel was not connected at any time since the stream opened) is
sent again on a new stream, with the same wire id, after 0.1, 0.3 and 0.9 s, within its
deadline; after that it fails. One that may have reached the peer is never sent again,
and a reply is only ever delivered once (the first one for an id). While the peer is
known to be down (the channel's last connection attempt failed and it has not been
connected since), :meth:`StreamClient.submit` fails at once instead of queueing, and
:meth:`StreamClient.known_down` tells callers so before they do any work.

[Note: replicas]
The peer's address may be a gRPC target list, ``ipv4:H1:P1,H2:P2`` (or a ``dns:`` name
with several addresses, a Kubernetes headless Service). gRPC's ``round_robin`` policy
balances *calls*, and a stream is one call: it stays on the replica it was opened on, and
which replica that is depends on which were connected at that moment (under load, two of
three streams opened on one replica and the third replica got nothing). So a client of a
list keeps one channel per listed address (:class:`_Replica`) and one stream per listed
address, stream ``i`` on replica ``i``'s channel, and sends its requests over them in
turn: each replica takes every n-th request, whatever the timing. The channels connect to
every replica as soon as the client is made. When a replica dies, its stream breaks and
its requests in flight fail as above (typed errors; those that never reached it are sent
again); the stream opened next in its place goes to the next replica in the list whose
channel is not known to be down. A replica that comes back gets streams again as others
break, not at once. A ``dns:`` name, whose addresses the client cannot count, keeps one
round-robin channel and :data:`DNS_STREAMS` streams on it. The requests of a session
([Note: session state on a tier] in tierflow/state/store.py) all take the same stream,
so that its state stays on one replica; when that replica dies, the replica its next
request reaches holds no state for it and the device replays the session.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import threading
import time
import zlib
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import grpc

from tierflow.errors import DeadlineError, InputError, RemoteError, TransportError
from tierflow.link.emulation import LinkShaper, ShapedQueue, Transfer
from tierflow.rpc import tier_pb2, tier_pb2_grpc
from tierflow.transport.peer_warnings import WARNINGS
from tierflow.transport.reach import close_when_unwatched
from tierflow.transport.security import Security, open_channel
from tierflow.transport.wire import DEFAULT_MESSAGE_BYTES, clean_figures, grpc_options

logger = logging.getLogger(__name__)

# What a request's ids, shapes, names and timings may add around its tensor bytes.
_FRAMING_MARGIN = 64 * 1024
# How late past a deadline a request may be failed. Deadlines of answered requests stay
# queued until they pass, so sweeping at every single one would wake a thread for every
# request once a stream has run for a deadline's length; sweeping them in batches does not.
_SWEEP_SLACK_S = 0.005
# Longest the deadline thread sleeps at once (it sleeps again if nothing is due).
_MAX_SWEEP_WAIT_S = 60.0


def channel_options(max_message_bytes: int = DEFAULT_MESSAGE_BYTES) -> list[tuple[str, int | str]]:
    """GRPC_OPTIONS plus a short reconnect backoff and round-robin balancing.

    A restarted tier is found again fast. grpc also takes ``min_reconnect_backoff_ms`` as
    the shortest time a connection attempt may take, so it is left at grpc's 20 s: at
    100 ms, every attempt over a link with a 300 ms round trip timed out before the TLS and
    HTTP/2 handshakes could finish. Round robin only matters for a target with several
    addresses ([Note: replicas]); with one it is the same as grpc's default. Each channel
    has connections of its own (grpc otherwise shares one among a process's channels to
    the same address): on plaintext a connection is who the caller is ([Note: who a caller
    is] in tierflow/transport/callers.py), so two clients in one process are two callers.
    """
    return [
        *grpc_options(max_message_bytes),
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 2_000),
        ("grpc.service_config", _ROUND_ROBIN),
        ("grpc.use_local_subchannel_pool", 1),
    ]


def stream_count(address: str) -> int:
    """How many streams a client keeps to ``address`` ([Note: replicas])."""
    if address.partition(":")[0] == "dns":
        return DNS_STREAMS
    return len(replica_addresses(address))


def replica_addresses(address: str) -> list[str]:
    """The addresses a client keeps a channel to, one per listed replica of an ``ipv4:`` or
    ``ipv6:`` list, else ``address`` itself ([Note: replicas])."""
    scheme, _, rest = address.partition(":")
    parts = [part.strip() for part in rest.split(",") if part.strip()]
    if scheme in ("ipv4", "ipv6") and len(parts) > 1:
        return [f"{scheme}:{part}" for part in parts]
    return [address]


_ROUND_ROBIN = '{"loadBalancingConfig": [{"round_robin": {}}]}'
#: Streams a client keeps to a ``dns:`` target, whose addresses it cannot count.
DNS_STREAMS = 4

#: A stream of this client's with nothing in flight and unused this long is closed and
#: another opened for the next request, before a server closes it (its ``--stream-idle``,
#: 60 s by default: [Note: stream admission] in tierflow/runtime/admission.py).
IDLE_STREAM_S = 30.0

# When a request that never reached the peer is sent again ([Note: retries and failing fast]).
_RETRY_DELAYS_S = (0.1, 0.3, 0.9)


@dataclass
class Sent:
    """A submitted request: its future reply and its transfer on the link.

    ``request``, ``size``, ``deadline`` and ``attempts`` are kept to send it again
    ([Note: retries and failing fast]).
    """

    future: Future[tier_pb2.Reply]
    transfer: Transfer
    wire_id: str
    request: tier_pb2.Request | None = None
    size: int = 0
    deadline: float | None = None
    attempts: int = 1


class _Replica:
    """One channel of a client's and what it knows of its connection ([Note: replicas]);
    its fields change under the client's lock."""

    def __init__(self, client: StreamClient, channel: grpc.Channel) -> None:
        self.client = client
        self.channel = channel
        self.stub = tier_pb2_grpc.TierStub(channel)
        self.down = False  # see StreamClient.known_down
        self.connected = False
        self.connections = 0  # times the channel became READY

    def on_state(self, state: grpc.ChannelConnectivity) -> None:
        with self.client.lock:
            self.connected = state == grpc.ChannelConnectivity.READY
            if self.connected:
                self.connections += 1
                self.down = False
            elif state == grpc.ChannelConnectivity.TRANSIENT_FAILURE:
                self.down = True
            elif state == grpc.ChannelConnectivity.IDLE:
                self.down = False  # nothing is trying to connect: the next call will


class _Stream:
    """One ``Infer`` call and the requests waiting for replies on it."""

    def __init__(self, client: StreamClient, replica: _Replica) -> None:
        self.client = client
        self.replica = replica
        self.queue: ShapedQueue[tier_pb2.Request] = ShapedQueue(client.shaper)
        self.pending: dict[str, Sent] = {}
        self.alive = True
        self.replied = False
        self.used = time.monotonic()  # when a request was last sent or answered on it
        # Made under client.lock: whether anything sent on it may have reached the peer.
        self.connected_at_start = replica.connected
        self.connections_at_start = replica.connections
        self.call = replica.stub.Infer(self.queue.drain())
        self.reader = threading.Thread(target=self._read, name=f"{client.me}-reader", daemon=True)
        self.reader.start()

    def _read(self) -> None:
        client = self.client
        error: TransportError
        unavailable = False
        try:
            for reply in self.call:
                with client.lock:
                    self.replied = True
                    self.used = time.monotonic()
                    sent = self.pending.pop(reply.id, None)
                if sent is None:
                    logger.debug("[%s] reply for %s came after its deadline", client.me, reply.id)
                    continue
                client._check_figures(reply)
                sent.future.set_result(reply)
            error = TransportError(f"the {client.peer} at {client.address} ended the stream")
        except grpc.RpcError as exc:
            code = exc.code() if isinstance(exc, grpc.Call) else None
            details = exc.details() if isinstance(exc, grpc.Call) else str(exc)
            name = code.name if code is not None else "UNKNOWN"
            unavailable = code == grpc.StatusCode.UNAVAILABLE
            if code == grpc.StatusCode.RESOURCE_EXHAUSTED:  # [Note: stream admission]
                error = RemoteError(
                    f"the {client.peer} at {client.address} refused the stream: {details}",
                    code="OVERLOADED",
                    tier=client.peer,
                )
            elif self.replica.connections == 0:
                error = TransportError(
                    f"the {client.peer} at {client.address} was never reached: {name}: {details}"
                )
            else:
                error = TransportError(
                    f"the {client.peer} at {client.address} went away: {name}: {details}"
                )
        except Exception as exc:  # a bug here must not leave requests hanging
            logger.exception("[%s] stream reader failed", client.me)
            error = TransportError(f"the stream to the {client.peer} failed: {exc}")
        with client.lock:
            self.alive = False
            failed = list(self.pending.values())
            self.pending.clear()
            client.streams = [None if s is self else s for s in client.streams]
            reached = (
                not unavailable
                or self.replied
                or self.connected_at_start
                or self.replica.connections != self.connections_at_start
            )
        self.queue.close()
        if not reached:  # nothing got out: no bytes to report ([Note: honest link figures])
            for sent in failed:
                sent.transfer.unreached = True
        retry = [] if reached else [s for s in failed if s.attempts <= len(_RETRY_DELAYS_S)]
        failed = [s for s in failed if s not in retry]
        if failed:
            logger.warning(
                "[%s] %s; failing %d request(s) in flight", client.me, error, len(failed)
            )
        for sent in failed:
            sent.future.set_exception(error)
        if retry:
            logger.info(
                "[%s] %d request(s) never reached the %s (%s); sending them again",
                client.me,
                len(retry),
                client.peer,
                error,
            )
            client._send_again(retry, error)


def check_figures(reply: tier_pb2.Reply, me: str, peer: str, address: str) -> None:
    """Drop the figures of ``reply`` (from the ``peer`` at ``address``) that no tier above
    ``me`` could have measured, with a counted warning ([Note: figures in a reply] in
    tierflow/transport/wire.py)."""
    problems = clean_figures(reply, me)
    if problems:
        WARNINGS.warn(
            logger,
            me,
            "reply_figures",
            address,
            "[%s] the %s at %s answered with figures no tier could measure, dropped: %s",
            me,
            peer,
            address,
            "; ".join(problems),
        )


class StreamClient:
    """Requests to the next tier over one long-lived stream ([Note: one reply per request]).

    ``me`` and ``peer`` name the tiers for messages ("device" -> "edge"); ``shaper``
    emulates the outgoing link (None: not shaped); ``security`` is the channel's TLS and
    token setting (``tierflow.transport.security``). ``address`` may list replicas
    ([Note: replicas]). Thread-safe.
    """

    def __init__(
        self,
        address: str,
        *,
        me: str,
        peer: str,
        shaper: LinkShaper | None = None,
        max_message_bytes: int = DEFAULT_MESSAGE_BYTES,
        security: Security | None = None,
    ) -> None:
        self.address = address
        self.me = me
        self.peer = peer
        self.shaper = shaper
        self.max_message_bytes = max_message_bytes
        options = channel_options(max_message_bytes)
        #: The peer (all its replicas, round robin): for probes and segment fetches.
        self.channel = open_channel(address, security, options)
        self.lock = threading.Lock()
        listed = replica_addresses(address)
        channels = (
            [self.channel]
            if len(listed) == 1
            else [open_channel(one, security, options) for one in listed]
        )
        self.replicas = [_Replica(self, channel) for channel in channels]
        # One slot per stream kept ([Note: replicas]); None: not open (or broken).
        self.streams: list[_Stream | None] = [None] * stream_count(address)
        self._turn = itertools.count()
        self._ids = itertools.count()
        self._prefix = f"{me[0]}{id(self):x}-"
        # (deadline, wire id, attempt, stream): a request sent again has a second entry.
        self._deadlines: list[tuple[float, str, int, _Stream]] = []
        self._wake = threading.Condition(self.lock)
        self._closed = False
        # With replicas, connect to all of them now, before the first streams are opened.
        for replica in self.replicas:
            replica.channel.subscribe(replica.on_state, try_to_connect=len(self.streams) > 1)
        self._sweeper = threading.Thread(target=self._sweep, name=f"{me}-deadlines", daemon=True)
        self._sweeper.start()

    def _check_figures(self, reply: tier_pb2.Reply) -> None:
        check_figures(reply, self.me, self.peer, self.address)

    def known_down(self) -> bool:
        """Whether the peer is known to be down ([Note: retries and failing fast]): every
        replica's channel ([Note: replicas])."""
        return all(replica.down for replica in self.replicas)

    def submit(
        self,
        request: tier_pb2.Request,
        *,
        deadline: float | None = None,
        nbytes: int | None = None,
        on_reply: Callable[[Sent], None] | None = None,
    ) -> Sent:
        """Send ``request`` (its id is replaced); ``deadline`` is on ``time.monotonic``.

        ``nbytes``, the encoded tensor bytes, is what the link carries and is charged for
        (``ByteSize()`` when not given; it costs about 0.2 ms per MB, so callers that
        know the figure pass it). Framing adds little: the receiver enforces the exact
        message limit in any case. ``on_reply`` is called with the returned
        :class:`Sent` once its future is resolved (on the thread that resolves it).

        [Note: the send comes last]
        The request is queued for gRPC's sending thread as the very last step: whatever
        this thread did after it would hold the GIL while that thread waits to send (on
        the edge, registering the reply's callback after the send cost about 0.05 ms of
        every hop). So the callback is given here, and set before the request is queued.
        """
        if deadline is not None and not math.isfinite(deadline):
            raise InputError(f"a deadline must be a finite time, found {deadline!r}")
        size = request.ByteSize() if nbytes is None else nbytes
        framed = size if nbytes is None else size + _FRAMING_MARGIN
        if framed > self.max_message_bytes:
            raise InputError(
                f"a request of {size} bytes exceeds the message limit of "
                f"{self.max_message_bytes} bytes to the {self.peer}"
            )
        wire_id = self._prefix + str(next(self._ids))
        request.id = wire_id
        future: Future[tier_pb2.Reply] = Future()
        with self.lock:
            if self._closed:
                raise TransportError(f"the stream to the {self.peer} is closed")
            if self.known_down():
                if not any(replica.connections for replica in self.replicas):
                    raise TransportError(
                        f"the {self.peer} at {self.address} was never reached (no connection "
                        "could be made to it); not sending"
                    )
                raise TransportError(
                    f"the {self.peer} at {self.address} is down (its last connection "
                    "attempt failed); not sending"
                )
            stream = self._live_stream(request.session)
            transfer = stream.queue.book(size)
            sent = Sent(future, transfer, wire_id, request, size, deadline)
            self._track(stream, sent)
            if on_reply is not None:
                future.add_done_callback(lambda _: on_reply(sent))
            stream.queue.send(transfer, request)  # [Note: the send comes last]
        return sent

    def _live_stream(self, session: str = "") -> _Stream:
        """The stream to send on, opened if need be; call with the lock held.

        With several streams, each call takes the next in turn ([Note: replicas]); the
        requests of a session all take the same one, so that its state stays on one
        replica and its requests arrive in order.
        """
        if session and len(self.streams) > 1:
            slot = zlib.crc32(session.encode()) % len(self.streams)
        else:
            slot = next(self._turn) % len(self.streams)
        stream = self.streams[slot]
        now = time.monotonic()
        idle = stream is not None and not stream.pending and now - stream.used > IDLE_STREAM_S
        if stream is not None and stream.alive and idle:  # before a server's --stream-idle
            stream.queue.close()  # half-closed: the server ends it once it has read this
            stream = None
        if stream is None or not stream.alive:
            stream = self.streams[slot] = _Stream(self, self._replica_for(slot))
        stream.used = now
        return stream

    def _replica_for(self, slot: int) -> _Replica:
        """The replica a new stream in ``slot`` opens on: the slot's own, or while that one
        is known down the next in the list that is not ([Note: replicas])."""
        count = len(self.replicas)
        for step in range(count):
            replica = self.replicas[(slot + step) % count]
            if not replica.down:
                return replica
        return self.replicas[slot % count]

    def _track(self, stream: _Stream, sent: Sent) -> None:
        """Wait for ``sent``'s reply on ``stream``, within its deadline; lock held."""
        stream.pending[sent.wire_id] = sent
        if sent.deadline is not None:
            entry = (sent.deadline, sent.wire_id, sent.attempts, stream)
            heapq.heappush(self._deadlines, entry)
            if self._deadlines[0][1] == sent.wire_id:
                self._wake.notify()

    def _send_again(self, sents: list[Sent], error: TransportError) -> None:
        """Send requests that never reached the peer again after a backoff (reader thread)."""
        time.sleep(_RETRY_DELAYS_S[min(s.attempts for s in sents) - 1])
        for sent in sents:
            late = sent.deadline is not None and time.monotonic() >= sent.deadline
            with self.lock:
                closed = self._closed
                if not closed and not late and sent.request is not None:
                    sent.attempts += 1
                    stream = self._live_stream(sent.request.session)
                    sent.transfer = stream.queue.put(sent.request, sent.size)
                    self._track(stream, sent)
                    continue
            if late:
                sent.future.set_exception(
                    DeadlineError(
                        f"no reply from the {self.peer} at {self.address} within the "
                        f"request's deadline ({error})"
                    )
                )
            else:
                sent.future.set_exception(error)

    def _sweep(self) -> None:
        """Fail requests whose deadline passed; runs until :meth:`close`."""
        with self.lock:
            while not self._closed:
                now = time.monotonic()
                expired: list[Sent] = []
                while self._deadlines and self._deadlines[0][0] <= now:
                    _, wire_id, _, stream = heapq.heappop(self._deadlines)
                    sent = stream.pending.pop(wire_id, None)
                    if sent is not None:
                        expired.append(sent)
                if expired:
                    self.lock.release()
                    try:
                        for sent in expired:
                            sent.future.set_exception(
                                DeadlineError(
                                    f"no reply from the {self.peer} at {self.address} "
                                    "within the request's deadline"
                                )
                            )
                    finally:
                        self.lock.acquire()
                    continue
                timeout = _MAX_SWEEP_WAIT_S  # bounded: a far deadline is no timer overflow
                if self._deadlines:
                    timeout = min(self._deadlines[0][0] - now + _SWEEP_SLACK_S, timeout)
                self._wake.wait(timeout)

    def in_flight(self) -> int:
        with self.lock:
            return sum(len(s.pending) for s in self.streams if s is not None)

    def close(self, timeout: float = 5.0) -> None:
        """Finish the streams (waiting up to ``timeout`` for replies), then close the channel."""
        with self.lock:
            self._closed = True
            streams = [s for s in self.streams if s is not None]
            self._wake.notify()
        for stream in streams:
            stream.queue.close()
        end = time.monotonic() + timeout
        for stream in streams:
            stream.reader.join(max(0.0, end - time.monotonic()))
        for stream in streams:
            stream.call.cancel()
            stream.reader.join(1.0)
        for replica in self.replicas:
            replica.channel.unsubscribe(replica.on_state)
            close_when_unwatched(replica.channel)
        if self.channel is not self.replicas[0].channel:
            close_when_unwatched(self.channel)
