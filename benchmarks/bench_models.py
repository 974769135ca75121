"""The benchmark's model suite: which networks, at which sizes, and what requests they get.

Every model is built in code (``tierflow.zoo.models`` and the digits demo model),
exported once to ONNX and cached by its recipe, so a rerun skips the export. Requests are
deterministic: images are smooth 8-bit pictures (low-resolution noise upsampled and
quantised to 256 levels, then normalised as ImageNet images are), because real camera
frames compress and white noise does not; the demo model gets real held-out digits; the
camera model (the demo's trained classifier behind a camera's preprocessing,
:mod:`tierflow.zoo.digits_camera`, as ``tierflow demo`` runs it) gets 224x224 8-bit RGB
frames of those held-out digits; the transformer gets token ids and a padding mask.

The planner's fidelity sample (:func:`planner_sample`) never overlaps the measured
requests: the trained models draw it from their training split, the others from
another seed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tierflow.codec.base import ImageNorm
from tierflow.codec.image import from_pixels

logger = logging.getLogger(__name__)

# Builders return (torch module, example inputs); typed loosely so this module imports
# without torch until a model is actually built.
Builder = Callable[..., tuple[Any, tuple[Any, ...]]]


@dataclass(frozen=True)
class BenchModel:
    """One model of the suite at one size: how to build it and how big it is."""

    name: str
    kind: str  # "chain", "residual", "mobilenet", "transformer", "demo", "camera"
    description: str
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def trained(self) -> bool:
        """Whether the weights are trained (the demo's classifier), not random."""
        return self.kind in TRAINED_KINDS

    @property
    def recipe(self) -> str:
        """Short hash of everything that decides the exported file."""
        key = json.dumps(
            {"name": self.name, "kind": self.kind, "params": self.params}, sort_keys=True
        )
        return hashlib.sha256(key.encode()).hexdigest()[:12]

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": self.kind,
            "description": self.description,
            "params": dict(self.params),
            "trained": self.trained,
        }


def suite(quick: bool) -> list[BenchModel]:
    """The five models: full sizes for the committed run, small ones for ``--quick``."""
    if quick:
        return [
            BenchModel(
                "vgg-like",
                "chain",
                "VGG-like chain CNN, 64x64, width 0.25",
                {"size": 64, "width": 0.25},
            ),
            BenchModel(
                "resnet18",
                "residual",
                "ResNet-18 shape, 64x64, width 0.25",
                {"size": 64, "width": 0.25, "num_classes": 100},
            ),
            BenchModel(
                "mobilenetv2",
                "mobilenet",
                "MobileNetV2-like, 64x64, width 0.5",
                {"size": 64, "width": 0.5, "num_classes": 100},
            ),
            BenchModel(
                "transformer",
                "transformer",
                "transformer encoder, 32 tokens, dim 64, 2 layers, padding mask",
                {"seq": 32, "dim": 64, "heads": 4, "layers": 2, "vocab": 1000},
            ),
            BenchModel("demo-digits", "demo", "tierflow demo: residual CNN on 32x32 digits", {}),
            CAMERA_MODEL,
        ]
    return [
        BenchModel(
            "vgg-like",
            "chain",
            "VGG-like chain CNN (8 conv), 224x224, width 0.5",
            {"size": 224, "width": 0.5, "num_classes": 1000},
        ),
        BenchModel(
            "resnet18",
            "residual",
            "ResNet-18, 224x224, 1000 classes",
            {"size": 224, "width": 1.0, "num_classes": 1000},
        ),
        BenchModel(
            "mobilenetv2",
            "mobilenet",
            "MobileNetV2, 224x224, 1000 classes",
            {"size": 224, "width": 1.0, "num_classes": 1000},
        ),
        BenchModel(
            "transformer",
            "transformer",
            "transformer encoder, 128 tokens, dim 256, 8 heads, 6 layers, padding mask",
            {"seq": 128, "dim": 256, "heads": 8, "layers": 6, "vocab": 8000},
        ),
        BenchModel("demo-digits", "demo", "tierflow demo: residual CNN on 32x32 digits", {}),
        CAMERA_MODEL,
    ]


