"""Exact feature cache in Redis, so several cloud replicas share what they computed.

Needs the ``redis`` client (``pip install tierflow[redis]``), imported only when a
:class:`RedisCache` is made. Answers are stored in a compact self-describing form
(:func:`encode_answer`: a JSON header of names, dtypes and shapes, then the raw array
bytes; never pickle), with the TTL as Redis expiry. See [Note: redis cache accounting].

[Note: redis cache accounting]
Redis' own ``maxmemory`` + ``allkeys-lru`` bounds the server, not this cache, and may
evict unrelated keys. The cache therefore keeps its own books in the same Redis, under
one namespace: a sorted set of entry names scored by a shared use counter (the LRU
order), a hash of entry sizes, and a byte counter. Storing and looking up run as Lua
scripts, so each is atomic across replicas: a store evicts least recently used entries
until its entry fits, and the counted bytes never exceed the budget. An entry that Redis
expired (TTL) stays counted until a lookup meets it or eviction reaches it, so the books
can only over-count, and the real bytes stay within the budget too. An entry counts its
blob, its name three times (entry key, sorted-set member, size field) and
:data:`REDIS_ENTRY_OVERHEAD` for Redis' per-key structures. All keys carry the namespace
as a hash tag, so they live on one node of a Redis Cluster.

A lookup that fails (Redis down, a timeout, a corrupt entry) never fails the request: it
counts an error, logs a warning, and is a miss. Only construction raises
:class:`~tierflow.errors.CacheError`, when Redis cannot be reached or the URL is bad.
"""

from __future__ import annotations

import json
import logging
import struct
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from tierflow.cloud.cache import CacheAnswer, CacheStats, answer_nbytes
from tierflow.cloud.cache_memory import check_budget
from tierflow.errors import CacheError

if TYPE_CHECKING:
    import redis

logger = logging.getLogger(__name__)

MAGIC = b"TFCA\x01"
"""First bytes of an encoded answer: format name and version."""

REDIS_ENTRY_OVERHEAD = 192
"""Bytes charged per entry for Redis' key, sorted-set and hash structures."""

_ALLOWED_KINDS = frozenset("biufc")

_STORE = """
local prefix, member, blob = ARGV[1], ARGV[2], ARGV[3]
local size, budget, ttl_ms = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local old = redis.call('HGET', KEYS[2], member)
if old then
  redis.call('HDEL', KEYS[2], member)
  redis.call('ZREM', KEYS[1], member)
  redis.call('DECRBY', KEYS[3], old)
  redis.call('DEL', prefix .. member)
end
if size > budget then return {0, 0, 0} end
local total = tonumber(redis.call('GET', KEYS[3]) or '0')
local evicted, expired = 0, 0
while total + size > budget do
  local oldest = redis.call('ZPOPMIN', KEYS[1])
  if #oldest == 0 then total = 0 break end
  local victim = oldest[1]
  total = total - tonumber(redis.call('HGET', KEYS[2], victim) or '0')
  redis.call('HDEL', KEYS[2], victim)
  if redis.call('DEL', prefix .. victim) == 1 then
    evicted = evicted + 1
  else
    expired = expired + 1
  end
end
redis.call('SET', KEYS[3], total + size)
redis.call('HSET', KEYS[2], member, size)
redis.call('ZADD', KEYS[1], redis.call('INCR', KEYS[4]), member)
if ttl_ms > 0 then
  redis.call('SET', prefix .. member, blob, 'PX', ttl_ms)
else
  redis.call('SET', prefix .. member, blob)
end
return {1, evicted, expired}
"""

_LOOKUP = """
local prefix, member = ARGV[1], ARGV[2]
local blob = redis.call('GET', prefix .. member)
if blob then
  redis.call('ZADD', KEYS[1], 'XX', redis.call('INCR', KEYS[4]), member)
  return blob
end
local old = redis.call('HGET', KEYS[2], member)
if old then
  redis.call('HDEL', KEYS[2], member)
  redis.call('ZREM', KEYS[1], member)
  redis.call('DECRBY', KEYS[3], old)
  return 1
end
return 0
"""


