"""Decoders at lower precision (ONNX Runtime's int8 and 4-bit quantizers, fp16): split, they
generate exactly what their own unsplit model generates, and their memory is their real bytes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest

from tierflow.cli.main import main
from tierflow.device.client import DeviceClient
from tierflow.device.generation import Generator
from tierflow.edge.forwarding import Forwarding
from tierflow.greedy import reference_generate
from tierflow.options import RuntimeOptions
from tierflow.partitioner.decoder_graph import (
    DecoderGraph,
    check_generation,
    load_decoder,
    split_decoder,
)
from tierflow.partitioner.decoder_points import DecoderSettings
from tierflow.partitioner.split import save_split_plan
from tierflow.partitioner.tensors import tensor_nbytes
from tierflow.plan import load_plan
from tierflow.runtime.server import TierServer
from tierflow.zoo.precision import PRECISIONS, convert
from tierflow.zoo.tiny_stateful import tiny_decoder

pytestmark = pytest.mark.integration  # ONNX Runtime's quantizers, servers

SETTINGS = DecoderSettings(context=64, max_tokens=8, prompt_tokens=5)
OPS = {"int8": "MatMulInteger", "int4": "MatMulNBits", "fp16": "MatMul"}


@pytest.fixture(scope="module")
def fp32(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("precision")
    return tiny_decoder(root / "fp32.onnx", blocks=3, width=32, vocab=64, shared_tables=True)


def _weight_bytes(graph: DecoderGraph) -> int:
    return graph.prefill.weight_bytes(0, len(graph.prefill.cuts) - 1)


def _three_tier_cuts(graph: DecoderGraph) -> tuple[int, int]:
    """Two cuts where at most a hidden state and a mask cross beside the model inputs."""
    inputs = {"input_ids", "attention_mask", "position_ids"}
    clean = [c.index for c in graph.prefill.cuts[1:-1] if len(set(c.tensors) - inputs) <= 2]
    return clean[len(clean) // 3], clean[2 * len(clean) // 3]


@pytest.mark.parametrize("precision", PRECISIONS)
def test_a_lower_precision_decoder_splits_bit_exactly_and_weighs_its_real_bytes(
    fp32: Path, precision: str
) -> None:
    path = convert(fp32, fp32.with_name(f"{precision}.onnx"), precision)
    model = onnx.load(str(path))
    assert OPS[precision] in {n.op_type for n in model.graph.node}
    graph = load_decoder(path, SETTINGS)
    whole = load_decoder(fp32, SETTINGS)
    # What planning counts is what the file holds: its initializers' bytes, at their type.
    assert _weight_bytes(graph) == sum(tensor_nbytes(t) for t in model.graph.initializer)
    ratio = _weight_bytes(graph) / _weight_bytes(whole)
    assert ratio < {"int8": 0.4, "int4": 0.35, "fp16": 0.55}[precision]
    if precision == "fp16":
        assert {s.dtype for s in graph.states} == {"float16"}
    segments = split_decoder(graph, _three_tier_cuts(graph))
    assert [spec.tier for spec, _ in segments] == ["device", "edge", "cloud"]
    check = check_generation(graph, segments, [3, 1, 4, 1, 5, 9], 10)
    assert check.same_tokens
    if precision == "fp16":  # [Note: half precision splits]
        assert 0 < check.max_abs_diff < 1e-2
    else:
        assert check.bitwise_equal and check.max_abs_diff == 0.0
    assert len(set(check.tokens)) > 1 and np.all(np.asarray(check.tokens) < 64)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_a_lower_precision_decoder_served_on_three_tiers_generates_its_own_tokens(
    fp32: Path, tmp_path: Path, precision: str
) -> None:
    path = convert(fp32, tmp_path / f"{precision}.onnx", precision)
    assert OPS[precision] in {n.op_type for n in onnx.load(str(path)).graph.node}
    graph = load_decoder(path, SETTINGS)
    cuts = _three_tier_cuts(graph)
    plan_dir = tmp_path / "plan"
    save_split_plan(
        graph.prefill,
        split_decoder(graph, cuts),
        plan_dir,
        cuts=cuts,
        codec={"device-edge": "raw", "edge-cloud": "zstd"},
        decoder=graph.decoder,
    )
    prompt = [3, 1, 4, 1, 5, 9]
    cloud = TierServer.from_plan("cloud", plan_dir, options=RuntimeOptions())
    cloud.start()
    edge = TierServer.from_plan(
        "edge", plan_dir, forwarder=Forwarding(cloud.address), options=RuntimeOptions()
    )
    edge.start()
    try:
        with DeviceClient(plan_dir, edge.address) as client:
            report = Generator(client).generate(prompt, 12)
    finally:
        edge.stop(0)
        cloud.stop(0)
    whole = reference_generate(path, prompt, 12, context=SETTINGS.context)
    assert report.tokens == list(whole.tokens)
    assert report.bytes_per_token["device-edge"] > 0 and report.bytes_per_token["edge-cloud"] > 0


def test_plan_splits_an_fp16_decoder_on_its_tokens_and_refuses_nothing_else(
    fp32: Path, tmp_path: Path, capsys: Any
) -> None:
    # Budgets no tier meets alone: the plan spreads the blocks over all three.
    path = convert(fp32, tmp_path / "fp16.onnx", "fp16")
    args = ["plan", str(path), "-o", str(tmp_path / "plan"), "--context", "128",
            "--max-tokens", "8", "--prompt-tokens", "6", "--memory", "device=40KiB",
            "--memory", "edge=45KiB", "--memory", "cloud=60KiB", "--json"]  # fmt: skip
    code = main(args)
    out, err = capsys.readouterr()
    assert code == 0, err
    report = json.loads(out)
    plan = load_plan(tmp_path / "plan")
    assert [spec.tier for spec in plan.segments] == ["device", "edge", "cloud"]
    verified = report["verified"]
    assert verified["same_tokens"] is True and verified["bitwise_equal"] is False
    assert 0 < verified["max_abs_diff"] < 1e-2
