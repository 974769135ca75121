"""The fastest plan that meets a fidelity budget: the pure search, fed with measurements.

See [Note: fidelity search]. :func:`admission` turns what has been measured into the
data the search filters on (pure); :func:`search_within_budget` alternates the search
with measuring (:class:`~.fidelity_probe.FidelityProbe`) until the best plan's lossy
crossings have all been measured and met the budget.

[Note: fidelity search]
A plan's fidelity depends only on its *lossy crossings*: the cut each lossy codec
carries and the codec (lossless crossings reproduce the features bit for bit, as the
split's verification checks). With one lossy crossing, at cut ``c`` with codec ``q``,
the plan answers as the plan "device to ``c``, ``q``, the rest on the edge" does,
whatever the other link's cut; with two, the pair is measured as such. Codecs that
differ only in their lossless compressor decode to the same values (``int8`` and
``int8+zstd``) and share one measurement.

Measuring every lossy crossing of a model (a hundred cuts times each lossy codec, each
over the whole sample) would take longer than the rest of planning, and most of them
cannot win anyway. So the search runs first with every unmeasured crossing assumed to
pass; the best plan's unmeasured crossings are measured (each alone first, then the
pair when both pass); a failure is recorded and the search runs again. Each round
measures something new, so the loop ends, with the best plan made only of crossings
that were measured and met the budget: every plan predicted faster used a crossing (or
pair) that failed. The assumption made is monotonicity: a plan whose lossy crossing
fails alone is taken to fail with a second one added. A final search with unmeasured
crossings refused ranks the runners-up honestly. A failing crossing is rejected as soon
as the sample settles it (``stop_early``), so failures are cheap; ``max_measurements``
bounds the rounds, after which unmeasured crossings are refused.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from tierflow.codec.base import CodecSpec
from tierflow.link.spec import LINKS
from tierflow.partitioner.cost import CostTables, Estimate, Problem, edge_forwards
from tierflow.partitioner.fidelity import FidelityBudget
from tierflow.partitioner.fidelity_probe import FidelityProbe, Measurement, fidelity_class
from tierflow.partitioner.profile import ProgressFn
from tierflow.partitioner.search import Admission, PairKey, SearchResult, search

logger = logging.getLogger(__name__)

#: Rounds of measuring before unmeasured lossy crossings are refused outright.
DEFAULT_MAX_MEASUREMENTS = 48

SingleKey = tuple[int, str]  # (cut, fidelity class of the codec)
PairClassKey = tuple[int, str, int, str]


def is_lossless(codec: str) -> bool:
    """Bit-exact for every tensor; ``png`` is exact only for 8-bit pixels, so measured."""
    return CodecSpec.parse(codec).bit_exact


def lossy_crossings(best: Estimate) -> tuple[tuple[str, int, str], ...]:
    """``(link, cut, codec)`` of each used link of ``best`` whose codec is lossy.

    An edge that runs nothing forwards the device's tensors as they came: its plan has
    one crossing, on device-edge ([Note: what crosses a link] in :mod:`.cost`).
    """
    crossing = dict(zip(LINKS, best.cuts, strict=True))
    forwarded = edge_forwards(*best.cuts, best.last)
    return tuple(
        (name, crossing[name], cost.codec)
        for name, cost in best.links.items()
        if cost.used and not is_lossless(cost.codec) and not (forwarded and name == "edge-cloud")
    )


@dataclass(frozen=True)
class Verdicts:
    """Lossy crossings measured so far: alone (by cut and class) and in pairs."""

    singles: Mapping[SingleKey, Measurement] = field(default_factory=dict)
    pairs: Mapping[PairClassKey, Measurement] = field(default_factory=dict)

    @property
    def count(self) -> int:
        return len(self.singles) + len(self.pairs)


def admission(problem: Problem, verdicts: Verdicts, *, optimistic: bool) -> Admission:
    """What the search may use, given ``verdicts``; unmeasured crossings pass if ``optimistic``.

    Pure. The output cut carries nothing, so every codec is allowed there.
    """
    codecs = problem.codecs
    classes = [fidelity_class(c) for c in codecs]
    lossy = tuple(c != "lossless" for c in classes)
    n = problem.ncuts
    table = np.ones((n, len(codecs)), dtype=bool)
    for j, cls in enumerate(classes):
        if cls == "lossless":
            continue
        for cut in range(n - 1):
            verdict = verdicts.singles.get((cut, cls))
            table[cut, j] = optimistic if verdict is None else verdict.passed
    pairs: dict[PairKey, bool] = {}
    for (a, ca, b, cb), measured in verdicts.pairs.items():
        for i, ci in enumerate(classes):
            for j, cj in enumerate(classes):
                if (ci, cj) == (ca, cb):
                    pairs[(a, i, b, j)] = measured.passed
    return Admission(
        allowed={name: table for name in LINKS},
        lossy=lossy,
        pairs=pairs,
        pairs_default=optimistic,
    )


@dataclass(frozen=True)
class BudgetedSearch:
    """The search's result under a budget and what it took to get there."""

    result: SearchResult
    verdicts: Verdicts
    exhausted: bool  # max_measurements was reached

    def measured_passed(self) -> int:
        measured = (*self.verdicts.singles.values(), *self.verdicts.pairs.values())
        return sum(m.passed for m in measured)


