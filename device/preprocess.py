"""From a picture to the model's input tensor: the device's declared preprocessing.

A frame (a camera's, an image file's, an 8-bit array's) becomes the model's image input
in three steps, always the same ones, so that a result can be reproduced from the frame:

1. **resize** to the input's height x width, bilinear (Pillow's ``Image.resize``; skipped
   when the frame already has that size), after converting it to RGB or grey as the
   input's channel count asks;
2. **normalise**: ``x = (pixel / scale - mean) / std`` per channel, in float32, with the
   plan's own normalisation of that input when the plan records one (``plan.json``
   ``image_inputs``, :class:`tierflow.codec.base.ImageNorm`), else the one given
   (``--image-norm``, the forms ``tierflow plan`` takes), else ``unit`` (pixel / 255);
3. **layout**: channels where the normalisation's layout puts them (NCHW or NHWC), with
   the leading batch axis of 1.

Resizing needs Pillow (the ``image`` extra), imported when a frame needs it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from tierflow.codec.base import ImageNorm
from tierflow.errors import InputError, UsageError
from tierflow.extras import import_extra
from tierflow.image_norm import NormSpec, parse_norm
from tierflow.onnxrt.inference import open_session
from tierflow.plan import Plan


@dataclass(frozen=True)
class Preprocess:
    """How a frame becomes input ``name``: resize to ``height`` x ``width``, then ``norm``."""

    name: str
    height: int
    width: int
    norm: ImageNorm

    def __post_init__(self) -> None:
        if self.height < 1 or self.width < 1:
            raise UsageError(f"an image input needs a size, got {self.height}x{self.width}")

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """The input tensor's shape (batch of 1)."""
        c = self.norm.channels
        if self.norm.layout == "NCHW":
            return (1, c, self.height, self.width)
        return (1, self.height, self.width, c)

    def pixels(self, frame: np.ndarray) -> np.ndarray:
        """``frame`` (uint8, H x W or H x W x 1/3/4, RGB) resized: H x W x C uint8."""
        frame = np.asarray(frame)
        if frame.dtype != np.uint8 or frame.ndim not in (2, 3):
            raise InputError(
                f"a frame is an 8-bit image (H x W or H x W x C, uint8), got "
                f"{frame.dtype}{list(frame.shape)}"
            )
        if frame.ndim == 3 and frame.shape[2] not in (1, 3, 4):
            raise InputError(f"a frame has 1, 3 or 4 channels, got shape {list(frame.shape)}")
        channels = 1 if frame.ndim == 2 else frame.shape[2]
        wanted = self.norm.channels
        same_size = frame.shape[:2] == (self.height, self.width)
        if same_size and channels == wanted:
            return frame.reshape(self.height, self.width, wanted)
        if same_size and wanted == 3 and channels == 4:
            return np.ascontiguousarray(frame[:, :, :3])
        pil = import_extra("PIL.Image", "reading and resizing images")
        image = pil.fromarray(frame.reshape(frame.shape[:2]) if channels == 1 else frame)
        image = image.convert("L" if wanted == 1 else "RGB")
        if not same_size:
            image = image.resize((self.width, self.height), pil.Resampling.BILINEAR)
        return np.asarray(image, dtype=np.uint8).reshape(self.height, self.width, wanted)

    def __call__(self, frame: np.ndarray) -> np.ndarray:
        """The input tensor for ``frame``: resized, normalised, laid out, batch of 1."""
        pixels = self.pixels(frame).astype(np.float32)
        mean = np.asarray(self.norm.mean, np.float32)
        std = np.asarray(self.norm.std, np.float32)
        scale = np.float32(self.norm.scale)
        tensor = (pixels / scale - mean) / std
        if self.norm.layout == "NCHW":
            tensor = tensor.transpose(2, 0, 1)
        return np.ascontiguousarray(tensor[np.newaxis], dtype=np.float32)


def read_image(path: str | Path) -> np.ndarray:
    """An image file (PNG, JPEG, anything Pillow reads) as RGB uint8 H x W x 3."""
    pil = import_extra("PIL.Image", "reading image files")
    try:
        with pil.open(path) as image:
            return np.asarray(image.convert("RGB"), dtype=np.uint8)
    except (OSError, ValueError) as exc:  # PIL.UnidentifiedImageError is an OSError
        raise InputError(f"cannot read image {path}: {exc}") from exc


def input_shape(plan: Plan, plan_dir: str | Path, name: str) -> tuple[int | None, ...]:
    """The shape the first segment reading model input ``name`` declares (None: dynamic)."""
    for spec in plan.segments:
        if name in spec.inputs:
            path = Path(plan_dir) / spec.file
            session = open_session(path, what=f"segment {path}")
            for arg in session.get_inputs():
                if arg.name == name:
                    return tuple(d if isinstance(d, int) and d >= 0 else None for d in arg.shape)
    raise UsageError(f"no segment of the plan reads model input {name!r}")


def plan_preprocess(plan: Plan, plan_dir: str | Path, image_norm: str | None = None) -> Preprocess:
    """The preprocessing for a plan's image input, from the plan or ``image_norm``.

    The image input is the plan's recorded one (``image_inputs``), else the model's only
    input. Its shape must be 4-D with a fixed height and width.
    """
    if plan.images:
        if len(plan.images) > 1:
            raise UsageError(
                f"the plan has {len(plan.images)} image inputs ({', '.join(plan.images)}); "
                "the device feeds one"
            )
        name = next(iter(plan.images))
    elif len(plan.inputs) == 1:
        name = plan.inputs[0]
    else:
        raise UsageError(
            f"the model has {len(plan.inputs)} inputs ({', '.join(plan.inputs)}); a frame "
            "feeds a model with one image input"
        )
    shape = input_shape(plan, plan_dir, name)
    if len(shape) != 4:
        raise UsageError(
            f"model input {name!r} has shape {list(shape)}; an image input is 4-D "
            "(N, C, H, W or N, H, W, C)"
        )
    recorded = plan.images.get(name)
    if recorded is not None and image_norm is None:
        norm = recorded
    else:
        spec = _norm_spec(image_norm or "unit", name)
        if spec.layout is None and recorded is not None:
            spec = replace(spec, layout=recorded.layout)
        norm = spec.resolve(shape, f"model input {name!r} (--image-norm)")
    height, width = (shape[2], shape[3]) if norm.layout == "NCHW" else (shape[1], shape[2])
    if height is None or width is None:
        raise UsageError(
            f"model input {name!r} of shape {list(shape)} has no fixed height and width "
            "to resize frames to"
        )
    return Preprocess(name, height, width, norm)


def _norm_spec(text: str, name: str) -> NormSpec:
    """``--image-norm [NAME=]SPEC``, read as ``tierflow plan`` reads it."""
    text = text.strip()
    return parse_norm(text if text.startswith(f"{name}=") else f"{name}={text}")[1]
