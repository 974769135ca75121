"""Small hand-built plans for the runtime benchmarks: a chain of float vectors over the tiers.

The transport and chaos benchmarks measure the runtime, not a model, so they serve plans
whose compute is a few elementwise or Gemm nodes per tier and whose crossing tensors have
the size the benchmark asks for. :func:`chain_plan` writes one: each tier's segment, the
unsplit model beside them (``model.onnx``, the answer every split run must give), and the
plan with the raw codec on every link.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from tierflow.plan import Plan, SegmentSpec, save_plan

OPSET = 17


@dataclass(frozen=True)
class Stage:
    """One tier's segment: its ``nodes``, from the previous stage's output (the plan's
    input ``x`` for the first) to ``output``, a float32 vector ``[1, width]``."""

    tier: str
    nodes: Sequence[Any]
    output: str
    width: int


def _vector(name: str, width: int) -> Any:
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, [1, width])


def _model(
    nodes: Sequence[Any],
    source: tuple[str, int],
    sink: tuple[str, int],
    weights: Mapping[str, np.ndarray],
) -> Any:
    used = {name for node in nodes for name in node.input}
    inits = [numpy_helper.from_array(w, n) for n, w in weights.items() if n in used]
    graph = helper.make_graph(list(nodes), "g", [_vector(*source)], [_vector(*sink)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])


def chain_plan(
    directory: Path,
    width: int,
    stages: Sequence[Stage],
    weights: Mapping[str, np.ndarray] | None = None,
) -> Path:
    """A plan in ``directory``: input ``x[1, width]`` through ``stages`` (one per tier, in
    order), ``weights`` as the initializers of the nodes that read them; returns
    ``directory``. The last stage's output must be named ``y``."""
    assert stages and stages[-1].output == "y", "the chain ends in y"
    weights = weights or {}
    directory.mkdir(parents=True, exist_ok=True)
    every = [node for stage in stages for node in stage.nodes]
    onnx.save(
        _model(every, ("x", width), ("y", stages[-1].width), weights), directory / "model.onnx"
    )
    segments, source = [], ("x", width)
    for stage in stages:
        sink = (stage.output, stage.width)
        onnx.save(_model(stage.nodes, source, sink, weights), directory / f"{stage.tier}.onnx")
        segments.append(SegmentSpec(stage.tier, f"{stage.tier}.onnx", (source[0],), (sink[0],)))
        source = sink
    plan = Plan(
        "model.onnx",
        "0" * 64,
        ("x",),
        ("y",),
        tuple(segments),
        codec={"device-edge": "raw", "edge-cloud": "raw"},
    )
    save_plan(plan, directory)
    return directory
