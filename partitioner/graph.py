"""Graph analysis of an ONNX model: static shapes, topological order and candidate cuts.

Pure analysis: it reads the model file and returns data; nothing is written. The planner
profiles the "units" between consecutive cuts and scores pairs of cuts. See
``Note [cut sets]`` below for what a cut is and which positions are candidates.

(Work in progress: the API below is fixed; implementations are being filled in.)
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

logger = logging.getLogger(__name__)

DEFAULT_MAX_CUT_TENSORS = 3


@dataclass(frozen=True)
class TensorInfo:
    """An activation tensor: its name, numpy dtype name and static shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


@dataclass(frozen=True)
class Cut:
    """A candidate cut: a position in the node order and the tensors crossing it."""

    index: int
    position: int
    tensors: tuple[str, ...]
    nbytes: int


@dataclass(frozen=True)
class ModelGraph:
    """A loaded, analysed model. See ``Note [cut sets]``."""

    path: str
    sha256: str
    model: onnx.ModelProto
    nodes: tuple[onnx.NodeProto, ...]
    inputs: tuple[TensorInfo, ...]
    outputs: tuple[TensorInfo, ...]
    tensors: dict[str, TensorInfo]
    cuts: tuple[Cut, ...]

    def weight_bytes(self, start: int, end: int) -> int:
        raise NotImplementedError

    def peak_activation_bytes(self, start: int, end: int) -> int:
        raise NotImplementedError

    def representative_inputs(self, seed: int = 0) -> dict[str, np.ndarray]:
        raise NotImplementedError


def load_model(
    path: str | Path,
    *,
    shapes: Mapping[str, Sequence[int]] | None = None,
    sample: Mapping[str, np.ndarray] | None = None,
    max_cut_tensors: int = DEFAULT_MAX_CUT_TENSORS,
) -> ModelGraph:
    raise NotImplementedError


def parse_shape_option(text: str) -> tuple[str, tuple[int, ...]]:
    raise NotImplementedError


def load_sample(path: str | Path) -> dict[str, np.ndarray]:
    raise NotImplementedError
