"""The Redis cache against a real redis-server: sharing, budget, TTL, failures as misses."""

from __future__ import annotations

import logging
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierflow.cache.base import CacheAnswer, cache_key
from tierflow.cache.redis import RedisCache, decode_answer, encode_answer
from tierflow.errors import CacheError

redis = pytest.importorskip("redis")

pytestmark = pytest.mark.redis


def features(seed: int) -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(seed).standard_normal((1, 16)).astype(np.float32)}


def answer(seed: int, size: int = 10) -> CacheAnswer:
    rng = np.random.default_rng(seed + 1000)
    return CacheAnswer({"logits": rng.standard_normal((1, size)).astype(np.float32)})


@pytest.fixture
def namespace() -> str:
    return f"test-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def replicas(redis_url: str, namespace: str) -> Iterator[tuple[RedisCache, RedisCache]]:
    """Two caches, as two cloud replicas would make them, over one namespace."""
    first = RedisCache(redis_url, 1 << 20, namespace=namespace)
    second = RedisCache(redis_url, 1 << 20, namespace=namespace)
    yield first, second
    first.clear()
    first.close()
    second.close()


def test_answers_round_trip_bit_for_bit_without_pickle() -> None:
    stored = CacheAnswer(
        {
            "logits": np.array([[np.nan, -0.0, 1e-45, 3.4e38]], dtype=np.float32),
            "ids": np.arange(6, dtype=np.int64).reshape(2, 3),
            "flag": np.array(True),
            "half": np.ones((0, 3), dtype=np.float16),
        },
        exit="exit2",
    )
    blob = encode_answer(stored)
    assert b"pickle" not in blob and blob.startswith(b"TFCA")
    back = decode_answer(blob)
    assert back.exit == "exit2" and list(back.outputs) == list(stored.outputs)
    for name, array in stored.outputs.items():
        assert back.outputs[name].dtype == array.dtype and back.outputs[name].shape == array.shape
        assert back.outputs[name].tobytes() == array.tobytes()
        assert not back.outputs[name].flags.writeable
    for broken in (blob[:-1], b"TFCA\x02" + blob[5:], blob[:10] + b"\xff" + blob[11:], blob + b"x"):
        with pytest.raises(CacheError):
            decode_answer(broken)
    with pytest.raises(CacheError, match="numeric"):
        encode_answer(CacheAnswer({"o": np.array(["text"], dtype=object)}))


@pytest.mark.integration
def test_two_replicas_share_entries(replicas: tuple[RedisCache, RedisCache]) -> None:
    first, second = replicas
    feats = features(1)
    key = cache_key("sha", "plan", 1, feats)
    assert second.lookup(key, feats) is None
    first.store(key, feats, answer(1))
    hit = second.lookup(key, feats)
    assert hit is not None and hit.exit is None
    assert hit.outputs["logits"].tobytes() == answer(1).outputs["logits"].tobytes()
    for model, plan, segment in [("sha-b", "plan", 1), ("sha", "plan-2", 1), ("sha", "plan", 2)]:
        assert second.lookup(cache_key(model, plan, segment, feats), feats) is None
    assert (first.stats().stores, second.stats().hits, second.stats().misses) == (1, 1, 4)
    assert first.stats().entries == second.stats().entries == 1


@pytest.mark.integration
def test_namespaces_do_not_share(redis_url: str, replicas: tuple[RedisCache, RedisCache]) -> None:
    first, _ = replicas
    other = RedisCache(redis_url, 1 << 20, namespace=f"{first.namespace}-other")
    feats = features(2)
    key = cache_key("sha", "plan", 1, feats)
    first.store(key, feats, answer(2))
    assert other.lookup(key, feats) is None
    other.close()


def stored_bytes(client: Any, cache: RedisCache) -> int:
    """What the namespace's entries really hold in Redis, measured by the server."""
    prefix = "{" + cache.namespace + "}:e:"
    return sum(
        int(client.strlen(name)) + len(name) for name in client.scan_iter(match=prefix + "*")
    )


@pytest.mark.integration
def test_budget_holds_across_replicas_with_lru_eviction(redis_url: str, namespace: str) -> None:
    budget = 6000
    first = RedisCache(redis_url, budget, namespace=namespace)
    second = RedisCache(redis_url, budget, namespace=namespace)
    client = redis.Redis.from_url(redis_url)
    try:
        keys = [cache_key("m", "p", 0, features(i)) for i in range(40)]
        first.store(keys[0], features(0), answer(0))
        for i in range(1, 40):
            (first if i % 2 else second).store(keys[i], features(i), answer(i))
            assert second.lookup(keys[0], features(0)) is not None  # keep 0 most recent
            books = first.stats()
            assert books.bytes <= budget
            assert stored_bytes(client, first) <= books.bytes
        assert second.lookup(keys[1], features(1)) is None  # long since evicted
        assert first.stats().evictions + second.stats().evictions == 40 - first.stats().entries
        huge = CacheAnswer({"logits": np.zeros(4000, np.float32)})
        first.store(keys[1], features(1), huge)  # larger than the budget: not stored
        assert first.lookup(keys[1], features(1)) is None
        assert first.stats().bytes <= budget
    finally:
        first.clear()
        client.close()


