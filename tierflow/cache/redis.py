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
counts an error, logs a warning, and is a miss. See [Note: redis circuit breaker] for why
a stalled Redis cannot slow the cloud down, and [Note: redis entry authentication] for
why a writer without the key cannot change answers. Only a malformed URL raises
:class:`~tierflow.errors.CacheError` at construction; an unreachable Redis does not.

[Note: redis circuit breaker]
Every Redis call has a short timeout (``timeout_s``, 0.1 s by default). After a call
fails, the cache skips Redis (every lookup a miss, every store dropped, at no cost) for
``cooldown_s``; then one call tries again, and its success closes the breaker. A cloud
whose Redis stalls so pays one timeout per cool-down, not one per request, and a cloud
started while Redis is down serves without the cache (one log line) and starts using
it once Redis answers.

[Note: redis entry authentication]
With a key (``hmac_key_file=`` in the URL: a file of at least 16 bytes, the same on
every replica) each stored blob is prefixed with HMAC-SHA256 over the namespace, the
entry's name and the blob. A lookup checks it in constant time; an entry written
without the key, changed, or copied under another name is a miss, counted in
``rejected``. Without a key, entries are trusted as they are (a warning says so once).

URLs: ``redis://[:PASSWORD@]HOST:PORT/DB``, ``rediss://`` for TLS (``ssl_ca_certs=``,
``ssl_certfile=``, ``ssl_keyfile=`` and other redis-py parameters pass through the query)
and ``unix://PATH``. Passwords never appear in logs.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import struct
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from tierflow.cache.base import CacheAnswer, CacheStats, FeatureCache, answer_nbytes
from tierflow.cache.config import CacheSpec, build_cache, redact
from tierflow.cache.memory import Clock, check_budget
from tierflow.errors import CacheError

if TYPE_CHECKING:
    import redis

logger = logging.getLogger(__name__)

MAGIC = b"TFCA\x01"
"""First bytes of an encoded answer: format name and version."""

REDIS_ENTRY_OVERHEAD = 192
"""Bytes charged per entry for Redis' key, sorted-set and hash structures."""

SIGNED = b"TFCS\x01"
"""First bytes of an authenticated entry: then the HMAC-SHA256 tag, then the answer."""

MIN_KEY_BYTES = 16
DEFAULT_TIMEOUT_S = 0.1
DEFAULT_COOLDOWN_S = 5.0

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


