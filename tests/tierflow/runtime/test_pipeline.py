"""The request path of every tier ([Note: one request path]), in process: no server, no
channel. Three pipelines, one per tier, pass a request up as the servers would, and the
answer equals the unsplit model's bit for bit; the checks a request meets on entry, the
cache, and an edge that runs nothing are each taken on their own.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tierflow.cache.memory import MemoryCache
from tierflow.codec.spec import CodecSpec
from tierflow.errors import (
    DeadlineError,
    InputError,
    PlanError,
    RemoteError,
    StateError,
    TransportError,
)
from tierflow.onnxrt.inference import open_session
from tierflow.options import RuntimeOptions
from tierflow.plan import Plan, PlanSet, SegmentSpec
from tierflow.rpc import tier_pb2
from tierflow.runtime.pipeline import (
    Answered,
    Onward,
    Pipeline,
    check_decoder_step,
    check_initial_state,
    drive,
    next_tier_gone,
    reply_codec,
    up,
)
from tierflow.state.spec import DecoderSpec, StateSpec
from tierflow.transport.wire import put_tensors

WIDTHS = (16, 12, 8, 4)  # x -> h1 -> h2 -> y


def _layers() -> tuple[list[onnx.NodeProto], list[TensorProto]]:
    """Gemm+Relu, Gemm+Relu, Gemm: three layers, one per tier."""
    rng = np.random.default_rng(0)
    nodes, weights = [], []
    names = ["x", "h1", "h2", "y"]
    for i in range(3):
        w = (rng.standard_normal((WIDTHS[i + 1], WIDTHS[i])) * 0.5).astype(np.float32)
        weights.append(numpy_helper.from_array(w, f"w{i}"))
        out = names[i + 1] if i == 2 else f"g{i}"
        nodes.append(helper.make_node("Gemm", [names[i], f"w{i}"], [out], transB=1))
        if i < 2:
            nodes.append(helper.make_node("Relu", [out], [names[i + 1]]))
    return nodes, weights


def _save(path: Path, nodes: list[onnx.NodeProto], inputs: str, output: str, width: tuple) -> None:
    used = {name for node in nodes for name in node.input}
    _, weights = _layers()
    graph = helper.make_graph(
        nodes,
        path.stem,
        [helper.make_tensor_value_info(inputs, TensorProto.FLOAT, ["batch", width[0]])],
        [helper.make_tensor_value_info(output, TensorProto.FLOAT, ["batch", width[1]])],
        [w for w in weights if w.name in used],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    onnx.save(model, path)


def _plan_dir(directory: Path, codec: dict[str, str], *, edge_runs: bool = True) -> Plan:
    """The model whole (``model.onnx``) and split device | edge | cloud at h1 and h2.

    ``edge_runs=False``: the edge runs nothing and the cloud runs both later layers.
    """
    directory.mkdir(parents=True, exist_ok=True)
    nodes, _ = _layers()
    _save(directory / "model.onnx", nodes, "x", "y", (WIDTHS[0], WIDTHS[3]))
    _save(directory / "a.onnx", nodes[0:2], "x", "h1", (WIDTHS[0], WIDTHS[1]))
    _save(directory / "b.onnx", nodes[2:4], "h1", "h2", (WIDTHS[1], WIDTHS[2]))
    _save(directory / "c.onnx", nodes[4:5], "h2", "y", (WIDTHS[2], WIDTHS[3]))
    _save(directory / "bc.onnx", nodes[2:5], "h1", "y", (WIDTHS[1], WIDTHS[3]))
    if edge_runs:
        segments = (
            SegmentSpec("device", "a.onnx", ("x",), ("h1",)),
            SegmentSpec("edge", "b.onnx", ("h1",), ("h2",)),
            SegmentSpec("cloud", "c.onnx", ("h2",), ("y",)),
        )
    else:
        segments = (
            SegmentSpec("device", "a.onnx", ("x",), ("h1",)),
            SegmentSpec("cloud", "bc.onnx", ("h1",), ("y",)),
        )
    sha = hashlib.sha256((directory / "model.onnx").read_bytes()).hexdigest()
    return Plan("model.onnx", sha, ("x",), ("y",), segments, codec=codec)


def _pipelines(
    directory: Path, plan: Plan, *, cache: MemoryCache | None = None
) -> dict[str, Pipeline]:
    plans, options = PlanSet((plan,)), RuntimeOptions()
    return {
        tier: Pipeline(tier, plans, directory, options, cache=cache if tier == "cloud" else None)
        for tier in ("device", "edge", "cloud")
    }


def _up(pipeline: Pipeline, onward: Onward) -> Answered | Onward:
    """What a server's pipeline makes of a request from the tier below (:func:`up`);
    what it would send up is returned as it is."""
    return up(pipeline.climb(0, request=onward.request, caller="local"), _kept)


def _kept(onward: Onward) -> Onward:
    return onward


def _device(pipeline: Pipeline, x: np.ndarray) -> Onward:
    onward = up(pipeline.climb(0, inputs={"x": x}), _kept)
    assert isinstance(onward, Onward)
    return onward


def _reference(directory: Path, x: np.ndarray) -> np.ndarray:
    """The unsplit model at the tiers' session settings."""
    return open_session(directory / "model.onnx").run(["y"], {"x": x})[0]


