"""Prometheus metrics of a tier process (``--metrics-port``), with the standard client library.

Needs the ``metrics`` extra (``pip install 'tierflow[metrics]'``: prometheus_client),
imported only when a port is given; without it the option fails with one line naming the
extra. Every figure comes from what the tier already measures for its replies, so the
hot path gains one call per reply and nothing when metrics are off. Metric names (all
prefixed ``tierflow_``; labels in brackets):

- ``requests_total{tier, outcome, answered_by}``: replies sent, by outcome (``ok``,
  ``exit``, ``cache_hit``, ``fallback`` (answered without the next tier), or the error
  code: ``overloaded``, ``unavailable``, ``invalid_input``, ...) and by the tier that
  answered.
- ``request_seconds{tier}`` (histogram): from a request's arrival at this tier to its
  reply, the next tiers' time included.
- ``tier_seconds{tier, part}`` (histogram): each tier's own time per request, as the
  replies report it (``queue``, ``compute``, ``codec``): the edge's metrics show the
  cloud's compute too.
- ``link_bytes_total{link, direction}``: encoded bytes this process sent on a link
  (``request`` up to the next tier, ``reply`` down); ``link_rate_bps{link}``: the rate
  last measured on a transfer up.
- ``in_flight{tier}``: requests at this tier not yet answered (its queue depth).
- ``exits_total{tier, exit}``, ``cache_hits_total{tier, answered_by}``.
- ``peer_warnings_total{tier, kind}``: warnings about what peers sent, each counted though
  few are logged ([Note: warnings about a peer] in tierflow/transport/peer_warnings.py):
  ``reply_figures`` (a reply's figures no tier could measure, dropped: [Note: figures in
  a reply]), ``undecodable`` (a message that does not parse), ``garbage_stream`` (a
  stream closed for sending nothing else: [Note: garbage on a stream]), ``slow_reader``
  (a stream cancelled for not reading its replies: [Note: slow readers]),
  ``reply_not_delivered`` (a reply its stream could no longer take).
- ``segment_bytes{tier}``: bytes of segment files the tier holds (bounded by
  ``--segment-budget``); ``segment_fetches{tier}``: segment files it fetched from the tier
  above so far ([Note: segments on demand] in ``tierflow.runtime.segment_store``).
- ``state_bytes{tier, identity}``, ``state_sessions{tier, identity}``: the session state
  each owner holds now (everything counted against ``--state-budget``), for the owners
  holding any; ``identity`` is the owner's name ([Note: who a caller is] in
  ``tierflow.transport.callers``), never a token. ``state_evictions_total{tier}``: sessions
  evicted or dropped idle so far ([Note: session state on a tier] in
  ``tierflow.state.store``).
- ``batch_calls_total{tier, size}``: the step batcher's ONNX Runtime calls by the steps each
  ran (``size`` 1: a step alone), every plan's together ([Note: the step batcher] in
  ``tierflow.runtime.batching``); ``batch_call_seconds_total{tier, size}``: the time they
  took.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tierflow.errors import TransportError
from tierflow.extras import import_extra
from tierflow.rpc import tier_pb2
from tierflow.transport.peer_warnings import WARNINGS

if TYPE_CHECKING:
    from collections.abc import Iterator

    from tierflow.runtime.batching import BatchStats
    from tierflow.runtime.segment_store import SegmentStore
    from tierflow.state.store import SessionStates

logger = logging.getLogger(__name__)

# Seconds: sub-millisecond hops on one machine up to slow links and big models.
_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class TierMetrics:
    """The metrics of one tier (``edge``, ``cloud`` or ``device``) in their own registry."""

    def __init__(
        self,
        tier: str,
        in_flight: Callable[[], float],
        segments: Callable[[], SegmentStore | None] | None = None,
        states: Callable[[], SessionStates | None] | None = None,
        batches: Callable[[], list[BatchStats]] | None = None,
    ) -> None:
        """``segments`` gives the tier's segment store, ``states`` its session state (each
        None until it has one), ``batches`` its step batchers' figures."""
        prom = import_extra("prometheus_client", "--metrics-port")
        self.tier = tier
        self.registry = prom.CollectorRegistry()
        reg = self.registry
        self._requests = prom.Counter(
            "tierflow_requests",
            "Replies sent, by outcome and by the tier that answered",
            ["tier", "outcome", "answered_by"],
            registry=reg,
        )
        self._latency = prom.Histogram(
            "tierflow_request_seconds",
            "Arrival at this tier to its reply (the next tiers' time included)",
            ["tier"],
            buckets=_BUCKETS,
            registry=reg,
        )
        self._tier_seconds = prom.Histogram(
            "tierflow_tier_seconds",
            "Each tier's own time per request, as reported in the replies",
            ["tier", "part"],
            buckets=_BUCKETS,
            registry=reg,
        )
        self._bytes = prom.Counter(
            "tierflow_link_bytes",
            "Encoded bytes this process sent on a link",
            ["link", "direction"],
            registry=reg,
        )
        self._rate = prom.Gauge(
            "tierflow_link_rate_bps",
            "Rate measured on the last transfer up a link, bits per second",
            ["link"],
            registry=reg,
        )
        self._exits = prom.Counter(
            "tierflow_exits", "Requests answered at an early exit", ["tier", "exit"], registry=reg
        )
        self._cache_hits = prom.Counter(
            "tierflow_cache_hits",
            "Requests answered from a feature cache",
            ["tier", "answered_by"],
            registry=reg,
        )
        depth = prom.Gauge(
            "tierflow_in_flight", "Requests at this tier not yet answered", ["tier"], registry=reg
        )
        depth.labels(tier).set_function(in_flight)
        if segments is not None:
            held = prom.Gauge(
                "tierflow_segment_bytes",
                "Bytes of segment files this tier holds",
                ["tier"],
                registry=reg,
            )
            held.labels(tier).set_function(lambda: _store_figure(segments(), "used_bytes"))
            fetches = prom.Gauge(
                "tierflow_segment_fetches",
                "Segment files this tier fetched from the tier above",
                ["tier"],
                registry=reg,
            )
            fetches.labels(tier).set_function(lambda: _store_figure(segments(), "fetches"))
        core = import_extra("prometheus_client.core", "--metrics-port")
        reg.register(_PeerWarningsCollector(tier, core.CounterMetricFamily))
        if states is not None:
            reg.register(_StateCollector(tier, states))
        if batches is not None:
            reg.register(_BatchCollector(tier, batches))
        self._server: Any = None

    # ------------------------------------------------------------------ observing

    def observe(self, reply: tier_pb2.Reply, down_link: str | None, nbytes: int) -> None:
        """Count one reply this tier sends (``nbytes`` on ``down_link``)."""
        answered_by = reply.answered_by or self.tier
        if reply.HasField("error"):
            outcome = tier_pb2.ErrorCode.Name(reply.error.code).lower()
        elif reply.cache_hit:
            outcome = "cache_hit"
            self._cache_hits.labels(self.tier, answered_by).inc()
        elif reply.fallback:  # answered without the next tier: not the model's usual answer
            outcome = "fallback"
        elif reply.exit:
            outcome = "exit"
            self._exits.labels(answered_by, reply.exit).inc()
        else:
            outcome = "ok"
        self._requests.labels(self.tier, outcome, answered_by).inc()
        for timing in reply.timings:
            for part in ("queue", "compute", "codec"):
                value = getattr(timing, f"{part}_ms")
                self._tier_seconds.labels(timing.tier, part).observe(value / 1e3)
        for link in reply.links:
            self._bytes.labels(link.link, "request").inc(link.bytes)
            if link.rate_bps > 0:
                self._rate.labels(link.link).set(link.rate_bps)
        if down_link and nbytes:
            self._bytes.labels(down_link, "reply").inc(nbytes)

    def observe_result(self, result: Any) -> None:
        """Count one request the device finished (a ``tierflow.device.client.Result``).

        The outcome of a failed request is its error code (``RemoteError``) or, for errors
        the device met itself, its type (``deadlineerror``, ``transporterror``, ...).
        """
        error = result.error
        if error is not None:
            outcome = str(getattr(error, "code", None) or type(error).__name__).lower()
        elif result.cache_hit:
            outcome = "cache_hit"
        elif result.fallback:
            outcome = "fallback"
        elif result.exit:
            outcome = "exit"
        else:
            outcome = "ok"
        answered_by = result.answered_by or self.tier
        self._requests.labels(self.tier, outcome, answered_by).inc()
        if result.cache_hit:
            self._cache_hits.labels(self.tier, answered_by).inc()
        if result.exit and error is None:
            self._exits.labels(answered_by, result.exit).inc()
        if "total" in result.ms:
            self._latency.labels(self.tier).observe(result.ms["total"] / 1e3)
        for tier, parts in result.timings.items():
            for part in ("queue", "compute", "codec"):
                if f"{part}_ms" in parts:
                    self._tier_seconds.labels(tier, part).observe(parts[f"{part}_ms"] / 1e3)
        for link, nbytes in result.bytes.items():
            if link.startswith(f"{self.tier}-"):  # what this process sent
                self._bytes.labels(link, "request").inc(nbytes)
        for link, rate in result.rate_bps.items():
            if rate > 0:
                self._rate.labels(link).set(rate)

    def observe_latency(self, received: float) -> None:
        """Observe the seconds since a request was ``received`` (perf_counter), at its reply."""
        self._latency.labels(self.tier).observe(time.perf_counter() - received)

    # ------------------------------------------------------------------ serving

    def start(self, host: str, port: int) -> int:
        """Serve ``/metrics`` on ``host:port`` (0 picks a port) in a thread; return the port."""
        prom = import_extra("prometheus_client", "--metrics-port")
        try:
            server, _ = prom.start_http_server(port, addr=host, registry=self.registry)
        except OSError as exc:
            raise TransportError(f"cannot serve metrics on {host}:{port}: {exc}") from exc
        self._server = server
        bound = int(server.server_port)
        logger.info("[%s] metrics on http://%s:%d/metrics", self.tier, host, bound)
        return bound

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class _PeerWarningsCollector:
    """``tierflow_peer_warnings_total``: the process's counts, read at each scrape."""

    def __init__(self, tier: str, family: Any) -> None:
        self.tier = tier
        self._family = family

    def collect(self) -> Any:
        family = self._family(
            "tierflow_peer_warnings",
            "Warnings about what peers sent, by kind (few are logged)",
            labels=["tier", "kind"],
        )
        for (tier, kind), count in sorted(WARNINGS.counts(self.tier).items()):
            family.add_metric([tier, kind], count)
        yield family


