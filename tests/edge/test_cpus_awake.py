"""``tierflow serve --cpus-awake``: the kernel's CPU latency setting is held at 0 while a
tier serves, and let go when it stops ([Note: CPUs that sleep between steps] in
tierflow/tuning.py). Needs write access to /dev/cpu_dma_latency (root); skipped without."""

from __future__ import annotations

import os
import signal
import struct
from pathlib import Path
from typing import Any

import pytest

from tierflow.tuning import CPU_LATENCY_FILE

pytestmark = pytest.mark.integration


def _latency() -> int:
    """The machine's CPU latency setting now, in µs (the least any holder asked for)."""
    return int(struct.unpack("=i", CPU_LATENCY_FILE.read_bytes()[:4])[0])


def test_a_cloud_served_with_cpus_awake_holds_the_cpu_latency_at_zero_until_it_stops(
    tmp_path: Path, rt: Any
) -> None:
    if not os.access(CPU_LATENCY_FILE, os.R_OK | os.W_OK):
        pytest.skip(f"needs read and write access to {CPU_LATENCY_FILE}")
    before = _latency()
    if before == 0:
        pytest.skip("something else holds the CPUs awake already")
    split = rt.cnn(tmp_path / "plan")
    with rt.processes() as start:
        cloud = start("cloud", split.plan_dir, "--cpus-awake")
        assert "keeps the machine's CPUs awake while serving" in cloud.read_line(30)
        assert _latency() == 0
        cloud.process.send_signal(signal.SIGTERM)
        assert cloud.process.wait(30) == 0
    assert _latency() == before
