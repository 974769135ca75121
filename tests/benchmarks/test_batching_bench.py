"""The batching benchmark's pure parts: prompts of different lengths for --batch-padding
and its token agreement, measured like a lossy codec's."""

from __future__ import annotations

import pytest

from benchmarks.batching import agreement, padding_table, prompts


def test_varied_prompts_are_each_a_token_shorter_and_the_same_for_a_run() -> None:
    same = prompts(4, 16)
    varied = prompts(4, 16, vary=True)
    assert [len(p) for p in same] == [16] * 4
    assert [len(p) for p in varied] == [16, 15, 14, 13]
    assert all(v == s[: len(v)] for v, s in zip(varied, same, strict=True))
    assert prompts(4, 16, vary=True) == varied
    assert [len(p) for p in prompts(3, 2, vary=True)] == [2, 1, 1]


def test_agreement_counts_equal_tokens_position_by_position() -> None:
    expected = [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert agreement([[1, 2, 3, 4], [5, 6, 7, 8]], expected) == {
        "token_agreement": 1.0,
        "sessions_identical": 2,
        "identical": True,
    }
    got = agreement([[1, 2, 9, 4], [5, 6, 7, 8]], expected)
    assert got["token_agreement"] == pytest.approx(7 / 8)
    assert got["sessions_identical"] == 1 and not got["identical"]
    short = agreement([[1, 2], [5, 6, 7, 8]], expected)  # a session that stopped early
    assert short["token_agreement"] == pytest.approx(6 / 8)


def test_the_padding_table_prints_agreement_as_a_share() -> None:
    row = {
        "tokens_per_s": 40.0,
        "p50_ms": 30.0,
        "p99_ms": 50.0,
        "cloud_batches": {"calls": 3, "steps": 10, "sizes": {"1": 2, "8": 1}},
        "token_agreement": 0.875,
        "sessions_identical": 6,
    }
    lines = padding_table({"padding": {"sessions": 8, "runs": {"cloud, --batch-padding": row}}})
    assert any("| cloud, --batch-padding | 40.0 |" in line for line in lines)
    assert any("| 1:2 8:1 | 87.5% | 6 of 8 |" in line for line in lines)
    assert padding_table({}) == []
