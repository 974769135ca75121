from __future__ import annotations

import pytest

from tierflow.cli.table import format_table


def test_first_column_left_others_right_with_a_rule_under_the_header() -> None:
    table = format_table(("plan", "ms", "bytes"), [("device-only", 12.5, 0), ("cut 3", 4.25, 1024)])
    assert table.splitlines() == [
        "plan           ms  bytes",
        "-----------  ----  -----",
        "device-only  12.5      0",
        "cut 3        4.25   1024",
    ]


def test_alignment_per_column_and_no_trailing_spaces() -> None:
    table = format_table(
        ("exit", "at", "rate"), [("e0", "conv1", "5%"), ("e1", "", "")], align="lll"
    )
    assert table.splitlines() == [
        "exit  at     rate",
        "----  -----  ----",
        "e0    conv1  5%",
        "e1",
    ]
    assert format_table(("a", "b"), [("x", "y")], align="ll", rule=False) == "a  b\nx  y"


def test_without_headers_a_list_of_name_value_pairs() -> None:
    rows = [("link", "device-edge"), ("rtt (median)", "5 ms")]
    assert format_table((), rows, align="ll") == "link          device-edge\nrtt (median)  5 ms"
    assert format_table((), []) == ""


def test_ragged_rows_and_unknown_alignments_are_refused() -> None:
    with pytest.raises(ValueError, match="2 cells, expected 3"):
        format_table(("a", "b", "c"), [("x", "y")])
    with pytest.raises(ValueError, match="'l' or 'r'"):
        format_table(("a",), [("x",)], align="c")
