"""Who may talk to a tier: TLS (mutual, with a CA), bearer tokens, and where a server listens.

Every channel and every server port in tierflow is made here, from one
:class:`Security` setting that the command line fills (``--tls-cert``, ``--tls-key``,
``--tls-ca``, ``--token-file``, ``--insecure``): the device's channel to the edge, the
edge's channel to the cloud, ``tierflow probe``, and each tier's own port (the ``Tier``
service and the standard health service share it). See [Note: tier security].

[Note: tier security]
* TLS: a server with ``--tls-cert`` and ``--tls-key`` serves TLS only; with ``--tls-ca``
  as well it accepts only clients that present a certificate signed by that CA (mutual
  TLS). A client with TLS flags verifies the server against ``--tls-ca`` (the system's
  roots without it) and presents its own certificate when it has one. gRPC does the TLS;
  nothing beyond grpcio is needed. A client of a list of replicas (``ipv4:H1:P1,H2:P2``,
  [Note: replicas] in ``tierflow.transport.stream_client``) checks every replica's certificate
  against one name, ``--tls-server-name``, as the address names no single host.
* Without TLS flags a server listens on loopback addresses only, unless ``--insecure``
  is given: plaintext beyond this machine must be asked for.
* Bearer token (``--token-file``, for setups that terminate TLS elsewhere): clients send
  ``authorization: Bearer TOKEN`` with every call; a server interceptor compares it in
  constant time with every token the server's file lists and refuses every other call
  with UNAUTHENTICATED. The standard health service is exempt, so that load balancers can
  ask it; it tells only SERVING or not. A server's token file may list many clients, one
  ``NAME TOKEN`` a line (the name is who the caller is: [Note: who a caller is] in
  tierflow/transport/callers.py); a line of one word is a token without a name, as a
  client's own token file holds its one token. Blank lines and lines starting with ``#``
  are skipped. An edge sends the cloud the token of ``--upstream-token-file`` (default:
  its ``--token-file``, which then must hold one token). Names, never tokens, are logged.
* A port already in use (by another tierflow, which grpc would otherwise share through
  SO_REUSEPORT) is refused with one line before grpc tries to bind it.
"""

from __future__ import annotations

import errno
import hmac
import ipaddress
import logging
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import grpc

from tierflow.errors import TransportError, UsageError

logger = logging.getLogger(__name__)

#: Methods that answer without a bearer token (see [Note: tier security]).
TOKEN_EXEMPT_PREFIX = "/grpc.health.v1.Health/"
#: Longest token file read (a line per client; a larger file is a mistake).
MAX_TOKEN_FILE_BYTES = 1 << 20


def _read(path: str, flag: str, limit: int | None = None) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise UsageError(f"cannot read {flag} {path}: {exc.strerror or exc}") from exc
    if limit is not None and len(data) > limit:
        raise UsageError(f"{flag} {path}: expected at most {limit} bytes, found {len(data)}")
    return data


@dataclass(frozen=True)
class TokenTable:
    """The bearer tokens a token file lists: ``(name, token)``, name None for a line of one
    word ([Note: tier security]); parse with :meth:`parse`."""

    entries: tuple[tuple[str | None, bytes], ...]

    @classmethod
    def parse(cls, data: bytes, path: str = "--token-file") -> TokenTable:
        """The file's lines: ``TOKEN`` or ``NAME TOKEN``; blank and ``#`` lines skipped."""
        entries: list[tuple[str | None, bytes]] = []
        for number, line in enumerate(data.splitlines(), 1):
            words = line.split()
            if not words or words[0].startswith(b"#"):
                continue
            if len(words) > 2 or any(c < 0x21 or c > 0x7E for word in words for c in word):
                raise UsageError(
                    f"--token-file {path}, line {number}: expected TOKEN or NAME TOKEN, "
                    "printable ASCII without spaces"
                )
            name = words[0].decode("ascii") if len(words) == 2 else None
            entries.append((name, words[-1]))
        if not entries:
            raise UsageError(f"--token-file {path}: expected a token, found none")
        names = [name for name, _ in entries if name is not None]
        tokens = [token for _, token in entries]
        if len(set(names)) != len(names) or len(set(tokens)) != len(tokens):
            raise UsageError(f"--token-file {path}: a name or a token appears twice")
        return cls(tuple(entries))

    def match(self, header: bytes) -> tuple[bool, str | None]:
        """Whether ``header`` (``Bearer TOKEN``) bears one of the tokens, and its name.

        Every token is compared, in constant time, whichever matches.
        """
        found, name = False, None
        for entry_name, token in self.entries:
            if hmac.compare_digest(header, b"Bearer " + token):
                found, name = True, entry_name
        return found, name


