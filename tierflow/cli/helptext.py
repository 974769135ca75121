"""How every ``tierflow`` command's ``--help`` reads: one formatter, and examples.

Each command has a description, an ``examples:`` epilog (:func:`examples`) and help for
every option; defaults show one way, ``(default: X)`` after the option's help. Nothing is
shown where there is nothing to say: a required option, one without a default, a flag,
an empty repeatable option, or help that already says its default in that form.
Descriptions are wrapped paragraph by paragraph, unless already broken into lines (a
module docstring, the examples). An option's value is named by its ``metavar``, or by its
kind (``N`` for a whole number, ``NUMBER``, ``PATH``), never by argparse's default, the
option's name in capitals (``--grace GRACE``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

EXAMPLES_HEADING = "examples:"
#: An option's value, named by its type where the option names it no other way.
VALUE_NAMES: dict[object, str] = {int: "N", float: "NUMBER", Path: "PATH"}


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults as ``(default: X)`` where there is one; examples kept line by line."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if (
            action.required
            or action.default is None
            or action.default is argparse.SUPPRESS
            or isinstance(action.default, bool)
            or action.default == []
            or "(default: " in text
        ):
            return action.help
        return super()._get_help_string(action)

    def _get_default_metavar_for_optional(self, action: argparse.Action) -> str:
        return VALUE_NAMES.get(action.type, "VALUE")

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        """Wrap one-line paragraphs; keep paragraphs already broken into lines as written."""
        paragraphs = []
        for paragraph in text.strip("\n").split("\n\n"):
            if "\n" in paragraph:
                paragraphs.append("".join(indent + line for line in paragraph.splitlines(True)))
            else:
                paragraphs.append(super()._fill_text(paragraph, width, indent))
        return "\n\n".join(paragraphs)


def examples(*commands: str) -> str:
    """An ``examples:`` epilog, one command line (or ``# comment``) per argument."""
    return "\n".join([EXAMPLES_HEADING, *(f"  {command}" for command in commands)])
