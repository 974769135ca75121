"""The batching benchmark's pure parts: prompts of different lengths for --batch-padding
and its token agreement, measured like a lossy codec's."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest

from benchmarks.batching import (
    Bursts,
    Ceiling,
    Setting,
    _generate,
    _generate_together,
    agreement,
    block_cut,
    choose_delay,
    fastest,
    goals,
    in_ort,
    median_of,
    padding_table,
    paired_change,
    prompts,
    round_table,
    side_by_side_table,
    table,
    whole_rounds,
)


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
        "batches": {"device": {}, "edge": {}, "cloud": {"1": 2, "8": 1}},
        "token_agreement": 0.875,
        "sessions_identical": 6,
    }
    lines = padding_table({"padding": {"sessions": 8, "runs": {"cloud, --batch-padding": row}}})
    assert any("| cloud, --batch-padding | 40.0 |" in line for line in lines)
    assert any("| 1:2 8:1 | 87.5% | 6 of 8 |" in line for line in lines)
    assert padding_table({}) == []


def test_a_setting_is_the_flags_tierflow_serve_takes_and_names_its_row() -> None:
    assert Setting().flags() == ["--max-batch", "16", "--batch-delay", "0ms"]
    assert Setting(16, 5.0).name == "batched, delay 5 ms"
    assert Setting(1).name == "not batched"
    padded = Setting(16, 0.0, padding=True)
    assert padded.flags()[-1] == "--batch-padding" and padded.name == "--batch-padding"
    together = Setting(16, 0.0, together=True)  # the device's way, not the tiers' flags
    assert together.flags() == Setting().flags()
    assert together.name == "batched, delay 0 ms, stepped together"


def _row(
    sessions: int, tokens_per_s: float, p50: float = 50.0, ceiling: tuple[float, float] = (50, 50)
) -> dict[str, object]:
    return {
        "sessions": sessions,
        "tokens_per_s": tokens_per_s,
        "p50_ms": p50,
        "identical": True,
        "ceiling_ms": list(ceiling),
    }


def _plan_runs(where: str, batched: dict[float, list[dict[str, object]]]) -> dict[str, Any]:
    """A plan's batched runs, one a --batch-delay (ms) with its rows, and its run not
    batched: 20 tokens/s at 1 and 8 sessions, one session's p50 49 ms."""
    runs: dict[str, Any] = {
        f"{where}, batched, delay {delay:g} ms": {
            "plan": where,
            "setting": {"max_batch": 16, "delay_ms": float(delay), "padding": False},
            "rows": rows,
        }
        for delay, rows in batched.items()
    }
    runs[f"{where}, not batched"] = {
        "plan": where,
        "setting": {"max_batch": 1, "delay_ms": 0.0, "padding": False},
        "rows": [_row(1, 20.0, 49.0), _row(8, 20.0)],
    }
    return runs


def test_goals_judge_each_row_against_the_faster_ceiling_measured_beside_it() -> None:
    """A row's share is of the ceiling at its batch size measured just before and just
    after it, the faster of the two (the slower would flatter the tiers), whichever came
    first: 8 sessions at 90 tokens/s against a ceiling step of 80 ms (100 tokens/s) is
    90%, against one of 40 ms, 45%."""
    runs = {}
    for where, ceiling in (("cloud", (80.0, 95.0)), ("split", (44.0, 40.0))):
        runs |= _plan_runs(where, {0.0: [_row(1, 20.0, 50.0), _row(8, 90.0, ceiling=ceiling)]})
    said = goals({"runs": runs})
    assert (
        "- cloud, batched, delay 0 ms: 8 sessions 4.50x one session's tokens/s (>= 3x): met" in said
    )
    assert (
        "- cloud, batched, delay 0 ms: 8 sessions at 90.0% of the ORT ceiling (>= 80%): met" in said
    )
    assert (
        "- split, batched, delay 0 ms: 8 sessions at 45.0% of the ORT ceiling (>= 80%): NOT met"
        in said
    )
    assert any(
        line.startswith(
            "- split, batched, delay 0 ms: one session's p50 50.0 ms/token, 49.0 not batched "
            "(no worse: NOT met"
        )
        for line in said
    )
    assert not any(line.startswith("- cloud, not batched") for line in said)


