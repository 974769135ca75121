"""Tiny stateful ONNX models built with ``onnx.helper``: a decoder and a streaming model.

Fast to build (no torch, random weights), for tests and examples of state pairs:

- :func:`tiny_decoder`: a decoder in the layout of [Note: one graph for prefill and
  decode] (:mod:`.bytelm`), ``blocks`` single-head attention blocks with a ReLU MLP,
  causal over its KV cache, masks and positions recomputed in every block from
  ``attention_mask`` and ``position_ids``; symbolic ``batch``, ``seq``, ``past``. With
  ``shared_tables`` it makes them once, as Hugging Face exports do: an expanded bool mask
  and rotary tables (cos and sin of the positions) that every block reads.
- :func:`streaming_model`: a chunk model with a recurrent ``state`` [1, H] -> ``stateN``
  read at its start and again near its end, so cuts between the two reads would separate
  the pair ([Note: state pairs] in :mod:`tierflow.state.pairs`).

Both are saved as one ``.onnx`` file; only onnx and numpy are needed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17


class _Builder:
    """Nodes and initializers of a graph under construction, with fresh names."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.weights: list[onnx.TensorProto] = []
        self.count = 0

    def weight(self, name: str, shape: tuple[int, ...], scale: float = 0.5) -> str:
        values = (self.rng.standard_normal(shape) * scale / np.sqrt(shape[0])).astype(np.float32)
        self.weights.append(numpy_helper.from_array(values, name))
        return name

    def const(self, name: str, value: np.ndarray) -> str:
        self.weights.append(numpy_helper.from_array(value, name))
        return name

    def op(self, op_type: str, inputs: list[str], out: str | None = None, **attrs: Any) -> str:
        self.count += 1
        out = out or f"{op_type.lower()}_{self.count}"
        self.nodes.append(helper.make_node(op_type, inputs, [out], **attrs))
        return out


def tiny_decoder(
    path: str | Path,
    *,
    blocks: int = 3,
    width: int = 8,
    vocab: int = 16,
    seed: int = 0,
    batch_from_last_cache: bool = False,
    shared_tables: bool = False,
    positions: int | None = None,
) -> Path:
    """Write a ``blocks``-block decoder with vocabulary ``vocab`` to ``path``.

    ``shared_tables``: the causal mask (Expand'ed to [batch, 1, seq, past + seq]) and
    rotary tables (cos, sin [batch, seq, width]) are made once before the blocks, so they
    cross every cut between blocks unless a tier rebuilds them ([Note: derived tensors
    stay home] in :mod:`tierflow.partitioner.rebuild`).

    ``positions``: learned position embeddings for that many positions (a table gathered by
    ``position_ids``, as GPT-2's): ONNX Runtime fails on a step at a later position.

    ``batch_from_last_cache`` reads the batch size for a reshape of the embeddings from the
    last block's cache, as torch.export's ONNX graphs do ([Note: state pairs in the cut
    search] in :mod:`tierflow.partitioner.stateful`).
    """
    b = _Builder(seed)
    past_shape: list[int | str] = ["batch", 1, "past", width]
    present_shape: list[int | str] = ["batch", 1, "past_seq", width]
    inputs = [
        helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"]),
        helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "past_seq"]),
        helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["batch", "seq"]),
    ]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "seq", vocab])]
    b.const("zero", np.array(0, dtype=np.int64))
    b.const("one", np.array(1, dtype=np.int64))
    b.const("axis1", np.array([1], dtype=np.int64))
    b.const("axis2", np.array([2], dtype=np.int64))
    b.const("masked", np.array(-1e9, dtype=np.float32))
    b.const("scale", np.array(1.0 / np.sqrt(width), dtype=np.float32))
    x = b.op("Gather", [b.weight("embed", (vocab, width), 2.0), "input_ids"], "embedded")
    if positions is not None:
        table = b.weight("position_embed", (positions, width), 0.5)
        x = b.op("Add", [x, b.op("Gather", [table, "position_ids"])])
    if batch_from_last_cache:
        batch = b.op("Shape", [f"past_key_values.{blocks - 1}.value"], start=0, end=1)
        rest = b.const("rest", np.array([-1, width], dtype=np.int64))
        x = b.op("Reshape", [x, b.op("Concat", [batch, rest], axis=0)])
    tables = _shared_tables(b, width) if shared_tables else None
    for i in range(blocks):
        for kind, shape in (("key", past_shape), ("value", past_shape)):
            inputs.append(
                helper.make_tensor_value_info(
                    f"past_key_values.{i}.{kind}", TensorProto.FLOAT, shape
                )
            )
            outputs.append(
                helper.make_tensor_value_info(
                    f"present.{i}.{kind}", TensorProto.FLOAT, present_shape
                )
            )
        if tables is None:
            # The causal mask over cache and step, from the companions (every block).
            allowed = _causal_mask(b)
            q = b.op("MatMul", [x, b.weight(f"wq{i}", (width, width))])
            k = b.op("MatMul", [x, b.weight(f"wk{i}", (width, width))])
        else:
            mask, cos, sin = tables
            allowed = b.op("Squeeze", [mask, "axis1"])
            q = _rotate(b, b.op("MatMul", [x, b.weight(f"wq{i}", (width, width))]), cos, sin)
            k = _rotate(b, b.op("MatMul", [x, b.weight(f"wk{i}", (width, width))]), cos, sin)
        k = b.op("Unsqueeze", [k, "axis1"])
        v = b.op("Unsqueeze", [b.op("MatMul", [x, b.weight(f"wv{i}", (width, width))]), "axis1"])
        k_all = b.op("Concat", [f"past_key_values.{i}.key", k], f"present.{i}.key", axis=2)
        v_all = b.op("Concat", [f"past_key_values.{i}.value", v], f"present.{i}.value", axis=2)
        keys_t = b.op("Transpose", [b.op("Squeeze", [k_all, "axis1"])], perm=[0, 2, 1])
        scores = b.op("Mul", [b.op("MatMul", [q, keys_t]), "scale"])
        weights = b.op("Softmax", [b.op("Where", [allowed, scores, "masked"])], axis=-1)
        attended = b.op("MatMul", [weights, b.op("Squeeze", [v_all, "axis1"])])
        x = b.op("Add", [x, b.op("MatMul", [attended, b.weight(f"wo{i}", (width, width))])])
        hidden = b.op("Relu", [b.op("MatMul", [x, b.weight(f"w1_{i}", (width, 2 * width))])])
        x = b.op("Add", [x, b.op("MatMul", [hidden, b.weight(f"w2_{i}", (2 * width, width))])])
    b.op("MatMul", [x, b.weight("head", (width, vocab), 2.0)], "logits")
    graph = helper.make_graph(b.nodes, "tiny_decoder", inputs, outputs, initializer=b.weights)
    return _save(graph, path)


