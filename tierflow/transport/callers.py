"""Who a caller is: the identity a tier keeps a caller's sessions under.

[Note: who a caller is]
A tier serves many devices (and a cloud many edges), and a session's state is a user's
prompt; it belongs to the caller that made it ([Note: session state on a tier] in
tierflow/state/store.py). A stream's caller is named once, as it opens, from what the
transport proved about it ([Note: tier security] in tierflow/transport/security.py):

* ``cert:SUBJECT``: under mutual TLS, the subject of the client's certificate;
* ``token:NAME``: the name of the bearer token it presented, when the server's token
  file names its tokens (``NAME TOKEN`` lines); both, ``cert:... token:...``, when both;
* ``peer:ADDRESS``: otherwise (plaintext on loopback, or a token without a name, which
  only admits), the connection itself, address and port: two clients on one host are two
  callers, and a client that reconnects is a new one (its sessions are replayed).

An edge forwards on behalf of its devices, all on one stream to the cloud. Each request it
sends up names, in ``Request.on_behalf_of``, the owner it ran the request for; the cloud
keeps the session under that name *within* the edge's own identity (:func:`owner_of`), so
devices behind two edges, and two devices behind one edge, never share a namespace, and
no caller can name a namespace outside its own, whatever it writes there. Names appear in
logs and metrics; tokens never do.
"""

from __future__ import annotations

import functools
import json
from typing import Any

from tierflow.errors import InputError
from tierflow.transport.security import TokenTable, bearer

#: Longest ``on_behalf_of`` a tier takes (an owner an edge vouches for).
MAX_BEHALF_BYTES = 1024


def caller_of(context: Any, tokens: TokenTable | None) -> str:
    """The identity of the caller of a gRPC call ([Note: who a caller is])."""
    parts = []
    auth = context.auth_context() or {}
    subject = auth.get("x509_subject") or auth.get("x509_common_name")
    if subject:
        parts.append("cert:" + subject[0].decode("utf-8", "replace"))
    if tokens is not None:
        _, name = tokens.match(bearer(context.invocation_metadata()))
        if name is not None:
            parts.append("token:" + name)
    return " ".join(parts) or "peer:" + context.peer()


@functools.lru_cache(maxsize=4096)  # every step of a session asks, on every tier
def owner_of(caller: str, behalf: str) -> str:
    """The owner of a request's session: its caller, or what the caller vouches for within
    the caller's own name ([Note: who a caller is]).

    One-to-one: a caller's name never starts with ``[``, a vouched one always does.
    """
    if len(behalf.encode()) > MAX_BEHALF_BYTES:
        raise InputError(
            f"on_behalf_of must be at most {MAX_BEHALF_BYTES} bytes, got {len(behalf.encode())}"
        )
    return caller if not behalf else json.dumps([behalf, caller])
