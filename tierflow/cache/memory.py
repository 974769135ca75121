"""In-process exact feature cache: bounded by a byte budget, LRU eviction, optional TTL.

A hit returns the stored answer bit-for-bit: answers are copied into read-only arrays
when stored, so neither the caller that stored them nor one that got them from a hit can
change what later hits see. The budget counts every entry honestly (see
[Note: cache entry size]) and is never exceeded; an entry larger than the whole budget is
simply not stored.

[Note: cache entry size]
An entry costs its arrays' ``nbytes``, their names, its key, any search signature it
carries (the approximate cache), and a fixed overhead per entry (:data:`ENTRY_OVERHEAD`:
the entry record, its answer and dict, its place in the LRU order) and per array
(:data:`ARRAY_OVERHEAD`: the ndarray header and the name string). The overheads are
CPython 3.11 ``sys.getsizeof`` figures rounded up, so the budget is a bound on the memory
the cache holds, not just on the payload.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from tierflow.cache.base import CacheAnswer, CacheStats, answer_nbytes, frozen_answer
from tierflow.errors import CacheError

logger = logging.getLogger(__name__)

ENTRY_OVERHEAD = 512
"""Bytes charged per entry beyond its arrays (see [Note: cache entry size])."""

ARRAY_OVERHEAD = 160
"""Bytes charged per stored array beyond its data (see [Note: cache entry size])."""

Clock = Callable[[], float]


@dataclass(frozen=True)
class _Entry:
    answer: CacheAnswer
    size: int
    expires_at: float | None


def entry_size(key: bytes, answer: CacheAnswer, extra_bytes: int = 0) -> int:
    """What one entry costs against a budget (see [Note: cache entry size])."""
    return (
        answer_nbytes(answer)
        + len(key)
        + extra_bytes
        + ENTRY_OVERHEAD
        + ARRAY_OVERHEAD * len(answer.outputs)
    )


def check_budget(budget_bytes: int, ttl_s: float | None) -> None:
    """Reject budgets and TTLs that cannot work, naming what was found."""
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes <= 0:
        raise CacheError(
            f"cache budget: expected a positive number of bytes, found {budget_bytes!r}"
        )
    if ttl_s is not None and not ttl_s > 0:
        raise CacheError(f"cache ttl: expected a positive number of seconds, found {ttl_s!r}")


class LruStore:
    """Budgeted LRU map from key to answer with expiry and counters; NOT locked.

    The building block of :class:`MemoryCache` and the approximate cache, which hold
    their own lock around it. ``on_remove`` is called with the key of every entry that
    leaves (evicted, expired or replaced), so an index kept beside the store stays in step.
    """

    def __init__(
        self,
        budget_bytes: int,
        *,
        ttl_s: float | None = None,
        clock: Clock = time.monotonic,
        on_remove: Callable[[bytes], None] | None = None,
    ) -> None:
        check_budget(budget_bytes, ttl_s)
        self.budget_bytes = budget_bytes
        self.ttl_s = ttl_s
        self.clock = clock
        self._on_remove = on_remove
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self.stores = 0
        self.evictions = 0
        self.expirations = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def is_live(self, key: bytes, now: float) -> bool:
        """Whether ``key`` is held and not expired at ``now`` (drops it if expired)."""
        entry = self._entries.get(key)
        if entry is None:
            return False
        if entry.expires_at is not None and now >= entry.expires_at:
            self._remove(key)
            self.expirations += 1
            return False
        return True

    def hit(self, key: bytes) -> CacheAnswer:
        """Count a hit on a live ``key``, mark it most recently used, return its answer.

        The answer's dict is new on every hit (the arrays are the stored read-only ones),
        so a caller adding or dropping outputs cannot change the stored entry.
        """
        self._entries.move_to_end(key)
        self.hits += 1
        answer = self._entries[key].answer
        return CacheAnswer(outputs=dict(answer.outputs), exit=answer.exit)

    def peek(self, key: bytes) -> CacheAnswer:
        """The stored answer of a held ``key`` without counting or reordering anything."""
        return self._entries[key].answer

    def expires_at(self, key: bytes) -> float | None:
        """When a held ``key`` expires (None: never)."""
        return self._entries[key].expires_at

    def get(self, key: bytes) -> CacheAnswer | None:
        """The live answer for ``key`` (counting a hit), or None (counting a miss)."""
        if self.is_live(key, self.clock()):
            return self.hit(key)
        self.misses += 1
        return None

    def put(self, key: bytes, answer: CacheAnswer, extra_bytes: int = 0) -> bool:
        """Store a read-only copy of ``answer``; False if it is larger than the budget.

        Least recently used entries are evicted until it fits; expired entries met on the
        way count as expirations, not evictions.
        """
        size = entry_size(key, answer, extra_bytes)
        if key in self._entries:
            self._remove(key)
        if size > self.budget_bytes:
            logger.debug(
                "[cache] not storing an entry of %d bytes: the budget is %d bytes",
                size,
                self.budget_bytes,
            )
            return False
        now = self.clock()
        while self.bytes + size > self.budget_bytes:
            oldest, entry = next(iter(self._entries.items()))
            self._remove(oldest)
            if entry.expires_at is not None and now >= entry.expires_at:
                self.expirations += 1
            else:
                self.evictions += 1
        expires_at = None if self.ttl_s is None else now + self.ttl_s
        self._entries[key] = _Entry(frozen_answer(answer), size, expires_at)
        self.bytes += size
        self.stores += 1
        return True

    def _remove(self, key: bytes) -> None:
        entry = self._entries.pop(key)
        self.bytes -= entry.size
        if self._on_remove is not None:
            self._on_remove(key)

    def stats(self, errors: int = 0) -> CacheStats:
        return CacheStats(
            hits=self.hits,
            misses=self.misses,
            stores=self.stores,
            evictions=self.evictions,
            expirations=self.expirations,
            errors=errors,
            entries=len(self._entries),
            bytes=self.bytes,
            budget_bytes=self.budget_bytes,
        )


class MemoryCache:
    """Exact feature cache in this process: a hit needs the very same key.

    Thread-safe (one lock around the store). ``clock`` is injectable so tests can move
    time past a TTL without sleeping.
    """

    def __init__(
        self, budget_bytes: int, *, ttl_s: float | None = None, clock: Clock = time.monotonic
    ) -> None:
        self._lock = threading.Lock()
        self._store = LruStore(budget_bytes, ttl_s=ttl_s, clock=clock)

    def __repr__(self) -> str:
        return f"MemoryCache(budget_bytes={self._store.budget_bytes}, ttl_s={self._store.ttl_s})"

    def lookup(self, key: bytes, features: Mapping[str, np.ndarray]) -> CacheAnswer | None:
        """The stored answer for exactly this key, or None; ``features`` are not needed."""
        with self._lock:
            return self._store.get(key)

    def store(self, key: bytes, features: Mapping[str, np.ndarray], answer: CacheAnswer) -> None:
        """Keep a read-only copy of ``answer`` under ``key``, evicting LRU entries to fit."""
        with self._lock:
            self._store.put(key, answer)

    def stats(self) -> CacheStats:
        with self._lock:
            return self._store.stats()