class CircuitBreaker:
    """Skip a failing backend for a cool-down, then let one call try ([Note: redis circuit
    breaker]). Thread-safe; ``clock`` is ``time.monotonic`` unless a test gives another."""

    def __init__(self, cooldown_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.cooldown_s = cooldown_s
        self._clock = clock
        self._lock = threading.Lock()
        self._open_until: float | None = None  # None: closed, calls go through

    @property
    def open(self) -> bool:
        return self._open_until is not None

    def allow(self) -> bool:
        """Whether a call may go to the backend now (one at a time once the cool-down ends)."""
        with self._lock:
            if self._open_until is None:
                return True
            now = self._clock()
            if now < self._open_until:
                return False
            self._open_until = now + self.cooldown_s  # this caller tries; the rest wait
            return True

    def failed(self) -> bool:
        """Open (again) for a cool-down; True when it was closed until now."""
        with self._lock:
            was_closed = self._open_until is None
            self._open_until = self._clock() + self.cooldown_s
            return was_closed

    def succeeded(self) -> bool:
        """Close; True when it was open until now."""
        with self._lock:
            was_open = self._open_until is not None
            self._open_until = None
            return was_open


class RedisCache:
    """Exact feature cache shared through Redis by every replica using the same namespace.

    ``url`` is a redis-py URL (``redis://host:port/db``, see the module docstring);
    ``budget_bytes`` bounds what this namespace holds, whichever replica stored it (see
    [Note: redis cache accounting]). ``timeout_s`` bounds each Redis call and
    ``cooldown_s`` is how long a failure makes the cache skip Redis ([Note: redis circuit
    breaker]); ``hmac_key`` authenticates entries ([Note: redis entry authentication]).
    """

    def __init__(
        self,
        url: str,
        budget_bytes: int,
        *,
        ttl_s: float | None = None,
        namespace: str = "tierflow",
        timeout_s: float = DEFAULT_TIMEOUT_S,
        cooldown_s: float = DEFAULT_COOLDOWN_S,
        hmac_key: bytes | None = None,
    ) -> None:
        check_budget(budget_bytes, ttl_s)
        if not (0 < timeout_s <= 60 and 0 <= cooldown_s <= 3600):
            raise CacheError(
                f"Redis timeout must be in (0, 60] s and cool-down in [0, 3600] s, found "
                f"{timeout_s} and {cooldown_s}"
            )
        if hmac_key is not None and len(hmac_key) < MIN_KEY_BYTES:
            raise CacheError(
                f"the Redis cache's HMAC key must have at least {MIN_KEY_BYTES} bytes, "
                f"found {len(hmac_key)}"
            )
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
        self._hmac_key = hmac_key
        self._breaker = CircuitBreaker(cooldown_s)
        try:
            # Connecting may take a TLS handshake over a long link: it gets a second.
            self._client: redis.Redis = redis.Redis.from_url(
                url, socket_timeout=timeout_s, socket_connect_timeout=max(timeout_s, 1.0)
            )
        except (ValueError, TypeError) as exc:
            raise CacheError(f"cannot use {redact(url)!r} as a Redis URL: {exc}") from exc
        self._store_script = self._client.register_script(_STORE)
        self._lookup_script = self._client.register_script(_LOOKUP)
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(
            ("hits", "misses", "stores", "evictions", "expirations", "errors", "rejected"), 0
        )
        self._last_books = (0, 0)
        self._warned_rejected = False
        if hmac_key is None:
            logger.warning(
                "[cache] Redis entries at %s are not authenticated: anyone who can write to "
                "this Redis can change answers (add hmac_key_file=FILE to the URL)",
                redact(url),
            )
        try:
            self._client.ping()
        except self._redis_error as exc:
            self._breaker.failed()
            logger.warning(
                "[cache] Redis at %s does not answer (%s); serving without it, retrying "
                "every %.3g s",
                redact(url),
                exc,
                cooldown_s,
            )

    def __repr__(self) -> str:
        return (
            f"RedisCache(url={redact(self.url)!r}, budget_bytes={self.budget_bytes}, "
            f"ttl_s={self.ttl_s}, namespace={self.namespace!r})"
        )

    @property
    def available(self) -> bool:
        """False while the breaker skips Redis ([Note: redis circuit breaker])."""
        return not self._breaker.open

    def _seal(self, member: str, blob: bytes) -> bytes:
        if self._hmac_key is None:
            return blob
        return SIGNED + self._tag(member, blob) + blob

    def _tag(self, member: str, blob: bytes) -> bytes:
        assert self._hmac_key is not None
        mac = hmac.new(self._hmac_key, digestmod=hashlib.sha256)
        for part in (self.namespace.encode(), b"\0", member.encode(), b"\0", blob):
            mac.update(part)
        return mac.digest()

    def _unseal(self, member: str, found: bytes) -> bytes | None:
        """The answer's bytes, or None when authentication fails (counted, warned once)."""
        if self._hmac_key is None:
            return found[len(SIGNED) + 32 :] if found.startswith(SIGNED) else found
        start = len(SIGNED) + 32
        if found.startswith(SIGNED) and len(found) >= start:
            blob = found[start:]
            if hmac.compare_digest(found[len(SIGNED) : start], self._tag(member, blob)):
                return blob
        self._count(rejected=1, misses=1)
        if not self._warned_rejected:
            self._warned_rejected = True
            logger.warning(
                "[cache] a Redis entry at %s failed authentication (written without the "
                "key, or changed): treated as a miss; counted in 'rejected' from now on",
                redact(self.url),
            )
        return None

    def _count(self, **increments: int) -> None:
        with self._lock:
            for name, amount in increments.items():
                self._counts[name] += amount

    def _failed(self, action: str, exc: BaseException) -> None:
        first = self._breaker.failed()
        with self._lock:
            self._counts["errors"] += 1
            errors = self._counts["errors"]
        if first or errors % 100 == 0:
            logger.warning(
                "[cache] Redis %s failed at %s (%s); treating as a miss and skipping Redis "
                "for %.3g s (%d errors so far)",
                action,
                redact(self.url),
                exc,
                self._breaker.cooldown_s,
                errors,
            )

    def _recovered(self) -> None:
        if self._breaker.succeeded():
            logger.warning("[cache] Redis at %s answers again", redact(self.url))

    def lookup(self, key: bytes, features: Mapping[str, np.ndarray]) -> CacheAnswer | None:
        """The shared answer for exactly this key, or None (also when Redis fails)."""
        if not self._breaker.allow():
            self._count(misses=1)
            return None
        member = key.hex()
        try:
            found = self._lookup_script(keys=self._keys, args=[self._prefix, member])
        except self._redis_error as exc:
            self._failed("lookup", exc)
            self._count(misses=1)
            return None
        self._recovered()
        if not isinstance(found, bytes):
            self._count(misses=1, expirations=1 if found == 1 else 0)
            return None
        blob = self._unseal(member, found)
        if blob is None:
            return None
        try:
            answer = decode_answer(blob)
        except CacheError as exc:
            self._failed("decode", exc)
            self._count(misses=1)
            return None
        self._count(hits=1)
        return answer

    def store(self, key: bytes, features: Mapping[str, np.ndarray], answer: CacheAnswer) -> None:
        """Share ``answer`` under ``key``, evicting LRU entries of the namespace to fit."""
        if not self._breaker.allow():
            return
        member = key.hex()
        blob = self._seal(member, encode_answer(answer))
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
        if self._breaker.allow():
            try:
                pipe = self._client.pipeline(transaction=True)
                pipe.zcard(self._keys[0])
                pipe.get(self._keys[2])
                entries, held = pipe.execute()
                self._last_books = (int(entries), int(held or 0))
                self._recovered()
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
            raise CacheError(f"cannot clear the Redis cache at {redact(self.url)}: {exc}") from exc

    def close(self) -> None:
        """Release the connection pool."""
        self._client.close()


def build_server_cache(spec: CacheSpec, *, clock: Clock | None = None) -> FeatureCache | None:
    """The cache a server's ``--cache`` describes: Redis, or an in-process one.

    An unreachable Redis is not an error: the cache starts without it and uses it once
    it answers (see [Note: redis circuit breaker]). ``clock`` is for the in-process
    caches (:func:`tierflow.cache.config.build_cache`).
    """
    if spec.kind != "redis":
        return build_cache(spec, clock=clock)
    assert spec.url is not None
    if clock is not None:
        raise CacheError("the Redis cache expires entries on Redis' clock; it takes no clock")
    return RedisCache(
        spec.url,
        spec.budget_bytes,
        ttl_s=spec.ttl_s,
        namespace=spec.namespace,
        timeout_s=spec.timeout_s,
        cooldown_s=spec.cooldown_s,
        hmac_key=read_hmac_key(spec.hmac_key_file) if spec.hmac_key_file else None,
    )


def read_hmac_key(path: str) -> bytes:
    """The key in ``path`` (its bytes, surrounding whitespace removed); at least 16 bytes."""
    try:
        with open(path, "rb") as file:
            key = file.read(64 * 1024 + 1).strip()
    except OSError as exc:
        raise CacheError(f"cannot read the Redis cache's hmac_key_file {path}: {exc}") from exc
    if not 16 <= len(key) <= 64 * 1024:
        raise CacheError(
            f"hmac_key_file {path}: expected 16 to 65536 bytes of key, found {len(key)}"
        )
    return key
