"""A tier's gRPC server: the ``Tier`` service, the standard health service, clean shutdown.

Follows grpc's own examples (``examples/python/health_checking`` and the graceful
shutdown example): the server starts with health NOT_SERVING, loads the model, then
reports SERVING; on SIGTERM or SIGINT it reports NOT_SERVING, stops accepting new
streams and gives those open ``grace`` seconds to finish. Message-size limits are set
explicitly on the server (``tierflow.wire.grpc_options``), the same as on every channel.
"""

from __future__ import annotations

import logging
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
        """Report NOT_SERVING, finish open streams within ``grace`` seconds, release all."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        self.health.enter_graceful_shutdown()
        self._server.stop(grace).wait()
        self.service.close()
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
            self.stop(grace)
