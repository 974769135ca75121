"""Checking a stateful split over several requests: each tier's state fed back, bit for bit.

A stateless split is checked on one request (:func:`~.split.verify_split`). A stateful
one must also carry its state from request to request as the tiers will: the chain of
segments keeps each pair's output and feeds it back on the next step, and so does the
whole model; after every step every output (answers and states) must be equal bit for
bit, at the same ONNX Runtime settings. A decoder is run greedily from a prompt
(:func:`verify_decoder`), its tokens chosen from the whole model's logits; a streaming
model over chunks drawn like its representative inputs (:func:`verify_stream`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx

from tierflow.errors import PlanError
from tierflow.greedy import StepFn, initial_state
from tierflow.partitioner.graph import ModelGraph
from tierflow.partitioner.split import Segment, session
from tierflow.partitioner.tensors import first_line
from tierflow.state.spec import DecoderSpec, StateSpec


@dataclass(frozen=True)
class StatefulCheck:
    """How a stateful split compared with the whole model over ``steps`` requests."""

    bitwise_equal: bool
    max_abs_diff: float
    steps: int
    tokens: tuple[int, ...] = ()
    #: A decoder's: whether the chain chose the whole model's token at every step.
    same_tokens: bool | None = None

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "bitwise_equal": self.bitwise_equal,
            "max_abs_diff": self.max_abs_diff,
            "steps": self.steps,
        }
        if self.tokens:
            data["tokens"] = list(self.tokens)
        if self.same_tokens is not None:
            data["same_tokens"] = self.same_tokens
        return data


def whole_step(model: onnx.ModelProto, level: str = "disabled") -> StepFn:
    """A step running the whole model in one session."""
    sess = session(model, level=level)
    names = [o.name for o in sess.get_outputs()]
    wanted = [i.name for i in sess.get_inputs()]

    def step(feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        try:
            values = sess.run(names, {n: feeds[n] for n in wanted})
        except Exception as exc:  # onnxruntime raises its own exception types
            raise PlanError(
                f"ONNX Runtime failed running the whole model: {first_line(exc)}"
            ) from exc
        return dict(zip(names, values, strict=True))

    return step


def chain_step(segments: Sequence[Segment], level: str = "disabled") -> StepFn:
    """A step running the segments one after another, as the tiers would.

    Each segment's state inputs come from the step's feeds (a tier's session store); only
    its other outputs go on to the next segment (as :func:`~.split.run_segments` runs
    them, with each session opened once).
    """
    opened = [(spec, session(model, level=level)) for spec, model in segments]

    def step(feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        available = dict(feeds)
        outputs: dict[str, np.ndarray] = {}
        for spec, sess in opened:
            names = [o.name for o in sess.get_outputs()]
            try:
                values = sess.run(names, {n: available[n] for n in spec.inputs})
            except KeyError as exc:
                raise PlanError(f"segment {spec.file} needs {exc}, which nothing made") from exc
            except Exception as exc:  # onnxruntime raises its own exception types
                raise PlanError(
                    f"ONNX Runtime failed running segment {spec.file}: {first_line(exc)}"
                ) from exc
            made = dict(zip(names, values, strict=True))
            outputs.update(made)
            available.update({n: made[n] for n in spec.sent_outputs})
        return outputs

    return step


def _compare(
    want: Mapping[str, np.ndarray], got: Mapping[str, np.ndarray], names: Sequence[str]
) -> tuple[bool, float]:
    missing = [n for n in names if n not in got]
    if missing:
        raise PlanError(f"the segments do not produce model outputs {missing}")
    equal, worst = True, 0.0
    for name in names:
        a, b = np.asarray(want[name]), np.asarray(got[name])
        if a.shape != b.shape or a.dtype != b.dtype:
            return False, float("inf")
        equal = equal and a.tobytes() == b.tobytes()
        if a.size:
            worst = max(worst, float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64)))))
    return equal, worst


def lockstep(
    whole: StepFn,
    chain: StepFn,
    states: Sequence[StateSpec],
    outputs: Sequence[str],
    feeds_for: Callable[[int, Mapping[str, np.ndarray] | None], dict[str, np.ndarray] | None],
    first_state: Mapping[str, np.ndarray],
) -> tuple[StatefulCheck, list[Mapping[str, np.ndarray]]]:
    """Run both steps with the same request feeds, each feeding its own state back.

    ``feeds_for(step, last whole-model outputs)`` gives a step's request inputs, None to
    stop. Returns the comparison and the whole model's outputs per step.
    """
    state_whole = dict(first_state)
    state_chain = dict(first_state)
    equal, worst, step = True, 0.0, 0
    history: list[Mapping[str, np.ndarray]] = []
    last: Mapping[str, np.ndarray] | None = None
    while (request := feeds_for(step, last)) is not None:
        want = whole({**request, **state_whole})
        got = chain({**request, **state_chain})
        same, diff = _compare(want, got, outputs)
        equal, worst = equal and same, max(worst, diff)
        state_whole = {s.input: np.asarray(want[s.output]) for s in states}
        state_chain = {s.input: np.asarray(got[s.output]) for s in states}
        history.append(want)
        last = want
        step += 1
    return StatefulCheck(equal, worst, step), history


def verify_decoder(
    whole: StepFn,
    chain: StepFn,
    decoder: DecoderSpec,
    states: Sequence[StateSpec],
    outputs: Sequence[str],
    prompt: Sequence[int],
    max_tokens: int,
) -> StatefulCheck:
    """Prefill ``prompt`` and decode ``max_tokens - 1`` greedy tokens through both."""
    tokens: list[int] = []
    chosen: list[int] = []  # the chain's own choices, on the whole model's tokens

    def chained(feeds: Mapping[str, np.ndarray]) -> Mapping[str, np.ndarray]:
        got = chain(feeds)
        if decoder.logits in got:
            chosen.append(int(np.argmax(np.asarray(got[decoder.logits])[0, -1])))
        return got

    def feeds_for(step: int, last: Mapping[str, np.ndarray] | None) -> dict[str, np.ndarray] | None:
        if last is not None:
            tokens.append(int(np.argmax(np.asarray(last[decoder.logits])[0, -1])))
        if step == 0:
            return decoder.step_feeds(prompt, 0)
        if step >= max_tokens:
            return None
        return decoder.step_feeds([tokens[-1]], len(prompt) + step - 1)

    first = {s.input: initial_state(s) for s in states}
    check, _ = lockstep(whole, chained, states, outputs, feeds_for, first)
    return StatefulCheck(
        check.bitwise_equal, check.max_abs_diff, check.steps, tuple(tokens), chosen == tokens
    )


def unit_state_bytes(graph: ModelGraph) -> list[int]:
    """Each unit's state pairs, in bytes (symbolic dimensions as 1: one session)."""
    return [
        sum(s.nbytes() for s in graph.states_between(i, i + 1)) for i in range(graph.unit_count())
    ]


def verify_stream_split(
    graph: ModelGraph, segments: Sequence[Segment], steps: int = 3
) -> StatefulCheck:
    """``steps`` requests through the chain and the whole model, state fed back on both.

    Each request's other inputs are the graph's representative inputs drawn with another
    seed; the state starts at zeros, as a session's first request without one does.
    """
    kept = {s.input for s in graph.state}
    chunks = [
        {k: v for k, v in graph.representative_inputs(seed=i).items() if k not in kept}
        for i in range(steps)
    ]
    outputs = [o.name for o in graph.outputs]
    return verify_stream(
        whole_step(graph.model), chain_step(segments), graph.state, outputs, chunks
    )


def verify_stream(
    whole: StepFn,
    chain: StepFn,
    states: Sequence[StateSpec],
    outputs: Sequence[str],
    chunks: Sequence[Mapping[str, np.ndarray]],
) -> StatefulCheck:
    """Feed ``chunks`` (request inputs without the state) in order through both."""

    def feeds_for(step: int, _: Mapping[str, np.ndarray] | None) -> dict[str, np.ndarray] | None:
        return dict(chunks[step]) if step < len(chunks) else None

    first = {s.input: initial_state(s) for s in states}
    check, _ = lockstep(whole, chain, states, outputs, feeds_for, first)
    return check
