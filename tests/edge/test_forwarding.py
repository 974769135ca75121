"""An edge that runs nothing forwards what the device sent, as it came.

See [Note: an edge that runs nothing] in tierflow/plan.py. A cloud-only plan (the edge
and the device run no segment) serves a small CNN through three tiers: a lossy codec is
applied once (the outputs are the model's on the once-decoded input, bit for bit), the
cloud receives the device's bytes, and an exact codec stays bit-exact. References run
at the tiers' optimisation level and thread count (see [Note: optimization level and
exactness] in tierflow/onnxrt/inference.py). The tiers are called in process ([Note: the
next tier in process] in tierflow/runtime/upstream.py); the edge's cache runs on servers.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest

from tierflow.cache.memory import MemoryCache
from tierflow.codec.base import ImageNorm, decode, encode
from tierflow.edge.forwarding import Forwarding
from tierflow.errors import UsageError
from tierflow.onnxrt.inference import open_session
from tierflow.partitioner.fidelity_probe import plan_fidelity, run_plan_dir
from tierflow.partitioner.split import session
from tierflow.plan import Plan, SegmentSpec, load_plan, save_plan
from tierflow.rpc import tier_pb2
from tierflow.runtime.upstream import LocalUpstream
from tierflow.transport.wire import to_proto

UNIT = ImageNorm(mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0))


def _cloud_only(rt: Any, directory: Path, de: str, ec: str) -> tuple[Path, Path]:
    """rt.cnn's model as one cloud segment, with ``de`` and ``ec`` in plan.json."""
    split = rt.cnn(directory / "split")
    plan_dir = directory / "plan"
    plan_dir.mkdir()
    shutil.copy(split.model_path, plan_dir / "model.onnx")
    shutil.copy(split.model_path, plan_dir / "segment0_cloud.onnx")
    plan = Plan(
        model_file="model.onnx",
        model_sha256=hashlib.sha256(split.model_path.read_bytes()).hexdigest(),
        inputs=("x",),
        outputs=("y",),
        segments=(SegmentSpec("cloud", "segment0_cloud.onnx", ("x",), ("y",)),),
        codec={"device-edge": de, "edge-cloud": ec},
        images={"x": UNIT},
    )
    save_plan(plan, plan_dir)
    return plan_dir, split.model_path


def _requests(count: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(7)
    return [{"x": rng.uniform(0, 1, (1, 3, 8, 8)).astype(np.float32)} for _ in range(count)]


def _once(codec: str, array: np.ndarray) -> np.ndarray:
    """``array`` after one encode and one decode with ``codec``."""
    image = UNIT if codec.startswith("jpeg") else None
    return decode(encode("x", array, codec, image=image))


@pytest.mark.parametrize("codec", ["jpeg:30", "int4+zstd", "zstd"])
def test_a_cloud_only_plan_applies_the_codec_once(rt: Any, tmp_path: Path, codec: str) -> None:
    # plan.json says raw for edge-cloud, as plans written before forwarding could:
    # the edge still forwards the device's encoding.
    plan_dir, model = _cloud_only(rt, tmp_path, codec, "raw")
    plan = load_plan(plan_dir)
    assert plan.edge_forwards and str(plan.link_codec("edge-cloud")) == codec
    requests = _requests(6)
    with rt.device(plan_dir, window=4) as device:
        results = [r.unwrap() for r in device.run_stream(requests)]
    whole = open_session(model)
    for feeds, result in zip(requests, results, strict=True):
        expected = whole.run(["y"], {"x": _once(codec, feeds["x"])})[0]
        np.testing.assert_array_equal(result.outputs["y"], expected)
        if codec == "zstd":  # exact: the model's own outputs
            np.testing.assert_array_equal(result.outputs["y"], whole.run(["y"], feeds)[0])
        # The cloud got what the device sent; the edge ran and decoded nothing.
        assert result.bytes["edge-cloud"] == result.bytes["device-edge"]
        assert result.timings["edge"]["compute_ms"] == 0.0
    # A plan directory measured offline applies the codec once too.
    sessions = [session(onnx.load(str(plan_dir / "segment0_cloud.onnx")))]
    offline = run_plan_dir(plan, sessions, requests[0])["y"]
    once = whole.run(["y"], {"x": _once(codec, requests[0]["x"])})[0]
    np.testing.assert_array_equal(offline, once)
    if codec == "zstd":
        sample = {"x": np.stack([r["x"] for r in requests])}
        assert plan_fidelity(plan_dir, model, sample).value == 1.0


def test_the_edge_leaves_the_payload_to_the_cloud(rt: Any, tmp_path: Path) -> None:
    """A corrupt JPEG with a sound header crosses the edge; the cloud refuses it, typed."""
    plan_dir, _ = _cloud_only(rt, tmp_path, "jpeg:50", "jpeg:50")
    plan = load_plan(plan_dir)
    good = to_proto(encode("x", _requests(1)[0]["x"], "jpeg:50", image=UNIT))
    bad = tier_pb2.Tensor()
    bad.CopyFrom(good)
    bad.data = good.data[:4] + b"\x00" * (len(good.data) - 4)
    requests = [
        tier_pb2.Request(plan_id=plan.plan_id, segment=0, tensors=[tensor])
        for tensor in (good, bad)
    ]
    with rt.in_process(plan_dir) as tiers:
        device = LocalUpstream(tiers.edge, me="device")
        good_reply, bad_reply = (device.submit(r).future.result() for r in requests)
    assert not good_reply.HasField("error"), good_reply.error.message
    assert good_reply.answered_by == "cloud"
    error = bad_reply.error
    assert tier_pb2.ErrorCode.Name(error.code) == "CODEC"
    assert error.tier == "cloud", error.message


def test_a_forwarding_edge_with_a_cache_answers_repeats_and_forwards_the_rest(
    rt: Any, tmp_path: Path
) -> None:
    """The edge decodes only to look its cache up; what it forwards is still the device's."""
    plan_dir, model = _cloud_only(rt, tmp_path, "jpeg:30", "jpeg:30")
    feeds, other = _requests(2)
    cache = MemoryCache(1 << 20)
    with rt.device(plan_dir, edge_cache=cache) as device:
        first = device.infer(feeds).unwrap()
        second = device.infer(feeds).unwrap()  # stored once the answer was sent
        third = device.infer(other).unwrap()
    whole = open_session(model)
    assert first.answered_by == "cloud" and not first.cache_hit
    assert first.bytes["edge-cloud"] == first.bytes["device-edge"]
    expected = whole.run(["y"], {"x": _once("jpeg:30", feeds["x"])})[0]
    np.testing.assert_array_equal(first.outputs["y"], expected)
    assert second.cache_hit and second.answered_by == "edge"
    np.testing.assert_array_equal(second.outputs["y"], expected)
    assert not third.cache_hit
    np.testing.assert_array_equal(
        third.outputs["y"], whole.run(["y"], {"x": _once("jpeg:30", other["x"])})[0]
    )
    assert cache.stats().hits == 1


def test_forwarding_needs_an_address_or_an_upstream() -> None:
    with pytest.raises(UsageError, match="give its address or upstream"):
        Forwarding()
