"""Which plan of a set to use for the next request: link estimates and a choice with hysteresis.

A plan set (``tierflow plan --adaptive``, :class:`~tierflow.plan.PlanSet`) holds plans
and, for each, the grid of link conditions where it is best. The device keeps an
estimate of each link from the transfers it sees (:class:`LinkEstimator`) and asks a
:class:`PlanSelector` which plan suits the estimate. Both take the time as an argument
and read no clock, so they are deterministic and a test replays any history.

[Note: switching with hysteresis]
Near the border between two regions a noisy estimate would flip the choice back and
forth, and every switch can cost (a segment fetched, a cold session). The selector
therefore measures how far the estimate is from each plan's region, in decades of rate
(log10; RTTs in log10 of milliseconds, with 1 ms added so that 0 is allowed), and moves
off the current plan only when another plan's region is closer by more than ``margin``
(0.1 decade: about 26% in rate) and has stayed the better one for ``hold_s`` seconds.
The estimate itself is an exponentially weighted mean over time (half-life
``half_life_s``), so one odd transfer moves it a little and a lasting change fully
(sooner after a clear one: [Note: a change detector in the estimate]).
The hold guards a border; when the estimate lies ``far`` (a decade) or more outside
the current plan's whole region, the link has changed tenfold past anything that plan
was chosen for, there is no border near to flap across, and every request held back
runs on a plan far from its best (the adaptation benchmark's 200 -> 2 Mbit/s step queued
seconds of 147 KiB uploads during a 0.5 s hold). The hold is then ``far_hold_s`` (0.1 s),
so the estimate must still stay there across two choices. The hold counts from when the
current plan stopped being the clear choice, even if the plan that beats it changes
meanwhile: an estimate falling a hundredfold crosses several regions on its way down
(the bounds of [Note: censored rate evidence] fall as the slow uploads wait), and a hold
restarted at each would keep the device on the plan that fits worst of all.

The hold also shortens with what staying costs ([Note: a hold priced by the cost
model]), and a censored bound ends it at once ([Note: a bound needs no second look]).

A switch may cost a fetch: a plan whose device segments are not held locally needs them
from the edge first ([Note: segments on demand] in tierflow/runtime/segment_store.py). The caller
passes, per plan, the bytes it would fetch (``plan.json`` records each segment's size),
and the other plan must then stay the better one for ``hold_s`` plus the time that fetch
takes at the estimated device-edge rate. Meanwhile the device fetches those segments in
the background (the selector's :attr:`~PlanSelector.candidate` names the plan), so a
lasting change switches once they are here, and a brief one costs no switch at all.

[Note: a hold priced by the cost model]
A hold is time on a plan the estimate already says is worse; every request sent
meanwhile pays the difference. So the selector prices the wait with the cost model's
figures in ``plan.json`` (:func:`predicted_s` at the estimated links): at each choice
during a hold it adds up the current plan's predicted excess over the candidate's, as a
fraction of the candidate's latency, times the time since the previous choice (the
smaller of the two excesses seen at either end, so one odd estimate adds nothing). Once
that loss reaches ``costly`` times ``hold_s`` (0.05 x 0.5 s), the hold ends at
``far_hold_s`` (the estimate still confirmed by two choices). A plan predicted at most
5% slower keeps the full hold; 10% slower, half of it; from 25%, the short hold. In the
adaptation benchmark's MobileNetV2 runs on the bursty traces (before this pricing, in
commit 0ddb8a8's results), over half the requests
sent on another plan than the true rate's (30 of 52 and 30 of 61) were held there after
the estimate had moved into the right region, or sat on the device-only plan while it
climbed out of that plan's, at a median 1.2x the oracle's latency and up to 2.1x (a
fade to 1.3 Mbit/s found the device uploading 23 KiB per request for 0.6 s). Priced, the
requests on another plan than the device's own estimate gave fell from 37 and 38 (+8.2
and +8.1 ms per answered request over the oracle) to 25 and 26 (+2.9 and +2.1 ms) in the
next full run (``benchmarks/results/ADAPTATION.md``, "gap per answered request"). This does
not make the selector flap: flapping needs each of two plans to look the slower one on
its side of the margin, and the cost model prices both sides alike, so near where
their predictions cross the excess is small and the hold full; where one plan is much
slower, it is so on both sides of the border, and only a switch away from it is quick.
A plan without the cost model's figures keeps the full hold.

[Note: a bound needs no second look]
The short hold still waits for a second choice, because one estimate from transfers may
be an odd one that the next transfers take back. A censored bound is not
([Note: censored rate evidence]): an upload still unanswered has shown that the link is
slower than the bound, and only its answer can lift the bound. And when the current
plan sends more bytes over device-edge than the candidate, it loses more than the
candidate at every rate below the bound, so the excess priced at the bound is the least
that staying costs. So when the device-edge estimate is a bound (``bounded``), the
current plan sends more over that link, and the excess there is one the priced hold
would act on within the short hold (``excess * far_hold_s`` reaches ``costly * hold_s``:
25% with the defaults), the selector switches at the first choice. In the adaptation
benchmark's MobileNetV2 step from 200 to 2 Mbit/s (commit 7fb389a's results), the
request after the step's first waited 0.2 s later on the raw 147 KiB plan although the
bound already put the link at 11.5 Mbit/s, where that plan is predicted 60% slower; it
took 1066 ms, where the device-only plan takes about 130. If the bound was wrong (a tier
slower than its recent answers, not the link), the upload's answer lifts it and the
plans' regions bring the device back after the full hold.

[Note: a change detector in the estimate]
The estimate's half-life smooths noisy transfers, but after a real change of rate it
takes several transfers to follow: each moves it halfway in log space (one every 0.2 s
in the adaptation benchmark), so a fivefold drop is still 50% off after two. Two
transfers in a row that are both more than ``jump`` (2x) off the estimate, the same
way, are taken as a change, not noise, and the second replaces the estimate: one odd
transfer still moves it only its half-life's share, and noise that scatters both ways
never restarts it.

[Note: censored rate evidence]
The estimate learns from transfers only once they are answered. When the link slows a
hundredfold, the uploads already on it (147 KiB each in the adaptation benchmark, a few
in flight) are answered a second or more later, and every request sent meanwhile is
chosen on the old rate. A transfer still unanswered is evidence too: if it began to
cross ``t`` seconds ago and an answer takes ``answer_s`` once a request has crossed (the
round trip and the tiers' work, as recent answers showed), then its ``n`` bytes have
not crossed in ``t - answer_s`` seconds, so the rate is below ``8 n / (t - answer_s)``
(:func:`rate_ceiling`). The bound says nothing until ``t`` exceeds the transfer's
expected time at the estimated rate plus ``answer_s``; from then on it falls as the wait
grows. It is a censored observation, not a measurement: the estimator keeps it apart
(:meth:`LinkEstimator.bound`) and reports the lower of it and its mean of completed
transfers, so it can only lower the estimate, and once those transfers are answered
their own measurement counts as any other. The device recomputes the bound before each
choice from the requests then in flight, so a bound lasts only while its evidence does.

[Note: a backlog on the link]
The regions price one request on an idle link. When the link slows under a stream of
requests, the uploads already handed to it stay queued (the adaptation benchmark's step
to 2 Mbit/s left a few 147 KiB uploads, seconds of them, ahead of every later request),
and a plan chosen for the new rate still waits behind them: a plan whose upload takes
longer than the time between requests even adds to the queue with each one. The device
knows what it handed to the link, when, and whether it has begun to cross, so it
estimates how long the link's sender needs to send what is still queued
(:func:`backlog_s`): the requests not answered yet, played through a first-in first-out
queue at the estimated rate (which [Note: censored rate evidence] already lowers when
uploads are overdue), where an upload that has not begun to cross shows the link still
busy with those before it, whatever the rate says. Every plan that sends over the
device-edge link waits that long first; a plan that sends nothing does not. So while a
backlog lasts, the selector compares the plan it would use, its predicted latency at the
estimated links (:func:`predicted_s`, the cost model's figures in ``plan.json`` rescaled
to the estimated rates) plus the backlog, with each plan that keeps off the link, and
runs the request on the fastest of those when it is faster. That is a detour, not a
switch: the plan the regions chose stays current, and the next request with no backlog
(or one short enough) goes back to it, so the link drains while the device answers
alone, and a plan too slow for the rate is interleaved with local answers instead of
building an ever longer queue. Plans whose device files would have to be fetched first
(over the backlogged link) are not detoured to.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from tierflow.errors import UsageError
from tierflow.link.spec import LINKS, LinkSpec
from tierflow.plan import Plan, PlanSet
from tierflow.transport.wire import MAX_FIGURE_BPS, MAX_FIGURE_BYTES, MAX_FIGURE_MS

#: Decades of rate (or of RTT in ms) by which another region must be closer to switch.
DEFAULT_MARGIN = 0.1
#: Seconds another plan must stay the better one before the selector switches to it.
DEFAULT_HOLD_S = 0.5
#: Decades outside the current plan's region from which the shorter hold applies.
DEFAULT_FAR = 1.0
#: The hold, in seconds, when the estimate is that far from the current plan's region.
DEFAULT_FAR_HOLD_S = 0.1
#: The predicted excess of the current plan (a fraction of the candidate's latency) held
#: for ``hold_s`` that ends a hold ([Note: a hold priced by the cost model]).
DEFAULT_COSTLY = 0.05
#: Half-life of a link estimate's memory, in seconds: short enough that a 100x step in
#: rate is tracked within 20% after 1 s (in log space, 100 ** 0.5 ** 5 < 1.2).
DEFAULT_HALF_LIFE_S = 0.2
#: Two transfers in a row this many times off the estimate, the same way, are a change of
#: rate ([Note: a change detector in the estimate]).
DEFAULT_JUMP = 2.0


#: The slowest rate a transfer may show and still count as evidence of a link's rate.
MIN_RATE_BPS = 1.0


class LinkEstimator:
    """A link's rate and RTT as recent transfers show them (time-weighted mean).

    :meth:`observe` a transfer of ``nbytes`` that took ``seconds`` on the wire (transfer
    time only: queueing at either end would make the link look slower than it is).
    Rates are averaged in log space: a transfer 100x slower than the rest moves the
    estimate as much as one 100x faster would, and neither swamps it. Two in a row
    ``jump`` times off the same way restart it ([Note: a change detector in the
    estimate]; None: never).
    """

    def __init__(
        self,
        prior: LinkSpec,
        half_life_s: float = DEFAULT_HALF_LIFE_S,
        jump: float | None = DEFAULT_JUMP,
    ) -> None:
        if not half_life_s > 0:
            raise UsageError(f"an estimate's half-life must be positive, got {half_life_s!r}")
        if jump is not None and not jump > 1:
            raise UsageError(f"a change detector's factor must exceed 1, got {jump!r}")
        self.half_life_s = half_life_s
        self.jump = jump
        self._off = 0  # -1 / +1: the last transfer was ``jump`` times below / above, else 0
        self._log_rate = math.log(prior.rate_bps)
        self._rtt_s = prior.rtt_s
        self._at: float | None = None
        self._rtt_at: float | None = None
        self._ceiling_bps: float | None = None

    def _weight(self, since: float | None, now: float) -> float:
        """The weight of a new observation against what is known from ``since``."""
        if since is None:
            return 1.0
        return 1.0 - 0.5 ** (max(now - since, 0.0) / self.half_life_s)

    def observe(self, now: float, nbytes: int, seconds: float) -> None:
        """A transfer of ``nbytes`` bytes that spent ``seconds`` on the link, seen at ``now``.

        A transfer outside physical bounds is ignored: more than
        :data:`~tierflow.transport.wire.MAX_FIGURE_BYTES` bytes, longer than a day, or a
        rate outside [:data:`MIN_RATE_BPS`, :data:`~tierflow.transport.wire.MAX_FIGURE_BPS`]
        (a tier's reply reporting 2^62 bytes once moved the device's estimate).
        """
        if not 0 < nbytes <= MAX_FIGURE_BYTES or not 0 < seconds <= MAX_FIGURE_MS / 1e3:
            return
        if not MIN_RATE_BPS <= nbytes * 8.0 / seconds <= MAX_FIGURE_BPS:
            return
        # At least a tenth of full weight: a burst of transfers at one instant still counts.
        weight = max(self._weight(self._at, now), 0.1)
        residual = math.log(nbytes * 8.0 / seconds) - self._log_rate
        off = 0
        if self.jump is not None and abs(residual) > math.log(self.jump):
            off = 1 if residual > 0 else -1
        if off and off == self._off:  # the second in a row: the link changed, not noise
            weight = 1.0
        self._off = off
        self._log_rate += weight * residual
        self._at = now

    def observe_rtt(self, now: float, rtt_s: float) -> None:
        """A round trip (a probe's, say) of ``rtt_s`` seconds, seen at ``now`` (ignored
        unless within a day)."""
        if not 0 <= rtt_s <= MAX_FIGURE_MS / 1e3:
            return
        weight = max(self._weight(self._rtt_at, now), 0.1)
        self._rtt_s += weight * (rtt_s - self._rtt_s)
        self._rtt_at = now

    def bound(self, ceiling_bps: float | None) -> None:
        """The rate is at most ``ceiling_bps``, as transfers still in flight show (None:
        they show nothing); replaces the previous bound ([Note: censored rate evidence])."""
        valid = ceiling_bps is not None and 0 < ceiling_bps < math.inf
        self._ceiling_bps = ceiling_bps if valid else None

    def measured(self) -> LinkSpec:
        """The estimate from completed transfers alone, without any bound."""
        return LinkSpec(math.exp(self._log_rate), self._rtt_s)

    @property
    def bounded(self) -> bool:
        """Whether :meth:`estimate` is the bound, below the mean of completed transfers."""
        return self._ceiling_bps is not None and self._ceiling_bps < self.measured().rate_bps

    def estimate(self) -> LinkSpec:
        measured = self.measured()
        if self._ceiling_bps is None or self._ceiling_bps >= measured.rate_bps:
            return measured
        return LinkSpec(self._ceiling_bps, self._rtt_s)


def rate_ceiling(
    now: float, in_flight: Iterable[tuple[int, float]], answer_s: float
) -> float | None:
    """The tightest upper bound on a link's rate that unanswered transfers give.

    ``in_flight``: (bytes, when the transfer began to cross the link) of each request
    sent on the link and not answered by ``now``; ``answer_s``: how long an answer takes
    once a request has crossed. None when no transfer has been out long enough to tell
    anything ([Note: censored rate evidence]).
    """
    bounds = [
        nbytes * 8.0 / (now - started - answer_s)
        for nbytes, started in in_flight
        if nbytes > 0 and now - started > answer_s
    ]
    return min(bounds, default=None)


def backlog_s(
    now: float, queued: Iterable[tuple[int, float, float | None]], rate_bps: float
) -> float:
    """Seconds the link's sender still needs for what was handed to it, at ``rate_bps``.

    ``queued``: (bytes, when the request was handed to the link, when it began to cross
    or None if it has not by ``now``) of each request not answered by ``now``. They cross
    one after another, first in first out, at the estimated rate, each from when it began
    to (if it has), else from when the one before it is done and not before ``now``: one
    that has not begun means the link is still busy with those before it ([Note: a
    backlog on the link]). 0 when all of it has crossed by now.
    """
    if not rate_bps > 0:
        return 0.0
    free = -math.inf
    for nbytes, handed, started in sorted(queued, key=lambda item: item[1]):
        start = started if started is not None else max(free, handed, now)
        free = start + max(nbytes, 0) * 8.0 / rate_bps
    return max(free - now, 0.0)


def predicted_s(plan: Plan, links: Mapping[str, LinkSpec]) -> float | None:
    """The cost model's latency for ``plan`` at the rates of ``links`` (seconds).

    ``plan.json`` records the prediction at the plan's own links and each link's time on
    the wire there; the wire time scales inversely with the rate, the rest is kept (the
    RTT too). None when the plan records no prediction (an old or hand-written plan).
    """
    latency = plan.estimate.get("latency_s")
    if not isinstance(latency, (int, float)) or not math.isfinite(latency):
        return None
    costs = plan.estimate.get("links")
    total = float(latency)
    for name, cost in (costs if isinstance(costs, dict) else {}).items():
        wire = cost.get("wire_s") if isinstance(cost, dict) else None
        if name not in links or name not in plan.links or not isinstance(wire, (int, float)):
            continue
        if wire > 0 and links[name].rate_bps > 0:
            total += wire * (plan.links[name].rate_bps / links[name].rate_bps - 1.0)
    return total


def _device_edge_bits(plan: Plan) -> float | None:
    """The bits ``plan`` sends over device-edge by the cost model's figures (None: not
    recorded): its wire time there at the plan's own rate."""
    costs = plan.estimate.get("links")
    if not isinstance(costs, dict):
        return None
    cost = costs.get("device-edge")
    wire = cost.get("wire_s") if isinstance(cost, dict) else 0.0  # no cost: sends nothing
    if not isinstance(wire, (int, float)):
        return None
    if wire <= 0:
        return 0.0
    link = plan.links.get("device-edge")
    return float(wire) * link.rate_bps if link is not None else None


