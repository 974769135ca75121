"""The systemd units and their TOML files in ``demos/``: what the deployment guide installs.

Each unit's ``ExecStart`` must be a ``tierflow serve`` command line the real parser takes
with its TOML file (copied where the unit expects it); a unit must want what it orders
itself after and wait before a restart; a server listening on every address must use TLS.
"""

from __future__ import annotations

import configparser
import shlex
from pathlib import Path

import pytest

from tierflow.cli.config import apply_config
from tierflow.cli.main import build_parser

DEMOS = Path(__file__).resolve().parents[2] / "demos"


def _unit(name: str) -> configparser.ConfigParser:
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str  # type: ignore[assignment,method-assign]
    unit.read_string((DEMOS / name).read_text())
    return unit


@pytest.mark.parametrize("tier", ["edge", "cloud"])
def test_unit_and_config(tier: str, tmp_path: Path) -> None:
    unit = _unit(f"tierflow-{tier}.service")
    after = set(unit["Unit"]["After"].split())
    wants = set(unit["Unit"]["Wants"].split())
    assert after <= wants, f"ordered after {after - wants} without wanting it"
    assert float(unit["Service"]["RestartSec"]) > 0
    assert unit["Service"]["Restart"] == "on-failure"

    argv = shlex.split(unit["Service"]["ExecStart"])
    assert argv[:3] == ["/opt/tierflow/bin/tierflow", "serve", tier]
    installed = argv[argv.index("--config") + 1]
    assert installed == f"/etc/tierflow/{tier}.toml"
    config = tmp_path / f"{tier}.toml"
    config.write_text((DEMOS / f"{tier}.toml").read_text())
    argv = [*argv[1:-1], str(config)]
    parser = build_parser()
    assert apply_config(parser, argv) == config
    args = parser.parse_args(argv)
    assert args.plan is not None and float(unit["Service"]["TimeoutStopSec"]) > args.grace + 1
    if args.listen.startswith("0.0.0.0:"):
        assert args.tls_cert and args.tls_key and args.tls_ca and not args.insecure
    if tier == "edge":
        assert args.upstream
    # Each file starts a runtime-only install (pip install ./tierflow, no extras): the
    # metrics port needs prometheus_client, so it stays commented out (issue 30, 14).
    assert args.metrics_port is None, f"{tier}.toml sets metrics-port, which needs an extra"
    assert "# metrics-port = " in (DEMOS / f"{tier}.toml").read_text()
