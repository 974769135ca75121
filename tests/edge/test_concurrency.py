"""A stream's requests run side by side, up to --workers, and a stopping tier answers every
request sent before it began to stop ([Note: a stream's requests run at once]).

The stream is served in process where it can be: the tier's own ``Infer`` handler called
with a :class:`LocalContext` (tierflow/runtime/local_call.py), no server; a tier that
stops, which waits out its requests in flight, runs as a gRPC server.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from tierflow.options import RuntimeOptions
from tierflow.plan import load_plan
from tierflow.rpc import tier_pb2, tier_pb2_grpc
from tierflow.runtime.local_call import LocalContext
from tierflow.runtime.pipeline import Pipeline
from tierflow.runtime.segment_runner import TierRunner
from tierflow.runtime.server import TierServer
from tierflow.runtime.service import TierService
from tierflow.runtime.tier import Tier
from tierflow.transport.wire import grpc_options, put_tensors


def cloud_requests(plan_dir: Path, count: int) -> list[tier_pb2.Request]:
    """What an edge sends the cloud for ``count`` requests: the device's and edge's parts run."""
    plan = load_plan(plan_dir)
    feeds = {"x": np.random.default_rng(0).standard_normal((1, 3, 8, 8)).astype(np.float32)}
    tensors = dict(feeds)
    for tier in ("device", "edge"):
        outcome = TierRunner(plan, plan_dir, tier).run(tensors)
        tensors = outcome.tensors
    requests = []
    for index in range(count):
        request = tier_pb2.Request(id=f"r{index}", plan_id=plan.plan_id, segment=2)
        put_tensors(request.tensors, tensors, plan.link_codec("edge-cloud"))
        requests.append(request)
    return requests


class Slow:
    """Makes every run of the pipeline take ``seconds`` and counts how many run at once."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
        self.seconds = seconds
        self.running = 0
        self.most = 0
        self._lock = threading.Lock()
        run = Pipeline.run

        def slow_run(pipeline: Pipeline, *args: Any, **kwargs: Any) -> Any:
            with self._lock:
                self.running += 1
                self.most = max(self.most, self.running)
            try:
                time.sleep(self.seconds)
                return run(pipeline, *args, **kwargs)
            finally:
                with self._lock:
                    self.running -= 1

        monkeypatch.setattr(Pipeline, "run", slow_run)


class Gate:
    """Holds every run of the pipeline until ``workers`` run at once, and counts how many
    do. A stream that runs its requests one after the other never gets there: each run
    then waits ``patience`` s and goes on, and the count says 1."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, workers: int, patience: float) -> None:
        self.running = 0
        self.most = 0
        self.full = threading.Event()
        self._lock = threading.Lock()
        run = Pipeline.run

        def gated_run(pipeline: Pipeline, *args: Any, **kwargs: Any) -> Any:
            with self._lock:
                self.running += 1
                self.most = max(self.most, self.running)
                if self.running >= workers:
                    self.full.set()
            try:
                if not self.full.wait(patience):
                    self.full.set()  # the others need not wait it out too
                return run(pipeline, *args, **kwargs)
            finally:
                with self._lock:
                    self.running -= 1

        monkeypatch.setattr(Pipeline, "run", gated_run)


@pytest.mark.parametrize("workers", [1, 4])
def test_one_streams_requests_run_side_by_side_up_to_the_workers(
    tmp_path: Path, rt: Any, monkeypatch: pytest.MonkeyPatch, workers: int
) -> None:
    """The edge sends every device's requests on one stream: the cloud must not run them
    one after the other (issue 18, part 4: it did, whatever --workers said)."""
    split = rt.cnn(tmp_path / "plan")
    requests = cloud_requests(split.plan_dir, 8)
    gate = Gate(monkeypatch, workers, patience=5.0)
    plan = load_plan(split.plan_dir)
    tier = Tier("cloud", plan, split.plan_dir, options=RuntimeOptions(workers=workers))
    tier.load()
    cloud = TierService(tier)
    replies: list[tier_pb2.Reply] = []
    ended = threading.Event()

    def send(reply: tier_pb2.Reply | None) -> None:  # grpc's non-blocking handler form
        if reply is None:
            ended.set()
        else:
            replies.append(reply)

    try:
        assert cloud.Infer(iter(requests), LocalContext("local:edge"), send) is None
        assert ended.wait(30)
    finally:
        tier.close(0.5)
    assert sorted(r.id for r in replies) == sorted(r.id for r in requests)
    assert not any(r.HasField("error") for r in replies)
    assert gate.most == workers


@pytest.mark.integration
def test_a_stopping_tier_answers_every_request_sent_before_it_began_to_stop(
    tmp_path: Path, rt: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Twenty requests on one stream, then the stop: all twenty are answered, none
    'stopping' (19 of 20 were, when the cloud read a stream's next request only after
    the last was done)."""
    split = rt.cnn(tmp_path / "plan")
    Slow(monkeypatch, 0.1)
    cloud = TierServer.from_plan("cloud", split.plan_dir, options=RuntimeOptions(workers=2))
    cloud.start()
    channel = grpc.insecure_channel(cloud.address, options=grpc_options())
    requests = cloud_requests(split.plan_dir, 20)
    replies: list[tier_pb2.Reply] = []
    call = tier_pb2_grpc.TierStub(channel).Infer(iter(requests), timeout=30)
    reader = threading.Thread(target=lambda: replies.extend(call), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 10
        while cloud.tier.in_flight < 20 and time.monotonic() < deadline:
            time.sleep(0.01)  # every request read: sent before the stop began
        assert cloud.tier.in_flight == 20
        cloud.stop(grace=10)
        reader.join(15)
    finally:
        channel.close()
        cloud.stop(0)
    assert len(replies) == 20
    assert [r.error.message for r in replies if r.HasField("error")] == []
