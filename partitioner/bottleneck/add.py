"""``tierflow bottleneck add``: a learned encoder/decoder grafted into a model at a cut.

[Note: learned bottleneck]
Quantising and entropy-coding a feature (the codecs) keeps all its channels; a convnet's
feature is far more redundant than that. Split computing's answer (supervised
compression, bottleneck injection) is to narrow the feature where it crosses the link:
an encoder on the sender maps the C channels at the cut to k << C channels of integer
codes, a decoder on the receiver maps them back, and the pair is trained so the rest of
the model hardly notices. Here:

- Encoder: a 3x3 convolution C -> k, clipped to [0, L-1] (L = 2**bits), rounded, cast
  to uint8: the *codes* are the new crossing tensor; it costs the sender 9Ck
  multiply-adds per position. Decoder: cast to float, a 3x3 convolution k -> 2C, ReLU, a
  1x1 convolution 2C -> C, and a ReLU when the original feature is non-negative. Plain
  ONNX operators (Conv, Clip, Round, Cast, Relu), so every runtime runs them. A 1x1
  linear pair was tried first: on the digits model at 4 of 64 channels it kept the top-1
  class for only 83% of held-out requests; spatial context and a hidden layer are cheap.
- Training (:mod:`.bottleneck_train`) distils from the frozen model on unlabeled inputs:
  it starts from the feature's top-k principal directions and minimises the feature's
  reconstruction error, and, where the layers after the cut can be re-run in torch
  (:mod:`.torch_tail`, checked against ONNX Runtime), the error of the model's outputs
  too. Rounding is in the loop with a straight-through gradient.
- The codes are uint8 at the cut, so a lossless codec (``zstd``) carries them exactly:
  a plan of the grafted model is bit-exact against the grafted model, and the price in
  fidelity is paid once, here, and measured here: each (k, bits) point is run by ONNX
  Runtime on held-out requests and compared with the exact model (top-1 agreement, or
  boxes / decoded text for detectors and OCR, :mod:`tierflow.zoo.agreement`).
- The cut: a one-tensor cut with a 4-D float feature, named by ``--at`` (tensor or cut
  index), else chosen where bytes matter most for a device: the first such cut within
  the first half of the model's multiply-adds where the feature has at most 1/16 of the
  input's spatial positions (bytes scale with positions x k), else the one with the
  fewest positions in that half.

The written model is the point with the fewest bytes whose agreement meets the target
(default 99%), else the most faithful one; ``tierflow plan`` sees the codes as the
cheapest cut in that stretch of the graph.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import onnx
from onnx import helper

from tierflow.errors import ModelError, UsageError
from tierflow.partitioner.bottleneck.graft import (
    METADATA_KEY,
    BottleneckWeights,
    code_name,
    graft,
)

logger = logging.getLogger(__name__)

DEFAULT_BITS = (8, 4, 2)
DEFAULT_TARGET = 0.99
HOLDOUT_FRACTION = 0.3
_SEED = 0

# Per-request agreement of changed outputs with exact ones (lists in output order).
Agreement = Callable[[list[np.ndarray], list[np.ndarray]], np.ndarray]


class Trainer(Protocol):
    """What trains the pairs: :class:`tierflow.zoo.bottleneck_train.TorchTrainer`.

    The planner side imports no torch; ``tierflow bottleneck add`` hands it a trainer.
    :meth:`prepare` gets the analysed model, the cut tensor, the output names, the
    features and the exact outputs on the training rows, and returns a description of how
    it distils; :meth:`train` returns :class:`BottleneckWeights` fields for one point.
    """

    def prepare(
        self,
        model: onnx.ModelProto,
        at: str,
        outputs: Sequence[str],
        features: np.ndarray,
        teacher: Sequence[np.ndarray],
    ) -> str: ...

    def train(
        self, features: np.ndarray, teacher: Sequence[np.ndarray], channels: int, bits: int
    ) -> Mapping[str, Any]: ...


def top1(exact: list[np.ndarray], changed: list[np.ndarray]) -> np.ndarray:
    """Per request, 1.0 when every output keeps the exact model's argmax (see fidelity)."""
    from tierflow.partitioner.fidelity import request_agrees

    rows = len(exact[0])
    return np.array(
        [
            float(
                request_agrees(
                    {str(i): e[r : r + 1] for i, e in enumerate(exact)},
                    {str(i): c[r : r + 1] for i, c in enumerate(changed)},
                )
            )
            for r in range(rows)
        ]
    )


