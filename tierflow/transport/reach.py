"""Reaching a tier before sending it work: one line for a tier that cannot be reached.

[Note: reaching a tier first]
A command that needs another tier (``run --edge``, ``device --edge``, ``generate
--edge``, ``probe``) connects before its first request. Without that, a tier that is not
there fails every request for the same reason (``run`` printed one line per request and
wrote outputs full of NaN; ``generate`` waited out its whole deadline), where the cause
was known in under a second. :func:`connect` waits for the channel to be ready and gives
up at its first failed attempt; :func:`diagnose` then says which of two different
mistakes it was, since gRPC reports both as UNAVAILABLE:

- nothing accepts a connection at that host and port (a TCP connection is refused or
  times out): the tier is not running there, or a firewall is in the way;
- something accepts it, yet gRPC could not talk to it: with TLS, the handshake failed (the
  certificate is not signed by ``--tls-ca``, or does not carry the name the client
  expects, ``--tls-server-name``); in plaintext, the tier most likely serves TLS.

gRPC targets that name several replicas or a resolver (``ipv4:A,B``, ``dns:///``,
``unix:``) get the first kind of message without the TCP check.
"""

from __future__ import annotations

import queue
import socket
import threading
import time

import grpc

from tierflow.errors import TransportError
from tierflow.transport.address import GRPC_SCHEMES
from tierflow.transport.security import Security, open_channel
from tierflow.transport.wire import grpc_options

#: Seconds a command waits for a tier to accept its connection before its first request.
CONNECT_TIMEOUT_S = 10.0

# [Note: closing a watched channel]
# ``channel.subscribe`` (:func:`connect`'s wait, a stream client's watch of its replicas)
# starts a grpc thread that watches the channel's state. After ``unsubscribe`` it stops at
# its next wake-up (at most 0.2 s later), but if the channel changes state in that window
# and is closed meanwhile, the thread calls into the closed channel and dies with "Channel
# closed!": a traceback on stderr, and a failed test under load (in
# tests/edge/test_plan_switching.py, whose only channel closed that way was ``tierflow
# run``'s check of its edge, closed right after connecting). So a watched channel is
# closed by :func:`close_when_unwatched`, from a small daemon thread, once grpc's watcher
# has ended: that thread is found by its first argument, the channel's connectivity state,
# and joined (for at most _WATCHER_STOP_S); the caller does not wait. Where grpc's
# internals are not as expected (no such state or thread), the channel is closed at once.
_WATCHER_STOP_S = 1.0


def connect(
    channel: grpc.Channel,
    address: str,
    security: Security | None = None,
    timeout: float = CONNECT_TIMEOUT_S,
) -> None:
    """Wait until ``channel`` to ``address`` is ready; a failed attempt fails at once.

    Raises :class:`TransportError` saying why ([Note: reaching a tier first]).
    """
    states: queue.SimpleQueue[grpc.ChannelConnectivity] = queue.SimpleQueue()
    channel.subscribe(states.put, try_to_connect=True)
    try:
        ends = time.monotonic() + timeout
        while True:
            try:
                state = states.get(timeout=max(ends - time.monotonic(), 0.0))
            except queue.Empty:
                raise TransportError(
                    f"cannot reach a tier at {address} within {timeout:g} s"
                ) from None
            if state == grpc.ChannelConnectivity.READY:
                return
            if state == grpc.ChannelConnectivity.TRANSIENT_FAILURE:
                raise TransportError(diagnose(address, security))
    finally:
        channel.unsubscribe(states.put)


def check_reachable(
    address: str,
    security: Security | None = None,
    *,
    option: str = "",
    timeout: float = CONNECT_TIMEOUT_S,
) -> None:
    """Connect to the tier at ``address`` once and let go; raise a one-line
    :class:`TransportError` if that fails. ``option`` names the flag that gave it."""
    channel = open_channel(address, security, grpc_options())
    try:
        connect(channel, address, security, timeout)
    except TransportError as exc:
        raise TransportError(f"{option} {exc}" if option else str(exc)) from None
    finally:
        close_when_unwatched(channel)  # connect watched it


def close_when_unwatched(channel: grpc.Channel) -> None:
    """Close ``channel`` once grpc's thread watching its state has ended, without waiting
    here ([Note: closing a watched channel])."""
    watcher = _watcher(getattr(channel, "_connectivity_state", None))
    if watcher is None:
        channel.close()
        return

    def close() -> None:
        watcher.join(_WATCHER_STOP_S)
        channel.close()

    threading.Thread(target=close, name="tierflow-channel-close", daemon=True).start()


def _watcher(state: object) -> threading.Thread | None:
    """grpc's thread watching a channel whose connectivity state is ``state``, while it
    runs: the thread whose first argument that state is (``grpc._channel``'s
    ``_poll_connectivity``)."""
    if state is None or not getattr(state, "polling", False):
        return None
    for thread in threading.enumerate():
        args = getattr(thread, "_args", ())
        if args and args[0] is state:
            return thread
    return None


def diagnose(address: str, security: Security | None = None, timeout: float = 2.0) -> str:
    """Why a channel to ``address`` failed, as one sentence ([Note: reaching a tier first])."""
    host_port = _host_port(address)
    if host_port is None:
        return f"cannot reach a tier at {address}: the connection failed"
    try:
        with socket.create_connection(host_port, timeout=timeout):
            pass
    except OSError as exc:
        reason = (exc.strerror or type(exc).__name__).lower()
        return f"cannot reach a tier at {address}: nothing listens there ({reason})"
    if security is not None and security.tls:
        name = security.server_name or host_port[0]
        return (
            f"cannot reach a tier at {address}: something listens there, but the TLS "
            f"handshake failed: its certificate is not signed by --tls-ca, or does not "
            f"name {name!r} (--tls-server-name sets the name expected)"
        )
    return (
        f"cannot reach a tier at {address}: something listens there, but not plaintext "
        "gRPC: if the tier serves TLS, give --tls-ca"
    )


def _host_port(address: str) -> tuple[str, int] | None:
    """``(host, port)`` of a plain ``HOST:PORT`` or ``[IPv6]:PORT``; None for gRPC targets."""
    if address.lower().startswith(GRPC_SCHEMES):
        return None
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not host:
        return None
    return host.removeprefix("[").removesuffix("]"), int(port)
