"""Streaming a stateful model across tiers: the state stays on its tier, answers equal a local
loop bit for bit, a lost state is replayed, and sessions stay in order and apart.

The tiers are called in process ([Note: the next tier in process] in
tierflow/runtime/upstream.py); one session goes over gRPC servers, and the commands, the
app API and replicas need them.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tierflow.cli.main import main
from tierflow.device.client import DeviceClient
from tierflow.device.sessions import StreamSession
from tierflow.edge.forwarding import Forwarding
from tierflow.errors import RemoteError, StateLostError
from tierflow.onnxrt.inference import open_session
from tierflow.options import RuntimeOptions
from tierflow.partitioner.graph import load_model
from tierflow.partitioner.split import save_split_plan, split_model
from tierflow.plan import load_plan
from tierflow.runtime.server import TierServer
from tierflow.runtime.tier import Tier
from tierflow.runtime.upstream import LocalUpstream
from tierflow.state.store import SESSION_OVERHEAD
from tierflow.zoo.tiny_stateful import streaming_model

CHUNKS = 30


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return streaming_model(tmp_path_factory.mktemp("stream") / "stream.onnx")


def plan_at(model: Path, plan_dir: Path, owner: str) -> Path:
    """The streaming model split so that ``owner`` runs the stateful part."""
    graph = load_model(model)
    last = len(graph.cuts) - 1
    cuts = {"device": (last, last), "edge": (0, last), "cloud": (0, 0)}[owner]
    segments = split_model(graph, cuts)
    save_split_plan(graph, segments, plan_dir, cuts=cuts)
    plan = load_plan(plan_dir)
    assert [s.tier for s in plan.segments if s.state] == [owner]
    return plan_dir


def chunks_and_state(seed: int = 0) -> tuple[list[dict[str, np.ndarray]], np.ndarray]:
    rng = np.random.default_rng(seed)
    chunks = [{"audio": rng.standard_normal((1, 6)).astype(np.float32)} for _ in range(CHUNKS)]
    return chunks, rng.standard_normal((1, 8)).astype(np.float32)


def local_loop(model: Path, chunks: list[dict[str, np.ndarray]], state: np.ndarray) -> list[Any]:
    """Each state output fed back by hand: what a session must answer."""
    session = open_session(model, threads=1, optimization="extended")
    outputs = []
    for chunk in chunks:
        out, state = session.run(["out", "stateN"], {"audio": chunk["audio"], "state": state})
        outputs.append(out)
    return outputs


@dataclass
class Tiers:
    """A plan's edge and cloud services (in process, or behind servers at ``address``)."""

    plan_dir: Path
    cloud: Tier
    edge: Tier
    address: str | None = None  # the edge server's, when the tiers are servers

    def client(self, **settings: Any) -> DeviceClient:
        if self.address is not None:
            return DeviceClient(self.plan_dir, self.address, **settings)
        upstream = LocalUpstream(self.edge, me="device")
        return DeviceClient(self.plan_dir, upstream=upstream, **settings)


@pytest.fixture()
def tiers(request: Any, model: Path, tmp_path: Path, rt: Any) -> Iterator[Tiers]:
    """``request.param``: (owner of the state, state budget[, "grpc" for servers])."""
    owner, budget, *how = request.param
    plan_dir = plan_at(model, tmp_path / "plan", owner)
    options = RuntimeOptions(workers=3, state_budget=budget)
    if how == ["grpc"]:
        cloud = TierServer.from_plan("cloud", plan_dir, options=options)
        cloud.start()
        edge = TierServer.from_plan(
            "edge", plan_dir, forwarder=Forwarding(cloud.address), options=options
        )
        edge.start()
        try:
            yield Tiers(plan_dir, cloud.tier, edge.tier, edge.address)
        finally:
            edge.stop(0)
            cloud.stop(0)
        return
    with rt.in_process(plan_dir, workers=3, state_budget=budget) as inp:
        yield Tiers(plan_dir, inp.cloud, inp.edge)


