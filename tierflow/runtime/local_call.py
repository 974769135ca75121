"""A call to a tier's gRPC service made in this process: its context and its failure.

A tier's handlers take a :class:`grpc.ServicerContext` and end a call with
``context.abort(code, details)``; the caller of a gRPC stub sees that as a
:class:`grpc.RpcError` that is a :class:`grpc.Call` with the code and details.
:class:`LocalContext` and :class:`LocalCallError` are the two ends of such a call with
no channel and no server, so that a handler runs unchanged for a caller in this process
and the caller handles its failures as it handles a remote one ([Note: the next tier in
process] in tierflow/runtime/upstream.py).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import grpc


class LocalCallError(grpc.RpcError, grpc.Call):
    """A call in this process that ended with ``code``, as a stub's caller sees it."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code = code
        self._details = details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def initial_metadata(self) -> tuple[tuple[str, str], ...]:
        return ()

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return ()

    def is_active(self) -> bool:
        return False

    def time_remaining(self) -> float | None:
        return None

    def cancel(self) -> bool:
        return False

    def add_callback(self, callback: Callable[[], None]) -> bool:
        return False


class LocalContext(grpc.ServicerContext):
    """The handler's side of a call in this process.

    ``peer`` is who the call comes from (``local:NAME``); ``active`` says whether the
    caller is still there (a handler stops sending once it is not, as on a cancelled
    call). :meth:`abort` raises the :class:`LocalCallError` the caller gets; :meth:`end`
    runs the callbacks a handler added, once, as grpc does when a call ends.
    """

    def __init__(self, peer: str, active: Callable[[], bool] = lambda: True) -> None:
        self._peer = peer
        self._active = active
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[], None]] | None = []
        self._cancelled = False
        self._code: grpc.StatusCode | None = None
        self._details = ""

    # ------------------------------------------------------------------ the call

    def end(self) -> None:
        """The call is over: run the callbacks added to it."""
        with self._lock:
            callbacks, self._callbacks = self._callbacks or [], None
        for callback in callbacks:
            callback()

    def is_active(self) -> bool:
        return not self._cancelled and self._callbacks is not None and self._active()

    def time_remaining(self) -> float | None:
        return None

    def cancel(self) -> None:
        self._cancelled = True

    def add_callback(self, callback: Callable[[], None]) -> bool:
        with self._lock:
            if self._callbacks is None:
                return False  # the call already ended
            self._callbacks.append(callback)
            return True

    def abort(self, code: grpc.StatusCode, details: str) -> NoReturn:
        self._code, self._details = code, details
        raise LocalCallError(code, details)

    def abort_with_status(self, status: Any) -> NoReturn:
        self.abort(status.code, status.details)

    def set_code(self, code: grpc.StatusCode) -> None:
        self._code = code

    def set_details(self, details: str) -> None:
        self._details = details

    # ------------------------------------------------------------------ who calls

    def peer(self) -> str:
        return self._peer

    def invocation_metadata(self) -> Sequence[tuple[str, str]]:
        return ()

    def peer_identities(self) -> None:
        return None

    def peer_identity_key(self) -> None:
        return None

    def auth_context(self) -> dict[str, list[bytes]]:
        return {}

    def send_initial_metadata(self, initial_metadata: Sequence[tuple[str, str]]) -> None:
        pass

    def set_trailing_metadata(self, trailing_metadata: Sequence[tuple[str, str]]) -> None:
        pass
