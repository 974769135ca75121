"""Device, edge and cloud in this process: split outputs equal the whole model's.

The tiers are called in process ([Note: the next tier in process] in
tierflow/runtime/upstream.py); one case of each check that needs them runs them as gRPC
servers too, and emulated links need real streams.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tierflow.cache.memory import MemoryCache
from tierflow.codec.base import EXACT_PLANNER_CODECS
from tierflow.device.client import DeviceClient
from tierflow.link.spec import LinkSpec
from tierflow.onnxrt.inference import open_session
from tierflow.options import RuntimeOptions
from tierflow.plan import load_plan

GRPC = pytest.param(True, marks=pytest.mark.integration, id="grpc")


@pytest.mark.parametrize(
    ("model", "codec", "grpc"),
    [
        *[(model, codec, False) for model in ("cnn", "residual") for codec in ("raw", "zstd")],
        ("cnn", "shuffle+zstd", False),
        ("residual", "shuffle+zstd", False),
        pytest.param("residual", "shuffle+zstd", True, marks=pytest.mark.integration),
    ],
)
def test_lossless_codecs_reproduce_the_model_exactly(
    tmp_path: Path, rt: Any, model: str, codec: str, grpc: bool
) -> None:
    split = getattr(rt, model)(tmp_path / "plan", {"device-edge": codec, "edge-cloud": codec})
    samples = split.sample(seed=3, count=6)
    with rt.device(split.plan_dir, grpc=grpc, window=4) as device:
        results = list(device.run_stream(samples))
    assert len(results) == len(samples)
    for feeds, result in zip(samples, results, strict=True):
        result.unwrap()
        expected = split.reference(feeds)
        assert sorted(result.outputs) == sorted(expected)
        for name, value in expected.items():
            assert result.outputs[name].dtype == value.dtype
            np.testing.assert_array_equal(result.outputs[name], value)
        assert result.answered_by == "cloud"
        assert result.exit is None and not result.cache_hit
        assert result.bytes["device-edge"] > 0 and result.bytes["edge-cloud"] > 0
        assert result.ms["edge"] > 0 and result.ms["cloud"] > 0
        for tier in ("device", "edge", "cloud"):
            assert result.timings[tier]["compute_ms"] > 0 and result.timings[tier]["codec_ms"] > 0
        assert result.ms["total"] >= result.ms["device"]


@pytest.mark.parametrize("codec", ["sparse+zstd", "drop+sparse+zstd", "sparse+shuffle+zstd"])
def test_lossless_stages_reproduce_the_model_bit_for_bit(
    tmp_path: Path, rt: Any, codec: str
) -> None:
    """The planner's exact stages (sparse zeros, dropped constant channels, shuffled bytes)
    on post-ReLU features with a dead channel, so that every stage has work to do."""
    assert codec in EXACT_PLANNER_CODECS
    split = rt.cnn(
        tmp_path / "plan", {"device-edge": codec, "edge-cloud": codec}, dead_channel=True
    )
    samples = split.sample(seed=9, count=4)
    device_part = open_session(split.plan_dir / load_plan(split.plan_dir).segments[0].file)
    (h1,) = device_part.run(["h1"], samples[0])
    assert not h1[0, 0].any() and (h1 == 0).mean() > 0.25  # a constant channel, zeros
    with rt.device(split.plan_dir, window=4) as device:
        results = [r.unwrap() for r in device.run_stream(samples)]
    for feeds, result in zip(samples, results, strict=True):
        expected = split.reference(feeds)["y"]
        assert result.outputs["y"].dtype == expected.dtype
        assert result.outputs["y"].tobytes() == expected.tobytes()
        assert result.bytes["device-edge"] < h1.nbytes  # the stages shrank the features


def test_int8_zstd_stays_close_and_keeps_the_argmax(tmp_path: Path, rt: Any) -> None:
    split = rt.cnn(tmp_path / "plan", {"device-edge": "int8+zstd", "edge-cloud": "int8+zstd"})
    lossless = rt.cnn(tmp_path / "exact", {"device-edge": "raw", "edge-cloud": "raw"})
    samples = split.sample(seed=4, count=8)
    with rt.device(split.plan_dir) as device:
        results = [r.unwrap() for r in device.run_stream(samples)]
    with rt.device(lossless.plan_dir) as device:
        exact_bytes = [r.unwrap().bytes for r in device.run_stream(samples)]
    for feeds, result in zip(samples, results, strict=True):
        expected = split.reference(feeds)["y"]
        got = result.outputs["y"]
        assert not np.array_equal(got, expected)  # it is lossy ...
        np.testing.assert_allclose(got, expected, atol=0.05 * np.abs(expected).max())
        assert got.argmax() == expected.argmax()  # ... but gives the same answer
    # int8 features are about a quarter of float32 ones (zstd may shrink both further).
    assert results[0].bytes["device-edge"] < exact_bytes[0]["device-edge"] / 2


@pytest.mark.parametrize("grpc", [False, GRPC])
def test_a_confident_exit_answers_on_the_edge(tmp_path: Path, rt: Any, grpc: bool) -> None:
    always = rt.cnn(tmp_path / "always", {"device-edge": "raw"}, exit_threshold=0.0)
    never = rt.cnn(tmp_path / "never", {"device-edge": "raw"}, exit_threshold=1.01)
    feeds = always.sample(seed=5)[0]
    with rt.device(always.plan_dir, grpc=grpc) as device:
        early = device.infer(feeds)
    assert early.answered_by == "edge" and early.exit == "exit_edge"
    assert list(early.outputs) == ["exit_edge"]
    assert early.bytes["edge-cloud"] == 0 and early.ms["cloud"] == 0
    with rt.device(never.plan_dir, grpc=grpc) as device:
        late = device.infer(feeds)
    assert late.answered_by == "cloud" and late.exit is None
    np.testing.assert_array_equal(late.outputs["y"], never.reference(feeds)["y"])


def test_the_cloud_cache_answers_a_repeated_feature(tmp_path: Path, rt: Any) -> None:
    split = rt.residual(tmp_path / "plan", {"device-edge": "zstd", "edge-cloud": "zstd"})
    feeds = split.sample(seed=6)[0]
    cache = MemoryCache(1 << 20)
    with rt.device(split.plan_dir, cloud_cache=cache) as device:
        first = device.infer(feeds)
        second = device.infer(feeds)  # the cloud stored its answer before it answered
        other = device.infer(split.sample(seed=7)[0])
    assert not first.cache_hit
    assert second.cache_hit and second.answered_by == "cloud"
    for name in first.outputs:
        np.testing.assert_array_equal(second.outputs[name], first.outputs[name])
    assert not other.cache_hit


@pytest.mark.integration
def test_emulated_links_slow_requests_to_the_link_rate(tmp_path: Path, rt: Any) -> None:
    split = rt.cnn(tmp_path / "plan", {"device-edge": "raw", "edge-cloud": "raw"})
    feeds = split.sample(seed=8)[0]
    links = {"device-edge": LinkSpec(200e3, 0.02), "edge-cloud": LinkSpec(1e9, 0.0)}
    with (
        rt.tiers(split.plan_dir, links=links) as (edge, _, _),
        DeviceClient(split.plan_dir, edge, options=RuntimeOptions(links=links)) as device,
    ):
        device.infer(feeds)  # connect first
        result = device.infer(feeds)
    # h1 is 8x8x8 float32 = 2 KiB: about 84 ms up at 200 kbit/s, plus 10 ms each way.
    expected_s = LinkSpec(200e3, 0.02).transfer_s(result.bytes["device-edge"]) + 0.01
    assert expected_s * 1e3 * 0.9 < result.ms["total"] < expected_s * 1e3 + 500
    assert 150e3 < result.rate_bps["device-edge"] <= 201e3
