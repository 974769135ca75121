"""What the adaptation benchmark computes from its runs: the oracle, summaries, the verdict.

Pure: runs come in as lists of :class:`Sample` (one per request, times in seconds from
the trace's start), results go out as plain dicts for ``adaptation.json``.

[Note: the per-request oracle]
Every static plan of a set runs on the same trace, with the same request schedule
(request ``i`` is due at ``i * period`` seconds). For a moment ``t``, plan ``p``'s
measured latency ``L_p(t)`` is the latency of the last request ``p``'s run sent at or
before ``t`` (its first request's before that). The oracle sends a request at every
scheduled time ``t_i`` of the trace, runs it on the plan that was fastest for the link
at that moment, and answers it in that plan's ``L_p(t_i)``: chosen in hindsight, with
every plan's real measurement under the same link, queueing included, and never paying
for a switch. "Fastest at that moment" is the lowest median of ``p``'s latencies for
requests sent within ``window_s`` (1 s) of ``t_i`` while the link held the rate it had
at ``t_i``: the plan's speed on that rate, not the luck of one request. Taking the
minimum of single requests instead (``window_s=None``, reported as "oracle (per-request
minimum)") also picks each plan's lucky requests out of the machine's noise, a bound no
policy that knows the link, but not the noise, can reach.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Sample:
    """One request: sent at ``sent_s``, answered ``latency_ms`` later (None: it failed)."""

    sent_s: float
    latency_ms: float | None
    plan: str | None = None


def summary(latencies: Sequence[float]) -> dict[str, float | int | None]:
    """Mean, p50 and p95 of ``latencies`` (ms) and how many there were."""
    if not latencies:
        return {"requests": 0, "mean_ms": None, "p50_ms": None, "p95_ms": None}
    values = np.asarray(latencies, dtype=np.float64)
    return {
        "requests": len(values),
        "mean_ms": float(values.mean()),
        "p50_ms": float(np.percentile(values, 50)),
        "p95_ms": float(np.percentile(values, 95)),
    }


def latency_at(samples: Sequence[Sample], t: float) -> float | None:
    """``L_p(t)`` of [Note: the per-request oracle] for one plan's run."""
    answered = [s for s in samples if s.latency_ms is not None]
    if not answered:
        return None
    times = [s.sent_s for s in answered]
    index = max(bisect.bisect_right(times, t) - 1, 0)
    return answered[index].latency_ms


def oracle(
    runs: Mapping[str, Sequence[Sample]],
    period_s: float,
    duration_s: float,
    *,
    changes: Sequence[float] = (),
    window_s: float | None = 1.0,
) -> list[Sample]:
    """The oracle's requests ([Note: the per-request oracle]); ``plan`` names the winner.

    ``runs`` maps each static plan to its samples in send order; ``changes`` are the
    times the link's rate changes. Ties go to the plan named first in ``runs``.
    """
    if not period_s > 0:
        raise ValueError(f"the period must be positive, got {period_s}")
    out: list[Sample] = []
    bounds = sorted(changes)
    for i in range(math.ceil(duration_s / period_s - 1e-9)):
        t = i * period_s
        held = bisect.bisect_right(bounds, t)
        low = max(t - (window_s or 0.0), bounds[held - 1] if held else -math.inf)
        high = min(t + (window_s or 0.0), bounds[held] if held < len(bounds) else math.inf)
        best: tuple[float, float, str] | None = None
        for name, samples in runs.items():
            latency = latency_at(samples, t)
            if latency is None:
                continue
            speed = latency
            if window_s is not None:
                near = [
                    s.latency_ms
                    for s in samples
                    if s.latency_ms is not None and low <= s.sent_s < high
                ]
                speed = float(np.median(near)) if near else latency
            if best is None or speed < best[0]:
                best = (speed, latency, name)
        if best is not None:
            out.append(Sample(t, best[1], best[2]))
    return out


def replay(
    runs: Mapping[str, Sequence[Sample]],
    choose: Callable[[float], str],
    period_s: float,
    duration_s: float,
) -> list[Sample]:
    """A policy that runs plan ``choose(t)`` at every scheduled time, priced like the oracle.

    With ``choose`` the planner's plan for the true rate at ``t`` this is adaptation with a
    perfect estimate: what the plan set's regions are worth without any estimation error.
    """
    out = []
    for i in range(math.ceil(duration_s / period_s - 1e-9)):
        t = i * period_s
        plan = choose(t)
        out.append(Sample(t, latency_at(runs[plan], t), plan))
    return out


