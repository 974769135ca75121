"""Speculative decoding's pure parts: which drafted tokens to keep, and how many to draft.

[Note: speculation]
A small draft model on the device proposes ``K`` tokens; the tiers holding the large
model score the pending token and all ``K`` drafts in one pass (one round trip), which
gives the large model's distribution at each of the ``K + 1`` positions.

* Greedy: the drafts are kept while each equals the large model's argmax at its position;
  the large model's argmax after the last kept draft is the next token (a correction, or
  a bonus when all ``K`` were kept). The output is the large model's own greedy output,
  token for token: every kept token is its argmax, and so is the one added. The tiers
  answer those argmaxes alone (tier.proto: Request.choices_only), not ``K + 1`` rows of
  logits: with a vocabulary of 256, 8 bytes a position instead of 1 KiB, which on a
  1 Mbit/s link is 8 ms a position less on the way back.
* Sampling (``temperature > 0``): draft ``d`` at position ``i`` is kept with probability
  ``min(1, p_i(d) / q_i(d))`` (``p`` the large model's distribution, ``q`` the draft's);
  at the first rejection the next token is drawn from ``max(0, p_i - q_i)`` renormalised,
  and when all are kept from ``p_K``. This is the standard acceptance rule (Leviathan et
  al., 2023; Chen et al., 2023), which keeps the large model's distribution exactly.

Every tier cuts its KV cache back to the kept length on the next request ([Note: session
state on a tier] in tierflow/state/store.py), so rejected tokens leave no trace.

``--draft-tokens auto`` picks ``K`` from the acceptance rate ``a`` seen so far and the
measured costs: a round trip of the large model takes ``r`` and a draft step ``d``, so
``K`` drafts give ``(1 - a**(K+1)) / (1 - a)`` tokens for ``r + K*d`` seconds; the ``K``
in ``1..MAX_DRAFT`` with the most tokens per second wins. That formula's ``a`` is the
chance that a draft is kept once those before it were, so it is measured over the drafts
the large model looked at: a round that kept ``k`` of ``K`` looked at ``k + 1`` (``K``
when all were kept), and ``a`` is kept over looked at, both as running means. The share
of all drafts kept (what ``generate`` reports as ``acceptance``) is lower: drafts after
a rejection are never looked at, and counting them as rejected would make ``auto`` draft
too few. The means weigh each round by 0.1 (about the last ten rounds): the tokens per
second are flat near the best ``K``, so a jumpy ``a`` costs more than a slow one. With
0.3, one rejected round pulled ``a`` down far enough to draft one or two, and the byte
family's split at 30 ms, 1 Mbit/s drafted 2.6 a round for 2.39 tokens (47.5 ms a token);
with 0.1, 3.2 a round for 2.86 tokens (43.3 ms), and as fast within noise at 5 ms,
100 Mbit/s and 100 ms, 10 Mbit/s (one run each, three prompts).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

#: The most tokens drafted per round.
MAX_DRAFT = 8
#: The first rounds' acceptance rate, before any was measured.
PRIOR_ACCEPTANCE = 0.6


def softmax(logits: np.ndarray, temperature: float) -> np.ndarray:
    """The distribution of ``logits`` (last axis) at ``temperature`` (> 0), in float64."""
    scaled = np.asarray(logits, dtype=np.float64) / temperature
    scaled -= scaled.max(axis=-1, keepdims=True)
    weights = np.exp(scaled)
    return weights / weights.sum(axis=-1, keepdims=True)


@dataclass(frozen=True)
class Verdict:
    """What one verification kept: ``kept`` drafts, then ``token`` (the large model's)."""

    kept: int
    token: int


def verify_greedy(choices: Sequence[int] | np.ndarray, drafts: Sequence[int]) -> Verdict:
    """Greedy acceptance ([Note: speculation]); ``choices`` are the large model's argmax
    at each of the K + 1 positions."""
    kept = 0
    while kept < len(drafts) and int(choices[kept]) == drafts[kept]:
        kept += 1
    return Verdict(kept, int(choices[kept]))


def verify_sampled(
    target: np.ndarray,
    draft: np.ndarray,
    drafts: Sequence[int],
    temperature: float,
    rng: np.random.Generator,
) -> Verdict:
    """Sampled acceptance ([Note: speculation]): ``target`` [K + 1, vocab] logits of the
    large model, ``draft`` [K, vocab] logits the draft chose ``drafts`` from."""
    p = softmax(target, temperature)
    q = softmax(draft, temperature)
    for i, token in enumerate(drafts):
        if rng.random() * q[i, token] < p[i, token]:  # kept with probability min(1, p/q)
            continue
        residual = np.maximum(p[i] - q[i], 0.0)
        total = residual.sum()
        weights = residual / total if total > 0 else p[i]
        return Verdict(i, int(rng.choice(len(weights), p=weights)))
    last = p[len(drafts)]
    return Verdict(len(drafts), int(rng.choice(len(last), p=last)))


def sample(logits: np.ndarray, temperature: float, rng: np.random.Generator) -> int:
    """One token from ``logits`` [vocab]: argmax at temperature 0, else drawn."""
    if temperature <= 0:
        return int(np.argmax(logits))
    weights = softmax(logits, temperature)
    return int(rng.choice(len(weights), p=weights))


def expected_tokens(acceptance: float, drafts: int) -> float:
    """Tokens one round gives on average with ``drafts`` drafts kept each with ``acceptance``."""
    a = min(max(acceptance, 0.0), 0.999)
    return (1.0 - a ** (drafts + 1)) / (1.0 - a)


def choose_drafts(acceptance: float, round_trip_s: float, draft_step_s: float) -> int:
    """The number of drafts with the most tokens per second ([Note: speculation])."""
    best, best_rate = 1, -1.0
    for k in range(1, MAX_DRAFT + 1):
        rate = expected_tokens(acceptance, k) / max(round_trip_s + k * draft_step_s, 1e-9)
        if rate > best_rate + 1e-12:
            best, best_rate = k, rate
    return best


class AcceptanceMeter:
    """The running acceptance rate of drafted tokens, and the costs ``auto`` weighs."""

    def __init__(self, weight: float = 0.1) -> None:
        self.weight = weight
        # Running means of drafts kept and drafts looked at per round ([Note: speculation]).
        self._kept = PRIOR_ACCEPTANCE
        self._looked = 1.0
        self.round_trip_s: float | None = None
        self.draft_step_s: float | None = None
        self.drafted = 0
        self.accepted = 0
        self.judged = 0  # drafts the large model looked at: kept, or the first it rejected

    @property
    def rate(self) -> float:
        """The chance that a draft is kept once those before it were."""
        return self._kept / self._looked

    def observe(self, drafted: int, kept: int, round_trip_s: float, draft_s: float) -> None:
        if drafted <= 0:
            return
        self.drafted += drafted
        self.accepted += kept
        looked = kept + 1 if kept < drafted else drafted
        self.judged += looked
        self._kept += self.weight * (kept - self._kept)
        self._looked += self.weight * (looked - self._looked)
        per_draft = draft_s / drafted
        self.round_trip_s = _blend(self.round_trip_s, round_trip_s, self.weight)
        self.draft_step_s = _blend(self.draft_step_s, per_draft, self.weight)

    def choose(self, fixed: int | None) -> int:
        """``fixed`` drafts, or (None: ``auto``) the best for what was measured so far."""
        if fixed is not None:
            return fixed
        if self.round_trip_s is None or self.draft_step_s is None:
            return 4
        return choose_drafts(self.rate, self.round_trip_s, self.draft_step_s)


def _blend(old: float | None, new: float, weight: float) -> float:
    return new if old is None else old + weight * (new - old)