def default_channels(feature_channels: int) -> tuple[int, ...]:
    """C/4, C/8 and C/16 channels (at least 1), widest first, without repeats."""
    widths = {max(1, feature_channels // d) for d in (4, 8, 16)}
    return tuple(sorted(widths, reverse=True))


def packed_bytes(codes_per_request: int, bits: int) -> int:
    """Bytes of one request's codes packed at ``bits`` per value (the information sent)."""
    return math.ceil(codes_per_request * bits / 8)


@dataclass(frozen=True)
class RatePoint:
    """One trained bottleneck measured on held-out requests against the exact model."""

    channels: int
    bits: int
    code_bytes: int  # the uint8 codes of one request, as they cross
    zstd_bytes: float  # mean over held-out requests of the codes through zstd level 3
    packed_bytes: int  # the codes packed at `bits` per value
    agreement: float  # mean per-request agreement with the exact model, in [0, 1]
    max_rel_error: float  # largest output error relative to the output's largest value

    def to_dict(self) -> dict[str, Any]:
        return {
            "channels": self.channels,
            "bits": self.bits,
            "code_bytes": self.code_bytes,
            "zstd_bytes": round(self.zstd_bytes, 1),
            "packed_bytes": self.packed_bytes,
            "agreement": self.agreement,
            "max_rel_error": self.max_rel_error,
        }


@dataclass(frozen=True)
class BottleneckResult:
    """The grafted model of the chosen point, and every point's figures."""

    model: onnx.ModelProto
    at: str
    code: str
    feature_shape: tuple[int, ...]
    feature_bytes: int
    input_bytes: int
    points: tuple[RatePoint, ...]
    chosen: int
    agreement: str
    distillation: str
    trained_on: int
    measured_on: int
    target: float

    def summary(self) -> dict[str, Any]:
        return {
            "at": self.at,
            "code": self.code,
            "feature_shape": list(self.feature_shape),
            "feature_bytes": self.feature_bytes,
            "input_bytes": self.input_bytes,
            "agreement": self.agreement,
            "distillation": self.distillation,
            "trained_on": self.trained_on,
            "measured_on": self.measured_on,
            "target": self.target,
            "chosen": self.chosen,
            "points": [p.to_dict() for p in self.points],
        }

    def save(self, path: str | Path) -> Path:
        out = Path(path)
        try:
            onnx.save_model(self.model, str(out))
        except (OSError, ValueError) as exc:
            raise ModelError(f"cannot write {out}: {exc}") from exc
        return out

    def table(self) -> str:
        """The rate-fidelity points as an aligned table; the written one is marked."""
        header = (
            "channels",
            "bits",
            "bytes",
            "zstd bytes",
            "packed",
            self.agreement,
            "max rel err",
        )
        rows = [
            (
                "exact",
                "32",
                str(self.feature_bytes),
                "",
                "",
                "100.00%",
                "0",
            )
        ]
        for i, p in enumerate(self.points):
            rows.append(
                (
                    f"{p.channels}{' *' if i == self.chosen else ''}",
                    str(p.bits),
                    str(p.code_bytes),
                    f"{p.zstd_bytes:.0f}",
                    str(p.packed_bytes),
                    f"{100 * p.agreement:.2f}%",
                    f"{p.max_rel_error:.3g}",
                )
            )
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        lines = [
            "  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in [header, *rows]
        ]
        shape = "x".join(str(d) for d in self.feature_shape)
        intro = (
            f"bottleneck at {self.at} ({shape} float32, {self.feature_bytes} bytes; the input "
            f"is {self.input_bytes} bytes); trained on {self.trained_on} requests, measured "
            f"on {self.measured_on} held-out; distillation: {self.distillation}"
        )
        outro = (
            f"* written: the fewest bytes with {self.agreement} >= {100 * self.target:.2f}%"
            if self.points[self.chosen].agreement >= self.target
            else f"* written: no point reached {100 * self.target:.2f}%; the most faithful"
        )
        return "\n".join([intro, *lines, outro])


# --- choosing the cut -------------------------------------------------------------------


def bottleneck_cuts(graph: Any) -> list[Any]:
    """Interior one-tensor cuts whose tensor is a 4-D float32 feature with >= 2 channels."""
    found = []
    for cut in graph.cuts[1:-1]:
        if len(cut.tensors) != 1:
            continue
        info = graph.tensors[cut.tensors[0]]
        if len(info.shape) == 4 and info.dtype == "float32" and info.shape[1] >= 2:
            found.append(cut)
    return found


def _macs_before(graph: Any) -> list[float]:
    """Multiply-adds of Conv/Gemm/MatMul nodes before each node position (cumulative)."""
    weights = {t.name: tuple(t.dims) for t in graph.model.graph.initializer}
    totals = [0.0]
    for node in graph.nodes:
        macs = 0.0
        if node.op_type in ("Conv", "ConvTranspose", "Gemm", "MatMul") and len(node.input) > 1:
            out = graph.tensors.get(node.output[0])
            weight = weights.get(node.input[1])
            if weight is None and node.input[1] in graph.tensors:
                weight = tuple(graph.tensors[node.input[1]].shape)
            if out is not None and weight:
                per_output = math.prod(weight[1:]) if node.op_type == "Conv" else weight[0]
                macs = float(math.prod(out.shape)) * float(per_output)
        totals.append(totals[-1] + macs)
    return totals


def choose_cut(graph: Any, at: str | None) -> Any:
    """The cut to put the bottleneck at: ``at`` (a tensor or a cut index), else see the Note."""
    candidates = bottleneck_cuts(graph)
    if at is not None:
        for cut in graph.cuts:
            if at in (cut.tensors[0] if len(cut.tensors) == 1 else None, str(cut.index)):
                if cut not in candidates:
                    raise UsageError(
                        f"cut {at!r} is not a one-tensor cut with a 4-D float feature; "
                        f"candidates: {[c.tensors[0] for c in candidates]}"
                    )
                return cut
        raise UsageError(
            f"{at!r} is not a cut of the model; candidates: {[c.tensors[0] for c in candidates]}"
        )
    if not candidates:
        raise ModelError("the model has no one-tensor cut with a 4-D float feature to narrow")
    macs = _macs_before(graph)
    half = [c for c in candidates if macs[c.position] <= macs[-1] / 2] or candidates[:1]
    image = next((i for i in graph.inputs if len(i.shape) == 4), None)
    input_positions = math.prod(image.shape[2:]) if image is not None else None

    def positions(cut: Any) -> int:
        return math.prod(graph.tensors[cut.tensors[0]].shape[2:])

    if input_positions is not None:
        for cut in half:
            if positions(cut) * 16 <= input_positions:
                return cut
    return min(half, key=lambda c: (positions(c), c.position))


# --- measuring --------------------------------------------------------------------------


def _rel_error(exact: Sequence[np.ndarray], changed: Sequence[np.ndarray]) -> float:
    worst = 0.0
    for e, c in zip(exact, changed, strict=True):
        scale = float(np.abs(e).max()) or 1.0
        worst = max(worst, float(np.abs(e.astype(np.float64) - c).max()) / scale)
    return worst


def _zstd_mean(codes: np.ndarray) -> float:
    import zstandard

    compressor = zstandard.ZstdCompressor(level=3)
    return float(np.mean([len(compressor.compress(row.tobytes())) for row in codes]))


def add_bottleneck(
    model: str | Path,
    data: Mapping[str, np.ndarray] | str | Path,
    *,
    at: str | None = None,
    channels: Sequence[int] = (),
    bits: Sequence[int] = DEFAULT_BITS,
    trainer: Trainer,
    target: float = DEFAULT_TARGET,
    agreement: Agreement = top1,
    agreement_name: str = "top1",
    holdout: float = HOLDOUT_FRACTION,
    shapes: Mapping[str, Sequence[int]] | None = None,
) -> BottleneckResult:
    """Train bottlenecks at one cut of ``model`` for each (channels, bits), graft the best.

    ``data`` is a calibration file (or its arrays) as ``exits add`` takes it; labels, if
    present, are ignored: the model's own outputs are the targets. ``agreement`` judges
    each point on the held-out rows (``agreement_name`` labels it). See
    [Note: learned bottleneck].
    """
    from tierflow.partitioner.exits.calibration import load_calibration, prepare_data
    from tierflow.partitioner.exits.heads import run_model
    from tierflow.partitioner.graph import load_model

    if not 0.0 < target <= 1.0:
        raise UsageError(f"the agreement target must lie in (0, 1], got {target}")
    if not 0.0 < holdout < 1.0:
        raise UsageError(f"the held-out share must lie in (0, 1), got {holdout}")
    if any(b not in range(1, 9) for b in bits) or not bits:
        raise UsageError(f"bits must be 1 to 8, got {list(bits)}")
    arrays = load_calibration(data) if isinstance(data, str | Path) else dict(data)
    sample = None if shapes else {k: v for k, v in arrays.items() if k != "labels"}
    graph = load_model(model, shapes=shapes, sample=sample)
    original = onnx.load(str(model))
    calib = prepare_data(original, arrays, "calibration data")
    if calib.rows < 4:
        raise UsageError(f"a bottleneck needs at least 4 calibration requests, got {calib.rows}")
    cut = choose_cut(graph, at)
    tensor = cut.tensors[0]
    feature_shape = tuple(graph.tensors[tensor].shape)
    outputs = [o.name for o in original.graph.output]

    order = np.random.default_rng(_SEED).permutation(calib.rows)
    split = min(max(round(calib.rows * (1 - holdout)), 2), calib.rows - 2)
    fit, held = calib.take(np.sort(order[:split])), calib.take(np.sort(order[split:]))
    fit_values = run_model(original, fit.inputs, [tensor, *outputs])
    features = fit_values[tensor]
    teacher = [fit_values[o] for o in outputs]
    exact_held = run_model(original, held.inputs, outputs)
    exact = [exact_held[o] for o in outputs]

    distillation = trainer.prepare(graph.model, tensor, outputs, features, teacher)
    logger.info("[bottleneck] at %s %s; distillation: %s", tensor, feature_shape, distillation)

    widths = tuple(channels) or default_channels(feature_shape[1])
    if any(k < 1 or k > feature_shape[1] for k in widths):
        raise UsageError(f"channels must be 1 to {feature_shape[1]}, got {list(widths)}")
    points: list[RatePoint] = []
    models: list[onnx.ModelProto] = []
    for k in widths:
        for b in bits:
            weights = BottleneckWeights.from_dict(trainer.train(features, teacher, k, b))
            grafted, code = graft(original, tensor, weights)
            got = run_model(grafted, held.inputs, [code, *outputs])
            changed = [got[o] for o in outputs]
            codes = got[code]
            points.append(
                RatePoint(
                    channels=weights.channels,
                    bits=b,
                    code_bytes=int(math.prod(codes.shape[1:])),
                    zstd_bytes=_zstd_mean(codes),
                    packed_bytes=packed_bytes(int(math.prod(codes.shape[1:])), b),
                    agreement=float(np.mean(agreement(exact, changed))),
                    max_rel_error=_rel_error(exact, changed),
                )
            )
            models.append(grafted)
            logger.info("[bottleneck] %s", points[-1].to_dict())
    meeting = [i for i, p in enumerate(points) if p.agreement >= target]
    if meeting:
        chosen = min(meeting, key=lambda i: (points[i].zstd_bytes, -points[i].agreement))
    else:
        chosen = max(range(len(points)), key=lambda i: (points[i].agreement, -points[i].zstd_bytes))
    input_bytes = sum(v.nbytes // max(len(v), 1) for v in calib.inputs.values())
    result = BottleneckResult(
        model=models[chosen],
        at=tensor,
        code=code_name(tensor),
        feature_shape=feature_shape,
        feature_bytes=int(math.prod(feature_shape) * 4),
        input_bytes=int(input_bytes),
        points=tuple(points),
        chosen=chosen,
        agreement=agreement_name,
        distillation=distillation,
        trained_on=fit.rows,
        measured_on=held.rows,
        target=target,
    )
    props = {p.key: p.value for p in result.model.metadata_props}
    props[METADATA_KEY] = json.dumps(result.summary())
    helper.set_model_props(result.model, props)
    return result
