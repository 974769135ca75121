"""Both ways a tier writes replies give the same answers ([Note: replies written where
they are made] in tierflow/runtime/service.py): grpc's non-blocking handler form, and the
reader-thread-and-queue fallback for a grpc that does not offer it."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tierflow.device.client import DeviceClient
from tierflow.runtime.service import TierService


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


def test_replies_are_written_by_the_threads_that_make_them(rt: Any, tmp_path: Path) -> None:
    names = _run_exactly(rt, tmp_path)
    assert not any(name.endswith("-stream") for name in names)  # no reader thread


def test_the_queued_fallback_answers_the_same(
    rt: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(TierService.Infer, "experimental_non_blocking", False)
    names = _run_exactly(rt, tmp_path)
    assert {"edge-stream", "cloud-stream"} <= names