def test_goals_begin_with_the_settings_that_meet_every_goal_on_each_plan() -> None:
    """Per plan: a setting is named as meeting every goal only when each of its goals is
    met (here the delay's 8 sessions at 90% of the ceiling and 4.5x one session); one that
    misses any (45% of the ceiling) is named as not."""
    runs = {}
    for where in ("cloud", "split"):
        rows = {
            d: [_row(1, 20.0, 48.0), _row(8, 90.0, ceiling=(c, c))] for d, c in ((0, 40), (5, 80))
        }
        runs |= _plan_runs(where, rows)
    said = goals({"runs": runs})
    assert said[:2] == [
        f"- {where}: every goal met by batched, delay 5 ms; not by batched, delay 0 ms"
        for where in ("cloud", "split")
    ]


def test_a_goal_row_measured_three_times_keeps_the_try_whose_share_is_the_median() -> None:
    """Three tries of 8 sessions, each beside its own ceiling: 90 tokens/s against a 80 ms
    step (90%), 80 against 80 (80%) and 85 against 90 (95.6%). The 90% try is kept, every
    figure of it, with each try's share for the goals and their range for the table."""
    tries = [_row(8, 90.0, ceiling=(80, 85)), _row(8, 80.0, ceiling=(80, 80))]
    tries.append(_row(8, 85.0, ceiling=(95, 90)))
    for i, row in enumerate(tries):
        row["tokens"] = [[i]]
        row["p50_ms"] = 60.0 + i
    kept = median_of(tries)
    assert kept is tries[0] and kept["p50_ms"] == 60.0
    assert [r["tokens"] for r in kept["repeats"]] == [[[0]], [[1]], [[2]]]
    assert median_of(tries[:2]) is tries[1]  # of two, the lower
    single = _row(8, 90.0, ceiling=(80, 85))
    assert median_of([single]) is single and "repeats" not in single
    for row in kept["repeats"]:
        row.pop("tokens")
    runs = {
        "cloud, batched, delay 0 ms": {
            "plan": "cloud",
            "setting": {"max_batch": 16, "delay_ms": 0.0, "padding": False},
            "rows": [_row(1, 20.0), kept],
        },
        "cloud, not batched": {
            "plan": "cloud",
            "setting": {"max_batch": 1, "delay_ms": 0.0, "padding": False},
            "rows": [_row(1, 20.0), _row(8, 20.0)],
        },
    }
    for run in runs.values():
        for row in run["rows"]:
            row.update(p99_ms=70.0, batches={"device": {}, "edge": {}, "cloud": {}})
            row["peak_rss"] = {"device": 2**30, "edge": 2**30, "cloud": 2**30}
    said = goals({"runs": runs})
    assert (
        "- cloud, batched, delay 0 ms: 8 sessions at 90.0% of the ORT ceiling (the median of 3: "
        "80.0%, 90.0%, 95.6%) (>= 80%): met" in said
    )
    lines = table({"runs": runs, "ceiling": {}})
    assert any("| cloud, batched, delay 0 ms | 8 | 90.0 | 4.50 | 90% (80-96) |" in x for x in lines)
    assert any("| cloud, not batched | 8 | 20.0 | 1.00 | 12% |" in x for x in lines)  # once


def test_the_ceiling_is_each_batch_sizes_faster_measurement() -> None:
    """Measured before and after a plan's runs, the ceiling keeps each batch size's faster
    step (the slower would flatter the tiers' share) and both figures, in order."""

    def measured(*steps: float) -> dict[str, Any]:
        rows = [
            {"sessions": n, "step_ms": ms, "tokens_per_s": n * 1e3 / ms}
            for n, ms in zip((1, 8), steps, strict=True)
        ]
        return {"rows": rows, "peak_rss": 1}

    both = fastest(measured(30.0, 50.0), measured(33.0, 44.0))
    assert [r["step_ms"] for r in both["rows"]] == [30.0, 44.0]
    assert [r["measured_ms"] for r in both["rows"]] == [[30.0, 33.0], [50.0, 44.0]]
    assert both["rows"][1]["tokens_per_s"] == 8e3 / 44.0


