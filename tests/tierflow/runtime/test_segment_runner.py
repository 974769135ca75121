"""Segment runner: input checks, error translation, slowdown, exit confidence, forwarding sets."""

from __future__ import annotations

import dataclasses
import sys
import threading
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tierflow.errors import InputError, ModelError
from tierflow.options import RuntimeOptions
from tierflow.plan import ExitSpec, Plan, SegmentSpec
from tierflow.runtime.segment_runner import (
    SegmentRunner,
    TierRunner,
    emulate_slower,
    exit_confidence,
)


def _gemm(path: Path, x: str, y: str, n_in: int, n_out: int, seed: int) -> Path:
    """y = x @ W.T for float32 x of shape [batch, n_in] (batch symbolic)."""
    weights = np.random.default_rng(seed).standard_normal((n_out, n_in)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Gemm", [x, f"w_{y}"], [y], transB=1)],
        path.stem,
        [helper.make_tensor_value_info(x, TensorProto.FLOAT, ["batch", n_in])],
        [helper.make_tensor_value_info(y, TensorProto.FLOAT, ["batch", n_out])],
        [numpy_helper.from_array(weights, f"w_{y}")],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def test_inputs_are_checked_with_expected_and_found(tmp_path: Path) -> None:
    runner = SegmentRunner(_gemm(tmp_path / "s.onnx", "x", "y", 4, 3, 0))
    out = runner.run({"x": np.ones((2, 4), np.float32)})
    weights = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    np.testing.assert_allclose(out["y"], np.ones((2, 4), np.float32) @ weights.T, rtol=1e-5)
    with pytest.raises(InputError, match=r"expected float32\[\?x4\], found float64\[2x4\]"):
        runner.run({"x": np.ones((2, 4))})
    with pytest.raises(InputError, match=r"found float32\[2x5\]"):
        runner.run({"x": np.ones((2, 5), np.float32)})
    with pytest.raises(InputError, match="missing"):
        runner.run({"z": np.ones((2, 4), np.float32)})


def test_a_file_that_is_not_onnx_is_a_model_error(tmp_path: Path) -> None:
    (tmp_path / "bad.onnx").write_bytes(b"not onnx")
    with pytest.raises(ModelError, match="cannot load segment"):
        SegmentRunner(tmp_path / "bad.onnx")


def test_slowdown_sleeps_slowdown_less_one_times_the_compute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 20x tier sleeps 19 times what it computed, once per run; a 1x tier never sleeps.

    The sleep is recorded, not taken: what is checked is the charge, not the wall clock.
    """
    slept: list[float] = []
    real_sleep = time.sleep

    def sleep(seconds: float) -> None:
        # Only this thread's: a thread an earlier test left (a channel closing) sleeps too.
        if threading.current_thread() is threading.main_thread():
            slept.append(seconds)
        else:
            real_sleep(seconds)

    monkeypatch.setattr(time, "sleep", sleep)
    emulate_slower(20.0, 1.0, clock=lambda: 1.25)
    emulate_slower(1.0, 1.0, clock=lambda: 9.0)
    assert slept == [pytest.approx(19 * 0.25)]

    path = _gemm(tmp_path / "s.onnx", "x", "y", 256, 256, 0)
    feeds = {"x": np.ones((64, 256), np.float32)}
    SegmentRunner(path).run(feeds)
    assert len(slept) == 1
    slow = SegmentRunner(path, RuntimeOptions(slowdown=20.0))
    start = time.perf_counter()
    slow.run(feeds)
    wall = time.perf_counter() - start
    assert len(slept) == 2 and 0 < slept[-1] <= 19 * wall


def test_a_slowed_single_thread_run_is_charged_its_cpu_time_not_waits_for_the_gil(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Beside a busy Python thread, a run may wait for the GIL as it returns; a 20x tier
    sleeps 19 times the run's compute, not that wait ([Note: emulating a slower tier]).

    The wait is not certain (the busy thread must hold the GIL as the run returns), so the
    test asserts the charge on every run and makes the wait likely: runs of a few
    milliseconds, and a switch interval of 20 ms that the busy thread may hold the GIL for.
    Timed in wall time, the charge exceeds the run's CPU time whenever a wait happens.
    """
    path = _gemm(tmp_path / "s.onnx", "x", "y", 1024, 1024, 0)
    feeds = {"x": np.ones((128, 1024), np.float32)}
    runner = SegmentRunner(path, RuntimeOptions(threads=1, slowdown=20.0))
    slept: list[float] = []
    monkeypatch.setattr(time, "sleep", slept.append)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(0.02)
    stop = threading.Event()

    def busy() -> None:
        while not stop.is_set():
            sum(range(1000))

    worker = threading.Thread(target=busy)
    worker.start()
    try:
        for _ in range(10):
            cpu = time.thread_time()
            runner.run(feeds)
            cpu = time.thread_time() - cpu
            assert slept[-1] / 19 <= cpu + 1e-4
    finally:
        stop.set()
        worker.join()
        sys.setswitchinterval(interval)


def test_exit_confidence_reads_logits_and_probabilities() -> None:
    assert exit_confidence(np.array([[0.1, 0.9]])) == pytest.approx(0.9)
    assert exit_confidence(np.array([[0.0, np.log(3.0)]])) == pytest.approx(0.75)
    assert exit_confidence(np.array([[0.2, 0.8], [0.6, 0.4]])) == pytest.approx(0.6)
    assert exit_confidence(np.array([[np.nan, 1.0]])) == 0.0


def test_a_tier_runs_its_segments_and_forwards_what_later_ones_need(tmp_path: Path) -> None:
    _gemm(tmp_path / "a.onnx", "x", "h", 4, 4, 1)
    _gemm(tmp_path / "b.onnx", "h", "e", 4, 2, 2)
    _gemm(tmp_path / "c.onnx", "h", "y", 4, 3, 3)
    plan = Plan(
        model_file="m.onnx",
        model_sha256="0" * 64,
        inputs=("x",),
        outputs=("y",),
        segments=(
            SegmentSpec("device", "a.onnx", ("x",), ("h",)),
            SegmentSpec("edge", "b.onnx", ("h",), ("e",), (ExitSpec("e", 0.999),)),
            SegmentSpec("cloud", "c.onnx", ("h",), ("y",)),
        ),
    )
    edge = TierRunner(plan, tmp_path, "edge")
    assert (edge.start, edge.end, edge.needs) == (1, 2, ("h",))
    feeds = {"h": np.full((1, 4), 0.01, np.float32)}
    outcome = edge.run(feeds)
    assert not outcome.final and outcome.next_segment == 2
    assert list(outcome.tensors) == ["h"] and outcome.exits_checked == ["e"]
    with pytest.raises(InputError, match="names segment 2"):
        edge.check_names({"h"}, segment=2)
    sure = dataclasses.replace(
        plan,
        segments=(
            plan.segments[0],
            SegmentSpec("edge", "b.onnx", ("h",), ("e",), (ExitSpec("e", 0.0),)),
            plan.segments[2],
        ),
    )
    outcome = TierRunner(sure, tmp_path, "edge").run(feeds)
    assert outcome.final and outcome.exit == "e" and list(outcome.tensors) == ["e"]
    cloud = TierRunner(plan, tmp_path, "cloud")
    assert cloud.run(feeds).final


def test_a_failed_run_leaves_tierflows_one_warning_and_no_line_of_onnx_runtimes(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 28 finding 8: ONNX Runtime wrote a coloured ``[E:onnxruntime...]`` line to the
    tier's stderr for every failed run, beside tierflow's own handling of the failure."""
    graph = helper.make_graph(
        [helper.make_node("Add", ["a", "b"], ["c"])],
        "add",
        [
            helper.make_tensor_value_info("a", TensorProto.FLOAT, ["n"]),
            helper.make_tensor_value_info("b", TensorProto.FLOAT, ["m"]),
        ],
        [helper.make_tensor_value_info("c", TensorProto.FLOAT, None)],
    )
    path = tmp_path / "add.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    runner = SegmentRunner(path)
    feeds = {"a": np.ones(3, np.float32), "b": np.ones(4, np.float32)}  # shapes disagree
    with (
        caplog.at_level("WARNING", logger="tierflow.runtime.segment_runner"),
        pytest.raises(ModelError, match=r"add\.onnx failed"),
    ):
        runner.run(feeds)
    assert "onnxruntime" not in capfd.readouterr().err
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    assert "add.onnx failed" in caplog.records[0].getMessage()
