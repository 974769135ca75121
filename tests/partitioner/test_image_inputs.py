"""Image inputs in planning: normalisation flags, png's exactness check, image codec plans.

The model is a small CNN on 32x32 crops of scikit-learn's two sample photos, normalised
as torchvision's ImageNet models expect; the device is slow and the links narrow, so
sending the input compressed is what the planner wants.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import time
from pathlib import Path
from typing import Any, cast

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tierflow.cli.main import main
from tierflow.codec.base import EXACT_PLANNER_CODECS, CodecSpec, ImageNorm, encode
from tierflow.errors import PlanError, UsageError
from tierflow.image_norm import PRESETS, NormSpec, parse_norm
from tierflow.link.spec import LinkSpec
from tierflow.partitioner import image_inputs
from tierflow.partitioner.candidates import codec_candidates
from tierflow.partitioner.fidelity import FidelityBudget
from tierflow.partitioner.fidelity_probe import plan_fidelity
from tierflow.partitioner.graph import load_model
from tierflow.partitioner.image_inputs import (
    measure_image_codecs,
    measured_requests,
    outside_pixels,
    png_is_exact,
    resolve_images,
)
from tierflow.partitioner.plan_options import PlanOptions
from tierflow.partitioner.planner import make_plan
from tierflow.partitioner.profile import save_profile
from tierflow.partitioner.ranking import score_plan
from tierflow.plan import Plan, load_plan

from ..profiles import graph_profile

SIDE = 32
MEAN = np.array([0.485, 0.456, 0.406], np.float32).reshape(3, 1, 1)
STD = np.array([0.229, 0.224, 0.225], np.float32).reshape(3, 1, 1)
LINKS = {"device-edge": LinkSpec.parse("2mbit,1ms"), "edge-cloud": LinkSpec.parse("2mbit,1ms")}


def _cnn(path: Path) -> Path:
    rng = np.random.default_rng(0)
    w1 = (rng.standard_normal((8, 3, 3, 3)) * 0.3).astype(np.float32)
    w2 = (rng.standard_normal((10, 8)) * 0.3).astype(np.float32)
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["c"], pads=[1, 1, 1, 1], strides=[2, 2]),
        helper.make_node("Relu", ["c"], ["h"]),
        helper.make_node("GlobalAveragePool", ["h"], ["p"]),
        helper.make_node("Flatten", ["p"], ["f"]),
        helper.make_node("Gemm", ["f", "w2"], ["y"], transB=1),
    ]
    graph = helper.make_graph(
        nodes,
        "cnn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, SIDE, SIDE])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 10])],
        [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2")],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


@functools.cache
def _sample_photos() -> tuple[np.ndarray, ...]:
    """scikit-learn's two bundled photos, read with Pillow (importing sklearn takes seconds)."""
    from PIL import Image

    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("scikit-learn (the photos' package) is not installed")
    folder = Path(next(iter(spec.submodule_search_locations))) / "datasets" / "images"
    return tuple(
        np.asarray(Image.open(folder / n).convert("RGB")) for n in ("china.jpg", "flower.jpg")
    )


def photos(count: int, seed: int, side: int = SIDE) -> dict[str, np.ndarray]:
    """Random crops of the sample photos, normalised in float32 as the image codec decodes."""
    images = _sample_photos()
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(count):
        image = images[int(rng.integers(len(images)))]
        top = int(rng.integers(0, image.shape[0] - side))
        left = int(rng.integers(0, image.shape[1] - side))
        crop = image[top : top + side, left : left + side].transpose(2, 0, 1).astype(np.float32)
        rows.append(((crop / np.float32(255.0) - MEAN) / STD)[np.newaxis])
    return {"x": np.stack(rows)}


IMAGENET = ImageNorm(
    mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225), scale=255.0, layout="NCHW"
)


@pytest.fixture(scope="module")
def cnn(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, dict[str, Any]]:
    """The model, its graph, and given profiles where the device computes slowly.

    With the image codecs' times fixed too (``fixed_image_codec_times``), what the
    planner picks follows from these figures and the photos' bytes, not from the load.
    """
    path = _cnn(tmp_path_factory.mktemp("images") / "cnn.onnx")
    graph = load_model(path)
    units = len(graph.cuts) - 1
    cloud = graph_profile(graph, [2e-5] * units)
    device = graph_profile(graph, [0.2] * units)  # 10^4 times the cloud: it runs nothing
    return path, graph, {"device": device, "edge": cloud.emulate(2.0), "cloud": cloud}


