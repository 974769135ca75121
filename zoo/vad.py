"""A streaming voice activity detector shaped like the published one, built in code.

The published streaming VAD ships as one ONNX graph whose whole network sits inside one
``If`` on a scalar sample rate: inputs ``input[?, ?]`` (a frame of samples),
``state[2, ?, 128]`` (the LSTM's h and c) and ``sr`` (int64, no dimensions), outputs the
speech probability and the new state. Each branch is the network for one rate: a
spectrum (reflect Pad, a strided Conv against a fixed basis, Slice into real and
imaginary parts, magnitude), four convolution blocks, the squeeze of the one remaining
time step, one LSTM step and a 1x1 convolution to a probability. This module builds a
network of that shape with seeded random weights (nothing is downloaded; it is not
trained, it only has to be the same graph) and exports it with either torch exporter.

Planning it needs the partitioner to leave the shapes a branch reads as the model
shipped them ([Note: shapes a branch reads] in :mod:`tierflow.partitioner.shapes`).
Needs torch (the ``train`` extra).
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from tierflow.zoo.exporting import quiet_onnx_export
from tierflow.zoo.models import Example

logger = logging.getLogger(__name__)

HIDDEN = 128
#: Samples per frame at each rate (the published model's 512 and 256, plus its context).
FRAME = {16000: 576, 8000: 288}
_FFT = {16000: 256, 8000: 128}
INPUT_NAMES = ["input", "state", "sr"]
OUTPUT_NAMES = ["output", "stateN"]


class _Spectrum(nn.Module):
    """STFT magnitude as the published model computes it: a strided Conv1d on a basis."""

    basis: torch.Tensor

    def __init__(self, n_fft: int) -> None:
        super().__init__()
        self.n_fft, self.hop = n_fft, n_fft // 2
        self.register_buffer("basis", torch.randn(n_fft + 2, 1, n_fft) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.pad(x, (0, self.n_fft // 4), mode="reflect").unsqueeze(1)
        y = F.conv1d(x, self.basis, stride=self.hop)
        cut = self.n_fft // 2 + 1
        real, imag = y[:, :cut, :], y[:, cut:, :]
        return torch.sqrt(real * real + imag * imag)


class _RateModel(nn.Module):
    """The network for one sample rate: spectrum, encoder, one LSTM step, probability.

    ``last_frame`` takes the encoder's last time step by indexing instead of squeezing
    it: the same value at the frame size of this rate (one step is left), but defined at
    the other rate's frame size too, which torch.cond needs (it traces both branches at
    the one input shape). The TorchScript export squeezes, as the published model does,
    and torch's exporter turns that squeeze into a nested If on the step count.
    """

    def __init__(self, n_fft: int, *, last_frame: bool) -> None:
        super().__init__()
        self.last_frame = last_frame
        self.spectrum = _Spectrum(n_fft)
        self.encoder = nn.Sequential(
            nn.Conv1d(n_fft // 2 + 1, HIDDEN, 3, padding=1),
            nn.ReLU(),
            nn.Conv1d(HIDDEN, 64, 3, stride=2, padding=1),
            nn.ReLU(),
            nn.Conv1d(64, 64, 3, stride=2, padding=1),
            nn.ReLU(),
            nn.Conv1d(64, HIDDEN, 3, padding=1),
            nn.ReLU(),
        )
        # Holds the weights; called through torch.lstm, which exports as one ONNX LSTM
        # in both exporters (nn.LSTM's own forward mutates its flat weights, which
        # torch.cond refuses).
        self.rnn = nn.LSTM(HIDDEN, HIDDEN)
        self.head = nn.Sequential(nn.ReLU(), nn.Conv1d(HIDDEN, 1, 1), nn.Sigmoid())

    def forward(self, x: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.encoder(self.spectrum(x))
        x = x[:, :, -1] if self.last_frame else x.squeeze(-1)
        weights: list[torch.Tensor] = list(self.rnn.all_weights[0])  # W, R, their biases
        _, h, c = torch.lstm(
            x.unsqueeze(0), (state[:1], state[1:]), weights, True, 1, 0.0, False, False, False
        )
        # .float(): the TorchScript exporter loses the LSTM output's dtype in an If block.
        probability = self.head(h[0].unsqueeze(-1).float()).squeeze(-1)
        return probability, torch.cat([h, c])


class StreamingVad(nn.Module):
    """``if sr == 16000: ... else: ...`` around the whole network, one per rate.

    ``scale_input`` multiplies the frame by a constant gain before the If, so that a
    tensor computed outside the If (not only the graph's inputs) is what its branches read.
    """

    __constants__: ClassVar[list[str]] = ["scale_input"]

    def __init__(self, rate16k: nn.Module, rate8k: nn.Module, *, scale_input: bool) -> None:
        super().__init__()
        self.rate16k = rate16k
        self.rate8k = rate8k
        self.scale_input = scale_input

    def forward(
        self, input: torch.Tensor, state: torch.Tensor, sr: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.scale_input:
            input = input * 0.5
        if sr == 16000:
            output, new_state = self.rate16k(input, state)
        else:
            output, new_state = self.rate8k(input, state)
        return output, new_state


class _CondVad(StreamingVad):
    """The same branches through torch.cond, the form the dynamo exporter keeps as an If."""

    def forward(
        self, input: torch.Tensor, state: torch.Tensor, sr: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.scale_input:
            input = input * 0.5
        result = torch.cond(sr == 16000, self.rate16k, self.rate8k, (input, state))
        return result[0], result[1]


def example(rate: int = 16000, batch: int = 1) -> Example:
    """One request at ``rate``: a frame of samples, a zero state and the rate."""
    return (
        torch.randn(batch, FRAME[rate], generator=torch.Generator().manual_seed(rate)),
        torch.zeros(2, batch, HIDDEN),
        torch.tensor(rate, dtype=torch.int64),
    )


def streaming_vad(
    *, seed: int = 0, for_dynamo: bool = False, scale_input: bool = False
) -> tuple[nn.Module, Example]:
    """The VAD in eval mode and a 16 kHz example; weights drawn from ``seed``.

    ``for_dynamo`` builds the torch.cond form (see :class:`_RateModel`); otherwise the
    Python ``if`` that ``torch.jit.script`` keeps. ``scale_input``: see
    :class:`StreamingVad`.
    """
    torch.manual_seed(seed)
    rates = [_RateModel(_FFT[r], last_frame=for_dynamo).eval() for r in (16000, 8000)]
    for model in rates:
        for parameter in model.parameters():
            parameter.requires_grad_(False)
    module = (_CondVad if for_dynamo else StreamingVad)(*rates, scale_input=scale_input)
    module.eval()
    return module, example(16000)


def export_vad(path: str | Path, *, dynamo: bool, seed: int = 0, scale_input: bool = False) -> Path:
    """Build the VAD and export it to ``path``; return the path.

    TorchScript (``dynamo=False``): each rate's network is traced at its own frame size
    and the rate switch scripted, so the If survives, with inputs ``input[batch,
    samples]``, ``state[2, batch, 128]``, ``sr[]``, as the published model has them.
    Dynamo: torch.cond becomes the If, at the example's shapes (``input[1, 576]``,
    ``state[2, 1, 128]``): torch.cond traces both branches at the one input shape, and
    marking the frame dynamic does not help (torch.export finds that the convolutions'
    output sizes pin it to 576 and refuses the dynamic dimension).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    module, inputs = streaming_vad(seed=seed, for_dynamo=dynamo, scale_input=scale_input)
    with quiet_onnx_export():
        if dynamo:
            program = torch.onnx.export(
                module,
                inputs,
                dynamo=True,
                verbose=False,
                input_names=INPUT_NAMES,
                output_names=OUTPUT_NAMES,
            )
            assert program is not None
            program.save(path)
        else:
            assert isinstance(module, StreamingVad)
            _script_and_export(module, inputs, path)
    logger.info("[zoo] exported the streaming VAD to %s (dynamo=%s)", path, dynamo)
    return path


def _script_and_export(module: StreamingVad, inputs: Example, path: Path) -> None:
    """The TorchScript export: rates traced at their own frame sizes, the switch scripted."""
    with warnings.catch_warnings():
        # Tracing notes that the traced squeeze and frame sizes are fixed: they are, per rate.
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        module.rate16k = torch.jit.trace(module.rate16k, example(16000)[:2])
        module.rate8k = torch.jit.trace(module.rate8k, example(8000)[:2])
        # The exporter's notes on what it could not fold, and on LSTM batch sizes (the
        # states here are inputs, which is what that note asks for).
        warnings.filterwarnings("ignore", message="Constant folding - Only steps=1")
        warnings.filterwarnings("ignore", message="Exporting a model to ONNX with a batch_size")
        torch.onnx.export(
            torch.jit.script(module),
            inputs,
            str(path),
            dynamo=False,
            opset_version=17,
            dynamic_axes={
                "input": {0: "batch", 1: "samples"},
                "state": {1: "batch"},
                "output": {0: "batch"},
                "stateN": {1: "batch"},
            },
            input_names=INPUT_NAMES,
            output_names=OUTPUT_NAMES,
        )
