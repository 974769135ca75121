"""``--config FILE.toml``: command-line options from a TOML file, for the long-running commands.

The file holds the same names as the flags, without the dashes in front, at the top level
(``listen = "0.0.0.0:50051"``, ``max-tensor-bytes = "1GiB"``, ``threads = 2``; ``_`` may
stand for ``-``). A flag given on the command line wins over the file; for repeatable
options (``emulate-link = ["device-edge=20mbit,10ms"]``) the command line's values replace the
file's. The file is checked against the command's own argparse options before anything
runs: an unknown key, a value of the wrong TOML type, a value the option's parser refuses
or one outside its choices is a :class:`~tierflow.errors.UsageError` naming the file, the
key and what was expected. A flag's old spelling ([Note: deprecated spellings] in
``tierflow.cli.arguments``) is an accepted key too (``link`` for ``emulate-link``), with
the same one-line notice on stderr as on the command line; a file may not give both.

It works on any argparse command, so a new flag is settable in the file with no code
here: the values become the subcommand's defaults (``set_defaults``), which argparse then
overrides with what the command line gives. Boolean flags take ``true``/``false``; options
that take a list (repeatable ones, ``nargs``) take a TOML array or a single value.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tierflow.cli.arguments import REPLACED_BY, deprecation_notice
from tierflow.errors import TierflowError, UsageError, shown

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser, from PyPI (a runtime dependency there)
    import tomli as tomllib

OPTION = "--config"
HELP = "read options from this TOML file (keys are the flag names; flags given here win)"

# Actions that take no value: TOML booleans switch them on or off.
_SWITCHES = (
    argparse._StoreTrueAction,
    argparse._StoreFalseAction,
    argparse._StoreConstAction,
    argparse._AppendConstAction,
)
_NOT_SETTABLE = (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction)


def add_config_option(root: argparse.ArgumentParser, commands: Sequence[str]) -> None:
    """Give each of ``commands`` (like ``"serve edge"``) a ``--config`` option, if it exists."""
    for command in commands:
        parser = _find_parser(root, command.split())
        if parser is not None:
            parser.add_argument(OPTION, metavar="FILE.toml", help=HELP)


def apply_config(root: argparse.ArgumentParser, argv: Sequence[str]) -> Path | None:
    """Load the file ``argv`` names with ``--config`` into its command's defaults.

    Returns the file, or None when ``argv`` names none. Call before ``parse_args``.
    """
    parser, rest = _command_parser(root, argv)
    if parser is None or not any(OPTION in a.option_strings for a in parser._actions):
        return None
    path = _config_path(rest)
    if path is None:
        return None
    values = load_toml(path)
    given = _flags_given(rest)
    options = _settable_options(parser)
    # Every flag that sets a dest (a deprecated spelling shares its new flag's).
    flags_of: dict[str, set[str]] = {}
    for known in options.values():
        flags_of.setdefault(known.dest, set()).update(known.option_strings)
    defaults: dict[str, Any] = {}
    keys: dict[str, str] = {}
    for key, value in values.items():
        name = key.replace("_", "-")
        action = options.get(name)
        if action is None:
            current = sorted(n for n, a in options.items() if not hasattr(a, REPLACED_BY))
            close = difflib.get_close_matches(name, current, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise UsageError(
                f"config file {path}: unknown key {shown(key)}{hint}; this command takes "
                f"{', '.join(current)}"
            )
        if action.dest in keys:
            raise UsageError(
                f"config file {path}: {keys[action.dest]!r} and {key!r} set the same option; "
                "keep one"
            )
        keys[action.dest] = key
        replaced_by = getattr(action, REPLACED_BY, None)
        if replaced_by is not None:
            new_key = replaced_by.removeprefix("--")
            print(
                deprecation_notice(repr(key), repr(new_key), f"config file {path}"),
                file=sys.stderr,
            )
        if given & flags_of[action.dest]:
            continue  # the command line wins
        defaults[action.dest] = _default_for(action, value, f"config file {path}: {key}")
        action.required = False
    parser.set_defaults(**defaults)
    return path


def check_config_used(args: argparse.Namespace, loaded: Path | None) -> None:
    """Raise if argparse saw a ``--config`` that :func:`apply_config` did not (abbreviated)."""
    given = getattr(args, "config", None)
    if given is not None and (loaded is None or Path(given) != loaded):
        raise UsageError(f"write {OPTION} in full (found an abbreviation of it)")


def load_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as file:
            return tomllib.load(file)
    except FileNotFoundError as exc:
        raise UsageError(f"config file {path} does not exist") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"cannot read config file {path}: {exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"config file {path} is not valid TOML: {exc}") from exc


# --------------------------------------------------------------------------- argparse


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _find_parser(
    root: argparse.ArgumentParser, path: Sequence[str]
) -> argparse.ArgumentParser | None:
    parser = root
    for name in path:
        found = _subcommands(parser).get(name)
        if found is None:
            return None
        parser = found
    return parser


def _command_parser(
    root: argparse.ArgumentParser, argv: Sequence[str]
) -> tuple[argparse.ArgumentParser | None, list[str]]:
    """The parser of the (sub)command ``argv`` names, and the tokens after its name."""
    parser = root
    tokens = list(argv)
    index = 0
    while index < len(tokens):
        choices = _subcommands(parser)
        if not choices:
            break
        token = tokens[index]
        index += 1
        if token.startswith("-"):
            continue  # an option of the parent (tierflow -v serve edge ...)
        if token not in choices:
            return None, []
        parser = choices[token]
        tokens = tokens[index:]
        index = 0
    return (parser, tokens) if parser is not root else (None, [])


def _config_path(tokens: Sequence[str]) -> Path | None:
    for index, token in enumerate(tokens):
        if token == "--":
            break
        if token == OPTION:
            if index + 1 >= len(tokens):
                return None  # argparse reports the missing value
            return Path(tokens[index + 1])
        if token.startswith(OPTION + "="):
            return Path(token.split("=", 1)[1])
    return None


def _flags_given(tokens: Sequence[str]) -> set[str]:
    given = set()
    for token in tokens:
        if token == "--":
            break
        if token.startswith("-"):
            given.add(token.split("=", 1)[0])
    return given


def _settable_options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Long option names (without ``--``) -> their actions, for every settable option."""
    options = {}
    for action in parser._actions:
        if isinstance(action, _NOT_SETTABLE) or OPTION in action.option_strings:
            continue
        for option in action.option_strings:
            if option.startswith("--"):
                options[option[2:]] = action
    return options


