"""``demos/netns-link.sh run``: the three tiers in network namespaces over kernel-shaped links.

Runs the recipe as a user would (as root, with ``tierflow`` on the PATH), on the demo model:
it must bring the namespaces up, plan the demo model, start the cloud and the edge in
their namespaces, answer every held-out request across the shaped device-edge link, and
remove the namespaces on its way out. Skipped where namespaces cannot be made (not root,
no iproute2, or a container without the privilege).

The plan is made from given profiles (``tests/profiles.py``), not from this machine's: on
a measured profile, whether the 20x device does better alone depends on the load (on a
loaded machine it did, and no request crossed the link this test is about).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from tierflow.partitioner.graph import load_model
from tierflow.partitioner.profile import save_profile

from ..profiles import graph_profile

SCRIPT = Path(__file__).resolve().parents[2] / "demos" / "netns-link.sh"
NAMESPACES = ("tf-device", "tf-edge", "tf-cloud")


def _netns() -> list[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    return [line.split()[0] for line in listed.stdout.splitlines() if line.strip()]


def _why_not() -> str | None:
    """Why this machine cannot run the recipe (None: it can)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "needs root to make network namespaces"
    for tool in ("bash", "ip", "tc"):
        if shutil.which(tool) is None:
            return f"needs {tool}"
    probe = f"tf-probe-{uuid.uuid4().hex[:8]}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot make a network namespace here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], check=True)
    if set(NAMESPACES) & set(_netns()):
        return "the recipe's namespaces exist already (another run is using them)"
    return None


pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _profile_options(model: Path, directory: Path) -> list[str]:
    """``--profile`` for each tier, as the recipe emulates them: 0.1 ms a unit on the cloud,
    twice that on the edge, 20 times on the device (2 ms a unit). The 588 KiB frame would
    take 0.24 s at 20 Mbit/s, but the device's first units leave a few KiB, and the edge
    runs the rest ten times faster than the device would: the plan sends that."""
    graph = load_model(model)
    cloud = graph_profile(graph, [1e-4] * (len(graph.cuts) - 1))
    options = []
    for tier, slowdown in (("device", 20.0), ("edge", 2.0), ("cloud", 1.0)):
        path = save_profile(cloud.emulate(slowdown), directory / f"{tier}.json")
        options += ["--profile", f"{tier}={path}"]
    return options


def test_the_recipe_answers_every_request_over_the_shaped_link_and_cleans_up(
    demo_build: tuple[Any, list[Any]], tmp_path: Path
) -> None:
    why = _why_not()
    if why is not None:
        pytest.skip(why)
    demo, _ = demo_build
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    wrapper = bin_dir / "tierflow"
    wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m tierflow.cli "$@"\n')
    wrapper.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:/usr/sbin:/usr/bin:/sbin:/bin"}
    model, inputs = demo.directory / "model.onnx", demo.directory / "heldout.npz"
    profiles = _profile_options(model, tmp_path)
    done = subprocess.run(
        ["bash", str(SCRIPT), "run", str(model), str(inputs), *profiles],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "tierflow edge serving plan" in output and "tierflow cloud serving plan" in output
    assert f"requests     {demo.meta.heldout_size} (0 failed)" in output, output
    # The plan for a device 20x slower sends the requests over the shaped link.
    answered = next(line for line in output.splitlines() if line.startswith("answered by"))
    assert "device 0," in answered, answered
    assert not set(NAMESPACES) & set(_netns())  # removed on the way out
