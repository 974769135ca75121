"""A tier that answers with figures no tier could measure (issue 28 finding 5): the edge and
the device keep its answers, drop its figures with a counted warning, write valid JSON, and
their link estimates do not move ([Note: figures in a reply] in tierflow/transport/wire.py).

The hostile tiers wrap the services in process ([Note: the next tier in process] in
tierflow/runtime/upstream.py); ``tierflow run`` through hostile gRPC relays is the
end-to-end case.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from tierflow.cli.main import main
from tierflow.device.client import DeviceClient
from tierflow.edge.forwarding import Forwarding
from tierflow.options import RuntimeOptions
from tierflow.rpc import tier_pb2, tier_pb2_grpc
from tierflow.runtime.server import TierServer
from tierflow.runtime.tier import Tier
from tierflow.runtime.upstream import LocalUpstream
from tierflow.transport.peer_warnings import WARNINGS
from tierflow.transport.wire import GRPC_OPTIONS, MAX_FIGURE_BPS, add_tier_servicer


def _poison(reply: tier_pb2.Reply) -> None:
    """Every figure a hostile tier can lie with, beside the honest ones."""
    for index, value in enumerate((float("nan"), float("inf"), -float("inf"), 1e308, -5.0)):
        reply.timings.add(tier=("edge", "cloud")[index % 2], compute_ms=value, queue_ms=value)
    for _ in range(20_000):
        reply.timings.add(tier="cloud", codec_ms=1e308)
    reply.links.add(link="edge-cloud", bytes=2**62, send_ms=1e-3, rate_bps=float("inf"))
    reply.links.add(link="device-edge", bytes=2**62, send_ms=-1.0, rate_bps=float("nan"))


class HostileRelay(tier_pb2_grpc.TierServicer):
    """Passes each request to ``target`` and its reply back, poisoned."""

    def __init__(self, target: str) -> None:
        self.channel = grpc.insecure_channel(target, options=GRPC_OPTIONS)
        self.stub = tier_pb2_grpc.TierStub(self.channel)

    def Infer(self, request_iterator: Any, context: Any) -> Iterator[tier_pb2.Reply]:
        for request in request_iterator:
            for reply in self.stub.Infer(iter([request]), timeout=30):
                _poison(reply)
                yield reply


def _relay(target: str) -> tuple[grpc.Server, str]:
    server = grpc.server(futures.ThreadPoolExecutor(4), options=GRPC_OPTIONS)
    add_tier_servicer(HostileRelay(target), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


class HostileTier:
    """A tier in this process whose every reply is poisoned on its way out."""

    def __init__(self, tier: Tier) -> None:
        self.tier = tier

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tier, name)

    @property
    def closed(self) -> bool:
        return self.tier.closed

    def handle(self, request: Any, received: float, later: Any, caller: str = "local") -> Any:
        def poisoned(reply: tier_pb2.Reply) -> None:
            _poison(reply)
            later(reply)

        reply = self.tier.handle(request, received, poisoned, caller)
        if reply is not None:
            _poison(reply)
        return reply


@pytest.fixture
def hostile_in_process(tmp_path: Path, rt: Any) -> Iterator[tuple[Any, DeviceClient]]:
    """A cloud whose replies are poisoned, an edge forwarding to it whose replies are
    poisoned too, and a device client of that edge, with the split."""
    split = rt.cnn(tmp_path / "plan")
    with rt.in_process(split.plan_dir) as tiers:
        tiers.edge.forwarder.upstream = LocalUpstream(HostileTier(tiers.cloud), me="edge")
        upstream = LocalUpstream(HostileTier(tiers.edge), me="device")
        with DeviceClient(split.plan_dir, upstream=upstream) as client:
            yield split, client


@pytest.fixture
def hostile(tmp_path: Path, rt: Any) -> Iterator[tuple[Any, str]]:
    """A real cloud behind a hostile relay, a real edge forwarding to that relay, and a
    second hostile relay in front of the edge, whose address is yielded with the split."""
    split = rt.cnn(tmp_path / "plan")
    with rt.tiers(split.plan_dir) as (_, _, cloud):
        above, above_address = _relay(cloud.address)
        edge = TierServer.from_plan(
            "edge",
            split.plan_dir,
            "127.0.0.1:0",
            forwarder=Forwarding(above_address),
            options=RuntimeOptions(workers=2),
        )
        edge.start()
        below, below_address = _relay(edge.address)
        try:
            yield split, below_address
        finally:
            below.stop(0)
            edge.stop(0)
            above.stop(0)


def _refuse(token: str) -> Any:
    raise ValueError(f"not JSON: {token}")


def test_the_edge_and_the_device_drop_a_hostile_tiers_figures_and_keep_its_answers(
    hostile_in_process: tuple[Any, DeviceClient],
) -> None:
    split, client = hostile_in_process
    before = {**WARNINGS.counts("edge"), **WARNINGS.counts("device")}
    feeds = split.sample(3, count=4)
    results = [client.submit(inputs).result() for inputs in feeds]
    for inputs, result in zip(feeds, results, strict=True):
        np.testing.assert_array_equal(result.unwrap().outputs["y"], split.reference(inputs)["y"])
        record = json.loads(json.dumps(result.to_dict()), parse_constant=_refuse)
        assert set(record["timings"]) <= {"device", "edge", "cloud"}
        assert record["bytes"]["edge-cloud"] < 2**40
        assert all(math.isfinite(v) and 0 <= v < 60_000 for v in result.ms.values())
    after = {**WARNINGS.counts("edge"), **WARNINGS.counts("device")}
    for key in (("edge", "reply_figures"), ("device", "reply_figures")):
        assert after.get(key, 0) - before.get(key, 0) >= len(feeds), key


@pytest.mark.integration
def test_the_edge_and_the_device_drop_a_hostile_tiers_figures_and_write_valid_json(
    hostile: tuple[Any, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    split, relay = hostile
    feeds = split.sample(3, count=4)
    np.savez(tmp_path / "in.npz", x=np.stack([f["x"][0] for f in feeds]))
    before = {**WARNINGS.counts("edge"), **WARNINGS.counts("device")}
    out, report = tmp_path / "out.npz", tmp_path / "r.jsonl"
    command = ["run", "--plan", str(split.plan_dir), "--edge", relay, "--json"]
    command += ["--input", str(tmp_path / "in.npz"), "--output", str(out)]
    assert main([*command, "--report", str(report)]) == 0
    printed = capsys.readouterr().out.strip().splitlines()[-1]
    summary = json.loads(printed, parse_constant=_refuse)
    assert summary["failed"] == 0
    for value in summary["p50_ms"].values():
        assert value is not None and math.isfinite(value) and 0 <= value < 60_000
    for line in report.read_text().splitlines():
        record = json.loads(line, parse_constant=_refuse)
        assert set(record["timings"]) <= {"device", "edge", "cloud"}
        assert record["bytes"]["edge-cloud"] < 2**40
    with np.load(out) as written:  # the answers are the model's
        for index, inputs in enumerate(feeds):
            np.testing.assert_array_equal(written["y"][index], split.reference(inputs)["y"][0])
    after = {**WARNINGS.counts("edge"), **WARNINGS.counts("device")}
    for key in (("edge", "reply_figures"), ("device", "reply_figures")):
        assert after.get(key, 0) - before.get(key, 0) >= len(feeds), key


def test_a_hostile_edges_link_figures_do_not_move_the_devices_estimates(
    hostile_in_process: tuple[Any, DeviceClient],
) -> None:
    split, client = hostile_in_process
    for inputs in split.sample(5, count=6):
        result = client.submit(inputs).result()
        assert result.ok, result.error
        assert all(math.isfinite(v) and v >= 0 for v in result.ms.values())
        assert result.bytes["edge-cloud"] < 2**40
    for link, estimator in client.estimators.items():
        rate = estimator.measured().rate_bps
        assert math.isfinite(rate) and rate <= MAX_FIGURE_BPS, link
