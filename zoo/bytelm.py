"""Byte-level decoder-only transformers, and their export as one ONNX graph with a KV cache.

The decoder family of issue 19 (:mod:`.bytelm_family` trains and caches three sizes):
token ids are the bytes of UTF-8 text (vocabulary 256, no specials), so every size shares
one vocabulary and any of them can draft for any other. A block is pre-LayerNorm
attention and a GELU MLP; positions enter as ALiBi biases (Press et al., 2022) computed in
every block from ``position_ids``, so the model has no position table, runs past the
length it was trained on, and what crosses a cut between blocks is the hidden state plus
the step's ``attention_mask`` and ``position_ids``. See [Note: one graph for prefill and
decode].

[Note: one graph for prefill and decode]
The export follows Hugging Face's ``text-generation-with-past`` layout: inputs
``input_ids`` int64[batch, seq], ``attention_mask`` int64[batch, past + seq],
``position_ids`` int64[batch, seq] and per block ``past_key_values.{i}.key``/``.value``
float32[batch, heads, past, head_dim]; outputs ``logits`` float32[batch, seq, 256] and
``present.{i}.key``/``.value`` [batch, heads, past + seq, head_dim]. ``seq`` and ``past``
are symbolic, so the same graph prefills a prompt (past 0) and decodes one token (seq 1).
Keys may be attended when ``attention_mask`` is 1 there and their position (the index in
the cache) is at most the query's ``position_ids``: causal over cache and step alike.
Both torch exporters are supported: ``dynamo`` (torch.export; one file, or weights in
``.onnx.data`` with ``external_data``) and ``legacy`` (TorchScript tracing), whose files
differ (dimension names, op choices) but compute the same.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tierflow.errors import ModelError, UsageError

VOCAB = 256
EXPORTERS = ("dynamo", "legacy")
INPUT_NAMES = ("input_ids", "attention_mask", "position_ids")
# Masked scores: far below any real one, finite (so an all-masked row is no NaN).
_MASKED = -1e9


@dataclass(frozen=True)
class ByteLMConfig:
    """A size of the family: blocks, width and heads (head_dim = width / heads)."""

    name: str
    blocks: int
    width: int
    heads: int

    def __post_init__(self) -> None:
        if self.blocks < 1 or self.heads < 1 or self.width % self.heads:
            raise UsageError(
                f"decoder size {self.name}: blocks and heads must be >= 1 and width a "
                f"multiple of heads, got {self.blocks}, {self.width}, {self.heads}"
            )

    @property
    def head_dim(self) -> int:
        return self.width // self.heads

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "blocks": self.blocks, "width": self.width, "heads": self.heads}


def past_names(blocks: int) -> list[str]:
    """``past_key_values.{i}.key``, ``.value`` for every block, in the graph's input order."""
    return [f"past_key_values.{i}.{kind}" for i in range(blocks) for kind in ("key", "value")]


def present_names(blocks: int) -> list[str]:
    """``present.{i}.key``, ``.value`` for every block, in the graph's output order."""
    return [f"present.{i}.{kind}" for i in range(blocks) for kind in ("key", "value")]


def alibi_slopes(heads: int) -> list[float]:
    """ALiBi's head slopes: the geometric sequence 2^(-8/heads), 2^(-16/heads), ..."""
    return [2.0 ** (-8.0 * (h + 1) / heads) for h in range(heads)]