def test_the_share_in_ort_calls_adds_each_running_tiers_call_against_the_round() -> None:
    """8 sessions at 100 tokens/s take 80 ms a round: a split plan's tiers' calls of all
    eight steps, 10 + 20 + 30 ms, are 75% of it; cloud-only, the cloud's 60 ms call is
    (the device's call runs nothing). A tier that made no call of every step: no share."""
    row = {"sessions": 8, "tokens_per_s": 100.0, "call_ms": {"device": 10.0, "edge": 20.0}}
    assert in_ort(row, "split") is None  # the cloud's rounds fragmented
    row["call_ms"]["cloud"] = 30.0
    assert in_ort(row, "split") == pytest.approx(0.75)
    assert in_ort({**row, "call_ms": {"device": 0.1, "cloud": 60.0}}, "cloud") == 0.75


def test_the_round_table_sets_each_tiers_call_against_the_ceilings_beside_the_row() -> None:
    """Stepped together, at 8 sessions: 100 tokens/s is an 80 ms round, of which the
    tiers' calls took 10 + 20 + 30 ms, so 20 outside them; rows without the figures
    (results of earlier runs) and settings not stepped together are left out."""
    row = {
        "sessions": 8,
        "tokens_per_s": 100.0,
        "ceiling_ms": [58.0, 55.0],
        "call_ms": {"device": 10.0, "edge": 20.0, "cloud": 30.0},
        "ceiling_segments_ms": {"device": 9.0, "edge": 18.0, "cloud": 28.0},
        "cpu_ms_per_round": {"device": 15.0, "cloud": 50.0, "edge": 30.0},
        "ceiling_cpu_ms": 90.0,
    }
    together = {"max_batch": 16, "delay_ms": 0.0, "together": True}
    runs = {
        "split, together": {"plan": "split", "setting": together, "rows": [row, _row(4, 1, 1)]},
        "split, delay": {
            "plan": "split",
            "setting": {**together, "together": False},
            "rows": [row],
        },
    }
    lines = round_table({"runs": runs})
    assert len(lines) == 5
    cells = [cell.strip() for cell in lines[4].strip("|").split("|")]
    assert cells == [
        "split", "8", "80.0", "55.0", "device 10.0 / edge 20.0 / cloud 30.0", "9.0 / 18.0 / 28.0",
        "20.0", "device 15.0 / edge 30.0 / cloud 50.0", "90.0",
    ]  # fmt: skip
    assert round_table({"runs": {"split, delay": runs["split, delay"]}}) == []


def _one_session_runs() -> dict[str, Any]:
    """A batched setting's and the not-batched one's rows of one session, cloud-only."""
    return {
        "cloud, batched, delay 0 ms": {
            "plan": "cloud",
            "setting": {"max_batch": 16, "delay_ms": 0.0, "padding": False},
            "rows": [_row(1, 20.0, 52.0)],
        },
        "cloud, not batched": {
            "plan": "cloud",
            "setting": {"max_batch": 1, "delay_ms": 0.0, "padding": False},
            "rows": [_row(1, 20.0, 49.0)],
        },
    }


def test_one_sessions_p50_is_judged_side_by_side_when_measured_so() -> None:
    """The p50 goal takes the side-by-side measurement (every setting's tiers at once,
    steps alternating) over the rows' one-session p50s, which ran minutes apart."""
    runs = _one_session_runs()
    side = {
        "cloud": {
            "sessions": 3,
            "rows": [
                {
                    "setting": name,
                    "p50_ms": p50,
                    "session_p50_ms": [p50, p50 + 0.5, p50 - 0.5],
                    "identical": True,
                }
                for name, p50 in (("batched, delay 0 ms", 40.0), ("not batched", 40.4))
            ],
        }
    }
    said = goals({"runs": runs, "side_by_side": side})
    assert any(
        line.startswith(
            "- cloud, batched, delay 0 ms: one session's p50 40.00 ms/token, 40.40 not batched, "
            "side by side (no worse: met"
        )
        for line in said
    ), said
    lines = side_by_side_table({"side_by_side": side})
    assert (
        "| cloud | batched, delay 0 ms | 40.00 | 0.990 | - | 40.00 / 40.50 / 39.50 | yes |" in lines
    )
    assert side_by_side_table({}) == []


def _swept(
    delay: float, sessions: int, cloud: dict[str, int], tokens_per_s: float
) -> dict[str, object]:
    return {
        "delay_ms": delay,
        "sessions": sessions,
        "tokens_per_s": tokens_per_s,
        "batches": {"device": {}, "edge": {}, "cloud": cloud},
    }


