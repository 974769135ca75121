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
