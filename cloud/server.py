"""The cloud server: finishes the model (with early exits) and answers, using its caches.

The cloud is the last tier: it never forwards. Requests go through
``tierflow.runtime.service`` ([Note: a request at a tier]); a feature cache (the interface in
``tierflow.cache.base``; in-process ones and Redis in ``tierflow.cache``) is
consulted before any segment runs. ``tierflow serve cloud`` (``tierflow.cloud.commands``)
runs one of these until it is stopped.
"""

from __future__ import annotations

from pathlib import Path

from tierflow.cache.base import FeatureCache
from tierflow.options import RuntimeOptions
from tierflow.plan import load_plan_set
from tierflow.runtime.server import TierServer
from tierflow.runtime.service import TierService


class CloudServer(TierServer):
    """``tierflow serve cloud`` as an object: ``start()`` returns the port, ``stop()`` ends it.

    ``cache`` is an optional feature cache; ``options`` say how to run (threads, emulated
    links, limits, TLS, ...).
    """

    def __init__(
        self,
        plan_dir: str | Path,
        listen: str = "127.0.0.1:0",
        *,
        cache: FeatureCache | None = None,
        options: RuntimeOptions | None = None,
    ) -> None:
        service = TierService(
            "cloud",
            load_plan_set(plan_dir, require_segments=False),
            plan_dir,
            cache=cache,
            options=options,
        )
        super().__init__(service, listen)
