"""Every command's ``--help``: a description, examples, help for each option, one default style."""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator

import pytest

from tierflow.cli.helptext import EXAMPLES_HEADING
from tierflow.cli.main import build_parser


def _commands(
    parser: argparse.ArgumentParser, name: str = "tierflow"
) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub, subparser in action.choices.items():
                yield from _commands(subparser, f"{name} {sub}")


COMMANDS = dict(_commands(build_parser()))


def test_every_command_is_walked() -> None:
    expected = {"profile", "plan", "serve edge", "serve cloud", "probe", "run"}
    expected |= {"exits add", "exits show", "demo"}
    assert {f"tierflow {c}" for c in expected} <= set(COMMANDS)


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_help_describes_shows_examples_and_defaults_one_way(name: str) -> None:
    parser = COMMANDS[name]
    text = parser.format_help()
    assert parser.description, f"{name}: no description"
    assert f"\n{EXAMPLES_HEADING}\n  " in text, f"{name}: no examples"
    examples = text.split(f"\n{EXAMPLES_HEADING}\n", 1)[1]
    assert f"  {name}" in examples, f"{name}: its examples do not run it"
    assert "(default: None)" not in text, name
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction | argparse._VersionAction):
            continue
        if isinstance(action, argparse._SubParsersAction):
            continue
        shown = action.option_strings or [action.dest]
        assert action.help, f"{name} {shown}: no help"
        # One default style: "(default: X)", never "defaults: ..." or "(default 3)".
        for match in re.finditer(r"default", action.help):
            assert action.help[match.start() - 1 : match.end() + 2] == "(default: ", (
                f"{name} {shown}: {action.help!r}"
            )
        if action.required:
            assert "(default:" not in (parser._get_formatter()._get_help_string(action) or "")


def test_defaults_are_shown_where_there_is_one() -> None:
    plan = COMMANDS["tierflow plan"].format_help()
    assert "(default: latency)" in plan and "(default: 5)" in plan
    assert "the plan directory to write" in plan
