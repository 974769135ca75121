"""Fidelity: how far a plan's answers may drift from the exact model's, and how far they do.

A *budget* (``tierflow plan --fidelity``) is one of

* ``exact`` (the default): only lossless codecs cross a link, so the split reproduces the
  model bit for bit (at the same ONNX Runtime optimisation level and intra-op thread
  count as the reference);
* ``top1=P%``: at least ``P`` percent of the sample's requests keep the exact model's
  argmax (see :func:`request_agrees`);
* ``rel=E``: no request's outputs move by more than ``E`` relative to their own size
  (see :func:`request_rel_error`).

A lossy plan is judged by running the sample through the split with the codecs applied
and comparing the outputs with the exact model's (:mod:`.fidelity_probe`); this module
only defines the budgets, the metrics and the statistics, and is pure.

[Note: how many samples a budget needs]
A top-1 budget is a rate, and a sample of ``N`` requests measures rates in steps of
``1/N``. ``top1=P%`` with ``N * (1 - P) < 1`` is refused: the sample could not register
one disagreement within the budget, so "meets the budget" would only mean "no
disagreement seen", a far weaker promise than the user stated (``top1=99.5%`` needs at
least 200 requests). ``top1=100%`` asks for no disagreement on the sample and is always
accepted. Above that floor the plan is accepted on the point estimate (``agreeing / N >=
P``) and the record carries the one-sided 95% Clopper-Pearson lower bound of the agreement
rate; when that bound is below the budget the planner warns and says how many requests
would support the budget with no disagreement observed (``N >= ln(0.05) / ln(P)``, about
``3 / (1 - P)``: the rule of three). ``rel=E`` is a maximum over the sample: by the same
rule, at 95% confidence at most a ``3 / N`` share of unseen requests exceed the worst
error seen; the record says on how many requests it was measured.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tierflow.errors import PlanError, UsageError, shown

METRICS: tuple[str, ...] = ("exact", "top1", "rel")
#: Confidence of the lower bound the planner reports for a top-1 agreement rate.
CONFIDENCE = 0.95
_FORMS = "exact, top1=P% (like top1=99.5%) or rel=E (like rel=1e-3)"


@dataclass(frozen=True)
class FidelityBudget:
    """What the user allows: ``exact``, ``top1`` with a share, or ``rel`` with an error.

    ``value`` is the share of requests that must agree (0..1] for ``top1``, the largest
    relative output error for ``rel``, and unused (0) for ``exact``.
    """

    metric: str = "exact"
    value: float = 0.0

    def __post_init__(self) -> None:
        if self.metric not in METRICS:
            raise UsageError(f"unknown fidelity metric {shown(self.metric)}: expected {_FORMS}")
        if self.metric == "top1" and not 0.0 < self.value <= 1.0:
            raise UsageError(f"a top1 budget must be within (0%, 100%], got {self.value:.4g}")
        if self.metric == "rel" and not (math.isfinite(self.value) and self.value >= 0.0):
            raise UsageError(f"a rel budget must be a finite error >= 0, got {shown(self.value)}")
        if self.metric == "exact" and self.value != 0.0:
            object.__setattr__(self, "value", 0.0)

    @classmethod
    def parse(cls, text: str) -> FidelityBudget:
        """Read ``exact``, ``top1=99.5%`` or ``rel=1e-3``."""
        clean = text.strip().lower()
        if clean == "exact":
            return cls()
        metric, sep, value = clean.partition("=")
        metric = metric.strip()
        value = value.strip()
        if not sep or metric not in ("top1", "rel") or not value:
            raise UsageError(f"malformed --fidelity {shown(text)}: expected {_FORMS}")
        if metric == "top1":
            if not value.endswith("%"):
                raise UsageError(
                    f"malformed --fidelity {shown(text)}: a top1 budget is a percentage, "
                    "like top1=99.5%"
                )
            number = _number(value[:-1], text)
            if not 0.0 < number <= 100.0:
                raise UsageError(
                    f"malformed --fidelity {shown(text)}: the share must be within (0%, 100%]"
                )
            return cls("top1", number / 100.0)
        number = _number(value, text)
        if not (math.isfinite(number) and number >= 0.0):
            raise UsageError(
                f"malformed --fidelity {shown(text)}: the error must be a finite E >= 0"
            )
        return cls("rel", number)

    @property
    def lossless_only(self) -> bool:
        return self.metric == "exact"

    def allowed_disagreements(self, samples: int) -> int:
        """For ``top1``: how many of ``samples`` requests may disagree within budget."""
        return math.floor((1.0 - self.value) * samples + 1e-9)

    def met_by(self, value: float, samples: int) -> bool:
        """Whether a measured ``value`` (share or error) on ``samples`` meets the budget."""
        if self.metric == "top1":
            return samples - round(value * samples) <= self.allowed_disagreements(samples)
        if self.metric == "rel":
            return value <= self.value
        return value >= 1.0  # exact: every request bit for bit

    def __str__(self) -> str:
        if self.metric == "top1":
            return f"top1={100.0 * self.value:g}%"
        if self.metric == "rel":
            return f"rel={self.value:g}"
        return "exact"

    def to_dict(self) -> dict[str, Any]:
        return {"metric": self.metric, "value": self.value}

    @classmethod
    def from_dict(cls, data: Any) -> FidelityBudget:
        if not isinstance(data, Mapping):
            raise UsageError(f"malformed fidelity budget {shown(data)}: expected an object")
        try:
            return cls(str(data["metric"]), float(data.get("value", 0.0)))
        except (KeyError, TypeError, ValueError) as exc:
            raise UsageError(f"malformed fidelity budget {shown(data)}: {exc}") from exc


EXACT = FidelityBudget()


def _number(text: str, option: str) -> float:
    try:
        return float(text)
    except ValueError as exc:
        raise UsageError(
            f"malformed --fidelity {shown(option)}: {shown(text)} is not a number"
        ) from exc


# --------------------------------------------------------------------------- metrics


def _float_kind(array: np.ndarray) -> bool:
    return array.dtype.kind in "fc"


def _same_layout(reference: np.ndarray, output: np.ndarray) -> bool:
    return reference.dtype == output.dtype and reference.shape == output.shape


def request_bitwise(reference: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray]) -> bool:
    """Whether every output of one request is bit for bit the reference's."""
    for name, want in reference.items():
        got = np.asarray(outputs[name])
        if not _same_layout(want, got) or want.tobytes() != got.tobytes():
            return False
    return True


