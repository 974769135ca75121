"""Train, export and cache the byte decoder family: small, medium and large, one vocabulary.

:func:`build_family` returns the three ONNX decoders ([Note: one graph for prefill and
decode] in :mod:`.bytelm`), training them the first time on the standard library's
sources (:mod:`.byte_corpus`): about a minute in all on two shared cores, with a status
line every few seconds. The cache lives in ``~/.cache/tierflow/bytelm-KEY`` (or under
``$TIERFLOW_CACHE``), KEY a hash of the recipe (sizes, steps, seeds, the corpus digest,
the exporter), so a changed recipe or another Python's library trains anew. Each file is
written under a temporary name and renamed, under an exclusive lock, as the digits demo
does (:mod:`.digits`).

``meta.json`` records what a user of the family needs to judge it, measured on the
exported graphs in ONNX Runtime on held-out files: each size's bits per byte and
next-byte accuracy, and how often small and medium pick the large model's greedy token
(:func:`draft_agreement`: on the large model's own greedy continuations of held-out
prompts, the rate at which a draft's tokens would be accepted).

[Note: one trunk, three sizes]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The three sizes are one 8-block trunk read out after 2, 4 and 8 blocks, each exit with
its own LayerNorm and output head, trained together (the mean of the three exits'
cross-entropies, as LayerSkip trains its early exits for self-speculative decoding,
Elhoushi et al., 2024); the early exits' heads also learn the large exit's distribution
(a KL term on the trunk's hidden state detached, so the trunk, and with it the large
model, is trained by the cross-entropies alone: a draft is judged by how often it picks
the large model's token, and distillation trains exactly that: the small and medium
models' greedy tokens agree with the large model's 90% and 95% of the time, against 79%
and 85% without it, and the large model is as good). A minute of one core buys about 400
steps of 16 windows of 64 bytes: trained apart, three models would share that minute and
each learn less, and a draft trained apart agrees less with the large model (independent
models of 2, 4 and 8 blocks, 17, 16 and 36 s each, agreed 89% with the large one only
because all three repeated spaces). Each size is exported as a decoder of its own, with
its own blocks' weights and KV cache: the small one runs on a device without the large
one's other blocks. The cost: the drafts are the large model's first blocks, so a split
that puts those blocks on the device computes them twice when the device also drafts.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tierflow.errors import ModelError
from tierflow.zoo.byte_corpus import Corpus, load_corpus
from tierflow.zoo.bytelm import (
    ByteLMConfig,
    export_onnx,
    make_trainer,
    past_names,
    truncated,
)
from tierflow.zoo.cache_files import exclusive_lock, sha256_file, write_atomic

logger = logging.getLogger(__name__)

#: The family, smallest first; the large model's 8 blocks split over three tiers.
SIZES: tuple[ByteLMConfig, ...] = (
    ByteLMConfig("small", blocks=2, width=64, heads=2),
    ByteLMConfig("medium", blocks=4, width=64, heads=2),
    ByteLMConfig("large", blocks=8, width=64, heads=2),
)
_RECIPE_VERSION = 3
#: Weight of the early exits' distillation towards the large exit, beside their own loss.
_DISTIL = 1.0
_STEPS = 400
_BATCH = 16
_WINDOW = 64
_LR = 4e-3
_WARMUP = 20
_SEED = 0
_THREADS = 1
_STATUS_EVERY_S = 4.0
# Held-out evaluation: windows of the held-out text, and prompts for draft agreement.
_EVAL_WINDOWS = 32
_EVAL_LENGTH = 128
_AGREEMENT_PROMPTS = 12
_AGREEMENT_PROMPT = 48
_AGREEMENT_TOKENS = 32
META_FILE = "meta.json"

Status = Callable[[str], None]


def _quiet(_: str) -> None:
    """The status callback when none is given."""


@dataclass(frozen=True)
class Family:
    """The cached family: one ONNX file per size and what ``meta.json`` says of them.

    ``built`` is True when this call trained them.
    """

    directory: Path
    meta: dict[str, Any]
    built: bool

    def path(self, size: str) -> Path:
        """The ONNX decoder of ``size`` (small, medium, large)."""
        if size not in self.meta["sizes"]:
            raise ModelError(f"no decoder size {size!r}: the family has {', '.join(self.sizes)}")
        return self.directory / f"{size}.onnx"

    @property
    def sizes(self) -> tuple[str, ...]:
        return tuple(self.meta["sizes"])

    @property
    def paths(self) -> dict[str, Path]:
        return {size: self.path(size) for size in self.sizes}


def recipe(corpus_digest: str, exporter: str) -> dict[str, Any]:
    """Everything the trained files depend on; its hash names the cache folder."""
    import torch

    return {
        "version": _RECIPE_VERSION,
        "sizes": [c.to_dict() for c in SIZES],
        "steps": _STEPS,
        "batch": _BATCH,
        "window": _WINDOW,
        "lr": _LR,
        "warmup": _WARMUP,
        "seed": _SEED,
        "threads": _THREADS,
        "corpus": corpus_digest,
        "exporter": exporter,
        "torch": torch.__version__.split("+")[0],
    }


def recipe_key(spec: dict[str, Any]) -> str:
    import hashlib

    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]


def default_cache_root() -> Path:
    root = os.environ.get("TIERFLOW_CACHE")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "tierflow"


def build_family(
    cache_root: Path | None = None,
    *,
    status: Status | None = None,
    exporter: str = "legacy",
) -> Family:
    """The three decoders, trained and exported the first time, then read from the cache.

    The cache is checked on every call (recipe, every file's sha256); see the module
    docstring. ``exporter`` is the torch exporter ([Note: one graph for prefill and
    decode] in :mod:`.bytelm`); ``legacy`` by default, as it exports each size in under a
    second where ``dynamo`` takes about fifteen.
    """
    say = status or _quiet
    corpus = load_corpus()
    spec = recipe(corpus.digest, exporter)
    directory = (cache_root or default_cache_root()) / f"bytelm-{recipe_key(spec)}"
    directory.mkdir(parents=True, exist_ok=True)
    meta = _valid_meta(directory, spec)
    if meta is not None:
        return Family(directory, meta, built=False)
    with exclusive_lock(directory / ".lock"):
        meta = _valid_meta(directory, spec)
        if meta is not None:
            return Family(directory, meta, built=False)
        say(f"no cached byte decoders in {directory}: training three once (about a minute)")
        meta = _build(directory, spec, corpus, exporter, say)
    return Family(directory, meta, built=True)


def _valid_meta(directory: Path, spec: dict[str, Any]) -> dict[str, Any] | None:
    try:
        meta = json.loads((directory / META_FILE).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(meta, dict) or meta.get("recipe") != spec:
        return None
    for size in (c.name for c in SIZES):
        try:
            if meta["sha256"][f"{size}.onnx"] != sha256_file(directory / f"{size}.onnx"):
                logger.warning("[bytelm] cached %s.onnx is corrupt: rebuilding", size)
                return None
        except (OSError, KeyError, TypeError):
            return None
    return meta


def _build(
    directory: Path, spec: dict[str, Any], corpus: Corpus, exporter: str, say: Status
) -> dict[str, Any]:
    import torch

    begin = time.perf_counter()
    data = np.frombuffer(corpus.train, dtype=np.uint8)
    say(
        f"corpus: {len(corpus.train_files)} standard-library files ({len(data) / 1e6:.1f} MB) "
        f"from {corpus.source}, {len(corpus.heldout_files)} held out"
    )
    previous = torch.get_num_threads()
    torch.set_num_threads(_THREADS)
    try:
        trainer, seconds, losses = _train(data, say)
        trained: dict[str, Any] = {}
        for config, loss in zip(SIZES, losses, strict=True):
            model = truncated(trainer, config)
            write_atomic(
                directory / f"{config.name}.onnx", functools.partial(_export, model, exporter)
            )
            trained[config.name] = {
                "params": sum(p.numel() for p in model.parameters()),
                "final_loss": round(loss, 4),
                **config.to_dict(),
            }
    finally:
        torch.set_num_threads(previous)
    say("measuring the exported decoders on held-out files in ONNX Runtime")
    heldout = np.frombuffer(corpus.heldout, dtype=np.uint8)
    windows = _windows(heldout, _EVAL_WINDOWS, _EVAL_LENGTH)
    for config in SIZES:
        trained[config.name].update(heldout_scores(directory / f"{config.name}.onnx", windows))
    prompts = _windows(heldout, _AGREEMENT_PROMPTS, _AGREEMENT_PROMPT, offset=_EVAL_LENGTH)
    large = directory / "large.onnx"
    agreement = {
        f"{c.name}_vs_large": round(
            draft_agreement(directory / f"{c.name}.onnx", large, prompts, _AGREEMENT_TOKENS), 4
        )
        for c in SIZES[:-1]
    }
    meta = {
        "recipe": spec,
        "sizes": [c.name for c in SIZES],
        "models": trained,
        "agreement": agreement,
        "corpus": {
            "source": corpus.source,
            "train_files": len(corpus.train_files),
            "heldout_files": list(corpus.heldout_files),
            "train_bytes": len(corpus.train),
        },
        "train_seconds": round(seconds, 1),
        "build_seconds": round(time.perf_counter() - begin, 1),
        "sha256": {f"{c.name}.onnx": sha256_file(directory / f"{c.name}.onnx") for c in SIZES},
    }
    text = json.dumps(meta, indent=2) + "\n"
    write_atomic(directory / META_FILE, lambda tmp: tmp.write_text(text))
    say(
        f"byte decoders ready in {meta['build_seconds']:.0f} s: greedy agreement with the large "
        f"model {agreement['small_vs_large']:.0%} (small), {agreement['medium_vs_large']:.0%} "
        "(medium)"
    )
    return meta


def _train(data: np.ndarray, say: Status) -> tuple[Any, float, list[float]]:
    """Train the trunk and its exits on random windows of ``data``.

    Returns the trainer, its seconds and each exit's smoothed last loss. See [Note: one
    trunk, three sizes].
    """
    import torch

    torch.manual_seed(_SEED)
    generator = torch.Generator().manual_seed(_SEED)
    trainer = make_trainer(SIZES[-1], [c.blocks for c in SIZES])
    large = SIZES[-1]
    optimizer = torch.optim.AdamW(trainer.parameters(), lr=_LR, weight_decay=0.01)

    def rate(step: int) -> float:
        if step < _WARMUP:
            return (step + 1) / _WARMUP
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - _WARMUP) / (_STEPS - _WARMUP)))

    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, rate)
    tokens = torch.from_numpy(data.astype(np.int64))
    mask = torch.ones(_BATCH, _WINDOW, dtype=torch.int64)
    positions = torch.arange(_WINDOW).expand(_BATCH, _WINDOW)
    empty = (_BATCH, large.heads, 0, large.head_dim)
    past = [torch.zeros(empty) for _ in past_names(large.blocks)]
    start = said = time.perf_counter()
    smoothed = [math.log(256)] * len(SIZES)
    trainer.train()
    for step in range(_STEPS):
        starts = torch.randint(0, len(tokens) - _WINDOW - 1, (_BATCH,), generator=generator)
        batch = torch.stack([tokens[s : s + _WINDOW + 1] for s in starts.tolist()])
        targets = batch[:, 1:].reshape(-1)
        out = [x.reshape(-1, 256) for x in trainer(batch[:, :-1], mask, positions, *past)]
        exits, alone = out[: len(SIZES)], out[len(SIZES) :]
        losses = [torch.nn.functional.cross_entropy(logits, targets) for logits in exits]
        # The early exits' heads also learn the large exit's distribution, on the trunk's
        # hidden state detached ([Note: one trunk, three sizes]).
        teacher = torch.nn.functional.log_softmax(exits[-1].detach(), dim=-1)
        distilled = [
            torch.nn.functional.kl_div(
                torch.nn.functional.log_softmax(logits, dim=-1),
                teacher,
                log_target=True,
                reduction="batchmean",
            )
            for logits in alone
        ]
        optimizer.zero_grad()
        (torch.stack(losses).mean() + _DISTIL * torch.stack(distilled).mean()).backward()
        torch.nn.utils.clip_grad_norm_(trainer.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        smoothed = [
            0.9 * m + 0.1 * float(x.detach()) for m, x in zip(smoothed, losses, strict=True)
        ]
        if time.perf_counter() - said >= _STATUS_EVERY_S:
            said = time.perf_counter()
            say(f"step {step + 1}/{_STEPS}: {_losses(smoothed)} ({said - start:.0f} s)")
    seconds = time.perf_counter() - start
    say(f"trained {_STEPS} steps in {seconds:.0f} s: {_losses(smoothed)}")
    trainer.eval()
    return trainer, seconds, smoothed


def _export(model: Any, exporter: str, path: Path) -> None:
    export_onnx(model, path, exporter=exporter)


def _losses(values: Sequence[float]) -> str:
    return ", ".join(
        f"{c.name} {v / math.log(2):.2f} bits/byte" for c, v in zip(SIZES, values, strict=True)
    )


def _windows(data: np.ndarray, count: int, length: int, offset: int = 0) -> np.ndarray:
    """``count`` windows of ``length`` bytes spread evenly over ``data``, int64 [count, length]."""
    last = len(data) - length - offset
    starts = np.linspace(0, last, count).astype(np.int64) + offset
    return np.stack([data[s : s + length] for s in starts]).astype(np.int64)


def _prefill(session: Any, ids: np.ndarray) -> np.ndarray:
    """Logits of a batch of sequences run from an empty cache, [batch, seq, 256]."""
    from tierflow.greedy import decoder_of_session, initial_state

    decoder, states = decoder_of_session(session)
    batch, length = ids.shape
    feeds: dict[str, np.ndarray] = {decoder.tokens: ids}
    if decoder.attention_mask is not None:
        feeds[decoder.attention_mask] = np.ones((batch, length), dtype=np.int64)
    if decoder.position_ids is not None:
        feeds[decoder.position_ids] = np.tile(np.arange(length, dtype=np.int64), (batch, 1))
    for state in states:
        empty = initial_state(state)
        feeds[state.input] = np.zeros((batch, *empty.shape[1:]), dtype=empty.dtype)
    return np.asarray(session.run([decoder.logits], feeds)[0])


def _session(path: Path) -> Any:
    from tierflow.onnxrt.inference import open_session

    return open_session(path, threads=1, what=f"decoder {path}")


def heldout_scores(path: Path, windows: np.ndarray) -> dict[str, float]:
    """Bits per byte and next-byte accuracy of the decoder on ``windows`` (teacher forced)."""
    logits = _prefill(_session(path), windows[:, :-1]).astype(np.float64)
    targets = windows[:, 1:]
    shifted = logits - logits.max(axis=-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    chosen = np.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
    return {
        "heldout_bits_per_byte": round(float(-chosen.mean() / math.log(2)), 4),
        "heldout_next_byte_accuracy": round(float((logits.argmax(-1) == targets).mean()), 4),
    }


def draft_agreement(draft: Path, target: Path, prompts: np.ndarray, tokens: int) -> float:
    """How often ``draft``'s greedy token equals ``target``'s, on ``target``'s own text.

    ``target`` continues each prompt greedily for ``tokens`` tokens (with its KV cache,
    :func:`tierflow.greedy.reference_generate`); the draft then reads each prompt plus that
    continuation once, and at every generated position its argmax is compared with the
    token the target chose: the share that agree is the acceptance rate greedy
    speculative decoding would see with this draft.
    """
    from tierflow.greedy import reference_generate

    continued = [
        list(prompt) + list(reference_generate(target, prompt.tolist(), tokens).tokens)
        for prompt in prompts
    ]
    ids = np.asarray(continued, dtype=np.int64)
    logits = _prefill(_session(draft), ids[:, :-1])
    length = prompts.shape[1]
    guessed = logits[:, length - 1 :].argmax(-1)
    return float((guessed == ids[:, length:]).mean())


def agreement_table(meta: dict[str, Any], sizes: Sequence[str] | None = None) -> str:
    """An aligned table of the family's held-out figures, for people."""
    rows = [("size", "blocks", "width", "params", "bits/byte", "next-byte acc", "agrees w/ large")]
    for size in sizes or meta["sizes"]:
        model = meta["models"][size]
        agrees = meta["agreement"].get(f"{size}_vs_large")
        rows.append(
            (
                size,
                str(model["blocks"]),
                str(model["width"]),
                f"{model['params']:,}",
                f"{model['heldout_bits_per_byte']:.2f}",
                f"{model['heldout_next_byte_accuracy']:.1%}",
                "-" if agrees is None else f"{agrees:.1%}",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows)
