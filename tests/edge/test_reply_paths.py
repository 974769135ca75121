"""Both ways a tier writes replies give the same answers ([Note: slow readers] in
tierflow/runtime/replies.py): grpc's non-blocking handler form, with replies written by
the threads that make them, and the queue drained by grpc's own thread for a grpc that
does not offer that form."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tierflow.device.client import DeviceClient
from tierflow.runtime.service import TierService

pytestmark = pytest.mark.integration


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
    """Record each stream served through the queue (``TierService._serve_queued``)."""
    queued: list[str] = []
    serve_queued = TierService._serve_queued

    def spy(self: TierService, *args: Any, **kwargs: Any) -> Any:
        queued.append(self.tier)
        return serve_queued(self, *args, **kwargs)

    monkeypatch.setattr(TierService, "_serve_queued", spy)
    return queued


def test_replies_are_written_by_the_threads_that_make_them(
    rt: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    queued = _count_queued(monkeypatch)
    names = _run_exactly(rt, tmp_path)
    assert queued == []
    assert "cloud-replies" not in names  # the cloud's threads write their own replies


def test_the_queued_fallback_answers_the_same(
    rt: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    queued = _count_queued(monkeypatch)
    monkeypatch.setattr(TierService.Infer, "experimental_non_blocking", False)
    _run_exactly(rt, tmp_path)
    assert sorted(set(queued)) == ["cloud", "edge"]
