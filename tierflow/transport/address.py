"""Where a tier is reached: an address parsed once, and which tier answers there.

``--edge``, ``--upstream`` and ``tierflow probe`` take ``HOST:PORT`` (``[::1]:50051`` for
IPv6) or a gRPC target (``ipv4:H1:P1,H2:P2``, ``dns:///NAME:PORT``, ``unix:PATH``), read
by :meth:`Address.parse` where the option enters, so that a missing port is an error
that says so (gRPC would quietly take port 443, and the failure would blame the network).

[Note: which tier answers]
A tier names itself in the initial metadata of every ``Probe`` stream
(``tierflow-tier``: ``edge`` or ``cloud``). :func:`answering_tier` opens one such
stream, sends nothing and reads the name, so a command can tell at start that the
address it was given belongs to another tier: ``run --edge`` pointed at a cloud would
otherwise skip the edge and still call the hop ``device-edge``, and ``serve edge
--upstream`` pointed at an edge would forward to a second edge. A tier that cannot be
reached, does not answer in time or does not say is no verdict (None): reaching it is
the client's own business, with its own errors and fallbacks.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import grpc

from tierflow.errors import UsageError, shown
from tierflow.rpc import tier_pb2_grpc
from tierflow.transport.security import Security, open_channel
from tierflow.transport.wire import grpc_options

#: Targets gRPC resolves itself (name resolvers): taken as written.
GRPC_SCHEMES: tuple[str, ...] = ("dns:", "ipv4:", "ipv6:", "unix:", "unix-abstract:", "vsock:")
#: Seconds :func:`answering_tier` waits for a tier to name itself.
ANSWER_TIMEOUT_S = 3.0

_BRACKETED = re.compile(r"\[(?P<host>[^\]]+)\]:(?P<port>[^:]*)")
_EXAMPLE = "like 127.0.0.1:50051, [::1]:50051 or dns:///edge.local:50051"


@dataclass(frozen=True)
class Address:
    """A tier's address as gRPC takes it (``target``), checked when parsed."""

    target: str

    @classmethod
    def parse(cls, text: str) -> Address:
        """Read ``HOST:PORT``, ``[IPv6]:PORT`` or a gRPC target; say what is wrong if it is not."""
        target = text.strip()
        if not target or any(c.isspace() for c in target):
            raise UsageError(f"address {shown(text)}: expected HOST:PORT, {_EXAMPLE}")
        if target.lower().startswith(GRPC_SCHEMES):
            if target.partition(":")[2].strip("/"):
                return cls(target)
            raise UsageError(f"address {shown(text)} names no host after its scheme")
        bracketed = _BRACKETED.fullmatch(target)
        if bracketed is not None:
            host, port = bracketed["host"], bracketed["port"]
        elif target.count(":") == 1:
            host, _, port = target.partition(":")
        elif ":" not in target or (target.startswith("[") and target.endswith("]")):
            raise UsageError(
                f"address {shown(text)} has no port: expected HOST:PORT, like "
                f"{shown(target + ':50051')}"
            )
        else:
            raise UsageError(
                f"address {shown(text)}: an IPv6 address goes in brackets before the port, "
                "like [::1]:50051"
            )
        if not host:
            raise UsageError(f"address {shown(text)} has no host: expected HOST:PORT, {_EXAMPLE}")
        if not port.isdigit() or not 1 <= int(port) <= 65535:
            raise UsageError(
                f"address {shown(text)}: the port {shown(port)} is not a port number (1-65535)"
            )
        return cls(target)

    def __str__(self) -> str:
        return self.target


def listen_address(text: str) -> str:
    """Read ``--listen``: ``HOST:PORT`` with a port 0-65535 (0: one the OS picks), or a
    ``unix:`` socket; gRPC would take a larger port modulo 65536 and serve on another."""
    target = text.strip()
    if target.startswith(("unix:", "unix-abstract:")):
        return target
    host, sep, port = target.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise UsageError(f"--listen {shown(text)}: expected HOST:PORT, like 127.0.0.1:50051")
    if int(port) > 65535:
        raise UsageError(
            f"--listen {shown(text)}: the port {shown(port)} is not a port number "
            "(1-65535, or 0 for one the OS picks)"
        )
    return target


def answering_tier(
    address: Address, security: Security | None = None, timeout: float = ANSWER_TIMEOUT_S
) -> str | None:
    """The tier that answers at ``address`` (``edge``, ``cloud``), or None if none says.

    See [Note: which tier answers]; waits at most ``timeout`` seconds.
    """
    channel = open_channel(address.target, security, grpc_options())
    try:
        stub = tier_pb2_grpc.TierStub(channel)
        call = stub.Probe(iter(()), timeout=timeout)  # no messages: the name is in the metadata
        try:
            metadata = dict(call.initial_metadata() or ())
        except grpc.RpcError:
            return None
        finally:
            call.cancel()
        name = metadata.get("tierflow-tier")
        return str(name) if name else None
    finally:
        channel.close()


def check_answering_tier(
    address: Address,
    expected: str,
    security: Security | None = None,
    *,
    option: str,
    timeout: float = ANSWER_TIMEOUT_S,
) -> None:
    """Raise a one-line :class:`UsageError` when another tier than ``expected`` answers.

    ``option`` is the flag that gave the address (``--edge``), for the message.
    """
    found = answering_tier(address, security, timeout)
    if found is None or found == expected:
        return
    hint = {
        "edge": f"; a device reaches the cloud through an edge (serve edge --upstream {address})",
        "cloud": "; an edge forwards to the cloud (the address serve cloud prints)",
    }.get(expected, "")
    raise UsageError(
        f"{option} {address}: the tier answering there is {_a(found)}, not {_a(expected)}: "
        f"give the {expected}'s address{hint}"
    )


def _a(tier: str) -> str:
    return f"an {tier}" if tier[:1] in "aeiou" else f"a {tier}"