#: The suite's CNNs, whose input is an 8-bit picture normalised by ``IMAGE_NORM``.
IMAGE_KINDS = ("chain", "residual", "mobilenet")
IMAGE_NORM = ImageNorm(mean=(0.45, 0.45, 0.45), std=(0.225, 0.225, 0.225))
#: Models with trained weights (the others are random networks built in code).
TRAINED_KINDS = ("demo", "camera")
#: The camera frame is pixel / 255 on three channels (``digits_camera.frame_tensor``).
CAMERA_NORM = ImageNorm(mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0))
CAMERA_MODEL = BenchModel(
    "digits-camera",
    "camera",
    "tierflow demo's trained classifier behind a camera stem: 224x224 RGB frames of held-out "
    "digits (as `tierflow demo` runs it)",
    {"frame": 224},
)


def default_work_dir() -> Path:
    """Where exported models are cached: $TIERFLOW_CACHE/bench, else ~/.cache/tierflow/bench."""
    root = os.environ.get("TIERFLOW_CACHE")
    base = Path(root).expanduser() if root else Path.home() / ".cache" / "tierflow"
    return base / "bench"


def _builder(kind: str) -> Builder:
    from tierflow.zoo import models

    builders: dict[str, Builder] = {
        "chain": models.chain_cnn,
        "residual": models.resnet18,
        "mobilenet": models.mobilenet_v2,
        "transformer": models.transformer_encoder,
    }
    return builders[kind]


def export(model: BenchModel, work_dir: Path) -> Path:
    """The model's ONNX file, exported on first use and cached by recipe."""
    if model.kind == "demo":
        from tierflow.zoo.digits import build_demo_model

        return build_demo_model().model_path
    if model.kind == "camera":
        return camera_model()
    path = work_dir / "models" / f"{model.name}-{model.recipe}.onnx"
    if path.is_file():
        return path
    from tierflow.zoo import models

    module, example = _builder(model.kind)(**model.params)
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp.onnx")  # concurrent runs
    # The legacy exporter: several times faster than dynamo here, same graph shapes.
    models.export_onnx(module, example, tmp, dynamo=False)
    tmp.replace(path)
    logger.info("[bench] exported %s to %s", model.name, path)
    return path


def camera_model() -> Path:
    """The demo model with the camera stem in front, cached next to it as ``tierflow demo``
    caches it (the same file, so either makes it once)."""
    from tierflow.zoo.digits import build_demo_model
    from tierflow.zoo.digits_camera import camera_model as cached

    return cached(build_demo_model())


# Frames made so far, per split (rendering them takes seconds; the run asks several times).
_FRAMES: dict[str, np.ndarray] = {}


def camera_frames(split: str, indices: list[int]) -> list[np.ndarray]:
    """Camera frames ``[1, 3, 224, 224]`` (pixel / 255) of the ``split`` digits at ``indices``."""
    from tierflow.zoo.digits_camera import digit_frames, frame_tensor

    needed = max(indices, default=0) + 1
    if split not in _FRAMES or len(_FRAMES[split]) < needed:
        _FRAMES[split] = digit_frames(split, needed if split == "train" else 0)[0]
    frames = _FRAMES[split]
    return [np.ascontiguousarray(frame_tensor(frames[i : i + 1])) for i in indices]