def test_three_tiers_in_process_answer_as_the_unsplit_model(tmp_path: Path) -> None:
    plan = _plan_dir(tmp_path, {"device-edge": "zstd", "edge-cloud": "shuffle+zstd"})
    tiers = _pipelines(tmp_path, plan)
    x = np.random.default_rng(1).standard_normal((3, WIDTHS[0])).astype(np.float32)
    up = _device(tiers["device"], x)
    assert up.request.segment == 1 and [t.name for t in up.request.tensors] == ["h1"]
    assert up.nbytes == sum(len(t.data) + len(t.params) for t in up.request.tensors)
    at_edge = _up(tiers["edge"], up)
    assert isinstance(at_edge, Onward) and at_edge.request.segment == 2
    answered = _up(tiers["cloud"], at_edge)
    assert isinstance(answered, Answered) and not answered.cache_hit
    assert answered.outputs["y"].tobytes() == _reference(tmp_path, x).tobytes()
    reply = tiers["cloud"].answer(0, answered)
    assert (reply.plan_id, reply.answered_by) == (plan.plan_id, "cloud")
    assert [t.name for t in reply.outputs] == ["y"]


def test_the_cloud_answers_a_repeated_request_from_its_cache(tmp_path: Path) -> None:
    plan = _plan_dir(tmp_path, {"device-edge": "raw", "edge-cloud": "raw"})
    tiers = _pipelines(tmp_path, plan, cache=MemoryCache(1 << 20))

    def through(x: np.ndarray) -> Answered:
        at_edge = _up(tiers["edge"], _device(tiers["device"], x))
        assert isinstance(at_edge, Onward)
        answered = _up(tiers["cloud"], at_edge)
        assert isinstance(answered, Answered)
        return answered

    x = np.ones((1, WIDTHS[0]), np.float32)
    first, again, other = through(x), through(x), through(2 * x)
    assert not first.cache_hit and again.cache_hit and not other.cache_hit
    assert again.outputs["y"].tobytes() == first.outputs["y"].tobytes()


