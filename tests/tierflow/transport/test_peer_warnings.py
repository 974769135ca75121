"""Warnings about a peer: every one counted, at most one line per peer and kind in an
interval ([Note: warnings about a peer])."""

from __future__ import annotations

import logging

import pytest

from tierflow.transport.peer_warnings import PeerWarnings

logger = logging.getLogger("tierflow.test_peer_warnings")


def test_a_peers_warnings_are_counted_each_and_logged_once_an_interval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [100.0]
    warnings = PeerWarnings(interval_s=10.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger=logger.name):
        logged = [
            warnings.warn(logger, "edge", "undecodable", "10.0.0.1", "bad %d", i) for i in range(50)
        ]
        assert logged == [True] + [False] * 49
        # Another peer, or another kind, has its own line.
        assert warnings.warn(logger, "edge", "undecodable", "10.0.0.2", "bad from two")
        assert warnings.warn(logger, "edge", "reply_figures", "10.0.0.1", "figures")
        now[0] += 10.0
        assert warnings.warn(logger, "edge", "undecodable", "10.0.0.1", "bad again")
    lines = [record.getMessage() for record in caplog.records]
    assert lines == [
        "bad 0",
        "bad from two",
        "figures",
        "bad again (and 49 more like it from this peer not logged)",
    ]
    assert warnings.counts("edge") == {("edge", "undecodable"): 52, ("edge", "reply_figures"): 1}
    assert warnings.counts("cloud") == {}
