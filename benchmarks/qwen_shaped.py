"""A decoder with Qwen2-0.5B's block shapes, random weights, exported for the batching benchmark.

Hidden 896, 14 query heads and 2 key/value heads of 64 (grouped-query attention, with
q/k/v biases), a SwiGLU MLP of 4864, RMSNorm, rotary positions; ``blocks`` blocks
(12 by default) and a 32k vocabulary: about 236 M parameters, 0.95 GB in float32. The
layout is Hugging Face's ``text-generation-with-past`` one, as the byte decoders'
([Note: one graph for prefill and decode] in ``tierflow.zoo.bytelm``): ``input_ids``,
``attention_mask`` [batch, past + seq], ``position_ids`` and per block
``past_key_values.{i}.key``/``.value`` [batch, 2, past, 64] in; ``logits`` and
``present.{i}.*`` out. As in Hugging Face's models, a key is attended when its mask is 1
and its index in the cache is at most the query's index (past + its row), and the rotary
angle comes from ``position_ids``: so a sequence left-padded in its cache (mask 0 there)
computes the same function, which is what ``--batch-padding`` relies on.

Random weights: the benchmark measures speed and token identity, not text quality; the
weights are scaled so that greedy choices are not ties.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

HIDDEN = 896
HEADS = 14
KV_HEADS = 2
HEAD_DIM = 64
MLP = 4864
VOCAB = 32000
BLOCKS = 12


def past_names(blocks: int) -> list[str]:
    return [f"past_key_values.{i}.{kind}" for i in range(blocks) for kind in ("key", "value")]


def present_names(blocks: int) -> list[str]:
    return [f"present.{i}.{kind}" for i in range(blocks) for kind in ("key", "value")]


def make_model(blocks: int = BLOCKS, vocab: int = VOCAB, seed: int = 0) -> Any:
    """The torch module ``forward(input_ids, attention_mask, position_ids, *past)``."""
    import torch
    from torch import nn

    torch.manual_seed(seed)

    class RMSNorm(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(HIDDEN))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            scale = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
            return x * scale * self.weight

    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        turned = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + turned * sin

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm1 = RMSNorm()
            self.q = nn.Linear(HIDDEN, HEADS * HEAD_DIM)
            self.k = nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM)
            self.v = nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM)
            self.o = nn.Linear(HEADS * HEAD_DIM, HIDDEN, bias=False)
            self.norm2 = RMSNorm()
            self.gate = nn.Linear(HIDDEN, MLP, bias=False)
            self.up = nn.Linear(HIDDEN, MLP, bias=False)
            self.down = nn.Linear(MLP, HIDDEN, bias=False)

        def forward(
            self,
            x: torch.Tensor,
            allowed: torch.Tensor,
            cos: torch.Tensor,
            sin: torch.Tensor,
            past_k: torch.Tensor,
            past_v: torch.Tensor,
        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            batch, seq, _ = x.shape
            h = self.norm1(x)
            q = self.q(h).view(batch, seq, HEADS, HEAD_DIM).transpose(1, 2)
            k = self.k(h).view(batch, seq, KV_HEADS, HEAD_DIM).transpose(1, 2)
            v = self.v(h).view(batch, seq, KV_HEADS, HEAD_DIM).transpose(1, 2)
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
            k = torch.cat([past_k, k], dim=2)
            v = torch.cat([past_v, v], dim=2)
            group = HEADS // KV_HEADS
            kk = k.repeat_interleave(group, dim=1)
            vv = v.repeat_interleave(group, dim=1)
            scores = (q @ kk.transpose(-1, -2)) * (HEAD_DIM**-0.5)
            scores = torch.where(allowed, scores, torch.finfo(scores.dtype).min)
            y = (torch.softmax(scores, dim=-1) @ vv).transpose(1, 2).reshape(batch, seq, HIDDEN)
            x = x + self.o(y)
            h = self.norm2(x)
            x = x + self.down(nn.functional.silu(self.gate(h)) * self.up(h))
            return x, k, v

    class Decoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(vocab, HIDDEN)
            self.blocks = nn.ModuleList(Block() for _ in range(blocks))
            self.norm = RMSNorm()
            self.head = nn.Linear(HIDDEN, vocab, bias=False)
            inv = 1.0 / (1e6 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))
            self.register_buffer("inv_freq", inv, persistent=False)

        def forward(
            self,
            input_ids: torch.Tensor,
            attention_mask: torch.Tensor,
            position_ids: torch.Tensor,
            *past: torch.Tensor,
        ) -> tuple[torch.Tensor, ...]:
            batch, seq = input_ids.shape
            total = attention_mask.shape[1]
            keys = torch.arange(total).view(1, 1, 1, total)
            queries = (torch.arange(seq) + (total - seq)).view(1, 1, seq, 1)
            allowed = (keys <= queries) & (attention_mask.view(batch, 1, 1, total) > 0)
            angles = position_ids.unsqueeze(-1).float() * self.inv_freq  # type: ignore[operator]
            angles = torch.cat([angles, angles], dim=-1).unsqueeze(1)
            cos, sin = angles.cos(), angles.sin()
            x = self.embed(input_ids)
            present: list[torch.Tensor] = []
            for i, block in enumerate(self.blocks):
                x, k, v = block(x, allowed, cos, sin, past[2 * i], past[2 * i + 1])
                present += [k, v]
            return (self.head(self.norm(x)), *present)

    model = Decoder()
    with torch.no_grad():  # weights a trained model's size, so activations stay in range
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.zero_()
            elif param.ndim == 2:
                param.normal_(0.0, 0.02)
    return model.eval()


def export(path: str | Path, *, blocks: int = BLOCKS, vocab: int = VOCAB) -> Path:
    """Build the decoder and export it with torch's TorchScript exporter to ``path``."""
    import torch

    path = Path(path)
    model = make_model(blocks, vocab)
    past_len, seq = 3, 2
    example = (
        torch.zeros(1, seq, dtype=torch.int64),
        torch.ones(1, past_len + seq, dtype=torch.int64),
        torch.arange(past_len, past_len + seq, dtype=torch.int64).view(1, seq),
        *[torch.zeros(1, KV_HEADS, past_len, HEAD_DIM) for _ in range(2 * blocks)],
    )
    inputs = ["input_ids", "attention_mask", "position_ids", *past_names(blocks)]
    outputs = ["logits", *present_names(blocks)]
    axes: dict[str, dict[int, str]] = {
        "input_ids": {0: "batch", 1: "seq"},
        "attention_mask": {0: "batch", 1: "past_seq"},
        "position_ids": {0: "batch", 1: "seq"},
        "logits": {0: "batch", 1: "seq"},
    }
    for name in past_names(blocks):
        axes[name] = {0: "batch", 2: "past"}
    for name in present_names(blocks):
        axes[name] = {0: "batch", 2: "past_seq"}
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
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
    return path
