"""The ``--cache`` setting: parse a cache spec from the command line and build the cache.

Spec forms (sizes, durations and rates as :mod:`tierflow.units` reads them)::

    off                                   no cache (the default)
    exact:64MiB[,ttl=600s]                in-process exact cache
    approx:32MiB[,target=1%][,ttl=10s][,dim=256]
                                          in-process approximate cache that calibrates
                                          its distance threshold online for the target
                                          disagreement rate (default 1%)
    approx:32MiB,threshold=0.08[,ttl=10s] approximate cache with a fixed threshold
                                          (from an offline calibrate_threshold run)
    redis://[:PASSWORD@]HOST:PORT/DB?budget=64MiB[&ttl=600s][&namespace=NAME]
          [&hmac_key_file=FILE][&timeout=100ms][&cooldown=5s]
                                          exact cache shared by replicas through Redis
                                          (also rediss:// for TLS and unix://; other
                                          query parameters go to the redis client);
                                          entries authenticated with the key in FILE,
                                          see tierflow.cache.redis

A tier parses the option's text with :func:`parse_cache_spec` (the command line's
``--cache`` does, in ``tierflow.cli``) and builds the cache once at
start-up: the device (``run --cache``) with :func:`build_cache`, which makes the
in-process caches; the servers with ``tierflow.cache.redis.build_server_cache``,
which adds Redis (and is where an unreachable Redis is reported).
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from tierflow.cache.approx import DEFAULT_DIM, ApproxCache
from tierflow.cache.base import FeatureCache
from tierflow.cache.memory import Clock, MemoryCache
from tierflow.errors import UsageError, shown
from tierflow.units import format_duration, format_size, parse_duration, parse_size

KINDS = ("off", "exact", "approx", "redis")

DEFAULT_TARGET = 0.01
"""Disagreement rate an approximate cache aims for when the spec names none."""

CACHE_HELP = (
    "feature cache: off | exact:SIZE[,ttl=DUR] | approx:SIZE[,target=RATE|threshold=D]"
    "[,ttl=DUR][,dim=N] | redis://HOST:PORT/DB?budget=SIZE[&ttl=DUR][&namespace=NAME]"
    "[&hmac_key_file=FILE][&timeout=DUR][&cooldown=DUR]"
)


@dataclass(frozen=True)
class CacheSpec:
    """A parsed cache setting; ``url`` (redis only) has tierflow's own parameters removed."""

    kind: str = "off"
    budget_bytes: int = 0
    ttl_s: float | None = None
    threshold: float | None = None
    target: float | None = None
    dim: int = DEFAULT_DIM
    url: str | None = None
    namespace: str = "tierflow"
    hmac_key_file: str | None = None
    timeout_s: float = 0.1
    cooldown_s: float = 5.0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise UsageError(
                f"cache kind: expected one of {', '.join(KINDS)}, found {shown(self.kind)}"
            )
        if self.kind != "off" and self.budget_bytes <= 0:
            raise UsageError(
                f"{self.kind} cache: expected a positive budget, found {self.budget_bytes}"
            )
        if self.ttl_s is not None and not self.ttl_s > 0:
            raise UsageError(f"cache ttl: expected a positive duration, found {self.ttl_s}")
        if self.kind == "approx" and (self.threshold is None) == (self.target is None):
            raise UsageError("approx cache: expected exactly one of target= or threshold=")
        if self.threshold is not None and not (
            math.isfinite(self.threshold) and self.threshold >= 0
        ):
            raise UsageError(f"approx cache threshold: expected >= 0, found {self.threshold}")
        if self.target is not None and not 0 <= self.target < 1:
            raise UsageError(f"approx cache target: expected a rate in [0, 1), found {self.target}")
        if self.dim < 1:
            raise UsageError(f"approx cache dim: expected >= 1, found {self.dim}")
        if self.kind == "redis" and not self.url:
            raise UsageError("redis cache: expected a redis:// URL")
        if not 0 < self.timeout_s <= 60:
            raise UsageError(f"redis cache timeout: expected (0, 60] s, found {self.timeout_s}")
        if not 0 <= self.cooldown_s <= 3600:
            raise UsageError(f"redis cache cooldown: expected [0, 3600] s, found {self.cooldown_s}")

    def describe(self) -> str:
        """One line for logs and tables, in the spec's own syntax where it can."""
        if self.kind == "off":
            return "off"
        ttl = "" if self.ttl_s is None else f",ttl={format_duration(self.ttl_s)}"
        if self.kind == "redis":
            signed = " signed" if self.hmac_key_file else ""
            budget = format_size(self.budget_bytes)
            return f"redis {redact(self.url or '')} budget={budget}{ttl}{signed}"
        if self.kind == "exact":
            return f"exact:{format_size(self.budget_bytes)}{ttl}"
        rule = (
            f"target={self.target:g}"
            if self.target is not None
            else f"threshold={self.threshold:g}"
        )
        return f"approx:{format_size(self.budget_bytes)},{rule}{ttl},dim={self.dim}"

    def to_dict(self) -> dict[str, object]:
        return {
            "kind": self.kind,
            "budget_bytes": self.budget_bytes,
            "ttl_s": self.ttl_s,
            "threshold": self.threshold,
            "target": self.target,
            "dim": self.dim,
            "url": self.url,
            "namespace": self.namespace,
            "hmac_key_file": self.hmac_key_file,
            "timeout_s": self.timeout_s,
            "cooldown_s": self.cooldown_s,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> CacheSpec:
        unknown = set(data) - set(cls.__dataclass_fields__)
        if unknown:
            raise UsageError(f"cache spec: unknown fields {sorted(unknown)}")
        try:
            return cls(**data)  # type: ignore[arg-type]
        except TypeError as exc:
            raise UsageError(f"malformed cache spec {shown(dict(data))}: {exc}") from exc


def _parse_rate(text: str) -> float:
    """A rate as a fraction: ``1%`` or ``0.01``."""
    try:
        return float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError as exc:
        raise UsageError(
            f"malformed rate {shown(text)}: expected a fraction like 0.01 or 1%"
        ) from exc


def _parse_float(text: str, what: str) -> float:
    try:
        return float(text)
    except ValueError as exc:
        raise UsageError(f"malformed {what} {shown(text)}: expected a number") from exc


def _parse_redis(text: str) -> CacheSpec:
    parts = urlsplit(text)
    ours: dict[str, str] = {}
    rest: list[tuple[str, str]] = []
    for name, value in parse_qsl(parts.query, keep_blank_values=True):
        if name in ("budget", "ttl", "namespace", "hmac_key_file", "timeout", "cooldown"):
            ours[name] = value
        else:
            rest.append((name, value))
    if "budget" not in ours:
        raise UsageError(
            f"redis cache {shown(text)}: expected a budget, like redis://127.0.0.1:6379/0?budget=64MiB"
        )
    url = urlunsplit((parts.scheme, parts.netloc, parts.path, urlencode(rest), parts.fragment))
    return CacheSpec(
        kind="redis",
        budget_bytes=parse_size(ours["budget"]),
        ttl_s=parse_duration(ours["ttl"]) if "ttl" in ours else None,
        url=url,
        namespace=ours.get("namespace") or "tierflow",
        hmac_key_file=ours.get("hmac_key_file") or None,
        timeout_s=parse_duration(ours["timeout"]) if "timeout" in ours else 0.1,
        cooldown_s=parse_duration(ours["cooldown"]) if "cooldown" in ours else 5.0,
    )


def parse_cache_spec(text: str) -> CacheSpec:
    """Read a ``--cache`` value (forms in this module's docstring); raises UsageError."""
    text = text.strip()
    if text.lower() in ("", "off", "none"):
        return CacheSpec()
    if text.split(":", 1)[0].lower() in ("redis", "rediss", "unix"):
        return _parse_redis(text)
    kind, _, rest = text.partition(":")
    kind = kind.lower()
    if kind not in ("exact", "approx") or not rest:
        raise UsageError(f"malformed cache spec {shown(text)}: expected {CACHE_HELP}")
    size, *options = rest.split(",")
    values: dict[str, str] = {}
    for option in options:
        name, sep, value = option.partition("=")
        name = name.strip().lower()
        allowed = ("ttl",) if kind == "exact" else ("ttl", "target", "threshold", "dim")
        if not sep or name not in allowed:
            raise UsageError(
                f"{kind} cache option {shown(option)}: expected NAME=VALUE with NAME one of "
                f"{', '.join(allowed)}"
            )
        values[name] = value.strip()
    ttl = parse_duration(values["ttl"]) if "ttl" in values else None
    if kind == "exact":
        return CacheSpec(kind="exact", budget_bytes=parse_size(size), ttl_s=ttl)
    threshold = _parse_float(values["threshold"], "threshold") if "threshold" in values else None
    target = _parse_rate(values["target"]) if "target" in values else None
    if threshold is None and target is None:
        target = DEFAULT_TARGET
    dim = values.get("dim", str(DEFAULT_DIM))
    if not dim.isdigit():
        raise UsageError(f"approx cache dim {shown(dim)}: expected a whole number")
    return CacheSpec(
        kind="approx",
        budget_bytes=parse_size(size),
        ttl_s=ttl,
        threshold=threshold,
        target=target,
        dim=int(dim),
    )


def build_cache(spec: CacheSpec, *, clock: Clock | None = None) -> FeatureCache | None:
    """The in-process cache a spec describes (None for ``off``); Redis is the servers'.

    ``clock`` (default :func:`time.monotonic`) decides when entries expire in the
    in-memory caches.
    """
    if spec.kind == "off":
        return None
    if spec.kind == "exact":
        return MemoryCache(spec.budget_bytes, ttl_s=spec.ttl_s, clock=clock or time.monotonic)
    if spec.kind == "approx":
        return ApproxCache(
            spec.budget_bytes,
            threshold=spec.threshold,
            target=spec.target,
            ttl_s=spec.ttl_s,
            dim=spec.dim,
            clock=clock or time.monotonic,
        )
    raise UsageError(
        "a Redis cache is shared by servers (tierflow.cache.redis.build_server_cache); "
        f"here the cache is exact: or approx:, found {redact(spec.url or '')!r}"
    )


def redact(url: str) -> str:
    """``url`` with its password (if any) replaced by ``***``, for logs and messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    netloc = f"{user}:***@{host}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))
