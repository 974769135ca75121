"""Image inputs through the tiers: PNG and JPEG plans round-trip, corrupt images are refused.

A CNN reads 32x32 crops of scikit-learn's sample photos, normalised as ImageNet models
expect. The partitioner plans it with ``--image-input``; the device encodes the input as
an image, the edge decodes it back into the model's tensor. References run at the tiers'
optimisation level and thread count (see [Note: optimization level and exactness] in
tierflow/onnxrt/inference.py). The tiers are called in process ([Note: the next tier in
process] in tierflow/runtime/upstream.py).
"""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tierflow.codec.base import ImageNorm, decode, encode
from tierflow.link.spec import LinkSpec
from tierflow.onnxrt.inference import open_session
from tierflow.partitioner.fidelity import FidelityBudget
from tierflow.partitioner.graph import load_model
from tierflow.partitioner.plan_options import PlanOptions
from tierflow.partitioner.planner import make_plan
from tierflow.partitioner.profile import profile_model
from tierflow.plan import load_plan
from tierflow.rpc import tier_pb2
from tierflow.runtime.upstream import LocalUpstream
from tierflow.transport.wire import to_proto

SIDE = 32
IMAGENET = ImageNorm(mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225))
LINKS = {"device-edge": LinkSpec.parse("2mbit,1ms"), "edge-cloud": LinkSpec.parse("2mbit,1ms")}


