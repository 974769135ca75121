"""Aligned text tables for people: the one formatter every command and benchmark uses.

Machines read ``--json``; these tables are for eyes, so the format is plain: columns
padded to their widest cell, two spaces apart, a rule of dashes under the header, no
trailing spaces.
"""

from __future__ import annotations

from collections.abc import Sequence


def format_table(
    headers: Sequence[str],
    rows: Sequence[Sequence[object]],
    *,
    align: str = "",
    rule: bool = True,
) -> str:
    """The rows (cells turned into text with ``str``) as an aligned table.

    ``align`` holds one letter per column, ``l`` (left) or ``r`` (right); columns it
    does not cover align like the default, the first left and the others right.
    ``headers`` may be empty (a list of name-value pairs, say); then there is no header
    line and no rule. ``rule`` draws dashes under the header.
    """
    table = [[str(cell) for cell in row] for row in ([headers] if headers else []) + list(rows)]
    if not table:
        return ""
    columns = len(table[0])
    for row in table:
        if len(row) != columns:
            raise ValueError(f"table row has {len(row)} cells, expected {columns}: {row}")
    for letter in align:
        if letter not in "lr":
            raise ValueError(f"column alignment must be 'l' or 'r', got {align!r}")
    sides = [align[i] if i < len(align) else ("l" if i == 0 else "r") for i in range(columns)]
    widths = [max(len(row[i]) for row in table) for i in range(columns)]

    def line(cells: Sequence[str]) -> str:
        padded = (
            cell.ljust(width) if side == "l" else cell.rjust(width)
            for cell, width, side in zip(cells, widths, sides, strict=True)
        )
        return "  ".join(padded).rstrip()

    lines = [line(row) for row in table]
    if headers and rule:
        lines.insert(1, line(["-" * width for width in widths]))
    return "\n".join(lines)