def encode_answer(answer: CacheAnswer) -> bytes:
    """The answer as ``MAGIC``, a length-prefixed JSON header, then each array's bytes."""
    arrays = [(name, np.asarray(array)) for name, array in answer.outputs.items()]
    for name, array in arrays:
        if array.dtype.kind not in _ALLOWED_KINDS:
            raise CacheError(
                f"cannot cache output {name!r}: expected a numeric array, found dtype {array.dtype}"
            )
    header = json.dumps(
        {
            "exit": answer.exit,
            "arrays": [[name, array.dtype.str, list(array.shape)] for name, array in arrays],
        },
        separators=(",", ":"),
    ).encode()
    parts = [MAGIC, struct.pack("<I", len(header)), header]
    parts.extend(array.tobytes(order="C") for _, array in arrays)
    return b"".join(parts)


def decode_answer(blob: bytes) -> CacheAnswer:
    """Read :func:`encode_answer`'s bytes back; the arrays are read-only views of ``blob``."""
    start = len(MAGIC) + 4
    if len(blob) < start or not blob.startswith(MAGIC):
        raise CacheError(f"cached answer: expected {MAGIC!r} and a header, found {blob[:8]!r}")
    (header_length,) = struct.unpack_from("<I", blob, len(MAGIC))
    try:
        header = json.loads(blob[start : start + header_length])
        exit_name = header["exit"]
        specs = [
            (str(name), np.dtype(dtype), tuple(int(d) for d in shape))
            for name, dtype, shape in header["arrays"]
        ]
    except (ValueError, TypeError, KeyError) as exc:
        raise CacheError(f"cached answer: malformed header ({exc})") from exc
    if exit_name is not None and not isinstance(exit_name, str):
        raise CacheError(f"cached answer: expected an exit name or null, found {exit_name!r}")
    offset = start + header_length
    outputs: dict[str, np.ndarray] = {}
    for name, dtype, shape in specs:
        if dtype.kind not in _ALLOWED_KINDS or any(d < 0 for d in shape):
            raise CacheError(f"cached answer: output {name!r} has dtype {dtype}, shape {shape}")
        count = int(np.prod(shape, dtype=np.int64))
        end = offset + count * dtype.itemsize
        if end > len(blob):
            raise CacheError(
                f"cached answer: output {name!r} needs {end - offset} bytes, "
                f"found {len(blob) - offset}"
            )
        outputs[name] = np.frombuffer(blob, dtype=dtype, count=count, offset=offset).reshape(shape)
        offset = end
    if offset != len(blob):
        raise CacheError(f"cached answer: {len(blob) - offset} bytes left after the last output")
    return CacheAnswer(outputs=outputs, exit=exit_name)


