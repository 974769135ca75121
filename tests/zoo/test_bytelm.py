"""The byte decoder family: corpus, byte tokens, both exporters, the trained and cached sizes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tierflow.greedy import decoder_of_session, initial_state, reference_generate, session_step
from tierflow.onnxrt.inference import open_session
from tierflow.zoo import byte_corpus
from tierflow.zoo.bytelm_family import recipe_key


def test_byte_tokens_round_trip_and_stream_split_characters() -> None:
    text = "def café():\n    return 'π'"
    ids = byte_corpus.encode(text)
    assert all(0 <= i < 256 for i in ids) and len(ids) == len(text.encode("utf-8"))
    assert byte_corpus.decode(ids) == text
    stream = byte_corpus.StreamDecoder()
    pieces = [stream.feed(i) for i in byte_corpus.encode("é!")]
    assert pieces == ["", "é", "!"]  # é is two bytes: nothing until its second arrives
    assert stream.feed(0xC3) == "" and stream.flush() == "\ufffd"


@pytest.mark.integration
def test_corpus_is_the_standard_library_split_one_file_in_ten() -> None:
    corpus = byte_corpus.load_corpus()
    again = byte_corpus.load_corpus()
    assert corpus.digest == again.digest and corpus.heldout_files == again.heldout_files
    assert not set(corpus.train_files) & set(corpus.heldout_files)
    total = len(corpus.train_files) + len(corpus.heldout_files)
    assert 0.03 < len(corpus.heldout_files) / total < 0.25
    assert len(corpus.train) > 1_000_000 and b"def " in corpus.heldout


def test_the_cache_key_follows_the_recipe() -> None:
    base = {"corpus": "a", "steps": 400}
    assert recipe_key(base) == recipe_key(dict(base))
    assert recipe_key(base) != recipe_key({**base, "corpus": "b"})


def _whole_text_tokens(path: Path, prompt: list[int], generated: tuple[int, ...]) -> list[int]:
    """Argmax after each position of prompt + generated, in one call without a cache."""
    session = open_session(path, threads=1)
    decoder, states = decoder_of_session(session)
    ids = prompt + list(generated[:-1])
    feeds = {**decoder.step_feeds(ids, 0), **{s.input: initial_state(s) for s in states}}
    logits = np.asarray(session_step(session)(feeds)[decoder.logits])[0]
    return [int(t) for t in logits[len(prompt) - 1 :].argmax(-1)]


@pytest.mark.integration
@pytest.mark.parametrize("exporter", ["dynamo", "legacy"])
def test_both_exporters_write_one_graph_for_prefill_and_decode(
    tmp_path: Path, exporter: str
) -> None:
    import torch

    from tierflow.zoo.bytelm import ByteLMConfig, empty_past, export_onnx, make_model

    torch.manual_seed(1)
    config = ByteLMConfig("tiny", blocks=2, width=16, heads=2)
    model = make_model(config)
    path = export_onnx(model, tmp_path / "tiny.onnx", exporter=exporter, external_data=True)
    session = open_session(path, threads=1)
    names = [i.name for i in session.get_inputs()]
    assert names[:3] == ["input_ids", "attention_mask", "position_ids"]
    assert names[3:] == [f"past_key_values.{i}.{k}" for i in range(2) for k in ("key", "value")]
    shapes = {o.name: o.shape for o in session.get_outputs()}
    assert shapes["logits"][2] == 256 and shapes["present.1.value"][1:4:2] == [2, 8]
    # Weights outside the graph where the dynamo exporter is asked to put them there.
    assert (tmp_path / "tiny.onnx.data").exists() == (exporter == "dynamo")
    prompt = [100, 101, 102]
    generation = reference_generate(path, prompt, 6)
    ids = torch.tensor([prompt + list(generation.tokens[:-1])])
    length = ids.shape[1]
    with torch.no_grad():
        logits = model(
            ids,
            torch.ones(1, length, dtype=torch.int64),
            torch.arange(length).view(1, length),
            *empty_past(config),
        )[0]
    assert logits[0, len(prompt) - 1 :].argmax(-1).tolist() == list(generation.tokens)


@pytest.mark.integration
@pytest.mark.slow
def test_family_is_trained_once_cached_and_agrees_with_the_large_model(byte_family: Any) -> None:
    from tierflow.zoo.bytelm_family import agreement_table, build_family

    family = byte_family
    assert family.sizes == ("small", "medium", "large")
    blocks = [family.meta["models"][s]["blocks"] for s in family.sizes]
    assert blocks == [2, 4, 8]
    for size in family.sizes:
        model = family.meta["models"][size]
        # Better than a byte's 8 bits, as a model of real text must be.
        assert model["heldout_bits_per_byte"] < 4.0
        assert model["heldout_next_byte_accuracy"] > 0.3
    agreement = family.meta["agreement"]
    assert agreement["small_vs_large"] >= 0.5 and agreement["medium_vs_large"] >= 0.5
    assert "agrees w/ large" in agreement_table(family.meta)
    again = build_family()
    assert not again.built and again.directory == family.directory
    # The KV cache loop equals the whole text read at once, token for token.
    prompt = byte_corpus.encode("def main():\n    ")
    for size in family.sizes:
        generation = reference_generate(family.path(size), prompt, 16)
        assert _whole_text_tokens(family.path(size), prompt, generation.tokens) == list(
            generation.tokens
        )
