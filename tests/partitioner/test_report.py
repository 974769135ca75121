"""What ``plan`` prints: the ``units`` column of its tables is explained under them."""

from __future__ import annotations

import dataclasses

from tierflow.link.spec import LinkSpec
from tierflow.partitioner.cost import Problem
from tierflow.partitioner.report import plan_table, units_legend
from tierflow.partitioner.search import SearchResult, search

from .conftest import make_profile

# Cut 2 carries 50 kB against 150 kB of input, after two cheap units.
UNITS = [0.001, 0.001, 0.05, 0.05]
CUTS = [150_000, 800_000, 50_000, 40_000, 4_000]


def _result() -> SearchResult:
    device = make_profile(UNITS, CUTS).emulate(2.0)
    links = {"device-edge": LinkSpec(10e6, 0.0), "edge-cloud": LinkSpec(1e9, 0.0)}
    tiers = {"device": device, "edge": device.emulate(0.1), "cloud": device.emulate(0.1)}
    return search(Problem(tiers, links))


def test_the_legend_reads_the_best_plans_own_split() -> None:
    best = _result().best
    assert best.cuts == (2, 4) and best.last == 4
    legend = units_legend(best)
    assert legend.startswith("units: the model's 4 units")
    assert "TIER START-END runs units START to END-1, TIER- none" in legend
    assert "D0-2: the device runs units 0-1" in legend
    assert "E2-4: the edge runs units 2-3" in legend
    assert "C-: the cloud runs none" in legend
    one = dataclasses.replace(best, cuts=(1, 4))
    assert "D0-1: the device runs unit 0," in units_legend(one)


def test_the_plan_table_ends_with_the_legend() -> None:
    result = _result()
    table = plan_table(result, {})
    header, *_, last = table.splitlines()
    assert "units" in header.split()
    assert last == units_legend(result.best)