class RedisCache:
    """Exact feature cache shared through Redis by every replica using the same namespace.

    ``url`` is a redis-py URL (``redis://host:port/db``); ``budget_bytes`` bounds what this
    namespace holds, whichever replica stored it (see [Note: redis cache accounting]).
    ``timeout_s`` bounds each Redis call, so a stalled server costs a lookup at most that.
    """

    def __init__(
        self,
        url: str,
        budget_bytes: int,
        *,
        ttl_s: float | None = None,
        namespace: str = "tierflow",
        timeout_s: float = 0.5,
    ) -> None:
        check_budget(budget_bytes, ttl_s)
        try:
            import redis
        except ImportError as exc:
            raise CacheError(
                "the Redis cache needs the redis client: pip install 'tierflow[redis]'"
            ) from exc
        self._redis_error: tuple[type[BaseException], ...] = (redis.RedisError, OSError)
        self.url = url
        self.budget_bytes = budget_bytes
        self.ttl_s = ttl_s
        self.namespace = namespace
        tag = "{" + namespace + "}"
        self._prefix = f"{tag}:e:"
        self._keys = [f"{tag}:lru", f"{tag}:size", f"{tag}:bytes", f"{tag}:tick"]
        try:
            self._client: redis.Redis = redis.Redis.from_url(
                url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
            )
            self._client.ping()
        except (ValueError, *self._redis_error) as exc:
            raise CacheError(f"cannot use Redis at {url!r} as a feature cache: {exc}") from exc
        self._store_script = self._client.register_script(_STORE)
        self._lookup_script = self._client.register_script(_LOOKUP)
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(
            ("hits", "misses", "stores", "evictions", "expirations", "errors"), 0
        )
        self._last_books = (0, 0)
        self._failing = False

    def __repr__(self) -> str:
        return (
            f"RedisCache(url={self.url!r}, budget_bytes={self.budget_bytes}, "
            f"ttl_s={self.ttl_s}, namespace={self.namespace!r})"
        )

    def _count(self, **increments: int) -> None:
        with self._lock:
            for name, amount in increments.items():
                self._counts[name] += amount

    def _failed(self, action: str, exc: BaseException) -> None:
        with self._lock:
            self._counts["errors"] += 1
            errors = self._counts["errors"]
            first = not self._failing
            self._failing = True
        if first or errors % 100 == 0:
            logger.warning(
                "[cache] Redis %s failed at %s (%s); treating as a miss (%d errors so far)",
                action,
                self.url,
                exc,
                errors,
            )

    def _recovered(self) -> None:
        if self._failing:
            with self._lock:
                self._failing = False
            logger.warning("[cache] Redis at %s answers again", self.url)

    def lookup(self, key: bytes, features: Mapping[str, np.ndarray]) -> CacheAnswer | None:
        """The shared answer for exactly this key, or None (also when Redis fails)."""
        try:
            found = self._lookup_script(keys=self._keys, args=[self._prefix, key.hex()])
        except self._redis_error as exc:
            self._failed("lookup", exc)
            self._count(misses=1)
            return None
        self._recovered()
        if not isinstance(found, bytes):
            self._count(misses=1, expirations=1 if found == 1 else 0)
            return None
        try:
            answer = decode_answer(found)
        except CacheError as exc:
            self._failed("decode", exc)
            self._count(misses=1)
            return None
        self._count(hits=1)
        return answer

    def store(self, key: bytes, features: Mapping[str, np.ndarray], answer: CacheAnswer) -> None:
        """Share ``answer`` under ``key``, evicting LRU entries of the namespace to fit."""
        blob = encode_answer(answer)
        member = key.hex()
        size = len(blob) + 3 * len(member) + len(self._prefix) + REDIS_ENTRY_OVERHEAD
        ttl_ms = 0 if self.ttl_s is None else max(1, round(self.ttl_s * 1000))
        try:
            stored, evicted, expired = self._store_script(
                keys=self._keys,
                args=[self._prefix, member, blob, size, self.budget_bytes, ttl_ms],
            )
        except self._redis_error as exc:
            self._failed("store", exc)
            return
        self._recovered()
        self._count(stores=int(stored), evictions=int(evicted), expirations=int(expired))
        if not stored:
            logger.debug(
                "[cache] not storing an answer of %d bytes: the budget is %d bytes",
                answer_nbytes(answer),
                self.budget_bytes,
            )

    def stats(self) -> CacheStats:
        """This replica's counters, with the namespace's shared entries and bytes.

        If Redis cannot be asked, entries and bytes are the last figures read.
        """
        try:
            pipe = self._client.pipeline(transaction=True)
            pipe.zcard(self._keys[0])
            pipe.get(self._keys[2])
            entries, held = pipe.execute()
            self._last_books = (int(entries), int(held or 0))
        except self._redis_error as exc:
            self._failed("stats", exc)
        with self._lock:
            counts = dict(self._counts)
        entries, held = self._last_books
        return CacheStats(entries=entries, bytes=held, budget_bytes=self.budget_bytes, **counts)

    def clear(self) -> None:
        """Drop every entry and the books of this namespace (all replicas see it)."""
        try:
            names: list[Any] = list(self._client.scan_iter(match=self._prefix + "*", count=1000))
            names.extend(self._keys)
            self._client.delete(*names)
        except self._redis_error as exc:
            raise CacheError(f"cannot clear the Redis cache at {self.url!r}: {exc}") from exc

    def close(self) -> None:
        """Release the connection pool."""
        self._client.close()
