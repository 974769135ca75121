"""The cloud server: finishes the model (with early exits) and answers, using its caches.

The cloud is the last tier: it never forwards. Requests go through
``tierflow.service`` ([Note: a request at a tier]); a feature cache (the interface in
``tierflow.cache``, the implementations in the ``cache_*`` modules beside this one) is
consulted before any segment runs. ``tierflow serve cloud`` (``tierflow.cloud.commands``)
runs one of these until it is stopped.
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


class CloudServer(TierServer):
    """``tierflow serve cloud`` as an object: ``start()`` returns the port, ``stop()`` ends it."""

    def __init__(
        self,
        plan_dir: str | Path,
        listen: str = "127.0.0.1:0",
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
            "cloud",
            load_plan(plan_dir),
            plan_dir,
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
