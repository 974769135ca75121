"""The edge server: serves devices, runs the middle segment(s), may exit early, forwards up.

The edge keeps one long-lived stream to the cloud (``tierflow.mux.StreamClient``) and
multiplexes every device's requests over it; what happens to a request is in
``tierflow.service`` ([Note: a request at a tier]). ``tierflow serve edge``
(``tierflow.edge.commands``) runs one of these until it is stopped.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from tierflow.cache import FeatureCache
from tierflow.codec import DEFAULT_MAX_TENSOR_BYTES
from tierflow.links import LinkSpec
from tierflow.plan import load_plan
from tierflow.security import Security
from tierflow.segment_runner import DEFAULT_OPTIMIZATION
from tierflow.server import TierServer
from tierflow.service import TierService


class EdgeServer(TierServer):
    """``tierflow serve edge`` as an object: ``start()`` returns the port, ``stop()`` ends it.

    ``upstream`` (the cloud's ``HOST:PORT``) is needed when the plan runs segments on the
    cloud. ``links`` are emulated links (see ``tierflow.linkemu``); ``cache`` an optional
    feature cache consulted before running the edge's segments.
    """

    def __init__(
        self,
        plan_dir: str | Path,
        listen: str = "127.0.0.1:0",
        upstream: str | None = None,
        *,
        cache: FeatureCache | None = None,
        threads: int = 1,
        slowdown: float = 1.0,
        optimization: str = DEFAULT_OPTIMIZATION,
        workers: int | None = None,
        links: Mapping[str, LinkSpec] | None = None,
        max_tensor_bytes: int = DEFAULT_MAX_TENSOR_BYTES,
        security: Security | None = None,
    ) -> None:
        service = TierService(
            "edge",
            load_plan(plan_dir),
            plan_dir,
            upstream=upstream,
            cache=cache,
            threads=threads,
            slowdown=slowdown,
            optimization=optimization,
            workers=workers,
            links=links,
            max_tensor_bytes=max_tensor_bytes,
            security=security,
        )
        super().__init__(service, listen, security)
