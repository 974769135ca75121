"""``--image-norm NAME=SPEC``: how an image input is made from 8-bit pixels, as written.

Read the same way by ``tierflow plan`` (:mod:`tierflow.partitioner.image_inputs`) and
``tierflow device`` (:mod:`tierflow.device.preprocess`). SPEC is a preset (``unit``:
x = pixel / 255; ``imagenet``: torchvision's mean and std over pixel / 255;
``symmetric``: x = pixel / 127.5 - 1) or ``mean=M[,M,M];std=S[,S,S][;scale=255]
[;layout=NCHW|NHWC]``; what is not given is filled in from the input's shape by the
caller (:meth:`NormSpec.resolve`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tierflow.codec.base import ImageNorm
from tierflow.errors import UsageError, shown

__all__ = ["PRESETS", "NormSpec", "parse_norm"]

# preset -> (mean, std, scale); one value means the same for every channel.
PRESETS: dict[str, tuple[tuple[float, ...], tuple[float, ...], float]] = {
    "unit": ((0.0,), (1.0,), 255.0),
    "imagenet": ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225), 255.0),
    "symmetric": ((0.5,), (0.5,), 255.0),
}
_FORM = (
    "a preset (unit, imagenet, symmetric) or mean=M[,M,M];std=S[,S,S][;scale=255]"
    "[;layout=NCHW|NHWC]"
)


@dataclass(frozen=True)
class NormSpec:
    """``--image-norm`` as written: values not given are filled in from the input's shape."""

    mean: tuple[float, ...] = (0.0,)
    std: tuple[float, ...] = (1.0,)
    scale: float = 255.0
    layout: str | None = None

    def resolve(self, shape: Sequence[int | None], what: str) -> ImageNorm:
        """The :class:`ImageNorm` for a 4-D input of ``shape``, its gaps filled from it.

        The layout, when not given, is the one whose channel axis holds 1 or 3; one mean
        or std is repeated over the channels. ``what`` opens every error message (the
        option and input it is about).
        """
        layout = self.layout
        if layout is None:
            layout = "NCHW" if shape[1] in (1, 3) else "NHWC" if shape[3] in (1, 3) else None
        if layout is None:
            raise UsageError(
                f"{what}: shape {list(shape)} has no 1- or 3-channel axis; give the layout "
                "(--image-norm '...;layout=NCHW|NHWC'); an image carries grey or RGB"
            )
        channels = shape[1] if layout == "NCHW" else shape[3]
        if channels not in (1, 3):
            raise UsageError(
                f"{what}: layout {layout} puts {channels} channels in shape {list(shape)}; "
                "an image carries 1 (grey) or 3 (RGB)"
            )
        mean = self.mean * channels if len(self.mean) == 1 else self.mean
        std = self.std * channels if len(self.std) == 1 else self.std
        if len(mean) != channels or len(std) != channels:
            raise UsageError(
                f"{what}: {len(self.mean)} means and {len(self.std)} stds for an image of "
                f"{channels} channel(s)"
            )
        return ImageNorm(mean=mean, std=std, scale=self.scale, layout=layout)


def _floats(text: str, key: str, option: str) -> tuple[float, ...]:
    try:
        values = tuple(float(v) for v in text.split(","))
    except ValueError as exc:
        raise UsageError(f"malformed --image-norm {shown(option)}: {key} must be numbers") from exc
    if len(values) not in (1, 3):
        raise UsageError(f"malformed --image-norm {shown(option)}: {key} takes 1 or 3 values")
    return values


def parse_norm(text: str) -> tuple[str, NormSpec]:
    """Read ``--image-norm NAME=SPEC``."""
    name, sep, spec = text.partition("=")
    name, spec = name.strip(), spec.strip()
    malformed = f"malformed --image-norm {text!r}: expected NAME=SPEC, SPEC being {_FORM}"
    if not sep or not name or not spec:
        raise UsageError(malformed)
    if spec.lower() in PRESETS:
        mean, std, scale = PRESETS[spec.lower()]
        return name, NormSpec(mean, std, scale)
    fields: dict[str, str] = {}
    for part in spec.split(";"):
        key, eq, value = part.partition("=")
        key = key.strip().lower()
        if not eq or key not in ("mean", "std", "scale", "layout") or key in fields:
            raise UsageError(
                f"malformed --image-norm {shown(text)}: expected NAME=SPEC, SPEC being {_FORM}"
            )
        fields[key] = value.strip()
    if "mean" not in fields or "std" not in fields:
        raise UsageError(f"malformed --image-norm {shown(text)}: give both mean= and std=")
    mean = _floats(fields["mean"], "mean", text)
    std = _floats(fields["std"], "std", text)
    try:
        scale = float(fields.get("scale", "255"))
    except ValueError as exc:
        raise UsageError(f"malformed --image-norm {shown(text)}: scale must be a number") from exc
    layout = fields.get("layout")
    if layout is not None and layout.upper() not in ("NCHW", "NHWC"):
        raise UsageError(f"malformed --image-norm {shown(text)}: layout is NCHW or NHWC")
    return name, NormSpec(mean, std, scale, layout.upper() if layout else None)
