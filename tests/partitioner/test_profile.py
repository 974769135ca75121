"""Profiling a tiny model on this machine: structure, codecs, emulation, model checks."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest

from tierflow.codec.base import PLANNER_CODECS
from tierflow.errors import ProfileError
from tierflow.partitioner.graph import ModelGraph, load_model
from tierflow.partitioner.profile import (
    Profile,
    capture_features,
    load_profile,
    make_session,
    profile_model,
    save_profile,
)
from tierflow.partitioner.split import extract_segment

pytestmark = pytest.mark.integration

_CACHE: dict[str, tuple[ModelGraph, Profile]] = {}


def _profiled(zoo_exports: Any, name: str) -> tuple[ModelGraph, Profile]:
    if name not in _CACHE:
        graph = load_model(zoo_exports.path(name, dynamo=False))
        _CACHE[name] = (graph, profile_model(graph, threads=1, time_budget_s=2.0))
    return _CACHE[name]


def test_profile_covers_every_unit_and_cut(zoo_exports: Any) -> None:
    graph, profile = _profiled(zoo_exports, "resnet18")
    assert len(profile.cuts) == len(graph.cuts)
    assert len(profile.units) == len(graph.cuts) - 1
    assert profile.model_sha256 == graph.sha256
    assert [c.nbytes for c in profile.cuts] == [c.nbytes for c in graph.cuts]
    assert all(u.compute_s >= 0 for u in profile.units)
    assert sum(u.compute_s for u in profile.units) > 0
    assert sum(u.weight_bytes for u in profile.units) == graph.weight_bytes(0, len(graph.cuts) - 1)
    for i, unit in enumerate(profile.units):
        assert unit.peak_activation_bytes == graph.peak_activation_bytes(i, i + 1)
    assert profile.machine.threads == 1 and not profile.machine.emulated
    assert profile.machine.onnxruntime
    assert profile.machine.providers == ("CPUExecutionProvider",)
    assert profile.machine.describe().endswith("on cpu")


def test_codecs_are_measured_on_the_real_features(zoo_exports: Any) -> None:
    graph, profile = _profiled(zoo_exports, "resnet18")
    for cut in profile.cuts:
        assert tuple(cut.codecs) == PLANNER_CODECS
        assert cut.codecs["raw"].ratio == pytest.approx(1.0)
        assert cut.codecs["zstd"].max_abs_error == 0.0
    features = capture_features(graph)
    middle = profile.cuts[len(profile.cuts) // 2]
    data = np.concatenate([features[t].ravel() for t in middle.tensors])
    # int8 keeps 1 byte of 4 and its error is at most half a quantisation step.
    assert middle.codecs["int8"].ratio > 3.5
    step = (data.max() - data.min()) / 255
    assert 0 < middle.codecs["int8"].max_abs_error <= step / 2 + 1e-6


def test_predicted_whole_model_time_is_near_a_measured_run(zoo_exports: Any) -> None:
    graph, profile = _profiled(zoo_exports, "resnet18")
    whole = make_session(extract_segment(graph, 0, len(graph.cuts) - 1), 1)
    feeds = graph.representative_inputs()
    whole.run(None, feeds)
    times = []
    for _ in range(20):
        start = time.perf_counter()
        whole.run(None, feeds)
        times.append(time.perf_counter() - start)
    measured = float(np.median(times))
    predicted = profile.segment_s(0, len(profile.units))
    # Generous: the machine is shared; this catches unit sums that are far off.
    assert measured / 3 < predicted < measured * 3


def test_slowdown_emulation_and_round_trip(zoo_exports: Any, tmp_path: Any) -> None:
    graph, _ = _profiled(zoo_exports, "chain_cnn")
    steps: list[tuple[int, int]] = []
    slow = profile_model(
        graph, slowdown=8.0, time_budget_s=0.5, progress=lambda d, t, _: steps.append((d, t))
    )
    assert slow.machine.emulated and slow.slowdown == 8.0
    assert steps[-1][0] == steps[-1][1] and len(steps) == steps[-1][1]
    here = slow.emulate(1.0)
    assert slow.overhead_s == pytest.approx(8.0 * here.overhead_s)
    # Every time scales, the codecs' too; sizes and ratios stay.
    for cut, base in zip(slow.cuts, here.cuts, strict=True):
        assert cut.codecs == {name: s.slower(8.0) for name, s in base.codecs.items()}
    assert slow.units[0].compute_s == pytest.approx(8.0 * here.units[0].compute_s)
    path = save_profile(slow, tmp_path / "slow.json")
    assert load_profile(path, graph) == slow


def test_a_profile_of_another_model_is_refused(zoo_exports: Any, tmp_path: Any) -> None:
    _, profile = _profiled(zoo_exports, "chain_cnn")
    other, _ = _profiled(zoo_exports, "resnet18")
    path = save_profile(profile, tmp_path / "chain.json")
    with pytest.raises(
        ProfileError,
        match=r"another model: it names model\.onnx \(sha256 \w+\), but the model is .*resnet18",
    ):
        load_profile(path, other)
    (tmp_path / "bad.json").write_text('{"format": "tierflow.profile/1"')
    with pytest.raises(ProfileError, match="cannot read profile"):
        load_profile(tmp_path / "bad.json")
    with pytest.raises(ProfileError, match="no profile at"):
        load_profile(tmp_path / "missing.json")
