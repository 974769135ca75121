"""Feature caches: a feature seen before returns the stored answer without running the rest.

``base`` is the interface every cache implements and the cache key; ``memory`` the exact
in-process cache, ``approx`` the approximate one, ``redis`` the exact cache server replicas
share through Redis; ``config`` builds any of them from ``--cache``.
"""
