"""Speculation's acceptance rules and draft count ([Note: speculation])."""

from __future__ import annotations

import numpy as np

from tierflow.device.speculation import (
    AcceptanceMeter,
    Verdict,
    choose_drafts,
    expected_tokens,
    softmax,
    verify_greedy,
    verify_sampled,
)


def test_greedy_keeps_drafts_while_they_are_the_argmax_and_adds_the_next() -> None:
    target = [3, 1, 4, 2]  # the large model's argmax at 4 positions
    assert verify_greedy(target, [3, 1, 4]) == Verdict(3, 2)  # all kept, and a bonus token
    assert verify_greedy(target, [3, 5, 4]).kept == 1  # second rejected
    assert verify_greedy(target, [3, 5, 4]).token == 1  # the large model's correction
    assert verify_greedy(target, [0, 1, 4]) == Verdict(0, 3)


def test_sampled_acceptance_keeps_the_large_models_distribution() -> None:
    """Speculative sampling's first token is distributed as the large model's (a chi-square
    style check over many seeded draws)."""
    rng = np.random.default_rng(7)
    vocab = 5
    target_logits = np.array([[2.0, 1.0, 0.5, -1.0, 0.0], [0.0] * vocab])
    draft_logits = np.array([[0.0, 2.0, 1.0, 0.0, -1.0]])
    q = softmax(draft_logits, 1.0)[0]
    counts = np.zeros(vocab)
    draws = 20000
    for _ in range(draws):
        proposed = int(rng.choice(vocab, p=q))
        verdict = verify_sampled(target_logits, draft_logits, [proposed], 1.0, rng)
        first = proposed if verdict.kept == 1 else verdict.token
        counts[first] += 1
    expected = softmax(target_logits[0], 1.0) * draws
    assert np.all(np.abs(counts - expected) < 4 * np.sqrt(expected) + 5)


def test_auto_drafts_more_when_round_trips_are_dear_and_acceptance_high() -> None:
    assert expected_tokens(0.0, 4) == 1.0
    assert abs(expected_tokens(0.8, 4) - (1 - 0.8**5) / 0.2) < 1e-9
    slow_link = choose_drafts(0.8, round_trip_s=0.1, draft_step_s=0.002)
    fast_link = choose_drafts(0.8, round_trip_s=0.002, draft_step_s=0.002)
    poor_drafts = choose_drafts(0.2, round_trip_s=0.1, draft_step_s=0.02)
    assert slow_link > fast_link and slow_link > poor_drafts


def test_the_meter_follows_acceptance() -> None:
    meter = AcceptanceMeter()
    assert meter.choose(3) == 3 and meter.choose(None) == 4  # nothing measured yet
    for _ in range(20):
        meter.observe(4, 4, round_trip_s=0.05, draft_s=0.004)
    assert meter.rate > 0.95 and meter.accepted == 80 and meter.drafted == 80
    assert meter.choose(None) >= 6


def test_the_meter_measures_a_drafts_chance_once_those_before_it_were_kept() -> None:
    """Each draft kept with chance 0.8 once the earlier ones were: ``rate`` is 0.8, not
    the 0.59 of all drafts kept (those after a rejection are never looked at)."""
    rng = np.random.default_rng(0)
    meter = AcceptanceMeter(weight=0.05)
    rates = []
    for _ in range(2000):
        kept = 0
        while kept < 4 and rng.random() < 0.8:
            kept += 1
        meter.observe(4, kept, round_trip_s=0.07, draft_s=0.028)
        rates.append(meter.rate)
    assert abs(float(np.mean(rates[500:])) - 0.8) < 0.03
    assert abs(meter.accepted / meter.drafted - 0.59) < 0.03
    assert abs(meter.accepted / meter.judged - 0.8) < 0.03  # the whole run's own count
    # With the rate right, a dear round trip and cheap drafts call for more than 4.
    assert meter.choose(None) > 4