@dataclass(frozen=True)
class _Pending:
    """A lossy crossing (``single``) or pair (``pair``) to measure, as a plan to run."""

    cuts: tuple[int, int]
    codec: dict[str, str]
    single: SingleKey | None = None
    pair: PairClassKey | None = None


def _next_measurement(best: Estimate, verdicts: Verdicts, last: int) -> _Pending | None:
    """The best plan's first unmeasured lossy crossing, then its unmeasured pair."""
    crossings = lossy_crossings(best)
    for _, cut, codec in crossings:
        key = (cut, fidelity_class(codec))
        if key not in verdicts.singles:
            return _Pending((cut, last), {"device-edge": codec}, single=key)
    if len(crossings) == 2:
        (_, a, qa), (_, b, qb) = crossings
        pair = (a, fidelity_class(qa), b, fidelity_class(qb))
        if pair not in verdicts.pairs:
            return _Pending((a, b), {"device-edge": qa, "edge-cloud": qb}, pair=pair)
    return None


def search_within_budget(
    problem: Problem,
    tables: CostTables,
    budget: FidelityBudget,
    probe: FidelityProbe,
    *,
    top: int = 5,
    max_measurements: int = DEFAULT_MAX_MEASUREMENTS,
    progress: ProgressFn | None = None,
) -> BudgetedSearch:
    """The ranking of plans that meet ``budget``, measuring lossy crossings as needed.

    ``progress(done, max_measurements, what)`` is called before each measurement.
    """
    singles: dict[SingleKey, Measurement] = {}
    pairs: dict[PairClassKey, Measurement] = {}
    last = problem.ncuts - 1
    exhausted = False
    while True:
        verdicts = Verdicts(dict(singles), dict(pairs))
        result = search(
            problem, top=top, tables=tables, admission=admission(problem, verdicts, optimistic=True)
        )
        wanted = _next_measurement(result.best, verdicts, last)
        if wanted is None:
            break
        if verdicts.count >= max_measurements:
            exhausted = True
            break
        if progress is not None:
            codecs = list(wanted.codec.values())
            what = " + ".join(f"{c} at cut {k}" for c, k in zip(codecs, wanted.cuts, strict=False))
            progress(verdicts.count, max_measurements, what)
        measured = probe.measure(wanted.cuts, wanted.codec, budget, stop_early=True)
        logger.info(
            "[fidelity] cuts %s with %s: %s (%s)",
            wanted.cuts,
            wanted.codec,
            "meets the budget" if measured.passed else "misses the budget",
            measured.score.describe(),
        )
        if wanted.single is not None:
            singles[wanted.single] = measured
        elif wanted.pair is not None:
            pairs[wanted.pair] = measured
    verdicts = Verdicts(dict(singles), dict(pairs))
    final = search(
        problem, top=top, tables=tables, admission=admission(problem, verdicts, optimistic=False)
    )
    return BudgetedSearch(final, verdicts, exhausted)
