"""State pairs in planning: kept on one tier, never crossing, carried over several requests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tierflow.cli.main import main
from tierflow.errors import ModelError
from tierflow.partitioner.graph import load_model
from tierflow.partitioner.split import split_model, verify_split
from tierflow.partitioner.state_verify import verify_stream_split
from tierflow.plan import load_plan
from tierflow.zoo.tiny_stateful import streaming_model


@pytest.fixture(scope="module")
def stream_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return streaming_model(tmp_path_factory.mktemp("stream") / "stream.onnx")


def test_a_recurrent_state_is_found_and_no_cut_separates_it(stream_path: Path) -> None:
    graph = load_model(stream_path)
    (pair,) = graph.state
    assert (pair.input, pair.output, pair.grows) == ("state", "stateN", None)
    lo, hi = graph.spans["state"]
    # The state is read at the model's start and again near stateN: no cut in between.
    assert hi - lo > 5
    assert all(not lo < cut.position <= hi for cut in graph.cuts)
    assert len(graph.cuts) >= 3  # cuts before the first read and after stateN remain
    assert graph.cuts[0].tensors == ("audio",)  # the state is not sent with the request
    assert graph.cuts[-1].tensors == ("out",)  # nor sent back with the answer
    for cut in graph.cuts:
        assert not {"state", "stateN"} & set(cut.tensors)


def test_every_split_keeps_the_pair_on_one_tier_and_carries_it(stream_path: Path) -> None:
    graph = load_model(stream_path)
    last = len(graph.cuts) - 1
    for a in range(last + 1):
        for b in range(a, last + 1):
            segments = split_model(graph, (a, b))
            owners = [spec for spec, _ in segments if spec.state]
            assert len(owners) == 1, (a, b)
            owner = owners[0]
            assert "state" in owner.inputs and "stateN" in owner.outputs
            assert "stateN" not in owner.sent_outputs
            assert all("state" not in spec.inputs for spec, _ in segments if spec is not owner)
            assert verify_split(graph, segments).bitwise_equal
            stream = verify_stream_split(graph, segments, steps=4)
            assert stream.bitwise_equal and stream.steps == 4, (a, b)


def test_plan_writes_the_pair_on_its_segment(
    stream_path: Path, tmp_path: Path, capsys: Any
) -> None:
    code = main(["plan", str(stream_path), "-o", str(tmp_path / "plan"), "--memory", "device=1KiB"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "verified: split reproduces the model bit-for-bit on 3 inputs" in out
    assert "state state -> stateN stays on the" in out
    plan = load_plan(tmp_path / "plan")
    assert plan.inputs == ("audio",) and plan.outputs == ("out",)
    assert plan.state_pairs == (("state", "stateN"),)
    (owner,) = [s for s in plan.segments if s.state]
    assert owner.state[0].shape == (1, 8) and owner.state[0].grows is None
    assert plan.decoder is None
    # The segment files take and make what plan.json says.
    import onnx

    model = onnx.load(str(tmp_path / "plan" / owner.file))
    assert [i.name for i in model.graph.input] == list(owner.inputs)


def test_state_option_pairs_names_no_convention_knows(tmp_path: Path, capsys: Any) -> None:
    path = streaming_model(tmp_path / "mem.onnx", names=("memory_in_t", "memory_out_t"))
    assert load_model(path).state == ()
    graph = load_model(path, state=[("memory_in_*", "memory_out_*")])
    assert [(s.input, s.output) for s in graph.state] == [("memory_in_t", "memory_out_t")]
    code = main(
        ["plan", str(path), "-o", str(tmp_path / "plan"), "--state", "memory_in_t=memory_out_t"]
    )
    _, err = capsys.readouterr()
    assert code == 0, err
    assert load_plan(tmp_path / "plan").state_pairs == (("memory_in_t", "memory_out_t"),)


def test_a_state_pair_whose_shapes_differ_is_a_one_line_error(
    stream_path: Path, tmp_path: Path, capsys: Any
) -> None:
    code = main(["plan", str(stream_path), "-o", str(tmp_path / "p"), "--state", "audio=out"])
    _, err = capsys.readouterr()
    assert code == 2
    assert "state pair audio -> out" in err and "shapes differ on axes [1]" in err
    assert err.count("\n") == 1
    with pytest.raises(ModelError, match="shapes differ"):
        load_model(stream_path, state=[("audio", "out")])


def test_decoder_lengths_on_a_model_without_a_kv_cache_are_refused(
    stream_path: Path, tmp_path: Path, capsys: Any
) -> None:
    code = main(["plan", str(stream_path), "-o", str(tmp_path / "p"), "--context", "128"])
    _, err = capsys.readouterr()
    assert code == 2 and "--context set a decoder's lengths" in err
    assert err.count("\n") == 1
    code = main(["plan", str(stream_path), "-o", str(tmp_path / "p"), "--sessions", "4"])
    _, err = capsys.readouterr()
    assert code == 2 and "--sessions set a decoder's lengths" in err


def test_state_memory_is_counted_on_the_tier_that_keeps_it(
    stream_path: Path, tmp_path: Path
) -> None:
    code = main(["plan", str(stream_path), "-o", str(tmp_path / "plan"), "--json"])
    assert code == 0
    plan = json.loads((tmp_path / "plan" / "plan.json").read_text())
    owner = next(s for s in plan["segments"] if s.get("state"))
    memory = plan["estimate"]["memory_bytes"][owner["tier"]]
    assert memory >= 1 * 8 * 4  # the state [1, 8] float32 on top of weights and activations
    assert np.isfinite(memory)
