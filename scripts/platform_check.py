"""Serve a small split model across interpreters or machines and check it bit for bit.

Used by ``scripts/py310-check`` and ``scripts/arm64-check`` (not part of the test suite):
this process (the full development install: it needs onnx) builds a small CNN and a plan
that gives the edge the first half and the cloud the second, starts ``tierflow serve
cloud``, ``tierflow serve edge`` and ``tierflow run`` each with its own command prefix
(another Python, or ``chroot ROOT /venv/bin/python`` for an emulated arm64 root), and
compares the answers with the unsplit model run here and with the same two segments
chained here. It prints one JSON object with the figures (times, sizes, exactness).

The plan directory lives under ``--work``, which every prefix must be able to read under
the same path (for a chroot, a bind mount: see scripts/arm64-check).
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from tierflow.errors import TransportError
from tierflow.runtime.processes import ServeProcess

INPUT_SHAPE = (1, 3, 16, 16)
REQUESTS = 8
# Seconds a tier may take to start: an emulated arm64 interpreter imports slowly.
START_S = 600.0


def build_model(path: Path) -> None:
    """conv-relu-conv-relu-conv-relu-pool-gemm with fixed random weights."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)

    def weights(name: str, shape: tuple[int, ...]) -> onnx.TensorProto:
        return numpy_helper.from_array((rng.standard_normal(shape) * 0.3).astype(np.float32), name)

    inits = [
        weights("w1", (8, 3, 3, 3)),
        weights("w2", (16, 8, 3, 3)),
        weights("w3", (16, 16, 3, 3)),
        weights("w4", (10, 16)),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["h1"]),
        helper.make_node("Conv", ["h1", "w2"], ["c2"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c2"], ["h2"]),
        helper.make_node("Conv", ["h2", "w3"], ["c3"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c3"], ["h3"]),
        helper.make_node("GlobalAveragePool", ["h3"], ["p"]),
        helper.make_node("Flatten", ["p"], ["f"]),
        helper.make_node("Gemm", ["f", "w4"], ["y"], transB=1),
    ]
    graph = helper.make_graph(
        nodes,
        "platform_check",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(INPUT_SHAPE))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 10])],
        inits,
    )
    # IR version 8 (opset 17's): onnxruntime 1.23, the last release for Python 3.10, reads
    # IR versions up to 11 only, and onnx.helper would stamp its own newest one.
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model)
    onnx.save(model, path)


def prepare(work: Path) -> dict[str, Any]:
    """Model, an edge|cloud plan (lossless zstd on the wire), inputs and references."""

    from tierflow.onnxrt.inference import open_session
    from tierflow.partitioner.graph import load_model
    from tierflow.partitioner.split import save_split_plan, split_model
    from tierflow.runtime.segment_runner import SegmentRunner

    work.mkdir(parents=True, exist_ok=True)
    model_path = work / "model.onnx"
    build_model(model_path)
    graph = load_model(model_path)
    middle = len(graph.cuts) // 2
    segments = split_model(graph, (0, middle))
    plan_dir = work / "plan"
    plan = save_split_plan(
        graph, segments, plan_dir, cuts=(0, middle), codec={"edge-cloud": "zstd"}
    )
    assert [s.tier for s in plan.segments] == ["edge", "cloud"], plan.segments
    rng = np.random.default_rng(1)
    x = rng.standard_normal((REQUESTS, *INPUT_SHAPE)).astype(np.float32)
    np.savez(work / "in.npz", x=x)
    # The unsplit model at the tiers' optimisation level and thread count (see
    # [Note: optimization level and exactness] in tierflow/onnxrt/inference.py).
    whole = open_session(model_path)
    reference = np.stack([whole.run(["y"], {"x": row})[0] for row in x])
    np.save(work / "reference.npy", reference)
    runners = [SegmentRunner(plan_dir / s.file) for s in plan.segments]
    chained = []
    for row in x:
        env: dict[str, np.ndarray] = {"x": row}
        for spec, runner in zip(plan.segments, runners, strict=True):
            env.update(runner.run({n: env[n] for n in spec.inputs}))
        chained.append(env["y"])
    np.save(work / "chained.npy", np.stack(chained))
    return {"plan_dir": str(plan_dir), "segments": [s.file for s in plan.segments]}