def test_the_way_up_looks_up_then_asks_the_hook_then_runs_then_sends(tmp_path: Path) -> None:
    """[Note: one request path]: a hit answers before the next-tier hook is asked; on a
    miss the hook comes before the segments, and its answer stops the request there;
    otherwise the segments run and what goes on is handed to ``send``, whose result is
    the request's."""
    plan = _plan_dir(tmp_path, {"device-edge": "raw", "edge-cloud": "raw"})
    cache = MemoryCache(1 << 20)
    edge = Pipeline("edge", PlanSet((plan,)), tmp_path, RuntimeOptions(), cache=cache)
    device = _pipelines(tmp_path, plan)["device"]
    asked: list[int] = []
    sent: list[Onward] = []

    def hook(answer: str | None) -> Callable[[object], str | None]:
        def next_down(runner: object) -> str | None:
            asked.append(1)
            return answer

        return next_down

    def send(onward: Onward) -> str:
        sent.append(onward)
        return "sent"

    x = np.ones((1, WIDTHS[0]), np.float32)
    request = _device(device, x).request
    assert up(edge.climb(0, request=request, next_down=hook("down")), send) == "down"
    assert (len(asked), sent, cache.stats().entries) == (1, [], 0)  # nothing ran
    assert up(edge.climb(0, request=request, next_down=hook(None)), send) == "sent"
    assert len(asked) == 2 and len(sent) == 1 and sent[0].request.segment == 2
    assert sent[0].codec_s > 0.0  # the request's decoding is counted with the encoding
    # The cloud's answer, stored as it comes down: the same request is a hit, no hook asked.
    y = np.full((1, WIDTHS[3]), 3.0, np.float32)
    edge.came_down(0, sent[0], tier_pb2.Reply(answered_by="cloud"), outputs={"y": y})
    hit = up(edge.climb(0, request=request, next_down=hook("down")), send)
    assert isinstance(hit, Answered) and hit.cache_hit and len(asked) == 2 and len(sent) == 1
    assert hit.outputs["y"].tobytes() == y.tobytes()
    edge.close()


def test_a_request_past_its_deadline_is_refused_before_it_is_decoded(tmp_path: Path) -> None:
    plan = _plan_dir(tmp_path, {"device-edge": "raw", "edge-cloud": "raw"})
    tiers = _pipelines(tmp_path, plan)
    request = _device(tiers["device"], np.ones((1, WIDTHS[0]), np.float32)).request
    request.deadline_unix_s = 1.0  # long past
    del request.tensors[:]  # never looked at
    with pytest.raises(DeadlineError, match="deadline passed before the edge ran it"):
        up(tiers["edge"].climb(0, request=request), _kept)


def test_an_edge_that_runs_nothing_forwards_the_tensors_as_they_came(tmp_path: Path) -> None:
    plan = _plan_dir(tmp_path, {"device-edge": "int8+zstd"}, edge_runs=False)
    assert plan.edge_forwards
    tiers = _pipelines(tmp_path, plan)
    x = np.random.default_rng(2).standard_normal((2, WIDTHS[0])).astype(np.float32)
    up = _device(tiers["device"], x)
    edge = tiers["edge"]
    runner = edge.runner(0)
    features, _ = edge.decode(0, runner, up.request.segment, up.request.tensors)
    assert features == {}  # checked, never decoded: nothing runs here and no cache needs them
    onward = drive(edge.run(0, runner, features, segment=1, as_received=up.request.tensors))
    assert isinstance(onward, Onward) and onward.request.segment == 1
    assert list(onward.request.tensors) == list(up.request.tensors)  # not re-encoded
    answered = _up(tiers["cloud"], onward)
    assert isinstance(answered, Answered)
    # int8 applied once, on the device: the cloud's answer is the model's on decoded h1.
    assert plan.link_codec("edge-cloud") == CodecSpec.parse("int8+zstd")
    assert answered.outputs["y"].shape == (2, WIDTHS[3])


def _tensors(**arrays: np.ndarray) -> list[tier_pb2.Tensor]:
    request = tier_pb2.Request()
    put_tensors(request.tensors, arrays, CodecSpec.parse("raw"))
    return list(request.tensors)


def test_a_request_is_checked_before_anything_is_decoded(tmp_path: Path) -> None:
    plan = _plan_dir(tmp_path, {"device-edge": "raw", "edge-cloud": "raw"})
    edge = _pipelines(tmp_path, plan)["edge"]
    runner = edge.runner(0)
    good = np.zeros((1, WIDTHS[1]), np.float32)
    with pytest.raises(InputError, match=r"expects 1 tensors \['h1'\], the request carries 2"):
        edge.decode(0, runner, 1, _tensors(h1=good, h9=good))
    with pytest.raises(InputError, match="names segment 2"):
        edge.decode(0, runner, 2, _tensors(h1=good))
    with pytest.raises(InputError, match="h9"):
        edge.decode(0, runner, 1, _tensors(h9=good))
    with pytest.raises(InputError, match=r"expected float32\[\?x12\], found float32\[1x5\]"):
        edge.decode(0, runner, 1, _tensors(h1=np.zeros((1, 5), np.float32)))
    with pytest.raises(InputError, match=r"found float64\[1x12\]"):
        edge.decode(0, runner, 1, _tensors(h1=np.zeros((1, WIDTHS[1]))))
    features, _ = edge.decode(0, runner, 1, _tensors(h1=good))
    assert features["h1"].tobytes() == good.tobytes()