def _store_figure(store: SegmentStore | None, what: str) -> float:
    if store is None:
        return 0.0
    return float(store.used_bytes if what == "used_bytes" else len(store.fetched))


class _StateCollector:
    """The session state each owner holds, read at each scrape (owners come and go)."""

    def __init__(self, tier: str, states: Callable[[], SessionStates | None]) -> None:
        self.tier = tier
        self.states = states

    def collect(self) -> Iterator[Any]:
        core = import_extra("prometheus_client.core", "--metrics-port")
        held = self.states()
        owners = held.by_owner() if held is not None else {}
        nbytes = core.GaugeMetricFamily(
            "tierflow_state_bytes",
            "Bytes of session state held, by owner (everything a session holds)",
            labels=["tier", "identity"],
        )
        sessions = core.GaugeMetricFamily(
            "tierflow_state_sessions", "Sessions held, by owner", labels=["tier", "identity"]
        )
        for owner, (count, size) in sorted(owners.items()):
            nbytes.add_metric([self.tier, owner], size)
            sessions.add_metric([self.tier, owner], count)
        evictions = core.CounterMetricFamily(
            "tierflow_state_evictions",
            "Sessions evicted (budget, share) or dropped idle",
            labels=["tier"],
        )
        evictions.add_metric([self.tier], held.evicted if held is not None else 0)
        yield from (nbytes, sessions, evictions)

    def describe(self) -> list[Any]:
        return []  # collected at each scrape only: the owners change


