"""Which plan of a set the device's next request runs, from what the links do now.

[Note: switching plans on the device]
When the plan set has several plans with rate regions, the device keeps a
:class:`~tierflow.device.switching.LinkEstimator` per link, fed passively from each
answered request's measured transfer (bytes over transfer time, per link), and asks a
:class:`~tierflow.device.switching.PlanSelector` which plan the next request runs
([Note: switching with hysteresis] in device/switching.py). Each request names
its plan on the wire and the tiers serve every plan of the set, so requests in flight
finish on the plan they started with. A plan's device sessions open on its first request
(segment files shared between plans are opened once). Its result names the plan
(``plan``) and, at a switch, why (``switch``). ``adaptive=False`` keeps the default plan.
Before each choice the device-edge estimate is also bounded by the requests still on that
link ([Note: censored rate evidence] in device/switching.py): one unanswered for
longer than its upload at the estimated rate plus ``ANSWER_MARGIN`` times the slowest of
the last ``ANSWER_TIMES_KEPT`` answers' time after their upload lowers the estimate at
once, so a sudden drop turns the next requests, not only those sent after the slow
uploads are answered (at the first choice, when the bound alone shows the current plan
costly: [Note: a bound needs no second look] there). And while uploads are still queued
on that link, a request may run on a plan that keeps off it ([Note: a backlog on the
link] in device/switching.py); its result names that detour in ``switch``.

[Note: idle probes on the device]
With a plan set that switches, the device also probes the device-edge link while it is
idle (``idle_probe_s``, default 1 s; None: never), so that the first request after a pause
runs on a plan chosen for the link as it is now ([Note: idle probes] in
device/probing.py).
"""

from __future__ import annotations

import collections
import functools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

from tierflow.device.probing import IdleProber
from tierflow.device.switching import LinkEstimator, PlanSelector, backlog_s, rate_ceiling
from tierflow.link.spec import LINKS, LinkSpec
from tierflow.plan import PlanSet
from tierflow.rpc import tier_pb2
from tierflow.runtime.segment_store import SegmentStore, tier_files
from tierflow.transport.stream_client import Sent, StreamClient

logger = logging.getLogger(__name__)

#: A link's assumed rate before any transfer, when the plan names none (bits/s).
DEFAULT_PRIOR_BPS = 100e6
#: Answers whose time after crossing the device-edge link bounds the next ones'
#: ([Note: censored rate evidence] in device/switching.py): the slowest counts,
#: times ANSWER_MARGIN, so that a tier a little slower than of late is not taken for a
#: slow link.
ANSWER_TIMES_KEPT = 8
ANSWER_MARGIN = 1.5


def prior(plans: PlanSet, link: str) -> LinkSpec:
    """What to believe of ``link`` before any transfer: the default plan's figures."""
    default = plans.default_plan
    if link in default.links:
        return default.links[link]
    points = [point[link] for point in plans.regions[plans.default] if link in point]
    return points[0] if points else LinkSpec(DEFAULT_PRIOR_BPS)


