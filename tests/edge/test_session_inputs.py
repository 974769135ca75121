"""A session's inputs checked where they enter a tier (issue 28 finding 8): a decoder step
whose position disagrees with its companions, and first state values of the wrong dtype or
for a state no tier owns, are INVALID_INPUT, never INTERNAL, never cast, never forwarded.
The tiers are called in process ([Note: the next tier in process] in
tierflow/runtime/upstream.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tierflow.codec.spec import CodecSpec
from tierflow.partitioner.decoder_graph import load_decoder, split_decoder
from tierflow.partitioner.decoder_points import DecoderSettings
from tierflow.partitioner.graph import load_model
from tierflow.partitioner.split import save_split_plan, split_model
from tierflow.plan import load_plan
from tierflow.rpc import tier_pb2
from tierflow.runtime.tier import Tier
from tierflow.runtime.upstream import LocalUpstream
from tierflow.transport.wire import put_tensors
from tierflow.zoo.tiny_stateful import streaming_model, tiny_decoder

RAW_CODEC = CodecSpec.parse("raw")


def _ask(edge: Tier, requests: list[tier_pb2.Request]) -> dict[str, tier_pb2.Reply]:
    """Each request's reply from ``edge``, by the request's own id."""
    device = LocalUpstream(edge, me="device")
    return {request.id: device.submit(request).future.result() for request in requests}


def _code(reply: tier_pb2.Reply) -> str:
    return str(tier_pb2.ErrorCode.Name(reply.error.code)) if reply.HasField("error") else "OK"


@pytest.fixture
def decoder_edge(tmp_path: Path, rt: Any) -> Iterator[tuple[str, Tier]]:
    """A decoder that runs whole on the edge: the device sends tokens and companions raw."""
    root = tmp_path
    model = tiny_decoder(root / "decoder.onnx", blocks=2, vocab=16, seed=1)
    graph = load_decoder(model, DecoderSettings(context=32, max_tokens=8, prompt_tokens=4))
    cuts = (0, len(graph.prefill.cuts) - 1)
    segments = split_decoder(graph, cuts)
    assert [spec.tier for spec, _ in segments] == ["edge"]
    plan_dir = root / "plan"
    save_split_plan(graph.prefill, segments, plan_dir, cuts=cuts, decoder=graph.decoder)
    with rt.in_process(plan_dir) as tiers:
        yield load_plan(plan_dir).plan_id, tiers.edge


def _step(
    plan_id: str, ident: str, position: int, feeds: dict[str, np.ndarray]
) -> tier_pb2.Request:
    request = tier_pb2.Request(id=ident, plan_id=plan_id, session="s", position=position)
    put_tensors(request.tensors, feeds, RAW_CODEC)
    return request


def test_a_step_whose_position_disagrees_with_its_mask_is_invalid_input(
    decoder_edge: tuple[str, Tier], capfd: pytest.CaptureFixture[str]
) -> None:
    plan_id, edge = decoder_edge
    decoder = edge.plan.decoder
    assert decoder is not None and decoder.attention_mask and decoder.position_ids
    prompt = decoder.step_feeds([1, 2, 3, 4], 0)
    bad_mask = {**decoder.step_feeds([5], 4), decoder.attention_mask: np.ones((1, 7), np.int64)}
    bad_ids = {**decoder.step_feeds([5], 4), decoder.position_ids: np.array([[2]], np.int64)}
    good = decoder.step_feeds([5], 4)
    replies = _ask(
        edge,
        [
            _step(plan_id, "prompt", 0, prompt),
            _step(plan_id, "mask", 4, bad_mask),
            _step(plan_id, "ids", 4, bad_ids),
            _step(plan_id, "good", 4, good),
        ],
    )
    assert _code(replies["prompt"]) == "OK"
    for name in ("mask", "ids"):
        assert _code(replies[name]) == "INVALID_INPUT", replies[name].error.message
        assert "position" in replies[name].error.message
    assert _code(replies["good"]) == "OK"  # the session's state was not touched
    assert "onnxruntime" not in capfd.readouterr().err


@pytest.fixture
def stream_tiers(tmp_path: Path, rt: Any) -> Iterator[tuple[str, Tier]]:
    """The streaming model with its state on the cloud: the edge only forwards."""
    root = tmp_path
    graph = load_model(streaming_model(root / "stream.onnx"))
    segments = split_model(graph, (0, 0))
    save_split_plan(graph, segments, root / "plan", cuts=(0, 0))
    with rt.in_process(root / "plan") as tiers:
        yield load_plan(root / "plan").plan_id, tiers.edge


def _first_chunk(plan_id: str, ident: str, state: dict[str, np.ndarray]) -> tier_pb2.Request:
    request = _step(plan_id, ident, 0, {"audio": np.ones((1, 6), np.float32)})
    request.session = ident
    put_tensors(request.initial_state, state, RAW_CODEC)
    return request


def test_initial_state_is_checked_against_the_plan_and_never_cast(
    stream_tiers: tuple[str, Tier],
) -> None:
    plan_id, edge = stream_tiers
    replies = _ask(
        edge,
        [
            _first_chunk(plan_id, "fits", {"state": np.zeros((1, 8), np.float32)}),
            _first_chunk(plan_id, "float64", {"state": np.zeros((1, 8), np.float64)}),
            _first_chunk(plan_id, "shape", {"state": np.zeros((1, 9), np.float32)}),
            _first_chunk(
                plan_id,
                "nobodys",
                {"state": np.zeros((1, 8), np.float32), "other": np.zeros(3, np.float32)},
            ),
        ],
    )
    assert _code(replies["fits"]) == "OK"
    for name, words in (("float64", "float64"), ("shape", "1x9"), ("nobodys", "no state")):
        assert _code(replies[name]) == "INVALID_INPUT", name
        assert words in replies[name].error.message
        assert replies[name].error.tier == "edge"  # refused where it entered
