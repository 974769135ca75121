"""Approximate feature cache: answer from the nearest stored feature within a threshold.

For streams of similar inputs (video frames, a sensor that barely changes) the feature of
the next request is close to one already answered, so its stored answer is very likely
the answer the model would compute. Each feature is reduced to a compact signature
(:func:`signature`: average-pooled to ``dim`` floats and L2-normalised), and a lookup
answers from the nearest live entry of the same scope only when the Euclidean distance
between signatures is at most the threshold. See [Note: approximate cache threshold].

[Note: approximate cache threshold]
The threshold trades hit rate for wrong answers. :func:`calibrate_threshold` picks it from
measured pairs (distance to the nearest stored feature, whether that neighbour's answer
differs from the computed one): the largest distance whose disagreement rate among the
queries it would answer stays within the target. With ``confidence`` > 0 the rate used is
a one-sided Wilson upper bound, so the target holds on held-out data, not only on the
calibration set. A cache built with ``target=`` instead of ``threshold=`` calibrates
itself online: a miss whose nearest neighbour is known is a free measurement once the
runtime stores the computed answer, and every ``audit_every``-th approximate hit is turned
into such a measurement so the rate below the threshold keeps being checked. Until
``min_samples`` measurements exist it answers exact repeats only. Approximate answers
never come from an entry farther than the threshold in force.

[Note: search cost]
A lookup is one float32 matrix-vector product over the scope's signatures (256 floats
each: about 1 MiB and well under a millisecond for 1000 entries) plus the exact distance
of the winner. The product goes through the BLAS numpy uses; on a busy machine a
multi-threaded BLAS can make such small products much slower than one thread, so a cloud
server sharing its cores should run with ``OPENBLAS_NUM_THREADS=1`` (or threadpoolctl).

[Note: approximate cache scope]
Neighbours are searched only among entries whose key has the same scope (model, plan and
cut, :func:`tierflow.cache.base.key_scope`) and whose features have the same names,
shapes and dtypes, so no answer made under another model, plan, cut or input layout can
ever be returned.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import math
import statistics
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from tierflow.cache.base import CacheAnswer, CacheStats, key_scope
from tierflow.cache.memory import Clock, LruStore
from tierflow.errors import CacheError

logger = logging.getLogger(__name__)

DEFAULT_DIM = 256
"""Floats in a signature: small enough to search thousands brute force, large enough to
tell frames apart."""

SIGNATURE_OVERHEAD = 160
"""Bytes charged per entry for its row in the search index beyond the signature itself
(key reference, row map entry, expiry and norm)."""

Agreement = Callable[[CacheAnswer, CacheAnswer], bool]


def signature(features: Mapping[str, np.ndarray], dim: int = DEFAULT_DIM) -> np.ndarray:
    """A fixed-length, unit-norm float32 summary of ``features`` (deterministic).

    The features (sorted by name) are flattened into one vector and average-pooled into
    ``dim`` contiguous bins (zero-padded if shorter), then scaled to unit length, so
    distances lie in [0, 2] and do not depend on the feature's overall scale.
    """
    parts = [np.asarray(features[name], dtype=np.float32).ravel() for name in sorted(features)]
    if len(parts) == 1:
        flat = parts[0]
    else:
        flat = np.concatenate(parts) if parts else np.zeros(0, dtype=np.float32)
    pooled = _pool(flat, dim)
    if not np.isfinite(pooled).all():  # rare: pay for the cleaning copy only then
        pooled = _pool(np.nan_to_num(flat, nan=0.0, posinf=0.0, neginf=0.0), dim)
    norm = float(np.linalg.norm(pooled))
    if norm > 0:
        pooled /= norm
    return pooled.astype(np.float32)


def _pool(flat: np.ndarray, dim: int) -> np.ndarray:
    """Average ``flat`` into ``dim`` contiguous bins (zero-padded if shorter), in float64."""
    if flat.size <= dim:
        pooled = np.zeros(dim, dtype=np.float64)
        pooled[: flat.size] = flat
        return pooled
    starts, counts = _bins(flat.size, dim)
    return np.asarray(np.add.reduceat(flat, starts, dtype=np.float64) / counts)


@functools.lru_cache(maxsize=64)
def _bins(size: int, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """Start and length of each of ``dim`` near-equal bins over ``size`` values."""
    starts = (np.arange(dim, dtype=np.int64) * size) // dim
    counts = np.diff(np.append(starts, size)).astype(np.float64)
    starts.flags.writeable = False
    counts.flags.writeable = False
    return starts, counts


def distance(a: np.ndarray, b: np.ndarray) -> float:
    """Euclidean distance between two signatures, as the cache measures it."""
    return float(np.linalg.norm(a.astype(np.float64) - b.astype(np.float64)))


def nearest(reference: np.ndarray, queries: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For each row of ``queries``, the index of and distance to its nearest ``reference`` row.

    Brute force and vectorised; for offline calibration on held-out streams.
    """
    ref = np.asarray(reference, dtype=np.float64)
    qry = np.asarray(queries, dtype=np.float64)
    if ref.ndim != 2 or qry.ndim != 2 or ref.shape[1] != qry.shape[1] or len(ref) == 0:
        raise CacheError(
            f"nearest: expected two 2-d signature matrices of equal width, the reference "
            f"non-empty; found shapes {ref.shape} and {qry.shape}"
        )
    squared = (qry**2).sum(1)[:, None] - 2.0 * qry @ ref.T + (ref**2).sum(1)[None, :]
    index = np.argmin(squared, axis=1)
    gaps = qry - ref[index]
    return index, np.sqrt((gaps**2).sum(1))


