"""The in-process exact cache: bit-for-bit hits, scoping by key, budget, LRU, TTL, counters."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierflow.cache.base import CacheAnswer, CacheStats, cache_key, key_scope
from tierflow.cache.memory import ARRAY_OVERHEAD, ENTRY_OVERHEAD, MemoryCache, entry_size
from tierflow.errors import CacheError


class FakeClock:
    """A clock tests move by hand, so TTLs expire without sleeping."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def features(seed: int, size: int = 32) -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(seed).standard_normal((1, size)).astype(np.float32)}


def answer(seed: int, size: int = 10) -> CacheAnswer:
    rng = np.random.default_rng(seed + 10_000)
    return CacheAnswer({"logits": rng.standard_normal((1, size)).astype(np.float32)}, exit=None)


def test_exact_hit_returns_the_stored_answer_bit_for_bit_and_read_only() -> None:
    cache = MemoryCache(1 << 20)
    feats = features(1)
    key = cache_key("sha", "plan", 1, feats)
    stored = CacheAnswer(
        {
            "logits": np.array([[0.1, np.nan, -0.0, 3e38]], dtype=np.float32),
            "ids": np.arange(4, dtype=np.int64),
        },
        exit="exit1",
    )
    original = {name: array.copy() for name, array in stored.outputs.items()}
    assert cache.lookup(key, feats) is None
    cache.store(key, feats, stored)
    stored.outputs["logits"][0, 0] = 42.0  # the caller's arrays are not the cache's
    hit = cache.lookup(key, feats)
    assert hit is not None and hit.exit == "exit1"
    assert hit.outputs.keys() == original.keys()
    for name, array in original.items():
        assert hit.outputs[name].dtype == array.dtype
        assert hit.outputs[name].tobytes() == array.tobytes()
        assert not hit.outputs[name].flags.writeable
        with pytest.raises(ValueError):
            hit.outputs[name][...] = 0
    hit.outputs.pop("ids")  # dropping from the returned dict does not touch the entry
    again = cache.lookup(key, feats)
    assert again is not None and set(again.outputs) == {"logits", "ids"}


def test_a_different_model_plan_or_segment_never_hits() -> None:
    cache = MemoryCache(1 << 20)
    feats = features(2)
    cache.store(cache_key("sha-a", "plan-1", 1, feats), feats, answer(2))
    for model, plan, segment in [
        ("sha-b", "plan-1", 1),
        ("sha-a", "plan-2", 1),
        ("sha-a", "plan-1", 2),
    ]:
        assert cache.lookup(cache_key(model, plan, segment, feats), feats) is None
    assert cache.lookup(cache_key("sha-a", "plan-1", 1, feats), feats) is not None
    # The same values under another dtype or shape are another feature.
    as_f64 = {"x": feats["x"].astype(np.float64)}
    reshaped = {"x": feats["x"].reshape(2, -1)}
    assert cache.lookup(cache_key("sha-a", "plan-1", 1, as_f64), as_f64) is None
    assert cache.lookup(cache_key("sha-a", "plan-1", 1, reshaped), reshaped) is None


def test_keys_carry_their_scope() -> None:
    a = cache_key("sha", "plan", 1, features(3))
    b = cache_key("sha", "plan", 1, features(4))
    c = cache_key("sha", "plan", 2, features(3))
    assert key_scope(a) == key_scope(b) != key_scope(c)
    assert a != b


def test_ttl_expires_entries_on_the_injected_clock() -> None:
    clock = FakeClock()
    cache = MemoryCache(1 << 20, ttl_s=10.0, clock=clock)
    feats = features(5)
    key = cache_key("sha", "plan", 0, feats)
    cache.store(key, feats, answer(5))
    clock.now += 9.99
    assert cache.lookup(key, feats) is not None
    clock.now += 0.01
    assert cache.lookup(key, feats) is None
    stats = cache.stats()
    assert (stats.hits, stats.misses, stats.expirations, stats.entries, stats.bytes) == (
        1,
        1,
        1,
        0,
        0,
    )