@pytest.mark.integration
def test_concurrent_replicas_never_exceed_the_budget(redis_url: str, namespace: str) -> None:
    budget = 20_000
    caches = [RedisCache(redis_url, budget, namespace=namespace) for _ in range(4)]
    errors: list[BaseException] = []

    def work(cache: RedisCache, worker: int) -> None:
        try:
            for i in range(60):
                which = (i * 5 + worker) % 90
                key = cache_key("m", "p", 0, features(which))
                if cache.lookup(key, features(which)) is None:
                    cache.store(key, features(which), answer(which, size=8 + which))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(c, w)) for w, c in enumerate(caches)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    stats = caches[0].stats()
    assert 0 < stats.bytes <= budget and stats.entries > 0
    assert sum(c.stats().errors for c in caches) == 0
    caches[0].clear()


@pytest.mark.integration
def test_ttl_is_redis_expiry(redis_url: str, namespace: str) -> None:
    cache = RedisCache(redis_url, 1 << 20, ttl_s=0.15, namespace=namespace)
    feats = features(3)
    key = cache_key("m", "p", 0, feats)
    cache.store(key, feats, answer(3))
    assert cache.lookup(key, feats) is not None
    deadline = time.monotonic() + 3
    while cache.lookup(key, feats) is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    stats = cache.stats()
    assert stats.expirations == 1 and stats.entries == 0 and stats.bytes == 0
    cache.clear()