def smooth_images(count: int, channels: int, size: int, seed: int) -> np.ndarray:
    """``count`` smooth 8-bit images [count, 1, C, H, W], normalised by ``IMAGE_NORM``
    (with 3 channels; else the same mean and std per channel) as a camera client would:
    ``tierflow.codec.image.from_pixels``, in float32, so PNG carries them bit for bit."""
    rng = np.random.default_rng(seed)
    coarse_size = max(2, size // 16)
    coarse = rng.random((count, channels, coarse_size, coarse_size))
    # Bilinear upsampling by separable linear interpolation.
    grid = np.linspace(0, coarse_size - 1, size)
    low = np.floor(grid).astype(int)
    high = np.minimum(low + 1, coarse_size - 1)
    frac = grid - low
    rows = (
        coarse[:, :, low, :] * (1 - frac)[None, None, :, None]
        + coarse[:, :, high, :] * frac[None, None, :, None]
    )
    image = rows[:, :, :, low] * (1 - frac) + rows[:, :, :, high] * frac
    image = image + rng.normal(0, 0.02, image.shape)  # sensor noise
    pixels = np.clip(np.round(image * 255), 0, 255).astype(np.uint8)
    norm = ImageNorm(mean=(IMAGE_NORM.mean[0],) * channels, std=(IMAGE_NORM.std[0],) * channels)
    normalised = from_pixels(pixels.transpose(0, 2, 3, 1), norm, "float32")
    return normalised[:, None]


def demo_indices(count: int, seed: int, available: int) -> list[int]:
    """Which held-out digits the demo model's requests are: different seeds, other digits."""
    return [(seed * 100 + i) % available for i in range(count)]


def requests(
    model: BenchModel,
    input_specs: list[tuple[str, str, tuple[int, ...]]],
    count: int,
    seed: int = 0,
) -> list[dict[str, np.ndarray]]:
    """``count`` request input dicts for ``model`` (one array per model input, batch 1).

    ``input_specs`` lists (name, numpy dtype, shape) of the model inputs.
    """
    if model.kind == "demo":
        from tierflow.zoo.digits import build_demo_model

        with np.load(build_demo_model().heldout_path) as data:
            images = data["image"]
        name = input_specs[0][0]
        return [
            {name: np.ascontiguousarray(images[i])} for i in demo_indices(count, seed, len(images))
        ]
    if model.kind == "camera":
        count_heldout = _heldout_size()
        name = input_specs[0][0]
        indices = demo_indices(count, seed, count_heldout)
        return [{name: frame} for frame in camera_frames("heldout", indices)]
    if model.kind == "transformer":
        rng = np.random.default_rng(seed)
        vocab = int(model.params.get("vocab", 100))
        out: list[dict[str, np.ndarray]] = []
        for _ in range(count):
            feeds: dict[str, np.ndarray] = {}
            for name, dtype, shape in input_specs:
                if np.dtype(dtype).kind in "iu":
                    feeds[name] = rng.integers(0, vocab, size=shape).astype(dtype)
                else:  # the padding mask: a random number of real tokens, then padding
                    seq = shape[-1]
                    length = int(rng.integers(seq // 2, seq + 1))
                    mask = np.zeros(shape, dtype=dtype)
                    mask[..., :length] = 1
                    feeds[name] = mask
            out.append(feeds)
        return out
    name, dtype, shape = input_specs[0]
    _, channels, height, _ = shape
    images = smooth_images(count, channels, height, seed)
    return [{name: images[i].reshape(shape).astype(dtype)} for i in range(count)]


def _heldout_size() -> int:
    from tierflow.zoo.digits import build_demo_model

    with np.load(build_demo_model().heldout_path) as data:
        return len(data["labels"])


def planner_sample(
    model: BenchModel,
    input_specs: list[tuple[str, str, tuple[int, ...]]],
    count: int,
    seed: int,
) -> list[dict[str, np.ndarray]]:
    """``count`` requests for the planner's fidelity probe, none of them ever measured.

    The trained models take them from their training split (the measured requests are
    held-out digits); the random networks from ``seed``, which the measured requests
    never use.
    """
    if model.kind == "demo":
        from tierflow.zoo.digits import build_demo_model

        with np.load(build_demo_model().calib_path) as data:
            images = data["image"]
        name = input_specs[0][0]
        return [{name: np.ascontiguousarray(images[i])} for i in range(min(count, len(images)))]
    if model.kind == "camera":
        name = input_specs[0][0]
        return [{name: frame} for frame in camera_frames("train", list(range(count)))]
    return requests(model, input_specs, count, seed=seed)
