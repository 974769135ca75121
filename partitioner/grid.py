"""Plan sets: the best plan at every point of a grid of link rates and RTTs. Pure.

A plan is best for the links it was scored against; when a link drifts, another plan
may be better (a slow uplink favours cutting after the layers that shrink the features,
a fast one sending early). ``tierflow plan --adaptive`` scores every plan at every
combination of device-edge and edge-cloud conditions in a :class:`RateGrid` and keeps
each plan that is best somewhere, with the grid points where it is (its region). Compute
and memory tables are built once; only the link tables change from point to point
(:func:`~.cost.with_links`). Ties between plans are broken as :func:`~.search.search`
breaks them, so the result is deterministic.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tierflow.errors import UsageError, shown
from tierflow.link.spec import LINKS, LinkSpec, check_link
from tierflow.partitioner.cost import CostTables, Estimate, with_links
from tierflow.partitioner.search import search
from tierflow.units import parse_duration, parse_rate

#: Rates tried when ``--grid`` names none for a link (the nominal rate is always added).
DEFAULT_RATES: Mapping[str, tuple[float, ...]] = {
    "device-edge": (1e6, 2e6, 5e6, 10e6, 20e6, 50e6, 100e6, 200e6),
    "edge-cloud": (10e6, 50e6, 200e6, 1e9),
}

#: One link condition per link: a point of the grid.
Point = Mapping[str, LinkSpec]


@dataclass(frozen=True)
class RateGrid:
    """The rates and RTTs tried on each link; every combination is a grid point."""

    rates: Mapping[str, tuple[float, ...]]
    rtts: Mapping[str, tuple[float, ...]]

    def __post_init__(self) -> None:
        for name in LINKS:
            if not self.rates.get(name) or not self.rtts.get(name):
                raise UsageError(f"a rate grid needs at least one rate and RTT for {name}")
            # Checks every value (positive finite rate, finite RTT >= 0).
            for rate, rtt in itertools.product(self.rates[name], self.rtts[name]):
                LinkSpec(rate, rtt)

    @classmethod
    def around(cls, nominal: Mapping[str, LinkSpec], given: Sequence[str] = ()) -> RateGrid:
        """The grid for ``--grid`` values over the defaults, always holding ``nominal``.

        A value is ``LINK=RATE,RATE,...[/RTT,RTT,...]``, like
        ``device-edge=1mbit,10mbit,100mbit/5ms,50ms``; without RTTs the link keeps its
        nominal one.
        """
        rates = {name: set(DEFAULT_RATES[name]) for name in LINKS}
        rtts: dict[str, set[float]] = {name: set() for name in LINKS}
        for text in given:
            name, sep, value = text.partition("=")
            if not sep or not value.strip():
                raise UsageError(
                    f"malformed --grid {shown(text)}: expected LINK=RATE,RATE[/RTT,RTT], like "
                    "device-edge=1mbit,10mbit,100mbit/5ms,50ms"
                )
            link = check_link(name.strip())
            rate_text, _, rtt_text = value.partition("/")
            rates[link] = {parse_rate(r) for r in rate_text.split(",") if r.strip()}
            rtts[link] = {parse_duration(t) for t in rtt_text.split(",") if t.strip()}
        return cls(
            rates={n: tuple(sorted(rates[n] | {nominal[n].rate_bps})) for n in LINKS},
            rtts={n: tuple(sorted(rtts[n] | {nominal[n].rtt_s})) for n in LINKS},
        )

    def points(self) -> list[dict[str, LinkSpec]]:
        """Every combination, slowest device-edge first, then edge-cloud; RTTs innermost."""
        per_link = [
            [LinkSpec(rate, rtt) for rate in self.rates[name] for rtt in self.rtts[name]]
            for name in LINKS
        ]
        return [dict(zip(LINKS, combo, strict=True)) for combo in itertools.product(*per_link)]


def plan_key(estimate: Estimate) -> tuple[object, ...]:
    """What makes two estimates the same plan: cuts and the codec of each used link."""
    return (estimate.cuts, tuple(sorted(estimate.codec.items())))


@dataclass(frozen=True)
class GridChoice:
    """The plans best somewhere on a grid, and where.

    ``plans[0]`` is the best plan at ``nominal`` (the default); the others follow in the
    order the grid first meets them. ``regions[i]`` holds the points where ``plans[i]``
    is best; each plan's estimate is at its representative point, ``anchors[i]``
    (``nominal`` for the default, else the middle point of its region).
    """

    nominal: Point
    points: tuple[Point, ...]
    plans: tuple[Estimate, ...]
    regions: tuple[tuple[Point, ...], ...]
    anchors: tuple[Point, ...]

    def best_at(self, point: Point) -> int:
        """The index of the plan best at a grid point."""
        for index, region in enumerate(self.regions):
            if any(dict(p) == dict(point) for p in region):
                return index
        raise KeyError(f"{dict(point)} is not a point of this grid")


def _best(tables: CostTables, point: Point) -> Estimate:
    retimed = with_links(tables, point)
    return search(retimed.problem, top=1, tables=retimed).best


def grid_search(tables: CostTables, grid: RateGrid, nominal: Point) -> GridChoice:
    """The best plan at every grid point, grouped into distinct plans and their regions.

    Raises :class:`~tierflow.errors.PlanError` (from the search) when no plan fits the
    memory budgets: that does not depend on the links.
    """
    points = grid.points()
    if not any(dict(p) == dict(nominal) for p in points):
        raise UsageError("the grid must hold the nominal links (RateGrid.around adds them)")
    best: dict[tuple[object, ...], list[Point]] = {}
    nominal_key = plan_key(_best(tables, nominal))
    for point in points:
        best.setdefault(plan_key(_best(tables, point)), []).append(point)
    keys = [nominal_key] + [k for k in best if k != nominal_key]
    plans, anchors = [], []
    for key in keys:
        region = best[key]
        anchor = nominal if key == nominal_key else region[len(region) // 2]
        found = _best(tables, anchor)
        assert plan_key(found) == key, "the anchor of a region is a point of that region"
        plans.append(found)
        anchors.append(anchor)
    return GridChoice(
        nominal=dict(nominal),
        points=tuple(points),
        plans=tuple(plans),
        regions=tuple(tuple(best[k]) for k in keys),
        anchors=tuple(anchors),
    )