class _Ticks:
    """A clock that moves 10 us each time it is read: every image encode and decode is
    measured at 10 us (libjpeg-turbo's order on a 32x32 crop), whatever the machine does."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1e-5
        return self.now


@pytest.fixture(autouse=True)
def fixed_image_codec_times(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Plans on ``cnn`` measure their image codecs' sizes and errors for real, their times
    on :class:`_Ticks` (see the ``cnn`` fixture)."""
    if "cnn" in request.fixturenames:
        monkeypatch.setattr(image_inputs, "_clock", _Ticks())


# --------------------------------------------------------------------------- flags


def test_norms_parse_from_presets_and_fields() -> None:
    assert parse_norm("x=imagenet") == ("x", NormSpec(*PRESETS["imagenet"]))
    name, spec = parse_norm("img=mean=0.5;std=0.25,0.5,1;scale=1;layout=nhwc")
    assert name == "img" and spec == NormSpec((0.5,), (0.25, 0.5, 1.0), 1.0, "NHWC")
    for text, message in [
        ("x", "expected NAME=SPEC"),
        ("x=mean=0.5", "give both mean= and std="),
        ("x=mean=a;std=1", "mean must be numbers"),
        ("x=mean=1,2;std=1", "takes 1 or 3 values"),
        ("x=mean=0;std=1;layout=CHW", "layout is NCHW or NHWC"),
        ("x=gamma=2", "expected NAME=SPEC"),
    ]:
        with pytest.raises(UsageError, match=message):
            parse_norm(text)


def test_image_inputs_resolve_against_the_model(cnn: Any) -> None:
    _, graph, _ = cnn
    images = resolve_images(graph.inputs, ["x"], {"x": NormSpec(*PRESETS["imagenet"])})
    assert images == {"x": IMAGENET}
    unit = resolve_images(graph.inputs, ["x"], {})["x"]
    assert unit.mean == (0.0,) * 3 and unit.std == (1.0,) * 3 and unit.layout == "NCHW"
    with pytest.raises(UsageError, match="'photo', which is not an input"):
        resolve_images(graph.inputs, ["photo"], {})
    with pytest.raises(UsageError, match="needs --image-input x"):
        resolve_images(graph.inputs, [], {"x": NormSpec()})
    with pytest.raises(UsageError, match="layout NHWC puts 32 channels"):
        resolve_images(graph.inputs, ["x"], {"x": NormSpec(layout="NHWC")})


def test_png_is_exact_only_for_pixels_normalised_as_declared() -> None:
    rows = photos(4, 0)["x"]
    requests = [{"x": row} for row in rows]
    assert png_is_exact(requests, {"x": IMAGENET})
    assert outside_pixels(rows[0], IMAGENET) == 0.0
    noisy = [{"x": row + np.float32(1e-3)} for row in rows]
    assert not png_is_exact(noisy, {"x": IMAGENET})
    other = ImageNorm(mean=(0.5,) * 3, std=(0.5,) * 3)
    assert not png_is_exact(requests, {"x": other})


def test_image_codec_figures_are_medians_over_the_sample_not_its_first_request() -> None:
    # A flat grey frame first: alone, it makes every JPEG quality look the same size.
    side = 128
    grey = ((np.float32(128 / 255) - MEAN) / STD)[np.newaxis].repeat(side, 2).repeat(side, 3)
    requests = [{"x": grey}] + [{"x": row} for row in photos(8, 4, side)["x"]]
    codecs = ["jpeg:10", "jpeg:90"]
    stats = measure_image_codecs(requests, {"x": IMAGENET}, codecs)
    first = measure_image_codecs(requests[:1], {"x": IMAGENET}, codecs)
    raw = grey.nbytes
    for codec in codecs:
        sizes = [encode("x", r["x"], codec, image=IMAGENET).nbytes for r in requests]
        assert stats[codec].ratio == pytest.approx(raw / float(np.median(sizes)))
        assert stats[codec].encode_s_per_mb > 0 and stats[codec].decode_s_per_mb > 0
    assert stats["jpeg:90"].ratio < stats["jpeg:10"].ratio / 1.5
    assert first["jpeg:90"].ratio > stats["jpeg:90"].ratio * 2
    # A long sample is measured on requests spread over it, first to last.
    spread = measured_requests(160)
    assert len(spread) == 16 and spread[0] == 0 and spread[-1] == 159
    assert measured_requests(5) == [0, 1, 2, 3, 4]
    with pytest.raises(UsageError, match="no requests"):
        measure_image_codecs([], {"x": IMAGENET}, codecs)


class _Stalling:
    """A tensor whose every read first stalls its reader (it sleeps), as a thread does
    that a busy machine has descheduled: time that passes without computing."""

    def __init__(self, array: np.ndarray, stall_s: float) -> None:
        self.array, self.stall_s = array, stall_s

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        time.sleep(self.stall_s)
        return self.array if dtype is None else self.array.astype(dtype)


