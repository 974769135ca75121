"""Where exits may go, and how a number of them is spread over a model's compute."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tierflow.errors import UsageError
from tierflow.partitioner.exits.points import (
    check_exit_points,
    choose_exit_points,
    exit_candidates,
)
from tierflow.partitioner.graph import ModelGraph, load_model


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory) -> ModelGraph:
    """x [1,1,16,16] -> three Conv+Relu stages (c1, c2, c3) -> global pool -> Gemm -> y [1,10].

    The stages grow in multiply-adds (4, 32 and 64 output channels), so the depth of
    the cuts after them is uneven: 0.2%, 6% and 99.99% of the model's multiply-adds.
    """
    rng = np.random.default_rng(0)
    nodes, weights = [], []
    channels = [1, 4, 32, 64]
    previous = "x"
    for stage in range(3):
        name = f"w{stage}"
        weights.append(
            numpy_helper.from_array(
                rng.standard_normal((channels[stage + 1], channels[stage], 3, 3)).astype(
                    np.float32
                ),
                name,
            )
        )
        nodes.append(helper.make_node("Conv", [previous, name], [f"z{stage}"], pads=[1] * 4))
        nodes.append(helper.make_node("Relu", [f"z{stage}"], [f"c{stage + 1}"]))
        previous = f"c{stage + 1}"
    weights.append(numpy_helper.from_array(rng.standard_normal((10, 64)).astype(np.float32), "fc"))
    nodes += [
        helper.make_node("GlobalAveragePool", [previous], ["pooled"]),
        helper.make_node("Flatten", ["pooled"], ["flat"]),
        helper.make_node("Gemm", ["flat", "fc"], ["y"], transB=1),
    ]
    graph = helper.make_graph(
        nodes,
        "chain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 16, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 10])],
        weights,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    path: Path = tmp_path_factory.mktemp("exit-points") / "chain.onnx"
    onnx.save(model, path)
    return load_model(path)


def test_candidates_are_float_features_in_depth_order(chain: ModelGraph) -> None:
    # Not the model's input or output; "flat" is a 2-D float feature, so it may carry one.
    assert exit_candidates(chain) == ["c1", "c2", "c3", "flat"]


def test_exits_are_spread_over_compute_not_over_nodes(chain: ModelGraph) -> None:
    # An exit after the last stage would save nothing (99.99% of the work is done), so
    # however many are asked for, only the cuts after the first two stages qualify; one
    # exit aimed at 50% of the compute takes the nearer of them.
    assert choose_exit_points(chain, 1) == ["c2"]
    assert choose_exit_points(chain, 2) == ["c1", "c2"]
    assert choose_exit_points(chain, 3) == ["c1", "c2"]
    assert choose_exit_points(chain, 0) == []
    with pytest.raises(UsageError, match="at least 0"):
        choose_exit_points(chain, -1)


def test_points_are_checked(chain: ModelGraph) -> None:
    check_exit_points(chain, ["c1", "c2"])
    with pytest.raises(UsageError, match="distinct"):
        check_exit_points(chain, ["c1", "c1"])
    with pytest.raises(UsageError, match="cannot carry an exit"):
        check_exit_points(chain, ["y"])
