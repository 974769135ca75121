"""The bandwidth traces of the adaptation benchmark: a step, and two bursty 4G-like uplinks.

All are :class:`~tierflow.link.trace.LinkTrace` objects, written as the CSV files that
``--link-emulation trace=FILE.csv`` replays. Pure and deterministic: the same parameters
and seed give the same trace, byte for byte.

The bursty trace comes from a stated model (:class:`BurstyModel`), a Markov-modulated
log-normal rate process in the manner of the LTE uplink logs people measure on the move
(the rate sits in a coarse state for a while, jitters within it, and now and then falls
to a poor state or climbs to a good one):

- three states with median rates (good, fair, poor), 30, 8 and 1.5 Mbit/s by default;
- the trace is a series of holds; each hold lasts ``min_hold_s`` plus an exponential
  time of mean ``mean_hold_s`` (0.6 + 1.4 s on average), and keeps one rate;
- at each new hold the state stays with probability ``stay`` (0.5), else moves to a
  neighbouring state (good <-> fair <-> poor, each way equally likely from fair);
- a hold's rate is its state's median times a log-normal factor ``exp(N(0, sigma))``
  (sigma 0.35), clipped to ``[floor, ceiling]`` Mbit/s;
- the RTT is fixed (see :data:`TRACE_RTT_S`): the traces vary the rate only.

The second bursty trace (:data:`LTE_FADING`, kind ``bursty-lte``) is the same model with
harsher figures, taken from published LTE measurements (as recalled from the papers; no
data is downloaded): its time-weighted median rate is the median LTE uplink throughput
that 4GTest measured from its users' phones, 5.64 Mbit/s (Huang et al., "A Close
Examination of Performance and Power Characteristics of 4G LTE Networks", MobiSys 2012;
:func:`median_mbit` checks it, 5.6 over a long trace), and its rate swings by more than
an order of magnitude within seconds, down to near-outages, as the cellular traces of
Winstein et al. show ("Stochastic Forecasts Achieve High Throughput and Low Delay over
Cellular Networks", NSDI 2013): four states, 40, 12, 3 and 0.4 Mbit/s (the fourth a
fade well below the first trace's poorest state), holds of 0.3 s + Exp(mean 0.9 s),
sigma 0.5, rates within 0.1-80 Mbit/s. Over a long trace its 10th and 90th percentiles
are 0.4 and 35 Mbit/s and the rate is below 1 Mbit/s 18% of the time (the first trace:
1.3 and 33 Mbit/s, 3%). The 36 s the benchmark plays (seed 4) are a short sample of it:
median 12 Mbit/s, 10th and 90th percentiles 1.8 and 60 Mbit/s, one fade to 0.18 Mbit/s
for 1.6 s (the first trace's 36 s: 8.6, 1.2 and 13 Mbit/s). The first trace is kept as
it was.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from tierflow.link.spec import LinkSpec
from tierflow.link.trace import LinkTrace, step_trace

#: Round trip of the device-edge link in both traces (a 4G-class access link).
TRACE_RTT_S = 0.030


@dataclass(frozen=True)
class StepModel:
    """``high`` Mbit/s for ``before_s``, ``low`` for ``low_s``, then ``high`` for ``after_s``."""

    high_mbit: float = 200.0
    low_mbit: float = 2.0
    before_s: float = 5.0
    low_s: float = 10.0
    after_s: float = 5.0
    rtt_s: float = TRACE_RTT_S

    @property
    def duration_s(self) -> float:
        return self.before_s + self.low_s + self.after_s

    def trace(self) -> LinkTrace:
        high = LinkSpec(self.high_mbit * 1e6, self.rtt_s)
        low = LinkSpec(self.low_mbit * 1e6, self.rtt_s)
        points = [(0.0, high), (self.before_s, low), (self.before_s + self.low_s, high)]
        return step_trace(points, source=self.describe())

    def describe(self) -> str:
        return (
            f"step {self.high_mbit:g} -> {self.low_mbit:g} -> {self.high_mbit:g} Mbit/s "
            f"at {self.before_s:g} s and {self.before_s + self.low_s:g} s, "
            f"RTT {self.rtt_s * 1e3:g} ms"
        )

    def to_dict(self) -> dict[str, Any]:
        return dict(asdict(self), kind="step", duration_s=self.duration_s)


@dataclass(frozen=True)
class BurstyModel:
    """A Markov-modulated log-normal uplink (see the module docstring); ``seed`` fixes it."""

    duration_s: float = 36.0
    seed: int = 4
    state_mbit: tuple[float, ...] = (30.0, 8.0, 1.5)  # good, fair, poor
    stay: float = 0.5
    min_hold_s: float = 0.6
    mean_hold_s: float = 1.4
    sigma: float = 0.35
    floor_mbit: float = 0.5
    ceiling_mbit: float = 100.0
    start_state: int = 1
    rtt_s: float = TRACE_RTT_S
    kind: str = "bursty"
    title: str = "bursty 4G-like"

    def holds(self) -> list[tuple[float, float, int]]:
        """``(start_s, rate_mbit, state)`` of every hold, in time order."""
        rng = np.random.default_rng(self.seed)
        states = len(self.state_mbit)
        t, state = 0.0, self.start_state
        out: list[tuple[float, float, int]] = []
        while t < self.duration_s:
            if out and rng.random() >= self.stay:
                if state == 0:
                    state = 1
                elif state == states - 1:
                    state = states - 2
                else:
                    state += 1 if rng.random() < 0.5 else -1
            factor = math.exp(float(rng.normal(0.0, self.sigma)))
            rate = min(max(self.state_mbit[state] * factor, self.floor_mbit), self.ceiling_mbit)
            out.append((round(t, 3), round(rate, 3), state))
            t += self.min_hold_s + float(rng.exponential(self.mean_hold_s))
        return out

    def trace(self) -> LinkTrace:
        points = [(start, LinkSpec(rate * 1e6, self.rtt_s)) for start, rate, _ in self.holds()]
        return step_trace(points, source=self.describe())

    def describe(self) -> str:
        states = "/".join(f"{rate:g}" for rate in self.state_mbit)
        bounds = f", within {self.floor_mbit:g}-{self.ceiling_mbit:g} Mbit/s"
        return (
            f"{self.title}, seed {self.seed}: Markov-modulated log-normal, states "
            f"{states} Mbit/s, stay {self.stay:g}, holds "
            f"{self.min_hold_s:g} s + Exp(mean {self.mean_hold_s:g} s), sigma {self.sigma:g}"
            f"{bounds}, RTT {self.rtt_s * 1e3:g} ms"
        )

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["state_mbit"] = list(self.state_mbit)
        return data


#: The second bursty trace, from published LTE figures (see the module docstring).
LTE_FADING = BurstyModel(
    state_mbit=(40.0, 12.0, 3.0, 0.4),
    stay=0.5,
    min_hold_s=0.3,
    mean_hold_s=0.9,
    sigma=0.5,
    floor_mbit=0.1,
    ceiling_mbit=80.0,
    kind="bursty-lte",
    title="LTE-grounded fading uplink",
)


def percentile_mbit(model: BurstyModel, q: float) -> float:
    """The rate (Mbit/s) below which ``model``'s trace stays ``q`` (0-1) of its time."""
    holds = model.holds()
    ends = [start for start, _, _ in holds[1:]] + [model.duration_s]
    spans = sorted(
        (rate, max(min(end, model.duration_s) - start, 0.0))
        for (start, rate, _), end in zip(holds, ends, strict=True)
    )
    total = sum(span for _, span in spans)
    seen = 0.0
    for rate, span in spans:
        seen += span
        if seen >= q * total:
            return rate
    return spans[-1][0]


def median_mbit(model: BurstyModel) -> float:
    """The time-weighted median rate of ``model``'s trace (Mbit/s)."""
    return percentile_mbit(model, 0.5)


def changes(trace: LinkTrace) -> list[float]:
    """When the trace's rate changes (seconds; not its start)."""
    return [
        step.start_s
        for before, step in zip(trace.steps, trace.steps[1:], strict=False)
        if step.link.rate_bps != before.link.rate_bps
    ]


def settled_since(trace: LinkTrace, t: float) -> float:
    """Seconds since the rate last changed, at ``t`` (``t`` itself before any change)."""
    last = max((c for c in changes(trace) if c <= t), default=0.0)
    return t - last