def make_model(config: ByteLMConfig) -> Any:
    """The torch module: ``forward(input_ids, attention_mask, position_ids, *past)``.

    Returns ``(logits, *present)`` with ``past``/``present`` flattened as
    :func:`past_names` orders them ([Note: one graph for prefill and decode]).
    """
    import torch
    from torch import nn

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = nn.Linear(config.width, 3 * config.width)
            self.out = nn.Linear(config.width, config.width)
            slopes = torch.tensor(alibi_slopes(config.heads)).view(1, config.heads, 1, 1)
            self.register_buffer("slopes", slopes, persistent=False)

        def forward(
            self,
            x: torch.Tensor,
            mask: torch.Tensor,
            positions: torch.Tensor,
            past_k: torch.Tensor,
            past_v: torch.Tensor,
        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            batch, seq, _ = x.shape
            q, k, v = (
                t.view(batch, seq, config.heads, config.head_dim).transpose(1, 2)
                for t in self.qkv(x).split(config.width, dim=-1)
            )
            k = torch.cat([past_k, k], dim=2)
            v = torch.cat([past_v, v], dim=2)
            scores = q @ k.transpose(-1, -2) * (1.0 / math.sqrt(config.head_dim))
            keys = torch.arange(mask.shape[1], device=x.device).view(1, 1, 1, -1)
            queries = positions.view(batch, 1, seq, 1)
            distance = (queries - keys).to(scores.dtype)
            allowed = (keys <= queries) & (mask.view(batch, 1, 1, -1) > 0)
            slopes: torch.Tensor = self.slopes  # type: ignore[assignment]
            scores = torch.where(allowed, scores - slopes * distance, _MASKED)
            y = torch.softmax(scores, dim=-1) @ v
            y = y.transpose(1, 2).reshape(batch, seq, config.width)
            return self.out(y), k, v

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm1 = nn.LayerNorm(config.width)
            self.attention = Attention()
            self.norm2 = nn.LayerNorm(config.width)
            self.mlp = nn.Sequential(
                nn.Linear(config.width, 4 * config.width),
                nn.GELU(approximate="tanh"),
                nn.Linear(4 * config.width, config.width),
            )

        def forward(
            self,
            x: torch.Tensor,
            mask: torch.Tensor,
            positions: torch.Tensor,
            past_k: torch.Tensor,
            past_v: torch.Tensor,
        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            attended, k, v = self.attention(self.norm1(x), mask, positions, past_k, past_v)
            x = x + attended
            return x + self.mlp(self.norm2(x)), k, v

    class ByteDecoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.config = config
            self.embed = nn.Embedding(VOCAB, config.width)
            self.blocks = nn.ModuleList(Block() for _ in range(config.blocks))
            self.norm = nn.LayerNorm(config.width)
            self.head = nn.Linear(config.width, VOCAB)

        def forward(
            self,
            input_ids: torch.Tensor,
            attention_mask: torch.Tensor,
            position_ids: torch.Tensor,
            *past: torch.Tensor,
        ) -> tuple[torch.Tensor, ...]:
            x = self.embed(input_ids)
            present: list[torch.Tensor] = []
            for i, block in enumerate(self.blocks):
                x, k, v = block(x, attention_mask, position_ids, past[2 * i], past[2 * i + 1])
                present += [k, v]
            return (self.head(self.norm(x)), *present)

    return ByteDecoder()


def make_trainer(config: ByteLMConfig, exits: Sequence[int]) -> Any:
    """The large decoder with an output head after each block count in ``exits``.

    ``forward(input_ids, attention_mask, position_ids, *past)`` returns the logits at
    every exit, in order; the last exit must be ``config.blocks``. Training all exits at
    once trains the family in the time of its largest member: see [Note: one trunk, three
    sizes] in :mod:`.bytelm_family`. :func:`truncated` cuts a member out of it.
    """
    import torch
    from torch import nn

    if list(exits) != sorted(set(exits)) or exits[-1] != config.blocks or exits[0] < 1:
        raise UsageError(f"exits must rise from 1 to {config.blocks}, got {list(exits)}")
    trunk = make_model(config)

    class Trainer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.trunk = trunk
            self.exits = tuple(exits)
            self.norms = nn.ModuleList(nn.LayerNorm(config.width) for _ in exits[:-1])
            self.heads = nn.ModuleList(nn.Linear(config.width, VOCAB) for _ in exits[:-1])

        def forward(
            self,
            input_ids: torch.Tensor,
            attention_mask: torch.Tensor,
            position_ids: torch.Tensor,
            *past: torch.Tensor,
        ) -> list[torch.Tensor]:
            """Each exit's logits; then, for the early exits, their logits again on the
            trunk's hidden state detached (a loss on those trains the exit alone)."""
            x = self.trunk.embed(input_ids)
            logits: list[torch.Tensor] = []
            alone: list[torch.Tensor] = []
            for i, block in enumerate(self.trunk.blocks):
                x, _, _ = block(x, attention_mask, position_ids, past[2 * i], past[2 * i + 1])
                if i + 1 in self.exits[:-1]:
                    at = self.exits.index(i + 1)
                    logits.append(self.heads[at](self.norms[at](x)))
                    alone.append(self.heads[at](self.norms[at](x.detach())))
            logits.append(self.trunk.head(self.trunk.norm(x)))
            return logits + alone

    return Trainer()


def truncated(trainer: Any, config: ByteLMConfig) -> Any:
    """The family member of ``config``: the trainer's first ``config.blocks`` blocks, and the
    head trained after them (the trunk itself for the largest)."""
    import copy

    exits = trainer.exits
    large: ByteLMConfig = trainer.trunk.config
    if (config.width, config.heads) != (large.width, large.heads):
        raise UsageError(
            f"{config.name} must have the trunk's width and heads ({large.width}, "
            f"{large.heads}), got ({config.width}, {config.heads})"
        )
    if config.blocks not in exits:
        raise UsageError(f"no exit after {config.blocks} blocks; the exits are {list(exits)}")
    model = make_model(config)
    model.embed = copy.deepcopy(trainer.trunk.embed)
    for i in range(config.blocks):
        model.blocks[i] = copy.deepcopy(trainer.trunk.blocks[i])
    if config.blocks == exits[-1]:
        model.norm = copy.deepcopy(trainer.trunk.norm)
        model.head = copy.deepcopy(trainer.trunk.head)
    else:
        at = exits.index(config.blocks)
        model.norm = copy.deepcopy(trainer.norms[at])
        model.head = copy.deepcopy(trainer.heads[at])
    model.eval()
    return model


def empty_past(config: ByteLMConfig, batch: int = 1, length: int = 0) -> list[Any]:
    """Zero KV tensors of ``length`` for every block (length 0: a session's start)."""
    import torch

    shape = (batch, config.heads, length, config.head_dim)
    return [torch.zeros(shape) for _ in range(2 * config.blocks)]


def export_onnx(
    model: Any,
    path: str | Path,
    *,
    exporter: str = "dynamo",
    external_data: bool = False,
) -> Path:
    """Export ``model`` as one ONNX graph for prefill and decode at ``path``.

    ``exporter`` is ``dynamo`` (torch.export; with ``external_data`` the weights go to
    ``PATH.data`` beside it) or ``legacy`` (TorchScript tracing, always one file). See
    [Note: one graph for prefill and decode].
    """
    import torch

    if exporter not in EXPORTERS:
        raise UsageError(f"unknown exporter {exporter!r}: expected one of {', '.join(EXPORTERS)}")
    config: ByteLMConfig = model.config
    path = Path(path)
    model.eval()
    past_len, seq = 3, 2  # not 0 or 1: torch.export would specialise those sizes
    example = (
        torch.zeros(1, seq, dtype=torch.int64),
        torch.ones(1, past_len + seq, dtype=torch.int64),
        torch.arange(past_len, past_len + seq, dtype=torch.int64).view(1, seq),
        *empty_past(config, length=past_len),
    )
    inputs = [*INPUT_NAMES, *past_names(config.blocks)]
    outputs = ["logits", *present_names(config.blocks)]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # both exporters warn about their own internals
            if exporter == "dynamo":
                _export_dynamo(model, example, path, inputs, outputs, external_data)
            else:
                _export_legacy(model, example, path, inputs, outputs)
    except Exception as exc:  # the exporters raise many unrelated types
        raise ModelError(f"exporting decoder {config.name} with {exporter} failed: {exc}") from exc
    return path


def _export_dynamo(
    model: Any,
    example: tuple[Any, ...],
    path: Path,
    inputs: list[str],
    outputs: list[str],
    external_data: bool,
) -> None:
    import torch

    batch = torch.export.Dim("batch", min=1, max=64)
    seq = torch.export.Dim("seq", min=1, max=4096)
    past = torch.export.Dim("past", min=0, max=4096)
    cache = {0: batch, 2: past}
    dynamic = (
        {0: batch, 1: seq},
        {0: batch, 1: torch.export.Dim.AUTO},
        {0: batch, 1: seq},
        tuple([cache] * (len(inputs) - len(INPUT_NAMES))),  # *past is one argument
    )
    torch.onnx.export(
        model,
        example,
        str(path),
        input_names=inputs,
        output_names=outputs,
        dynamo=True,
        external_data=external_data,
        dynamic_shapes=dynamic,
        verbose=False,
    )


def _export_legacy(
    model: Any, example: tuple[Any, ...], path: Path, inputs: list[str], outputs: list[str]
) -> None:
    import torch

    axes: dict[str, dict[int, str]] = {
        "input_ids": {0: "batch", 1: "seq"},
        "attention_mask": {0: "batch", 1: "past_seq"},
        "position_ids": {0: "batch", 1: "seq"},
        "logits": {0: "batch", 1: "seq"},
    }
    for name in inputs[len(INPUT_NAMES) :]:
        axes[name] = {0: "batch", 2: "past"}
    for name in outputs[1:]:
        axes[name] = {0: "batch", 2: "past_seq"}
    torch.onnx.export(
        model,
        example,
        str(path),
        input_names=inputs,
        output_names=outputs,
        dynamic_axes=axes,
        opset_version=17,
        dynamo=False,
    )