def request_agrees(reference: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray]) -> bool:
    """Top-1 agreement of one request with the exact model.

    Every float output must have the same argmax along its last axis at every position
    (a ``(1, classes)`` logit vector: the same class; a ``(1, boxes, classes)`` output:
    the same class per box); a 0-d float output, and every non-float output, must be
    equal. NaN counts as the largest value, as numpy's argmax has it.
    """
    for name, want in reference.items():
        got = np.asarray(outputs[name])
        if want.shape != got.shape:
            return False
        if _float_kind(want) and want.ndim > 0 and want.shape[-1] > 0:
            if not np.array_equal(np.argmax(want, axis=-1), np.argmax(got, axis=-1)):
                return False
        elif not np.array_equal(want, got, equal_nan=_float_kind(want)):
            return False
    return True


def request_rel_error(
    reference: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray]
) -> float:
    """The relative output error of one request: the largest, over its outputs, of

        max |y - y'| / max |y|

    where ``y`` is the exact model's output and ``y'`` the plan's (infinity norms over
    all the output's elements, so a logit vector's error is measured against its
    largest logit rather than element by element, where logits near zero would make any
    change infinite). An output that is all zeros counts its absolute error instead. NaN
    or infinity in the same place in both counts as equal; anywhere else the error is
    infinite. Non-float outputs are 0 when equal, else infinite.
    """
    worst = 0.0
    for name, want in reference.items():
        got = np.asarray(outputs[name])
        if want.shape != got.shape:
            return math.inf
        if not _float_kind(want):
            if not np.array_equal(want, got):
                return math.inf
            continue
        if want.size == 0:
            continue
        a = want.astype(np.complex128 if want.dtype.kind == "c" else np.float64)
        b = got.astype(a.dtype)
        finite = np.isfinite(a)
        same_special = (~finite) & ((a == b) | (np.isnan(a) & np.isnan(b)))
        if not np.all(finite | same_special) or not np.all(np.isfinite(b[finite])):
            return math.inf
        if not finite.any():
            continue
        diff = float(np.max(np.abs(a[finite] - b[finite])))
        scale = float(np.max(np.abs(a[finite])))
        worst = max(worst, diff / scale if scale > 0 else diff)
    return worst


