"""A tier's gRPC server: the ``Tier`` service, the standard health service, clean shutdown.

Follows grpc's own examples (``examples/python/health_checking`` and the graceful
shutdown example): the server starts with health NOT_SERVING, loads the model, then
reports SERVING; on SIGTERM or SIGINT it stops as [Note: stopping a tier] says.
Message-size limits are set explicitly on the server (``tierflow.wire.grpc_options``),
the same as on every channel.

[Note: stopping a tier]
At once: health reports NOT_SERVING, no new stream is accepted, and every new request on
an open stream is answered UNAVAILABLE ("stopping"), so devices go elsewhere. Requests
already in flight get up to ``grace`` seconds to be answered; then the streams still
open (idle devices keep theirs open) are cancelled and the tier releases its model and
its stream to the next tier. The CLI process always exits within ``grace`` + 1 s: if
anything still holds it then (a segment still running, a stuck writer), it exits anyway.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from types import FrameType

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tierflow.security import Security, bind, server_options
from tierflow.service import TierService
from tierflow.wire import add_tier_servicer, grpc_options

logger = logging.getLogger(__name__)

SERVICE_NAME = "tierflow.rpc.Tier"
# Threads serving gRPC streams (one per open stream); the work runs on the service's pool.
_STREAM_THREADS = 64
# How long stopping waits for cancelled streams to end, and how long after the grace
# period a stopping CLI process exits in any case ([Note: stopping a tier]).
_CANCEL_WAIT_S = 0.5
_EXIT_MARGIN_S = 0.9


class TierServer:
    """Serves one :class:`TierService` on ``listen`` (``HOST:PORT``; port 0 picks one).

    ``security`` says whether the port is TLS and which clients it serves
    ([Note: tier security] in ``tierflow.security``); by default plaintext on loopback.
    """

    def __init__(self, service: TierService, listen: str, security: Security | None = None) -> None:
        self.service = service
        self.listen = listen
        self.security = security or Security()
        self.port = 0
        self.health = health.HealthServicer()
        self._server = grpc.server(
            ThreadPoolExecutor(
                max_workers=_STREAM_THREADS, thread_name_prefix=f"{service.tier}-grpc"
            ),
            options=[*grpc_options(service.max_message_bytes), *server_options()],
            interceptors=self.security.interceptors(service.tier),
        )
        add_tier_servicer(service, self._server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        self._stopped = threading.Event()

    @property
    def address(self) -> str:
        host = self.listen.rpartition(":")[0] or "127.0.0.1"
        return f"{host}:{self.port}"

    def start(self) -> int:
        """Listen, load the model, then report SERVING; return the port."""
        for name in ("", SERVICE_NAME):
            self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        self.port = bind(self._server, self.listen, self.security, self.service.tier)
        self._server.start()
        try:
            self.service.load()
        except BaseException:
            self._server.stop(None)
            raise
        for name in ("", SERVICE_NAME):
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        logger.info("[%s] serving on %s", self.service.tier, self.address)
        return self.port

    def stop(self, grace: float | None = 2.0) -> None:
        """Stop as [Note: stopping a tier] says: drain within ``grace`` s, then release all.

        Returns within ``grace`` + about 0.7 s, whatever the streams do.
        """
        if self._stopped.is_set():
            return
        self._stopped.set()
        grace = max(grace or 0.0, 0.0)
        self.health.enter_graceful_shutdown()
        self._server.stop(grace)  # no new streams from now on
        if not self.service.drain(grace):
            logger.warning(
                "[%s] requests still in flight after %.3g s; cancelling them",
                self.service.tier,
                grace,
            )
        if not self._server.stop(0).wait(_CANCEL_WAIT_S):  # the streams left open
            logger.warning("[%s] streams did not end when cancelled", self.service.tier)
        self.service.close(timeout=0.2)
        logger.info("[%s] stopped", self.service.tier)

    def serve_until_signal(self, grace: float = 5.0) -> None:
        """Block until SIGTERM or SIGINT, then stop gracefully (for the CLI)."""
        stop = threading.Event()

        def on_signal(signum: int, frame: FrameType | None) -> None:
            logger.info(
                "[%s] %s received, shutting down", self.service.tier, signal.Signals(signum).name
            )
            stop.set()

        previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            while not stop.wait(1.0):
                pass
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            _exit_after(grace + _EXIT_MARGIN_S, self.service.tier)
            self.stop(grace)


def _exit_after(seconds: float, tier: str) -> None:
    """End the process in ``seconds`` if it is still running then ([Note: stopping a tier])."""

    def exit_now() -> None:
        logger.warning("[%s] still not stopped after %.3g s; exiting now", tier, seconds)
        logging.shutdown()
        os._exit(0)

    timer = threading.Timer(seconds, exit_now)
    timer.daemon = True
    timer.start()
