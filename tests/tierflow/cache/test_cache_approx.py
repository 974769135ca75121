"""The approximate cache: threshold never exceeded, scoping, calibration on a digits stream."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from tierflow.cache.approx import (
    ApproxCache,
    Calibration,
    calibrate_threshold,
    distance,
    evaluate_threshold,
    nearest,
    same_top1,
    signature,
)
from tierflow.cache.base import CacheAnswer, cache_key
from tierflow.errors import CacheError


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def labelled(index: int) -> CacheAnswer:
    """An answer that names the entry it came from."""
    return CacheAnswer({"id": np.array([index], dtype=np.int64)})


@dataclass(frozen=True)
class DigitStream:
    """Digits as video clips: every frame of a clip is the clip's image, slightly disturbed.

    ``features`` stands in for the first segment's output (a fixed random projection and a
    ReLU), ``answer`` for the rest of the model (a nearest-class-mean classifier on them).
    """

    images: np.ndarray
    projection: np.ndarray
    class_means: np.ndarray

    def frames(self, clips: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        frames = self.images[clips] + rng.normal(0, 0.75, (len(clips), 8, 8)).astype(np.float32)
        shifted = rng.random(len(clips)) < 0.2
        frames[shifted] = np.roll(frames[shifted], 1, axis=2)
        return np.clip(frames, 0, 16)

    def features(self, frames: np.ndarray) -> np.ndarray:
        return np.maximum(frames.reshape(len(frames), 64) @ self.projection, 0)

    def answers(self, features: np.ndarray) -> np.ndarray:
        gaps = ((features[:, None, :] - self.class_means[None]) ** 2).sum(-1)
        return np.argmin(gaps, axis=1)


@pytest.fixture(scope="module")
def digits() -> DigitStream:
    from sklearn.datasets import load_digits

    data = load_digits()
    images = data.images.astype(np.float32)
    projection = np.random.default_rng(0).standard_normal((64, 512)).astype(np.float32) / 8
    clean = np.maximum(images.reshape(len(images), 64) @ projection, 0)
    means = np.stack([clean[data.target == c].mean(0) for c in range(10)])
    return DigitStream(images, projection, means)


def signatures(features: np.ndarray) -> np.ndarray:
    return np.stack([signature({"x": row[None]}) for row in features])


# --- the threshold is a hard bound -------------------------------------------------------

vectors = hnp.arrays(np.float32, (4,), elements=st.floats(-4, 4, width=32))


@settings(max_examples=80, deadline=None)
@given(
    threshold=st.floats(0.0, 1.5),
    stored=st.lists(vectors, min_size=1, max_size=12),
    queries=st.lists(vectors, min_size=1, max_size=12),
)
def test_never_answers_from_an_entry_farther_than_the_threshold(
    threshold: float, stored: list[np.ndarray], queries: list[np.ndarray]
) -> None:
    cache = ApproxCache(1 << 20, threshold=threshold, dim=4)
    sigs = []
    for index, vector in enumerate(stored):
        feats = {"x": vector}
        cache.store(cache_key("m", "p", 0, feats) + bytes([index]), feats, labelled(index))
        sigs.append(signature(feats, 4))
    for vector in queries:
        feats = {"x": vector}
        hit = cache.lookup(cache_key("m", "p", 0, feats), feats)
        query = signature(feats, 4)
        gaps = [distance(query, s) for s in sigs]
        if hit is None:
            assert min(gaps) > threshold - 1e-6  # a miss only when nothing was near enough
        else:
            assert gaps[int(hit.outputs["id"][0])] <= threshold


def test_neighbours_come_only_from_the_same_model_plan_cut_and_layout() -> None:
    cache = ApproxCache(1 << 20, threshold=0.5, dim=8)
    base = {"x": np.linspace(0, 1, 8, dtype=np.float32)[None]}
    near = {"x": base["x"] + 0.01}
    cache.store(cache_key("sha-a", "plan", 1, base), base, labelled(1))
    assert cache.lookup(cache_key("sha-a", "plan", 1, near), near) is not None
    for model, plan, segment in [
        ("sha-b", "plan", 1),
        ("sha-a", "plan-2", 1),
        ("sha-a", "plan", 2),
    ]:
        assert cache.lookup(cache_key(model, plan, segment, near), near) is None
    as_f64 = {"x": near["x"].astype(np.float64)}
    renamed = {"y": near["x"]}
    assert cache.lookup(cache_key("sha-a", "plan", 1, as_f64), as_f64) is None
    assert cache.lookup(cache_key("sha-a", "plan", 1, renamed), renamed) is None
    assert cache.approx_hits == 1


def test_exact_repeats_hit_even_without_a_threshold_and_ttl_applies() -> None:
    clock = FakeClock()
    cache = ApproxCache(1 << 20, target=0.01, ttl_s=5.0, clock=clock, dim=8)
    assert cache.threshold is None
    feats = {"x": np.arange(8, dtype=np.float32)}
    near = {"x": feats["x"] + 0.001}
    key = cache_key("m", "p", 0, feats)
    cache.store(key, feats, labelled(7))
    hit = cache.lookup(key, feats)
    assert hit is not None and hit.outputs["id"].tobytes() == labelled(7).outputs["id"].tobytes()
    assert cache.lookup(cache_key("m", "p", 0, near), near) is None  # not calibrated yet
    clock.now += 5.0
    assert cache.lookup(key, feats) is None
    stats = cache.stats()
    assert (stats.hits, stats.misses, stats.expirations, stats.entries, stats.bytes) == (
        1,
        2,
        1,
        0,
        0,
    )


@settings(max_examples=40, deadline=None)
@given(
    budget=st.integers(1500, 6000),
    ops=st.lists(st.tuples(st.booleans(), st.integers(0, 20), st.integers(0, 300)), max_size=50),
)
def test_signatures_count_against_the_budget(budget: int, ops: list[tuple[bool, int, int]]) -> None:
    cache = ApproxCache(budget, threshold=0.1, dim=64)
    for is_store, which, size in ops:
        feats = {"x": np.random.default_rng(which).standard_normal(32).astype(np.float32)}
        key = cache_key("m", "p", 0, feats)
        if is_store:
            cache.store(key, feats, CacheAnswer({"y": np.zeros(size, np.uint8)}))
        else:
            cache.lookup(key, feats)
        stats = cache.stats()
        assert stats.bytes <= budget
        assert stats.bytes >= stats.entries * 64 * 4  # each entry pays for its signature


# --- calibration ----------------------------------------------------------------------------


def test_calibrate_threshold_picks_the_largest_distance_within_the_target() -> None:
    distances = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6]
    disagree = [False, False, False, True, False, True]
    plain = calibrate_threshold(distances, disagree, 0.25, confidence=0.0)
    # rates at each distance: 0, 0, 0, 1/4, 1/5, 2/6 -> 0.5 is the largest within 25%
    assert plain.threshold == 0.5 and plain.disagreement == pytest.approx(0.2)
    assert (plain.answered, plain.samples, plain.coverage) == (5, 6, 5 / 6)
    assert calibrate_threshold(distances, disagree, 0.0, confidence=0.0).threshold == 0.3
    assert Calibration.from_dict(plain.to_dict()) == plain
    # The Wilson bound is stricter than the measured rate on few samples.
    assert calibrate_threshold(distances, disagree, 0.25).threshold is None
    # Equal distances are answered together, so a threshold cannot split them.
    tied = calibrate_threshold([0.1, 0.2, 0.2], [False, False, True], 0.0, confidence=0.0)
    assert tied.threshold == 0.1
    with pytest.raises(CacheError):
        calibrate_threshold([0.1], [True, False], 0.1)


def test_calibration_meets_its_target_on_held_out_digit_frames(digits: DigitStream) -> None:
    rng = np.random.default_rng(1)
    clips = rng.permutation(len(digits.images))
    seen = clips[:1200]  # clips whose first frame the cache already holds
    first = digits.features(digits.frames(seen, rng))
    first_answers = digits.answers(first)
    queries = np.repeat(clips, 3)  # three later frames of every clip, seen or not
    later = digits.features(digits.frames(queries, rng))
    later_answers = digits.answers(later)
    index, dist = nearest(signatures(first), signatures(later))
    disagree = first_answers[index] != later_answers
    calibrating = np.isin(queries, clips[::2])  # held out: the other half of the clips

    target = 0.05
    calibration = calibrate_threshold(dist[calibrating], disagree[calibrating], target)
    assert calibration.threshold is not None
    assert calibration.upper_bound <= target and calibration.coverage > 0.5
    held_out, coverage = evaluate_threshold(
        dist[~calibrating], disagree[~calibrating], calibration.threshold
    )
    assert held_out <= target
    assert coverage > 0.5

    # The cache with that threshold answers the held-out frames the same way.
    cache = ApproxCache(8 << 20, threshold=calibration.threshold)
    for row, label in zip(first, first_answers, strict=True):
        feats = {"x": row[None]}
        cache.store(cache_key("m", "p", 0, feats), feats, labelled(int(label)))
    wrong = answered = 0
    for row, label in zip(later[~calibrating], later_answers[~calibrating], strict=True):
        feats = {"x": row[None]}
        hit = cache.lookup(cache_key("m", "p", 0, feats), feats)
        if hit is not None:
            answered += 1
            wrong += int(hit.outputs["id"][0]) != label
    assert answered == pytest.approx(coverage * (~calibrating).sum(), abs=2)
    assert wrong / answered <= target


def test_a_target_cache_calibrates_itself_on_a_stream(digits: DigitStream) -> None:
    rng = np.random.default_rng(2)
    clips = np.repeat(rng.permutation(len(digits.images))[:600], 6)  # 6 frames per clip
    features = digits.features(digits.frames(clips, rng))
    answers = digits.answers(features)
    target = 0.05
    cache = ApproxCache(16 << 20, target=target, min_samples=300, agree=same_top1)
    approx_wrong = approx_hits = 0
    for row, label in zip(features, answers, strict=True):
        feats = {"x": row[None]}
        key = cache_key("m", "p", 0, feats)
        before = cache.approx_hits
        hit = cache.lookup(key, feats)
        if hit is None:
            cache.store(
                key, feats, CacheAnswer({"logits": np.eye(10, dtype=np.float32)[label][None]})
            )
        elif cache.approx_hits > before:
            approx_hits += 1
            approx_wrong += int(np.argmax(hit.outputs["logits"])) != label
    assert cache.threshold is not None and cache.calibration is not None
    assert cache.calibration.upper_bound <= target
    assert approx_hits > 0.3 * len(clips)
    assert approx_wrong / approx_hits <= target
    assert len(cache.observations()) >= 300


def test_threads_share_an_approximate_cache_safely() -> None:
    cache = ApproxCache(200_000, threshold=0.05, dim=16)
    errors: list[BaseException] = []

    def work(worker: int) -> None:
        rng = np.random.default_rng(worker)
        try:
            for _ in range(300):
                which = int(rng.integers(0, 40))
                base = np.random.default_rng(which).standard_normal(16).astype(np.float32)
                feats = {"x": base + rng.normal(0, 0.001, 16).astype(np.float32)}
                key = cache_key("m", "p", 0, feats)
                hit = cache.lookup(key, feats)
                if hit is None:
                    cache.store(key, feats, labelled(which))
                else:
                    assert int(hit.outputs["id"][0]) == which
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(w,)) for w in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    stats = cache.stats()
    assert stats.hits + stats.misses == 6 * 300 and stats.hits > 1000
    assert stats.bytes <= 200_000
