"""Training a learned bottleneck: a small convolutional encoder/decoder pair around a feature.

See [Note: learned bottleneck] in :mod:`tierflow.partitioner.bottleneck.add` for what is
trained and why. This module holds the numbers: the PCA start, the distillation loop in
torch, and :class:`TorchTrainer`, which ``tierflow bottleneck add`` hands to the
planner-side code (which imports no torch). Weights come back as plain arrays in the form
the graph runs (codes in 0..L-1, L = 2**bits; see
:class:`tierflow.partitioner.bottleneck.graft.BottleneckWeights`). Needs torch (the
``train`` extra).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

_PCA_ROWS = 20_000  # feature vectors (pixels) used to find the principal directions
_SPREAD = 2.0  # the code range covers +-_SPREAD standard deviations of each direction


@dataclass(frozen=True)
class TrainSettings:
    """How long and how hard to train; the defaults suit a few hundred calibration images."""

    steps: int = 300
    batch: int = 32
    learning_rate: float = 3e-3
    output_weight: float = 1.0
    seed: int = 0


def pca_start(features: np.ndarray, channels: int, seed: int = 0) -> tuple[np.ndarray, ...]:
    """Mean [C], the top ``channels`` principal directions [k, C] and their std devs [k].

    The encoder starts as the projection onto these directions, so training begins from
    the best linear k-channel code instead of from noise.
    """
    pixels = features.transpose(0, 2, 3, 1).reshape(-1, features.shape[1]).astype(np.float64)
    if len(pixels) > _PCA_ROWS:
        pick = np.random.default_rng(seed).choice(len(pixels), _PCA_ROWS, replace=False)
        pixels = pixels[pick]
    mean = pixels.mean(axis=0)
    covariance = np.cov(pixels - mean, rowvar=False).reshape(len(mean), len(mean))
    values, vectors = np.linalg.eigh(covariance)
    order = np.argsort(values)[::-1][:channels]
    stds = np.sqrt(np.maximum(values[order], 1e-12))
    return mean, vectors[:, order].T, stds


def _start_weights(features: np.ndarray, channels: int, seed: int) -> list[np.ndarray]:
    """Encoder and decoder weights that compute the rank-k PCA reconstruction exactly.

    Codes z in [0, 1]: z = (u + 1) / 2 with u = directions . (x - mean) / (spread * std).
    The decoder's hidden layer holds +r and -r (r the linear reconstruction) so that after
    its ReLU the 1x1 layer [I, -I] gives r back whatever its sign.
    """
    mean, directions, stds = pca_start(features, channels, seed)
    k, c = directions.shape
    enc_w = np.zeros((k, c, 3, 3))
    enc_w[:, :, 1, 1] = directions / (_SPREAD * stds)[:, None] / 2.0
    enc_b = 0.5 - enc_w[:, :, 1, 1] @ mean
    recon_w = (directions * (2.0 * _SPREAD * stds)[:, None]).T  # [C, k]
    recon_b = mean - recon_w.sum(axis=1) / 2.0
    dec1_w = np.zeros((2 * c, k, 3, 3))
    dec1_w[:c, :, 1, 1], dec1_w[c:, :, 1, 1] = recon_w, -recon_w
    dec1_b = np.concatenate([recon_b, -recon_b])
    dec2_w = np.concatenate([np.eye(c), -np.eye(c)], axis=1)[:, :, None, None]
    dec2_b = np.zeros(c)
    return [enc_w, enc_b, dec1_w, dec1_b, dec2_w, dec2_b]


def _as_logits(torch: Any, output: Any, probabilities: bool) -> Any:
    return torch.log(output.clamp_min(1e-8)) if probabilities else output


def train_bottleneck(
    features: np.ndarray,
    teacher: Sequence[np.ndarray],
    tail: Callable[[Any], list[Any]] | None,
    channels: int,
    bits: int,
    settings: TrainSettings,
) -> dict[str, Any]:
    """Distil a ``channels``-wide, ``bits``-bit bottleneck from the frozen model.

    ``features`` [N,C,H,W] are the model's own features at the cut, ``teacher`` its
    outputs for the same rows; ``tail`` (or None) maps a feature to the outputs in torch.
    Loss: MSE of the reconstructed feature over its variance; with a tail, plus
    ``output_weight`` x (MSE of each output over its variance, and for 2-D class outputs
    the KL divergence from the teacher's class distribution). Rounding to the code levels
    is in the loop, with a straight-through gradient.
    """
    import torch

    # One thread: the tensors are small, and on a shared machine torch's thread pool
    # spins against other processes (measured 8x slower with 2 threads on 2 busy cores).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train(torch, features, teacher, tail, channels, bits, settings)
    finally:
        torch.set_num_threads(threads)


def _train(
    torch: Any,
    features: np.ndarray,
    teacher: Sequence[np.ndarray],
    tail: Callable[[Any], list[Any]] | None,
    channels: int,
    bits: int,
    settings: TrainSettings,
) -> dict[str, Any]:
    torch.manual_seed(settings.seed)
    generator = np.random.default_rng(settings.seed)
    levels = (1 << bits) - 1
    relu = bool(features.min() >= 0.0)
    params = [
        torch.tensor(a, dtype=torch.float32, requires_grad=True)
        for a in _start_weights(features, channels, settings.seed)
    ]
    k = int(params[0].shape[0])
    optimizer = torch.optim.Adam(params, lr=settings.learning_rate)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, max(settings.steps, 1))
    feature_var = float(features.var()) or 1.0
    output_vars = [float(t.var()) or 1.0 for t in teacher]
    x_all = torch.from_numpy(np.ascontiguousarray(features, dtype=np.float32))
    t_all = [torch.from_numpy(np.ascontiguousarray(t, dtype=np.float32)) for t in teacher]
    classes = [t.ndim == 2 and t.shape[1] >= 2 for t in teacher]
    probabilities = [
        bool(c and t.min() >= 0 and np.allclose(t.sum(axis=1), 1.0, atol=1e-3))
        for c, t in zip(classes, teacher, strict=True)
    ]
    conv = torch.nn.functional.conv2d

    def reconstruct(x: Any) -> Any:
        code = torch.clamp(conv(x, params[0], params[1], padding=1), 0.0, 1.0) * levels
        code = code + (torch.round(code) - code).detach()  # straight-through rounding
        hidden = torch.relu(conv(code / levels, params[2], params[3], padding=1))
        out = conv(hidden, params[4], params[5])
        return torch.relu(out) if relu else out

    def feature_loss() -> float:
        """The reconstruction loss over every training row (no gradients)."""
        with torch.no_grad():
            total = sum(
                float(torch.sum((reconstruct(x_all[i : i + 64]) - x_all[i : i + 64]) ** 2))
                for i in range(0, len(x_all), 64)
            )
        return total / x_all.numel() / feature_var

    start = [p.detach().clone() for p in params]
    start_loss = feature_loss()
    for step in range(settings.steps):
        rows = torch.from_numpy(generator.choice(len(x_all), min(settings.batch, len(x_all))))
        x = x_all[rows]
        rebuilt = reconstruct(x)
        loss = torch.mean((rebuilt - x) ** 2) / feature_var
        if tail is not None and settings.output_weight > 0:
            got_all = tail(rebuilt)
            for i, (got, want) in enumerate(zip(got_all, t_all, strict=True)):
                target = want[rows]
                loss = (
                    loss + settings.output_weight * torch.mean((got - target) ** 2) / output_vars[i]
                )
                if classes[i]:
                    student = torch.log_softmax(_as_logits(torch, got, probabilities[i]), dim=1)
                    teacher_p = torch.softmax(_as_logits(torch, target, probabilities[i]), dim=1)
                    kl = torch.nn.functional.kl_div(student, teacher_p, reduction="batchmean")
                    loss = loss + settings.output_weight * kl
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        if step % 100 == 0 or step == settings.steps - 1:
            logger.info(
                "[bottleneck] k=%d bits=%d step %d/%d: loss %.4g",
                k,
                bits,
                step + 1,
                settings.steps,
                float(loss.detach()),
            )
    if tail is None and feature_loss() > start_loss:
        # Training made the reconstruction worse than the PCA start (it can, with few
        # steps and coarse codes): keep the start.
        logger.info(
            "[bottleneck] k=%d bits=%d: keeping the PCA start (loss %.4g)", k, bits, start_loss
        )
        params = start
    e_w, e_b, d1_w, d1_b, d2_w, d2_b = (p.detach().numpy().astype(np.float64) for p in params)
    # Fold the code scale into the convolutions: the graph's codes are integers 0..levels.
    return {
        "channels": k,
        "bits": bits,
        "enc_w": (e_w * levels).astype(np.float32),
        "enc_b": (e_b * levels).astype(np.float32),
        "dec1_w": (d1_w / levels).astype(np.float32),
        "dec1_b": d1_b.astype(np.float32),
        "dec2_w": d2_w.astype(np.float32),
        "dec2_b": d2_b.astype(np.float32),
        "relu": relu,
    }


class TorchTrainer:
    """Trains bottlenecks in torch for :func:`tierflow.partitioner.bottleneck.add.add_bottleneck`.

    :meth:`prepare` builds the torch re-run of the layers after the cut
    (:mod:`tierflow.zoo.torch_tail`) once, checked against ONNX Runtime's outputs, and
    says how training distils; :meth:`train` trains one (channels, bits) point.
    """

    def __init__(self, settings: TrainSettings | None = None, *, outputs: bool = True) -> None:
        self.settings = settings or TrainSettings()
        self.outputs = outputs
        self._tail: Callable[[Any], list[Any]] | None = None

    def prepare(
        self,
        model: Any,
        at: str,
        outputs: Sequence[str],
        features: np.ndarray,
        teacher: Sequence[np.ndarray],
    ) -> str:
        """Set up distillation for the analysed ``model`` cut at ``at``; describe it."""
        from tierflow.zoo.torch_tail import checked_tail

        if not self.outputs:
            self._tail = None
            return "features only (asked for)"
        self._tail, description = checked_tail(model, at, outputs, features, teacher)
        return description

    def train(
        self, features: np.ndarray, teacher: Sequence[np.ndarray], channels: int, bits: int
    ) -> dict[str, Any]:
        return train_bottleneck(features, teacher, self._tail, channels, bits, self.settings)
