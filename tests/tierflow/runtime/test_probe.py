"""The probe allowance is per peer and refills over time ([Note: probe credit])."""

from __future__ import annotations

from tierflow.runtime.probe import PROBE_ALLOWANCE, ProbeCredit


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_peer_draws_its_allowance_once_then_what_has_refilled() -> None:
    clock = Clock()
    credit = ProbeCredit(allowance=1000, per_s=100, clock=clock)
    assert credit.draw("10.0.0.1", 800) == 800
    assert credit.draw("10.0.0.1", 800) == 200  # the rest of the bucket
    assert credit.draw("10.0.0.1", 800) == 0
    clock.now += 2.0
    assert credit.draw("10.0.0.1", 800) == 200  # 2 s at 100 B/s
    clock.now += 60.0
    assert credit.draw("10.0.0.1", 5000) == 1000  # never more than the bucket holds


def test_peers_have_their_own_allowance() -> None:
    credit = ProbeCredit(allowance=1000, per_s=0, clock=Clock())
    assert credit.draw("10.0.0.1", 1000) == 1000
    assert credit.draw("10.0.0.2", 1000) == 1000
    assert credit.draw("10.0.0.1", 1000) == 0


def test_many_asks_from_one_peer_get_one_allowance_in_all() -> None:
    credit = ProbeCredit(clock=Clock())
    granted = sum(credit.draw("ipv4-host", PROBE_ALLOWANCE) for _ in range(200))
    assert granted == PROBE_ALLOWANCE


def test_a_grant_is_never_negative_when_clock_readings_land_out_of_order() -> None:
    """Issue 28 finding 7: a draw whose clock reading is older than the one the draw
    before it stored (it read the clock first, outside the lock) refilled by a negative
    amount and granted a negative count, which reached ``bytes(size)``."""
    readings = iter([10.0, 5.0, 5.0])
    credit = ProbeCredit(allowance=1000, per_s=1000, clock=lambda: next(readings))
    assert credit.draw("10.0.0.1", 900) == 900
    assert credit.draw("10.0.0.1", 900) == 100  # no refill, and none taken back
    assert credit.draw("10.0.0.1", 900) == 0


def test_the_clock_is_read_under_the_lock() -> None:
    """So that the readings of two draws are in the order the draws take the bucket."""
    credit: ProbeCredit

    def clock() -> float:
        assert credit._lock.locked(), "the clock must be read under the lock"
        return 1.0

    credit = ProbeCredit(allowance=1000, per_s=1000, clock=clock)
    assert credit.draw("10.0.0.1", 10) == 10
