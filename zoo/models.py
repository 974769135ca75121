"""Built-in models for tests, benchmarks and the demo, built in code (no downloads).

Each builder returns an eval-mode ``torch.nn.Module`` and an example input tuple, with
weights drawn from a fixed seed so every call builds the same network. The shapes follow
the well-known architectures (VGG-like chain, ResNet-18, MobileNetV2, a transformer
encoder) so the planner meets the cut structures real models have: one-tensor chains,
residual blocks with two-tensor interiors, and hidden state plus mask. ``width`` and
``size`` make tiny versions for tests; benchmarks use the full ones.

This module is planning/export tooling: it imports torch, which the runtime tiers never do.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from tierflow.zoo.exporting import quiet_onnx_export

logger = logging.getLogger(__name__)

Example = tuple[torch.Tensor, ...]


def _channels(base: int, width: float) -> int:
    """Scale a channel count by ``width``, keeping at least 4 and a multiple of 4."""
    return max(4, round(base * width / 4) * 4)


def _finish(module: nn.Module, example: Example) -> tuple[nn.Module, Example]:
    module.eval()
    for parameter in module.parameters():
        parameter.requires_grad_(False)
    return module, example


# --- chain CNN (VGG-like) ---------------------------------------------------------------


def chain_cnn(
    *, size: int = 32, width: float = 1.0, num_classes: int = 10, seed: int = 0
) -> tuple[nn.Module, Example]:
    """A VGG-like chain: conv-relu stages with max pooling, then a classifier.

    Every layer boundary is a one-tensor cut, and the feature shrinks stage by stage,
    which is what makes a late cut cheap to send.
    """
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    in_ch = 3
    for base, convs in ((64, 1), (128, 1), (256, 2), (512, 2)):
        out_ch = _channels(base, width)
        for _ in range(convs):
            layers += [nn.Conv2d(in_ch, out_ch, 3, padding=1), nn.ReLU()]
            in_ch = out_ch
        layers.append(nn.MaxPool2d(2))
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(in_ch, num_classes)]
    model = nn.Sequential(*layers)
    return _finish(model, (torch.randn(1, 3, size, size),))


# --- ResNet-18 --------------------------------------------------------------------------


class BasicBlock(nn.Module):
    """ResNet's two-conv residual block, with a 1x1 projection when the shape changes."""

    def __init__(self, in_ch: int, out_ch: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_ch, out_ch, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_ch)
        self.conv2 = nn.Conv2d(out_ch, out_ch, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_ch)
        self.relu = nn.ReLU()
        self.downsample: nn.Module | None = None
        if stride != 1 or in_ch != out_ch:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_ch, out_ch, 1, stride, bias=False), nn.BatchNorm2d(out_ch)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class ResNet(nn.Module):
    """ResNet with BasicBlocks (ResNet-18 for ``layers=(2, 2, 2, 2)``)."""

    def __init__(self, layers: tuple[int, ...], width: float, num_classes: int) -> None:
        super().__init__()
        stem = _channels(64, width)
        self.stem = nn.Sequential(
            nn.Conv2d(3, stem, 7, 2, 3, bias=False),
            nn.BatchNorm2d(stem),
            nn.ReLU(),
            nn.MaxPool2d(3, 2, 1),
        )
        blocks: list[nn.Module] = []
        in_ch = stem
        for stage, count in enumerate(layers):
            out_ch = _channels(64 * 2**stage, width)
            for i in range(count):
                stride = 2 if stage > 0 and i == 0 else 1
                blocks.append(BasicBlock(in_ch, out_ch, stride))
                in_ch = out_ch
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Sequential(
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(in_ch, num_classes)
        )
        for module in self.modules():
            if isinstance(module, nn.BatchNorm2d):
                # Non-trivial statistics, so folding BatchNorm is actually exercised.
                assert module.running_mean is not None and module.running_var is not None
                nn.init.uniform_(module.running_mean, -0.1, 0.1)
                nn.init.uniform_(module.running_var, 0.5, 1.5)
                nn.init.uniform_(module.weight, 0.5, 1.5)
                nn.init.uniform_(module.bias, -0.1, 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)))


