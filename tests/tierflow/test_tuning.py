"""Per-process tuning: a short GIL switch interval, freed buffers kept for reuse, the
imports left out of garbage collection; and the machine's CPUs kept awake when asked
([Note: CPUs that sleep between steps])."""

from __future__ import annotations

import ctypes
import json
import logging
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from tierflow.tuning import SESSIONS_SWITCH_INTERVAL_S, SWITCH_INTERVAL_S, cpus_awake

pytestmark = pytest.mark.integration

# 50 times, as a request's buffers would: allocates and fills four 1 MiB buffers (the
# serialised message, gRPC's copy, the received bytes, the decoded tensor), then frees
# them; prints the minor page faults that took. With TUNE set, after
# tune_for_latency(sessions=TUNE).
_CHURN = """
import os, resource, sys
import numpy as np
from tierflow.tuning import tune_for_latency
if os.environ.get("TUNE"):
    tune_for_latency(sessions=int(os.environ["TUNE"]))
    print(sys.getswitchinterval(), file=sys.stderr)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(50):
    buffers = [np.empty(1 << 20, np.uint8) for _ in range(4)]
    for buffer in buffers:
        buffer.fill(1)
    del buffer, buffers
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(tune: bool, sessions: int = 1) -> tuple[int, str]:
    """Page faults of the churn in a fresh process, and its switch interval when tuned."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    if tune:
        env["TUNE"] = str(sessions)
    done = subprocess.run(
        [sys.executable, "-c", _CHURN],
        capture_output=True,
        text=True,
        check=True,
        env=env,
        timeout=60,
    )
    return int(done.stdout.strip()), done.stderr.strip()


def test_tuned_processes_reuse_freed_buffers_instead_of_faulting_new_pages() -> None:
    if not hasattr(ctypes.CDLL(None), "mallopt"):
        pytest.skip("this C library has no mallopt")
    pages = 50 * 4 * (1 << 20) // 4096
    untuned, _ = _faults(tune=False)
    tuned, interval = _faults(tune=True)
    assert untuned > pages // 2  # freed buffers went back to the system (measured: 49,621)
    assert tuned < untuned // 10  # the first round's pages, then reuse (measured: 977)
    assert float(interval) == pytest.approx(SWITCH_INTERVAL_S)


def test_a_process_driving_several_sessions_keeps_a_longer_switch_interval() -> None:
    """[Note: GIL switch interval]: a thread a session, woken together each round."""
    _, interval = _faults(tune=True, sessions=16)
    assert float(interval) == pytest.approx(SESSIONS_SWITCH_INTERVAL_S)
    assert SESSIONS_SWITCH_INTERVAL_S > SWITCH_INTERVAL_S


def test_a_tuned_process_leaves_what_it_made_before_out_of_garbage_collection() -> None:
    """[Note: garbage collection between steps]: the imports are frozen, later objects not."""
    script = (
        "import gc, json\n"
        "from tierflow.tuning import tune_for_latency\n"
        "before = gc.get_freeze_count()\n"
        "tune_for_latency()\n"
        "frozen = gc.get_freeze_count()\n"
        "later = [[] for _ in range(1000)]\n"
        "print(json.dumps([before, frozen, gc.get_freeze_count(), gc.get_threshold()[0]]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=60
    )
    before, frozen, after, threshold = json.loads(done.stdout)
    assert before == 0 and frozen > 1_000  # the imports (measured: about 10,000)
    assert after == frozen  # what is made later is collected as before
    assert threshold == 700  # the youngest generation as Python has it


def test_cpus_awake_writes_a_zero_latency_and_lets_it_go_after_the_block(tmp_path: Path) -> None:
    latency = tmp_path / "cpu_dma_latency"
    latency.write_bytes(b"")
    with cpus_awake(path=latency) as held:
        assert held
        assert latency.read_bytes() == struct.pack("=i", 0)
        assert str(latency) in _open_files()
    assert str(latency) not in _open_files()  # let go: the kernel's request ends with it


def test_cpus_awake_not_asked_for_leaves_the_setting_alone(tmp_path: Path) -> None:
    latency = tmp_path / "cpu_dma_latency"
    latency.write_bytes(b"")
    with cpus_awake(False, path=latency) as held:
        assert not held
        assert latency.read_bytes() == b"" and str(latency) not in _open_files()


def test_cpus_awake_where_the_setting_may_not_be_written_changes_nothing_and_says_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING), cpus_awake(path=tmp_path / "missing") as held:
        assert not held
    assert "cannot keep the CPUs awake" in caplog.text and "missing" in caplog.text


def _open_files() -> set[str]:
    """What this process holds open (Linux)."""
    folder = Path("/proc/self/fd")
    return {os.readlink(entry) for entry in folder.iterdir() if entry.exists()}