def test_the_sweep_chooses_the_second_shortest_delay_that_gathers_whole_rounds() -> None:
    """At every count, and a margin over the shortest, which is at the edge; not the most
    tokens/s: once rounds are whole, tokens/s differ by the machine's noise."""
    rows = [
        _swept(5.0, 8, {"8": 32}, 90.0),
        _swept(5.0, 16, {"1": 32, "15": 32}, 95.0),  # 1 + 15: not whole
        _swept(10.0, 8, {"8": 31, "7": 1, "1": 1}, 80.0),
        _swept(10.0, 16, {"16": 30, "15": 2, "1": 2}, 120.0),  # 480 of 512 steps: 94%
        _swept(20.0, 8, {"8": 32}, 99.0),
        _swept(20.0, 16, {"16": 32}, 125.0),
    ]
    assert whole_rounds(rows[2]) == pytest.approx(248 / 256)
    assert choose_delay(rows) == 20.0  # 10 and 20 ms gathered whole rounds
    assert choose_delay(rows[:4]) == 10.0  # only 10 ms did
    assert choose_delay(rows[:2]) == 5.0  # none whole: the most tokens/s at 16 sessions


class _Decoder:
    """A session's decoder that logs each step; the third session's prefill fails when
    ``failing``."""

    made: ClassVar[int] = 0
    log: ClassVar[list[tuple[int, int]]] = []
    failing: ClassVar[bool] = False

    def __init__(self, client: object) -> None:
        self.number = _Decoder.made
        _Decoder.made += 1

    def choose(self, tokens: list[int], position: int, keep: int = 0) -> np.ndarray:
        if position == 0 and self.number == 2 and _Decoder.failing:
            raise RuntimeError("the prefill failed")
        _Decoder.log.append((self.number, position))
        return np.array([7])

    @staticmethod
    def choose_together(
        steps: list[tuple[_Decoder, list[int], int]], keep: int = 0
    ) -> list[np.ndarray | Exception]:
        answers: list[np.ndarray | Exception] = []
        for decoder, tokens, position in steps:
            try:
                answers.append(decoder.choose(tokens, position, keep))
            except RuntimeError as exc:
                answers.append(exc)
        return answers


def _sessions(monkeypatch: pytest.MonkeyPatch, *, failing: bool) -> None:
    import tierflow.device.generation

    monkeypatch.setattr(tierflow.device.generation, "TierDecoder", _Decoder)
    monkeypatch.setattr(_Decoder, "made", 0)
    monkeypatch.setattr(_Decoder, "log", [])
    monkeypatch.setattr(_Decoder, "failing", failing)


