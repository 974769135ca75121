"""The feature-cache interface the tiers call: look a feature up, store an answer.

More memory → less computation: a tier that has seen a feature before (exactly, or
nearly for the approximate cache) returns the stored answer without running the rest of
the model. A tier (``tierflow.runtime.tier``) only knows this protocol, so it lives
in the core, and so do the in-process exact and approximate caches
(``tierflow.cache.memory``, ``tierflow.cache.approx``), which every tier may keep (the
device too: ``run --cache``), and the Redis cache that server replicas share
(``tierflow.cache.redis``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from tierflow.errors import CacheError


@dataclass(frozen=True)
class CacheAnswer:
    """A stored answer: the model outputs, and the exit that produced them (None = final)."""

    outputs: dict[str, np.ndarray]
    exit: str | None = None


SCOPE_BYTES = 16
"""Length of the scope prefix every :func:`cache_key` starts with."""


def cache_scope(model_sha256: str, plan_id: str, segment: int) -> bytes:
    """The digest of (model, plan, cut) that prefixes every key made for them.

    The approximate cache searches neighbours only among entries with the same scope, so
    an answer computed under another model, plan or cut can never be a neighbour.
    """
    digest = hashlib.blake2b(digest_size=SCOPE_BYTES, person=b"tierflow.scope")
    digest.update(f"{model_sha256}\0{plan_id}\0{segment}".encode())
    return digest.digest()


def key_scope(key: bytes) -> bytes:
    """The scope prefix of a key made by :func:`cache_key`."""
    return key[:SCOPE_BYTES]


def cache_key(
    model_sha256: str, plan_id: str, segment: int, features: Mapping[str, np.ndarray]
) -> bytes:
    """Hash of the incoming features together with the model, the plan and the cut.

    Binding model, plan and segment index into the key means a stale entry can never
    answer after the plan or the model changes. The key is the scope digest
    (:func:`cache_scope`, :data:`SCOPE_BYTES` long) followed by a 32-byte digest of the
    scope and the features, so caches can tell which (model, plan, cut) a key belongs to.
    """
    scope = cache_scope(model_sha256, plan_id, segment)
    digest = hashlib.blake2b(digest_size=32)
    digest.update(scope)
    for name in sorted(features):
        array = np.asarray(features[name])
        digest.update(f"{name}\0{array.dtype.str}\0{array.shape}\0".encode())
        # ascontiguousarray would turn a 0-d array into shape (1,); the shape is hashed above.
        digest.update(np.ascontiguousarray(array).data)
    return scope + digest.digest()


def answer_nbytes(answer: CacheAnswer) -> int:
    """Bytes an answer holds: its arrays' data plus the names, as a budget counts them."""
    total = len(answer.exit or "")
    for name, array in answer.outputs.items():
        total += len(name) + int(array.nbytes)
    return total


def frozen_answer(answer: CacheAnswer) -> CacheAnswer:
    """A read-only copy of ``answer``, so neither the caller nor a hit can change it."""
    outputs: dict[str, np.ndarray] = {}
    for name, array in answer.outputs.items():
        copy = np.array(array, copy=True, order="C")
        copy.flags.writeable = False
        outputs[name] = copy
    return CacheAnswer(outputs=outputs, exit=answer.exit)


@dataclass(frozen=True)
class CacheStats:
    """Counters of one cache, for reports and the benchmark.

    ``bytes`` is what the cache counts against ``budget_bytes`` (never more than it);
    ``expirations`` are entries dropped because their TTL ran out; ``errors`` are backend
    failures that were treated as misses (Redis unreachable, a corrupt entry);
    ``rejected`` are shared entries whose authentication failed (written without the
    key, or changed since), also misses.
    """

    hits: int = 0
    misses: int = 0
    stores: int = 0
    evictions: int = 0
    expirations: int = 0
    errors: int = 0
    rejected: int = 0
    entries: int = 0
    bytes: int = 0
    budget_bytes: int = 0

    @property
    def hit_rate(self) -> float:
        """Hits over lookups (0 when nothing was looked up)."""
        lookups = self.hits + self.misses
        return self.hits / lookups if lookups else 0.0

    def to_dict(self) -> dict[str, int | float]:
        return {
            "hits": self.hits,
            "misses": self.misses,
            "stores": self.stores,
            "evictions": self.evictions,
            "expirations": self.expirations,
            "errors": self.errors,
            "rejected": self.rejected,
            "entries": self.entries,
            "bytes": self.bytes,
            "budget_bytes": self.budget_bytes,
            "hit_rate": self.hit_rate,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> CacheStats:
        values: dict[str, int] = {}
        for name in cls.__dataclass_fields__:
            value = data.get(name, 0)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise CacheError(f"cache stats field {name!r}: expected a count, found {value!r}")
            values[name] = value
        return cls(**values)


class FeatureCache(Protocol):
    """What a tier needs from a cache. Implementations must be thread-safe."""

    def lookup(self, key: bytes, features: Mapping[str, np.ndarray]) -> CacheAnswer | None:
        """The stored answer for these features, or None on a miss."""
        ...

    def store(self, key: bytes, features: Mapping[str, np.ndarray], answer: CacheAnswer) -> None:
        """Remember ``answer`` for these features (may evict older entries)."""
        ...

    def stats(self) -> CacheStats:
        """Counters so far: hits, misses, evictions, entries, bytes held."""
        ...
