"""Exhaustive search over plans: every cut pair, every codec per link. Pure.

A ResNet-18 has on the order of a hundred candidate cuts, so the ~5,000 cut pairs times
36 codec pairs are scored in a few numpy passes over the tables of :mod:`.cost`, well
under a second. With the latency objective each link's cost depends only on its own cut
and codec, so each link's best codec is picked independently; with the throughput
objective the codecs shift work between stages, so every codec pair is tried.

Ties are broken deterministically: lower score, then lower latency, then more work on
the lower tiers (keeping data close costs nothing when it is free), then the codec that
comes first in the candidate list (``raw`` before ``zstd`` before the lossy ones).

Under a fidelity budget the search takes an :class:`Admission`: which codec may cross at
which cut, and which pairs of lossy crossings may share a plan. It is data, measured
beforehand (see [Note: fidelity search] in :mod:`.fidelity_search`); the search only
filters on it, scoring every codec pair per cut pair so that a refused pair falls back
to the next best one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

import numpy as np

from tierflow.errors import PlanError
from tierflow.link.spec import TIERS
from tierflow.partitioner.cost import (
    CostTables,
    Estimate,
    Problem,
    build_tables,
    estimate,
    forwarded_plans,
)
from tierflow.units import format_size

BASELINES: tuple[str, ...] = ("device-only", "edge-only", "cloud-only")


class Ranked(Protocol):
    """What a search result ranks: an :class:`~.cost.Estimate`, or a plan priced from
    several (a decoder's :class:`~.decoder_cost.DecoderEstimate`)."""

    @property
    def cuts(self) -> tuple[int, int]: ...

    @property
    def codec(self) -> dict[str, str]: ...

    def to_dict(self) -> dict[str, Any]: ...


E = TypeVar("E", bound=Ranked)
F = TypeVar("F", bound=Ranked)


@dataclass(frozen=True)
class SearchResult(Generic[E]):
    """Ranked feasible plans (best first) and the single-tier baselines for comparison.

    A baseline that breaks a memory budget is still reported, with ``feasible`` false.
    """

    objective: str
    ranked: tuple[E, ...]
    baselines: Mapping[str, E]
    considered: int
    feasible: int

    @property
    def best(self) -> E:
        return self.ranked[0]

    def map(self, priced: Callable[[E], F]) -> SearchResult[F]:
        """The same ranking with every plan priced again (a decoder's search ranks one
        table and reports each plan at both of its points)."""
        return SearchResult(
            self.objective,
            tuple(priced(e) for e in self.ranked),
            {name: priced(e) for name, e in self.baselines.items()},
            self.considered,
            self.feasible,
        )

    def to_dict(self) -> dict[str, Any]:
        def entry(e: E) -> dict[str, Any]:
            return dict(e.to_dict(), codec=e.codec, cuts=list(e.cuts))

        return {
            "objective": self.objective,
            "considered": self.considered,
            "feasible": self.feasible,
            "ranked": [entry(e) for e in self.ranked],
            "baselines": {k: entry(e) for k, e in self.baselines.items()},
        }


# A pair of lossy crossings: (cut a, codec column on device-edge, cut b, column on edge-cloud).
PairKey = tuple[int, int, int, int]


@dataclass(frozen=True)
class Admission:
    """Which codecs a plan may use where: the fidelity budget as data for the search.

    ``allowed[link]`` is an ``(ncuts, ncodecs)`` boolean table: the codec in column ``j``
    may carry the tensors of cut ``i`` over ``link``. A plan using a lossy codec on both
    links is allowed when both are and ``pairs`` says so for its ``(a, i, b, j)``; pairs
    not listed get ``pairs_default``. Columns follow ``Problem.codecs``; ``lossy[j]``
    says which columns change the features (the others are always allowed).
    """

    allowed: Mapping[str, np.ndarray]
    lossy: tuple[bool, ...]
    pairs: Mapping[PairKey, bool] = field(default_factory=dict)
    pairs_default: bool = True

    def pair_mask(self, i: int, j: int, n: int) -> np.ndarray:
        """(n, n) which cut pairs may use column ``i`` on device-edge and ``j`` on edge-cloud."""
        de, ec = self.allowed["device-edge"], self.allowed["edge-cloud"]
        mask = de[:, i][:, None] & ec[:, j][None, :]
        if not (self.lossy[i] and self.lossy[j]):
            return mask
        verdicts = np.full((n, n), self.pairs_default)
        for (a, pi, b, pj), ok in self.pairs.items():
            if (pi, pj) == (i, j):
                verdicts[a, b] = ok
        # A link that carries nothing (its cut is the output cut) makes no pair.
        verdicts[n - 1, :] = True
        verdicts[:, n - 1] = True
        return mask & verdicts


@dataclass(frozen=True)
class _Scores:
    """Per cut pair ``(a, b)``: score, latency and the chosen codec column per link."""

    score: np.ndarray
    latency: np.ndarray
    codec_de: np.ndarray
    codec_ec: np.ndarray


def _latency_scores(tables: CostTables) -> _Scores:
    last = tables.last
    de = tables.links["device-edge"].total_s
    ec = tables.links["edge-cloud"].total_s
    best_de, best_ec = de.argmin(axis=1), ec.argmin(axis=1)
    rows = np.arange(last + 1)
    link_de, link_ec = de[rows, best_de], ec[rows, best_ec]
    latency = (
        tables.segment_s["device"][0, :, None]
        + tables.segment_s["edge"]
        + tables.segment_s["cloud"][:, last][None, :]
        + link_de[:, None]
        + link_ec[None, :]
    )
    n = last + 1
    return _Scores(
        score=latency,
        latency=latency,
        codec_de=np.broadcast_to(best_de[:, None], (n, n)),
        codec_ec=np.broadcast_to(best_ec[None, :], (n, n)),
    )


def _admitted_latency_scores(tables: CostTables, admission: Admission) -> _Scores:
    """Latency over every codec pair, keeping the best one the admission allows."""
    last = tables.last
    de = tables.links["device-edge"].total_s
    ec = tables.links["edge-cloud"].total_s
    n, ncodecs = last + 1, len(tables.problem.codecs)
    base = (
        tables.segment_s["device"][0, :, None]
        + tables.segment_s["edge"]
        + tables.segment_s["cloud"][:, last][None, :]
    )
    best = np.full((n, n), np.inf)
    codec_de = np.zeros((n, n), dtype=np.int64)
    codec_ec = np.zeros((n, n), dtype=np.int64)
    for i in range(ncodecs):
        for j in range(ncodecs):
            latency = base + de[:, i][:, None] + ec[:, j][None, :]
            latency = np.where(admission.pair_mask(i, j, n), latency, np.inf)
            better = latency < best
            best = np.where(better, latency, best)
            codec_de = np.where(better, i, codec_de)
            codec_ec = np.where(better, j, codec_ec)
    return _Scores(best, best, codec_de, codec_ec)


def _throughput_scores(tables: CostTables, admission: Admission | None = None) -> _Scores:
    last = tables.last
    de, ec = tables.links["device-edge"], tables.links["edge-cloud"]
    dev = tables.segment_s["device"][0, :]
    edge = tables.segment_s["edge"]
    cloud = tables.segment_s["cloud"][:, last]
    de_total, ec_total = de.total_s, ec.total_s
    de_reply, ec_reply = de.reply_row_s, ec.reply_row_s
    n, ncodecs = last + 1, len(tables.problem.codecs)
    best_period = np.full((n, n), np.inf)
    best_latency = np.full((n, n), np.inf)
    codec_de = np.zeros((n, n), dtype=np.int64)
    codec_ec = np.zeros((n, n), dtype=np.int64)
    base_latency = dev[:, None] + edge + cloud[None, :]
    for i in range(ncodecs):
        for j in range(ncodecs):
            period = np.maximum.reduce(
                [
                    np.broadcast_to((dev + de.encode_s[:, i])[:, None], (n, n)),
                    de.decode_s[:, i][:, None] + edge + ec.encode_s[:, j][None, :],
                    np.broadcast_to((ec.decode_s[:, j] + cloud)[None, :], (n, n)),
                    np.broadcast_to((de.wire_s[:, i] + de_reply)[:, None], (n, n)),
                    np.broadcast_to((ec.wire_s[:, j] + ec_reply)[None, :], (n, n)),
                ]
            )
            latency = base_latency + de_total[:, i][:, None] + ec_total[:, j][None, :]
            if admission is not None:
                mask = admission.pair_mask(i, j, n)
                period = np.where(mask, period, np.inf)
                latency = np.where(mask, latency, np.inf)
            better = (period < best_period) | ((period == best_period) & (latency < best_latency))
            best_period = np.where(better, period, best_period)
            best_latency = np.where(better, latency, best_latency)
            codec_de = np.where(better, i, codec_de)
            codec_ec = np.where(better, j, codec_ec)
    return _Scores(best_period, best_latency, codec_de, codec_ec)


def _with_forwarding(
    tables: CostTables, scores: _Scores, admission: Admission | None = None
) -> _Scores:
    """``scores`` with the plans ``(a, a)`` whose edge runs nothing scored as forwarded.

    Such a plan carries one codec across both links, applied once
    ([Note: what crosses a link] in :mod:`.cost`); under an ``admission`` it is one lossy
    crossing at cut ``a``, never a pair.
    """
    last = tables.last
    latency, period = forwarded_plans(tables)
    score = period if tables.problem.objective == "throughput" else latency
    if admission is not None:
        allowed = admission.allowed["device-edge"]
        score = np.where(allowed, score, np.inf)
        latency = np.where(allowed, latency, np.inf)
    rows = np.arange(last)  # a == b < last
    # Lower score, then lower latency, then the codec listed first.
    columns = np.broadcast_to(np.arange(score.shape[1]), (last, score.shape[1]))
    choice = np.lexsort((columns, latency[rows], score[rows]), axis=-1)[:, 0]
    out = _Scores(
        np.array(scores.score, dtype=float),
        np.array(scores.latency, dtype=float),
        np.array(scores.codec_de, dtype=np.int64),
        np.array(scores.codec_ec, dtype=np.int64),
    )
    out.score[rows, rows] = score[rows, choice]
    out.latency[rows, rows] = latency[rows, choice]
    out.codec_de[rows, rows] = choice
    out.codec_ec[rows, rows] = choice
    return out


def _feasible(tables: CostTables) -> np.ndarray:
    n, last = tables.problem.ncuts, tables.last
    a, b = np.indices((n, n))
    ok = a <= b
    budgets = tables.problem.memory
    if "device" in budgets:
        ok &= (tables.memory["device"][0, :] <= budgets["device"])[:, None]
    if "edge" in budgets:
        ok &= tables.memory["edge"] <= budgets["edge"]
    if "cloud" in budgets:
        ok &= (tables.memory["cloud"][:, last] <= budgets["cloud"])[None, :]
    return ok


def _no_fit_error(tables: CostTables) -> PlanError:
    """Name the plan that comes closest to the budgets, and what it needs."""
    n, last = tables.problem.ncuts, tables.last
    budgets = tables.problem.memory
    a, b = np.indices((n, n))
    need = {
        "device": np.broadcast_to(tables.memory["device"][0, :, None], (n, n)),
        "edge": tables.memory["edge"],
        "cloud": np.broadcast_to(tables.memory["cloud"][None, :, last], (n, n)),
    }
    worst = np.zeros((n, n))
    for tier, budget in budgets.items():
        worst = np.maximum(worst, need[tier] / budget)
    worst = np.where(a <= b, worst, np.inf)
    best_a, best_b = np.unravel_index(int(np.argmin(worst)), worst.shape)
    needs = ", ".join(
        f"{t} {format_size(float(need[t][best_a, best_b]))}"
        for t in TIERS
        if need[t][best_a, best_b] > 0 or t in budgets
    )
    limits = ", ".join(f"{t} {format_size(v)}" for t, v in budgets.items())
    return PlanError(
        f"no plan fits the memory budgets ({limits}): the smallest need is {needs} "
        f"(cuts {int(best_a)}, {int(best_b)})"
    )


def _estimate_at(tables: CostTables, scores: _Scores, a: int, b: int) -> Estimate:
    codecs = tables.problem.codecs
    chosen = {
        "device-edge": codecs[int(scores.codec_de[a, b])],
        "edge-cloud": codecs[int(scores.codec_ec[a, b])],
    }
    return estimate(tables, a, b, chosen)


def search(
    problem: Problem,
    *,
    top: int = 5,
    tables: CostTables | None = None,
    admission: Admission | None = None,
) -> SearchResult[Estimate]:
    """Score every plan of ``problem``; return the ``top`` best feasible ones and baselines.

    With an ``admission`` only the codecs it allows are chosen, and a cut pair where it
    allows none is not feasible. Raises :class:`PlanError` when no plan fits the memory
    budgets.
    """
    tables = tables or build_tables(problem)
    if problem.objective == "throughput":
        scores = _throughput_scores(tables, admission)
    elif admission is not None:
        scores = _admitted_latency_scores(tables, admission)
    else:
        scores = _latency_scores(tables)
    scores = _with_forwarding(tables, scores, admission)
    feasible = _feasible(tables)
    if admission is not None:
        feasible &= np.isfinite(scores.score)
    n, last = problem.ncuts, tables.last
    considered = n * (n + 1) // 2
    count = int(feasible.sum())
    if count == 0:
        raise _no_fit_error(tables)
    a, b = np.nonzero(feasible)
    score = np.round(scores.score[a, b], 12)
    latency = np.round(scores.latency[a, b], 12)
    # lexsort: the last key is the primary one.
    order = np.lexsort((-b, -a, latency, score))[: max(1, top)]
    ranked = tuple(_estimate_at(tables, scores, int(a[i]), int(b[i])) for i in order)
    baselines = {
        "device-only": _estimate_at(tables, scores, last, last),
        "edge-only": _estimate_at(tables, scores, 0, last),
        "cloud-only": _estimate_at(tables, scores, 0, 0),
    }
    return SearchResult(problem.objective, ranked, baselines, considered, count)
