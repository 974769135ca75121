"""A request's timing figures when only the device worked on it (device/results.py)."""

from __future__ import annotations

from tierflow.device.results import local_ms
from tierflow.link.spec import TIERS


def test_local_figures_name_every_tier_and_add_up_to_the_total() -> None:
    ms = local_ms(12.0, device=5.0, network=7.0)
    # Every figure a run's summary reads (device/commands.py), each tier included.
    assert set(ms) == {*TIERS, "total", "queue", "network"}
    assert ms["device"] == 5.0 and ms["network"] == 7.0 and ms["total"] == 12.0
    assert ms["edge"] == ms["cloud"] == ms["queue"] == 0.0
    assert local_ms(3.0, device=3.0)["network"] == 0.0
