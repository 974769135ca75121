"""Tensors tiers rebuild from model inputs: a decoder's mask and rotary tables ([Note: derived
tensors stay home])."""

from __future__ import annotations

from pathlib import Path

import pytest

from tierflow.partitioner.decoder_graph import (
    DecoderGraph,
    check_generation,
    load_decoder,
    split_decoder,
)
from tierflow.partitioner.decoder_points import DecoderSettings, point_sample
from tierflow.partitioner.graph import load_model
from tierflow.partitioner.rebuild import Cone, choose_rebuilt, rebuilt_sets
from tierflow.partitioner.stateful import value_sig
from tierflow.partitioner.tensors import TensorInfo
from tierflow.zoo.tiny_stateful import tiny_decoder

SETTINGS = DecoderSettings(context=64, max_tokens=8, prompt_tokens=5)
INPUTS = ("input_ids", "attention_mask", "position_ids")


@pytest.fixture(scope="module")
def shared_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_decoder(tmp_path_factory.mktemp("shared") / "d.onnx", shared_tables=True)


@pytest.fixture(scope="module")
def graph(shared_path: Path) -> DecoderGraph:
    return load_decoder(shared_path, SETTINGS)


def _info(name: str, nbytes: int) -> TensorInfo:
    return TensorInfo(name, "uint8", (nbytes,))


def test_every_tensor_a_cheap_cone_makes_is_rebuilt_and_its_roots_cross() -> None:
    cones = {
        "cos": Cone(frozenset({"position_ids"}), frozenset({1}), frozenset()),
        "mask": Cone(frozenset({"attention_mask"}), frozenset({2}), frozenset()),
        "ids_only": Cone(frozenset({"token_types"}), frozenset({3}), frozenset()),
    }
    tensors = {
        n: _info(n, b)
        for n, b in [("position_ids", 8), ("attention_mask", 80), ("cos", 256), ("mask", 10),
                     ("hidden", 3584), ("ids_only", 4)]
    }  # fmt: skip
    sets = [INPUTS, ("cos", "mask", "hidden"), ("cos", "mask", "hidden", "ids_only"), ("logits",)]
    # The bool mask (10 B) is rebuilt too, though the int64 attention_mask takes 80 B: the
    # inputs carry the batch axis and compress; a cone whose root cannot cross is not.
    assert choose_rebuilt(sets, cones, tensors) == ("cos", "mask")
    rebuilt = rebuilt_sets(sets, cones, ("cos", "mask"), INPUTS)
    assert rebuilt[1] == ("attention_mask", "position_ids", "hidden")
    assert rebuilt[2] == ("attention_mask", "position_ids", "hidden", "ids_only")
    assert rebuilt[0] == INPUTS and rebuilt[-1] == ("logits",)
    # A root that crosses beside it anyway crosses once.
    sets = [INPUTS, ("attention_mask", "mask", "hidden"), ("logits",)]
    assert choose_rebuilt(sets, cones, tensors) == ("mask",)
    assert rebuilt_sets(sets, cones, ("mask",), INPUTS)[1] == ("attention_mask", "hidden")
    # A root stays live from the start to the last cut whose tensor it rebuilds.
    sets = [INPUTS, ("hidden",), ("cos", "hidden"), ("hidden",), ("logits",)]
    assert rebuilt_sets(sets, cones, ("cos",), INPUTS)[1:4] == [
        ("position_ids", "hidden"),
        ("position_ids", "hidden"),
        ("hidden",),
    ]


def test_the_mask_and_rotary_tables_never_cross_a_cut_and_the_inputs_do(
    graph: DecoderGraph,
) -> None:
    derived = {"rotary_cos", "rotary_sin", "expanded_mask"}
    assert derived <= set(graph.decode.rebuilt)
    assert graph.prefill.rebuilt == graph.decode.rebuilt
    for prefill, decode in zip(graph.prefill.cuts, graph.decode.cuts, strict=True):
        assert prefill.tensors == decode.tensors
        assert not derived & set(prefill.tensors)
    # From the model inputs to the last block: position_ids and attention_mask in the
    # tables' and the mask's place.
    last_read = max(i for i, node in enumerate(graph.prefill.nodes) if "rotary_sin" in node.input)
    before = [c for c in graph.prefill.cuts if c.position <= last_read]
    assert len(before) > 3
    assert all({"position_ids", "attention_mask"} <= set(c.tensors) for c in before)


def test_a_split_rebuilding_the_mask_and_tables_is_bit_exact(
    graph: DecoderGraph, shared_path: Path
) -> None:
    cuts = graph.prefill.cuts
    inputs = [value_sig(v) for v in graph.source.graph.input]
    sample = point_sample(inputs, graph.decoder, graph.states, graph.points[1], seed=1)
    sent = load_model(
        shared_path,
        sample=sample,
        positions=[c.position for c in graph.decode.cuts],
        fold=False,
        max_cut_tensors=16,
    )
    assert sent.rebuilt == ()
    between = [c.index for c in sent.cuts if "expanded_mask" in c.tensors]
    assert len(between) > 3
    for index in between:
        before, after = sent.cuts[index], graph.decode.cuts[index]
        # What the tiers rebuild goes; the model inputs it comes from cross instead.
        roots = {"input_ids", "attention_mask", "position_ids"}
        assert set(after.tensors) - roots == set(before.tensors) - set(graph.decode.rebuilt)
        assert "attention_mask" in after.tensors
    pairs = [(between[0], between[-1]), (between[len(between) // 2], len(cuts) - 1)]
    for a, b in pairs:
        segments = split_decoder(graph, (a, b))
        taken = {name for spec, _ in segments for name in spec.inputs}
        assert not {"rotary_cos", "rotary_sin", "expanded_mask"} & taken
        check = check_generation(graph, segments, [3, 1, 4, 1, 5], 8)
        assert check.bitwise_equal and check.max_abs_diff == 0.0
