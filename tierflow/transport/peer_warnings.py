"""Warnings about what a peer sent: every one counted, a few logged.

[Note: warnings about a peer]
A peer that sends garbage, or answers with figures no tier could have measured, must not
fill a tier's log: a trickle of undecodable messages once wrote a warning line for each
(1,792 lines in 32 s). So a warning about a peer is counted every time (by tier and kind,
the metrics' ``tierflow_peer_warnings_total``), and logged at most once per peer and kind
every :data:`LOG_INTERVAL_S` seconds; the line says how many like it were not logged since
the last one. Peers are remembered up to :data:`PEERS_KEPT` (the least recently warned
about are forgotten first), so a flood from many addresses costs bounded memory.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable

#: Seconds between two lines about the same peer and kind.
LOG_INTERVAL_S = 10.0
#: Peers whose last line is remembered at most.
PEERS_KEPT = 4096


class PeerWarnings:
    """Counts warnings by (tier, kind) and logs each peer's at most every ``interval_s``.

    Thread-safe. ``clock`` is for tests.
    """

    def __init__(
        self,
        interval_s: float = LOG_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._counts: Counter[tuple[str, str]] = Counter()
        # (peer, kind) -> (when last logged, warnings not logged since)
        self._last: OrderedDict[tuple[str, str], tuple[float, int]] = OrderedDict()

    def warn(
        self,
        logger: logging.Logger,
        tier: str,
        kind: str,
        peer: str,
        message: str,
        *args: object,
    ) -> bool:
        """Count one warning of ``kind`` about ``peer`` at ``tier``; log it (``message``
        with lazy ``args``) unless a line about that peer and kind was logged less than
        ``interval_s`` ago. Returns whether it was logged."""
        key = (peer, kind)
        with self._lock:
            self._counts[(tier, kind)] += 1
            now = self._clock()
            when, quiet = self._last.pop(key, (None, 0))
            if when is not None and now - when < self.interval_s:
                self._last[key] = (when, quiet + 1)
                return False
            self._last[key] = (now, 0)
            while len(self._last) > PEERS_KEPT:
                del self._last[next(iter(self._last))]
        if quiet:
            logger.warning(
                message + " (and %d more like it from this peer not logged)", *args, quiet
            )
        else:
            logger.warning(message, *args)
        return True

    def forget(self) -> None:
        """Forget when each peer was last logged about (the counts stay): the next warning
        about any peer is logged. Tests start each so, whatever ran before them."""
        with self._lock:
            self._last.clear()

    def counts(self, tier: str | None = None) -> dict[tuple[str, str], int]:
        """Warnings so far by (tier, kind); only ``tier``'s when given."""
        with self._lock:
            return {k: n for k, n in self._counts.items() if tier is None or k[0] == tier}


#: The process's warnings about its peers: each tier process is one tier, and its
#: metrics (``tierflow.runtime.metrics``) report these counts.
WARNINGS = PeerWarnings()