def _cnn(path: Path) -> Path:
    rng = np.random.default_rng(0)
    w1 = (rng.standard_normal((8, 3, 3, 3)) * 0.3).astype(np.float32)
    w2 = (rng.standard_normal((10, 8)) * 0.3).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["x", "w1"], ["c"], pads=[1, 1, 1, 1], strides=[2, 2]),
            helper.make_node("Relu", ["c"], ["h"]),
            helper.make_node("GlobalAveragePool", ["h"], ["p"]),
            helper.make_node("Flatten", ["p"], ["f"]),
            helper.make_node("Gemm", ["f", "w2"], ["y"], transB=1),
        ],
        "cnn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, SIDE, SIDE])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 10])],
        [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2")],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


@functools.cache
def _sample_photos() -> tuple[np.ndarray, ...]:
    from PIL import Image

    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("scikit-learn (the photos' package) is not installed")
    folder = Path(next(iter(spec.submodule_search_locations))) / "datasets" / "images"
    return tuple(
        np.asarray(Image.open(folder / name).convert("RGB")) for name in ("china.jpg", "flower.jpg")
    )


def _photos(count: int, seed: int) -> dict[str, np.ndarray]:
    images = _sample_photos()
    rng = np.random.default_rng(seed)
    mean = np.array(IMAGENET.mean, np.float32).reshape(3, 1, 1)
    std = np.array(IMAGENET.std, np.float32).reshape(3, 1, 1)
    rows = []
    for _ in range(count):
        image = images[int(rng.integers(len(images)))]
        top = int(rng.integers(0, image.shape[0] - SIDE))
        left = int(rng.integers(0, image.shape[1] - SIDE))
        crop = image[top : top + SIDE, left : left + SIDE].transpose(2, 0, 1).astype(np.float32)
        rows.append(((crop / np.float32(255.0) - mean) / std)[np.newaxis])
    return {"x": np.stack(rows)}


@pytest.fixture(scope="module")
def cnn(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, dict[str, Any]]:
    path = _cnn(tmp_path_factory.mktemp("image-plans") / "cnn.onnx")
    graph = load_model(path)
    base = profile_model(graph, time_budget_s=0.3)
    slow = replace(base, units=tuple(replace(u, compute_s=u.compute_s * 1e4) for u in base.units))
    return path, graph, {"device": slow, "edge": base.emulate(2.0), "cloud": base}


def _reference(path: Path, requests: list[dict[str, np.ndarray]]) -> list[np.ndarray]:
    session = open_session(path)
    return [session.run(["y"], feeds)[0] for feeds in requests]


def _serve(rt: Any, plan_dir: Path, requests: list[dict[str, np.ndarray]]) -> list[Any]:
    with rt.device(plan_dir, window=8) as device:  # the tiers in process
        return [r.unwrap() for r in device.run_stream(requests)]


def test_a_png_plan_reproduces_the_model_bit_for_bit(cnn: Any, tmp_path: Path, rt: Any) -> None:
    path, graph, profiles = cnn
    options = PlanOptions(links=LINKS, images={"x": IMAGENET})
    outcome = make_plan(graph, profiles, options, tmp_path / "plan", sample=_photos(20, 1))
    assert outcome.plan.codec["device-edge"] == "png"
    requests = [{"x": row} for row in _photos(8, 2)["x"]]
    results = _serve(rt, tmp_path / "plan", requests)
    for expected, result in zip(_reference(path, requests), results, strict=True):
        np.testing.assert_array_equal(result.outputs["y"], expected)
    raw_bytes = requests[0]["x"].nbytes
    assert results[0].bytes["device-edge"] < raw_bytes / 2  # one byte per pixel, compressed


def test_a_jpeg_plan_runs_the_model_on_the_decoded_jpeg(cnn: Any, tmp_path: Path, rt: Any) -> None:
    path, graph, profiles = cnn
    options = PlanOptions(
        links=LINKS,
        codec="jpeg:80",
        fidelity=FidelityBudget.parse("top1=90%"),
        images={"x": IMAGENET},
    )
    outcome = make_plan(graph, profiles, options, tmp_path / "plan", sample=_photos(20, 3))
    assert outcome.plan.codec["device-edge"] == "jpeg:80"
    requests = [{"x": row} for row in _photos(8, 4)["x"]]
    results = _serve(rt, tmp_path / "plan", requests)
    # What the edge computes on is exactly the JPEG the device made, decoded.
    decoded = [
        {"x": decode(encode("x", feeds["x"], "jpeg:80", image=IMAGENET))} for feeds in requests
    ]
    for expected, result in zip(_reference(path, decoded), results, strict=True):
        np.testing.assert_array_equal(result.outputs["y"], expected)
    assert results[0].bytes["device-edge"] < requests[0]["x"].nbytes / 5


def test_corrupt_images_get_typed_codec_errors(cnn: Any, tmp_path: Path, rt: Any) -> None:
    _, graph, profiles = cnn
    options = PlanOptions(links=LINKS, images={"x": IMAGENET})
    make_plan(graph, profiles, options, tmp_path / "plan", sample=_photos(10, 5))
    plan = load_plan(tmp_path / "plan")
    row = _photos(1, 6)["x"][0]
    good = to_proto(encode("x", row, "jpeg:90", image=IMAGENET))

    def request(**changes: Any) -> tier_pb2.Request:
        tensor = tier_pb2.Tensor()
        tensor.CopyFrom(good)
        for key, value in changes.items():
            if key == "shape":
                del tensor.shape[:]
                tensor.shape.extend(value)
            else:
                setattr(tensor, key, value)
        return tier_pb2.Request(plan_id=plan.plan_id, segment=0, tensors=[tensor])

    cases = [
        (request(), None),
        (request(data=good.data[:-40]), "CODEC"),  # truncated JPEG
        (request(data=b"\x05\x00\x00\x00hello"), "CODEC"),  # not an image at all
        (request(data=good.data[:4] + b"\x00" * (len(good.data) - 4)), "CODEC"),
        (request(params=b"\x00" * 8), "CODEC"),  # no normalisation
        (request(codec="png"), "CODEC"),  # JPEG bytes claimed as PNG
        (request(shape=[1, 3, 64, 64]), "INVALID_INPUT"),  # not what the edge expects
        (request(), None),
    ]
    with rt.in_process(tmp_path / "plan") as tiers:
        device = LocalUpstream(tiers.edge, me="device")
        replies = [device.submit(req).future.result() for req, _ in cases]
    for index, (reply, (_, expected)) in enumerate(zip(replies, cases, strict=True)):
        if expected is None:
            assert not reply.HasField("error"), reply.error.message
        else:
            assert reply.HasField("error"), index
            assert tier_pb2.ErrorCode.Name(reply.error.code) == expected, reply.error.message
