"""A trained streaming model that ships inside a PyPI package: Silero VAD, with its state.

Silero VAD (``pip install silero-vad``, a ``dev`` dependency; nothing downloaded at run
time) is a voice activity detector run on 512-sample chunks of 16 kHz audio; it carries
an LSTM state from chunk to chunk: inputs ``input`` [batch, 512], ``state`` [2, batch,
128] and ``sr`` (the sample rate, a scalar), outputs ``output`` [batch, 1] (speech
probability) and ``stateN``, the next chunk's state. The pair ``state -> stateN`` is
found by name ([Note: state pairs] in :mod:`tierflow.state.pairs`), so ``tierflow plan``
keeps it on one tier.

The package ships several exports of the same network; :data:`VARIANTS` names the ones
tierflow plans: ``16k_op15`` (opset 15, 16 kHz only), ``op18_ifless`` (opset 18, both
rates, no If node) and ``if`` (``silero_vad.onnx``, the published default: the whole
network inside one If on the sample rate, whose branches keep the shapes the model
shipped with, [Note: shapes a branch reads] in :mod:`tierflow.partitioner.shapes`).
Only the files are used: the package's Python code (which imports torch) never runs;
:func:`vad_path` finds a file through the import system's spec of the package.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import numpy as np

from tierflow.errors import ModelError, UsageError

PACKAGE = "silero_vad"
VARIANTS = {
    "16k_op15": "silero_vad_16k_op15.onnx",
    "op18_ifless": "silero_vad_op18_ifless.onnx",
    "if": "silero_vad.onnx",
}
CHUNK = 512
RATE = 16000


def vad_path(variant: str = "16k_op15") -> Path:
    """The ONNX file of a Silero VAD ``variant``; a :class:`ModelError` if not installed."""
    if variant not in VARIANTS:
        raise UsageError(f"unknown Silero VAD variant {variant!r}: expected {', '.join(VARIANTS)}")
    spec = importlib.util.find_spec(PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / "data" / VARIANTS[variant]
        if path.is_file():
            return path
    raise ModelError(
        f"Silero VAD is not installed (pip install silero-vad): no {VARIANTS[variant]} found"
    )


def chunks(count: int, *, seed: int = 0) -> dict[str, np.ndarray]:
    """``count`` consecutive chunks as ``IN.npz`` arrays: a session's requests in order.

    The audio is synthetic (no recording ships offline): faint noise, then a 150 Hz tone
    with harmonics under a syllable-rate envelope. It is no speech (the detector says
    so), but it moves the state as any audio does, which is what a split must carry.
    ``state`` is zeros (a session's start), ``sr`` 16000.
    """
    rng = np.random.default_rng(seed)
    t = np.arange(count * CHUNK) / RATE
    voiced = sum(np.sin(2 * math.pi * 150 * k * t) / k for k in (1, 2, 3))
    envelope = (t > t[-1] / 3) * (0.5 + 0.5 * np.sin(2 * math.pi * 4 * t)) ** 2
    audio = 0.3 * voiced * envelope + 0.003 * rng.standard_normal(t.shape)
    return {
        "input": audio.astype(np.float32).reshape(count, 1, CHUNK),
        "state": np.zeros((count, 2, 1, 128), dtype=np.float32),
        "sr": np.full(count, RATE, dtype=np.int64),
    }
