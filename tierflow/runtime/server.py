"""A tier's gRPC server: the ``Tier`` service, the standard health service, clean shutdown.

Follows grpc's own examples (``examples/python/health_checking`` and the graceful
shutdown example): the server starts with health NOT_SERVING, loads the model, then
reports SERVING; on SIGTERM or SIGINT it stops as [Note: stopping a tier] says.
Message-size limits are set explicitly on the server (``tierflow.transport.wire.grpc_options``),
the same as on every channel.

One server class serves every tier: :meth:`TierServer.from_plan` configures it by role
(``"edge"`` or ``"cloud"``), and a role differs only by its forwarder (the edge's
``tierflow.edge.forwarding.Forwarding``; the cloud has none). Each tier owns its
``tierflow serve TIER`` command (``tierflow.edge.commands``, ``tierflow.cloud.commands``);
the options every server takes are declared in ``tierflow.cli.serve``, and the run until a
signal is here.

[Note: stopping a tier]
At once: health reports NOT_SERVING, no new stream is accepted, and every new request on
an open stream is answered UNAVAILABLE ("stopping"), so devices go elsewhere. Requests
already in flight get up to ``grace`` seconds to be answered; then the streams still
open (idle devices keep theirs open) are cancelled and the tier releases its model and
its stream to the next tier. The CLI process always exits within ``grace`` + 1 s: if
anything still holds it then (a segment still running, a stuck writer), it exits anyway.
It handles SIGTERM and SIGINT before it prints where it serves, so a signal sent as soon
as a script has read that line stops it this way too (one sent in the moment after the
lines, before the handlers were in place, used to kill it outright).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tierflow.cache.base import FeatureCache
from tierflow.errors import UsageError
from tierflow.options import RuntimeOptions
from tierflow.plan import load_plan_set
from tierflow.runtime.limits import receive_limit
from tierflow.runtime.service import TierService
from tierflow.runtime.tier import Forwarder, Tier
from tierflow.state.store import describe_state_budget
from tierflow.transport.security import bind, server_options
from tierflow.transport.wire import add_tier_servicer, grpc_options
from tierflow.tuning import cpus_awake, tune_for_latency

if TYPE_CHECKING:
    from tierflow.runtime.metrics import TierMetrics

logger = logging.getLogger(__name__)

SERVICE_NAME = "tierflow.rpc.Tier"
# gRPC threads beyond the stream caps, for health checks ([Note: stream admission]).
_SPARE_THREADS = 16
# How long stopping waits for cancelled streams to end, and how long after the grace
# period a stopping CLI process exits in any case ([Note: stopping a tier]).
_CANCEL_WAIT_S = 0.5
_EXIT_MARGIN_S = 0.9


class TierServer:
    """Serves one :class:`~tierflow.runtime.tier.Tier` on ``listen`` (``HOST:PORT``; port 0
    picks one), through its :class:`TierService`.

    ``tierflow serve TIER`` as an object: ``start()`` returns the port, ``stop()`` ends it;
    :meth:`from_plan` makes one for a tier's role from a plan directory. The tier's
    ``options.security`` says whether the port is TLS and which clients it serves
    ([Note: tier security] in ``tierflow.transport.security``); by default plaintext on
    loopback.
    """

    @classmethod
    def from_plan(
        cls,
        tier: str,
        plan_dir: str | Path,
        listen: str = "127.0.0.1:0",
        *,
        forwarder: Forwarder | None = None,
        cache: FeatureCache | None = None,
        options: RuntimeOptions | None = None,
    ) -> TierServer:
        """The server of ``tier`` (``"edge"`` or ``"cloud"``) for the plan in ``plan_dir``.

        ``forwarder`` passes requests on to the next tier (the edge's, to the cloud, is
        ``tierflow.edge.forwarding.Forwarding``; needed when the plan runs segments above
        this tier; the cloud has none). ``cache`` is an optional feature cache consulted
        before the tier's segments run; ``options`` say how to run (threads, emulated
        links, limits, TLS, ...).
        """
        served = Tier(
            tier,
            load_plan_set(plan_dir, require_segments=False),
            plan_dir,
            forwarder=forwarder,
            cache=cache,
            options=options,
        )
        return cls(served, listen)

    def __init__(self, tier: Tier, listen: str) -> None:
        self.tier = tier
        self.service = TierService(tier)
        self.listen = listen
        self.security = tier.options.security
        self.port = 0
        self.health = health.HealthServicer()
        # One thread per call gRPC admits, so that no call waits behind idle streams
        # ([Note: stream admission] in tierflow.runtime.admission); threads start as needed.
        calls = tier.options.max_streams + _SPARE_THREADS
        #: The largest message gRPC takes here ([Note: a tier's largest request]).
        self.receive_limit = receive_limit(
            tier.plans.plans, tier.name, tier.options.max_message_bytes
        )
        options = [
            (key, self.receive_limit if key == "grpc.max_receive_message_length" else value)
            for key, value in grpc_options(tier.options.max_message_bytes)
        ]
        self._server = grpc.server(
            ThreadPoolExecutor(max_workers=calls, thread_name_prefix=f"{tier.name}-grpc"),
            options=[*options, *server_options()],
            maximum_concurrent_rpcs=calls,
            interceptors=self.security.interceptors(tier.name),
        )
        add_tier_servicer(self.service, self._server)
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
        self.port = bind(self._server, self.listen, self.security, self.tier.name)
        self._server.start()
        try:
            self.tier.load()
        except BaseException:
            self._server.stop(None)
            raise
        for name in ("", SERVICE_NAME):
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        logger.info("[%s] serving on %s", self.tier.name, self.address)
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
                self.tier.name,
                grace,
            )
        if not self._server.stop(0).wait(_CANCEL_WAIT_S):  # the streams left open
            logger.warning("[%s] streams did not end when cancelled", self.tier.name)
        self.tier.close(timeout=0.2)
        logger.info("[%s] stopped", self.tier.name)

    def serve_until_signal(
        self, grace: float = 5.0, ready: Callable[[], None] | None = None
    ) -> None:
        """Block until SIGTERM or SIGINT, then stop gracefully (for the CLI).

        ``ready`` (the CLI's lines saying where the tier serves) runs once the signals are
        handled: a SIGTERM sent as soon as the tier says it serves stops it gracefully,
        instead of killing it before its handler was in place.
        """
        stop = threading.Event()

        def on_signal(signum: int, frame: FrameType | None) -> None:
            logger.info(
                "[%s] %s received, shutting down", self.tier.name, signal.Signals(signum).name
            )
            stop.set()

        previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            if ready is not None:
                ready()
            while not stop.wait(1.0):
                pass
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            _exit_after(grace + _EXIT_MARGIN_S, self.tier.name)
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


def watch_metrics(tier: Tier) -> TierMetrics:
    """The Prometheus metrics of ``serve --metrics-port`` (``tierflow.runtime.metrics``),
    counted by ``tier`` from now on."""
    from tierflow.runtime.metrics import TierMetrics  # the metrics extra: only when asked

    metrics = TierMetrics(
        tier.name,
        lambda: tier.in_flight,
        segments=lambda: tier.segments,
        states=lambda: None if tier.pipeline is None else tier.pipeline.states,
        batches=tier.batch_stats,
    )
    tier.metrics = metrics
    return metrics


def serve_until_stopped(
    server: TierServer,
    grace: float,
    metrics_port: int | None = None,
    awake: bool = False,
) -> int:
    """Start ``server``, say where it serves, and run until SIGTERM or SIGINT (the CLI).

    With ``metrics_port`` the tier also serves Prometheus metrics (``tierflow.runtime.metrics``)
    on the host it listens on, and says where on a second line. With ``awake`` it keeps
    the machine's CPUs from sleeping while it serves (``--cpus-awake``: [Note: CPUs that
    sleep between steps] in tierflow/tuning.py).
    """
    tune_for_latency()
    with cpus_awake(awake) as held:
        return _serve(server, grace, metrics_port, held)


def _serve(server: TierServer, grace: float, metrics_port: int | None, awake: bool) -> int:
    """:func:`serve_until_stopped` once the process is set; ``awake``: the CPUs are kept
    awake (said on a line of its own, after the first)."""
    tier = server.tier
    metrics = None
    if metrics_port is not None:
        if not 0 <= metrics_port <= 65535:
            raise UsageError(f"--metrics-port must be a port number, got {metrics_port}")
        metrics = watch_metrics(tier)

    def say_serving() -> None:
        # One line on stdout, so that scripts (and tests) can learn a port picked by the OS.
        print(
            f"tierflow {tier.name} serving plan {tier.plan_id} on {server.address}",
            flush=True,
        )
        if metrics is not None:
            host = server.address.rpartition(":")[0]
            try:
                port = metrics.start(host.strip("[]"), metrics_port or 0)
            except BaseException:
                server.stop(0)
                raise
            print(f"tierflow {tier.name} metrics on http://{host}:{port}/metrics", flush=True)
        if awake:
            print(f"tierflow {tier.name} keeps the machine's CPUs awake while serving", flush=True)
        if any(plan.states for plan in tier.plans.plans):
            budget = describe_state_budget(tier.options.state_budget, tier.options.state_share)
            print(f"tierflow {tier.name} session state: {budget}", flush=True)

    server.start()
    try:
        server.serve_until_signal(grace=grace, ready=say_serving)
    finally:
        if metrics is not None:
            metrics.stop()
    return 0
