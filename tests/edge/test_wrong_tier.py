"""A command given the address of the wrong tier says so at start.

See [Note: which tier answers] in ``tierflow.transport.address``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tierflow.cli.main import main
from tierflow.transport.address import Address, answering_tier

pytestmark = pytest.mark.integration


def test_each_tier_names_itself_and_an_empty_port_is_no_verdict(tmp_path: Path, rt: Any) -> None:
    split = rt.cnn(tmp_path / "plan")
    with rt.tiers(split.plan_dir) as (edge, _, cloud):
        assert answering_tier(Address.parse(edge)) == "edge"
        assert answering_tier(Address.parse(cloud.address)) == "cloud"
    assert answering_tier(Address.parse(f"127.0.0.1:{rt.free_port()}"), timeout=2.0) is None


def test_run_and_device_pointed_at_a_cloud_fail_in_one_line(
    tmp_path: Path, rt: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """Not a run that skips the edge and still calls its hop ``device-edge``."""
    split = rt.cnn(tmp_path / "plan")
    with rt.tiers(split.plan_dir) as (_, _, cloud):
        run = ["run", "--plan", str(split.plan_dir), "--edge", cloud.address, "--input", "in.npz"]
        device = ["device", "--plan", str(split.plan_dir), "--edge", cloud.address]
        for argv in (run, [*device, "--source", "-"]):
            assert main(argv) == 2
            err = capsys.readouterr().err
            assert err.count("\n") == 1, err
            wrong = f"--edge {cloud.address}: the tier answering there is a cloud, not an edge"
            assert wrong in err


def test_an_edge_whose_upstream_is_an_edge_fails_in_one_line(
    tmp_path: Path, rt: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    split = rt.cnn(tmp_path / "plan")
    with rt.tiers(split.plan_dir) as (edge, _, _):
        assert main(["serve", "edge", "--plan", str(split.plan_dir), "--upstream", edge]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert f"--upstream {edge}: the tier answering there is an edge, not a cloud" in err
