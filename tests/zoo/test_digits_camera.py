"""The demo model at camera resolution: frames of the held-out digits, the stem in ONNX."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tierflow.onnxrt.inference import open_session
from tierflow.zoo import digits_camera

pytestmark = pytest.mark.slow


@pytest.mark.integration
def test_frames_pooled_by_the_stem_are_the_cached_held_out_images(
    demo_build: tuple[Any, list[Any]], tmp_path: Path
) -> None:
    demo, _ = demo_build
    mean, std = digits_camera.training_normalisation()
    path = tmp_path / "camera.onnx"
    digits_camera.add_camera_stem(demo.model_path, path, mean, std)
    frames, labels = digits_camera.digit_frames("heldout")
    assert frames.shape == (len(labels), 3, 224, 224) and frames.dtype == np.uint8
    with np.load(demo.heldout_path) as heldout:
        assert np.array_equal(labels, heldout["labels"])  # the same requests, in order
        images = heldout["image"][:, 0]
    session = open_session(path)
    logits = session.run(None, {"frame": digits_camera.frame_tensor(frames)})[0]
    camera_accuracy = float(np.mean(np.argmax(logits, 1) == labels))
    plain = open_session(demo.model_path).run(None, {"image": images})[0]
    plain_accuracy = float(np.mean(np.argmax(plain, 1) == labels))
    # The stem greys and pools the frame back to (nearly) the 32x32 input the network was
    # trained on: accuracy stays where it was.
    assert camera_accuracy >= plain_accuracy - 0.01
    assert np.mean(np.argmax(logits, 1) == np.argmax(plain, 1)) >= 0.98


def test_the_stem_refuses_a_model_with_other_inputs(tmp_path: Path) -> None:
    import onnx
    from onnx import TensorProto, helper

    from tierflow.errors import ModelError

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 32, 32])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1, 32, 32])
    model = helper.make_model(
        helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y])
    )
    onnx.save(model, str(tmp_path / "m.onnx"))
    with pytest.raises(ModelError, match="one input named image"):
        digits_camera.add_camera_stem(tmp_path / "m.onnx", tmp_path / "out.onnx", 0.0, 1.0)
