"""The grid search behind ``plan --adaptive``: pure, deterministic, one best plan per point."""

from __future__ import annotations

import numpy as np
import pytest

from tierflow.errors import UsageError
from tierflow.link.spec import LinkSpec
from tierflow.partitioner.cost import Problem, build_tables, with_links
from tierflow.partitioner.grid import RateGrid, grid_search, plan_key
from tierflow.partitioner.search import search

from .conftest import make_profile

UNITS = [0.010, 0.020, 0.020, 0.010]
CUTS = [150_000, 800_000, 200_000, 50_000, 4_000]  # input, shrinking features, output


def _links(de_bps: float, ec_bps: float) -> dict[str, LinkSpec]:
    return {"device-edge": LinkSpec(de_bps, 0.01), "edge-cloud": LinkSpec(ec_bps, 0.03)}


def _problem(links: dict[str, LinkSpec]) -> Problem:
    device = make_profile(UNITS, CUTS).emulate(8.0)
    profiles = {"device": device, "edge": device.emulate(0.25), "cloud": device.emulate(0.05)}
    return Problem(profiles, links, codecs=("raw", "zstd"))


def test_with_links_equals_tables_built_for_those_links() -> None:
    nominal, other = _links(20e6, 200e6), _links(1e6, 1e9)
    retimed = with_links(build_tables(_problem(nominal)), other)
    fresh = build_tables(_problem(other))
    for name, table in fresh.links.items():
        np.testing.assert_array_equal(retimed.links[name].total_s, table.total_s)
    assert retimed.problem.links == other
    assert search(retimed.problem, tables=retimed).best == search(fresh.problem).best


def test_every_point_gets_the_plan_a_search_at_that_point_finds() -> None:
    nominal = _links(20e6, 200e6)
    grid = RateGrid.around(nominal, ["device-edge=100kbit,2mbit,1gbit", "edge-cloud=5mbit,10gbit"])
    choice = grid_search(build_tables(_problem(nominal)), grid, nominal)
    assert len(choice.points) == 4 * 3
    assert sum(len(region) for region in choice.regions) == len(choice.points)
    for point in choice.points:
        alone = search(_problem(dict(point))).best
        assert plan_key(choice.plans[choice.best_at(point)]) == plan_key(alone)
    # The default is the plan for the nominal links, estimated there.
    assert choice.anchors[0] == nominal
    assert plan_key(choice.plans[0]) == plan_key(search(_problem(nominal)).best)
    # A link too slow to send anything keeps the work on the device; a fast one moves it up.
    assert choice.plans[choice.best_at(_links(100e3, 5e6))].tiers == ("device",)
    assert choice.plans[choice.best_at(_links(1e9, 10e9))].tiers != ("device",)
    assert len(choice.plans) >= 2
    keys = [plan_key(p) for p in choice.plans]
    assert len(set(keys)) == len(keys)


def test_the_grid_search_is_deterministic() -> None:
    nominal = _links(20e6, 200e6)
    grid = RateGrid.around(nominal)
    tables = build_tables(_problem(nominal))
    assert grid_search(tables, grid, nominal) == grid_search(tables, grid, nominal)


def test_grid_values_are_checked() -> None:
    nominal = _links(20e6, 200e6)
    grid = RateGrid.around(nominal, ["device-edge=1mbit,5mbit/0ms,50ms"])
    assert grid.rates["device-edge"] == (1e6, 5e6, 20e6)
    assert grid.rtts["device-edge"] == (0.0, 0.01, 0.05)
    assert len(grid.points()) == 3 * 3 * len(grid.rates["edge-cloud"])
    for text, message in [
        ("wifi=1mbit", "unknown link"),
        ("device-edge", "malformed --grid"),
        ("device-edge=fast", "malformed rate"),
        ("device-edge=1mbit/soon", "malformed duration"),
    ]:
        with pytest.raises(UsageError, match=message):
            RateGrid.around(nominal, [text])
