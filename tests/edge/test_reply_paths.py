"""Both ways a tier writes replies give the same answers ([Note: slow readers] in
tierflow/runtime/replies.py): grpc's non-blocking handler form, with replies written by
the threads that make them, and the queue drained by grpc's own thread for a grpc that
does not offer that form. The cloud's own ``Infer`` handler is called in process in both
forms (a :class:`LocalContext`, tierflow/runtime/local_call.py); a grpc without the
non-blocking form is the end-to-end case.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tierflow.device.client import DeviceClient
from tierflow.options import RuntimeOptions
from tierflow.plan import load_plan
from tierflow.rpc import tier_pb2
from tierflow.runtime import streams
from tierflow.runtime.local_call import LocalContext
from tierflow.runtime.segment_runner import TierRunner
from tierflow.runtime.service import TierService
from tierflow.runtime.tier import Tier
from tierflow.transport.wire import decode_tensors, put_tensors


def _run_exactly(rt: Any, tmp_path: Path) -> set[str]:
    """Run a pipelined batch; check every answer bit for bit; return the new threads' names."""
    split = rt.cnn(tmp_path / "plan", {"device-edge": "raw", "edge-cloud": "zstd"})
    samples = split.sample(seed=5, count=12)
    before = set(threading.enumerate())
    with (
        rt.tiers(split.plan_dir) as (edge, _, _),
        DeviceClient(split.plan_dir, edge, window=4) as device,
    ):
        results = list(device.run_stream(samples))
        names = {thread.name for thread in set(threading.enumerate()) - before}
    assert len(results) == len(samples)
    for feeds, result in zip(samples, results, strict=True):
        result.unwrap()
        for name, value in split.reference(feeds).items():
            np.testing.assert_array_equal(result.outputs[name], value)
    return names


def _count_queued(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record each stream served through the queue (``tierflow.runtime.streams._serve_queued``)."""
    queued: list[str] = []
    serve_queued = streams._serve_queued

    def spy(tier: Tier, *args: Any, **kwargs: Any) -> Any:
        queued.append(tier.name)
        return serve_queued(tier, *args, **kwargs)

    monkeypatch.setattr(streams, "_serve_queued", spy)
    return queued


@pytest.mark.parametrize("form", ["non-blocking", "queued"])
def test_a_streams_replies_are_exact_both_ways(
    rt: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, form: str
) -> None:
    """The cloud's stream of twelve requests, answered bit for bit either way; in the
    non-blocking form by the threads that run them, with no writer thread and no queue."""
    split = rt.cnn(tmp_path / "plan", {"device-edge": "raw", "edge-cloud": "zstd"})
    plan = load_plan(split.plan_dir)
    samples = split.sample(seed=5, count=12)
    requests = []
    for index, feeds in enumerate(samples):
        tensors = dict(feeds)
        for tier in ("device", "edge"):
            tensors = TierRunner(plan, split.plan_dir, tier).run(tensors).tensors
        request = tier_pb2.Request(id=str(index), plan_id=plan.plan_id, segment=2)
        put_tensors(request.tensors, tensors, plan.link_codec("edge-cloud"))
        requests.append(request)
    queued = _count_queued(monkeypatch)
    tier = Tier("cloud", plan, split.plan_dir, options=RuntimeOptions(workers=2))
    tier.load()
    cloud = TierService(tier)
    writers: set[str] = set()  # the threads that wrote replies
    replies: list[tier_pb2.Reply] = []
    try:
        context = LocalContext("local:edge")
        if form == "queued":  # a grpc without the non-blocking form drains the queue
            drained = cloud.Infer(iter(requests), context)
            assert drained is not None
            replies = list(drained)
        else:
            ended = threading.Event()

            def send(reply: tier_pb2.Reply | None) -> None:
                writers.add(threading.current_thread().name)
                if reply is None:
                    ended.set()
                else:
                    replies.append(reply)

            assert cloud.Infer(iter(requests), context, send) is None
            assert ended.wait(30)
    finally:
        tier.close(0.5)
    assert sorted(int(r.id) for r in replies) == list(range(len(samples)))
    for reply in replies:
        assert not reply.HasField("error"), reply.error.message
        outputs = decode_tensors(reply.outputs)
        expected = split.reference(samples[int(reply.id)])["y"]
        assert outputs["y"].tobytes() == expected.tobytes()
    if form == "queued":
        assert queued == ["cloud"]
    else:
        assert queued == []
        assert writers and "cloud-replies" not in writers  # the running threads write them


@pytest.mark.integration
def test_the_queued_fallback_answers_the_same(
    rt: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    queued = _count_queued(monkeypatch)
    monkeypatch.setattr(TierService.Infer, "experimental_non_blocking", False)
    _run_exactly(rt, tmp_path)
    assert sorted(set(queued)) == ["cloud", "edge"]
