"""The draft model runs as slowly as the emulated device it stands on."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from tierflow.device.generation import LocalDecoder
from tierflow.options import RuntimeOptions
from tierflow.runtime import segment_runner
from tierflow.zoo.tiny_stateful import tiny_decoder


def test_a_draft_on_a_slower_device_sleeps_as_the_device_s_segments_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tiny_decoder(tmp_path / "draft.onnx", blocks=2, vocab=16, seed=1)
    slept: list[float] = []
    here = threading.get_ident()
    sleep = time.sleep  # time.sleep is the module's: other threads' sleeps pass through

    def recorded(seconds: float) -> None:
        if threading.get_ident() == here:
            slept.append(seconds)
        else:
            sleep(seconds)

    monkeypatch.setattr(segment_runner.time, "sleep", recorded)
    plain = LocalDecoder(model, RuntimeOptions(), context=32)
    plain.forward([1, 2, 3], 0)
    assert slept == []  # slowdown 1: no emulation
    slow = LocalDecoder(model, RuntimeOptions(slowdown=20.0), context=32)
    logits = slow.forward([1, 2, 3], 0)
    slow.forward([4], 3)
    assert len(slept) == 2 and all(s > 0 for s in slept)
    assert logits.shape == (3, 16) and slow.state_bytes > plain.state_bytes > 0