@dataclass(frozen=True)
class Security:
    """TLS files, a token file and whether plaintext may leave this machine.

    Paths are kept, not contents: the files are read when a server binds or a channel
    opens, so a message names the file that is wrong.
    """

    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    token_file: str | None = None
    insecure: bool = False
    server_name: str | None = None
    #: The token file an edge sends the cloud (None: ``token_file``).
    upstream_token_file: str | None = None

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise UsageError("--tls-cert and --tls-key go together: give both or neither")

    @property
    def tls(self) -> bool:
        """Whether channels and ports use TLS (a CA alone makes a client verify the server)."""
        return self.tls_cert is not None or self.tls_ca is not None

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Security:
        unknown = set(data) - {f.name for f in fields(cls)}
        if unknown:
            raise UsageError(f"security settings: unknown fields {sorted(unknown)}")
        return cls(**data)

    def token(self) -> bytes | None:
        """The bearer token this client sends (None without a token file).

        A client's token file holds one token: one word, or one ``NAME TOKEN`` line.
        """
        table = self.tokens()
        if table is None:
            return None
        if len(table.entries) != 1:
            raise UsageError(
                f"--token-file {self.token_file}: a client sends one token, the file lists "
                f"{len(table.entries)} (an edge whose file lists its clients sends the cloud "
                "the token of --upstream-token-file)"
            )
        return table.entries[0][1]

    def tokens(self) -> TokenTable | None:
        """The tokens the token file lists, with their names (None without a token file)."""
        if self.token_file is None:
            return None
        return TokenTable.parse(
            _read(self.token_file, "--token-file", MAX_TOKEN_FILE_BYTES), self.token_file
        )

    def upstream(self) -> Security:
        """The setting of this tier's channel to the next tier: its own TLS files, and the
        token of ``upstream_token_file`` when given."""
        if self.upstream_token_file is None:
            return self
        return replace(self, token_file=self.upstream_token_file, upstream_token_file=None)

    def server_credentials(self) -> grpc.ServerCredentials | None:
        """TLS credentials for a server port (None: plaintext)."""
        if not self.tls:
            return None
        if self.tls_cert is None or self.tls_key is None:
            raise UsageError("a TLS server needs --tls-cert and --tls-key (--tls-ca alone is not)")
        key = _read(self.tls_key, "--tls-key")
        cert = _read(self.tls_cert, "--tls-cert")
        ca = _read(self.tls_ca, "--tls-ca") if self.tls_ca else None
        return grpc.ssl_server_credentials(
            [(key, cert)], root_certificates=ca, require_client_auth=ca is not None
        )

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        """TLS credentials for a channel (None: plaintext)."""
        if not self.tls:
            return None
        ca = _read(self.tls_ca, "--tls-ca") if self.tls_ca else None
        key = _read(self.tls_key, "--tls-key") if self.tls_key else None
        cert = _read(self.tls_cert, "--tls-cert") if self.tls_cert else None
        return grpc.ssl_channel_credentials(
            root_certificates=ca, private_key=key, certificate_chain=cert
        )

    def interceptors(self, tier: str) -> list[grpc.ServerInterceptor]:
        """Server interceptors that enforce this setting (the token check, if any)."""
        tokens = self.tokens()
        return [] if tokens is None else [TokenCheck(tokens, tier)]


#: No TLS, no token, loopback only: what a server gets when nothing is said.
PLAINTEXT = Security()


# ---------------------------------------------------------------------- channels


