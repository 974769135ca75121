"""The smallest real chain of segments, for tests of what runs around a plan (commands,
clients, reaching a tier) rather than of what the segments compute."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from tierflow.plan import SegmentSpec


def matmul_chain(directory: Path, places: Sequence[tuple[str, str]]) -> list[SegmentSpec]:
    """Two identity MatMuls, x -> h -> y, written into ``directory``: one segment per
    (tier, file name) in ``places``, in that order."""
    assert len(places) == 2, places
    specs = []
    for (tier, name), (src, dst) in zip(places, (("x", "h"), ("h", "y")), strict=True):
        weights = numpy_helper.from_array(np.eye(4, dtype=np.float32), "w")
        graph = helper.make_graph(
            [helper.make_node("MatMul", [src, "w"], [dst])],
            "g",
            [helper.make_tensor_value_info(src, TensorProto.FLOAT, [1, 4])],
            [helper.make_tensor_value_info(dst, TensorProto.FLOAT, [1, 4])],
            [weights],
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        onnx.save(model, directory / name)
        specs.append(SegmentSpec(tier, name, (src,), (dst,)))
    return specs