# --------------------------------------------------------------------------- values


def _describe(value: Any) -> str:
    kinds = {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}
    kinds.update({list: "an array", dict: "a table"})
    return f"{kinds.get(type(value), type(value).__name__)} ({shown(value)})"


def _default_for(action: argparse.Action, value: Any, where: str) -> Any:
    """The default that makes argparse behave as if the file's ``value`` had been given."""
    if isinstance(action, _SWITCHES):
        if not isinstance(value, bool):
            raise UsageError(f"{where}: expected true or false, found {_describe(value)}")
        if isinstance(action, argparse._AppendConstAction):
            return [action.const] if value else action.default
        return action.const if value else action.default
    if isinstance(action, argparse._CountAction):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise UsageError(f"{where}: expected a count (0, 1, 2...), found {_describe(value)}")
        return value
    many = (
        isinstance(action, argparse._AppendAction)
        or action.nargs in ("*", "+")
        or (isinstance(action.nargs, int) and action.nargs > 1)
    )
    if not many:
        text = _scalar_text(action, value, where)
        converted = _convert(action, text, where)
        # argparse runs a string default through the option's type itself.
        return text if action.type is not None else converted
    items = value if isinstance(value, list) else [value]
    if isinstance(action.nargs, int) and len(items) != action.nargs:
        raise UsageError(f"{where}: expected {action.nargs} values, found {len(items)}")
    if action.nargs == "+" and not items:
        raise UsageError(f"{where}: expected at least one value, found an empty array")
    converted = [_convert(action, _scalar_text(action, item, where), where) for item in items]
    if isinstance(action, argparse._AppendAction) and action.nargs not in (None, "?"):
        return [converted]
    return converted


def _scalar_text(action: argparse.Action, value: Any, where: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise UsageError(f"{where}: expected {_expected(action)}, found {_describe(value)}")
    if action.type is int and not isinstance(value, int):
        raise UsageError(f"{where}: expected an integer, found {_describe(value)}")
    if action.type is float and not isinstance(value, (int, float)):
        raise UsageError(f"{where}: expected a number, found {_describe(value)}")
    if action.type in (None, str) and not isinstance(value, str):
        raise UsageError(f"{where}: expected a string, found {_describe(value)}")
    return str(value)


def _expected(action: argparse.Action) -> str:
    if action.type is int:
        return "an integer"
    if action.type is float:
        return "a number"
    return "a string" if action.metavar is None else f"a string like {action.metavar}"


def _convert(action: argparse.Action, text: str, where: str) -> Any:
    """Run ``text`` through the option's own type and choices, as the flag would be."""
    try:
        converted = action.type(text) if callable(action.type) else text
    except (ValueError, TypeError, argparse.ArgumentTypeError, TierflowError) as exc:
        raise UsageError(f"{where}: {shown(text)} is not accepted: {exc}") from exc
    if action.choices is not None and converted not in action.choices:
        choices = ", ".join(map(str, action.choices))
        raise UsageError(f"{where}: expected one of {choices}, found {shown(text)}")
    return converted
