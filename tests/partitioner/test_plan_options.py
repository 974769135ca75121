"""``plan``'s options, each parsed once into a typed value where it enters (no model loaded)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tierflow.cli.main import build_parser, main
from tierflow.link.spec import LinkOption, LinkSpec
from tierflow.partitioner.commands import plan_links

PLAN = ["plan", "missing.onnx", "-o", "out"]


def _error(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    assert main([*PLAN, *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tierflow plan: error: ") and err.count("\n") == 1, err
    return err


def test_values_become_typed_values() -> None:
    args = build_parser().parse_args(
        [
            *PLAN,
            *("--link", "device-edge=5mbit", "--memory", "device=64MiB"),
            *("--slowdown", "device=8", "--profile", "cloud=server.json"),
        ]
    )
    assert args.link == [(LinkOption("device-edge", 5e6, None),)]
    assert args.memory == [("device", 64 << 20)]
    assert args.slowdown == [("device", 8.0)]
    assert args.profile == [("cloud", Path("server.json"))]


def test_links_keep_their_rtt_when_only_a_rate_is_given(tmp_path: Path) -> None:
    probe = tmp_path / "edge.json"
    probe.write_text(json.dumps({"link": "edge-cloud", "rate_bps": 1e8, "rtt_s": 0.002}))
    args = build_parser().parse_args([*PLAN, "--link", "device-edge=5mbit", "--link", str(probe)])
    links, kept = plan_links(args.link)
    assert links["device-edge"] == LinkSpec(5e6, 0.01)  # the planner's default RTT
    assert links["edge-cloud"] == LinkSpec(1e8, 0.002)  # a probe gives both
    assert kept == {"device-edge": "10ms"}
    # A later value with an RTT for the same link: nothing was assumed for it.
    args = build_parser().parse_args(
        [*PLAN, "--link", "device-edge=5mbit", "--link", "device-edge=5mbit,1ms"]
    )
    assert plan_links(args.link) == (
        {"device-edge": LinkSpec(5e6, 0.001), "edge-cloud": LinkSpec(200e6, 0.03)},
        {},
    )


def test_a_memory_budget_without_a_unit_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    """``--memory device=64`` was 64 bytes: a silent edge-only plan.

    See [Note: sizes carry a unit] in ``tierflow.units``.
    """
    err = _error(capsys, "--memory", "device=64")
    assert "a size needs a unit" in err and "'64MiB'" in err
    assert build_parser().parse_args([*PLAN, "--memory", "device=64B"]).memory == [("device", 64)]


def test_a_profile_given_as_a_link_is_named_not_printed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    profile = tmp_path / "pi4.json"
    units = [{"index": i, "compute_s": 0.001 * i, "weight_bytes": 4096} for i in range(200)]
    profile.write_text(json.dumps({"format": "tierflow.profile/1", "units": units}))
    assert profile.stat().st_size > 10_000
    err = _error(capsys, "--link", f"device-edge={profile}")
    assert len(err) < 400 and "compute_s" not in err
    assert f"link file {profile} is not a probe result" in err
    assert "it is a profile: give it as --profile TIER=FILE" in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--link", "device-edge=" + "9" * 5000], "(5,000 characters)"),
        (["--link", "device-edge=" + "x" * 5000], "(5,000 characters)"),
        (["--link", "x" * 5000], "(5,000 characters)"),
        (["--slowdown", "device=fast"], "malformed slowdown 'fast': expected how many"),
        (["--slowdown", "device=0"], "a slowdown must be positive"),
        (["--slowdown", "phone=2"], "unknown tier 'phone'"),
        (["--memory", "device=" + "x" * 500], "characters)"),
    ],
)
def test_bad_values_are_one_short_line(
    capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    err = _error(capsys, *args)
    assert message in err and len(err) < 400


def test_the_old_emulate_spelling_is_slowdown_with_a_notice(
    capsys: pytest.CaptureFixture[str],
) -> None:
    parser = build_parser()
    old = parser.parse_args([*PLAN, "--emulate", "device=8", "--emulate", "edge=3"])
    notice = capsys.readouterr().err
    new = parser.parse_args([*PLAN, "--slowdown", "device=8", "--slowdown", "edge=3"])
    assert old.slowdown == new.slowdown == [("device", 8.0), ("edge", 3.0)]
    assert notice.count("\n") == 1 and "--emulate is deprecated" in notice
    assert "write --slowdown" in notice and capsys.readouterr().err == ""