def silent_stretch(records: Sequence[Mapping[str, Any]]) -> tuple[float, float]:
    """The longest time (start, seconds) requests in a row sent nothing over device-edge.

    ``records`` are the adaptive run's requests in send order (``sent_s``, ``ok``,
    ``bytes_device_edge``). While nothing crosses, a passive estimate cannot move.
    """
    best = (0.0, 0.0)
    start: float | None = None
    for record in records:
        quiet = record["ok"] and record["bytes_device_edge"] == 0
        if quiet and start is None:
            start = record["sent_s"]
        if start is not None:
            if quiet:
                best = max(best, (record["sent_s"] - start, start))
            else:
                start = None
    return best[1], best[0]


def gap_parts(
    records: Sequence[Mapping[str, Any]],
    oracle_samples: Sequence[Sample],
    planned_at: Callable[[float], str],
    period_s: float,
    estimated_at: Callable[[float], str | None] | None = None,
) -> dict[str, Any]:
    """Where the adaptive run's time over the oracle's went, in ms per answered request.

    Each request of ``records`` (the adaptive run: ``index``, ``sent_s``, ``ok``,
    ``latency_ms``, ``plan``, ``link_queue_ms``) is compared with the oracle's request at
    the same scheduled time (``index * period_s``); its excess is split into the time it
    waited behind earlier uploads on the device-edge link (``backlog``), and the rest,
    counted as ``choice`` when it ran on another plan than the set's regions give for the
    true rate at ``sent_s`` (``planned_at``: estimate lag, the hold, detours off a
    backlogged link) and as ``other`` when it ran on that plan (the regions against the
    oracle, and noise).
    The three parts add up to ``excess``, the mean difference over the compared requests.
    With ``estimated_at`` (the plan the regions give for the device's own estimate at a
    time), ``choice`` splits further: ``lag``, the requests on the plan the estimate
    gave (the estimate was off), and ``held``, those on another (the hold kept the
    previous plan, or a detour left the link).
    """
    by_index = {round(s.sent_s / period_s): s for s in oracle_samples}
    parts = {"backlog": 0.0, "choice": 0.0, "other": 0.0}
    split = {"lag": 0.0, "held": 0.0}
    counts = {"lag": 0, "held": 0}
    compared = off_plan = 0
    for record in records:
        oracle_ = by_index.get(record["index"])
        if not record["ok"] or oracle_ is None or oracle_.latency_ms is None:
            continue
        compared += 1
        excess = record["latency_ms"] - oracle_.latency_ms
        waited = float(record.get("link_queue_ms") or 0.0)
        parts["backlog"] += waited
        if record["plan"] != planned_at(record["sent_s"]):
            off_plan += 1
            parts["choice"] += excess - waited
            if estimated_at is not None:
                why = "lag" if record["plan"] == estimated_at(record["sent_s"]) else "held"
                split[why] += excess - waited
                counts[why] += 1
        else:
            parts["other"] += excess - waited
    if not compared:
        return {"compared": 0}
    out: dict[str, Any] = {k: v / compared for k, v in parts.items()}
    out["excess"] = sum(out.values())
    out.update(compared=compared, off_plan=off_plan)
    if estimated_at is not None:
        out.update({f"choice_{k}": v / compared for k, v in split.items()})
        out.update({f"off_{k}": v for k, v in counts.items()})
    return out


def estimate_errors(
    points: Sequence[tuple[float, float, float, float]], settle_s: float = 1.0
) -> dict[str, Any]:
    """How far the rate estimate was from the true rate once the rate had held ``settle_s``.

    ``points`` are ``(t, estimated_bps, true_bps, settled_s)``: the estimate at ``t``,
    the trace's rate then, and how long that rate had held. Only points with
    ``settled_s >= settle_s`` count; the error is ``|estimate / true - 1|``.
    """
    errors = [abs(est / true - 1.0) for _, est, true, held in points if held >= settle_s]
    if not errors:
        return {"settle_s": settle_s, "points": 0, "within_20pct": None}
    values = np.asarray(errors)
    return {
        "settle_s": settle_s,
        "points": len(errors),
        "median": float(np.median(values)),
        "p95": float(np.percentile(values, 95)),
        "max": float(values.max()),
        "within_20pct": float(np.mean(values <= 0.2)),
    }