def owner_of(cloud: Tier, edge: Tier) -> Any:
    """The pipeline of the tier that keeps the plan's state."""
    (owner,) = [s.tier for s in cloud.plan.segments if s.state]
    tier = cloud if owner == "cloud" else edge
    assert tier.pipeline is not None
    return tier.pipeline


def drop_when_caught_up(states: Any, session: str, sent: int) -> None:
    """Drop ``session``'s state once the tier has committed all ``sent`` steps: a drop
    while a step runs would be undone by that step's commit."""
    deadline = time.monotonic() + 10
    while states.position(session) != sent:
        assert time.monotonic() < deadline, f"the tier holds step {states.position(session)}"
        time.sleep(0.005)
    states.drop(session)


@pytest.mark.parametrize(
    "tiers",
    [
        ("edge", None),
        ("cloud", None),
        pytest.param(("cloud", None, "grpc"), marks=pytest.mark.integration, id="grpc"),
    ],
    indirect=True,
)
def test_a_session_answers_as_a_local_loop_and_keeps_its_state_off_the_links(
    model: Path, tiers: Tiers
) -> None:
    chunks, state = chunks_and_state()
    expected = local_loop(model, chunks, state)
    with tiers.client(window=8) as client:
        results = list(StreamSession(client, "mic-1", initial={"state": state}).run(chunks))
    for result, want in zip(results, expected, strict=True):
        np.testing.assert_array_equal(result.unwrap().outputs["out"], want)
    # Only the chunk itself crosses: 6 floats, not the 8-float state (the first request
    # also carries the initial state, once).
    assert results[1].bytes["device-edge"] < 6 * 4 + 64
    assert owner_of(tiers.cloud, tiers.edge).states.position("mic-1") == CHUNKS


@pytest.mark.parametrize("tiers", [("cloud", None)], indirect=True)
def test_a_lost_state_is_replayed_and_the_answers_do_not_change(model: Path, tiers: Tiers) -> None:
    chunks, state = chunks_and_state(1)
    expected = local_loop(model, chunks, state)
    states = owner_of(tiers.cloud, tiers.edge).states
    with tiers.client(window=4) as client:
        session = StreamSession(client, "mic-2", initial={"state": state})
        results = []
        for i, result in enumerate(session.run(chunks)):
            results.append(result)
            if i in (7, 19):
                drop_when_caught_up(states, "mic-2", session.position)
    assert session.replays == 2
    for result, want in zip(results, expected, strict=True):
        np.testing.assert_array_equal(result.unwrap().outputs["out"], want)


@pytest.mark.parametrize("tiers", [("edge", None)], indirect=True)
def test_a_loss_older_than_the_chunks_kept_fails_instead_of_answering_wrong(
    tiers: Tiers,
) -> None:
    chunks, state = chunks_and_state(2)
    with tiers.client(window=1) as client:
        session = StreamSession(client, "mic-3", initial={"state": state}, keep=5)
        results = []
        for i, result in enumerate(session.run(chunks)):
            results.append(result)
            if i == 12:
                owner_of(tiers.cloud, tiers.edge).states.drop("mic-3")
    assert all(r.ok for r in results[:13])
    assert all(isinstance(r.error, StateLostError) for r in results[13:])
    assert "keeps only the last 5 chunks" in str(results[13].error)


