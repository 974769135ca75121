"""The feature-cache interface the tiers call: look a feature up, store an answer.

More memory → less computation: a tier that has seen a feature before (exactly, or
nearly for the approximate cache) returns the stored answer without running the rest of
the model. Implementations (in-process exact and approximate caches, Redis) live in the
``cache_*`` modules beside this one; the runtime only knows this protocol.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import numpy as np


@dataclass(frozen=True)
class CacheAnswer:
    """A stored answer: the model outputs, and the exit that produced them (None = final)."""

    outputs: dict[str, np.ndarray]
    exit: str | None = None


def cache_key(
    model_sha256: str, plan_id: str, segment: int, features: Mapping[str, np.ndarray]
) -> bytes:
    """Hash of the incoming features together with the model, the plan and the cut.

    Binding model, plan and segment index into the key means a stale entry can never
    answer after the plan or the model changes.
    """
    digest = hashlib.blake2b(digest_size=32)
    digest.update(f"{model_sha256}\0{plan_id}\0{segment}\0".encode())
    for name in sorted(features):
        array = np.ascontiguousarray(features[name])
        digest.update(f"{name}\0{array.dtype.str}\0{array.shape}\0".encode())
        digest.update(array.data)
    return digest.digest()


class FeatureCache(Protocol):
    """What a tier needs from a cache. Implementations must be thread-safe."""

    def lookup(self, key: bytes, features: Mapping[str, np.ndarray]) -> CacheAnswer | None:
        """The stored answer for these features, or None on a miss."""
        ...

    def store(self, key: bytes, features: Mapping[str, np.ndarray], answer: CacheAnswer) -> None:
        """Remember ``answer`` for these features (may evict older entries)."""
        ...