def test_a_plan_the_tier_does_not_serve_is_a_plan_error(tmp_path: Path) -> None:
    plan = _plan_dir(tmp_path, {"device-edge": "raw"})
    edge = _pipelines(tmp_path, plan)["edge"]
    assert edge.index_of(plan.plan_id) == 0
    with pytest.raises(PlanError, match=f"serves plans {plan.plan_id}, the request names plan x"):
        edge.index_of("x")
    with pytest.raises(PlanError, match=r"names plan \(none\)"):
        edge.index_of("")


@pytest.mark.parametrize(
    ("codec", "reply"),
    [("raw", "raw"), ("int8+zstd", "zstd"), ("fp16", "raw"), ("shuffle+zstd", "shuffle+zstd")],
)
def test_answers_go_down_with_the_lossless_part_of_the_links_codec(
    tmp_path: Path, codec: str, reply: str
) -> None:
    plan = _plan_dir(tmp_path, {"device-edge": codec, "edge-cloud": codec})
    assert reply_codec(plan, "edge-cloud") == CodecSpec.parse(reply)
    assert reply_codec(plan, None) == CodecSpec.parse("raw")


def _decoder() -> DecoderSpec:
    return DecoderSpec("tokens", "logits", "attention_mask", "position_ids", 32, 64, 16)


def test_a_decoder_step_whose_companions_fit_its_position_passes() -> None:
    decoder = _decoder()
    for position, tokens in ((0, [1, 2, 3]), (3, [4]), (4, [5, 6])):
        check_decoder_step(decoder, decoder.step_feeds(tokens, position), position)
    # A tier that reads the companions without the tokens takes the length from the ids.
    feeds = decoder.step_feeds([7, 8], 5)
    del feeds["tokens"]
    check_decoder_step(decoder, feeds, 5)


@pytest.mark.parametrize(
    "change",
    [
        {"attention_mask": np.ones((1, 7), np.int64)},  # for position 6, not 5
        {"attention_mask": np.ones((1, 3), np.int64)},
        {"position_ids": np.array([[3]], np.int64)},
        {"position_ids": np.array([[5, 6]], np.int64)},  # two ids for one token
    ],
)
def test_a_decoder_step_whose_companions_disagree_with_its_position_is_invalid_input(
    change: dict[str, np.ndarray],
) -> None:
    """Issue 28 finding 8: such a step failed inside ONNX Runtime and was answered INTERNAL."""
    decoder = _decoder()
    feeds = {**decoder.step_feeds([9], 5), **change}
    with pytest.raises(StateError, match="position"):
        check_decoder_step(decoder, feeds, 5)


STATES = (
    StateSpec("state", "stateN", "float32", (None, 8)),
    StateSpec("past", "present", "float32", (1, 2, None, 4), grows=2),
)


def test_a_first_state_value_must_fit_its_state_exactly() -> None:
    check_initial_state(STATES, [("state", "float32", (1, 8))], "session 's'")
    check_initial_state(STATES, [], "session 's'")
    wrong = [
        ([("state", "float64", (1, 8))], "float32\\[1x8\\], found float64"),  # never cast
        ([("state", "float32", (2, 8))], "found float32\\[2x8\\]"),
        ([("state", "float32", (8,))], "found float32\\[8\\]"),
        ([("elsewhere", "float32", (1, 8))], "no state of the plan"),  # no tier owns it
        ([("past", "float32", (1, 2, 0, 4))], "starts empty"),
        ([("state", "float32", (1, 8))] * 2, "twice"),
    ]
    for given, message in wrong:
        with pytest.raises(StateError, match=message):
            check_initial_state(STATES, given, "session 's'")