class _TokenMetadata(
    grpc.StreamStreamClientInterceptor,
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
):
    """Adds ``authorization: Bearer TOKEN`` to every call of a channel."""

    def __init__(self, token: bytes) -> None:
        self._metadata = ("authorization", "Bearer " + token.decode("ascii"))

    def _details(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        metadata = [*(details.metadata or ()), self._metadata]
        return _CallDetails(
            details.method,
            details.timeout,
            metadata,
            details.credentials,
            getattr(details, "wait_for_ready", None),
            getattr(details, "compression", None),
        )

    def intercept_stream_stream(
        self,
        continuation: Callable[..., Any],
        client_call_details: grpc.ClientCallDetails,
        request_iterator: Any,
    ) -> Any:
        return continuation(self._details(client_call_details), request_iterator)

    def intercept_unary_unary(
        self,
        continuation: Callable[..., Any],
        client_call_details: grpc.ClientCallDetails,
        request: Any,
    ) -> Any:
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(
        self,
        continuation: Callable[..., Any],
        client_call_details: grpc.ClientCallDetails,
        request: Any,
    ) -> Any:
        return continuation(self._details(client_call_details), request)


class _CallDetails(grpc.ClientCallDetails):
    def __init__(
        self,
        method: str,
        timeout: float | None,
        metadata: Any,
        credentials: grpc.CallCredentials | None,
        wait_for_ready: bool | None,
        compression: Any,
    ) -> None:
        self.method = method
        self.timeout = timeout
        self.metadata = metadata
        self.credentials = credentials
        self.wait_for_ready = wait_for_ready
        self.compression = compression


def open_channel(
    address: str, security: Security | None, options: list[tuple[str, Any]]
) -> grpc.Channel:
    """A channel to a tier: TLS or plaintext as ``security`` says, with its token if any."""
    security = security or PLAINTEXT
    credentials = security.channel_credentials()
    if credentials is None:
        channel = grpc.insecure_channel(address, options=options)
    else:
        if security.server_name:
            options = [*options, ("grpc.ssl_target_name_override", security.server_name)]
        elif address.startswith(("ipv4:", "ipv6:")) and "," in address:
            raise UsageError(
                f"with TLS, a list of replicas ({address}) needs --tls-server-name: the "
                "name their certificates carry"
            )
        channel = grpc.secure_channel(address, credentials, options=options)
    token = security.token()
    if token is not None:
        channel = grpc.intercept_channel(channel, _TokenMetadata(token))
    return channel


# ---------------------------------------------------------------------- servers


class TokenCheck(grpc.ServerInterceptor):
    """Refuses calls without one of the bearer tokens (UNAUTHENTICATED); constant-time compare."""

    def __init__(self, tokens: TokenTable, tier: str) -> None:
        self._tokens = tokens
        self._tier = tier

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(TOKEN_EXEMPT_PREFIX):
            return handler
        found, _ = self._tokens.match(bearer(handler_call_details.invocation_metadata))
        if found:
            return handler
        logger.warning(
            "[%s] refused a call to %s: no valid bearer token",
            self._tier,
            handler_call_details.method,
        )
        return _refusal(handler)


def bearer(metadata: Any) -> bytes:
    """The ``authorization`` value of a call's metadata (b"" if none)."""
    given = b""
    for key, value in metadata or ():
        if key == "authorization":
            given = value.encode("latin-1") if isinstance(value, str) else bytes(value)
    return given


def _refusal(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same kind as ``handler`` that answers UNAUTHENTICATED."""

    def refuse(request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse)
    return grpc.unary_unary_rpc_method_handler(refuse)


def server_options() -> list[tuple[str, int]]:
    """Options every tier server adds: no SO_REUSEPORT, so a port is never shared."""
    return [("grpc.so_reuseport", 0)]


def is_loopback(host: str) -> bool:
    """Whether ``host`` (from ``HOST:PORT``) names only this machine."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _check_port_free(host: str, port: int, listen: str) -> None:
    """Raise TransportError when something already listens on ``host:port``."""
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(
            host.strip("[]") or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror as exc:
        raise TransportError(f"cannot listen on {listen}: {exc.strerror}") from exc
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise TransportError(
                        f"cannot listen on {listen}: port {port} is in use (is another "
                        "tierflow serving there?)"
                    ) from exc


def bind(server: grpc.Server, listen: str, security: Security | None, tier: str) -> int:
    """Add the port ``listen`` (``HOST:PORT``) to ``server``; return the port bound.

    Plaintext is allowed beyond loopback only with ``insecure`` ([Note: tier security]).
    """
    security = security or PLAINTEXT
    if listen.startswith(("unix:", "unix-abstract:")):  # a local socket: this machine only
        host, sep, port_text = "localhost", ":", "0"
    else:
        host, sep, port_text = listen.rpartition(":")
    if not sep or not port_text.isdigit():
        raise UsageError(f"--listen {listen!r}: expected HOST:PORT")
    if int(port_text) > 65535:  # gRPC would take it modulo 65536, and serve elsewhere
        raise UsageError(
            f"--listen {listen!r}: the port {port_text} is not a port number "
            "(1-65535, or 0 for one the OS picks)"
        )
    if not security.tls and not security.insecure and not is_loopback(host):
        raise UsageError(
            f"refusing to serve the {tier} on {listen} in plaintext: give --tls-cert and "
            "--tls-key (and --tls-ca to require client certificates), or --insecure"
        )
    _check_port_free(host, int(port_text), listen)
    credentials = security.server_credentials()
    try:
        if credentials is None:
            port = server.add_insecure_port(listen)
        else:
            port = server.add_secure_port(listen, credentials)
    except RuntimeError as exc:
        raise TransportError(f"cannot listen on {listen}: the address is not available") from exc
    if port == 0:
        raise TransportError(f"cannot listen on {listen}: the address is not available")
    return int(port)