def _sends_on_device_edge(plan: Plan) -> bool:
    """Whether a request on ``plan`` crosses the device-edge link (it leaves the device)."""
    return any(segment.tier != "device" for segment in plan.segments)


def _distance(point: Mapping[str, LinkSpec], links: Mapping[str, LinkSpec]) -> float:
    """How far two link conditions are apart, in decades (see the note)."""
    total = 0.0
    for name in LINKS:
        if name not in point or name not in links:
            continue
        total += (math.log10(point[name].rate_bps) - math.log10(links[name].rate_bps)) ** 2
        total += (
            math.log10(point[name].rtt_s * 1e3 + 1) - math.log10(links[name].rtt_s * 1e3 + 1)
        ) ** 2
    return math.sqrt(total)


@dataclass(frozen=True)
class Choice:
    """The plan for the next request; ``reason`` says why it changed (empty if it did not).

    ``switched``: the selector's current plan changed. ``detour``: the request runs on a
    plan that keeps off a backlogged link instead ([Note: a backlog on the link]).
    """

    index: int
    switched: bool
    reason: str = ""
    detour: bool = False


class PlanSelector:
    """Picks a plan of ``plans`` for estimated links ([Note: switching with hysteresis]).

    ``costly``: see [Note: a hold priced by the cost model] (None: holds ignore the cost).

    Starts on the set's default plan. Not thread-safe: one caller (the device's sender).
    """

    def __init__(
        self,
        plans: PlanSet,
        *,
        margin: float = DEFAULT_MARGIN,
        hold_s: float = DEFAULT_HOLD_S,
        far: float = DEFAULT_FAR,
        far_hold_s: float = DEFAULT_FAR_HOLD_S,
        costly: float | None = DEFAULT_COSTLY,
    ) -> None:
        if not margin >= 0 or not hold_s >= 0:
            raise UsageError(f"margin and hold must not be negative, got {margin}, {hold_s}")
        if not far > margin or not far_hold_s >= 0:
            raise UsageError(
                f"'far' must exceed the margin and its hold must not be negative, got {far}, "
                f"{far_hold_s}"
            )
        self.plans = plans
        self.margin = margin
        self.hold_s = hold_s
        self.far = far
        self.far_hold_s = min(far_hold_s, hold_s)
        if costly is not None and not costly > 0:
            raise UsageError(f"'costly' must be positive (or None), got {costly!r}")
        self.costly = costly
        self.current = plans.default
        self._candidate: int | None = None
        self._since = 0.0
        # [Note: a hold priced by the cost model]: the predicted loss of staying since
        # _since (seconds times a fraction), and the excess last seen, at _seen.
        self._loss = 0.0
        self._excess_seen = 0.0
        self._seen = 0.0
        self._sends = [_sends_on_device_edge(plan) for plan in plans.plans]
        self._bits = [_device_edge_bits(plan) for plan in plans.plans]
        self._detour: int | None = None  # the plan of the detour under way, if any

    def distances(self, links: Mapping[str, LinkSpec]) -> list[float]:
        """Per plan, how far ``links`` are from its region (inf for a plan without one)."""
        return [
            min((_distance(point, links) for point in region), default=math.inf)
            for region in self.plans.regions
        ]

    @property
    def candidate(self) -> int | None:
        """The plan the selector is waiting to switch to (its hold not over yet), if any."""
        return self._candidate

    @property
    def detour(self) -> int | None:
        """The plan the last choice detoured to from a backlogged link, if it did."""
        return self._detour

    def choose(
        self,
        now: float,
        links: Mapping[str, LinkSpec],
        fetch_bytes: Sequence[int] = (),
        backlog: float = 0.0,
        bounded: bool = False,
    ) -> Choice:
        """The plan for a request sent at ``now`` over links estimated as ``links``.

        ``fetch_bytes[i]``: bytes the device must fetch before plan ``i`` can run (none
        if not given); they lengthen the hold before a switch to it (see the note).
        ``backlog``: seconds the device-edge link still needs for what is queued on it
        (:func:`backlog_s`); a request may then run on a plan that keeps off the link
        ([Note: a backlog on the link]).
        ``bounded``: the device-edge estimate is a censored bound ([Note: a bound needs no
        second look]).
        """
        choice = self._by_region(now, links, fetch_bytes, bounded)
        detour = self._off_the_link(choice.index, links, fetch_bytes, backlog)
        if detour is not None:
            index, reason = detour
            if index == self._detour:
                reason = ""  # the same detour goes on: named at its first request
            self._detour = index
            return Choice(index, choice.switched, choice.reason or reason, detour=True)
        if self._detour is not None and not choice.reason:
            back = self._detour != choice.index
            self._detour = None
            if back:
                reason = f"the device-edge backlog has drained: back to plan {choice.index}"
                return Choice(choice.index, choice.switched, reason)
        self._detour = None
        return choice

    def _off_the_link(
        self,
        index: int,
        links: Mapping[str, LinkSpec],
        fetch_bytes: Sequence[int],
        backlog: float,
    ) -> tuple[int, str] | None:
        """A plan that keeps off the backlogged link and beats ``index`` waiting for it.

        ([Note: a backlog on the link].) With the reason; None when there is none.
        """
        if not backlog > 0 or not self._sends[index]:
            return None
        plans = self.plans.plans
        waiting = predicted_s(plans[index], links)
        if waiting is None:
            return None
        waiting += backlog
        best: tuple[float, int] | None = None
        for other, plan in enumerate(plans):
            if self._sends[other] or (other < len(fetch_bytes) and fetch_bytes[other] > 0):
                continue
            alone = predicted_s(plan, links)
            if alone is not None and alone < waiting and (best is None or alone < best[0]):
                best = (alone, other)
        if best is None:
            return None
        alone, other = best
        rate = links.get("device-edge")
        reason = (
            f"backlog: uploads queued on device-edge need {backlog * 1e3:.0f} ms more"
            + (f" at {rate}" if rate is not None else "")
            + f"; plan {index} would answer in {waiting * 1e3:.0f} ms behind them, plan "
            f"{other} keeps off the link in {alone * 1e3:.0f} ms (until the queue drains)"
        )
        return other, reason

    def _excess(self, best: int, links: Mapping[str, LinkSpec]) -> float:
        """How much slower the cost model predicts the current plan than ``best`` at
        ``links``, as a fraction of ``best``'s latency (0 when it cannot tell)."""
        plans = self.plans.plans
        stay, move = predicted_s(plans[self.current], links), predicted_s(plans[best], links)
        if stay is None or move is None or not move > 0:
            return 0.0
        return max(stay / move - 1.0, 0.0)

    def _sends_more(self, best: int) -> bool:
        """Whether the current plan sends more over device-edge than ``best`` (by the
        cost model's figures; False when either records none)."""
        stay, move = self._bits[self.current], self._bits[best]
        return stay is not None and move is not None and stay > move

    def _by_region(
        self,
        now: float,
        links: Mapping[str, LinkSpec],
        fetch_bytes: Sequence[int],
        bounded: bool,
    ) -> Choice:
        """The plan whose region fits ``links``, with hysteresis (see the note)."""
        distances = self.distances(links)
        best = min(range(len(distances)), key=lambda i: (distances[i], i))
        if best == self.current or not math.isfinite(distances[best]):
            self._candidate = None
            return Choice(self.current, False)
        if distances[self.current] - distances[best] <= self.margin:
            self._candidate = None  # not clearly better: stay
            return Choice(self.current, False)
        excess = self._excess(best, links)
        if self._candidate is None:  # the current plan stops being the clear choice now
            self._since, self._loss = now, 0.0
        else:  # at the smaller of the excesses seen at both ends
            self._loss += min(self._excess_seen, excess) * max(now - self._seen, 0.0)
        self._excess_seen, self._seen = excess, now
        self._candidate = best
        fetch_s = 0.0
        if best < len(fetch_bytes) and fetch_bytes[best] > 0 and "device-edge" in links:
            fetch_s = fetch_bytes[best] * 8.0 / links["device-edge"].rate_bps
        costly = self.costly is not None and self._loss >= self.costly * self.hold_s
        hold = self.far_hold_s if distances[self.current] >= self.far or costly else self.hold_s
        if (  # [Note: a bound needs no second look]
            bounded
            and self.costly is not None
            and excess * self.far_hold_s >= self.costly * self.hold_s
            and self._sends_more(best)
        ):
            hold = 0.0
        if now - self._since < hold + fetch_s:
            return Choice(self.current, False)
        before, self.current, self._candidate = self.current, best, None
        seen = ", ".join(f"{name} {links[name]}" for name in LINKS if name in links)
        reason = f"links now {seen}: plan {best} fits them better than plan {before}"
        return Choice(best, True, reason)
