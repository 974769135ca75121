"""``tierflow probe`` against running tiers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tierflow.cli import main
from tierflow.edge.probe import ProbeResult, probe
from tierflow.errors import TransportError


def test_probe_measures_plausible_rtt_and_rate(tmp_path: Path, rt: Any, capsys: Any) -> None:
    split = rt.cnn(tmp_path / "plan")
    with rt.tiers(split.plan_dir) as (edge, _, cloud):
        result = probe(edge, pings=5, payload_bytes=1 << 20, transfers=2)
        assert main(["probe", cloud.address, "--json", "--pings", "5", "--payload", "1MiB"]) == 0
    assert result.link == "device-edge"
    assert 0 < result.rtt_s < 0.5
    assert 1e7 < result.rate_bps < 1e12  # loopback: far above a real link, but finite
    assert result.link_option().startswith("device-edge=")
    printed = json.loads(capsys.readouterr().out)
    again = ProbeResult.from_dict(printed)
    assert again.link == "edge-cloud" and again.rate_bps > 0 and set(printed) >= {"samples"}


def test_probe_of_nothing_is_a_transport_error() -> None:
    with pytest.raises(TransportError, match="cannot reach"):
        probe("127.0.0.1:1", pings=1, transfers=1, connect_timeout=1.0)
