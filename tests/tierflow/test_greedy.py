"""The reference greedy loop: KV cache fed back step by step equals running the whole text."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tierflow.errors import InputError
from tierflow.greedy import (
    decoder_of_session,
    greedy_generate,
    initial_state,
    reference_generate,
    session_step,
)
from tierflow.onnxrt.inference import open_session
from tierflow.zoo.tiny_stateful import tiny_decoder


@pytest.fixture(scope="module")
def decoder_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_decoder(tmp_path_factory.mktemp("greedy") / "tiny.onnx", blocks=2)


def _without_cache(path: Path, ids: list[int]) -> np.ndarray:
    """Logits of the whole sequence in one call from an empty cache, [len(ids), vocab]."""
    session = open_session(path, threads=1)
    decoder, states = decoder_of_session(session)
    feeds = {**decoder.step_feeds(ids, 0), **{s.input: initial_state(s) for s in states}}
    return np.asarray(session_step(session)(feeds)[decoder.logits])[0]


def test_greedy_with_the_cache_equals_argmax_over_the_whole_text(decoder_path: Path) -> None:
    prompt = [1, 2, 3, 4]
    generation = reference_generate(decoder_path, prompt, 12)
    assert len(generation.tokens) == 12 and generation.steps == 12
    full = _without_cache(decoder_path, prompt + list(generation.tokens[:-1]))
    assert full[len(prompt) - 1 :].argmax(-1).tolist() == list(generation.tokens)
    np.testing.assert_allclose(np.stack(generation.logits), full[len(prompt) - 1 :], atol=1e-5)


def test_generation_stops_after_a_stop_token(decoder_path: Path) -> None:
    first = reference_generate(decoder_path, [5, 6], 8)
    stop = first.tokens[2]
    stopped = reference_generate(decoder_path, [5, 6], 8, stop=[stop])
    assert stopped.tokens == first.tokens[: first.tokens.index(stop) + 1]


def test_a_prompt_longer_than_the_context_is_refused(decoder_path: Path) -> None:
    with pytest.raises(InputError, match="need a context of 12; the decoder is planned for 8"):
        reference_generate(decoder_path, list(range(10)), 3, context=8)
    with pytest.raises(InputError, match="outside the vocabulary"):
        reference_generate(decoder_path, [99], 1)


def test_the_loop_feeds_each_state_output_back(decoder_path: Path) -> None:
    session = open_session(decoder_path, threads=1)
    decoder, states = decoder_of_session(session)
    seen: list[dict[str, tuple[int, ...]]] = []
    step = session_step(session)

    def spy(feeds):  # type: ignore[no-untyped-def]
        seen.append({s.input: feeds[s.input].shape for s in states})
        return step(feeds)

    greedy_generate(spy, decoder, states, [1, 2, 3], 3)
    lengths = [shape["past_key_values.0.key"][2] for shape in seen]
    assert lengths == [0, 3, 4]