def test_the_calls_are_counted_once_every_session_has_its_first_token(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _sessions(monkeypatch, failing=False)
    seen: list[list[tuple[int, int]]] = []
    row = _generate(None, [[1, 2]] * 4, 3, prefilled=lambda: seen.append(list(_Decoder.log)))
    assert len(seen) == 1 and sorted(seen[0]) == [(i, 0) for i in range(4)]  # prefills only
    assert len(_Decoder.log) == 4 * 3
    assert row["tokens"] == [[7, 7, 7]] * 4


# The failed session's thread ends with its exception, as in the benchmark (which prints it).
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
@pytest.mark.timeout(30)  # what it guards against is a hang
def test_a_session_whose_prefill_fails_ends_the_row_instead_of_stopping_the_others(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _sessions(monkeypatch, failing=True)
    with pytest.raises(RuntimeError, match="a session failed"):
        _generate(None, [[1, 2]] * 4, 3, prefilled=lambda: None)


def test_sessions_stepped_together_count_their_calls_after_every_prefill(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _sessions(monkeypatch, failing=False)
    seen: list[list[tuple[int, int]]] = []
    row = _generate_together(
        None, [[1, 2]] * 4, 3, prefilled=lambda: seen.append(list(_Decoder.log))
    )
    assert seen == [[(i, 0) for i in range(4)]]  # the prefills, together
    assert _Decoder.log[4:] == [(i, 2) for i in range(4)] + [(i, 3) for i in range(4)]
    assert row["tokens"] == [[7, 7, 7]] * 4 and row["sessions"] == 4


def test_a_session_stepped_together_that_fails_fails_the_row(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _sessions(monkeypatch, failing=True)
    with pytest.raises(RuntimeError, match="the prefill failed"):
        _generate_together(None, [[1, 2]] * 4, 3, prefilled=lambda: None)


@pytest.mark.integration
def test_the_ceiling_generates_the_rows_tokens_in_a_process_of_its_own(tmp_path: Path) -> None:
    """ORT alone, the plan's three segments in one process, generates each session's
    tokens as the unsplit model does; the bursts process answers each batch size asked
    for, for as long as it is asked."""
    from tierflow.greedy import reference_generate
    from tierflow.partitioner.decoder_graph import load_decoder, split_decoder
    from tierflow.partitioner.decoder_points import DecoderSettings
    from tierflow.partitioner.split import save_split_plan
    from tierflow.zoo.tiny_stateful import tiny_decoder

    model = tiny_decoder(tmp_path / "model.onnx", blocks=6, vocab=32, seed=1)
    graph = load_decoder(model, DecoderSettings(context=32, max_tokens=8, prompt_tokens=4))
    last = len(graph.prefill.cuts) - 1
    cuts = (last // 3, 2 * last // 3)
    plan = tmp_path / "plan"
    save_split_plan(
        graph.prefill, split_decoder(graph, cuts), plan, cuts=cuts, decoder=graph.decoder
    )
    args = argparse.Namespace(tokens=6, prompt=4, threads=1)
    step = Ceiling(plan, args).step(3)
    assert list(step["segments_ms"]) == ["device", "edge", "cloud"]
    assert step["step_ms"] == pytest.approx(sum(step["segments_ms"].values()))
    expected = [
        list(reference_generate(model, text, 6, threads=1, context=32).tokens)
        for text in prompts(3, 4, vocab=32)
    ]
    assert step["tokens"] == expected
    with Bursts(plan, args) as bursts:
        burst = [bursts.step(n) for n in (1, 3, 1)]
        process = bursts.process
    assert [b["sessions"] for b in burst] == [1, 3, 1]
    assert all(
        b["step_ms"] > 0 and list(b["segments_ms"]) == list(step["segments_ms"]) for b in burst
    )
    assert process.returncode == 0  # it ends when asked no more


def test_the_split_cuts_between_blocks_where_one_activation_crosses() -> None:
    """Not inside a block, where its MLP's wide tensors cross too."""
    from tierflow.partitioner.cuts import Cut

    names = [
        ("position_ids", "/model/layers.3/mlp/act_fn/Mul_output_0"),
        ("position_ids", "/model/layers.3/mlp/down_proj/MatMul_output_0"),
        ("position_ids", "/model/layers.4/input_layernorm/Cast_output_0"),
        ("position_ids", "/model/layers.4/input_layernorm/Cast_output_0", "/model/layers.4/x"),
    ]
    cuts = [Cut(i, 10 * i, tensors, 1) for i, tensors in enumerate(names)]
    assert block_cut(cuts, 4) == 2
    with pytest.raises(StopIteration):
        block_cut(cuts, 5)


def test_one_sessions_p50_is_no_worse_unless_its_steps_are_measurably_slower() -> None:
    """With each step kept, the p50 goal asks whether batched steps were slower than the
    not-batched steps measured beside them, pair by pair: a median 0.5% higher from noise
    either way is not; every step 5% slower is."""
    rng = np.random.default_rng(0)
    plain = 40.0 + rng.normal(0.0, 2.0, 186)
    even = plain * (1.0 + rng.normal(0.0, 0.03, 186))  # as fast, noisy

    def said(steps: np.ndarray) -> str:
        side = {
            "cloud": {
                "sessions": 6,
                "rows": [
                    {"setting": name, "p50_ms": float(np.median(v)), "steps_ms": list(v)}
                    for name, v in (("batched, delay 0 ms", steps), ("not batched", plain))
                ],
            }
        }
        said = goals({"runs": _one_session_runs(), "side_by_side": side})
        (line,) = [x for x in said if "p50" in x]
        return line

    middle, low, high = paired_change({"steps_ms": list(even)}, {"steps_ms": list(plain)})
    assert low < middle < high and low < 0.0
    assert "(no worse: met" in said(even)
    slower = said(plain * 1.05)
    assert "(no worse: NOT met, +5.0%; step by step +5.0%, 95% CI +5.0% to +5.0%)" in slower
    assert paired_change({"steps_ms": [1.0]}, {}) is None
