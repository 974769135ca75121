"""The built-in demo model: real digits, a residual CNN trained once, then served from cache."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from tierflow.zoo import digits


@pytest.fixture(scope="module")
def built(
    demo_build: tuple[digits.DemoModel, list[digits.EpochReport]],
) -> tuple[digits.DemoModel, list[digits.EpochReport]]:
    """The run's demo model (trained once per run, see tests/conftest.py)."""
    return demo_build


@pytest.mark.integration
def test_digits_data_is_split_deterministically_and_normalised() -> None:
    data = digits.load_digits_data()
    again = digits.load_digits_data()
    assert data.train_images.shape == (1437, 1, 32, 32)
    assert data.heldout_images.shape == (360, 1, 32, 32)
    assert data.train_images.dtype == np.float32 and data.train_labels.dtype == np.int64
    assert np.array_equal(data.heldout_images, again.heldout_images)
    assert np.array_equal(data.train_labels, again.train_labels)
    # Stratified: every digit is held out in proportion (the classes have 174-183 images).
    assert np.bincount(data.heldout_labels, minlength=10).min() >= 34
    assert abs(float(data.train_images.mean())) < 1e-3
    assert float(data.train_images.std()) == pytest.approx(1.0, abs=1e-3)
    assert digits.load_digits_data(size=16).train_images.shape == (1437, 1, 16, 16)


@pytest.mark.integration
@pytest.mark.slow
def test_demo_model_is_accurate_and_well_formed(
    built: tuple[digits.DemoModel, list[digits.EpochReport]],
) -> None:
    demo, reports = built
    assert demo.built
    assert [r.epoch for r in reports] == list(range(1, reports[0].epochs + 1))
    assert 50_000 <= demo.meta.params <= 300_000
    # Accuracy measured here, independently of the figure the build recorded.
    with np.load(demo.heldout_path) as heldout:
        images, labels = heldout["image"], heldout["labels"]
    assert images.shape == (360, 1, 1, 32, 32) and labels.shape == (360,)
    session = ort.InferenceSession(str(demo.model_path), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == ["image"]
    assert [o.name for o in session.get_outputs()] == ["logits"]
    logits = session.run(["logits"], {"image": images[:, 0]})[0]  # the batch dim is dynamic
    accuracy = float((logits.argmax(axis=1) == labels).mean())
    assert accuracy >= 0.95
    assert accuracy == pytest.approx(demo.meta.accuracy)
    one = session.run(["logits"], {"image": images[0]})[0]
    assert one.shape == (1, 10)
    model = onnx.load(str(demo.model_path))
    assert not any(t.data_location == onnx.TensorProto.EXTERNAL for t in model.graph.initializer)
    assert {n.op_type for n in model.graph.node} >= {"Conv", "Add", "Relu"}  # residual
    with np.load(demo.calib_path) as calib:
        assert calib["image"].shape == (1437, 1, 1, 32, 32) and calib["labels"].shape == (1437,)


@pytest.mark.integration
@pytest.mark.slow
def test_cached_model_loads_without_retraining(
    built: tuple[digits.DemoModel, list[digits.EpochReport]],
) -> None:
    demo, _ = built
    before = demo.meta_path.read_text()
    reports: list[digits.EpochReport] = []
    again = digits.build_demo_model(demo.directory, progress=reports.append)
    assert not again.built
    assert reports == []  # no epoch ran
    assert again.meta == demo.meta
    assert demo.meta_path.read_text() == before


@pytest.mark.integration
@pytest.mark.slow
def test_corrupt_or_stale_caches_are_rejected(
    built: tuple[digits.DemoModel, list[digits.EpochReport]], tmp_path: Path
) -> None:
    demo, _ = built
    assert digits.cache_is_valid(demo.directory)

    def copy(name: str) -> Path:
        target = tmp_path / name
        shutil.copytree(demo.directory, target)
        return target

    truncated = copy("truncated")
    data = (truncated / digits.MODEL_FILE).read_bytes()
    (truncated / digits.MODEL_FILE).write_bytes(data[: len(data) // 2])
    assert not digits.cache_is_valid(truncated)

    missing = copy("missing")
    (missing / digits.HELDOUT_FILE).unlink()
    assert not digits.cache_is_valid(missing)

    stale = copy("stale")
    meta = json.loads((stale / digits.META_FILE).read_text())
    meta["recipe"] = digits.RECIPE_VERSION - 1
    (stale / digits.META_FILE).write_text(json.dumps(meta))
    assert not digits.cache_is_valid(stale)

    garbled = copy("garbled")
    (garbled / digits.META_FILE).write_text("{not json")
    assert not digits.cache_is_valid(garbled)
    assert not digits.cache_is_valid(tmp_path / "empty")


def test_default_cache_dir_follows_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIERFLOW_CACHE", "/some/where")
    assert digits.default_cache_dir() == Path("/some/where/demo")
    monkeypatch.delenv("TIERFLOW_CACHE")
    assert digits.default_cache_dir() == Path.home() / ".cache" / "tierflow" / "demo"


@pytest.mark.integration
def test_training_says_what_it_does_between_epochs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first epoch ends long after the build starts: status lines fill the wait."""
    pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    monkeypatch.setattr(digits, "_BATCH", 2)
    images = rng.standard_normal((16, 1, 32, 32)).astype(np.float32)
    labels = rng.integers(0, 10, len(images)).astype(np.int64)
    data = digits.DigitsData(images, labels, images[:4], labels[:4], 0.0, 1.0)
    monkeypatch.setattr(digits, "_EPOCHS", 2)
    monkeypatch.setattr(digits, "_STATUS_EVERY_S", 0.0)  # a status after every batch
    events: list[str] = []
    digits._train(data, lambda r: events.append(f"epoch {r.epoch} done"), events.append)
    assert events[0].startswith("setting up the network")
    first_epoch = events.index("epoch 1 done")
    during = [e.split(" (")[0] for e in events[1:first_epoch]]
    assert during == [f"epoch 1/2: {(i + 1) / 8:.0%}" for i in range(8)]  # one per batch
    assert events[-1] == "epoch 2 done"
