"""Codec settings: :class:`CodecSpec`, the text grammar a user, a plan and the wire share.

::

    codec      := "raw" | image | [ "drop+" ] [ "sparse+" ] [ quantiser ] [ compressor ]
    image      := "jpeg:" Q | "webp:" Q | "png"              Q in 1..100
    quantiser  := "fp16" | "int8" | "int8c" | "int4" | "int2"
    compressor := "zstd" [ ":" LEVEL ] | "shuffle+zstd" [ ":" LEVEL ]     LEVEL in 1..22

At least one part is present (``drop+zstd``, ``sparse+int8+zstd``, ``int4``, ...). The
stages run in the order written on the sender and in reverse on the receiver; what each
does to the bytes, and its error bound, is [Note: codec wire format] in
:mod:`tierflow.codec.base`, which re-exports everything here.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from tierflow.codec.image import IMAGE_CODECS, QUALITY_CODECS
from tierflow.errors import UsageError, shown

QUANTISERS: tuple[str, ...] = ("none", "fp16", "int8", "int8c", "int4", "int2")
COMPRESSORS: tuple[str, ...] = ("none", "zstd", "shuffle+zstd")
DEFAULT_LEVEL = 3
MIN_LEVEL = 1
MAX_LEVEL = 22

#: What ``--codec auto`` chooses among under ``--fidelity exact``: bit-exact for every
#: tensor (``sparse`` keeps -0.0 and every NaN's bits; ``drop`` only drops channels whose
#: elements share their bits and whose value float32 holds exactly).
EXACT_PLANNER_CODECS: tuple[str, ...] = (
    "raw",
    "zstd",
    "shuffle+zstd",
    "sparse+zstd",
    "sparse+shuffle+zstd",
    "drop+sparse+zstd",
)
#: What ``--codec auto`` adds under a lossy fidelity budget (each measured end to end).
LOSSY_PLANNER_CODECS: tuple[str, ...] = (
    "fp16",
    "fp16+zstd",
    "int8",
    "int8+zstd",
    "int8c+zstd",
    "int4+zstd",
    "int2+zstd",
    "sparse+int8+zstd",
    "sparse+int4+zstd",
)
#: The codecs ``--codec auto`` chooses among (docs/design.md, "Command line").
PLANNER_CODECS: tuple[str, ...] = EXACT_PLANNER_CODECS + LOSSY_PLANNER_CODECS
#: Codecs whose round trip is bit-exact for every dtype.
LOSSLESS_CODECS: tuple[str, ...] = ("raw", "zstd", "shuffle+zstd")
#: Codecs that spend computation to save bandwidth on features (benchmarks compare them).
LOW_BIT_CODECS: tuple[str, ...] = (
    "int4+zstd",
    "int2+zstd",
    "sparse+zstd",
    "sparse+int8+zstd",
    "sparse+int4+zstd",
    "drop+int8+zstd",
    "drop+sparse+int8+zstd",
    "drop+sparse+int4+zstd",
)

#: Every codec the grammar takes, in words (errors and `plan --codec` help say it).
CODEC_FORMS = (
    "raw, zstd, zstd:LEVEL, shuffle+zstd[:LEVEL]; a quantiser (fp16, int8, int8c, int4, "
    "int2) optionally followed by +zstd[:LEVEL] or +shuffle+zstd[:LEVEL]; any of these "
    "after drop+ and/or sparse+ (e.g. int8c+zstd, sparse+int4+zstd, drop+zstd); "
    f"LEVEL is {MIN_LEVEL}..{MAX_LEVEL}; or an image codec jpeg:QUALITY, webp:QUALITY "
    "(QUALITY 1..100) or png"
)


@dataclass(frozen=True)
class CodecSpec:
    """How features are encoded on a link: the stages of the grammar above.

    ``level`` only matters with a compressor; without one it is normalised to the
    default so that equal codecs compare equal (``parse(str(s)) == s`` always holds).
    An image codec (``quant`` one of :data:`IMAGE_CODECS`) has no other stage, and
    ``quality`` (1..100) for ``jpeg`` and ``webp``; every other codec has quality 0.
    ``sparse`` skips zero elements and ``drop`` drops constant channels.
    """

    quant: str
    compress: str
    level: int = DEFAULT_LEVEL
    quality: int = 0
    sparse: bool = False
    drop: bool = False

    def __post_init__(self) -> None:
        if self.quant not in QUANTISERS + IMAGE_CODECS:
            raise UsageError(
                f"unknown quantiser {shown(self.quant)}: expected one of "
                f"{', '.join(QUANTISERS + IMAGE_CODECS)}"
            )
        if self.compress not in COMPRESSORS:
            raise UsageError(
                f"unknown compressor {shown(self.compress)}: expected one of "
                f"{', '.join(COMPRESSORS)}"
            )
        for flag in ("sparse", "drop"):
            if not isinstance(getattr(self, flag), bool):
                raise UsageError(f"codec {flag} must be true or false, got {getattr(self, flag)!r}")
        if isinstance(self.quality, bool) or not isinstance(self.quality, int):
            raise UsageError(f"image quality must be an integer, got {self.quality!r}")
        if self.quant in QUALITY_CODECS and not 1 <= self.quality <= 100:
            raise UsageError(f"{self.quant} quality must be within 1..100, got {self.quality}")
        if self.quant not in QUALITY_CODECS and self.quality != 0:
            raise UsageError(f"codec {self.quant} takes no quality, got {self.quality}")
        if self.image and (self.compress != "none" or self.sparse or self.drop):
            raise UsageError(f"image codec {self.quant} cannot be combined with other stages")
        if isinstance(self.level, bool) or not isinstance(self.level, int):
            raise UsageError(f"zstd level must be an integer, got {self.level!r}")
        if not MIN_LEVEL <= self.level <= MAX_LEVEL:
            raise UsageError(
                f"zstd level must be within {MIN_LEVEL}..{MAX_LEVEL}, got {self.level}"
            )
        if self.compress == "none" and self.level != DEFAULT_LEVEL:
            object.__setattr__(self, "level", DEFAULT_LEVEL)

    @classmethod
    def parse(cls, text: str) -> CodecSpec:
        """Read codec text such as ``raw``, ``zstd:9``, ``int8+zstd`` or ``sparse+int4``."""
        if not isinstance(text, str):
            raise UsageError(f"codec must be text, got {shown(text)}")
        # Every received tensor names its codec: the few texts a link uses are cached.
        return _parse_cached(text) if cls is CodecSpec else cls._parse(text)

    @classmethod
    def _parse(cls, text: str) -> CodecSpec:
        parts = text.strip().lower().split("+")
        if parts == ["raw"]:
            return cls("none", "none")
        name, sep, quality = parts[0].partition(":")
        if name in IMAGE_CODECS:
            if len(parts) > 1 or (name in QUALITY_CODECS) != bool(sep):
                raise UsageError(f"malformed codec {shown(text)}: expected one of {CODEC_FORMS}")
            if sep and not (quality.isdigit() and 1 <= int(quality) <= 100):
                raise UsageError(
                    f"malformed codec {shown(text)}: {name} quality must be within 1..100"
                )
            return cls(name, "none", quality=int(quality) if sep else 0)
        drop = bool(parts) and parts[0] == "drop"
        if drop:
            parts.pop(0)
        sparse = bool(parts) and parts[0] == "sparse"
        if sparse:
            parts.pop(0)
        quant = "none"
        if parts and parts[0] in QUANTISERS[1:]:
            quant = parts.pop(0)
        compress, level = _parse_compressor(parts, text)
        if not (drop or sparse or quant != "none" or compress != "none"):
            raise UsageError(f"malformed codec {shown(text)}: expected one of {CODEC_FORMS}")
        return cls(quant, compress, level, sparse=sparse, drop=drop)

    @classmethod
    def of(cls, spec: CodecSpec | str) -> CodecSpec:
        """Accept either a spec or its text (what the public functions take)."""
        return spec if isinstance(spec, CodecSpec) else cls.parse(spec)

    @property
    def image(self) -> bool:
        """Whether this is an image codec (``jpeg:Q``, ``webp:Q``, ``png``)."""
        return self.quant in IMAGE_CODECS

    @property
    def lossless(self) -> bool:
        """Whether the codec keeps all information: no quantiser, or ``png``.

        ``drop`` and ``sparse`` are lossless. ``png`` is lossless for 8-bit pixels, and
        so exact for a tensor normalised as the decoder does (see [Note: image codecs]);
        :attr:`bit_exact` is the stricter promise, for every tensor.
        """
        return self.quant in ("none", "png")

    @property
    def bit_exact(self) -> bool:
        """Whether every tensor of every dtype round-trips bit for bit."""
        return self.quant == "none"

    def lossless_part(self) -> CodecSpec:
        """This codec with only its compressor: what non-float tensors get."""
        return self._lossless_part

    @functools.cached_property
    def _lossless_part(self) -> CodecSpec:  # made once: every integer tensor sent asks
        return CodecSpec("none", self.compress, self.level)

    def __str__(self) -> str:
        return self._text

    @functools.cached_property
    def _text(self) -> str:  # made once: it names every tensor sent's codec
        if self.image:
            return f"{self.quant}:{self.quality}" if self.quality else self.quant
        parts = [] if self.quant == "none" else [self.quant]
        parts[:0] = ["drop"] * self.drop + ["sparse"] * self.sparse
        if self.compress != "none":
            zstd = "zstd" if self.level == DEFAULT_LEVEL else f"zstd:{self.level}"
            parts.append(zstd if self.compress == "zstd" else f"shuffle+{zstd}")
        return "+".join(parts) or "raw"

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"quant": self.quant, "compress": self.compress, "level": self.level}
        for key in ("quality", "sparse", "drop"):
            if getattr(self, key):
                data[key] = getattr(self, key)
        return data

    @classmethod
    def from_dict(cls, data: Any) -> CodecSpec:
        if not isinstance(data, dict):
            raise UsageError(f"malformed codec {shown(data)}: expected an object")
        try:
            return cls(
                str(data["quant"]),
                str(data["compress"]),
                data.get("level", DEFAULT_LEVEL),
                data.get("quality", 0),
                sparse=data.get("sparse", False),
                drop=data.get("drop", False),
            )
        except KeyError as exc:
            raise UsageError(f"malformed codec {shown(data)}: expected quant and compress") from exc


def _parse_compressor(parts: list[str], text: str) -> tuple[str, int]:
    """The compressor and level of what remains of the codec text (all of it)."""
    compress = "none"
    level = DEFAULT_LEVEL
    if parts and parts[0] == "shuffle":
        compress = "shuffle+zstd"
        parts.pop(0)
        if not parts or not parts[0].startswith("zstd"):
            raise UsageError(f"malformed codec {shown(text)}: shuffle must be followed by +zstd")
    if parts and parts[0].startswith("zstd"):
        name, sep, level_text = parts.pop(0).partition(":")
        if name != "zstd" or (sep and not level_text.isdigit()):
            raise UsageError(f"malformed codec {shown(text)}: expected one of {CODEC_FORMS}")
        compress = "zstd" if compress == "none" else compress
        if sep:
            level = int(level_text)
            if not MIN_LEVEL <= level <= MAX_LEVEL:
                raise UsageError(
                    f"malformed codec {shown(text)}: zstd level must be within "
                    f"{MIN_LEVEL}..{MAX_LEVEL}, got {level}"
                )
    if parts:
        raise UsageError(f"malformed codec {shown(text)}: expected one of {CODEC_FORMS}")
    return compress, level


@functools.lru_cache(maxsize=256)
def _parse_cached(text: str) -> CodecSpec:
    return CodecSpec._parse(text)