def _causal_mask(b: _Builder) -> str:
    """bool [batch, seq, past + seq]: key j visible to query i (causal, attention_mask 1)."""
    total = b.op("Gather", [b.op("Shape", ["attention_mask"]), "one"])
    keys = b.op("Range", ["zero", total, "one"])
    queries = b.op("Unsqueeze", ["position_ids", "axis2"])
    causal = b.op("LessOrEqual", [keys, queries])
    present_mask = b.op("Equal", [b.op("Unsqueeze", ["attention_mask", "axis1"]), "one"])
    return b.op("And", [causal, present_mask])


def _shared_tables(b: _Builder, width: int) -> tuple[str, str, str]:
    """The mask [batch, 1, seq, past + seq] and rotary cos, sin [batch, seq, width]."""
    allowed = b.op("Unsqueeze", [_causal_mask(b), "axis1"])
    shape = b.op("Shape", [allowed])
    mask = b.op("Expand", [allowed, shape], "expanded_mask")
    half = width // 2
    inv_freq = (1.0 / 10000 ** (np.arange(half, dtype=np.float32) * 2 / width)).astype(np.float32)
    b.const("inv_freq", np.concatenate([inv_freq, inv_freq]))
    for name, value in (("start", 0), ("mid", half), ("end", width), ("axis", -1)):
        b.const(f"slice_{name}", np.array([value], dtype=np.int64))
    positions = b.op("Cast", [b.op("Unsqueeze", ["position_ids", "axis2"])], to=TensorProto.FLOAT)
    angles = b.op("Mul", [positions, "inv_freq"])
    return mask, b.op("Cos", [angles], "rotary_cos"), b.op("Sin", [angles], "rotary_sin")


def _rotate(b: _Builder, x: str, cos: str, sin: str) -> str:
    """Rotary position embedding: x * cos + rotate_half(x) * sin (halves swapped, negated)."""
    first = b.op("Slice", [x, "slice_start", "slice_mid", "slice_axis"])
    second = b.op("Slice", [x, "slice_mid", "slice_end", "slice_axis"])
    rotated = b.op("Concat", [b.op("Neg", [second]), first], axis=-1)
    return b.op("Add", [b.op("Mul", [x, cos]), b.op("Mul", [rotated, sin])])


def streaming_model(
    path: str | Path,
    *,
    features: int = 6,
    hidden: int = 8,
    seed: int = 0,
    names: tuple[str, str] = ("state", "stateN"),
) -> Path:
    """Write a chunk model: ``audio`` [1, F] and ``state`` [1, H] in; ``out``, ``stateN`` out.

    ``state`` is read twice, at the start and near the end; ``stateN`` is made after the
    second read. ``names`` renames the pair (to names no convention knows, say).
    """
    b = _Builder(seed)
    state, new = names
    inputs = [
        helper.make_tensor_value_info("audio", TensorProto.FLOAT, [1, features]),
        helper.make_tensor_value_info(state, TensorProto.FLOAT, [1, hidden]),
    ]
    outputs = [
        helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, hidden]),
        helper.make_tensor_value_info(new, TensorProto.FLOAT, [1, hidden]),
    ]
    a = b.op("Relu", [b.op("MatMul", ["audio", b.weight("w_in", (features, hidden))])])
    mixed = b.op("Add", [a, b.op("MatMul", [state, b.weight("u1", (hidden, hidden))])])
    x = mixed
    for i in range(3):
        x = b.op("Tanh", [b.op("MatMul", [x, b.weight(f"w{i}", (hidden, hidden))])])
    recurrent = b.op("MatMul", [state, b.weight("u2", (hidden, hidden))])
    new_state = b.op("Tanh", [b.op("Add", [x, recurrent])], new)
    y = new_state
    for i in range(2):
        y = b.op("Relu", [b.op("MatMul", [y, b.weight(f"v{i}", (hidden, hidden))])])
    b.op("Identity", [y], "out")
    graph = helper.make_graph(b.nodes, "streaming_model", inputs, outputs, initializer=b.weights)
    return _save(graph, path)


def _save(graph: onnx.GraphProto, path: str | Path) -> Path:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    path = Path(path)
    onnx.save_model(model, str(path))
    return path