@dataclass(frozen=True)
class FidelityScore:
    """One plan measured end to end: what ``plan.json`` records and ``plan`` prints.

    ``metric`` is the budget's (``exact`` when no lossy budget was stated); ``value`` the
    share of requests agreeing (``top1``, and ``exact``: the share bit-for-bit equal) or
    the worst relative error (``rel``); ``samples`` how many requests were compared;
    ``bitwise_equal`` whether every one of them matched bit for bit; ``lower_bound`` the
    one-sided 95% lower confidence bound of a ``top1`` share (None otherwise); ``budget``
    the budget it was measured against.
    """

    metric: str
    value: float
    samples: int
    bitwise_equal: bool
    budget: str = "exact"
    lower_bound: float | None = None

    def __post_init__(self) -> None:
        if self.metric not in METRICS:
            raise PlanError(f"malformed fidelity: unknown metric {shown(self.metric)}")
        if self.samples < 0 or (not math.isfinite(self.value) and self.metric != "rel"):
            raise PlanError(f"malformed fidelity: {shown(self.value)} on {self.samples} samples")

    def describe(self) -> str:
        """One line for people, like ``top1 agreement 99.5% on 200 requests``."""
        requests = f"{self.samples} request{'s' if self.samples != 1 else ''}"
        if self.metric == "rel":
            return f"max relative output error {self.value:.3g} on {requests}"
        if self.metric == "top1":
            bound = (
                f", {100 * self.lower_bound:.1f}% at 95% confidence"
                if self.lower_bound is not None
                else ""
            )
            return f"top1 agreement {100 * self.value:.1f}% on {requests}{bound}"
        return f"{100 * self.value:.1f}% of outputs bit-for-bit equal on {requests}"

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "budget": self.budget,
            "metric": self.metric,
            "value": self.value,
            "samples": self.samples,
            "bitwise_equal": self.bitwise_equal,
        }
        if self.lower_bound is not None:
            data["lower_bound_95"] = self.lower_bound
        return data

    @classmethod
    def from_dict(cls, data: Any) -> FidelityScore:
        if not isinstance(data, Mapping):
            raise PlanError(f"malformed fidelity {shown(data)}: expected an object")
        try:
            bound = data.get("lower_bound_95")
            return cls(
                metric=str(data["metric"]),
                value=float(data["value"]),
                samples=int(data["samples"]),
                bitwise_equal=bool(data["bitwise_equal"]),
                budget=str(data.get("budget", "exact")),
                lower_bound=None if bound is None else float(bound),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise PlanError(f"malformed fidelity {shown(data)}: {exc}") from exc


def score(
    budget: FidelityBudget,
    references: Sequence[Mapping[str, np.ndarray]],
    outputs: Sequence[Mapping[str, np.ndarray]],
) -> FidelityScore:
    """Compare a plan's outputs with the exact model's, request by request."""
    if len(references) != len(outputs):
        raise PlanError(f"{len(outputs)} outputs for {len(references)} references")
    n = len(references)
    bitwise = [request_bitwise(r, o) for r, o in zip(references, outputs, strict=True)]
    if budget.metric == "rel":
        errors = [request_rel_error(r, o) for r, o in zip(references, outputs, strict=True)]
        return FidelityScore("rel", max(errors, default=0.0), n, all(bitwise), str(budget))
    if budget.metric == "top1":
        agree = sum(request_agrees(r, o) for r, o in zip(references, outputs, strict=True))
        share = agree / n if n else 1.0
        bound = lower_confidence_bound(agree, n) if n else None
        return FidelityScore("top1", share, n, all(bitwise), str(budget), bound)
    share = sum(bitwise) / n if n else 1.0
    return FidelityScore("exact", share, n, all(bitwise), str(budget))


# --------------------------------------------------------------------------- statistics


def _binomial_tail_at_least(k: int, n: int, p: float) -> float:
    """P(X >= k) for X ~ Binomial(n, p), summed in log space."""
    if k <= 0:
        return 1.0
    if p <= 0.0:
        return 0.0
    if p >= 1.0:
        return 1.0
    log_p, log_q = math.log(p), math.log1p(-p)
    log_n = math.lgamma(n + 1)
    terms = [
        log_n - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * log_p + (n - i) * log_q
        for i in range(k, n + 1)
    ]
    top = max(terms)
    return min(1.0, math.exp(top) * sum(math.exp(t - top) for t in terms))


def lower_confidence_bound(successes: int, n: int, confidence: float = CONFIDENCE) -> float:
    """One-sided Clopper-Pearson lower bound of a success rate seen as ``successes / n``.

    The smallest ``p`` for which seeing ``successes`` or more in ``n`` tries still has
    probability ``1 - confidence``; ``(1 - confidence) ** (1 / n)`` when all succeeded.
    """
    if not 0 <= successes <= n or n == 0:
        raise PlanError(f"cannot bound {successes} successes in {n} tries")
    alpha = 1.0 - confidence
    if successes == 0:
        return 0.0
    if successes == n:
        return alpha ** (1.0 / n)
    low, high = 0.0, successes / n
    for _ in range(60):
        mid = (low + high) / 2
        if _binomial_tail_at_least(successes, n, mid) < alpha:
            low = mid
        else:
            high = mid
    return low


def samples_to_support(budget: FidelityBudget, confidence: float = CONFIDENCE) -> int:
    """Requests needed so that none disagreeing bounds the agreement above a top1 budget."""
    if budget.metric != "top1" or budget.value >= 1.0:
        return 1
    return math.ceil(math.log(1.0 - confidence) / math.log(budget.value))


def check_sample_size(budget: FidelityBudget, samples: int) -> None:
    """Refuse a budget finer than the sample resolves.

    See [Note: how many samples a budget needs].
    """
    if budget.lossless_only:
        return
    if samples < 1:
        raise UsageError(f"--fidelity {budget} needs at least one sample request")
    if budget.metric == "top1" and budget.value < 1.0:
        needed = math.ceil(1.0 / (1.0 - budget.value) - 1e-9)
        if samples < needed:
            raise UsageError(
                f"--fidelity {budget} needs at least {needed} sample requests (one disagreement "
                f"in {samples} is already {100.0 / samples:.3g}%); the sample has {samples}. "
                f"Give a larger --sample (about {samples_to_support(budget)} requests support "
                "it at 95% confidence) or a looser budget"
            )


def confidence_warning(budget: FidelityBudget, measured: FidelityScore) -> str | None:
    """A note when the measured share's 95% lower bound falls below a top1 budget."""
    if budget.metric != "top1" or measured.lower_bound is None:
        return None
    if measured.lower_bound >= budget.value:
        return None
    return (
        f"note: on {measured.samples} requests the agreement's 95% lower confidence bound is "
        f"{100 * measured.lower_bound:.1f}%, below the budget {budget}: unseen requests may "
        f"agree less often; about {samples_to_support(budget)} requests would support it"
    )
