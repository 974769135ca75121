"""Many callers on one edge and one cloud (issue 28): a session belongs to its caller, and
one caller's flood of sessions does not cost another its state.

Who a caller is comes from the transport ([Note: who a caller is] in
tierflow/transport/callers.py); what a tier does with it is checked with the tiers in
process, each caller named as its stream would name it ([Note: the next tier in process]
in tierflow/runtime/upstream.py). Tokens, certificates and connections naming callers,
a flood racing a stream on threads, and the command's start-up line need gRPC servers.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tierflow.device.client import DeviceClient
from tierflow.device.sessions import StreamSession
from tierflow.edge.forwarding import Forwarding
from tierflow.errors import RemoteError
from tierflow.options import RuntimeOptions
from tierflow.plan import load_plan_set
from tierflow.runtime.server import TierServer
from tierflow.runtime.tier import Tier
from tierflow.runtime.upstream import LocalUpstream
from tierflow.transport.security import Security
from tierflow.zoo.tiny_stateful import streaming_model

from .test_sessions import chunks_and_state, local_loop, plan_at

GRPC = pytest.mark.integration


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return streaming_model(tmp_path_factory.mktemp("stream") / "stream.onnx")


def write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


class Tiers:
    """A cloud and any number of edges in front of it, each with its own settings."""

    def __init__(self) -> None:
        self.servers: list[Any] = []

    def cloud(self, plan_dir: Path, **settings: Any) -> TierServer:
        cloud = TierServer.from_plan(
            "cloud", plan_dir, options=RuntimeOptions(workers=2, **settings)
        )
        self.servers.append(cloud)
        cloud.start()
        return cloud

    def edge(self, plan_dir: Path, cloud: TierServer, **settings: Any) -> TierServer:
        options = RuntimeOptions(workers=2, **settings)
        edge = TierServer.from_plan(
            "edge", plan_dir, forwarder=Forwarding(cloud.address), options=options
        )
        self.servers.append(edge)
        edge.start()
        return edge


class LocalTiers:
    """A cloud and any number of edges in front of it, in this process: each edge and
    device named as the caller its stream's transport would name ([Note: who a caller
    is])."""

    def __init__(self, plan_dir: Path, **settings: Any) -> None:
        self.plan_dir = plan_dir
        self.plans = load_plan_set(plan_dir, require_segments=False)
        self.options = RuntimeOptions(workers=2, **settings)
        self.cloud = self._load(Tier("cloud", self.plans, plan_dir, options=self.options))
        self.tiers = [self.cloud]
        self.clients: list[DeviceClient] = []

    def _load(self, tier: Tier) -> Tier:
        tier.load()
        return tier

    def edge(self, caller: str) -> Tier:
        """An edge the cloud takes for ``caller``."""
        forwarding = Forwarding(upstream=LocalUpstream(self.cloud, me="edge", caller=caller))
        edge = Tier("edge", self.plans, self.plan_dir, forwarder=forwarding, options=self.options)
        self.tiers.append(self._load(edge))
        return edge

    def device(self, edge: Tier, caller: str) -> DeviceClient:
        """A device ``edge`` takes for ``caller``."""
        upstream = LocalUpstream(edge, me="device", caller=caller)
        client = DeviceClient(self.plan_dir, upstream=upstream, window=4)
        self.clients.append(client)
        return client

    def close(self) -> None:
        for client in self.clients:
            client.close()
        for tier in reversed(self.tiers):
            tier.close(0.5)


@contextlib.contextmanager
def local_tiers(plan_dir: Path, **settings: Any) -> Iterator[LocalTiers]:
    made = LocalTiers(plan_dir, **settings)
    try:
        yield made
    finally:
        made.close()


@pytest.fixture()
def tiers() -> Iterator[Tiers]:
    made = Tiers()
    try:
        yield made
    finally:
        for server in reversed(made.servers):
            server.stop(0)


def client(plan_dir: Path, edge: TierServer, security: Security) -> DeviceClient:
    return DeviceClient(plan_dir, edge.address, options=RuntimeOptions(security=security), window=4)


def attack(model: Path, plan_dir: Path, alice: DeviceClient, mallory: DeviceClient) -> None:
    """Issue 28, finding 1: Mallory names Alice's session. Reading it finds what a session
    that never existed finds, word for word; resetting and overwriting it make Mallory's
    own; Alice's answers stay the local loop's, with no replay."""
    chunks, state = chunks_and_state(0)
    expected = local_loop(model, chunks, state)
    session = StreamSession(alice, "mic-1", initial={"state": state})
    results = list(session.run(chunks[:10]))
    read = mallory.submit(chunks[10], session="mic-1", position=10).result()
    never = mallory.submit(chunks[10], session="never", position=10).result()
    for lost in (read, never):
        assert isinstance(lost.error, RemoteError) and lost.error.code == "STATE_LOST"
    assert str(read.error).replace("'mic-1'", "'never'") == str(never.error)
    assert "10" not in str(read.error) and "step" not in str(read.error)
    # Reset and overwrite: Mallory's own session of that name, from its own start.
    other, other_state = chunks_and_state(1)
    rogue = StreamSession(mallory, "mic-1", initial={"state": other_state})
    mine = list(rogue.run(other[:12]))
    for result, want in zip(mine, local_loop(model, other[:12], other_state), strict=True):
        np.testing.assert_array_equal(result.unwrap().outputs["out"], want)
    results += session.run(chunks[10:])
    assert session.replays == 0 and rogue.replays == 0
    for result, want in zip(results, expected, strict=True):
        np.testing.assert_array_equal(result.unwrap().outputs["out"], want)


def held_owners(tier: Tier, session: str) -> set[str]:
    assert tier.pipeline is not None
    return {o for o, s in tier.pipeline.states.held() if s == session}


def namespaces(owner: str) -> set[str]:
    """Who holds session "mic-1" at ``owner`` after alice and mallory behind edge 1, then
    alice behind edge 2: each in a namespace of its own (at the cloud, inside its edge's)."""
    if owner == "cloud":
        return {
            '["token:alice", "token:edge-1"]',
            '["token:mallory", "token:edge-1"]',
            '["token:alice", "token:edge-2"]',
        }
    return {"token:alice", "token:mallory"}


@pytest.mark.parametrize("owner", ["edge", "cloud"])
def test_two_callers_through_two_edges_never_share_a_session(
    model: Path, tmp_path: Path, owner: str
) -> None:
    """Two devices behind one edge, and the same device name behind two edges: four
    namespaces, whichever tier keeps the state."""
    plan_dir = plan_at(model, tmp_path / "plan", owner)
    with local_tiers(plan_dir) as tiers:
        edges = [tiers.edge("token:edge-1"), tiers.edge("token:edge-2")]
        attack(
            model,
            plan_dir,
            tiers.device(edges[0], "token:alice"),
            tiers.device(edges[0], "token:mallory"),
        )
        # Alice again, behind the other edge: the same name, another edge's namespace.
        attack(
            model,
            plan_dir,
            tiers.device(edges[0], "token:alice"),
            tiers.device(edges[1], "token:alice"),
        )
        owners = held_owners(tiers.cloud if owner == "cloud" else edges[0], "mic-1")
    assert owners == namespaces(owner)


@GRPC
@pytest.mark.parametrize("owner", ["cloud"])
def test_two_tokens_through_two_edges_never_share_a_session(
    model: Path, tmp_path: Path, tiers: Tiers, owner: str
) -> None:
    """Devices with their own named tokens behind one edge, and the same client name
    behind two edges (each vouched for by its edge, with its own token at the cloud)."""
    plan_dir = plan_at(model, tmp_path / "plan", owner)
    cloud_tokens = write(tmp_path / "cloud", "edge-1 e1-secret\nedge-2 e2-secret\n")
    cloud = tiers.cloud(plan_dir, security=Security(token_file=cloud_tokens))
    clients = write(tmp_path / "clients", "# devices\nalice a-secret\nmallory m-secret\n")
    edges = [
        tiers.edge(
            plan_dir,
            cloud,
            security=Security(
                token_file=clients,
                upstream_token_file=write(tmp_path / f"up{n}", f"e{n}-secret\n"),
            ),
        )
        for n in (1, 2)
    ]
    alice = Security(token_file=write(tmp_path / "alice", "a-secret\n"))
    mallory = Security(token_file=write(tmp_path / "mallory", "mallory m-secret\n"))
    with client(plan_dir, edges[0], alice) as a, client(plan_dir, edges[0], mallory) as m:
        attack(model, plan_dir, a, m)
    # Alice again, behind the other edge: the same name, another edge's namespace.
    with client(plan_dir, edges[0], alice) as a, client(plan_dir, edges[1], alice) as other:
        attack(model, plan_dir, a, other)
    held = cloud if owner == "cloud" else edges[0]
    assert held_owners(held.tier, "mic-1") == namespaces(owner)


@GRPC
def test_two_client_certificates_never_share_a_session(
    model: Path, tmp_path: Path, tiers: Tiers, tls_files: dict[str, Path]
) -> None:
    plan_dir = plan_at(model, tmp_path / "plan", "cloud")
    server = Security(
        tls_cert=str(tls_files["server_cert"]),
        tls_key=str(tls_files["server_key"]),
        tls_ca=str(tls_files["ca"]),
    )
    cloud = tiers.cloud(plan_dir, security=server)
    edge = tiers.edge(plan_dir, cloud, security=server)

    def certificate(who: str) -> Security:
        return Security(
            tls_cert=str(tls_files[f"{who}_cert"]),
            tls_key=str(tls_files[f"{who}_key"]),
            tls_ca=str(tls_files["ca"]),
        )

    alice, mallory = certificate("client"), certificate("client2")
    with client(plan_dir, edge, alice) as a, client(plan_dir, edge, mallory) as m:
        attack(model, plan_dir, a, m)
    held = cloud.tier.pipeline.states  # type: ignore[union-attr]
    assert {o for o, s in held.held() if s == "mic-1"} == {
        '["cert:CN=client", "cert:CN=server"]',
        '["cert:CN=client2", "cert:CN=server"]',
    }


@GRPC
def test_two_devices_on_loopback_are_two_callers(model: Path, tmp_path: Path, tiers: Tiers) -> None:
    """Plaintext on loopback: each connection is its own caller."""
    plan_dir = plan_at(model, tmp_path / "plan", "cloud")
    cloud = tiers.cloud(plan_dir)
    edge = tiers.edge(plan_dir, cloud)
    with client(plan_dir, edge, Security()) as a, client(plan_dir, edge, Security()) as m:
        attack(model, plan_dir, a, m)


def test_a_flood_of_sessions_costs_another_caller_nothing(model: Path, tmp_path: Path) -> None:
    """Issue 28, findings 3 and 4: one device floods the cloud with new sessions while
    another streams; under global LRU the victim's state was evicted again and again and
    its replays failed. Now the flood evicts only its own sessions. More new sessions than
    the budget holds come between each two of the victim's chunks: least recently used
    alone would evict the victim's state every time."""
    plan_dir = plan_at(model, tmp_path / "plan", "cloud")
    budget = 16 * (8 * 4 + 600)  # about sixteen sessions of the model's 8-float state
    chunks, state = chunks_and_state(3)
    expected = local_loop(model, chunks, state)
    flooded = [0]
    with local_tiers(plan_dir, state_budget=budget) as tiers:
        edge = tiers.edge("token:edge")
        flooder = tiers.device(edge, "peer:flooder")
        victim = tiers.device(edge, "peer:victim")

        def flooding() -> Iterator[dict[str, np.ndarray]]:
            for chunk in chunks:
                tickets = [
                    flooder.submit(chunks[0], session=f"flood-{flooded[0] + i}") for i in range(20)
                ]
                flooded[0] += len(tickets)
                assert all(ticket.result().ok for ticket in tickets)
                yield chunk

        session = StreamSession(victim, "victim", initial={"state": state})
        results = list(session.run(flooding()))
        assert tiers.cloud.pipeline is not None
        states = tiers.cloud.pipeline.states
        assert states.evicted > 50 and states.nbytes <= budget
    assert flooded[0] == 20 * len(chunks)  # the flood filled the budget many times over
    assert [r.error for r in results if not r.ok] == [] and session.replays == 0
    for result, want in zip(results, expected, strict=True):
        np.testing.assert_array_equal(result.unwrap().outputs["out"], want)


@GRPC
def test_serve_says_its_state_budget_at_start(model: Path, tmp_path: Path, rt: Any) -> None:
    """Issue 28, finding 3: the default budget was no bound; it is a stated share of the
    machine's memory, printed as the tier starts."""
    plan_dir = plan_at(model, tmp_path / "plan", "cloud")
    with rt.processes() as serve:
        cloud = serve("cloud", plan_dir)
        default = cloud.read_line(30)
        shared = serve("cloud", plan_dir, "--state-budget", "64MiB", "--state-share", "8MiB")
        given = shared.read_line(30)
    assert "session state: at most" in default and "25% of" in default, default
    assert "shared equally among the callers" in default
    assert "at most 64MiB, at most 8MiB for each caller" in given, given


class Crowded:
    """The cloud, with other callers' requests arriving while each request of
    ``victim`` waits there: ``crowd`` runs after the victim's state is held and before
    its request runs, as on a busy tier ([Note: the next tier in process])."""

    def __init__(self, cloud: Tier, victim: str, crowd: Any) -> None:
        self.cloud, self.victim, self.crowd = cloud, victim, crowd
        self.crowded = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.cloud, name)

    @property
    def closed(self) -> bool:
        return self.cloud.closed

    def handle(self, request: Any, received: float, later: Any, caller: str = "local") -> Any:
        if request.session == self.victim:
            self.crowded += 1
            self.crowd()
        return self.cloud.handle(request, received, later, caller)


