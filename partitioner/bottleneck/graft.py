"""Grafting a trained bottleneck into an ONNX model with onnx.helper.

The pair's nodes go right after the node producing the feature and every reader of the
feature reads the decoder's output instead; the model is checked before it is returned.
See [Note: learned bottleneck] in :mod:`.add`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from tierflow.errors import ModelError

METADATA_KEY = "tierflow.bottleneck"


@dataclass(frozen=True)
class BottleneckWeights:
    """A trained pair as the graph runs it (float32 arrays, convolution layouts).

    Encoder: ``codes = Cast<uint8>(Round(Clip(conv3x3(x, enc_w, enc_b), 0, levels - 1)))``
    with enc_w [k, C, 3, 3]. Decoder: ``h = Relu(conv3x3(Cast<float>(codes), dec1_w,
    dec1_b))`` with dec1_w [2C, k, 3, 3], then ``x' = conv1x1(h, dec2_w, dec2_b)`` with
    dec2_w [C, 2C, 1, 1], and a final ReLU when ``relu`` (the feature is non-negative).
    """

    channels: int
    bits: int
    enc_w: np.ndarray
    enc_b: np.ndarray
    dec1_w: np.ndarray
    dec1_b: np.ndarray
    dec2_w: np.ndarray
    dec2_b: np.ndarray
    relu: bool

    @property
    def levels(self) -> int:
        return 1 << self.bits

    @classmethod
    def from_dict(cls, data: Any) -> BottleneckWeights:
        """From a trainer's result, checked: shapes must fit together."""
        try:
            weights = cls(
                channels=int(data["channels"]),
                bits=int(data["bits"]),
                relu=bool(data["relu"]),
                **{k: np.asarray(data[k], dtype=np.float32) for k in _ARRAYS},
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelError(f"malformed bottleneck weights: {exc}") from exc
        k, c = weights.enc_w.shape[:2]
        expected = {
            "enc_w": (k, c, 3, 3),
            "enc_b": (k,),
            "dec1_w": (2 * c, k, 3, 3),
            "dec1_b": (2 * c,),
            "dec2_w": (c, 2 * c, 1, 1),
            "dec2_b": (c,),
        }
        for name, shape in expected.items():
            if getattr(weights, name).shape != shape:
                raise ModelError(
                    f"bottleneck weight {name} has shape {getattr(weights, name).shape}, "
                    f"expected {shape}"
                )
        if k != weights.channels or not 1 <= weights.bits <= 8:
            raise ModelError(f"bottleneck of {k} channels at {weights.bits} bits is malformed")
        return weights


_ARRAYS = ("enc_w", "enc_b", "dec1_w", "dec1_b", "dec2_w", "dec2_b")


def code_name(at: str) -> str:
    """The name of the crossing tensor a bottleneck at ``at`` creates."""
    return f"{at}.bottleneck.codes"


def graft(
    model: onnx.ModelProto, at: str, weights: BottleneckWeights
) -> tuple[onnx.ModelProto, str]:
    """A copy of ``model`` with the pair around tensor ``at``; returns it and the code name.

    Every reader of ``at`` reads the decoder's output instead; the nodes go right after
    the one producing ``at``, so the order stays topological.
    """
    grafted = onnx.ModelProto()
    grafted.CopyFrom(model)
    graph = grafted.graph
    producer = next((i for i, n in enumerate(graph.node) if at in n.output), None)
    if producer is None:
        raise ModelError(f"no node produces {at!r}; a bottleneck needs an inner feature")
    if any(o.name == at for o in graph.output):
        raise ModelError(f"{at!r} is a model output; a bottleneck needs an inner feature")
    if (
        max((o.version for o in grafted.opset_import if o.domain in ("", "ai.onnx")), default=0)
        < 11
    ):
        raise ModelError("a bottleneck needs opset 11 or newer (Round)")
    prefix = f"{at}.bottleneck"
    code, decoded = code_name(at), f"{prefix}.decoded"
    for node in graph.node:
        for i, name in enumerate(node.input):
            if name == at:
                node.input[i] = decoded
    arrays = {
        "enc_w": weights.enc_w,
        "enc_b": weights.enc_b,
        "dec1_w": weights.dec1_w,
        "dec1_b": weights.dec1_b,
        "dec2_w": weights.dec2_w,
        "dec2_b": weights.dec2_b,
        "low": np.array(0.0, np.float32),
        "high": np.array(float(weights.levels - 1), np.float32),
    }
    graph.initializer.extend(numpy_helper.from_array(a, f"{prefix}.{k}") for k, a in arrays.items())
    linear = f"{prefix}.linear" if weights.relu else decoded
    p = prefix
    nodes = [
        helper.make_node("Conv", [at, f"{p}.enc_w", f"{p}.enc_b"], [f"{p}.enc"], pads=[1] * 4),
        helper.make_node("Clip", [f"{p}.enc", f"{p}.low", f"{p}.high"], [f"{p}.clipped"]),
        helper.make_node("Round", [f"{p}.clipped"], [f"{p}.rounded"]),
        helper.make_node("Cast", [f"{p}.rounded"], [code], to=TensorProto.UINT8),
        helper.make_node("Cast", [code], [f"{p}.levels"], to=TensorProto.FLOAT),
        helper.make_node(
            "Conv", [f"{p}.levels", f"{p}.dec1_w", f"{p}.dec1_b"], [f"{p}.dec1"], pads=[1] * 4
        ),
        helper.make_node("Relu", [f"{p}.dec1"], [f"{p}.hidden"]),
        helper.make_node("Conv", [f"{p}.hidden", f"{p}.dec2_w", f"{p}.dec2_b"], [linear]),
    ]
    if weights.relu:
        nodes.append(helper.make_node("Relu", [linear], [decoded]))
    for offset, node in enumerate(nodes):
        node.name = f"{prefix}/{node.op_type.lower()}{offset}"
    ordered = [*graph.node[: producer + 1], *nodes, *graph.node[producer + 1 :]]
    del graph.node[:]
    graph.node.extend(ordered)
    try:
        onnx.checker.check_model(grafted)
    except onnx.checker.ValidationError as exc:
        raise ModelError(f"the grafted model is not valid ONNX: {exc}") from exc
    return grafted, code


def read_bottleneck(model: onnx.ModelProto | str | Path) -> dict[str, Any]:
    """The summary ``bottleneck add`` recorded in a model, or {} when it has none."""
    proto = model if isinstance(model, onnx.ModelProto) else onnx.load(str(model))
    for prop in proto.metadata_props:
        if prop.key == METADATA_KEY:
            return dict(json.loads(prop.value))
    return {}
