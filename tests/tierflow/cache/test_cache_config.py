"""The --cache spec: every documented form parses, builds the right cache, and errors say why."""

from __future__ import annotations

import argparse

import numpy as np
import pytest

from tierflow.cache.approx import ApproxCache
from tierflow.cache.base import CacheAnswer, cache_key
from tierflow.cache.config import (
    CacheSpec,
    build_cache,
    parse_cache_spec,
)
from tierflow.cache.memory import MemoryCache
from tierflow.cache.redis import RedisCache, build_server_cache
from tierflow.cli.arguments import argument_type
from tierflow.errors import CacheError, UsageError


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("off", CacheSpec()),
        ("exact:64MiB", CacheSpec(kind="exact", budget_bytes=64 << 20)),
        ("exact:64MiB,ttl=600s", CacheSpec(kind="exact", budget_bytes=64 << 20, ttl_s=600.0)),
        ("approx:32MiB", CacheSpec(kind="approx", budget_bytes=32 << 20, target=0.01)),
        (
            "approx:32MiB,target=2%,ttl=10s,dim=128",
            CacheSpec(kind="approx", budget_bytes=32 << 20, target=0.02, ttl_s=10.0, dim=128),
        ),
        (
            "approx:1MiB,threshold=0.08",
            CacheSpec(kind="approx", budget_bytes=1 << 20, threshold=0.08),
        ),
        (
            "redis://127.0.0.1:6379/0?budget=64MiB",
            CacheSpec(kind="redis", budget_bytes=64 << 20, url="redis://127.0.0.1:6379/0"),
        ),
        (
            "redis://:pw@host:6380/2?budget=1GiB&ttl=300s&namespace=cams&socket_keepalive=true",
            CacheSpec(
                kind="redis",
                budget_bytes=1 << 30,
                ttl_s=300.0,
                url="redis://:pw@host:6380/2?socket_keepalive=true",
                namespace="cams",
            ),
        ),
    ],
)
def test_documented_forms_parse(text: str, expected: CacheSpec) -> None:
    spec = parse_cache_spec(text)
    assert spec == expected
    assert CacheSpec.from_dict(spec.to_dict()) == spec
    assert spec.describe()


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("lru:64MiB", "malformed cache spec"),
        ("exact", "malformed cache spec"),
        ("exact:lots", "size"),
        ("exact:64MiB,ttl=5m", "duration"),
        ("exact:64MiB,target=1%", "option"),
        ("approx:1MiB,target=1%,threshold=0.1", "exactly one"),
        ("approx:1MiB,target=150%", "target"),
        ("approx:1MiB,threshold=-1", "threshold"),
        ("approx:1MiB,dim=x", "dim"),
        ("redis://127.0.0.1:6379/0", "budget"),
    ],
)
def test_bad_specs_say_what_was_expected(text: str, match: str) -> None:
    with pytest.raises(UsageError, match=match):
        parse_cache_spec(text)
    with pytest.raises(argparse.ArgumentTypeError, match=match):
        argument_type(parse_cache_spec)(text)  # as --cache reads it


def test_build_cache_makes_working_caches() -> None:
    assert build_cache(parse_cache_spec("off")) is None
    exact = build_cache(parse_cache_spec("exact:1MiB,ttl=1s"), clock=lambda: 0.0)
    approx = build_cache(parse_cache_spec("approx:1MiB,threshold=0.1"))
    assert isinstance(exact, MemoryCache) and isinstance(approx, ApproxCache)
    feats = {"x": np.ones((1, 4), np.float32)}
    key = cache_key("m", "p", 0, feats)
    for cache in (exact, approx):
        cache.store(key, feats, CacheAnswer({"y": np.zeros(3, np.float32)}))
        assert cache.lookup(key, feats) is not None
        assert cache.stats().budget_bytes == 1 << 20


@pytest.mark.integration
def test_build_cache_reaches_redis(redis_url: str) -> None:
    cache = build_server_cache(parse_cache_spec(f"{redis_url}?budget=1MiB&namespace=config-test"))
    assert isinstance(cache, RedisCache) and cache.stats().budget_bytes == 1 << 20
    cache.close()
    down = build_server_cache(parse_cache_spec("redis://127.0.0.1:1/0?budget=1MiB&timeout=50ms"))
    assert isinstance(down, RedisCache) and not down.available  # starts without Redis
    down.close()
    with pytest.raises(CacheError, match="hmac_key_file"):
        build_server_cache(parse_cache_spec(f"{redis_url}?budget=1MiB&hmac_key_file=/nonexistent"))
