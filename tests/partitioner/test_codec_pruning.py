"""Codecs skipped at a cut by a cheap look at its features ([Note: codec pruning])."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tierflow.codec.base import EXACT_PLANNER_CODECS, measure
from tierflow.link.spec import LinkSpec
from tierflow.partitioner.codec_pruning import CutTraits, pruned_by
from tierflow.partitioner.graph import load_model
from tierflow.partitioner.plan_options import PlanOptions
from tierflow.partitioner.profile import capture_features, measure_cut_codecs, profile_model
from tierflow.partitioner.ranking import rank

EXACT = ("zstd", "sparse+zstd", "drop+sparse+zstd")


def _post_relu(seed: int = 0) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((1, 8, 16, 16)).astype(np.float32)
    return np.maximum(x, 0.0)


def test_traits_count_zero_bits_and_constant_channels() -> None:
    features = _post_relu()
    traits = CutTraits.of([features, np.arange(5)])  # integer tensors are not looked at
    assert 0.4 < traits.zero_share < 0.6 and not traits.constant_channel
    features[0, 3] = 0.0
    assert CutTraits.of([features]).constant_channel
    negative_zero = np.full((1, 4), -0.0, np.float32)
    assert CutTraits.of([negative_zero]) == CutTraits(0.0, True)  # -0.0 is not a zero bit


def test_a_stage_is_skipped_only_for_the_codec_without_it_that_is_measured() -> None:
    post_relu = CutTraits.of([_post_relu()])
    assert pruned_by("drop+sparse+zstd", post_relu, EXACT) == "sparse+zstd"
    assert pruned_by("sparse+zstd", post_relu, EXACT) is None
    assert pruned_by("drop+sparse+zstd", post_relu, ("drop+sparse+zstd",)) is None
    dense = CutTraits(zero_share=0.02, constant_channel=True)
    assert pruned_by("sparse+zstd", dense, EXACT) == "zstd"  # 2% of 4 bytes < 1/8 byte
    assert pruned_by("drop+sparse+zstd", dense, EXACT) is None  # drop+zstd is not measured
    # A skipped zero saves what the quantiser stores: int4 needs over 25% zeros.
    assert pruned_by("sparse+int4+zstd", CutTraits(0.2, False), ("int4+zstd",)) == "int4+zstd"
    assert pruned_by("sparse+int4+zstd", CutTraits(0.3, False), ("int4+zstd",)) is None
    assert pruned_by("sparse+zstd", CutTraits(0.02, False), EXACT, "float64") is None


def _model(path: Path) -> Path:
    """Conv, Relu, Conv: the cut after the Relu is about half zeros, the input has none."""
    rng = np.random.default_rng(0)
    weights = [
        numpy_helper.from_array((rng.standard_normal((8, 8, 1, 1)) * 0.3).astype(np.float32), n)
        for n in ("w0", "w1")
    ]
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["x", "w0"], ["c"]),
            helper.make_node("Relu", ["c"], ["h"]),
            helper.make_node("Conv", ["h", "w1"], ["y"]),
        ],
        "relu",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 16, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 16, 16])],
        weights,
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def test_skipped_codecs_are_never_worth_choosing_and_the_rest_are_measured(
    tmp_path: Path,
) -> None:
    graph = load_model(_model(tmp_path / "relu.onnx"))
    features = capture_features(graph)
    stats = measure_cut_codecs(graph, features, EXACT)
    for cut, figures in zip(graph.cuts, stats, strict=True):
        assert tuple(figures) == EXACT
        traits = CutTraits.of([features[t] for t in cut.tensors])
        for codec, measured in figures.items():
            skipped = pruned_by(codec, traits, EXACT) is not None
            assert math.isinf(measured.encode_s_per_mb) == skipped
            if not skipped:
                assert measured.ratio == measure(codec, [features[t] for t in cut.tensors]).ratio
    h = next(i for i, cut in enumerate(graph.cuts) if cut.tensors == ("h",))
    assert math.isinf(stats[0]["sparse+zstd"].encode_s_per_mb)  # random input: no zeros
    assert not math.isinf(stats[h]["sparse+zstd"].encode_s_per_mb)  # post-ReLU: half zeros
    assert math.isinf(stats[h]["drop+sparse+zstd"].encode_s_per_mb)  # no constant channel


@pytest.mark.integration
def test_a_codec_named_explicitly_is_measured_where_the_profile_skipped_it(
    tmp_path: Path,
) -> None:
    graph = load_model(_model(tmp_path / "relu.onnx"))
    base = profile_model(graph, time_budget_s=0.2, codecs=EXACT_PLANNER_CODECS)
    assert math.isinf(base.cuts[1].codecs["drop+sparse+zstd"].encode_s_per_mb)
    profiles = {"device": base.emulate(4.0), "edge": base.emulate(2.0), "cloud": base}
    links = {"device-edge": LinkSpec.parse("1mbit"), "edge-cloud": LinkSpec.parse("1mbit")}
    result, notes = rank(graph, profiles, PlanOptions(links=links, codec="drop+sparse+zstd"))
    assert all(math.isfinite(e.latency_s) for e in result.ranked)
    assert any("drop+sparse+zstd" in note for note in notes)
    # Under auto, sparse+zstd stands in for it: nothing is measured again.
    _, notes = rank(graph, profiles, PlanOptions(links=links))
    assert not any("measured on this machine" in note for note in notes)
