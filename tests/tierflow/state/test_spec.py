"""plan.json's state pairs and decoder: typed, validated where they enter, old plans unchanged."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tierflow.errors import PlanError
from tierflow.plan import DecoderSpec, Plan, SegmentSpec, StateSpec

KEY = StateSpec("past_key_values.0.key", "present.0.key", "float32", (None, 2, None, 4), 2)
VALUE = StateSpec("past_key_values.0.value", "present.0.value", "float32", (None, 2, None, 4), 2)
DECODER = DecoderSpec("input_ids", "logits", "attention_mask", "position_ids", 256, 2048, 64)
TOKENS = ("input_ids", "attention_mask", "position_ids")


def _decoder_plan(**changes: Any) -> Plan:
    """Two segments: the device owns block 0's cache, the cloud block 1's (key only)."""
    cloud_key = StateSpec("past_key_values.1.key", "present.1.key", "float32", (1, 2, None, 4), 2)
    fields: dict[str, Any] = {
        "model_file": "decoder.onnx",
        "model_sha256": "a" * 64,
        "inputs": TOKENS,
        "outputs": ("logits",),
        "segments": (
            SegmentSpec(
                "device",
                "00-device.onnx",
                (*TOKENS, KEY.input, VALUE.input),
                ("hidden", "attention_mask", "position_ids", KEY.output, VALUE.output),
                state=(KEY, VALUE),
            ),
            SegmentSpec(
                "cloud",
                "01-cloud.onnx",
                ("hidden", "attention_mask", "position_ids", cloud_key.input),
                ("logits", cloud_key.output),
                state=(cloud_key,),
            ),
        ),
        "state_pairs": (
            (KEY.input, KEY.output),
            (VALUE.input, VALUE.output),
            (cloud_key.input, cloud_key.output),
        ),
        "decoder": DECODER,
    }
    fields.update(changes)
    return Plan(**fields)


def test_state_and_decoder_round_trip_through_plan_json() -> None:
    plan = _decoder_plan()
    data = plan.to_dict()
    assert data["segments"][0]["state"][0] == {
        "input": "past_key_values.0.key",
        "output": "present.0.key",
        "dtype": "float32",
        "shape": [None, 2, None, 4],
        "grows": 2,
    }
    assert data["state_pairs"][0] == ["past_key_values.0.key", "present.0.key"]
    assert data["decoder"]["context"] == 2048 and data["decoder"]["vocab"] == 256
    again = Plan.from_dict(data)
    assert again == plan
    assert again.segments[0].state_inputs == (KEY.input, VALUE.input)
    assert again.segments[0].sent_outputs == ("hidden", "attention_mask", "position_ids")
    assert again.decoder == DECODER


def test_plans_without_state_load_unchanged() -> None:
    plain = Plan(
        "m.onnx", "b" * 64, ("x",), ("y",), (SegmentSpec("cloud", "00-cloud.onnx", ("x",), ("y",)),)
    )
    data = plain.to_dict()
    assert "state_pairs" not in data and "decoder" not in data
    assert "state" not in data["segments"][0]
    loaded = Plan.from_dict(data)
    assert loaded.decoder is None and loaded.state_pairs == () and loaded.segments[0].state == ()


def test_a_state_output_never_feeds_another_segment() -> None:
    segments = _decoder_plan().segments
    leaking = SegmentSpec(
        "cloud",
        "01-cloud.onnx",
        ("hidden", "attention_mask", "position_ids", "present.0.key", "past_key_values.1.key"),
        ("logits", "present.1.key"),
        state=segments[1].state,
    )
    with pytest.raises(PlanError, match=r"needs \['present.0.key'\]"):
        _decoder_plan(segments=(segments[0], leaking))


def test_a_state_input_of_another_segment_is_refused() -> None:
    segments = _decoder_plan().segments
    taking = SegmentSpec(
        "cloud",
        "01-cloud.onnx",
        (*segments[1].inputs, KEY.input),
        segments[1].outputs,
        state=segments[1].state,
    )
    with pytest.raises(PlanError, match=r"01-cloud.onnx needs \['past_key_values.0.key'\]"):
        _decoder_plan(segments=(segments[0], taking))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"state_pairs": ()}, "not both in 'state_pairs'"),
        ({"inputs": (*TOKENS, "past_key_values.0.key")}, "among the plan's inputs or outputs"),
        ({"outputs": ("logits", "present.0.key")}, r"no segment yields .*'present.0.key'"),
        ({"decoder": DecoderSpec("tokens", "logits", None, None, 256, 64, 8)}, "decoder tensors"),
    ],
)
def test_inconsistent_state_records_are_refused(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(PlanError, match=message):
        _decoder_plan(**changes)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"input": "s", "output": "sN", "dtype": "float32", "shape": [1, "h"]}, "shape"),
        ({"input": "s", "output": "sN", "dtype": "float32", "shape": [1, 4], "grows": 2}, "axis 2"),
        ({"input": "s", "output": "sN", "dtype": "nonsense", "shape": [1]}, "not a numpy dtype"),
        ({"input": "", "output": "sN", "dtype": "float32", "shape": [1]}, "tensor name"),
    ],
)
def test_malformed_state_specs_are_plan_errors(data: dict[str, Any], message: str) -> None:
    with pytest.raises(PlanError, match=message):
        StateSpec.from_dict(data)


def test_decoder_spec_validates_and_builds_step_feeds() -> None:
    with pytest.raises(PlanError, match="context"):
        DecoderSpec.from_dict({**DECODER.to_dict(), "context": 0})
    feeds = DECODER.step_feeds([7, 8, 9], position=5)
    assert feeds["input_ids"].tolist() == [[7, 8, 9]]
    assert feeds["attention_mask"].tolist() == [[1] * 8]
    assert feeds["position_ids"].tolist() == [[5, 6, 7]]
    assert all(v.dtype == np.int64 for v in feeds.values())


def test_state_bytes_count_the_growing_axis_at_the_given_length() -> None:
    assert KEY.nbytes(2048) == 1 * 2 * 2048 * 4 * 4
    fixed = StateSpec("state", "stateN", "float32", (2, 1, 128), None)
    assert fixed.nbytes(2048) == fixed.nbytes() == 2 * 128 * 4