def resnet18(
    *, size: int = 224, width: float = 1.0, num_classes: int = 1000, seed: int = 0
) -> tuple[nn.Module, Example]:
    """ResNet-18: BasicBlocks [2, 2, 2, 2] with 64-128-256-512 channels times ``width``.

    Block boundaries are one-tensor cuts; inside a block the skip path makes them two.
    """
    torch.manual_seed(seed)
    model = ResNet((2, 2, 2, 2), width, num_classes)
    return _finish(model, (torch.randn(1, 3, size, size),))


# --- MobileNetV2 ------------------------------------------------------------------------


class InvertedResidual(nn.Module):
    """MobileNetV2's block: 1x1 expand, 3x3 depthwise, 1x1 project; residual if shapes match."""

    def __init__(self, in_ch: int, out_ch: int, stride: int, expand: int) -> None:
        super().__init__()
        hidden = in_ch * expand
        layers: list[nn.Module] = []
        if expand != 1:
            layers += [nn.Conv2d(in_ch, hidden, 1, bias=False), nn.BatchNorm2d(hidden), nn.ReLU6()]
        layers += [
            nn.Conv2d(hidden, hidden, 3, stride, 1, groups=hidden, bias=False),
            nn.BatchNorm2d(hidden),
            nn.ReLU6(),
            nn.Conv2d(hidden, out_ch, 1, bias=False),
            nn.BatchNorm2d(out_ch),
        ]
        self.body = nn.Sequential(*layers)
        self.residual = stride == 1 and in_ch == out_ch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.body(x)
        return x + out if self.residual else out


#: (expansion, output channels, repeats, first stride): the MobileNetV2 paper's (and
#: torchvision's).
MOBILENET_V2_SETTINGS = (
    (1, 16, 1, 1),
    (6, 24, 2, 2),
    (6, 32, 3, 2),
    (6, 64, 4, 2),
    (6, 96, 3, 1),
    (6, 160, 3, 2),
    (6, 320, 1, 1),
)


