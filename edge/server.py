"""The edge server: serves devices, runs the middle segment(s), may exit early, forwards up.

The edge keeps one long-lived stream to the cloud
(``tierflow.transport.stream_client.StreamClient``) and multiplexes every device's requests
over it; what happens to a request is in
``tierflow.runtime.service`` ([Note: a request at a tier]). ``tierflow serve edge``
(``tierflow.edge.commands``) runs one of these until it is stopped.
"""

from __future__ import annotations

from pathlib import Path

from tierflow.cache.base import FeatureCache
from tierflow.edge.forwarding import Forwarding
from tierflow.options import RuntimeOptions
from tierflow.plan import load_plan_set
from tierflow.runtime.server import TierServer
from tierflow.runtime.service import TierService


class EdgeServer(TierServer):
    """``tierflow serve edge`` as an object: ``start()`` returns the port, ``stop()`` ends it.

    ``upstream`` (the cloud's ``HOST:PORT``) is needed when the plan runs segments on the
    cloud. ``cache`` is an optional feature cache consulted before running the edge's
    segments; ``options`` say how to run (threads, emulated links, limits, TLS, ...).
    """

    def __init__(
        self,
        plan_dir: str | Path,
        listen: str = "127.0.0.1:0",
        upstream: str | None = None,
        *,
        cache: FeatureCache | None = None,
        options: RuntimeOptions | None = None,
    ) -> None:
        service = TierService(
            "edge",
            load_plan_set(plan_dir, require_segments=False),
            plan_dir,
            forwarder=Forwarding(upstream) if upstream else None,
            cache=cache,
            options=options,
        )
        super().__init__(service, listen)