@pytest.mark.integration
def test_image_codec_times_are_computation_not_waiting() -> None:
    # Timed on the wall clock, a stalled encode looked 30 ms slower to the planner, whose
    # emulated device multiplies it tenfold ([Note: image codec figures]).
    row = photos(1, 5, 128)["x"][0]
    stalled = [{"x": cast(np.ndarray, _Stalling(row, 0.05))} for _ in range(3)]
    plain = [{"x": row} for _ in range(3)]
    mb = row.nbytes / 1e6
    for codec, figures in measure_image_codecs(stalled, {"x": IMAGENET}, ["jpeg:50"]).items():
        calm = measure_image_codecs(plain, {"x": IMAGENET}, [codec])[codec]
        assert figures.encode_s_per_mb * mb < 0.025, "a stall counted as encode time"
        assert figures.ratio == pytest.approx(calm.ratio)


def test_image_codecs_join_the_candidates_only_for_image_inputs() -> None:
    exact = FidelityBudget()
    assert "jpeg:90" not in codec_candidates("auto", FidelityBudget("rel", 1.0))
    lossy = codec_candidates("auto", FidelityBudget("rel", 1.0), ["x"])
    assert {"jpeg:50", "jpeg:95", "webp:75", "png"} <= set(lossy)
    assert codec_candidates("auto", exact, ["x"]) == (*EXACT_PLANNER_CODECS, "png")
    with pytest.raises(UsageError, match="name them with --image-input"):
        codec_candidates("jpeg:90", FidelityBudget("rel", 1.0))
    with pytest.raises(UsageError, match="codec jpeg:90 is lossy"):
        codec_candidates("jpeg:90", exact, ["x"])


# --------------------------------------------------------------------------- plans


def test_exact_plans_send_png_only_where_the_sample_shows_it_exact(
    cnn: Any, tmp_path: Path
) -> None:
    path, graph, profiles = cnn
    options = PlanOptions(links=LINKS, images={"x": IMAGENET})
    outcome = make_plan(graph, profiles, options, tmp_path / "png", sample=photos(30, 1))
    assert "png" in outcome.plan.codec.values()
    assert outcome.fidelity is not None and outcome.fidelity.bitwise_equal
    assert outcome.fidelity.samples == 30
    assert any("png reproduces image input(s) x bit for bit" in n for n in outcome.notes)
    plan = load_plan(tmp_path / "png")
    assert plan.images == {"x": IMAGENET}
    data = json.loads((tmp_path / "png" / "plan.json").read_text())
    assert data["image_inputs"]["x"]["mean"] == pytest.approx([0.485, 0.456, 0.406])
    held_out = plan_fidelity(tmp_path / "png", path, photos(20, 2), metric="exact")
    assert held_out.bitwise_equal and held_out.value == 1.0
    # Values between pixel levels: png is no longer exact, so the plan stays lossless.
    noisy = {"x": photos(30, 1)["x"] + np.float32(1e-3)}
    outcome = make_plan(graph, profiles, options, tmp_path / "no-png", sample=noisy)
    assert all(CodecSpec.parse(c).bit_exact for c in outcome.plan.codec.values())
    assert any("png left out under the exact budget" in n for n in outcome.notes)


def test_a_jpeg_baseline_is_scored_outside_the_exact_budget(cnn: Any) -> None:
    _, graph, profiles = cnn
    options = PlanOptions(links=LINKS, images={"x": IMAGENET})
    feeds = {"x": photos(1, 3)["x"][0]}
    jpeg = score_plan(graph, profiles, options, (0, 0), dict.fromkeys(LINKS, "jpeg:90"), feeds)
    raw = score_plan(graph, profiles, options, (0, 0), dict.fromkeys(LINKS, "raw"), feeds)
    assert jpeg.codec == {"device-edge": "jpeg:90", "edge-cloud": "jpeg:90"}
    assert jpeg.tiers == ("cloud",)
    de = jpeg.links["device-edge"]
    assert 0 < de.bytes < de.raw_bytes / 3  # a photo crop as JPEG: a fraction of float32
    assert jpeg.latency_s < raw.latency_s  # on 2 Mbit/s links the bytes dominate
    # The edge runs nothing: it forwards the JPEG, decoding and encoding nothing.
    ec = jpeg.links["edge-cloud"]
    assert de.decode_s == 0.0 and ec.encode_s == 0.0
    assert de.encode_s > 0 and ec.decode_s > 0
    assert ec.bytes == pytest.approx(de.bytes)
    with pytest.raises(PlanError, match="no codec"):
        score_plan(graph, profiles, options, (0, 0), {"edge-cloud": "jpeg:90"}, feeds)


