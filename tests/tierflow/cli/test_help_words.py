"""What a newcomer reads in ``--help`` and in errors (issue 30, item 13)."""

from __future__ import annotations

import pytest

from tierflow.cli.main import CONFIG_COMMANDS, _commands, build_parser, main
from tierflow.codec.spec import EXACT_PLANNER_CODECS, LOSSY_PLANNER_CODECS
from tierflow.units import parse_seconds, parse_slowdown, positive_seconds

_PARSER = build_parser()
_COMMANDS = {" ".join(words): parser for words, parser in _commands(_PARSER).items()}


@pytest.mark.parametrize("command", sorted(_COMMANDS))
def test_no_value_is_named_by_its_option_in_capitals(command: str) -> None:
    """``--grace GRACE``, ``--requests REQUESTS``: argparse's placeholders say nothing."""
    text = _COMMANDS[command].format_help()
    for action in _COMMANDS[command]._actions:
        if action.option_strings and action.nargs != 0 and action.metavar is None:
            assert f"{action.option_strings[-1]} {action.dest.upper()}" not in text, command


@pytest.mark.parametrize("command", sorted(_COMMANDS))
def test_help_shows_no_restructuredtext(command: str) -> None:
    text = _COMMANDS[command].format_help()
    for markup in ("``", ":class:", ":func:", ":mod:", "[Note:"):
        assert markup not in text, f"tierflow {command} --help shows {markup}"


def test_plan_codec_help_names_every_codec_auto_chooses_and_the_image_codecs() -> None:
    text = " ".join(_COMMANDS["plan"].format_help().split())
    for codec in (*EXACT_PLANNER_CODECS, *LOSSY_PLANNER_CODECS, "jpeg:QUALITY", "png", "int4"):
        assert codec in text, codec


@pytest.mark.parametrize(
    ("flag", "values"),
    [
        (["serve", "edge", "--plan", "p", "--grace"], {"10s": 10.0, "10": 10.0, "500ms": 0.5}),
        (["serve", "cloud", "--plan", "p", "--reply-timeout"], {"5s": 5.0, "5": 5.0}),
        (["serve", "cloud", "--plan", "p", "--stream-idle"], {"60": 60.0, "60s": 60.0}),
        (["serve", "cloud", "--plan", "p", "--state-idle"], {"90": 90.0, "2s": 2.0}),
        (["run", "--plan", "p", "--input", "i", "--retry"], {"2": 2.0, "250ms": 0.25}),
        (["device", "--plan", "p", "--source", "-", "--poll"], {"1": 1.0, "100ms": 0.1}),
        (["profile", "m.onnx", "-o", "p.json", "--time-budget"], {"5": 5.0, "5s": 5.0}),
    ],
)
def test_every_duration_takes_a_unit_or_bare_seconds(
    flag: list[str], values: dict[str, float]
) -> None:
    """One rule ([Note: durations on the command line]): --grace 10s and --reply-timeout 5s
    were refused, while --stream-idle 60 and --deadline 5 were refused for lacking a unit."""
    dest = flag[-1].lstrip("-").replace("-", "_")
    for text, seconds in values.items():
        assert getattr(_PARSER.parse_args([*flag, text]), dest) == seconds
    run = _PARSER.parse_args(["generate", "--plan", "p", "--prompt-ids", "1", "--deadline", "5"])
    assert run.deadline.seconds == 5.0


def test_durations_and_slowdowns_refuse_what_they_cannot_mean() -> None:
    for text, message in [
        ("-1", "cannot be negative"),
        ("-1s", "malformed"),
        ("soon", "malformed"),
    ]:
        with pytest.raises(Exception, match=message):
            parse_seconds(text)
    with pytest.raises(Exception, match="positive duration"):
        positive_seconds("0")
    assert parse_slowdown("8") == parse_slowdown("8x") == parse_slowdown(" 8X ") == 8.0
    for bad in ("0", "-2x", "fast", "inf"):
        with pytest.raises(Exception, match="malformed slowdown"):
            parse_slowdown(bad)


@pytest.mark.parametrize(
    "argv",
    [
        ["serve", "edge", "--plan", "p", "--slowdown", "8x"],
        ["run", "--plan", "p", "--input", "i", "--slowdown", "8x"],
        ["profile", "m.onnx", "-o", "p.json", "--slowdown", "8x"],
    ],
)
def test_slowdown_takes_one_form_everywhere(argv: list[str]) -> None:
    assert _PARSER.parse_args(argv).slowdown == 8.0
    planned = _PARSER.parse_args(["plan", "m.onnx", "-o", "p", "--slowdown", "device=8x"])
    assert dict(planned.slowdown) == {"device": 8.0}


def test_probe_names_its_link_with_link_name() -> None:
    args = _PARSER.parse_args(["probe", "127.0.0.1:1", "--link-name", "edge-cloud"])
    assert args.link == "edge-cloud"
    assert "--link-name NAME" in _COMMANDS["probe"].format_help()


def test_generate_reads_a_config_file_and_says_links_are_shaped_per_process() -> None:
    assert "generate" in CONFIG_COMMANDS
    text = " ".join(_COMMANDS["generate"].format_help().split())
    assert "--config FILE.toml" in text and "give the same to serve edge and serve cloud" in text


@pytest.mark.parametrize(
    ("argv", "prefix"),
    [
        (["serve", "cloud", "--plan", "/nonexistent"], "tierflow serve cloud: error: "),
        (["serve", "edge", "--config", "/nonexistent.toml"], "tierflow serve edge: error: "),
        (["serve", "edge", "--plan", "p", "--listen", "1:99999"], "tierflow serve edge: error: "),
        (["exits", "add", "m.onnx", "--calib", "c", "-o", "/no/x"], "tierflow exits add: error: "),
    ],
)
def test_every_error_line_names_the_whole_command(
    capsys: pytest.CaptureFixture[str], argv: list[str], prefix: str
) -> None:
    """It was 'tierflow serve:', 'tierflow serve cloud:' or 'tierflow:' by where it failed."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(prefix) and err.count("\n") == 1, err
