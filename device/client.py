"""The device runtime: run the first segment(s) here, stream the features to the edge.

:class:`DeviceClient` is what ``tierflow run``, the demo and the benchmarks call. It runs
the device's segments in ONNX Runtime, encodes what the next tier needs with the plan's
device-edge codec and sends it on one long-lived stream to the edge, with up to
``window`` requests in flight so that device, links, edge and cloud work as a pipeline.
Each request ends as one :class:`Result`: the outputs, or a typed error
(``TransportError``, ``DeadlineError`` or ``RemoteError``) — never a hang: a request not
answered within ``deadline_s`` fails with a ``DeadlineError``, and a tier that goes away
fails every request in flight at once (see ``tierflow.transport.stream_client``).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tierflow.cache.base import CacheAnswer, FeatureCache, cache_key
from tierflow.codec.base import DEFAULT_MAX_TENSOR_BYTES
from tierflow.device.probing import DEFAULT_IDLE_S, IdleProber
from tierflow.device.switching import LinkEstimator, PlanSelector, backlog_s, rate_ceiling
from tierflow.errors import (
    CacheError,
    DeadlineError,
    InputError,
    RemoteError,
    TierflowError,
    TransportError,
    UsageError,
)
from tierflow.link.emulation import LinkShaper
from tierflow.link.spec import LINKS, TIERS, LinkSpec
from tierflow.options import RuntimeOptions
from tierflow.plan import Plan, PlanSet, load_plan_set
from tierflow.rpc import tier_pb2
from tierflow.runtime.segment_runner import SegmentRunner, TierRunner, emulate_slower
from tierflow.runtime.segment_store import SegmentSource, SegmentStore, tier_files
from tierflow.transport.deadline import DEFAULT_DEADLINE_S, Deadline
from tierflow.transport.stream_client import Sent, StreamClient
from tierflow.transport.wire import decode_tensors, error_from_proto, put_tensors

logger = logging.getLogger(__name__)

DEFAULT_WINDOW = 16
#: A link's assumed rate before any transfer, when the plan names none (bits/s).
DEFAULT_PRIOR_BPS = 100e6
#: While the cloud is missing, one request in this many seconds tries it again.
DEFAULT_RETRY_S = 1.0
#: Answers whose time after crossing the device-edge link bounds the next ones'
#: ([Note: censored rate evidence] in tierflow/device/switching.py): the slowest counts,
#: times ANSWER_MARGIN, so that a tier a little slower than of late is not taken for a
#: slow link.
ANSWER_TIMES_KEPT = 8
ANSWER_MARGIN = 1.5
#: Error codes of a reply that mean a tier is gone: the edge (stopping) or the one after it.
_TIER_GONE = ("UNAVAILABLE", "UPSTREAM_UNAVAILABLE")


@dataclass(frozen=True)
class Result:
    """One request's outcome, as the device saw it.

    ``outputs`` are the model outputs, or, when an early exit answered, that exit's class
    scores under the exit's name. ``bytes`` and ``rate_bps`` are per link, as measured by
    the sender of the request's features on that link (0 where nothing crossed; the rate
    is over the transfer time only, see [Note: honest link figures]).
    ``ms`` holds each tier's compute + codec time, ``queue`` (all waiting: at each
    receiver before its work started, and at each sender behind earlier messages),
    ``total`` (wall time on the device) and ``network`` (total minus the tiers and the
    waiting: transfers, propagation, gRPC and the way back).
    ``error`` is set, and ``outputs`` empty, when the request failed. ``timings`` splits
    each tier's time into ``compute_ms``, ``codec_ms`` and ``queue_ms``; ``links`` each
    link's into ``queue_ms`` (at its sender) and ``transfer_ms``. ``fallback`` marks an
    answer given without a tier the request's plan needed, and ``fallback_reason`` says
    which tier was missing and how the answer came instead ([Note: device fallback],
    [Note: losing a tier]). ``plan`` is the id of the plan the request ran on;
    ``switch`` says why the device changed plans at this request (None if it did not).
    """

    id: str
    outputs: dict[str, np.ndarray] = field(default_factory=dict)
    answered_by: str | None = None
    exit: str | None = None
    cache_hit: bool = False
    bytes: dict[str, int] = field(default_factory=dict)
    rate_bps: dict[str, float] = field(default_factory=dict)
    ms: dict[str, float] = field(default_factory=dict)
    error: TierflowError | None = None
    timings: dict[str, dict[str, float]] = field(default_factory=dict)
    links: dict[str, dict[str, float]] = field(default_factory=dict)
    fallback: bool = False
    plan: str | None = None
    switch: str | None = None
    fallback_reason: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def unwrap(self) -> Result:
        """Return self, or raise the request's error."""
        if self.error is not None:
            raise self.error
        return self

    def to_dict(self) -> dict[str, Any]:
        """The report line of this request (``R.jsonl``); outputs are not included."""
        error = None
        if self.error is not None:
            error = {
                "type": type(self.error).__name__,
                "code": getattr(self.error, "code", None),
                "tier": getattr(self.error, "tier", None),
                "message": str(self.error),
            }
        return {
            "id": self.id,
            "answered_by": self.answered_by,
            "exit": self.exit,
            "cache_hit": self.cache_hit,
            "bytes": dict(self.bytes),
            "rate_bps": dict(self.rate_bps),
            "ms": dict(self.ms),
            "error": error,
            "timings": {tier: dict(parts) for tier, parts in self.timings.items()},
            "links": {link: dict(parts) for link, parts in self.links.items()},
            "fallback": self.fallback,
            "fallback_reason": self.fallback_reason,
            "plan": self.plan,
            "switch": self.switch,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Result:
        """A report line read back (outputs are not in reports; errors become TierflowError)."""
        error = data.get("error")
        return cls(
            id=str(data["id"]),
            answered_by=data.get("answered_by"),
            exit=data.get("exit"),
            cache_hit=bool(data.get("cache_hit", False)),
            bytes={str(k): int(v) for k, v in (data.get("bytes") or {}).items()},
            rate_bps={str(k): float(v) for k, v in (data.get("rate_bps") or {}).items()},
            ms={str(k): float(v) for k, v in (data.get("ms") or {}).items()},
            error=TierflowError(error["message"]) if error else None,
            timings={
                str(tier): {str(k): float(v) for k, v in parts.items()}
                for tier, parts in (data.get("timings") or {}).items()
            },
            links={
                str(link): {str(k): float(v) for k, v in parts.items()}
                for link, parts in (data.get("links") or {}).items()
            },
            fallback=bool(data.get("fallback", False)),
            plan=data.get("plan"),
            switch=data.get("switch"),
            fallback_reason=data.get("fallback_reason"),
        )


class Ticket:
    """A request on its way: :meth:`result` waits for its :class:`Result`."""

    def __init__(
        self,
        request_id: str,
        started: float,
        device_ms: float,
        *,
        compute_ms: float = 0.0,
        sent: Sent | None = None,
        result: Result | None = None,
        timeout: float = DEFAULT_DEADLINE_S,
        max_tensor_bytes: int = DEFAULT_MAX_TENSOR_BYTES,
        store: Callable[[Mapping[str, np.ndarray], str | None], None] | None = None,
        fallback: Callable[[TransportError], Result | None] | None = None,
    ) -> None:
        self.id = request_id
        self.plan: str | None = None  # the plan it runs on, set by DeviceClient.submit
        self.switch: str | None = None
        #: Why the plan was one that avoids a missing tier ([Note: losing a tier]).
        self.avoided: str | None = None
        self._store = store
        self._fallback = fallback
        self._started = started
        self._device_ms = device_ms
        self._compute_ms = compute_ms
        self._sent = sent
        self._result = result
        self._timeout = timeout
        self._max_tensor_bytes = max_tensor_bytes
        self._arrived: float | None = None
        if sent is not None:
            # When the reply came, not when the caller got round to asking for it.
            sent.future.add_done_callback(self._mark_arrival)

    def _mark_arrival(self, future: Future[tier_pb2.Reply]) -> None:
        self._arrived = time.perf_counter()

    def done(self) -> bool:
        return self._result is not None or (self._sent is not None and self._sent.future.done())

    def result(self) -> Result:
        """Wait for the reply (the stream client resolves it by the deadline at the latest)."""
        if self._result is None:
            self._result = self._finish()
        if self.plan is not None:  # a fallback answer already names the device-only plan
            plan = self._result.plan or self.plan
            self._result = dataclasses.replace(self._result, plan=plan, switch=self.switch)
        result = self._result
        if self.avoided is not None and result.ok and not (result.fallback or result.cache_hit):
            reason = f"{self.avoided}; answered with plan {self.plan}"
            self._result = dataclasses.replace(self._result, fallback=True, fallback_reason=reason)
        return self._result

    def _finish(self) -> Result:
        assert self._sent is not None
        failure: TierflowError | None = None
        try:
            reply = self._sent.future.result(timeout=self._timeout + 5.0)
        except TierflowError as exc:
            failure = exc
        except TimeoutError:
            failure = DeadlineError("no reply within the deadline")
        # Read once the request is done: a request sent again has a new transfer.
        stat = self._sent.transfer.stat("device-edge")
        bytes_ = {link: 0 for link in LINKS}
        rates = {link: 0.0 for link in LINKS}
        links = {link: {"queue_ms": 0.0, "transfer_ms": 0.0} for link in LINKS}
        _add_link(stat, bytes_, rates, links)
        if isinstance(failure, TransportError) and self._fallback is not None:
            answer = self._fallback(failure)
            if answer is not None:
                return answer
        if failure is not None:
            return self._failed(failure, bytes_, rates, links)
        ended = self._arrived or time.perf_counter()
        ms = {tier: 0.0 for tier in TIERS}
        ms["device"] = self._device_ms
        ms["queue"] = stat.queue_ms
        timings: dict[str, dict[str, float]] = {}
        for timing in reply.timings:
            if timing.tier in ms:
                ms[timing.tier] += timing.compute_ms + timing.codec_ms
                ms["queue"] += timing.queue_ms
                timings[timing.tier] = {
                    "compute_ms": timing.compute_ms,
                    "codec_ms": timing.codec_ms,
                    "queue_ms": timing.queue_ms,
                }
        for link in reply.links:
            if link.link in bytes_:
                _add_link(link, bytes_, rates, links)
                ms["queue"] += link.queue_ms
        if reply.HasField("error"):
            error = error_from_proto(reply.error)
            if error.code in _TIER_GONE and self._fallback is not None:
                answer = self._fallback(error)
                if answer is not None:
                    return answer
            return self._failed(error, bytes_, rates, links)
        start = time.perf_counter()
        try:
            outputs = decode_tensors(reply.outputs, max_bytes=self._max_tensor_bytes)
        except TierflowError as exc:
            return self._failed(exc, bytes_, rates, links)
        decode_ms = (time.perf_counter() - start) * 1e3
        ms["device"] += decode_ms
        timings["device"] = {
            "compute_ms": self._compute_ms,
            "codec_ms": self._device_ms - self._compute_ms + decode_ms,
            "queue_ms": 0.0,
        }
        ms["total"] = (ended - self._started) * 1e3 + (time.perf_counter() - start) * 1e3
        busy = sum(ms[tier] for tier in TIERS) + ms["queue"]
        ms["network"] = max(ms["total"] - busy, 0.0)
        if self._store is not None:  # after the figures: storing is not the request's time
            self._store(outputs, reply.exit or None)
        return Result(
            self.id,
            outputs,
            reply.answered_by or None,
            reply.exit or None,
            reply.cache_hit,
            bytes_,
            rates,
            ms,
            timings=timings,
            links=links,
            fallback=bool(reply.fallback),
            fallback_reason=reply.fallback or None,
        )

    def _failed(
        self,
        error: TierflowError,
        bytes_: dict[str, int],
        rates: dict[str, float],
        links: dict[str, dict[str, float]],
    ) -> Result:
        total = ((self._arrived or time.perf_counter()) - self._started) * 1e3
        ms = {"device": self._device_ms, "edge": 0.0, "cloud": 0.0, "total": total}
        ms.update(queue=0.0, network=0.0)
        return Result(self.id, bytes=bytes_, rate_bps=rates, ms=ms, error=error, links=links)


def _add_link(
    stat: tier_pb2.LinkStat,
    bytes_: dict[str, int],
    rates: dict[str, float],
    links: dict[str, dict[str, float]],
) -> None:
    """Record one link's figures for a request ([Note: honest link figures])."""
    bytes_[stat.link] += stat.bytes
    rates[stat.link] = stat.rate_bps
    links[stat.link] = {"queue_ms": stat.queue_ms, "transfer_ms": stat.send_ms}


class DeviceClient:
    """Runs a plan from the device: local segments, then the edge and cloud over gRPC.

    ``edge`` (``HOST:PORT``) is needed unless the plan runs entirely on the device.
    ``options`` say how to run: ONNX Runtime settings, emulated links (only
    ``device-edge`` matters here), limits, and the TLS and token setting of the channel
    to the edge. ``window`` requests are in flight at most; each fails with a
    ``DeadlineError`` if not answered within ``deadline_s``. ``cache`` (any
    :class:`~tierflow.cache.base.FeatureCache`, e.g. from ``run --cache``) is looked up with
    the model inputs before anything runs: a hit is answered here, with no compute and
    nothing sent (``answered_by`` "device", ``cache_hit``); every answer is stored when
    its result is read. When the plan directory also holds a device-only plan, requests
    the edge cannot take are answered with it ([Note: device fallback]). Use as a
    context manager, or call :meth:`close`.

    [Note: device fallback]
    A plan set (``plan --adaptive``) may hold a plan that runs the whole model on the
    device. While the edge is known to be down, for every request whose stream to the
    edge broke (a ``TransportError``, not a deadline) and for every request the edge
    refused UNAVAILABLE (it is stopping), the device runs that plan on the request's
    inputs and answers itself, marked ``fallback`` in its result, with
    ``fallback_reason``. Its sessions are opened on the first fallback,
    so a device that never loses the edge never pays their memory. Each request still
    tries the edge first unless it is known to be down, so answers come from the edge
    again as soon as it is back (the channel reconnects by itself, see
    [Note: retries and failing fast]). Without a device-only plan, a request whose
    device segment has an early exit is answered from that exit's scores instead.

    [Note: losing a tier]
    When the cloud is gone, the edge answers what it can ([Note: answering without the
    next tier] in tierflow/runtime/service.py): from its early exit, marked ``fallback`` with the
    reason, or with an ``UPSTREAM_UNAVAILABLE`` error. The device takes either as
    news that the cloud is missing. The request that met the error is finished with a
    plan of the set that does not need the cloud: run here if it is the device-only
    plan, else sent again on it through the edge (a device+edge plan); the answer is
    marked ``fallback``, with ``fallback_reason``. Until the cloud is back the device
    picks its plans among those that do not need it (the one closest to the link
    estimates, with a plan set that has regions; else the first in the set), names the
    switch in ``switch`` and marks those answers ``fallback`` too; a set without such a
    plan keeps its plans (the edge's
    exits answer, or requests fail with the typed error). One request every
    ``retry_s`` seconds tries the plan the device would use with every tier; the first
    answer the cloud gives again ends the fallback (a failed try is still answered
    once, as above).

    [Note: idle probes on the device]
    With a plan set that switches, the device also probes the device-edge link while
    it is idle (``idle_probe_s``, default 1 s; None: never), so that the first request
    after a pause runs on a plan chosen for the link as it is now
    ([Note: idle probes] in tierflow/device/probing.py).

    [Note: switching plans on the device]
    When the plan set has several plans with rate regions, the device keeps a
    :class:`~tierflow.device.switching.LinkEstimator` per link, fed passively from each
    answered request's measured transfer (bytes over transfer time, per link), and asks a
    :class:`~tierflow.device.switching.PlanSelector` which plan the next request runs
    ([Note: switching with hysteresis]). Each request names its plan on the wire and the
    tiers serve every plan of the set, so requests in flight finish on the plan they
    started with. A plan's device sessions open on its first request (segment files
    shared between plans are opened once). Its result names the plan (``plan``) and, at
    a switch, why (``switch``). ``adaptive=False`` keeps the default plan. Before each
    choice the device-edge estimate is also bounded by the requests still on that link
    ([Note: censored rate evidence] in tierflow/device/switching.py): one unanswered for
    longer than its upload at the estimated rate plus ``ANSWER_MARGIN`` times the slowest
    of the last ``ANSWER_TIMES_KEPT`` answers' time after their upload lowers the
    estimate at once, so a sudden drop turns the next requests, not only those sent after
    the slow uploads are answered (at the first choice, when the bound alone shows the
    current plan costly: [Note: a bound needs no second look] there). And while uploads
    are still queued on that link, a request may run on a plan that keeps off it
    ([Note: a backlog on the link] in tierflow/device/switching.py); its result names
    that detour in ``switch``.
    """

    def __init__(
        self,
        plan_dir: str | Path,
        edge: str | None = None,
        *,
        options: RuntimeOptions | None = None,
        window: int = DEFAULT_WINDOW,
        deadline_s: Deadline | float = DEFAULT_DEADLINE_S,
        cache: FeatureCache | None = None,
        adaptive: bool = True,
        idle_probe_s: float | None = DEFAULT_IDLE_S,
        retry_s: float = DEFAULT_RETRY_S,
    ) -> None:
        if window < 1:
            raise UsageError(f"the window must be at least 1 request, got {window}")
        # Checked when made: [Note: one deadline] in tierflow.transport.deadline.
        self.deadline = Deadline.of(deadline_s)
        self.options = options = options or RuntimeOptions()
        self.plans = plans = load_plan_set(plan_dir, require_segments=False)
        self.plan = plans.default_plan
        self.plan_id = self.plan.plan_id
        self._sessions: dict[Path, SegmentRunner] = {}
        self._runners: dict[int, TierRunner] = {}
        self._runners_lock = threading.Lock()
        self.window = window
        self.deadline_s = self.deadline.seconds
        self.max_tensor_bytes = options.max_tensor_bytes
        self.cache = cache
        self.codec = self.plan.link_codec("device-edge")
        self.local_only = _runs_on_device_only(self.plan)
        self.plan_dir = plan_dir
        self.fallback_plan = None if self.local_only else _device_only(plans.plans)
        self.stream: StreamClient | None = None
        self._ids = itertools.count()
        remote = any(not _runs_on_device_only(plan) for plan in plans.plans)
        if not self.local_only or (edge and remote):
            if not edge:
                raise UsageError(
                    "the plan runs segments on the edge or the cloud; give the edge's "
                    "address (--edge HOST:PORT)"
                )
            self.stream = StreamClient(
                edge,
                me="device",
                peer="edge",
                shaper=LinkShaper("device-edge", options.links.get("device-edge")),
                max_message_bytes=options.max_message_bytes,
                security=options.security,
            )
        self.segments = SegmentStore(
            plan_dir,
            plans,
            tier="device",
            budget=options.segment_budget,
            source=None
            if self.stream is None
            else SegmentSource(self.stream.channel, "edge", known_down=self.stream.known_down),
            on_evict=self._evicted,
        )
        self._fetching_ahead = threading.Lock()  # one fetch ahead at a time
        try:
            self._runner_for(plans.default)  # fetched and opened now, not at the first request
        except BaseException:
            if self.stream is not None:
                self.stream.close()
            raise
        self.selector: PlanSelector | None = None
        if adaptive and self.stream is not None and len(plans.plans) > 1 and any(plans.regions):
            self.selector = PlanSelector(plans)
        self.estimators = {link: LinkEstimator(_prior(plans, link)) for link in LINKS}
        self._estimates_lock = threading.Lock()
        # Under _estimates_lock: requests on the device-edge link not answered yet, and
        # how long recent answers took after their upload had left.
        self._unanswered: dict[str, Sent] = {}
        self._answer_s: collections.deque[float] = collections.deque(
            [_prior(plans, "device-edge").rtt_s], maxlen=ANSWER_TIMES_KEPT
        )
        self._probe_switch: str | None = None  # a switch an idle probe made, not yet named
        # [Note: losing a tier]: the plans that run without the cloud, and its state.
        self.retry_s = retry_s
        self._cloud_free = [i for i, p in enumerate(plans.plans) if not _needs_cloud(p)]
        self._device_only_index = next(
            (i for i, p in enumerate(plans.plans) if _runs_on_device_only(p)), None
        )
        self._cloud_missing: str | None = None  # why, while the cloud is missing
        self._retry_at = 0.0
        self._last_index = plans.default
        self._tiers_lock = threading.Lock()
        self.prober: IdleProber | None = None
        if self.selector is not None and self.stream is not None and idle_probe_s is not None:
            stream = self.stream
            self.prober = IdleProber(
                stream.channel,
                busy=lambda: stream.in_flight() > 0,
                rate=lambda: self.estimators["device-edge"].estimate().rate_bps,
                report=self._probed,
                shaper=stream.shaper,
                idle_s=idle_probe_s,
            )
            self.prober.start()

    def __enter__(self) -> DeviceClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self.prober is not None:
            self.prober.close()
        if self.stream is not None:
            self.stream.close()

    def submit(self, inputs: Mapping[str, np.ndarray]) -> Ticket:
        """Run the device's part now and send the rest on; errors end up in the Result.

        The plan is chosen per request ([Note: switching plans on the device]). While the
        edge is known to be down, and no device exit could answer, the request fails at
        once without running anything (see [Note: retries and failing fast]).
        """
        index, switch, avoided = self._choose()
        plan = self.plans.plans[index]
        try:
            with self.segments.holding(tier_files(self.plans, index, "device")):
                ticket = self._submit(inputs, plan, self._runner_for(index))
        except TierflowError as exc:  # its segments could not be fetched
            request_id, started = str(next(self._ids)), time.perf_counter()
            result = None
            if isinstance(exc, TransportError):
                arrays = {name: np.asarray(value) for name, value in inputs.items()}
                result = self._fall_back(request_id, started, arrays, None, exc)
            if result is None:
                ticket = self._local(request_id, started, error=exc)
            else:
                ticket = Ticket(request_id, started, result.ms["device"], result=result)
        ticket.plan, ticket.switch, ticket.avoided = plan.plan_id, switch, avoided
        return ticket

    def _choose(self) -> tuple[int, str | None, str | None]:
        """The index of the plan for the next request, why it changed (if it did), and
        why it avoids a tier (if it does: its answer is then a fallback).

        See [Note: switching plans on the device] and, while the cloud is missing,
        [Note: losing a tier].
        """
        now = time.monotonic()
        index, reason = self.plans.default, None
        if self.selector is not None:
            fetch = self._fetch_bytes()
            with self._estimates_lock:
                self._bound_by_unanswered(now)
                links = {link: e.estimate() for link, e in self.estimators.items()}
                backlog = self._backlog(now, links["device-edge"].rate_bps)
                bounded = self.estimators["device-edge"].bounded
                choice = self.selector.choose(now, links, fetch, backlog, bounded)
                if choice.reason:
                    logger.info("[device] switching plans: %s", choice.reason)
                index, reason = choice.index, choice.reason or None
                if self._probe_switch is not None:
                    reason, self._probe_switch = reason or self._probe_switch, None
        with self._tiers_lock:
            missing = self._cloud_missing
            trial = missing is not None and now >= self._retry_at
            if trial:
                self._retry_at = now + self.retry_s
        if trial:
            return index, None, None  # tries the cloud again: not a switch
        avoided = None
        if missing is not None and index not in self._cloud_free:
            index, avoided = self._cloud_free_plan(), missing
            reason = None  # the selector's reason names a plan not taken
        if index != self._last_index and reason is None:
            plan_id = self.plans.plans[index].plan_id
            if missing is not None:
                reason = f"{missing}: plan {plan_id} does not need the cloud"
            else:
                reason = f"the cloud answers again: back to plan {plan_id}"
            logger.info("[device] switching plans: %s", reason)
        self._last_index = index
        return index, reason, avoided

    def _fetch_bytes(self) -> list[int]:
        """Per plan, the bytes of device segments to fetch before it can run."""
        return [
            self.segments.missing_bytes(tier_files(self.plans, index, "device"))
            for index in range(len(self.plans.plans))
        ]

    def _cloud_free_plan(self) -> int:
        """The plan to use without the cloud ([Note: losing a tier]); there is one."""
        if self.selector is None:
            return self._cloud_free[0]
        with self._estimates_lock:
            links = {link: e.estimate() for link, e in self.estimators.items()}
        distances = self.selector.distances(links)
        return min(self._cloud_free, key=lambda i: (distances[i], i))

    def _lose_cloud(self, why: str) -> None:
        """The cloud is missing ([Note: losing a tier]); a no-op without a plan to avoid it."""
        if not self._cloud_free:
            return
        with self._tiers_lock:
            if self._cloud_missing is not None:
                return
            self._cloud_missing = why
            self._retry_at = time.monotonic() + self.retry_s
        logger.warning("[device] %s; using plans that do not need it", self._cloud_missing)

    def _track_cloud(self, reply: tier_pb2.Reply) -> None:
        """Whether ``reply`` says the cloud is missing, or answers from it again."""
        if reply.fallback:
            self._lose_cloud(f"{reply.answered_by}: {reply.fallback}")
        elif reply.HasField("error"):
            if reply.error.code == tier_pb2.ErrorCode.UPSTREAM_UNAVAILABLE:
                self._lose_cloud(str(error_from_proto(reply.error)))
        elif reply.answered_by == "cloud" and self._cloud_missing is not None:
            with self._tiers_lock:
                self._cloud_missing = None
            logger.info("[device] the cloud answers again")

    def _probed(self, now: float, nbytes: int, seconds: float, rtt_s: float) -> None:
        """An idle probe's measurement of the device-edge link ([Note: idle probes])."""
        fetch = self._fetch_bytes()
        with self._estimates_lock:
            estimator = self.estimators["device-edge"]
            estimator.observe(now, nbytes, seconds)
            estimator.observe_rtt(now, rtt_s)
            self._bound_by_unanswered(now)
            if self.selector is not None:
                # The hold of a switch counts from what the probe saw, not from the next
                # request; a switch made here is named by that request.
                links = {link: e.estimate() for link, e in self.estimators.items()}
                choice = self.selector.choose(
                    now,
                    links,
                    fetch,
                    self._backlog(now, links["device-edge"].rate_bps),
                    estimator.bounded,
                )
                if choice.reason:
                    self._probe_switch = f"idle probe: {choice.reason}"
                    logger.info("[device] switching plans: %s", self._probe_switch)

    def _backlog(self, now: float, rate_bps: float) -> float:
        """Seconds the device-edge link still needs for the uploads not answered yet.

        See [Note: a backlog on the link] in tierflow/device/switching.py: from what the
        device handed to the link, when, and whether it has begun to cross by ``now``, at
        the estimated rate. Call with ``_estimates_lock`` held.
        """
        queued = []
        for sent in self._unanswered.values():
            began = sent.transfer.started  # with emulation, booked ahead: known once past
            queued.append(
                (
                    sent.transfer.nbytes,
                    sent.transfer.queued,
                    began if began is not None and began <= now else None,
                )
            )
        return backlog_s(now, queued, rate_bps)

    def _bound_by_unanswered(self, now: float) -> None:
        """Bound the device-edge estimate by the uploads still unanswered at ``now``.

        See [Note: censored rate evidence]; call with ``_estimates_lock`` held.
        """
        in_flight: list[tuple[int, float]] = []
        for sent in self._unanswered.values():
            if sent.transfer.started is not None:  # it has begun to cross
                in_flight.append((sent.transfer.nbytes, sent.transfer.started))
        ceiling = rate_ceiling(now, in_flight, ANSWER_MARGIN * max(self._answer_s))
        self.estimators["device-edge"].bound(ceiling)

    @property
    def runner(self) -> TierRunner:
        """The default plan's device runner (reopened, its files fetched, if evicted)."""
        return self._runner_for(self.plans.default)

    def _runner_for(self, index: int) -> TierRunner:
        """Plan ``index``'s device runner, opened on first use (its files fetched first)."""
        files = tier_files(self.plans, index, "device")
        with self.segments.holding(files), self._runners_lock:
            runner = self._runners.get(index)
            if runner is None:
                plan = self.plans.plans[index]
                runner = TierRunner(plan, self.plan_dir, "device", self.options, self._sessions)
                self._runners[index] = runner
            return runner

    def _evicted(self, file: str) -> None:
        """A segment file left the store: drop the sessions on it and the runners using it."""
        uses = functools.partial(_uses, file)
        with self._runners_lock:
            self._sessions.pop(Path(self.plan_dir) / file, None)
            for index, runner in list(self._runners.items()):
                if uses(runner):
                    del self._runners[index]

    def _observe(self, sent: Sent, future: Future[tier_pb2.Reply]) -> None:
        """Feed the link estimators from an answered request's transfers (passive).

        Also notes a missing cloud, or its return ([Note: losing a tier]).
        """
        if self.prober is not None:
            self.prober.touch()
        now = time.monotonic()
        with self._estimates_lock:
            self._unanswered.pop(sent.wire_id, None)
        if future.cancelled() or future.exception() is not None:
            return
        self._track_cloud(future.result())
        stats = [sent.transfer.stat("device-edge"), *future.result().links]
        with self._estimates_lock:
            if sent.transfer.handed and sent.transfer.left is not None:
                self._answer_s.append(max(now - sent.transfer.left, 0.0))
            for stat in stats:
                estimator = self.estimators.get(stat.link)
                if estimator is not None and stat.rate_bps > 0:
                    estimator.observe(now, stat.bytes, stat.send_ms / 1e3)
        self._fetch_ahead()  # the edge answered: the link is up

    def _fetch_ahead(self) -> None:
        """Fetch, in the background, the device files the next requests may need.

        Those of the device-only plan ([Note: device fallback]) and of the plan the
        selector is about to switch to ([Note: switching plans on the device]), when the
        store's budget holds them beside the current plan's files. One fetch at a time.
        """
        if self.segments.source is None or self.stream is None or self.stream.known_down():
            return
        wanted = [spec.file for spec in self.fallback_plan.segments] if self.fallback_plan else []
        current = self.plans.default
        if self.selector is not None:
            with self._estimates_lock:
                current, candidate = self.selector.current, self.selector.candidate
            if candidate is not None:
                wanted += tier_files(self.plans, candidate, "device")
        missing = [name for name in dict.fromkeys(wanted) if not self.segments.present(name)]
        keep = tier_files(self.plans, current, "device")
        if not missing or not self.segments.fits(missing, keep=keep):
            return
        if not self._fetching_ahead.acquire(blocking=False):
            return
        threading.Thread(
            target=self._fetch, args=(missing,), name="device-fetch-ahead", daemon=True
        ).start()

    def _fetch(self, files: list[str]) -> None:
        try:
            with self.segments.holding(files):
                pass
        except TierflowError as exc:
            logger.info("[device] fetching %s ahead failed, later again: %s", files, exc)
        finally:
            self._fetching_ahead.release()

    def _submit(
        self,
        inputs: Mapping[str, np.ndarray],
        plan: Plan,
        runner: TierRunner,
        request_id: str | None = None,
    ) -> Ticket:
        """``request_id``: a request sent again keeps its id (new ones get the next)."""
        request_id = str(next(self._ids)) if request_id is None else request_id
        started = time.perf_counter()
        key: bytes | None = None
        try:
            arrays = {name: np.asarray(value) for name, value in inputs.items()}
            runner.check_names(set(arrays), segment=0)
            if self.cache is not None:
                key = cache_key(self.plan.model_sha256, self.plan_id, 0, arrays)
                answer = self._lookup(key, arrays)
                if answer is not None:
                    return self._local(
                        request_id,
                        started,
                        outputs=answer.outputs,
                        exit_name=answer.exit,
                        cache_hit=True,
                    )
            exits = any(spec.exits for _, spec, _ in runner.segments)
            if self.stream is not None and not exits and self.stream.known_down():
                address = self.stream.address
                down = TransportError(f"the edge at {address} is down; not running")
                result = self._fall_back(request_id, started, arrays, None, down)
                if result is None:
                    raise down
                return Ticket(request_id, started, result.ms["device"], result=result)
            outcome = runner.run(arrays)
        except TierflowError as exc:
            return self._local(request_id, started, error=exc)
        except Exception as exc:  # onnxruntime or numpy on odd input: still one Result
            logger.exception("[device] request %s failed", request_id)
            return self._local(request_id, started, error=InputError(str(exc)))
        store = None if key is None else functools.partial(self._store, key, arrays)
        if outcome.final:
            if self.prober is not None:  # chosen on a link estimate it cannot refresh
                self.prober.demand()
            if store is not None:
                store(outcome.tensors, outcome.exit)
            return self._local(request_id, started, outputs=outcome.tensors, exit_name=outcome.exit)
        assert self.stream is not None
        try:
            request = tier_pb2.Request(
                plan_id=plan.plan_id,
                segment=outcome.next_segment,
                deadline_unix_s=self.deadline.expires_unix_s(time.time()),
            )
            codec = plan.link_codec("device-edge")
            encoding = time.thread_time()
            nbytes = put_tensors(request.tensors, outcome.tensors, codec, plan.images)
            # See [Note: emulating a slower tier] in tierflow/runtime/segment_runner.py.
            emulate_slower(self.options.slowdown, encoding, time.thread_time)
            device_ms = (time.perf_counter() - started) * 1e3
            sent = self.stream.submit(
                request, deadline=self.deadline.expires_monotonic(time.monotonic()), nbytes=nbytes
            )
        except TransportError as exc:
            result = self._fall_back(request_id, started, arrays, outcome.unconfident, exc)
            if result is None:
                return self._local(request_id, started, error=exc)
            return Ticket(request_id, started, result.ms["device"], result=result)
        except TierflowError as exc:
            return self._local(request_id, started, error=exc)
        if self.prober is not None:
            self.prober.touch()
        with self._estimates_lock:
            self._unanswered[sent.wire_id] = sent
        sent.future.add_done_callback(functools.partial(self._observe, sent))
        fallback = functools.partial(
            self._fall_back, request_id, started, arrays, outcome.unconfident
        )
        return Ticket(
            request_id,
            started,
            device_ms,
            compute_ms=outcome.compute_s * 1e3,
            sent=sent,
            timeout=self.deadline_s,
            max_tensor_bytes=self.max_tensor_bytes,
            store=store,
            fallback=fallback,
        )

    def _fall_back(
        self,
        request_id: str,
        started: float,
        arrays: Mapping[str, np.ndarray],
        unconfident: tuple[str, np.ndarray] | None,
        cause: TransportError,
    ) -> Result | None:
        """Answer a request that the edge or the cloud could not take; never raises.

        The cloud missing ([Note: losing a tier]): a plan that does not need it. The
        edge missing ([Note: device fallback]): the device-only plan. Failing those, the
        device's own exit scores (``unconfident``). None: no way to answer here.
        """
        if isinstance(cause, RemoteError) and cause.code == "UPSTREAM_UNAVAILABLE":
            self._lose_cloud(str(cause))
            index = self._cloud_free_plan() if self._cloud_free else None
            why = str(cause)
        else:
            index = self._device_only_index
            why = f"the edge is unavailable ({cause})"
        if index is None:
            if unconfident is None:
                return None
            name, scores = unconfident
            total = (time.perf_counter() - started) * 1e3
            ms = {"device": 0.0, "edge": 0.0, "cloud": 0.0, "total": total}
            ms.update(queue=0.0, network=total)
            return Result(
                request_id,
                {name: scores},
                "device",
                name,
                bytes={link: 0 for link in LINKS},
                rate_bps={link: 0.0 for link in LINKS},
                ms=ms,
                fallback=True,
                fallback_reason=f"{why}; answered at the device's exit",
            )
        plan = self.plans.plans[index]
        if not _runs_on_device_only(plan):
            return self._send_again(request_id, started, arrays, index, why)
        bytes_ = {link: 0 for link in LINKS}
        rates = {link: 0.0 for link in LINKS}
        files = tier_files(self.plans, index, "device")
        try:
            with self.segments.holding(files):  # fetched ahead, or this fails
                if index not in self._runners:  # the first time: its sessions open now
                    logger.warning(
                        "[device] %s; answering with the device-only plan %s until it is back",
                        why,
                        plan.plan_id,
                    )
                runner = self._runner_for(index)
                run_start = time.perf_counter()
                outcome = runner.run(dict(arrays))
        except TierflowError as exc:
            total = (time.perf_counter() - started) * 1e3
            ms = {"device": total, "edge": 0.0, "cloud": 0.0, "total": total}
            ms.update(queue=0.0, network=0.0)
            logger.warning("[device] request %s: the device-only plan failed too", request_id)
            return Result(request_id, bytes=bytes_, rate_bps=rates, ms=ms, error=exc)
        assert outcome.final, "a device-only plan ends on the device"
        total = (time.perf_counter() - started) * 1e3
        # Time spent trying the edge is waiting, not the device's work.
        device_ms = (time.perf_counter() - run_start) * 1e3
        ms = {"device": device_ms, "edge": 0.0, "cloud": 0.0, "total": total}
        ms.update(queue=0.0, network=max(total - device_ms, 0.0))
        timings = {
            "device": {
                "compute_ms": outcome.compute_s * 1e3,
                "codec_ms": 0.0,
                "queue_ms": 0.0,
            }
        }
        return Result(
            request_id,
            outcome.tensors,
            "device",
            outcome.exit,
            False,
            bytes_,
            rates,
            ms,
            timings=timings,
            fallback=True,
            plan=plan.plan_id,
            fallback_reason=f"{why}; answered with the device-only plan",
        )

    def _send_again(
        self,
        request_id: str,
        started: float,
        arrays: Mapping[str, np.ndarray],
        index: int,
        why: str,
    ) -> Result:
        """Run a request again on plan ``index``, which needs no cloud ([Note: losing a tier])."""
        plan = self.plans.plans[index]
        with self.segments.holding(tier_files(self.plans, index, "device")):
            ticket = self._submit(arrays, plan, self._runner_for(index), request_id)
        answer = ticket.result()
        ms = dict(answer.ms)
        total = (time.perf_counter() - started) * 1e3
        # The first attempt's time is waiting, not any tier's work.
        ms["network"] = ms.get("network", 0.0) + max(total - ms.get("total", 0.0), 0.0)
        ms["total"] = total
        if answer.error is not None:
            return dataclasses.replace(answer, id=request_id, ms=ms, plan=plan.plan_id)
        reason = f"{why}; answered with plan {plan.plan_id}"
        if answer.fallback_reason:  # the edge went too: the device answered alone
            reason = f"{why}; then {answer.fallback_reason}"
        return dataclasses.replace(
            answer,
            id=request_id,
            ms=ms,
            fallback=True,
            plan=answer.plan or plan.plan_id,
            fallback_reason=reason,
        )

    def _lookup(self, key: bytes, arrays: Mapping[str, np.ndarray]) -> CacheAnswer | None:
        assert self.cache is not None
        try:
            return self.cache.lookup(key, arrays)
        except CacheError as exc:
            logger.warning("[device] cache lookup failed, running the model: %s", exc)
            return None

    def _store(
        self,
        key: bytes,
        arrays: Mapping[str, np.ndarray],
        outputs: Mapping[str, np.ndarray],
        exit_name: str | None,
    ) -> None:
        assert self.cache is not None
        try:
            self.cache.store(key, arrays, CacheAnswer(dict(outputs), exit_name))
        except CacheError as exc:
            logger.warning("[device] cache store failed: %s", exc)

    def _local(
        self,
        request_id: str,
        started: float,
        *,
        outputs: dict[str, np.ndarray] | None = None,
        exit_name: str | None = None,
        error: TierflowError | None = None,
        cache_hit: bool = False,
    ) -> Ticket:
        total = (time.perf_counter() - started) * 1e3
        ms = {"device": total, "edge": 0.0, "cloud": 0.0, "total": total}
        ms.update(queue=0.0, network=0.0)
        result = Result(
            request_id,
            outputs or {},
            None if error else "device",
            exit_name,
            cache_hit,
            {link: 0 for link in LINKS},
            {link: 0.0 for link in LINKS},
            ms,
            error,
        )
        return Ticket(request_id, started, total, result=result)

    def infer(self, inputs: Mapping[str, np.ndarray]) -> Result:
        """One request, start to end; raises its error (a TierflowError) if it failed."""
        return self.submit(inputs).result().unwrap()

    def run_stream(self, requests: Iterable[Mapping[str, np.ndarray]]) -> Iterator[Result]:
        """Results in request order, with up to ``window`` requests in flight.

        Failed requests are yielded too (``Result.error``): the stream goes on.
        """
        in_flight: collections.deque[Ticket] = collections.deque()
        for inputs in requests:
            while len(in_flight) >= self.window:
                yield in_flight.popleft().result()
            in_flight.append(self.submit(inputs))
            while in_flight and in_flight[0].done():
                yield in_flight.popleft().result()
        while in_flight:
            yield in_flight.popleft().result()


def _uses(file: str, runner: TierRunner) -> bool:
    return any(spec.file == file for _, spec, _ in runner.segments)


def _runs_on_device_only(plan: Plan) -> bool:
    return all(segment.tier == "device" for segment in plan.segments)


def _needs_cloud(plan: Plan) -> bool:
    return any(segment.tier == "cloud" for segment in plan.segments)


def _prior(plans: PlanSet, link: str) -> LinkSpec:
    """What to believe of ``link`` before any transfer: the default plan's figures."""
    default = plans.default_plan
    if link in default.links:
        return default.links[link]
    points = [point[link] for point in plans.regions[plans.default] if link in point]
    return points[0] if points else LinkSpec(DEFAULT_PRIOR_BPS)


def _device_only(plans: Iterable[Plan]) -> Plan | None:
    """The first plan that runs every segment on the device, if any."""
    return next((plan for plan in plans if _runs_on_device_only(plan)), None)
