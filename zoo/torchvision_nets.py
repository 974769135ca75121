"""torchvision's ImageNet networks in plain torch, under torchvision's parameter names.

Some packages ship torchvision's own ImageNet checkpoints (``mobilenet_v2-b0353104.pth``)
without torchvision, and tierflow must not install torchvision: it pins its own torch
(the ``train`` extra's 2.13.0) and brings gigabytes of wheels. A checkpoint is a state
dict, so the network that reads it only has to have the same modules at the same names
and shapes; these classes rebuild torchvision's layout (``features.N.conv.M...``) from
its published definition, layer for layer, so :func:`load_checkpoint` can load strictly:
a missing, extra or misshapen tensor is an error, never a half-random network.

:class:`MobileNetV2` is torchvision's ``mobilenet_v2`` (width 1.0, 1000 classes): a
3x3 stem, 17 inverted residual blocks, a 1x1 conv to 1280 channels, global average
pooling and a linear classifier (the dropout before it does nothing in eval mode).

Needs torch (the ``train`` extra); imported only by :mod:`tierflow.zoo.imagenet` when it
exports a network.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from tierflow.errors import ModelError
from tierflow.zoo.models import MOBILENET_V2_SETTINGS


class ConvBNReLU6(nn.Sequential):
    """torchvision's ``Conv2dNormActivation``: conv (no bias), BatchNorm, ReLU6.

    Children ``0`` (conv) and ``1`` (norm), as the checkpoint names them.
    """

    def __init__(self, inp: int, out: int, kernel: int = 3, stride: int = 1, groups: int = 1):
        super().__init__(
            nn.Conv2d(inp, out, kernel, stride, (kernel - 1) // 2, groups=groups, bias=False),
            nn.BatchNorm2d(out),
            nn.ReLU6(inplace=True),
        )


class InvertedResidual(nn.Module):
    """MobileNetV2's block under torchvision's names: ``conv`` = [1x1 expand,] 3x3
    depthwise, 1x1 project, BatchNorm; the input is added back when the shapes match."""

    def __init__(self, inp: int, out: int, stride: int, expand: int) -> None:
        super().__init__()
        hidden = inp * expand
        layers: list[nn.Module] = []
        if expand != 1:
            layers.append(ConvBNReLU6(inp, hidden, kernel=1))
        layers += [
            ConvBNReLU6(hidden, hidden, stride=stride, groups=hidden),
            nn.Conv2d(hidden, out, 1, bias=False),
            nn.BatchNorm2d(out),
        ]
        self.conv = nn.Sequential(*layers)
        self.use_res_connect = stride == 1 and inp == out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv(x) if self.use_res_connect else self.conv(x)


class MobileNetV2(nn.Module):
    """torchvision's ``mobilenet_v2()`` at width 1.0: ``features`` (19 modules) then
    ``classifier`` (dropout, linear 1280 -> ``num_classes``)."""

    def __init__(self, num_classes: int = 1000) -> None:
        super().__init__()
        features: list[nn.Module] = [ConvBNReLU6(3, 32, stride=2)]
        channels = 32
        for expand, out, repeats, stride in MOBILENET_V2_SETTINGS:
            for i in range(repeats):
                features.append(InvertedResidual(channels, out, stride if i == 0 else 1, expand))
                channels = out
        features.append(ConvBNReLU6(channels, 1280, kernel=1))
        self.features = nn.Sequential(*features)
        self.classifier = nn.Sequential(nn.Dropout(0.2), nn.Linear(1280, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = nn.functional.adaptive_avg_pool2d(self.features(x), 1)
        return self.classifier(torch.flatten(x, 1))


def check_state_dict(network: nn.Module, state: Mapping[str, torch.Tensor], source: str) -> None:
    """Raise :class:`ModelError` unless ``state`` has exactly ``network``'s tensors, each
    of its shape: which are missing, unexpected or misshapen, a few of each by name."""
    own = network.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    misshapen = sorted(
        f"{k} {tuple(state[k].shape)} (expected {tuple(own[k].shape)})"
        for k in set(own) & set(state)
        if tuple(state[k].shape) != tuple(own[k].shape)
    )
    problems = [
        f"{what}: {', '.join(names[:4])}{' ...' if len(names) > 4 else ''} ({len(names)})"
        for what, names in (
            ("missing", missing),
            ("unexpected", unexpected),
            ("misshapen", misshapen),
        )
        if names
    ]
    if problems:
        raise ModelError(f"{source} does not fit {type(network).__name__}: " + "; ".join(problems))


def load_checkpoint(network: nn.Module, path: Path) -> nn.Module:
    """``network`` with the state dict in ``path`` loaded strictly, in eval mode.

    The file is read with ``weights_only`` (tensors only, no pickled code runs).
    """
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # a truncated file, not a checkpoint, pickled code
        raise ModelError(f"cannot read the checkpoint {path}: {exc}") from exc
    if not isinstance(state, Mapping):
        raise ModelError(f"{path} holds a {type(state).__name__}, not a state dict")
    check_state_dict(network, state, str(path))
    network.load_state_dict(state, strict=True)
    return network.eval()
