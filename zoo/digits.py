"""The built-in demo model: a small residual CNN trained on scikit-learn's digits.

``tierflow demo``, the exit benchmark and several tests need a real classifier that
reaches good accuracy without downloading anything. scikit-learn ships 1797 real 8x8
hand-written digits; we scale them to 32x32 so the network has several resolutions to
cut between (a stem, then residual stages at 32x32, 16x16, 8x8 and 4x4), train it once
with torch (about a minute on two shared cores: importing torch, scaling the data, six
epochs; ``status`` and ``progress`` report each step), export it to ONNX and cache
everything:

``CACHE/model.onnx``    single file, weights embedded; input ``image`` [batch,1,32,32],
                        output ``logits`` [batch,10]
``CACHE/heldout.npz``   the held-out split as request arrays: ``image`` [N,1,1,32,32],
                        ``labels`` [N]
``CACHE/calib.npz``     a calibration set from the training split, same layout
``CACHE/meta.json``     accuracy, training seconds, sha256 of every file, recipe version

Later calls validate the cache (recipe version, every file present, sha256s matching)
and load it; a missing or corrupt cache is rebuilt. Builds hold an exclusive lock on
``CACHE/.lock`` and every file is written to a temporary name and renamed, so two
concurrent callers neither train twice nor see half-written files.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tierflow.errors import ModelError
from tierflow.zoo.cache_files import exclusive_lock as _exclusive_lock
from tierflow.zoo.cache_files import sha256_file as _sha256
from tierflow.zoo.cache_files import write_atomic as _write_atomic
from tierflow.zoo.exporting import quiet_onnx_export

logger = logging.getLogger(__name__)

# Bump when the data, architecture or training changes: old caches are then rebuilt.
RECIPE_VERSION = 2
IMAGE_SIZE = 32
NUM_CLASSES = 10
INPUT_NAME = "image"
OUTPUT_NAME = "logits"
MODEL_FILE = "model.onnx"
HELDOUT_FILE = "heldout.npz"
CALIB_FILE = "calib.npz"
META_FILE = "meta.json"
_CACHED_FILES = (MODEL_FILE, HELDOUT_FILE, CALIB_FILE)

_SEED = 0
_HELDOUT_FRACTION = 0.2  # 1437 train / 360 held-out of sklearn's 1797 digits
_EPOCHS = 6
_BATCH = 64
_THREADS = 1
# While training, a status line at least this often (the first epoch ends after ~10 s).
_STATUS_EVERY_S = 4.0


@dataclass(frozen=True)
class DigitsData:
    """The digits scaled to ``size``x``size``, normalised, split into train and held-out.

    Images are float32 [N,1,size,size]; labels int64 [N]. The split is stratified and
    fixed by seed 0, so every caller sees the same images in the same order.
    """

    train_images: np.ndarray
    train_labels: np.ndarray
    heldout_images: np.ndarray
    heldout_labels: np.ndarray
    mean: float
    std: float


@dataclass(frozen=True)
class EpochReport:
    """Progress of the one-time training, passed to the optional progress callback."""

    epoch: int
    epochs: int
    loss: float
    heldout_accuracy: float
    seconds: float


@dataclass(frozen=True)
class DemoMeta:
    """What ``meta.json`` records about a built demo model."""

    recipe: int
    accuracy: float
    train_seconds: float
    params: int
    sha256: dict[str, str]
    heldout_size: int
    calib_size: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "recipe": self.recipe,
            "accuracy": self.accuracy,
            "train_seconds": self.train_seconds,
            "params": self.params,
            "sha256": dict(self.sha256),
            "heldout_size": self.heldout_size,
            "calib_size": self.calib_size,
        }

    @classmethod
    def from_dict(cls, data: Any) -> DemoMeta:
        if not isinstance(data, dict):
            raise ModelError(f"malformed demo meta: expected a JSON object, got {type(data)}")
        try:
            sha = data["sha256"]
            if not isinstance(sha, dict):
                raise TypeError("sha256 must be an object")
            return cls(
                recipe=int(data["recipe"]),
                accuracy=float(data["accuracy"]),
                train_seconds=float(data["train_seconds"]),
                params=int(data["params"]),
                sha256={str(k): str(v) for k, v in sha.items()},
                heldout_size=int(data["heldout_size"]),
                calib_size=int(data["calib_size"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelError(f"malformed demo meta: {exc}") from exc


@dataclass(frozen=True)
class DemoModel:
    """The cached demo model and its data files.

    ``built`` is True when this call trained the model, False when it came from the cache.
    """

    directory: Path
    meta: DemoMeta
    built: bool

    @property
    def model_path(self) -> Path:
        return self.directory / MODEL_FILE

    @property
    def heldout_path(self) -> Path:
        return self.directory / HELDOUT_FILE

    @property
    def calib_path(self) -> Path:
        return self.directory / CALIB_FILE

    @property
    def meta_path(self) -> Path:
        return self.directory / META_FILE


def default_cache_dir() -> Path:
    """``$TIERFLOW_CACHE/demo`` if set, else ``~/.cache/tierflow/demo``."""
    root = os.environ.get("TIERFLOW_CACHE")
    if root:
        return Path(root).expanduser() / "demo"
    return Path.home() / ".cache" / "tierflow" / "demo"


def load_digits_data(size: int = IMAGE_SIZE) -> DigitsData:
    """Load sklearn's digits, scale them bilinearly to ``size`` and split 80/20 stratified.

    Normalisation uses the training split's mean and std, so held-out data carries no
    information into training.
    """
    import torch
    import torch.nn.functional as F
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    raw = np.asarray(digits.images, dtype=np.float32) / 16.0  # [N,8,8], values 0..1
    labels = np.asarray(digits.target, dtype=np.int64)
    scaled = F.interpolate(
        torch.from_numpy(raw[:, None]), size=(size, size), mode="bilinear", align_corners=False
    ).numpy()
    train_idx, heldout_idx = train_test_split(
        np.arange(len(labels)), test_size=_HELDOUT_FRACTION, random_state=_SEED, stratify=labels
    )
    mean = float(scaled[train_idx].mean())
    std = float(scaled[train_idx].std())
    images = ((scaled - mean) / std).astype(np.float32)
    return DigitsData(
        train_images=images[train_idx],
        train_labels=labels[train_idx],
        heldout_images=images[heldout_idx],
        heldout_labels=labels[heldout_idx],
        mean=mean,
        std=std,
    )


def build_demo_model(
    cache_dir: Path | None = None,
    progress: Callable[[EpochReport], None] | None = None,
    status: Callable[[str], None] | None = None,
) -> DemoModel:
    """Return the demo model, training and caching it the first time.

    Training takes about a minute on two shared cores. The cache is validated on every
    call (see the module docstring); pass ``progress`` to follow the epochs of a build
    and ``status`` for a line at least every few seconds while it trains.
    """
    directory = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    meta = _valid_meta(directory)
    if meta is not None:
        logger.debug("[demo] using cached model in %s", directory)
        return DemoModel(directory, meta, built=False)
    with _exclusive_lock(directory / ".lock"):
        meta = _valid_meta(directory)  # another process may have built it meanwhile
        if meta is not None:
            return DemoModel(directory, meta, built=False)
        logger.info("[demo] no valid cached model in %s: training one", directory)
        say = status or _quiet
        say(f"no cached model in {directory}: training it once (about a minute)")
        meta = _build_into(directory, progress, say)
    return DemoModel(directory, meta, built=True)


def cache_is_valid(cache_dir: Path) -> bool:
    """Whether ``cache_dir`` holds a complete, uncorrupted demo model of this recipe."""
    return _valid_meta(Path(cache_dir)) is not None


def _valid_meta(directory: Path) -> DemoMeta | None:
    try:
        meta = DemoMeta.from_dict(json.loads((directory / META_FILE).read_text()))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, ModelError) as exc:
        logger.debug("[demo] cache %s unusable: %s", directory, exc)
        return None
    if meta.recipe != RECIPE_VERSION:
        logger.info(
            "[demo] cache %s has recipe %s, expected %s", directory, meta.recipe, RECIPE_VERSION
        )
        return None
    for name in _CACHED_FILES:
        try:
            digest = _sha256(directory / name)
        except OSError:
            logger.info("[demo] cache %s lacks %s", directory, name)
            return None
        if meta.sha256.get(name) != digest:
            logger.warning("[demo] cached %s is corrupt (sha256 mismatch): rebuilding", name)
            return None
    return meta


def _save_npz(path: Path, **arrays: np.ndarray) -> None:
    def write(tmp: Path) -> None:
        with tmp.open("wb") as stream:
            np.savez(stream, **arrays)  # type: ignore[arg-type]

    _write_atomic(path, write)


def _quiet(_: str) -> None:
    """The status callback when none is given."""


def _build_into(
    directory: Path,
    progress: Callable[[EpochReport], None] | None,
    status: Callable[[str], None] = _quiet,
) -> DemoMeta:
    begin = time.perf_counter()
    status("loading torch and scikit-learn's digits, scaling them to 32x32")
    import torch

    data = load_digits_data()
    status(
        f"{len(data.train_labels)} training and {len(data.heldout_labels)} held-out images "
        f"ready ({time.perf_counter() - begin:.0f} s); training {_EPOCHS} epochs"
    )
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(min(_THREADS, previous_threads))
    try:
        start = time.perf_counter()
        model = _train(data, progress, status)
        train_seconds = time.perf_counter() - start
        params = sum(p.numel() for p in model.parameters())
        status("exporting to ONNX and measuring its accuracy in ONNX Runtime")
        _write_atomic(directory / MODEL_FILE, lambda tmp: _export(model, tmp))
    finally:
        torch.set_num_threads(previous_threads)
    # The accuracy recorded is the exported model's, run by ONNX Runtime as tiers run it.
    accuracy = onnx_accuracy(directory / MODEL_FILE, data.heldout_images, data.heldout_labels)
    logger.info(
        "[demo] trained %d params in %.1f s: held-out accuracy %.2f%% (ONNX Runtime)",
        params,
        train_seconds,
        100 * accuracy,
    )

    # One request per row: [N,1,1,32,32], as IN.npz files are laid out.
    _save_npz(
        directory / HELDOUT_FILE,
        image=data.heldout_images[:, None],
        labels=data.heldout_labels,
    )
    _save_npz(
        directory / CALIB_FILE,
        image=data.train_images[:, None],
        labels=data.train_labels,
    )
    meta = DemoMeta(
        recipe=RECIPE_VERSION,
        accuracy=accuracy,
        train_seconds=round(train_seconds, 3),
        params=params,
        sha256={name: _sha256(directory / name) for name in _CACHED_FILES},
        heldout_size=len(data.heldout_labels),
        calib_size=len(data.train_labels),
    )
    text = json.dumps(meta.to_dict(), indent=2) + "\n"

    def write_meta(tmp: Path) -> None:
        tmp.write_text(text)

    _write_atomic(directory / META_FILE, write_meta)
    return meta


def onnx_accuracy(model_path: Path, images: np.ndarray, labels: np.ndarray) -> float:
    """Top-1 accuracy of the ONNX model at ``model_path`` on rows ``images`` [N,1,32,32]."""
    from tierflow.onnxrt.inference import open_session

    session = open_session(
        model_path, threads=0, optimization="all", what=f"the demo model {model_path}"
    )
    try:
        logits = session.run([OUTPUT_NAME], {INPUT_NAME: images})[0]
    except Exception as exc:
        raise ModelError(f"ONNX Runtime cannot run the demo model {model_path}: {exc}") from exc
    return float((np.asarray(logits).argmax(axis=1) == labels).mean())


def _make_network() -> Any:
    """Stem + four residual stages (32, 16, 8, 4 pixels), global pool, linear: ~170k params."""
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self, cin: int, cout: int, stride: int) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(cout)
            self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(cout)
            self.shortcut: nn.Module = nn.Identity()
            if stride != 1 or cin != cout:
                self.shortcut = nn.Sequential(
                    nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
                )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = torch.relu(self.bn1(self.conv1(x)))
            y = self.bn2(self.conv2(y))
            return torch.relu(y + self.shortcut(x))

    class DigitsNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.Sequential(
                nn.Conv2d(1, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU()
            )
            self.stages = nn.Sequential(
                Block(16, 16, 1),
                Block(16, 32, 2),
                Block(32, 64, 2),
                Block(64, 64, 2),
            )
            self.head = nn.Linear(64, NUM_CLASSES)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.stages(self.stem(x))
            return self.head(y.mean(dim=(2, 3)))

    return DigitsNet()


def _augment(images: Any, generator: Any) -> Any:
    """Random shifts of up to 2 pixels: cheap, label-preserving, deterministic by seed."""
    import torch

    padded = torch.nn.functional.pad(images, (2, 2, 2, 2), mode="replicate")
    n = images.shape[0]
    dx = torch.randint(0, 5, (n,), generator=generator)
    dy = torch.randint(0, 5, (n,), generator=generator)
    rows = (torch.arange(IMAGE_SIZE)[None, :] + dy[:, None])[:, None, :, None]
    cols = (torch.arange(IMAGE_SIZE)[None, :] + dx[:, None])[:, None, None, :]
    batch = torch.arange(n)[:, None, None, None]
    return padded[batch, 0, rows, cols]


def _train(
    data: DigitsData,
    progress: Callable[[EpochReport], None] | None,
    status: Callable[[str], None] = _quiet,
) -> Any:
    import torch

    start = said = time.perf_counter()
    status("setting up the network and its optimizer (torch initialises on first use)")
    torch.manual_seed(_SEED)
    generator = torch.Generator().manual_seed(_SEED)
    model = _make_network()
    images = torch.from_numpy(data.train_images)
    labels = torch.from_numpy(data.train_labels)
    steps = _EPOCHS * ((len(labels) + _BATCH - 1) // _BATCH)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=1e-4)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=6e-3, total_steps=steps)
    for epoch in range(_EPOCHS):
        model.train()
        order = torch.randperm(len(labels), generator=generator)
        total_loss = 0.0
        for first in range(0, len(labels), _BATCH):
            index = order[first : first + _BATCH]
            batch = _augment(images[index], generator)
            loss = torch.nn.functional.cross_entropy(model(batch), labels[index])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            schedule.step()
            total_loss += float(loss.detach()) * len(index)
            if time.perf_counter() - said >= _STATUS_EVERY_S:
                said = time.perf_counter()
                done = min(first + _BATCH, len(labels)) / len(labels)
                status(f"epoch {epoch + 1}/{_EPOCHS}: {done:.0%} ({said - start:.0f} s)")
        said = time.perf_counter()
        report = EpochReport(
            epoch=epoch + 1,
            epochs=_EPOCHS,
            loss=total_loss / len(labels),
            heldout_accuracy=_accuracy(model, data.heldout_images, data.heldout_labels),
            seconds=time.perf_counter() - start,
        )
        logger.info(
            "[demo] epoch %d/%d: loss %.4f, held-out accuracy %.2f%% (%.1f s)",
            report.epoch,
            report.epochs,
            report.loss,
            100 * report.heldout_accuracy,
            report.seconds,
        )
        if progress is not None:
            progress(report)
    model.eval()
    return model


def _accuracy(model: Any, images: np.ndarray, labels: np.ndarray) -> float:
    import torch

    model.eval()
    with torch.no_grad():
        predicted = model(torch.from_numpy(images)).argmax(dim=1).numpy()
    return float((predicted == labels).mean())


def _export(model: Any, path: Path) -> None:
    """Export to one ONNX file, weights embedded, with a dynamic batch dimension."""
    import torch

    example = torch.zeros(1, 1, IMAGE_SIZE, IMAGE_SIZE)
    batch = torch.export.Dim("batch", min=1, max=4096)
    try:
        with quiet_onnx_export():
            torch.onnx.export(
                model,
                (example,),
                str(path),
                input_names=[INPUT_NAME],
                output_names=[OUTPUT_NAME],
                dynamo=True,
                external_data=False,
                dynamic_shapes=({0: batch},),
                verbose=False,
            )
    except Exception as exc:  # the exporter raises many unrelated types
        raise ModelError(f"exporting the demo model to ONNX failed: {exc}") from exc