@pytest.mark.parametrize(
    ("got", "gone"),
    [
        (TransportError("the cloud went away"), True),
        (DeadlineError("no reply within the deadline"), False),  # late is not gone
        (RemoteError("refused", code="OVERLOADED", tier="cloud"), False),
        (tier_pb2.Reply(error=tier_pb2.Error(code="UNAVAILABLE", message="stopping")), True),
        (tier_pb2.Reply(error=tier_pb2.Error(code="UPSTREAM_UNAVAILABLE", message="x")), True),
        (tier_pb2.Reply(error=tier_pb2.Error(code="INVALID_INPUT", message="bad")), False),
        (tier_pb2.Reply(answered_by="cloud"), False),
    ],
)
def test_the_next_tier_is_gone_when_it_cannot_be_reached_or_says_a_tier_is(
    got: tier_pb2.Reply | BaseException, gone: bool
) -> None:
    assert (next_tier_gone(got) is not None) == gone


def _edge_onward(tmp_path: Path, cache: MemoryCache) -> tuple[Pipeline, Onward]:
    """An edge with a cache, and a request it sends on to the cloud, with the scores of an
    exit it found not confident enough."""
    plan = _plan_dir(tmp_path, {"device-edge": "raw", "edge-cloud": "raw"})
    edge = Pipeline("edge", PlanSet((plan,)), tmp_path, RuntimeOptions(), cache=cache)
    up = _device(_pipelines(tmp_path, plan)["device"], np.ones((1, WIDTHS[0]), np.float32))
    runner = edge.runner(0)
    features, _ = edge.decode(0, runner, up.request.segment, up.request.tensors)
    _, key = edge.cached(0, up.request.segment, features)
    onward = drive(edge.run(0, runner, features, segment=1, key=key))
    assert isinstance(onward, Onward) and onward.key is not None
    onward.unconfident = ("exit_edge", np.array([[0.4, 0.6]], np.float32))
    return edge, onward


def test_without_the_next_tier_the_exit_answers_and_is_never_cached(tmp_path: Path) -> None:
    cache = MemoryCache(1 << 20)
    edge, onward = _edge_onward(tmp_path, cache)
    down = edge.came_down(0, onward, TransportError("the stream broke"))
    assert down.reply is None and down.failure is None and down.gone is not None
    assert down.answered is not None and down.answered.exit == "exit_edge"
    assert down.answered.fallback == (
        "the cloud is unavailable (the stream broke); answered at the edge's exit"
    )
    reply = edge.answer(0, down.answered)
    assert reply.fallback == down.answered.fallback and reply.answered_by == "edge"
    # The fallback reply, passed down, is not kept; nor an error; the cloud's answer is.
    edge.fill(onward, reply, {"exit_edge": np.zeros((1, 2), np.float32)})
    error = tier_pb2.Reply(error=tier_pb2.Error(code="INVALID_INPUT", message="bad"))
    assert edge.came_down(0, onward, error).reply is error
    assert cache.stats().entries == 0
    late = edge.came_down(0, onward, DeadlineError("late"))
    assert late.gone is None and isinstance(late.failure, DeadlineError)
    answer = tier_pb2.Reply(answered_by="cloud")
    y = np.full((1, WIDTHS[3]), 7.0, np.float32)
    assert edge.came_down(0, onward, answer, outputs={"y": y}).reply is answer
    hit = edge.lookup(onward.key or b"", onward.features)
    assert hit is not None and hit.outputs["y"].tobytes() == y.tobytes()
    edge.close()


def test_without_an_exit_nothing_is_answered_here(tmp_path: Path) -> None:
    edge, onward = _edge_onward(tmp_path, MemoryCache(1 << 20))
    onward.unconfident = None
    gone = RemoteError("edge: UPSTREAM_UNAVAILABLE: the cloud is gone", code="UPSTREAM_UNAVAILABLE")
    down = edge.came_down(0, onward, gone)
    assert down.gone is gone and down.answered is None
    assert edge.unavailable(gone) == str(gone)  # it names the missing tier already
    edge.close()