@pytest.mark.parametrize("tiers", [("cloud", None)], indirect=True)
def test_sessions_side_by_side_stay_apart_and_in_order(model: Path, tiers: Tiers) -> None:
    """Three devices stream at once through one edge, each request of a session in order."""
    outcomes: dict[int, list[Any]] = {}

    def stream(number: int) -> None:
        chunks, state = chunks_and_state(10 + number)
        with tiers.client(window=6) as client:
            session = StreamSession(client, f"s{number}", initial={"state": state})
            outcomes[number] = [list(session.run(chunks)), local_loop(model, chunks, state)]

    threads = [threading.Thread(target=stream, args=(n,)) for n in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert sorted(outcomes) == [0, 1, 2]
    for results, expected in outcomes.values():
        for result, want in zip(results, expected, strict=True):
            np.testing.assert_array_equal(result.unwrap().outputs["out"], want)


# Two sessions' 8-float states, with their ids, owner's name and overhead (of at most
# 100 bytes of names: the cloud's owner is the device's address within the edge's).
TWO_SESSIONS = int(2.5 * (8 * 4 + SESSION_OVERHEAD + 100))


@pytest.mark.parametrize("tiers", [("cloud", TWO_SESSIONS)], indirect=True)
def test_the_state_budget_evicts_the_least_recent_session_which_is_replayed(
    model: Path, tiers: Tiers
) -> None:
    """The cloud keeps two sessions' states: a third evicts the oldest, which its device
    rebuilds when it goes on."""
    states = owner_of(tiers.cloud, tiers.edge).states
    with tiers.client(window=4) as client:
        made = {n: chunks_and_state(20 + n) for n in range(3)}
        sessions = {
            n: StreamSession(client, f"b{n}", initial={"state": made[n][1]}) for n in range(3)
        }
        results: dict[int, list[Any]] = {n: [] for n in range(3)}
        for n in range(3):  # the first halves, one session after the other
            results[n] += sessions[n].run(made[n][0][: CHUNKS // 2])
        assert states.position("b0") is None and states.position("b2") == CHUNKS // 2
        results[0] += sessions[0].run(made[0][0][CHUNKS // 2 :])  # b0 goes on: replayed
    assert sessions[0].replays == 1 and states.nbytes <= TWO_SESSIONS and len(states) == 2
    expected = local_loop(model, *made[0])
    for result, want in zip(results[0], expected, strict=True):
        np.testing.assert_array_equal(result.unwrap().outputs["out"], want)


@pytest.mark.parametrize("tiers", [("edge", None)], indirect=True)
def test_a_stateful_plan_needs_a_session(tiers: Tiers) -> None:
    chunks, _ = chunks_and_state()
    with tiers.client() as client:
        result = client.submit(chunks[0]).result()
    assert isinstance(result.error, RemoteError) and result.error.code == "INVALID_INPUT"
    assert "must name its session" in str(result.error)


@pytest.mark.integration
@pytest.mark.parametrize("tiers", [("cloud", None, "grpc")], indirect=True)
def test_run_session_streams_in_npz_rows_as_one_session(
    model: Path, tiers: Tiers, tmp_path: Path, capsys: Any
) -> None:
    plan_dir, address = tiers.plan_dir, tiers.address
    assert address is not None
    chunks, state = chunks_and_state(4)
    expected = local_loop(model, chunks, state)
    audio = np.stack([c["audio"][0] for c in chunks])  # rows lack the batch dimension
    states = np.stack([state[0]] * CHUNKS)  # only the first row is used
    np.savez(tmp_path / "in.npz", audio=audio, state=states)
    code = main(["run", "--plan", str(plan_dir), "--edge", address, "--input",
                 str(tmp_path / "in.npz"), "--output", str(tmp_path / "out.npz"),
                 "--session", "mic-9", "--window", "5"])  # fmt: skip
    assert code == 0, capsys.readouterr().err
    with np.load(tmp_path / "out.npz") as out:
        np.testing.assert_array_equal(out["out"], np.stack([e[0] for e in expected]))


@pytest.mark.parametrize("tiers", [("edge", None)], indirect=True)
def test_the_app_api_streams_a_session(model: Path, tiers: Tiers) -> None:
    from tierflow.device.app import Device

    chunks, _ = chunks_and_state(6)
    zeros = np.zeros((1, 8), np.float32)  # no state given: the tier starts from zeros
    expected = local_loop(model, chunks, zeros)
    with Device(tiers.client(window=4)) as device:
        first = list(device.stream(chunks[:10], session="app"))
        rest = list(device.stream(chunks[10:], session="app"))  # goes on where it ended
    for result, want in zip(first + rest, expected, strict=True):
        np.testing.assert_array_equal(result.unwrap().outputs["out"], want)


@pytest.mark.integration
@pytest.mark.parametrize("tiers", [("edge", None, "grpc")], indirect=True)
def test_the_device_command_streams_a_session_from_a_pipe(
    model: Path, tiers: Tiers, tmp_path: Path
) -> None:
    """Chunks as .npy arrays through a pipe into `tierflow device --session`."""
    plan_dir, address = tiers.plan_dir, tiers.address
    assert address is not None
    chunks, _ = chunks_and_state(6)
    expected = local_loop(model, chunks, np.zeros((1, 8), np.float32))
    stream = b"".join(_npy(chunk["audio"]) for chunk in chunks)
    results = tmp_path / "r.jsonl"
    done = subprocess.run(
        [sys.executable, "-m", "tierflow.cli", "device", "--plan", str(plan_dir), "--edge",
         address, "--source", "-", "--session", "cmd", "--results", str(results)],
        input=stream, capture_output=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr.decode()
    lines = [json.loads(line) for line in results.read_text().splitlines()]
    assert len(lines) == CHUNKS
    for line, want in zip(lines, expected, strict=True):
        assert np.asarray(line["outputs"]["out"], np.float32).tobytes() == want.tobytes()


def _npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def test_the_published_vad_whose_graph_sits_in_one_if_plans_and_streams_exactly(
    tmp_path: Path, capsys: Any, rt: Any
) -> None:
    """Silero VAD's silero_vad.onnx (issue 20, item 1): the whole network inside one If on
    the sample rate, an LSTM state carried from chunk to chunk. It plans, serves, and a
    session's answers equal the model run with its state fed back, bit for bit."""
    from tierflow.zoo.real_stateful import chunks, vad_path

    model = vad_path("if")
    arrays = chunks(12)
    np.savez(tmp_path / "vad.npz", **arrays)
    code = main(["plan", str(model), "-o", str(tmp_path / "plan"), "--sample",
                 str(tmp_path / "vad.npz"), "--memory", "device=1MiB"])  # fmt: skip
    assert code == 0, capsys.readouterr().err
    plan = load_plan(tmp_path / "plan")
    assert plan.state_pairs == (("state", "stateN"),)
    session = open_session(model)
    state, expected = arrays["state"][0], []
    for i in range(12):
        feeds = {"input": arrays["input"][i], "state": state, "sr": np.array(arrays["sr"][i])}
        out, state = session.run(["output", "stateN"], feeds)
        expected.append(out)
    requests = [{k: np.asarray(arrays[k][i]) for k in ("input", "sr")} for i in range(12)]
    initial = {"state": arrays["state"][0]}
    with rt.device(tmp_path / "plan", window=4) as client:
        results = list(StreamSession(client, "vad", initial=initial).run(requests))
    for result, want in zip(results, expected, strict=True):
        np.testing.assert_array_equal(result.unwrap().outputs["output"], want)


@pytest.mark.integration
def test_a_session_stays_on_one_replica_of_an_upstream_list(model: Path, tmp_path: Path) -> None:
    plan_dir = plan_at(model, tmp_path / "plan", "cloud")
    options = RuntimeOptions(workers=2)
    replicas = [TierServer.from_plan("cloud", plan_dir, options=options) for _ in range(2)]
    for replica in replicas:
        replica.start()
    targets = ",".join(r.address for r in replicas)
    edge = TierServer.from_plan(
        "edge", plan_dir, forwarder=Forwarding(f"ipv4:{targets}"), options=options
    )
    edge.start()
    try:
        outcomes = {}
        for name in ("a", "b", "c", "d"):
            chunks, state = chunks_and_state(ord(name))
            with DeviceClient(plan_dir, edge.address, window=4) as client:
                session = StreamSession(client, name, initial={"state": state})
                outcomes[name] = (list(session.run(chunks)), local_loop(model, chunks, state))
        for name, (results, expected) in outcomes.items():
            for result, want in zip(results, expected, strict=True):
                np.testing.assert_array_equal(result.unwrap().outputs["out"], want)
            holders = [r for r in replicas if owner_of(r.tier, edge.tier).states.position(name)]
            assert len(holders) == 1, name  # every request of the session on one replica
    finally:
        edge.stop(0)
        for replica in replicas:
            replica.stop(0)
