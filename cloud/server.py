"""The cloud server: finishes the model (with early exits) and answers, using its caches.

The cloud is the last tier: it never forwards. Requests go through
``tierflow.service`` ([Note: a request at a tier]); a feature cache (``cache.py`` and
the ``cache_*`` implementations) is consulted before any segment runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from tierflow.cloud.cache import FeatureCache
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
            security=security,
        )
        super().__init__(service, listen, security)