class Adaptation:
    """The device's link estimates and plan choice ([Note: switching plans on the device]).

    ``on_answer`` is called with every reply the edge gives (after the estimates took it
    in). Thread-safe.
    """

    def __init__(
        self,
        plans: PlanSet,
        segments: SegmentStore,
        stream: StreamClient | None,
        *,
        adaptive: bool,
        idle_probe_s: float | None,
        on_answer: Callable[[tier_pb2.Reply], None],
    ) -> None:
        self.plans = plans
        self.segments = segments
        self._on_answer = on_answer
        self.selector: PlanSelector | None = None
        if adaptive and stream is not None and len(plans.plans) > 1 and any(plans.regions):
            self.selector = PlanSelector(plans)
        self.estimators = {link: LinkEstimator(prior(plans, link)) for link in LINKS}
        self._lock = threading.Lock()
        # Under _lock: requests on the device-edge link not answered yet, and how long
        # recent answers took after their upload had left.
        self._unanswered: dict[str, Sent] = {}
        self._answer_s: collections.deque[float] = collections.deque(
            [prior(plans, "device-edge").rtt_s], maxlen=ANSWER_TIMES_KEPT
        )
        self._probe_switch: str | None = None  # a switch an idle probe made, not yet named
        self.prober: IdleProber | None = None
        if self.selector is not None and stream is not None and idle_probe_s is not None:
            self.prober = IdleProber(
                stream.channel,
                busy=lambda: stream.in_flight() > 0,
                rate=lambda: self.estimators["device-edge"].estimate().rate_bps,
                report=self._probed,
                shaper=stream.shaper,
                idle_s=idle_probe_s,
            )
            self.prober.start()

    def close(self) -> None:
        if self.prober is not None:
            self.prober.close()

    def choose(self) -> tuple[int, str | None]:
        """The plan for the next request and why it changed, if it did."""
        if self.selector is None:
            return self.plans.default, None
        now = time.monotonic()
        fetch = self.fetch_bytes()
        with self._lock:
            self._bound_by_unanswered(now)
            links = {link: e.estimate() for link, e in self.estimators.items()}
            backlog = self._backlog(now, links["device-edge"].rate_bps)
            bounded = self.estimators["device-edge"].bounded
            choice = self.selector.choose(now, links, fetch, backlog, bounded)
            if choice.reason:
                logger.info("[device] switching plans: %s", choice.reason)
            reason = choice.reason or None
            if self._probe_switch is not None:
                reason, self._probe_switch = reason or self._probe_switch, None
            return choice.index, reason

    def closest(self, candidates: list[int]) -> int:
        """Of plan indices ``candidates``, the one closest to the link estimates."""
        if self.selector is None:
            return candidates[0]
        with self._lock:
            links = {link: e.estimate() for link, e in self.estimators.items()}
        distances = self.selector.distances(links)
        return min(candidates, key=lambda i: (distances[i], i))

    def fetch_bytes(self) -> list[int]:
        """Per plan, the bytes of device segments to fetch before it can run."""
        return [
            self.segments.missing_bytes(tier_files(self.plans, index, "device"))
            for index in range(len(self.plans.plans))
        ]

    def touch(self) -> None:
        """The link is in use (an idle probe is not needed now)."""
        if self.prober is not None:
            self.prober.touch()

    def demand(self) -> None:
        """A request ran on the device alone, on an estimate no transfer can refresh."""
        if self.prober is not None:
            self.prober.demand()

    def sent(self, sent: Sent) -> None:
        """A request left for the edge: watch it until it is answered."""
        self.touch()
        with self._lock:
            self._unanswered[sent.wire_id] = sent
        sent.future.add_done_callback(functools.partial(self._observe, sent))

    def _observe(self, sent: Sent, future: Future[tier_pb2.Reply]) -> None:
        """Feed the link estimators from an answered request's transfers (passive)."""
        self.touch()
        now = time.monotonic()
        with self._lock:
            self._unanswered.pop(sent.wire_id, None)
        if future.cancelled() or future.exception() is not None:
            return
        reply = future.result()
        stats = [sent.transfer.stat("device-edge"), *reply.links]
        with self._lock:
            if sent.transfer.handed and sent.transfer.left is not None:
                self._answer_s.append(max(now - sent.transfer.left, 0.0))
            for stat in stats:
                estimator = self.estimators.get(stat.link)
                if estimator is not None and stat.rate_bps > 0:
                    estimator.observe(now, stat.bytes, stat.send_ms / 1e3)
        self._on_answer(reply)

    def candidate(self) -> tuple[int, int | None]:
        """The plan in use, and the one the selector is about to switch to (if any)."""
        if self.selector is None:
            return self.plans.default, None
        with self._lock:
            return self.selector.current, self.selector.candidate

    def _probed(self, now: float, nbytes: int, seconds: float, rtt_s: float) -> None:
        """An idle probe's measurement of the device-edge link ([Note: idle probes])."""
        fetch = self.fetch_bytes()
        with self._lock:
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

        See [Note: a backlog on the link] in device/switching.py: from what the
        device handed to the link, when, and whether it has begun to cross by ``now``, at
        the estimated rate. Call with ``_lock`` held.
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

        See [Note: censored rate evidence]; call with ``_lock`` held.
        """
        in_flight: list[tuple[int, float]] = []
        for sent in self._unanswered.values():
            if sent.transfer.started is not None:  # it has begun to cross
                in_flight.append((sent.transfer.nbytes, sent.transfer.started))
        ceiling = rate_ceiling(now, in_flight, ANSWER_MARGIN * max(self._answer_s))
        self.estimators["device-edge"].bound(ceiling)
