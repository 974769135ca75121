"""The demo model at camera resolution: 224x224 RGB frames in, the digits classifier behind.

A camera does not hand a classifier 32x32 normalised tensors: it hands it frames. This
module turns scikit-learn's held-out digits into 224x224 RGB frames (8-bit pixels, as a
camera delivers them; the 8x8 digit scaled up bilinearly) and puts the preprocessing a
deployment would run in front of the trained network, in the ONNX graph itself:

``frame`` [batch,3,224,224], pixel / 255  ->  grey (mean of the channels), 7x7 average
pool to 32x32 and the training split's normalisation, as one 7x7 stride-7 convolution
->  the network

Nothing is retrained: the network is the cached demo model (with or without its exits),
and its accuracy on these frames is measured, not assumed. The preprocessing is where a
split pays off: the frame is 588 KiB of float32 (5 KB as JPEG, 15 KB as PNG), the
pooled image 4 KiB, so a device that runs the first few cheap nodes sends less than one
that uploads the frame, and exactly what the network needs.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from tierflow.errors import ModelError

if TYPE_CHECKING:
    from tierflow.zoo.digits import DemoModel

FRAME_SIZE = 224
FRAME_INPUT = "frame"
# Bump when the stem changes: cached camera models carry it in their file name.
STEM_VERSION = 2
_POOL = FRAME_SIZE // 32  # the network's input is 32x32
_DIGIT_SIDE = 8


def _bilinear_matrix(size_in: int, size_out: int) -> np.ndarray:
    """``M`` with ``M @ x`` = bilinear resampling of ``x``'s rows (align_corners=False).

    The same weights as torch's ``interpolate(mode="bilinear")`` when upscaling, which is
    how :mod:`tierflow.zoo.digits` scaled the training images.
    """
    src = (np.arange(size_out) + 0.5) * size_in / size_out - 0.5
    src = np.clip(src, 0.0, size_in - 1)
    low = np.floor(src).astype(int)
    high = np.minimum(low + 1, size_in - 1)
    frac = src - low
    matrix = np.zeros((size_out, size_in))
    matrix[np.arange(size_out), low] += 1.0 - frac
    matrix[np.arange(size_out), high] += frac
    return matrix


def _digits_split() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """sklearn's 8x8 digits (0..1) split exactly as :func:`~.digits.load_digits_data` does."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    from tierflow.zoo import digits as demo

    data = load_digits()
    raw = np.asarray(data.images, dtype=np.float64) / 16.0
    labels = np.asarray(data.target, dtype=np.int64)
    train, heldout = train_test_split(
        np.arange(len(labels)),
        test_size=demo._HELDOUT_FRACTION,
        random_state=demo._SEED,
        stratify=labels,
    )
    return raw[train], labels[train], raw[heldout], labels[heldout]


def _scale(images: np.ndarray, size: int) -> np.ndarray:
    matrix = _bilinear_matrix(images.shape[-1], size)
    return np.einsum("ij,njk,lk->nil", matrix, images, matrix)


def training_normalisation() -> tuple[float, float]:
    """The mean and std the network was trained with (the 32x32 training split's)."""
    train, _, _, _ = _digits_split()
    scaled = _scale(train, 32).astype(np.float32)
    return float(scaled.mean()), float(scaled.std())


def digit_frames(split: str, count: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Camera frames of the ``heldout`` or ``train`` digits: uint8 [N,3,224,224], labels [N].

    ``count`` > 0 keeps the first ``count``. The order is the cached held-out set's, so
    request ``i`` is the digit in row ``i`` of ``heldout.npz``.
    """
    train, train_labels, heldout, heldout_labels = _digits_split()
    images, labels = (heldout, heldout_labels) if split == "heldout" else (train, train_labels)
    if count:
        images, labels = images[:count], labels[:count]
    grey = np.clip(np.rint(_scale(images, FRAME_SIZE) * 255.0), 0, 255).astype(np.uint8)
    return np.repeat(grey[:, None], 3, axis=1), labels


def frame_tensor(frames: np.ndarray) -> np.ndarray:
    """uint8 frames [...,3,224,224] as the model's ``frame`` input: pixel / 255, float32."""
    return frames.astype(np.float32) / np.float32(255.0)


def camera_model(demo: DemoModel, model_path: Path | None = None, stem: str = "camera") -> Path:
    """``model_path`` (the demo model's by default) with the camera stem in front.

    Made once and cached next to the demo model, named by ``stem``, the stem's version
    and the demo model's digest, so ``tierflow demo`` and the benchmarks share the file.
    """
    sha = demo.meta.sha256.get("model.onnx", "")[:12]
    path = demo.directory / f"{stem}-v{STEM_VERSION}-{sha}.onnx"
    if not path.is_file():
        mean, std = training_normalisation()
        add_camera_stem(demo.model_path if model_path is None else model_path, path, mean, std)
    return path


def add_camera_stem(model_path: Path, out_path: Path, mean: float, std: float) -> None:
    """Write ``model_path`` with the frame preprocessing in front, through ``onnx.compose``.

    The model's metadata (its exits, when it has them) is kept. Raises ModelError when
    the model does not take one ``image`` [batch,1,32,32] input.
    """
    import onnx
    from onnx import TensorProto, compose, helper, numpy_helper

    model = onnx.load(str(model_path))
    if [i.name for i in model.graph.input] != ["image"]:
        raise ModelError(f"{model_path}: expected one input named image")
    opset = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
    # Grey (the mean of the channels), 7x7 average pool and normalisation are one linear
    # map: a 7x7 stride-7 convolution, 2.5x cheaper in ONNX Runtime than the three ops.
    weight = np.full((1, 3, _POOL, _POOL), 1.0 / (3 * _POOL * _POOL * std), np.float32)
    stem = helper.make_graph(
        [
            helper.make_node(
                "Conv",
                [FRAME_INPUT, "stem_weight", "stem_bias"],
                ["stem_image"],
                kernel_shape=[_POOL, _POOL],
                strides=[_POOL, _POOL],
            )
        ],
        "camera_stem",
        [
            helper.make_tensor_value_info(
                FRAME_INPUT, TensorProto.FLOAT, ["batch", 3, FRAME_SIZE, FRAME_SIZE]
            )
        ],
        [helper.make_tensor_value_info("stem_image", TensorProto.FLOAT, ["batch", 1, 32, 32])],
        initializer=[
            numpy_helper.from_array(weight, "stem_weight"),
            numpy_helper.from_array(np.array([-mean / std], np.float32), "stem_bias"),
        ],
    )
    stem_model = helper.make_model(
        stem, opset_imports=[helper.make_opsetid("", opset)], ir_version=model.ir_version
    )
    merged = compose.merge_models(stem_model, model, io_map=[("stem_image", "image")])
    merged.metadata_props.clear()
    merged.metadata_props.extend(model.metadata_props)
    onnx.checker.check_model(merged)
    partial = out_path.with_suffix(".partial")
    onnx.save(merged, str(partial))
    partial.replace(out_path)