class _BatchCollector:
    """The step batchers' calls by size, read at each scrape."""

    def __init__(self, tier: str, batches: Callable[[], list[BatchStats]]) -> None:
        self.tier = tier
        self.batches = batches

    def collect(self) -> Iterator[Any]:
        core = import_extra("prometheus_client.core", "--metrics-port")
        calls = core.CounterMetricFamily(
            "tierflow_batch_calls",
            "The step batcher's ONNX Runtime calls, by the steps each ran",
            labels=["tier", "size"],
        )
        seconds = core.CounterMetricFamily(
            "tierflow_batch_call_seconds",
            "The time the step batcher's ONNX Runtime calls took, by the steps each ran",
            labels=["tier", "size"],
        )
        sizes: dict[int, int] = {}
        took: dict[int, float] = {}
        for stats in self.batches():
            for size, count in dict(stats.sizes).items():
                sizes[size] = sizes.get(size, 0) + count
            for size, spent in dict(stats.seconds).items():
                took[size] = took.get(size, 0.0) + spent
        for size in sorted(sizes):
            calls.add_metric([self.tier, str(size)], sizes[size])
            seconds.add_metric([self.tier, str(size)], took.get(size, 0.0))
        yield calls
        yield seconds

    def describe(self) -> list[Any]:
        return []  # collected at each scrape only: the sizes change