def test_lru_eviction_and_counters() -> None:
    one = entry_size(cache_key("m", "p", 0, features(0)), answer(0))
    assert one == 32 + 16 + len("logits") + 40 + ENTRY_OVERHEAD + ARRAY_OVERHEAD
    cache = MemoryCache(3 * one)
    keys = [cache_key("m", "p", 0, features(i)) for i in range(5)]
    for i in range(3):
        cache.store(keys[i], features(i), answer(i))
    assert cache.lookup(keys[0], features(0)) is not None  # 0 becomes most recent
    cache.store(keys[3], features(3), answer(3))  # evicts 1, the least recently used
    assert cache.lookup(keys[1], features(1)) is None
    cache.store(keys[4], features(4), answer(4))  # evicts 2
    assert cache.lookup(keys[2], features(2)) is None
    for i in (0, 3, 4):
        assert cache.lookup(keys[i], features(i)) is not None
    assert cache.stats() == CacheStats(
        hits=4, misses=2, stores=5, evictions=2, entries=3, bytes=3 * one, budget_bytes=3 * one
    )
    assert CacheStats.from_dict(cache.stats().to_dict()) == cache.stats()


def test_an_entry_larger_than_the_budget_is_not_stored() -> None:
    cache = MemoryCache(4096)
    small = features(1)
    cache.store(cache_key("m", "p", 0, small), small, answer(1))
    big = CacheAnswer({"logits": np.zeros(2048, dtype=np.float32)})
    cache.store(cache_key("m", "p", 0, features(9)), features(9), big)
    assert cache.lookup(cache_key("m", "p", 0, features(9)), features(9)) is None
    assert cache.stats().entries == 1  # and nothing was evicted to make room for it
    assert cache.stats().evictions == 0


def test_bad_settings_are_rejected() -> None:
    with pytest.raises(CacheError, match="budget"):
        MemoryCache(0)
    with pytest.raises(CacheError, match="ttl"):
        MemoryCache(1024, ttl_s=0.0)


@settings(max_examples=60, deadline=None)
@given(
    budget=st.integers(min_value=600, max_value=8000),
    ops=st.lists(
        st.tuples(st.booleans(), st.integers(0, 15), st.integers(0, 600), st.integers(0, 3)),
        max_size=60,
    ),
)
def test_a_cache_never_exceeds_its_budget(
    budget: int, ops: list[tuple[bool, int, int, int]]
) -> None:
    clock = FakeClock()
    cache = MemoryCache(budget, ttl_s=5.0, clock=clock)
    lookups = 0
    for is_store, which, size, tick in ops:
        clock.now += tick
        feats = features(which, 4)
        key = cache_key("m", "p", 0, feats)
        if is_store:
            cache.store(key, feats, CacheAnswer({"y": np.full(size, which, dtype=np.uint8)}))
        else:
            lookups += 1
            hit = cache.lookup(key, feats)
            assert (
                hit is None or int(hit.outputs["y"][0] if hit.outputs["y"].size else which) == which
            )
        stats = cache.stats()
        assert 0 <= stats.bytes <= budget
        assert stats.entries * (ENTRY_OVERHEAD + ARRAY_OVERHEAD) <= stats.bytes
    stats = cache.stats()
    assert stats.hits + stats.misses == lookups


def test_threads_share_one_cache_safely() -> None:
    cache = MemoryCache(40_000)
    errors: list[BaseException] = []

    def work(worker: int) -> None:
        try:
            for i in range(400):
                which = (i * 7 + worker) % 50
                feats = features(which, 8)
                key = cache_key("m", "p", 0, feats)
                hit = cache.lookup(key, feats)
                if hit is None:
                    cache.store(key, feats, CacheAnswer({"y": np.full(64, which, np.int32)}))
                else:
                    assert int(hit.outputs["y"][0]) == which
        except BaseException as exc:  # reported after join
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(w,)) for w in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    stats = cache.stats()
    assert stats.hits + stats.misses == 8 * 400
    assert stats.hits > 0 and stats.evictions > 0 and stats.bytes <= 40_000