@pytest.mark.integration
def test_a_cloud_starts_without_redis_and_uses_it_once_it_answers(
    redis_servers: Any, namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with caplog.at_level(logging.WARNING, logger="tierflow.cache.redis"):
        cache = RedisCache(
            f"redis://127.0.0.1:{port}/0", 1 << 20, namespace=namespace, cooldown_s=0.2
        )
    assert not cache.available
    assert [r for r in caplog.records if "does not answer" in r.getMessage()]
    feats = features(6)
    key = cache_key("m", "p", 0, feats)
    started = time.monotonic()
    for _ in range(100):
        assert cache.lookup(key, feats) is None
    assert time.monotonic() - started < 0.5  # skipped, not 100 connection attempts
    redis_servers(port=port)
    time.sleep(0.25)
    cache.store(key, feats, answer(6))  # the first call after the cool-down reconnects
    assert cache.available
    assert cache.lookup(key, feats) is not None
    cache.clear()
    cache.close()
    with pytest.raises(CacheError):
        RedisCache("http://not-redis", 1 << 20)


@pytest.mark.integration
def test_a_stalled_redis_is_a_miss_not_a_failure(
    redis_url: str, namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    cache = RedisCache(redis_url, 1 << 20, namespace=namespace, timeout_s=0.1, cooldown_s=0.2)
    admin = redis.Redis.from_url(redis_url)
    feats = features(4)
    key = cache_key("m", "p", 0, feats)
    cache.store(key, feats, answer(4))
    try:
        admin.execute_command("CLIENT", "PAUSE", 600, "ALL")
        with caplog.at_level(logging.WARNING, logger="tierflow.cache.redis"):
            assert cache.lookup(key, feats) is None
            cache.store(cache_key("m", "p", 0, features(5)), features(5), answer(5))
    finally:
        admin.execute_command("CLIENT", "UNPAUSE")
    assert cache.stats().errors == 1 and cache.stats().misses == 1  # then the breaker skips
    assert any("treating as a miss" in record.getMessage() for record in caplog.records)
    time.sleep(0.25)
    assert cache.lookup(key, feats) is not None  # served again once Redis answers
    cache.clear()
    admin.close()


@pytest.mark.integration
def test_a_stopped_redis_costs_one_timeout_per_cool_down(redis_servers: Any) -> None:
    """SIGSTOP the server: lookups stay fast (the breaker), and resume after SIGCONT."""
    process, url = redis_servers()
    cache = RedisCache(url, 1 << 20, timeout_s=0.1, cooldown_s=0.5)
    feats = features(7)
    key = cache_key("m", "p", 0, feats)
    cache.store(key, feats, answer(7))
    process.send_signal(signal.SIGSTOP)
    try:
        latencies = []
        ended = time.monotonic() + 1.2  # a little over two cool-downs
        while time.monotonic() < ended:
            started = time.perf_counter()
            assert cache.lookup(key, feats) is None
            latencies.append(time.perf_counter() - started)
            time.sleep(0.002)
    finally:
        process.send_signal(signal.SIGCONT)
    slow = [t for t in latencies if t > 0.05]
    assert len(latencies) > 100
    assert 1 <= len(slow) <= 4  # one timeout at first and one per cool-down after
    assert max(latencies) < 0.3 and sorted(latencies)[len(latencies) // 2] < 0.005
    time.sleep(0.6)
    assert cache.lookup(key, feats) is not None
    cache.clear()
    cache.close()


@pytest.mark.integration
def test_entries_without_the_key_or_changed_are_rejected(redis_url: str, namespace: str) -> None:
    key_bytes = b"k" * 32
    signed = RedisCache(redis_url, 1 << 20, namespace=namespace, hmac_key=key_bytes)
    forger = RedisCache(redis_url, 1 << 20, namespace=namespace, hmac_key=b"x" * 32)
    plain = RedisCache(redis_url, 1 << 20, namespace=namespace)
    client = redis.Redis.from_url(redis_url)
    try:
        feats, other = features(8), features(9)
        key, other_key = cache_key("m", "p", 0, feats), cache_key("m", "p", 0, other)
        signed.store(key, feats, answer(8))
        assert signed.lookup(key, feats) is not None
        entry = "{" + namespace + "}:e:" + key.hex()
        blob = client.get(entry)
        assert blob is not None and blob.startswith(b"TFCS")
        # A writer with no key or another key, a flipped byte, an entry moved to another key.
        forger.store(key, feats, answer(10))
        assert signed.lookup(key, feats) is None
        plain.store(key, feats, answer(10))
        assert signed.lookup(key, feats) is None
        client.set(entry, blob[:-1] + bytes([blob[-1] ^ 1]))
        assert signed.lookup(key, feats) is None
        signed.store(other_key, other, answer(9))
        client.set(entry, client.get("{" + namespace + "}:e:" + other_key.hex()))
        assert signed.lookup(key, feats) is None
        assert signed.stats().rejected == 4
        client.set(entry, blob)
        hit = signed.lookup(key, feats)
        assert hit is not None
        assert hit.outputs["logits"].tobytes() == answer(8).outputs["logits"].tobytes()
    finally:
        signed.clear()
        for cache in (signed, forger, plain):
            cache.close()
        client.close()


@pytest.mark.integration
def test_password_and_tls_urls(redis_servers: Any, tls_files: dict[str, Any]) -> None:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        tls_port = probe.getsockname()[1]
    _, url = redis_servers(
        "--requirepass",
        "pa55word",
        "--tls-port",
        str(tls_port),
        "--tls-cert-file",
        str(tls_files["server_cert"]),
        "--tls-key-file",
        str(tls_files["server_key"]),
        "--tls-ca-cert-file",
        str(tls_files["ca"]),
        "--tls-auth-clients",
        "no",
    )
    port = url.rsplit(":", 1)[1].split("/")[0]
    feats = features(11)
    key = cache_key("m", "p", 0, feats)
    secure = f"rediss://:pa55word@127.0.0.1:{tls_port}/0?ssl_ca_certs={tls_files['ca']}"
    cache = RedisCache(secure, 1 << 20)
    assert "pa55word" not in repr(cache)
    cache.store(key, feats, answer(11))
    assert cache.lookup(key, feats) is not None
    cache.clear()
    cache.close()
    wrong = RedisCache(f"redis://:wrong@127.0.0.1:{port}/0", 1 << 20)
    assert not wrong.available and wrong.lookup(key, feats) is None
    wrong.close()


@pytest.mark.integration
@settings(max_examples=15, deadline=None)
@given(
    budget=st.integers(1000, 6000),
    ops=st.lists(st.tuples(st.booleans(), st.integers(0, 12), st.integers(0, 1500)), max_size=30),
)
def test_redis_books_never_exceed_the_budget(
    redis_url: str, budget: int, ops: list[tuple[bool, int, int]]
) -> None:
    namespace = f"prop-{uuid.uuid4().hex[:12]}"
    replicas = [RedisCache(redis_url, budget, namespace=namespace) for _ in range(2)]
    client = redis.Redis.from_url(redis_url)
    try:
        for step, (is_store, which, size) in enumerate(ops):
            cache = replicas[step % 2]
            feats = features(which)
            key = cache_key("m", "p", 0, feats)
            if is_store:
                cache.store(key, feats, CacheAnswer({"y": np.full(size, which, np.uint8)}))
            else:
                hit = cache.lookup(key, feats)
                assert (
                    hit is None or hit.outputs["y"].size == 0 or int(hit.outputs["y"][0]) == which
                )
            books = cache.stats()
            assert books.bytes <= budget
            assert stored_bytes(client, cache) <= books.bytes
    finally:
        replicas[0].clear()
        client.close()
        for cache in replicas:
            cache.close()