def same_top1(a: CacheAnswer, b: CacheAnswer) -> bool:
    """Whether two answers agree: same exit, same outputs, same argmax of every output."""
    if a.exit != b.exit or a.outputs.keys() != b.outputs.keys():
        return False
    for name, left in a.outputs.items():
        right = b.outputs[name]
        if left.shape != right.shape:
            return False
        if left.ndim == 0:
            if not np.array_equal(left, right):
                return False
        elif not np.array_equal(np.argmax(left, axis=-1), np.argmax(right, axis=-1)):
            return False
    return True


@dataclass(frozen=True)
class Calibration:
    """A chosen threshold and what it achieved on the pairs it was measured on.

    ``threshold`` None means no distance met the target: answer exact repeats only.
    ``disagreement`` is the measured rate of wrong answers among the ``answered`` pairs
    within the threshold, ``upper_bound`` the rate the choice was held to (equal to
    ``disagreement`` when ``confidence`` is 0), ``coverage`` the fraction of all
    ``samples`` the threshold answers.
    """

    threshold: float | None
    target: float
    confidence: float
    disagreement: float
    upper_bound: float
    coverage: float
    answered: int
    samples: int

    def to_dict(self) -> dict[str, float | int | None]:
        return {
            "threshold": self.threshold,
            "target": self.target,
            "confidence": self.confidence,
            "disagreement": self.disagreement,
            "upper_bound": self.upper_bound,
            "coverage": self.coverage,
            "answered": self.answered,
            "samples": self.samples,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> Calibration:
        try:
            threshold = data["threshold"]
            return cls(
                threshold=None if threshold is None else float(threshold),  # type: ignore[arg-type]
                target=float(data["target"]),  # type: ignore[arg-type]
                confidence=float(data["confidence"]),  # type: ignore[arg-type]
                disagreement=float(data["disagreement"]),  # type: ignore[arg-type]
                upper_bound=float(data["upper_bound"]),  # type: ignore[arg-type]
                coverage=float(data["coverage"]),  # type: ignore[arg-type]
                answered=int(data["answered"]),  # type: ignore[call-overload]
                samples=int(data["samples"]),  # type: ignore[call-overload]
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise CacheError(f"malformed calibration {dict(data)!r}: {exc}") from exc


def wilson_upper(wrong: np.ndarray, total: np.ndarray, confidence: float) -> np.ndarray:
    """One-sided Wilson score upper bound on a rate of ``wrong`` in ``total`` trials."""
    z = statistics.NormalDist().inv_cdf(confidence)
    n = total.astype(np.float64)
    p = wrong / n
    centre = p + z * z / (2 * n)
    spread = z * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return np.asarray((centre + spread) / (1 + z * z / n))


def calibrate_threshold(
    distances: npt.ArrayLike,
    disagree: npt.ArrayLike,
    target: float,
    *,
    confidence: float = 0.95,
) -> Calibration:
    """The largest distance threshold whose disagreement rate stays within ``target``.

    ``distances[i]`` is query i's distance to its nearest stored feature, ``disagree[i]``
    whether that neighbour's answer differs from the one computed for query i. Candidate
    thresholds are the measured distances; the rate at a threshold is over the queries it
    would answer. With ``confidence`` > 0 the Wilson upper bound of that rate must be
    within the target (see [Note: approximate cache threshold]); 0 uses the measured rate.
    """
    dist = np.asarray(distances, dtype=np.float64).ravel()
    bad = np.asarray(disagree, dtype=bool).ravel()
    if dist.shape != bad.shape:
        raise CacheError(
            f"calibration: expected one disagreement flag per distance, found "
            f"{bad.size} flags for {dist.size} distances"
        )
    if not 0 <= target < 1:
        raise CacheError(f"calibration target: expected a rate in [0, 1), found {target!r}")
    if not 0 <= confidence < 1:
        raise CacheError(f"calibration confidence: expected [0, 1), found {confidence!r}")
    if not np.all(np.isfinite(dist)) or np.any(dist < 0):
        raise CacheError("calibration: distances must be finite and non-negative")
    samples = int(dist.size)
    order = np.argsort(dist, kind="stable")
    dist, bad = dist[order], bad[order]
    answered = np.arange(1, samples + 1)
    wrong = np.cumsum(bad)
    rate = wrong / np.maximum(answered, 1)
    bound = wilson_upper(wrong, answered, confidence) if confidence > 0 else rate
    # A threshold answers every query at its distance, so only the last of equal ones counts.
    last_of_value = np.append(dist[1:] != dist[:-1], True) if samples else np.zeros(0, bool)
    ok = np.flatnonzero(last_of_value & (bound <= target))
    if ok.size == 0:
        return Calibration(None, target, confidence, 0.0, 0.0, 0.0, 0, samples)
    best = int(ok[-1])
    return Calibration(
        threshold=float(dist[best]),
        target=target,
        confidence=confidence,
        disagreement=float(rate[best]),
        upper_bound=float(bound[best]),
        coverage=(best + 1) / samples,
        answered=best + 1,
        samples=samples,
    )


def evaluate_threshold(
    distances: npt.ArrayLike, disagree: npt.ArrayLike, threshold: float | None
) -> tuple[float, float]:
    """(disagreement rate among answered, coverage) of ``threshold`` on held-out pairs."""
    dist = np.asarray(distances, dtype=np.float64).ravel()
    bad = np.asarray(disagree, dtype=bool).ravel()
    if threshold is None or dist.size == 0:
        return 0.0, 0.0
    answered = dist <= threshold
    count = int(answered.sum())
    if count == 0:
        return 0.0, 0.0
    return float(bad[answered].mean()), count / dist.size


class _ScopeIndex:
    """Signatures of one scope's entries in a growable matrix, searched brute force."""

    def __init__(self, dim: int) -> None:
        self.matrix = np.zeros((16, dim), dtype=np.float32)
        self.norms = np.zeros(16, dtype=np.float64)
        self.expires = np.zeros(16, dtype=np.float64)
        self.keys: list[bytes] = []
        self.row_of: dict[bytes, int] = {}

    def __len__(self) -> int:
        return len(self.keys)

    def add(self, key: bytes, sig: np.ndarray, expires_at: float | None) -> None:
        row = len(self.keys)
        if row == len(self.matrix):
            self._resize(2 * len(self.matrix))
        self.matrix[row] = sig
        self.norms[row] = float(sig.astype(np.float64) @ sig.astype(np.float64))
        self.expires[row] = math.inf if expires_at is None else expires_at
        self.keys.append(key)
        self.row_of[key] = row

    def remove(self, key: bytes) -> None:
        row = self.row_of.pop(key)
        last = len(self.keys) - 1
        if row != last:
            moved = self.keys[last]
            self.matrix[row] = self.matrix[last]
            self.norms[row] = self.norms[last]
            self.expires[row] = self.expires[last]
            self.keys[row] = moved
            self.row_of[moved] = row
        self.keys.pop()
        if len(self.matrix) > 16 and len(self.keys) < len(self.matrix) // 4:
            self._resize(len(self.matrix) // 2)

    def _resize(self, rows: int) -> None:
        count = len(self.keys)
        for name in ("matrix", "norms", "expires"):
            old = getattr(self, name)
            new = np.zeros((rows, *old.shape[1:]), dtype=old.dtype)
            new[:count] = old[:count]
            setattr(self, name, new)

    def nearest(self, sig: np.ndarray, now: float) -> tuple[bytes, float] | None:
        """The nearest live entry's key and its exact distance, or None if none is live."""
        count = len(self.keys)
        if count == 0:
            return None
        # float32 product: upcasting the matrix would copy it on every lookup.
        # See [Note: search cost].
        products = self.matrix[:count] @ sig
        query = sig.astype(np.float64)
        squared = self.norms[:count] - 2.0 * products + query @ query
        squared[self.expires[:count] <= now] = np.inf
        row = int(np.argmin(squared))
        if not np.isfinite(squared[row]):
            return None
        # The exact distance of the chosen row decides, not the expanded-form estimate.
        return self.keys[row], distance(self.matrix[row], sig)


@dataclass(frozen=True)
class _Pending:
    """What a miss learned, kept until the runtime stores the computed answer."""

    scope: bytes
    sig: np.ndarray
    neighbour: bytes | None
    distance: float


class ApproxCache:
    """Feature cache answering from the nearest stored feature within a threshold.

    Give either ``threshold`` (a distance from :func:`calibrate_threshold` run offline) or
    ``target`` (a disagreement rate; the cache calibrates itself online, see
    [Note: approximate cache threshold]). Exact repeats of a key always hit. Bounded by
    ``budget_bytes`` (signatures included), LRU eviction, optional TTL, thread-safe.
    """

    PENDING_LIMIT = 256
    """Misses remembered until their answer is stored (for online calibration)."""

    def __init__(
        self,
        budget_bytes: int,
        *,
        threshold: float | None = None,
        target: float | None = None,
        ttl_s: float | None = None,
        dim: int = DEFAULT_DIM,
        clock: Clock = time.monotonic,
        agree: Agreement = same_top1,
        confidence: float = 0.95,
        min_samples: int = 300,
        audit_every: int = 20,
        window: int = 4096,
    ) -> None:
        if (threshold is None) == (target is None):
            raise CacheError(
                "approximate cache: expected exactly one of a distance threshold or a "
                f"target disagreement rate, found threshold={threshold!r}, target={target!r}"
            )
        if threshold is not None and not (math.isfinite(threshold) and threshold >= 0):
            raise CacheError(f"approximate cache threshold: expected >= 0, found {threshold!r}")
        if target is not None and not 0 <= target < 1:
            raise CacheError(
                f"approximate cache target: expected a rate in [0, 1), found {target!r}"
            )
        if dim < 1 or min_samples < 1 or audit_every < 1 or window < min_samples:
            raise CacheError(
                f"approximate cache: expected dim, min_samples, audit_every >= 1 and "
                f"window >= min_samples, found {dim}, {min_samples}, {audit_every}, {window}"
            )
        self._lock = threading.Lock()
        self._indexes: dict[bytes, _ScopeIndex] = {}
        self._scope_of: dict[bytes, bytes] = {}
        self._store = LruStore(budget_bytes, ttl_s=ttl_s, clock=clock, on_remove=self._unindex)
        self.dim = dim
        self.target = target
        self.confidence = confidence
        self.min_samples = min_samples
        self.audit_every = audit_every
        self._threshold = threshold
        self._agree = agree
        self._pending: OrderedDict[bytes, _Pending] = OrderedDict()
        self._observations: deque[tuple[float, bool]] = deque(maxlen=window)
        self._new_observations = 0
        self._near_hits = 0
        self.approx_hits = 0
        self.calibration: Calibration | None = None

    def __repr__(self) -> str:
        return (
            f"ApproxCache(budget_bytes={self._store.budget_bytes}, threshold={self._threshold}, "
            f"target={self.target}, ttl_s={self._store.ttl_s}, dim={self.dim})"
        )

    @property
    def threshold(self) -> float | None:
        """The distance threshold in force (None: exact repeats only)."""
        return self._threshold

    def _scope(self, key: bytes, features: Mapping[str, np.ndarray]) -> bytes:
        layout = hashlib.blake2b(key_scope(key), digest_size=16)
        for name in sorted(features):
            array = features[name]
            layout.update(f"{name}\0{np.asarray(array).dtype.str}\0{np.shape(array)}\0".encode())
        return layout.digest()

    def _unindex(self, key: bytes) -> None:
        scope = self._scope_of.pop(key)
        index = self._indexes[scope]
        index.remove(key)
        if not index:
            del self._indexes[scope]

    def lookup(self, key: bytes, features: Mapping[str, np.ndarray]) -> CacheAnswer | None:
        """The answer for this key, else the nearest same-scope entry's within the threshold."""
        with self._lock:
            if self._store.is_live(key, self._store.clock()):
                return self._store.hit(key)
        scope = self._scope(key, features)
        sig = signature(features, self.dim)
        with self._lock:
            now = self._store.clock()
            index = self._indexes.get(scope)
            found = index.nearest(sig, now) if index is not None else None
            neighbour, dist = found if found is not None else (None, math.inf)
            if neighbour is not None and self._store.is_live(neighbour, now):
                if self._threshold is not None and dist <= self._threshold:
                    self._near_hits += 1
                    if self.target is None or self._near_hits % self.audit_every != 0:
                        self.approx_hits += 1
                        return self._store.hit(neighbour)
            else:
                neighbour = None
            self._pending[key] = _Pending(scope, sig, neighbour, dist)
            while len(self._pending) > self.PENDING_LIMIT:
                self._pending.popitem(last=False)
            self._store.misses += 1
            return None

    def store(self, key: bytes, features: Mapping[str, np.ndarray], answer: CacheAnswer) -> None:
        """Keep ``answer`` with the feature's signature; learn from it if a miss asked."""
        with self._lock:
            pending = self._pending.pop(key, None)
        if pending is None:
            pending = _Pending(self._scope(key, features), signature(features, self.dim), None, 0)
        with self._lock:
            neighbour = pending.neighbour
            now = self._store.clock()
            if self.target is not None and neighbour and self._store.is_live(neighbour, now):
                stored = self._store.peek(neighbour)
                self._observe(pending.distance, not self._agree(stored, answer))
            extra = pending.sig.nbytes + SIGNATURE_OVERHEAD
            if self._store.put(key, answer, extra_bytes=extra):
                index = self._indexes.get(pending.scope)
                if index is None:
                    index = self._indexes[pending.scope] = _ScopeIndex(self.dim)
                index.add(key, pending.sig, self._store.expires_at(key))
                self._scope_of[key] = pending.scope

    def _observe(self, dist: float, disagreed: bool) -> None:
        self._observations.append((dist, disagreed))
        self._new_observations += 1
        if len(self._observations) < self.min_samples or self._new_observations < 32:
            return
        self._new_observations = 0
        assert self.target is not None
        pairs = np.array(self._observations, dtype=np.float64)
        self.calibration = calibrate_threshold(
            pairs[:, 0], pairs[:, 1] > 0.5, self.target, confidence=self.confidence
        )
        if self.calibration.threshold != self._threshold:
            logger.info(
                "[cache] approximate threshold %s -> %s (disagreement %.4f on %d pairs)",
                self._threshold,
                self.calibration.threshold,
                self.calibration.disagreement,
                self.calibration.samples,
            )
        self._threshold = self.calibration.threshold

    def stats(self) -> CacheStats:
        with self._lock:
            return self._store.stats()

    def observations(self) -> Sequence[tuple[float, bool]]:
        """The (distance, disagreed) pairs measured online so far (newest last)."""
        with self._lock:
            return list(self._observations)
