"""``tierflow run`` keeps what was answered as it goes; ``--resume`` finishes a killed run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tierflow.cli.main import main
from tierflow.device.progress import PartialWriter, partial_path, read_partial
from tierflow.edge.forwarding import Forwarding
from tierflow.options import RuntimeOptions
from tierflow.runtime.server import TierServer


def _records(path: Path) -> int:
    return len(read_partial(path)) if path.exists() else 0


@pytest.mark.integration
def test_a_killed_run_keeps_its_answers_and_resume_finishes_it(tmp_path: Path, rt: Any) -> None:
    split = rt.cnn(tmp_path / "plan")
    count = 30
    feeds = split.sample(7, count=count)
    np.savez(tmp_path / "in.npz", x=np.stack([f["x"][0] for f in feeds]))
    out, report = tmp_path / "out.npz", tmp_path / "r.jsonl"
    partial = partial_path(out)
    with rt.processes() as start:
        cloud = start("cloud", split.plan_dir)
        edge = TierServer.from_plan(
            "edge",
            split.plan_dir,
            "127.0.0.1:0",
            forwarder=Forwarding(cloud.address),
            options=RuntimeOptions(workers=1),
        )
        edge.start()
        command = [sys.executable, "-m", "tierflow.cli", "run", "--plan", str(split.plan_dir)]
        command += ["--edge", edge.address, "--input", str(tmp_path / "in.npz")]
        command += ["--output", str(out), "--report", str(report), "--window", "1"]
        run = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            ends = time.monotonic() + 60
            while _records(partial) < 3 and time.monotonic() < ends and run.poll() is None:
                time.sleep(0.002)
            os.kill(cloud.process.pid, signal.SIGSTOP)  # nothing more gets answered
            time.sleep(0.2)
            run.kill()
            run.wait(10)
        finally:
            os.kill(cloud.process.pid, signal.SIGCONT)
        kept = read_partial(partial)
        assert 3 <= len(kept) < count and not out.exists()
        for index, row in kept.items():  # what was answered is on disk, exactly
            np.testing.assert_array_equal(row["y"], split.reference(feeds[index])["y"][0])
        with partial.open("ab") as file:
            file.write(b"\x10\x00\x00")  # a record cut short by the kill
        try:
            command = ["run", "--plan", str(split.plan_dir), "--edge", edge.address]
            command += ["--input", str(tmp_path / "in.npz"), "--output", str(out)]
            assert main([*command, "--report", str(report), "--resume"]) == 0
        finally:
            edge.stop(0)
    assert not partial.exists()
    with np.load(out) as written:
        assert written["y"].shape == (count, 10)
        for index, inputs in enumerate(feeds):
            np.testing.assert_array_equal(written["y"][index], split.reference(inputs)["y"][0])
    ids = [json.loads(line)["id"] for line in report.read_text().splitlines()]
    assert sorted(ids) == list(range(count))  # one line per request, none twice


def test_resume_needs_a_stopped_run(tmp_path: Path, rt: Any) -> None:
    split = rt.cnn(tmp_path / "plan")
    np.savez(tmp_path / "in.npz", x=np.zeros((2, 3, 8, 8), np.float32))
    command = ["run", "--plan", str(split.plan_dir), "--input", str(tmp_path / "in.npz")]
    command += ["--edge", "127.0.0.1:1", "--output", str(tmp_path / "out.npz"), "--resume"]
    assert main(command) == 2


@pytest.mark.integration
def test_an_edge_nobody_serves_fails_the_run_once_before_any_request(
    tmp_path: Path, rt: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """It printed one line per request and wrote outputs full of NaN (issue 30, item 11;
    [Note: reaching a tier first] in tierflow/transport/reach.py)."""
    split = rt.cnn(tmp_path / "plan")
    np.savez(tmp_path / "in.npz", x=np.zeros((3, 3, 8, 8), np.float32))
    out = tmp_path / "out.npz"
    command = ["run", "--plan", str(split.plan_dir), "--input", str(tmp_path / "in.npz")]
    command += ["--edge", f"127.0.0.1:{rt.free_port()}", "--output", str(out)]
    command += ["--deadline", "2s"]
    assert main(command) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "nothing listens there" in err
    assert not out.exists()


def test_partial_files_drop_a_cut_short_record(tmp_path: Path) -> None:
    path = tmp_path / "out.npz.partial"
    with PartialWriter(path) as writer:
        writer.add(4, {"y": np.arange(3, dtype=np.float32)})
        writer.add(1, {"y": np.ones(3, dtype=np.float32)})
    whole = path.stat().st_size
    with path.open("ab") as file:
        file.write(b"\xff\x00\x00\x00\x00\x00\x00\x00abc")
    assert sorted(read_partial(path)) == [1, 4] and path.stat().st_size > whole
    rows = read_partial(path, repair=True)
    assert sorted(rows) == [1, 4] and rows[4]["y"].tolist() == [0, 1, 2]
    assert path.stat().st_size == whole
