"""The decoder cost model on hand-made profiles: TTFT, per-token time, KV memory. No clocks."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from tierflow.errors import PlanError
from tierflow.link.spec import LinkSpec
from tierflow.partitioner.cost import Problem
from tierflow.partitioner.decoder_cost import (
    at_batch,
    batch_sizes,
    bytes_per_token,
    decoder_estimate,
    decoder_search,
    decoder_tables,
)
from tierflow.partitioner.profile import Profile

LINKS = {"device-edge": LinkSpec(8e6, 0.030), "edge-cloud": LinkSpec(80e6, 0.020)}
RAW = {"device-edge": "raw", "edge-cloud": "raw"}
# Three blocks. Prefill of a 32-token prompt: hidden states of 32 x 256 B cross a cut, the
# model's logits are 32 x 1 KiB. A decode step: one token's hidden state, logits of 1 KiB.
# What comes back is the runtime's answer: a greedy choice (8 B), or one row of logits.
PREFILL_CUTS = [96, 8192, 8192, 32768]
DECODE_CUTS = [24, 256, 256, 1024]
WEIGHTS = [1000, 1000, 1000]
KV = [4096, 4096, 4096]  # each block's cache at --context


def _tiers(profile: Profile) -> dict[str, Profile]:
    return {"device": profile.emulate(4.0), "edge": profile.emulate(2.0), "cloud": profile}


def _tables(
    profile_factory, max_tokens: int = 10, objective: str = "latency", memory=None, sampled=False
):
    prefill = profile_factory([0.004, 0.004, 0.004], PREFILL_CUTS, weights=WEIGHTS, peaks=[500] * 3)
    decode = profile_factory([0.001, 0.001, 0.001], DECODE_CUTS, weights=WEIGHTS, peaks=[100] * 3)
    problems = [
        Problem(_tiers(p), LINKS, memory=memory or {}, objective=objective, codecs=("raw",))
        for p in (prefill, decode)
    ]
    return decoder_tables(*problems, max_tokens=max_tokens, state_bytes=KV, sampled=sampled)


def test_cloud_only_sends_the_prompt_up_once_and_pays_the_round_trip_per_token(
    profile_factory,
) -> None:
    tables = _tables(profile_factory)
    plan = decoder_estimate(tables, 0, 0, RAW)
    assert plan.tiers == ("cloud",)
    both_rtts = 0.030 + 0.020
    # The prompt's 96 bytes of ids go up both links once, one greedy choice (8 B) comes
    # back: the prefill answers its last position only, as a token (keep_last, choices_only).
    prefill_wire = (96 + 8) * 8 / 8e6 + (96 + 8) * 8 / 80e6
    assert plan.ttft_s == pytest.approx(0.012 + prefill_wire + both_rtts)
    step_wire = (24 + 8) * 8 / 8e6 + (24 + 8) * 8 / 80e6
    assert plan.per_token_s == pytest.approx(0.003 + step_wire + both_rtts)
    # The prefill answers the first of the 10 tokens, a step each of the other 9.
    assert plan.generation_s == pytest.approx(plan.ttft_s + 9 * plan.per_token_s)
    assert plan.tokens_per_s == pytest.approx(10 / plan.generation_s)
    # As generate --json counts them: the prompt's 96 B up once, 24 B a step for each of
    # the other 9 tokens, over the 10 tokens; the answers are not counted.
    assert plan.bytes_per_token() == pytest.approx({"device-edge": 31.2, "edge-cloud": 31.2})
    # The cloud holds every block's weights, KV cache and the larger activation peak.
    assert plan.memory_bytes["cloud"] == 3000 + 3 * 4096 + 500
    assert plan.state_bytes == {"device": 0, "edge": 0, "cloud": 3 * 4096}


def test_a_split_pays_one_hidden_state_and_one_round_trip_per_token_per_link(
    profile_factory,
) -> None:
    tables = _tables(profile_factory)
    plan = decoder_estimate(tables, 1, 3, RAW)  # device block 0, edge blocks 1-2
    assert plan.tiers == ("device", "edge")
    assert plan.per_token_s == pytest.approx(0.004 + 0.002 * 2 + (256 + 8) * 8 / 8e6 + 0.030)
    assert plan.ttft_s == pytest.approx(0.016 + 0.008 * 2 + (8192 + 8) * 8 / 8e6 + 0.030)
    assert plan.memory_bytes["device"] == 1000 + 4096 + 500
    assert plan.memory_bytes["edge"] == 2000 + 2 * 4096 + 500
    assert plan.bytes_per_token() == {"device-edge": (8192 + 9 * 256) / 10, "edge-cloud": 0}


def test_one_count_of_bytes_per_token_for_the_plan_and_the_benchmarks(
    profile_factory, tmp_path: Path
) -> None:
    """[Note: bytes per token]: the plan's figure, written in plan.json, is what the
    benchmarks set beside generate --json's (they read it back from the plan's links)."""
    from benchmarks.lib.decoder_estimates import predicted

    assert bytes_per_token({"l": 100.0}, {"l": 10.0}, 1) == {"l": 100.0}
    assert bytes_per_token({"l": 100.0}, {"l": 10.0}, 4) == {"l": 130 / 4}
    plan = decoder_estimate(_tables(profile_factory), 1, 3, RAW)
    (tmp_path / "plan.json").write_text(json.dumps({"estimate": {"decoder": plan.to_dict()}}))
    read = predicted(tmp_path, 32, plan.max_tokens)["bytes_per_token"]
    assert read == pytest.approx(plan.to_dict()["bytes_per_token"])
    assert read == pytest.approx({"device-edge": (8192 + 9 * 256) / 10, "edge-cloud": 0})


def test_sampled_steps_answer_one_row_of_logits_greedy_ones_a_choice(profile_factory) -> None:
    greedy = decoder_estimate(_tables(profile_factory), 0, 0, RAW)
    sampled = decoder_estimate(_tables(profile_factory, sampled=True), 0, 0, RAW)
    # The last position's logits (1 KiB) come back, for the prompt as for every token;
    # never the prompt's 32 rows (32 KiB).
    # Bytes per token count what goes up ([Note: bytes per token]): the same for both.
    assert sampled.bytes_per_token() == greedy.bytes_per_token()
    extra = (1024 - 8) * 8 / 8e6 + (1024 - 8) * 8 / 80e6
    assert sampled.ttft_s - greedy.ttft_s == pytest.approx(extra)
    assert sampled.per_token_s - greedy.per_token_s == pytest.approx(extra)
    assert sampled.prefill.links["device-edge"].reply_s == pytest.approx(1024 * 8 / 8e6)
    assert greedy.prefill.links["device-edge"].reply_s == pytest.approx(8 * 8 / 8e6)
    # The compute still pays for every position's logits (the model computes them).
    assert sampled.prefill.compute_s == greedy.prefill.compute_s


def test_a_problem_prices_the_answer_it_is_given(profile_factory) -> None:
    profile = profile_factory([0.001], [24, 4000], weights=[10], peaks=[10])
    whole = Problem(_tiers(profile), LINKS)
    assert whole.answer_bytes == 4000  # the model outputs, by default
    assert Problem(_tiers(profile), LINKS, reply_bytes=8).answer_bytes == 8
    with pytest.raises(PlanError, match="reply_bytes must not be negative"):
        Problem(_tiers(profile), LINKS, reply_bytes=-1)


def test_the_search_minimises_ttft_plus_max_tokens_steps(profile_factory) -> None:
    for tokens in (1, 10, 1000):
        tables = _tables(profile_factory, max_tokens=tokens)
        result = decoder_search(tables, top=100)
        scores = [e.generation_s for e in result.ranked]
        assert scores == sorted(scores)
        everything = [decoder_estimate(tables, a, b, RAW) for a in range(4) for b in range(a, 4)]
        assert result.best.generation_s == pytest.approx(min(e.generation_s for e in everything))
        assert set(result.baselines) == {"device-only", "edge-only", "cloud-only"}


def test_one_token_is_the_prefill_alone(profile_factory) -> None:
    # The prefill answers the first token: a generation of one takes no step, and the
    # whole-generation tables the search ranks are the prefill's.
    tables = _tables(profile_factory, max_tokens=1)
    for tier, seconds in tables.generation.segment_s.items():
        assert (seconds == tables.prefill.segment_s[tier]).all()
    plan = decoder_estimate(tables, 1, 2, RAW)
    assert plan.generation_s == pytest.approx(plan.ttft_s)
    assert plan.tokens_per_s == pytest.approx(1 / plan.ttft_s)


def test_memory_budgets_count_each_tiers_kv_cache(profile_factory) -> None:
    # Weights and activations of all three blocks (3.5 KB) fit 8 KB; their caches do not.
    tables = _tables(profile_factory, memory={"device": 8000})
    result = decoder_search(tables, top=100)
    assert not result.baselines["device-only"].feasible
    assert all(e.memory_bytes["device"] <= 8000 for e in result.ranked)
    assert max(e.cuts[0] for e in result.ranked) == 1  # one block and its cache fit
    table = tables.prefill.memory["device"]
    assert table[0, 1] == 1000 + 4096 + 500 and table[1, 3] == 2000 + 2 * 4096 + 500


def test_no_plan_fitting_names_the_kv_cache(profile_factory) -> None:
    tables = _tables(profile_factory, memory={"device": 100, "edge": 100, "cloud": 100})
    with pytest.raises(
        PlanError, match=r"KV cache at --context 2048 \(12KiB for the whole model\)"
    ):
        decoder_search(tables, context=2048)


def test_throughput_ranks_by_the_slowest_stage_of_a_step(profile_factory) -> None:
    tables = _tables(profile_factory, objective="throughput")
    result = decoder_search(tables, top=100)
    periods = [e.step.period_s for e in result.ranked]
    assert periods == sorted(periods)
    assert result.best.pipelined_tokens_per_s == pytest.approx(1 / result.best.step.period_s)


def _batched_tables(profile_factory, *, objective: str, sessions: int = 8, memory=None):
    """Steps of ``sessions`` batched: the device's CPU is compute-bound (its step takes
    ``sessions`` times as long), the edge's too, the cloud's memory-bound (10% longer)."""
    tables = _tables(profile_factory, objective=objective, memory=memory)
    per_tier = {"device": (4.0, sessions), "edge": (2.0, sessions), "cloud": (1.0, 1.1)}
    at_n = {
        tier: profile_factory(
            [0.001 * slowdown * grows] * 3,
            [n * sessions for n in DECODE_CUTS],
            weights=WEIGHTS,
            peaks=[100 * sessions] * 3,
            slowdown=slowdown,
        )
        for tier, (slowdown, grows) in per_tier.items()
    }
    prefill, decode = tables.prefill.problem, tables.decode.problem
    return decoder_tables(
        replace(prefill, reply_bytes=None),
        replace(decode, reply_bytes=None),
        max_tokens=10,
        state_bytes=KV,
        batched=Problem(at_n, LINKS, memory=memory or {}, objective=objective, codecs=("raw",)),
        sessions=sessions,
    )


def test_throughput_for_sessions_and_latency_choose_differently(profile_factory) -> None:
    """Latency: one session, no round trip: device-only. Eight sessions batched: the
    device's step grows eightfold, the cloud's by 10%, so the cloud serves them best."""
    latency = decoder_search(_tables(profile_factory), top=100)
    assert latency.best.tiers == ("device",)
    tables = _batched_tables(profile_factory, objective="throughput")
    result = decoder_search(tables, top=100)
    assert result.objective == "throughput"
    best = result.best
    assert best.tiers == ("cloud",) and best.sessions == 8
    # One batch of 8 through both links: 8 hidden states up, 8 token choices down, one RTT.
    wire = (8 * 24 + 8 * 8) * 8 / 8e6 + (8 * 24 + 8 * 8) * 8 / 80e6
    assert best.session_per_token_s == pytest.approx(3 * 0.0011 + wire + 0.050)
    assert best.aggregate_tokens_per_s == pytest.approx(8 / best.session_per_token_s)
    device = result.baselines["device-only"]
    assert device.session_per_token_s == pytest.approx(8 * 3 * 0.004)
    assert best.aggregate_tokens_per_s > 1.5 * device.aggregate_tokens_per_s
    rates = [e.aggregate_tokens_per_s for e in result.ranked]
    assert rates == sorted(rates, reverse=True)
    # One session's figures stay those of one step alone.
    assert best.per_token_s == pytest.approx(decoder_estimate(_tables(profile_factory), 0, 0,
                                                              RAW).per_token_s)  # fmt: skip
    data = best.to_dict()
    assert data["sessions"] == 8 and data["aggregate_tokens_per_s"] == best.aggregate_tokens_per_s


def test_memory_for_sessions_counts_every_sessions_kv_cache(profile_factory) -> None:
    tables = _batched_tables(profile_factory, objective="throughput", sessions=8)
    plan = decoder_estimate(tables, 0, 0, RAW)
    assert plan.state_bytes["cloud"] == 8 * 3 * 4096
    # Weights, eight caches and the batch's activation peak (larger than the prompt's).
    assert plan.memory_bytes["cloud"] == 3000 + 8 * 3 * 4096 + 800
    budget = {"device": 3000 + 3 * 4096 + 800}  # one session's caches fit the device
    one = decoder_search(_tables(profile_factory, memory=budget), top=100)
    assert one.baselines["device-only"].feasible
    eight = _batched_tables(profile_factory, objective="throughput", memory=budget)
    result = decoder_search(eight, top=100)
    assert not result.baselines["device-only"].feasible
    assert all(e.memory_bytes["device"] <= budget["device"] for e in result.ranked)


def test_a_batched_profile_is_interpolated_between_the_measured_sizes(profile_factory) -> None:
    assert batch_sizes(1) == (1,) and batch_sizes(4) == (1, 2, 4) and batch_sizes(6) == (
        1, 2, 4, 8)  # fmt: skip
    measured = {
        b: profile_factory([0.001 * (1 + b / 10)] * 2, [10 * b, 24 * b, 8], peaks=[50 * b] * 2)
        for b in (1, 2, 4, 8)
    }
    assert at_batch(measured, 4) is measured[4]
    six = at_batch(measured, 6)
    assert [u.compute_s for u in six.units] == pytest.approx([0.001 * 1.6] * 2)
    assert [c.nbytes for c in six.cuts] == [60, 144, 8]
    assert [u.peak_activation_bytes for u in six.units] == [300, 300]
    with pytest.raises(PlanError, match="no decode profile around batch 16"):
        at_batch(measured, 16)