def mobilenet_v2(
    *,
    size: int = 224,
    width: float = 1.0,
    num_classes: int = 1000,
    settings: tuple[tuple[int, int, int, int], ...] = MOBILENET_V2_SETTINGS,
    seed: int = 0,
) -> tuple[nn.Module, Example]:
    """MobileNetV2: inverted residual blocks with depthwise convolutions.

    ``settings`` (expansion, channels, repeats, stride) rows may be shortened for tiny
    test versions.
    """
    torch.manual_seed(seed)
    stem = _channels(32, width)
    layers: list[nn.Module] = [
        nn.Conv2d(3, stem, 3, 2, 1, bias=False),
        nn.BatchNorm2d(stem),
        nn.ReLU6(),
    ]
    in_ch = stem
    for expand, channels, repeats, stride in settings:
        out_ch = _channels(channels, width)
        for i in range(repeats):
            layers.append(InvertedResidual(in_ch, out_ch, stride if i == 0 else 1, expand))
            in_ch = out_ch
    last = _channels(1280, max(1.0, width))
    layers += [
        nn.Conv2d(in_ch, last, 1, bias=False),
        nn.BatchNorm2d(last),
        nn.ReLU6(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(last, num_classes),
    ]
    model = nn.Sequential(*layers)
    return _finish(model, (torch.randn(1, 3, size, size),))


# --- transformer encoder ----------------------------------------------------------------


class EncoderLayer(nn.Module):
    """A pre-norm transformer encoder layer with attention written in plain ops.

    Plain matmul/softmax attention exports the same way from both torch exporters, and
    its additive mask is an explicit tensor, so the mask crosses cuts as itself.
    """

    def __init__(self, dim: int, heads: int, ff: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.ff = nn.Sequential(nn.Linear(dim, ff), nn.GELU(), nn.Linear(ff, dim))

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        batch, seq, dim = x.shape
        head_dim = dim // self.heads
        qkv = self.qkv(self.norm1(x)).reshape(batch, seq, 3, self.heads, head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        scores = q @ k.transpose(-2, -1) * head_dim**-0.5
        if bias is not None:
            scores = scores + bias
        attended = torch.softmax(scores, dim=-1) @ v
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, seq, dim))
        return x + self.ff(self.norm2(x))


class TransformerEncoder(nn.Module):
    """Token embedding (or linear projection of features), encoder layers, mean-pool head."""

    def __init__(
        self,
        *,
        vocab: int | None,
        features: int,
        dim: int,
        heads: int,
        layers: int,
        seq: int,
        num_classes: int,
    ) -> None:
        super().__init__()
        self.embed: nn.Module = nn.Embedding(vocab, dim) if vocab else nn.Linear(features, dim)
        self.position = nn.Parameter(torch.randn(1, seq, dim) * 0.02)
        self.layers = nn.ModuleList(EncoderLayer(dim, heads, 4 * dim) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self.embed(x) + self.position
        bias = None
        if mask is not None:
            # mask: (batch, seq), 1 = attend, 0 = padding -> additive bias on the keys.
            bias = ((1.0 - mask) * -1e4)[:, None, None, :]
        for layer in self.layers:
            hidden = layer(hidden, bias)
        return self.head(self.norm(hidden).mean(dim=1))


def transformer_encoder(
    *,
    seq: int = 16,
    dim: int = 32,
    heads: int = 4,
    layers: int = 2,
    vocab: int | None = 100,
    features: int = 16,
    num_classes: int = 10,
    mask: bool = True,
    seed: int = 0,
) -> tuple[nn.Module, Example]:
    """A small transformer encoder; with ``mask`` the example has a float (batch, seq) mask.

    Token ids feed an embedding when ``vocab`` is set, else ``features``-wide float vectors
    feed a linear projection. Between layers the cut carries the hidden state plus the mask
    bias computed from the mask input.
    """
    torch.manual_seed(seed)
    model = TransformerEncoder(
        vocab=vocab,
        features=features,
        dim=dim,
        heads=heads,
        layers=layers,
        seq=seq,
        num_classes=num_classes,
    )
    tokens = torch.randint(0, vocab, (1, seq)) if vocab else torch.randn(1, seq, features)
    example: Example = (tokens,)
    if mask:
        attend = torch.ones(1, seq)
        attend[:, seq - seq // 4 :] = 0.0
        example = (tokens, attend)
    return _finish(model, example)


# --- export -----------------------------------------------------------------------------


def export_onnx(
    module: nn.Module,
    example: Example,
    path: str | Path,
    *,
    dynamo: bool = True,
    external_data: bool = False,
    dynamic_batch: bool = False,
    opset: int | None = None,
) -> Path:
    """Export ``module`` to ONNX at ``path`` with either torch exporter; return the path.

    Inputs are named ``input`` (and ``mask``, ``input2``... for further ones), the output
    ``output``. ``external_data`` writes the weights to ``PATH.data`` beside the model, as
    the dynamo exporter does for large models. ``dynamic_batch`` makes the leading input
    dimension symbolic. What the exporters print about torch itself rather than this model
    is left out (:func:`~tierflow.zoo.exporting.quiet_onnx_export`).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    input_names = ["input", "mask", *[f"input{i}" for i in range(2, len(example))]][: len(example)]
    with quiet_onnx_export():
        if dynamo:
            dynamic_shapes = None
            if dynamic_batch:
                batch = torch.export.Dim("batch", min=1, max=1024)
                dynamic_shapes = tuple({0: batch} for _ in example)
            program = torch.onnx.export(
                module,
                example,
                input_names=input_names,
                output_names=["output"],
                dynamo=True,
                dynamic_shapes=dynamic_shapes,
                opset_version=opset,
                verbose=False,
            )
            assert program is not None
            program.save(path, external_data=external_data)
        else:
            dynamic_axes = {name: {0: "batch"} for name in input_names} if dynamic_batch else None
            if dynamic_axes is not None:
                dynamic_axes["output"] = {0: "batch"}
            torch.onnx.export(
                module,
                example,
                str(path),
                input_names=input_names,
                output_names=["output"],
                dynamo=False,
                dynamic_axes=dynamic_axes,
                opset_version=opset or 17,
            )
            if external_data:
                import onnx

                model = onnx.load(str(path))
                onnx.save_model(
                    model,
                    str(path),
                    save_as_external_data=True,
                    all_tensors_to_one_file=True,
                    location=path.name + ".data",
                    size_threshold=0,
                )
    logger.info("[zoo] exported %s (dynamo=%s)", path, dynamo)
    return path
