"""How options become typed values: refusals as one line, and old spellings that still work.

Every option is parsed once, where it enters, by the ``type=`` of its argparse argument
(a :class:`~tierflow.link.spec.LinkOption`, a :class:`~tierflow.transport.deadline.Deadline`,
a size in bytes...); handlers and everything inward take those values, never the text.
Those parsers raise the project's :class:`~tierflow.errors.UsageError`, whose message
already says what was expected and what was found; :class:`ArgumentParser` passes it on
as an :class:`OptionError` so that the CLI prints it as every other error, on one line
(``tierflow plan: error: a size needs a unit: ...``), instead of argparse's "invalid
value" or a traceback.

[Note: deprecated spellings]
When a flag is renamed (one name per idea: ``--link`` on a runtime is now
``--emulate-link``, ``plan --emulate`` is ``plan --slowdown``), the old spelling keeps
working for a while: :func:`add_deprecated` adds it with the new flag's ``dest`` and
parser, hidden from ``--help``, and each command line that uses it gets one line on
stderr naming the new spelling. A config file's old key (``tierflow.cli.config``) is
accepted the same way, with the same notice.
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from tierflow.errors import TierflowError, UsageError

T = TypeVar("T")

#: The attribute of an action added by :func:`add_deprecated`: the flag that replaces it.
REPLACED_BY = "replaced_by"
# Set on a namespace once it has printed a deprecation notice for a flag.
_NOTED = "_deprecations_noted"


class OptionError(UsageError):
    """A value on the command line that its option's parser refused; ``prog`` is the command."""

    def __init__(self, message: str, prog: str) -> None:
        super().__init__(message)
        self.prog = prog


class ArgumentParser(argparse.ArgumentParser):
    """argparse, with an option parser's :class:`TierflowError` raised as an :class:`OptionError`.

    argparse reports only ``ArgumentTypeError`` and ``ValueError`` from a ``type=``, as
    "invalid value", and lets anything else out as a traceback. Subcommands' parsers
    are of the same class (``add_subparsers`` uses the parent's).
    """

    def _get_value(self, action: argparse.Action, arg_string: str) -> Any:
        try:
            return super()._get_value(action, arg_string)
        except OptionError:
            raise
        except TierflowError as exc:
            raise OptionError(str(exc), self.prog) from exc


def argument_type(parse: Callable[[str], T]) -> Callable[[str], T]:
    """``parse`` as an argparse ``type=`` whose refusal argparse reports itself, after the
    command's usage (``argument --cache: ...``): a :class:`UsageError` it raises becomes an
    ``ArgumentTypeError``. For the parsers of the core, which know nothing of argparse
    ([Note: flags only in cli] in ``tierflow.cli.runtime_arguments``)."""

    @functools.wraps(parse)
    def parsed(text: str) -> T:
        try:
            return parse(text)
        except UsageError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from exc

    return parsed


def deprecation_notice(old: str, new: str, where: str = "") -> str:
    """The one line a deprecated spelling prints ([Note: deprecated spellings])."""
    at = f"{where}: " if where else ""
    return f"tierflow: {at}{old} is deprecated and will go; write {new} (same value)"


def _deprecated_action(base: type[argparse.Action], new: str) -> type[argparse.Action]:
    class Deprecated(base):  # type: ignore[valid-type,misc]
        replaced_by = new

        def __call__(
            self,
            parser: argparse.ArgumentParser,
            namespace: argparse.Namespace,
            values: str | Sequence[Any] | None,
            option_string: str | None = None,
        ) -> None:
            noted: set[str] = getattr(namespace, _NOTED, set())
            if option_string not in noted:
                print(deprecation_notice(str(option_string), new), file=sys.stderr)
                setattr(namespace, _NOTED, noted | {str(option_string)})
            super().__call__(parser, namespace, values, option_string)

    return Deprecated


def add_deprecated(parser: argparse.ArgumentParser, old: str, new: argparse.Action) -> None:
    """Let ``old`` stand for the option ``new`` (same value and ``dest``), with a notice.

    ``new`` is the action ``add_argument`` returned for the new spelling; the old one is
    hidden from ``--help`` ([Note: deprecated spellings]).
    """
    base: type[argparse.Action] = (
        argparse._AppendAction if isinstance(new, argparse._AppendAction) else argparse._StoreAction
    )
    parser.add_argument(
        old,
        dest=new.dest,
        action=_deprecated_action(base, new.option_strings[-1]),
        type=new.type if new.type is not None else str,
        metavar=new.metavar,
        default=argparse.SUPPRESS,
        help=argparse.SUPPRESS,
    )