def estimate_misses(
    points: Sequence[tuple[float, float, float, float]],
    upload_bytes: int,
    settle_s: float = 1.0,
    holds: Sequence[tuple[float, float, float]] = (),
) -> list[dict[str, float]]:
    """Where the estimate was off by more than 20% once settled, per true rate.

    ``points`` as :func:`estimate_errors` takes them; ``upload_bytes`` is the largest
    upload the run sent; ``holds`` are the trace's (start, end, rate) spans. Each entry:
    the true rate (Mbit/s), how many samples missed there, how long one such upload takes
    at that rate (a passive estimate learns from completed uploads, so none can be right
    sooner), and, with ``holds``, how long the rate held there (the longest such span).
    """
    missed: dict[float, int] = {}
    for _, estimate, true, held in points:
        if held >= settle_s and abs(estimate / true - 1.0) > 0.2:
            missed[true] = missed.get(true, 0) + 1
    out: list[dict[str, float]] = []
    for true, count in sorted(missed.items()):
        miss = {"true_mbit": true / 1e6, "samples": count, "upload_s": upload_bytes * 8.0 / true}
        spans = [end - start for start, end, rate in holds if rate == true]
        if spans:
            miss["held_s"] = max(spans)
        out.append(miss)
    return out


def verdicts(case: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The issue's goals for one model x trace, each computed from ``case`` (never assumed).

    ``case`` holds ``adaptive``, ``oracle`` and ``best_static`` summaries, the trace's
    ``kind`` (the speed-up goal holds on every bursty kind: ``bursty``, ``bursty-lte``),
    the adaptive run's ``estimate_error`` and ``lost``/``duplicated`` counts.
    """
    adaptive, oracle_, best = case["adaptive"], case["oracle"], case["best_static"]
    out: list[dict[str, Any]] = []
    if adaptive["mean_ms"] is not None and oracle_["mean_ms"]:
        ratio = adaptive["mean_ms"] / oracle_["mean_ms"]
        out.append(
            _goal(
                "adaptive mean within 10% of the oracle's",
                ratio <= 1.10,
                f"adaptive / oracle mean = {ratio:.2f}",
                ratio,
            )
        )
    if case["kind"].startswith("bursty") and adaptive["mean_ms"] and best["mean_ms"] is not None:
        speedup = best["mean_ms"] / adaptive["mean_ms"]
        detail = f"best static / adaptive mean = {speedup:.2f}x"
        if oracle_["mean_ms"]:
            ceiling = best["mean_ms"] / oracle_["mean_ms"]
            detail += f"; the oracle's own: {ceiling:.2f}x" + (
                ", so no choice among these plans reaches 1.3x" if ceiling < 1.3 else ""
            )
        out.append(
            _goal(
                "adaptive at least 1.3x better than the best static plan (mean, bursty trace)",
                speedup >= 1.3,
                detail,
                speedup,
            )
        )
    error = case["estimate_error"]
    if error.get("points"):
        share = error["within_20pct"]
        out.append(
            _goal(
                "rate estimate within 20% of the true rate 1 s after a change",
                error["p95"] <= 0.2,
                f"p95 error {error['p95']:.0%} (median {error['median']:.0%}, "
                f"{share:.0%} of {error['points']} samples within 20%)",
                error["p95"],
            )
        )
    lost = case["lost"] + case["duplicated"]
    out.append(
        _goal(
            "0 requests lost or answered twice across switches",
            lost == 0,
            f"{case['lost']} lost, {case['duplicated']} duplicated, {case['switches']} switches",
            lost,
        )
    )
    return out


def meeting_all(
    models: Sequence[Mapping[str, Any]], kinds: Sequence[str] = ("step", "bursty")
) -> list[str]:
    """The models whose cases on each trace kind of ``kinds`` met every goal (the issue
    asks for at least two models on a step trace and a bursty trace)."""
    names = []
    for model in models:
        cases = {case["kind"]: case for case in model["cases"]}
        if all(
            kind in cases and all(goal["met"] for goal in cases[kind]["verdicts"]) for kind in kinds
        ):
            names.append(model["model"]["name"])
    return names


def diagnosis(case: Mapping[str, Any]) -> list[str]:
    """Why a goal failed, from what the case measured (empty when every goal was met).

    Separates the parts: how much any per-request choice could gain over the best static
    plan (the oracle's headroom), what the plan set's regions are worth with the true
    rate known (the cost model's share), and how long the device sent nothing over the
    link (when a passive estimate cannot follow it).
    """
    if all(goal["met"] for goal in case["verdicts"]):
        return []
    out = []
    oracle_, best = case["oracle"]["mean_ms"], case["best_static"]["mean_ms"]
    adaptive = case["adaptive"]["mean_ms"]
    known = case.get("true_rate_regions", {}).get("mean_ms")
    if oracle_ and best:
        out.append(
            f"headroom: the oracle is {best / oracle_:.2f}x faster than the best static plan "
            "(no per-request choice of these plans can gain more here)"
        )
    if known and oracle_ and adaptive:
        out.append(
            f"regions: choosing by the plan set's regions with the true rate known gives "
            f"{known:.1f} ms, {known / oracle_:.2f}x the oracle's mean (the cost model's "
            f"choice at each rate vs the measured best); the adaptive device's "
            f"{adaptive:.1f} ms is {adaptive / known:.2f}x that (estimation and switching)"
        )
    gap = case.get("gap", {})
    if gap.get("compared"):
        why = "(estimate lag, hold, detours)"
        if "choice_lag" in gap:
            why = (
                f"({gap['choice_lag']:+.1f} ms on {gap['off_lag']} run on the plan the "
                f"device's estimate then gave, which lagged the change; "
                f"{gap['choice_held']:+.1f} ms on {gap['off_held']} run on another: held on "
                "the previous plan, or detoured off a backlog)"
            )
        out.append(
            f"gap per answered request ({gap['compared']} compared with the oracle's at the "
            f"same time): {gap['excess']:+.1f} ms = {gap['backlog']:.1f} ms waiting behind "
            f"earlier uploads on device-edge, {gap['choice']:+.1f} ms on the "
            f"{gap['off_plan']} requests run on another plan than the regions give for the "
            f"true rate {why}, {gap['other']:+.1f} ms on the rest "
            "(the regions against the oracle, and noise)"
        )
    estimate_goal = [g for g in case["verdicts"] if g["goal"].startswith("rate estimate")]
    if estimate_goal and not estimate_goal[0]["met"]:
        for miss in case.get("estimate_misses", []):
            out.append(_estimate_miss(miss))
    start, length = case.get("silent", (0.0, 0.0))
    if length >= 1.0:
        out.append(
            f"silent link: from {start:.1f} s the device ran {length:.1f} s on plans that "
            "send nothing over device-edge: only its idle probes (every 0.25 s while it "
            "answers alone) kept the estimate fresh meanwhile"
        )
    return out


def _estimate_miss(miss: Mapping[str, float]) -> str:
    """Why the estimate missed at one true rate, from what the run measured there."""
    line = (
        f"estimate: {miss['samples']} samples off by more than 20% while the true rate was "
        f"{miss['true_mbit']:.3g} Mbit/s, where one upload of the largest size this run "
        f"sent takes {miss['upload_s']:.2f} s"
    )
    held = miss.get("held_s")
    if held is None:
        return line + " (a passive estimate learns only from completed uploads)"
    # An upload still out bounds the rate by its bytes over its time out ([Note: censored
    # rate evidence] in tierflow.device.switching): within 20% of the truth only once it
    # has been out 1/1.2 of its whole time.
    bounded = miss["upload_s"] / 1.2
    line += f" and the rate held {held:.2f} s"
    if miss["upload_s"] < held:
        return line + (
            ": an upload begun as it changed completes within it, so the estimate lagged "
            "what the device could know"
        )
    if bounded < held:
        return line + (
            ": an upload begun as it changed is still out when it ends, but bounds the rate "
            f"within 20% after {bounded:.2f} s out (plus an answer's time), within it"
        )
    return line + (
        ": no upload begun at that rate completed while it lasted, and one still out "
        f"bounds the rate within 20% only after {bounded:.2f} s out (5/6 of its time, "
        "plus an answer's), "
        "longer than the rate held; one begun before averages the faster rate in. A "
        "passive estimate, which learns from what has crossed, cannot be within 20% "
        "there; only a smaller transfer could (a probe would wait behind the upload)"
    )


def _goal(name: str, met: bool, detail: str, value: float) -> dict[str, Any]:
    return {"goal": name, "met": bool(met), "detail": detail, "value": value}