def test_a_top1_budget_picks_a_lossy_image_codec_that_holds_on_held_out_photos(
    cnn: Any, tmp_path: Path
) -> None:
    path, graph, profiles = cnn
    budget = FidelityBudget.parse("top1=95%")
    options = PlanOptions(links=LINKS, fidelity=budget, images={"x": IMAGENET})
    outcome = make_plan(graph, profiles, options, tmp_path / "plan", sample=photos(60, 3))
    chosen = [CodecSpec.parse(c) for c in outcome.plan.codec.values()]
    assert any(c.image and not c.lossless for c in chosen), outcome.plan.codec
    assert outcome.plan.fidelity["budget"] == "top1=95%"
    held_out = plan_fidelity(tmp_path / "plan", path, photos(60, 4))
    assert budget.met_by(held_out.value, held_out.samples), held_out.describe()


def test_a_cloud_only_jpeg_plan_says_its_edge_forwards(cnn: Any, tmp_path: Path) -> None:
    _, graph, profiles = cnn
    slow_edge = {**profiles, "edge": profiles["cloud"].emulate(1000.0)}
    options = PlanOptions(
        links=LINKS,
        codec="jpeg:50",
        fidelity=FidelityBudget.parse("top1=50%"),
        images={"x": IMAGENET},
    )
    outcome = make_plan(graph, slow_edge, options, tmp_path / "plan", sample=photos(10, 3))
    plan = load_plan(tmp_path / "plan")
    assert plan.segments[0].tier == "cloud" and plan.edge_forwards
    # plan.json says what the runtime does: one codec on both links, none at the edge.
    assert plan.codec == {"device-edge": "jpeg:50", "edge-cloud": "jpeg:50"}
    links = plan.estimate["links"]
    assert links["device-edge"]["decode_s"] == 0.0 and links["edge-cloud"]["encode_s"] == 0.0
    assert links["device-edge"]["bytes"] == links["edge-cloud"]["bytes"]
    assert outcome.plan.fidelity["samples"] == 10


def test_old_plans_without_image_inputs_load_and_bad_ones_are_refused(
    cnn: Any, tmp_path: Path
) -> None:
    _, graph, profiles = cnn
    options = PlanOptions(links=LINKS, images={"x": IMAGENET})
    make_plan(graph, profiles, options, tmp_path / "plan", sample=photos(10, 5))
    data = json.loads((tmp_path / "plan" / "plan.json").read_text())
    old = {k: v for k, v in data.items() if k not in ("image_inputs", "fidelity")}
    old["codec"] = {"device-edge": "zstd", "edge-cloud": "raw"}
    assert Plan.from_dict(old).images == {}
    with pytest.raises(PlanError, match="names no image inputs"):
        Plan.from_dict({**old, "codec": {"device-edge": "jpeg:90"}})
    with pytest.raises(PlanError, match=r"image inputs \['photo'\] are not model inputs"):
        Plan.from_dict({**data, "image_inputs": {"photo": IMAGENET.to_dict()}})
    with pytest.raises(PlanError, match="image_inputs"):
        Plan.from_dict({**data, "image_inputs": {"x": {"mean": [1, 2]}}})


def test_plan_command_with_image_flags(cnn: Any, tmp_path: Path, capsys: Any) -> None:
    path, _, profiles = cnn
    sample = tmp_path / "photos.npz"
    np.savez(sample, **photos(40, 6))
    argv = ["plan", str(path), "-o", str(tmp_path / "plan"), "--sample", str(sample)]
    argv += ["--link", "device-edge=2mbit,1ms", "--link", "edge-cloud=2mbit,1ms"]
    for tier, profile in profiles.items():
        save_profile(profile, tmp_path / f"{tier}.json")
        argv += ["--profile", f"{tier}={tmp_path / f'{tier}.json'}"]
    argv += ["--image-input", "x", "--image-norm", "x=imagenet", "--fidelity", "top1=90%"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    # With these figures a photo goes up as an image (webp:50: 151 bytes of 12 KiB), and
    # the plan's note says so.
    plan = load_plan(tmp_path / "plan")
    image_links = [n for n, codec in plan.codec.items() if CodecSpec.parse(codec).image]
    assert image_links == ["device-edge"], plan.codec
    assert "on device-edge carries image input(s) x as images" in out
    assert "fidelity: top1 agreement" in out and "on 40 requests" in out
    assert plan.images == {"x": IMAGENET}
    assert main([*argv[:-2], "--image-norm", "y=unit"]) == 2
    assert "'y', which is not an input" in capsys.readouterr().err