def test_a_replay_completes_when_every_caller_is_over_its_share(
    model: Path, tmp_path: Path
) -> None:
    """Issue 28, finding 4: a stream's replay went chunk by chunk and its chunks were
    evicted again (45 of 50 failed). Six callers flood a cloud that keeps four sessions,
    so every caller is over its equal share: between two of the victim's chunks the
    flood costs it its state, again and again, and while each of its chunks waits at the
    tier the flood goes on; its state is held while its chunks wait, so each replay
    completes and no chunk fails."""
    plan_dir = plan_at(model, tmp_path / "plan", "cloud")
    budget = 4 * (8 * 4 + 600)
    chunks, state = chunks_and_state(5)
    chunks = chunks[:12]
    expected = local_loop(model, chunks, state)
    sent = [0]
    with local_tiers(plan_dir, state_budget=budget) as tiers:
        edge = tiers.edge("token:edge")
        flooders = [tiers.device(edge, f"peer:flood-{n}") for n in range(6)]

        def flood() -> None:  # a new session of each flooder's: more than the budget holds
            tickets = [
                flooder.submit(chunks[0], session=f"f{number}-{sent[0]}")
                for number, flooder in enumerate(flooders)
            ]
            assert all(ticket.result().ok for ticket in tickets)
            sent[0] += 1

        crowded = Crowded(tiers.cloud, "victim", flood)
        busy = tiers.edge("token:busy-edge")
        assert isinstance(busy.forwarder, Forwarding)
        busy.forwarder.upstream = LocalUpstream(crowded, me="edge", caller="token:busy-edge")

        def flooding() -> Iterator[dict[str, np.ndarray]]:
            for chunk in chunks:
                flood()  # between two chunks: nothing of the victim's is held
                yield chunk

        victim = tiers.device(busy, "peer:victim")
        session = StreamSession(victim, "victim", initial={"state": state})
        results = list(session.run(flooding()))
        assert tiers.cloud.pipeline is not None
        assert tiers.cloud.pipeline.states.nbytes <= budget
    assert session.replays >= 1  # the pressure was real: its state was lost
    assert crowded.crowded > len(chunks)  # replayed chunks waited in the crowd too
    assert [r.error for r in results if not r.ok] == []
    for result, want in zip(results, expected, strict=True):
        np.testing.assert_array_equal(result.unwrap().outputs["out"], want)


