"""Stream admission counts: per peer (a host) and in all."""

from __future__ import annotations

import pytest

from tierflow.errors import UsageError
from tierflow.options import RuntimeOptions
from tierflow.runtime.admission import StreamAdmission, peer_host


@pytest.mark.parametrize(
    ("peer", "host"),
    [
        ("ipv4:10.0.0.5:40512", "10.0.0.5"),
        ("ipv6:[::1]:40512", "[::1]"),
        ("unix:/run/tierflow.sock", "unix:/run/tierflow.sock"),
        ("unix-abstract:edge", "unix-abstract:edge"),
    ],
)
def test_a_peer_is_its_host(peer: str, host: str) -> None:
    assert peer_host(peer) == host


def test_caps_per_peer_and_in_all_and_places_come_back() -> None:
    admission = StreamAdmission("edge", max_streams=3, max_per_peer=2)
    assert admission.admit("a") is None
    assert admission.admit("a") is None
    refusal = admission.admit("a")
    assert refusal is not None and refusal.startswith("OVERLOADED: the edge serves 2 streams")
    assert admission.admit("b") is None
    total = admission.admit("c")
    assert total is not None and "at most 3" in total
    admission.release("a")
    assert admission.open_streams == 2
    assert admission.admit("c") is None
    assert admission.open_streams == 3


@pytest.mark.parametrize("field", ["max_streams", "max_streams_per_peer"])
def test_stream_caps_must_be_positive(field: str) -> None:
    with pytest.raises(UsageError, match=f"{field} must be >= 1"):
        RuntimeOptions(**{field: 0})  # type: ignore[arg-type]


def test_hosts_at_their_cap_leave_room_for_other_hosts_devices() -> None:
    """Issue 28 finding 6: four hosts at the cap per peer filled the global cap."""
    admission = StreamAdmission("edge", max_streams=16, max_per_peer=4)
    assert admission.reserve == 4
    for host in ("h1", "h2", "h3"):  # the open three quarters
        assert all(admission.admit(host) is None for _ in range(4))
        assert admission.admit(host) is not None  # a host at its cap is refused
    assert admission.open_streams == 12
    # A fourth host gets a share of the reserve, not all of it: fewer than remain free.
    assert admission.admit("h4") is None  # holds 0 < 4 free
    assert admission.admit("h4") is None  # 1 < 3
    refusal = admission.admit("h4")  # 2 >= 2 free
    assert refusal is not None and "kept for peers holding fewer streams" in refusal
    # Other hosts' devices still get in, one each, to the last place.
    assert admission.admit("device-a") is None
    assert admission.admit("device-b") is None
    assert admission.open_streams == 16
    assert admission.admit("device-c") is not None  # full
    admission.release("h1")
    assert admission.admit("h1") is not None  # 3 held >= 1 free: the place is for others
    assert admission.admit("device-c") is None


def test_small_caps_keep_no_reserve() -> None:
    admission = StreamAdmission("edge", max_streams=3, max_per_peer=3)
    assert admission.reserve == 0
    assert all(admission.admit("a") is None for _ in range(3))
