"""Which candidate codecs are not worth measuring at a cut: cheap checks on its features.

See [Note: codec pruning]. Pure: takes arrays and codec names, returns data.

[Note: codec pruning]
The profile measures every candidate codec on the real features at every cut (encode,
decode, ratio), and each zstd variant costs tens of milliseconds on a ResNet-18 feature
map: with the planner's full set, measuring dominates ``tierflow plan``. Two stages can
be judged from one pass over the features, without encoding anything:

* ``drop+X`` where no channel of any float tensor is constant (what
  :func:`~tierflow.codec.stages.drop_constant_channels` would drop): its payload is
  ``X``'s, plus a channel mask and a pass over the data, so it cannot beat ``X``.
* ``sparse+X`` where the share ``z`` of zero elements (all bits zero) of the float tensors
  is at most ``1 / (8 * b)``, ``b`` the bytes ``X``'s quantiser stores per element (4 for
  float32, 1 for int8, 1/2 for int4): the bitmap (1/8 byte per element) costs at least
  what skipping the zeros saves before compression, and the compressor behind it
  already squeezes runs of zeros, so it does not beat ``X``.

A codec is skipped only when ``X`` itself is among the codecs measured: the search then
still has the codec that does at least as well, and a codec the user named explicitly is
always measured. A skipped codec is recorded as infinitely slow at that cut (as image
codecs are where they cannot carry anything), so the search never puts it there.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np

from tierflow.codec.base import CodecSpec, CodecStats
from tierflow.codec.schemes import QUANTISER_SCHEMES, wire_dtype
from tierflow.codec.stages import drop_constant_channels

_FLOATS = ("float16", "float32", "float64")


@dataclass(frozen=True)
class CutTraits:
    """What the pruning rules read from the float tensors crossing one cut."""

    zero_share: float  # share of float elements whose bits are all zero
    constant_channel: bool  # whether the drop stage would drop any channel

    @classmethod
    def of(cls, arrays: Sequence[np.ndarray]) -> CutTraits:
        floats = [np.asarray(a) for a in arrays if np.asarray(a).dtype.name in _FLOATS]
        elements = sum(a.size for a in floats)
        zeros = 0
        constant = False
        for array in floats:
            wire = np.ascontiguousarray(array, dtype=wire_dtype(array.dtype.name))
            bits = wire.reshape(-1).view(f"u{wire.dtype.itemsize}")
            zeros += int(np.count_nonzero(bits == 0))
            if not constant and wire.size:
                _, kept = drop_constant_channels(wire)
                constant = kept.size < wire.size
        return cls(zeros / elements if elements else 0.0, constant)


def _stored_bytes(spec: CodecSpec, dtype: str) -> float:
    """Bytes the quantiser of ``spec`` stores per element of a ``dtype`` tensor."""
    quantiser = QUANTISER_SCHEMES[spec.quant]
    if quantiser.bits:
        return quantiser.bits / 8
    return float(quantiser.stored_dtype(dtype).itemsize)


def pruned_by(
    codec: str, traits: CutTraits, measured: Collection[str], dtype: str = "float32"
) -> str | None:
    """The measured codec that does at least as well as ``codec`` at this cut, if any.

    ``measured`` holds the codecs measured alongside; ``dtype`` is the widest float
    dtype at the cut (it sets how many bytes a skipped zero saves).
    """
    spec = CodecSpec.parse(codec)
    if spec.drop and not traits.constant_channel:
        plain = str(dataclasses.replace(spec, drop=False))
        if plain in measured:
            return plain
    if spec.sparse and traits.zero_share * _stored_bytes(spec, dtype) <= 1 / 8:
        dense = str(dataclasses.replace(spec, sparse=False))
        if dense in measured:
            return dense
    return None


def widest_float(arrays: Sequence[np.ndarray]) -> str:
    """The float dtype at a cut with the largest items (``float32`` when there is none)."""
    dtypes = [np.asarray(a).dtype for a in arrays if np.asarray(a).dtype.name in _FLOATS]
    return max(dtypes, key=lambda d: d.itemsize).name if dtypes else "float32"


def skipped_stats(codec: str) -> CodecStats:
    """Figures for a codec not measured at a cut: infinitely slow, so never chosen there."""
    return CodecStats(codec, 1.0, math.inf, math.inf, 0.0)