@GRPC
def test_a_streams_replay_completes_when_every_caller_is_over_its_share(
    model: Path, tmp_path: Path, tiers: Tiers
) -> None:
    """Issue 28, finding 4: a stream's replay went chunk by chunk and its chunks were
    evicted again (45 of 50 failed). Six callers flood a cloud that keeps four sessions,
    so every caller is over its equal share and the victim's state is lost between its
    chunks (sent at a device's pace) again and again; but its state is held while its
    chunks wait at the tier, so each replay completes: no chunk fails."""
    plan_dir = plan_at(model, tmp_path / "plan", "cloud")
    budget = 4 * (8 * 4 + 600)
    cloud = tiers.cloud(plan_dir, state_budget=budget)
    edge = tiers.edge(plan_dir, cloud)
    chunks, state = chunks_and_state(5)
    chunks = (chunks * 2)[:50]
    expected = local_loop(model, chunks, state)
    stop = threading.Event()

    def flood(number: int) -> None:
        with client(plan_dir, edge, Security()) as flooder:
            sent = 0
            while not stop.is_set():
                tickets = [
                    flooder.submit(chunks[0], session=f"f{number}-{sent + i}") for i in range(4)
                ]
                sent += len(tickets)
                for ticket in tickets:
                    ticket.result()

    def paced() -> Iterator[dict[str, np.ndarray]]:
        for chunk in chunks:
            stop.wait(0.02)  # a device's pace: its session waits at the tier in between
            yield chunk

    threads = [threading.Thread(target=flood, args=(n,)) for n in range(6)]
    for thread in threads:
        thread.start()
    try:
        with client(plan_dir, edge, Security()) as victim:
            session = StreamSession(victim, "victim", initial={"state": state})
            results = list(session.run(paced()))
    finally:
        stop.set()
        for thread in threads:
            thread.join(30)
    assert session.replays >= 1  # the pressure was real: its state was lost
    assert [r.error for r in results if not r.ok] == []
    for result, want in zip(results, expected, strict=True):
        np.testing.assert_array_equal(result.unwrap().outputs["out"], want)
    assert cloud.tier.pipeline.states.nbytes <= budget  # type: ignore[union-attr]
