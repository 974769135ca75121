"""Three real processes: `tierflow serve cloud`, `tierflow serve edge`, `tierflow run`.

Also what happens when a tier is killed (SIGKILL) with requests in flight: each of them
ends in a typed error well within its deadline, and the edge reconnects to a restarted
cloud.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tierflow.device.client import DeviceClient, Result
from tierflow.errors import RemoteError, TransportError

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _tierflow(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tierflow.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.parametrize("model", ["cnn", "residual"])
def test_three_processes_reproduce_the_model_exactly(tmp_path: Path, rt: Any, model: str) -> None:
    split = getattr(rt, model)(tmp_path / "plan", {"device-edge": "zstd", "edge-cloud": "raw"})
    rng = np.random.default_rng(11)
    ((name, shape),) = split.inputs.items()
    # The cnn's IN.npz leaves out the batch axis (tierflow run re-adds it); the residual's keeps it.
    per_request = shape[1:] if model == "cnn" else shape
    inputs = rng.standard_normal((5, *per_request)).astype(np.float32)
    np.savez(tmp_path / "in.npz", **{name: inputs})
    with rt.processes() as serve:
        cloud = serve("cloud", split.plan_dir, "--workers", "2")
        edge = serve("edge", split.plan_dir, "--upstream", cloud.address, "--workers", "2")
        done = _tierflow(
            "run",
            "--plan",
            str(split.plan_dir),
            "--edge",
            edge.address,
            "--input",
            str(tmp_path / "in.npz"),
            "--output",
            str(tmp_path / "out.npz"),
            "--report",
            str(tmp_path / "r.jsonl"),
            "--window",
            "3",
            "--json",
        )
        assert done.returncode == 0, done.stderr
        assert edge.stop() == 0 and cloud.stop() == 0  # graceful on SIGTERM
    summary = json.loads(done.stdout)
    assert (summary["requests"], summary["failed"]) == (len(inputs), 0)
    assert summary["answered_by"] == {"device": 0, "edge": 0, "cloud": len(inputs)}
    assert summary["bytes_per_request"]["edge-cloud"] > 0 and summary["rate_bps"]["device-edge"]
    with np.load(tmp_path / "out.npz") as out:
        outputs = {key: out[key] for key in out.files}
    for i in range(len(inputs)):
        row = inputs[i][np.newaxis] if model == "cnn" else inputs[i]
        expected = split.reference({name: row})
        for key, value in expected.items():
            got = outputs[key][i]
            np.testing.assert_array_equal(got, value[0] if model == "cnn" else value)
    lines = [json.loads(line) for line in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert [line["id"] for line in lines] == list(range(len(inputs)))
    for line in lines:
        assert line["answered_by"] == "cloud" and line["exit"] is None
        assert line["cache_hit"] is False and line["error"] is None
        assert line["bytes"]["device-edge"] > 0 and line["bytes"]["edge-cloud"] > 0
        assert set(line["ms"]) >= {"device", "edge", "cloud", "total"}
        assert line["rate_bps"]["device-edge"] > 0


def _collect(tickets: list[Any]) -> list[Result]:
    return [ticket.result() for ticket in tickets]


def test_killing_the_edge_fails_every_request_in_flight(tmp_path: Path, rt: Any) -> None:
    split = rt.cnn(tmp_path / "plan", {"device-edge": "raw", "edge-cloud": "raw"})
    samples = split.sample(seed=12, count=12)
    deadline = 10.0
    with rt.processes() as serve:
        # One slow worker on the cloud keeps the requests queued, in flight.
        cloud = serve("cloud", split.plan_dir, "--workers", "1", "--slowdown", "20000")
        edge = serve("edge", split.plan_dir, "--upstream", cloud.address)
        with DeviceClient(split.plan_dir, edge.address, deadline_s=deadline, window=16) as device:
            tickets = [device.submit(feeds) for feeds in samples]
            time.sleep(0.5)
            edge.kill()
            killed = time.monotonic()
            results = _collect(tickets)
            settled = time.monotonic() - killed
            after = device.submit(samples[0]).result()
    failed = [r for r in results if r.error is not None]
    assert failed, "the slow cloud should have kept requests in flight"
    assert all(isinstance(r.error, TransportError) for r in failed)
    assert not any(isinstance(r.error, RemoteError) for r in failed)
    assert settled < deadline / 2
    assert isinstance(after.error, TransportError) and after.ms["total"] < 5000


def test_killing_the_cloud_fails_requests_and_the_edge_reconnects(tmp_path: Path, rt: Any) -> None:
    split = rt.cnn(tmp_path / "plan", {"device-edge": "raw", "edge-cloud": "raw"})
    samples = split.sample(seed=13, count=12)
    deadline = 10.0
    port = rt.free_port()
    with rt.processes() as serve:
        cloud = serve(
            "cloud",
            split.plan_dir,
            "--workers",
            "1",
            "--slowdown",
            "20000",
            listen=f"127.0.0.1:{port}",
        )
        edge = serve("edge", split.plan_dir, "--upstream", cloud.address)
        with DeviceClient(split.plan_dir, edge.address, deadline_s=deadline, window=16) as device:
            tickets = [device.submit(feeds) for feeds in samples]
            time.sleep(0.5)
            cloud.kill()
            killed = time.monotonic()
            results = _collect(tickets)
            settled = time.monotonic() - killed
            while_down = device.submit(samples[0]).result()
            serve("cloud", split.plan_dir, listen=f"127.0.0.1:{port}")
            back = None
            for _ in range(50):
                back = device.submit(samples[1]).result()
                if back.ok:
                    break
                time.sleep(0.2)
    failed = [r for r in results if r.error is not None]
    assert failed
    for result in failed:  # the edge says its upstream is gone ([Note: losing a tier])
        assert isinstance(result.error, RemoteError)
        assert result.error.code == "UPSTREAM_UNAVAILABLE" and result.error.tier == "edge"
    assert settled < deadline / 2
    assert isinstance(while_down.error, RemoteError)
    assert while_down.error.code == "UPSTREAM_UNAVAILABLE"
    assert back is not None and back.ok, back
    np.testing.assert_array_equal(back.outputs["y"], split.reference(samples[1])["y"])
