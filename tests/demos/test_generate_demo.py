"""``tierflow demo --generate`` end to end, and its one-line refusals."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tierflow.cli.main import main
from tierflow.demos import generation_setup as setup
from tierflow.demos.generate import HEADERS, plan_table
from tierflow.demos.generation_setup import STRATEGIES
from tierflow.link.spec import LinkSpec
from tierflow.zoo.tiny_stateful import tiny_decoder


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--requests", "5"], "--requests and --results-md are the digits demo's"),
        (["--max-tokens", "0"], "--max-tokens must be within 1..256"),
        (["--prompts", "40"], "--prompts within 1..32"),
    ],
)
def test_options_that_do_not_fit_are_one_line(extra: list[str], message: str, capsys: Any) -> None:
    assert main(["demo", "--generate", *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


def test_the_demos_plan_table_says_which_blocks_each_tier_holds(tmp_path: Path) -> None:
    """As ``tierflow plan`` of a decoder does: a ``blocks`` column, D- E0-3 C4-7 style."""
    paths = {
        "large": tiny_decoder(tmp_path / "large.onnx", blocks=4),
        "small": tiny_decoder(tmp_path / "small.onnx", blocks=2),
    }
    family = SimpleNamespace(path=paths.__getitem__)
    links = {"device-edge": LinkSpec(20e6, 0.03), "edge-cloud": LinkSpec(200e6, 0.02)}
    plans = setup.plan_family(
        family, links, tmp_path / "plans", context=64, max_tokens=8, prompt_tokens=8
    )
    assert sorted(b for unit in plans.large_blocks for b in unit) == [0, 1, 2, 3]
    header, _, *rows = plan_table(plans).splitlines()
    assert header.split()[:3] == ["plan", "units", "blocks"]
    (cloud_only,) = [row for row in rows if row.startswith("cloud-only")]
    assert cloud_only.split()[4:7] == ["D-", "E-", "C0-3"]  # after units' D- E- C0-N


@pytest.mark.integration
def test_the_generation_demo_streams_and_measures_every_strategy(
    byte_family: Any, tmp_path: Path
) -> None:
    workdir = tmp_path / "work"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "tierflow.cli",
            "demo",
            "--generate",
            "--max-tokens",
            "24",
            "--workdir",
            str(workdir),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    steps = done.stderr  # with --json the steps (and the streamed text) go to stderr
    assert "cached in" in steps and "[5/5] results" in steps
    planning = steps[steps.index("[2/5]") : steps.index("[3/5]")]
    # The plan table says which blocks each tier holds, as `tierflow plan` does.
    assert any(line.split()[:3] == ["plan", "units", "blocks"] for line in planning.splitlines())
    report = json.loads(done.stdout)
    assert report["links"] == {"device-edge": "20mbit,30ms", "edge-cloud": "200mbit,20ms"}
    rows = {row["strategy"]: row for row in report["strategies"]}
    assert tuple(rows) == STRATEGIES
    reference = report["reference"][0]
    for name, row in rows.items():
        assert row["tokens"] == 24 and row["tokens_per_s"] > 0 and row["ttft_ms"] > 0
        # Each strategy's text was streamed, labelled, as it came.
        assert f"  {name:<12}| " in steps
        if row["model"] == "large":
            assert row["agreement"] == 1.0, row  # computed against the unsplit greedy output
            assert row["round_trips_per_token"] > 0
    assert reference[:10] in steps  # the large model's text, as the split printed it
    split, drafted = rows["split"], rows["split+draft"]
    # The planner split the large model over all three tiers; the edge and the cloud keep
    # the KV cache of the blocks they run, all eight between them and the device.
    assert split["tiers"] == drafted["tiers"] == ["device", "edge", "cloud"]
    assert sorted(b for blocks in split["blocks"].values() for b in blocks) == list(range(8))
    assert {"edge", "cloud"} <= set(split["blocks"]) and split["blocks"] == drafted["blocks"]
    assert rows["cloud-only"]["blocks"] == {"cloud": list(range(8))}
    assert drafted["drafted"] > 0 and drafted["round_trips_per_token"] < 1.0
    assert split["round_trips_per_token"] == 1.0
    assert all(split["bytes_per_token"][link] > 0 for link in ("device-edge", "edge-cloud"))
    small = rows["device-only"]
    assert small["blocks"] == {"device": [0, 1]} and small["tiers"] == ["device"]
    assert small["round_trips_per_token"] == 0
    assert 0.0 <= small["agreement"] < 1.0  # the small model is not the large one
    assert any("split+draft against split" in note for note in report["notes"])
    for header in HEADERS:
        assert header in steps
    leftover = subprocess.run(
        ["pgrep", "-f", str(workdir)], capture_output=True, text=True, check=False
    )
    assert leftover.stdout.strip() == "", f"processes left running: {leftover.stdout}"
