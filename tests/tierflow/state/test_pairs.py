"""State pairs found by name and given with --state: conventions, globs, mismatches."""

from __future__ import annotations

import pytest

from tierflow.errors import ModelError, UsageError
from tierflow.state.pairs import (
    TensorSig,
    find_decoder,
    find_state_pairs,
    parse_state_option,
)


def _kv(blocks: int, past_in: str = "past_key_values.{i}.{k}", out: str = "present.{i}.{k}"):
    inputs = [
        TensorSig("input_ids", "int64", ("batch", "seq")),
        TensorSig("attention_mask", "int64", ("batch", "past + seq")),
    ]
    outputs = [TensorSig("logits", "float32", ("batch", "seq", 256))]
    for i in range(blocks):
        for k in ("key", "value"):
            inputs.append(TensorSig(past_in.format(i=i, k=k), "float32", ("batch", 4, "past", 16)))
            outputs.append(
                TensorSig(out.format(i=i, k=k), "float32", ("batch", 4, "past + seq", 16))
            )
    return inputs, outputs


def test_hugging_face_kv_cache_pairs_are_found_with_their_growing_axis() -> None:
    inputs, outputs = _kv(2)
    pairs = find_state_pairs(inputs, outputs)
    assert [(p.input, p.output) for p in pairs] == [
        ("past_key_values.0.key", "present.0.key"),
        ("past_key_values.0.value", "present.0.value"),
        ("past_key_values.1.key", "present.1.key"),
        ("past_key_values.1.value", "present.1.value"),
    ]
    assert all(p.grows == 2 and p.shape == (None, 4, None, 16) for p in pairs)
    decoder = find_decoder(inputs, outputs, pairs, context=512, max_tokens=16)
    assert decoder is not None
    assert (decoder.tokens, decoder.logits, decoder.vocab) == ("input_ids", "logits", 256)
    assert decoder.attention_mask == "attention_mask" and decoder.position_ids is None


@pytest.mark.parametrize(
    ("past", "present"),
    [("past.{i}.{k}", "present.{i}.{k}"), ("past_{k}_{i}", "present_{k}_{i}")],
)
def test_older_past_present_names_pair_too(past: str, present: str) -> None:
    inputs, outputs = _kv(1, past, present)
    assert len(find_state_pairs(inputs, outputs)) == 2


@pytest.mark.parametrize(
    ("name_in", "name_out"),
    [("state", "stateN"), ("h0", "hn"), ("c", "cn"), ("enc_state", "enc_state_out"),
     ("cache_in", "cache_out")],
)  # fmt: skip
def test_recurrent_states_pair_by_name_and_keep_their_shape(name_in: str, name_out: str) -> None:
    inputs = [TensorSig("audio", "float32", (1, 512)), TensorSig(name_in, "float32", (2, 1, 128))]
    outputs = [TensorSig("out", "float32", (1, 1)), TensorSig(name_out, "float32", (2, 1, 128))]
    (pair,) = find_state_pairs(inputs, outputs)
    assert (pair.input, pair.output, pair.grows, pair.shape) == (
        name_in,
        name_out,
        None,
        (2, 1, 128),
    )
    assert find_decoder(inputs, outputs, (pair,), context=8, max_tokens=1) is None


def test_names_that_only_look_alike_are_not_paired() -> None:
    inputs = [TensorSig("state", "float32", (1, 64)), TensorSig("pasta", "float32", (1, 3))]
    outputs = [
        TensorSig("stateN", "float16", (1, 64)),  # another dtype: not the same state
        TensorSig("presenta", "float32", (1, 3)),  # no convention maps pasta to it
    ]
    assert find_state_pairs(inputs, outputs) == ()


def test_state_option_globs_pair_every_match() -> None:
    inputs, outputs = _kv(2, "cache_{k}{i}", "new_cache_{k}{i}")
    assert find_state_pairs(inputs, outputs) == ()
    pairs = find_state_pairs(inputs, outputs, [parse_state_option("cache_*=new_cache_*")])
    assert [(p.input, p.output) for p in pairs] == [
        ("cache_key0", "new_cache_key0"),
        ("cache_value0", "new_cache_value0"),
        ("cache_key1", "new_cache_key1"),
        ("cache_value1", "new_cache_value1"),
    ]
    exact = find_state_pairs(inputs, outputs, [parse_state_option("cache_key1=new_cache_key1")])
    assert [p.input for p in exact] == ["cache_key1"]


def test_a_given_pair_whose_shapes_differ_is_one_clear_error() -> None:
    inputs = [TensorSig("mem", "float32", (1, 64)), TensorSig("x", "float32", (1, 8))]
    outputs = [TensorSig("mem_next", "float32", (1, 32)), TensorSig("y", "float32", (1, 8))]
    with pytest.raises(ModelError, match=r"mem -> mem_next .*shapes differ on axes \[1\]"):
        find_state_pairs(inputs, outputs, [("mem", "mem_next")])
    outputs[0] = TensorSig("mem_next", "float16", (1, 64))
    with pytest.raises(ModelError, match=r"dtypes differ \(float32 in, float16 out\)"):
        find_state_pairs(inputs, outputs, [("mem", "mem_next")])


@pytest.mark.parametrize(
    ("option", "message"),
    [
        ("nothing=stateN", "no model input matches 'nothing'"),
        ("state=missing", "'missing', which is not a model output"),
        ("state", "expected IN=OUT"),
        ("st*=*N*", r"OUT has 2 wildcard\(s\), IN has 1"),
    ],
)
def test_bad_state_options_are_usage_errors(option: str, message: str) -> None:
    inputs = [TensorSig("state", "float32", (1, 4))]
    outputs = [TensorSig("stateN", "float32", (1, 4))]
    with pytest.raises(UsageError, match=message):
        find_state_pairs(inputs, outputs, [parse_state_option(option)])


def test_one_input_in_two_pairs_is_refused() -> None:
    inputs = [TensorSig("state", "float32", (1, 4))]
    outputs = [TensorSig("stateN", "float32", (1, 4)), TensorSig("other", "float32", (1, 4))]
    with pytest.raises(ModelError, match="in two state pairs"):
        find_state_pairs(inputs, outputs, [("state", "stateN"), ("state", "other")])


def test_a_growing_state_without_decoder_tensors_is_an_error() -> None:
    inputs, outputs = _kv(1)
    inputs = [i for i in inputs if i.name != "input_ids"]
    pairs = find_state_pairs(inputs, outputs)
    with pytest.raises(ModelError, match="no decoder tensors"):
        find_decoder(inputs, outputs, pairs, context=8, max_tokens=1)


@pytest.mark.parametrize(
    "declared_out",
    [(None, None, None), ("AddstateN_dim_0", "batch", "AddstateN_dim_2"), None],
)
def test_an_output_shape_the_exporter_left_vague_is_no_mismatch(declared_out) -> None:
    # Silero VAD's files declare stateN like this; its state keeps its shape.
    inputs = [TensorSig("input", "float32", ("batch", "sequence")),
              TensorSig("state", "float32", (2, "batch", 128))]  # fmt: skip
    outputs = [TensorSig("stateN", "float32", declared_out)]
    (pair,) = find_state_pairs(inputs, outputs)
    assert pair.grows is None and pair.shape == (2, None, 128)


def test_a_cache_whose_output_says_nothing_grows_along_its_symbolic_axis() -> None:
    inputs = [TensorSig("past_key_0", "float32", (1, 4, "past", 16))]
    outputs = [TensorSig("present_key_0", "float32", (None, None, None, None))]
    (pair,) = find_state_pairs(inputs, outputs)
    assert pair.grows == 2