def import_seconds(prefix: list[str], cwd: Path) -> float:
    """Seconds a fresh interpreter takes to import the edge and cloud runtimes."""
    code = (
        "import time; t = time.perf_counter(); "
        "import tierflow.cli.main, tierflow.runtime.server, tierflow.runtime.service; "
        "import tierflow.edge.commands; "
        "import onnxruntime, grpc, numpy, zstandard; "
        "print(time.perf_counter() - t)"
    )
    out = subprocess.run([*prefix, "-c", code], capture_output=True, text=True, check=True, cwd=cwd)
    return float(out.stdout.strip().splitlines()[-1])


def check(work: Path, edge: list[str], cloud: list[str], run: list[str]) -> dict[str, Any]:
    plan_dir = work / "plan"
    started = time.perf_counter()
    with ServeProcess(
        "cloud", plan_dir, python=cloud, cwd=work, log=work / "cloud.log", timeout=START_S
    ) as cloud_server:
        # The edge reads its options from a config file (tomli on Python 3.10).
        config = work / "edge.toml"
        config.write_text(f'plan = "{plan_dir}"\nupstream = "{cloud_server.address}"\n')
        with ServeProcess(
            "edge",
            None,
            "--config",
            str(config),
            listen=None,
            python=edge,
            cwd=work,  # not the checkout: `-m` would import its tierflow/ folder
            log=work / "edge.log",
            timeout=START_S,
        ) as edge_server:
            up_s = time.perf_counter() - started
            begin = time.perf_counter()
            out = work / "out.npz"
            command = [
                *run,
                "-m",
                "tierflow.cli",
                "run",
                "--plan",
                str(plan_dir),
                "--edge",
                edge_server.address,
                "--input",
                str(work / "in.npz"),
                "--output",
                str(out),
                "--report",
                str(work / "report.jsonl"),
            ]
            finished = subprocess.run(command, capture_output=True, text=True, cwd=work)
            run_s = time.perf_counter() - begin
    if finished.returncode != 0:
        raise SystemExit(f"tierflow run failed:\n{finished.stdout}\n{finished.stderr}")
    with np.load(out) as data:
        answers = data["y"]
    reference = np.load(work / "reference.npy")
    chained = np.load(work / "chained.npy")
    answers = answers.reshape(reference.shape)
    return {
        "requests": int(reference.shape[0]),
        "bit_exact_vs_unsplit_here": bool(np.array_equal(answers, reference)),
        "bit_exact_vs_segments_chained_here": bool(np.array_equal(answers, chained)),
        "max_abs_diff_vs_unsplit_here": float(np.max(np.abs(answers - reference))),
        "tiers_up_s": round(up_s, 2),
        "run_s": round(run_s, 2),
        "answered_by": sorted(
            {json.loads(line)["answered_by"] for line in (work / "report.jsonl").open()}
        ),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True, help="folder for model and plan")
    parser.add_argument("--edge", default=sys.executable, help="command prefix for the edge")
    parser.add_argument("--cloud", default=sys.executable, help="command prefix for the cloud")
    parser.add_argument("--run", default=sys.executable, help="command prefix for the device")
    parser.add_argument(
        "--import-time",
        action="append",
        default=[],
        metavar="NAME=PREFIX",
        help="also time the runtime imports under PREFIX (repeatable)",
    )
    args = parser.parse_args()
    figures: dict[str, Any] = {"prepare": prepare(args.work)}
    for item in args.import_time:
        name, _, prefix = item.partition("=")
        figures[f"import_s_{name}"] = round(import_seconds(shlex.split(prefix), args.work), 2)
    try:
        figures["check"] = check(
            args.work, shlex.split(args.edge), shlex.split(args.cloud), shlex.split(args.run)
        )
    except TransportError as exc:  # a tier did not start: its log's end says why
        raise SystemExit(str(exc)) from exc
    print(json.dumps(figures, indent=2))
    ok = figures["check"]["bit_exact_vs_segments_chained_here"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
