"""Greedy generation with a decoder and its KV cache: the reference every split must equal.

:func:`greedy_generate` drives any *step* (a function from one request's feeds to its
outputs) the way a decoder is driven: prefill the prompt, then one token at a time, each
state output fed back as the next step's state input. :func:`reference_generate` runs it
on the unsplit ONNX model in one ONNX Runtime session: greedy output from tierflow's
tiers (and the planner's check of a split, which chains the segments as the step) must
equal it token for token at the same session settings. numpy and onnxruntime only: no
torch, no onnx.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tierflow.errors import InputError, ModelError
from tierflow.onnxrt.inference import DEFAULT_OPTIMIZATION, open_session
from tierflow.state.pairs import find_decoder, find_state_pairs, ort_sig
from tierflow.state.spec import DecoderSpec, StateSpec

#: One request of a stateful model: feeds in, outputs out (a session, or a chain of them).
StepFn = Callable[[Mapping[str, np.ndarray]], Mapping[str, np.ndarray]]

#: --context assumed for an unsplit model when the caller names none.
DEFAULT_CONTEXT = 2048


@dataclass(frozen=True)
class Generation:
    """What a greedy run produced: the new tokens and, per step, the logits it chose from.

    ``logits[i]`` is the last position's logits of step ``i`` (step 0 is the prefill),
    ``float32 [vocab]``; token ``i`` is its argmax. ``steps`` counts model calls.
    """

    prompt: tuple[int, ...]
    tokens: tuple[int, ...]
    logits: tuple[np.ndarray, ...] = field(repr=False)

    @property
    def steps(self) -> int:
        return len(self.logits)


def initial_state(state: StateSpec) -> np.ndarray:
    """A session's first state: empty along a growing axis, zeros of the planned shape else.

    Symbolic dimensions other than the growing one are 1 (one sequence at a time).
    """
    dims = [
        0 if axis == state.grows else (1 if d is None else d) for axis, d in enumerate(state.shape)
    ]
    return np.zeros(dims, dtype=np.dtype(state.dtype))


def greedy_generate(
    step: StepFn,
    decoder: DecoderSpec,
    states: Sequence[StateSpec],
    prompt: Sequence[int],
    max_tokens: int,
    *,
    stop: Sequence[int] = (),
    on_token: Callable[[int], None] | None = None,
) -> Generation:
    """Prefill ``prompt``, then generate up to ``max_tokens`` tokens by argmax.

    Each step feeds the tokens, the companions (:meth:`DecoderSpec.step_feeds`) and every
    state input, and keeps every state output for the next step. Stops early after a
    token in ``stop`` (which is kept). The prompt plus the tokens fed back must fit
    ``decoder.context``.
    """
    ids = [int(t) for t in prompt]
    if not ids:
        raise InputError("the prompt is empty: a decoder needs at least one token")
    if max_tokens < 1:
        raise InputError(f"max_tokens must be at least 1, got {max_tokens}")
    bad = [t for t in ids if not 0 <= t < decoder.vocab]
    if bad:
        raise InputError(f"prompt token {bad[0]} is outside the vocabulary 0..{decoder.vocab - 1}")
    if len(ids) + max_tokens - 1 > decoder.context:
        raise InputError(
            f"a prompt of {len(ids)} tokens and {max_tokens} new ones need a context of "
            f"{len(ids) + max_tokens - 1}; the decoder is planned for {decoder.context}"
        )
    current = {s.input: initial_state(s) for s in states}
    position = 0
    feed: list[int] = ids
    tokens: list[int] = []
    logits: list[np.ndarray] = []
    while len(tokens) < max_tokens:
        feeds = {**decoder.step_feeds(feed, position), **current}
        outputs = step(feeds)
        scores = np.asarray(outputs[decoder.logits])[0, -1]
        token = int(np.argmax(scores))
        logits.append(np.array(scores, copy=True))
        tokens.append(token)
        current = {s.input: np.asarray(outputs[s.output]) for s in states}
        position += len(feed)
        feed = [token]
        if on_token is not None:
            on_token(token)
        if token in stop:
            break
    return Generation(tuple(ids), tuple(tokens), tuple(logits))


def session_step(session: object) -> StepFn:
    """A :data:`StepFn` running one ONNX Runtime session on the inputs it declares."""
    names = [o.name for o in session.get_outputs()]  # type: ignore[attr-defined]
    wanted = [i.name for i in session.get_inputs()]  # type: ignore[attr-defined]

    def step(feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        try:
            values = session.run(names, {n: feeds[n] for n in wanted})  # type: ignore[attr-defined]
        except KeyError as exc:
            raise InputError(f"the step has no value for model input {exc}") from exc
        except Exception as exc:  # onnxruntime raises its own exception types
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ModelError(f"ONNX Runtime failed on a decoder step: {first}") from exc
        return dict(zip(names, values, strict=True))

    return step


def decoder_of_session(
    session: object,
    *,
    context: int = DEFAULT_CONTEXT,
    max_tokens: int = 1,
    where: str = "the model",
) -> tuple[DecoderSpec, tuple[StateSpec, ...]]:
    """The decoder tensors and state pairs of a session's model, found by name."""
    inputs = [ort_sig(a) for a in session.get_inputs()]  # type: ignore[attr-defined]
    outputs = [ort_sig(a) for a in session.get_outputs()]  # type: ignore[attr-defined]
    states = find_state_pairs(inputs, outputs, where=where)
    decoder = find_decoder(
        inputs, outputs, states, context=context, max_tokens=max_tokens, where=where
    )
    if decoder is None:
        raise ModelError(
            f"{where} is not a decoder: no input pairs with an output as a growing state "
            "(past_key_values.N.key -> present.N.key and the like)"
        )
    return decoder, states


def reference_generate(
    model: str | Path,
    prompt: Sequence[int],
    max_tokens: int,
    *,
    threads: int = 1,
    optimization: str = DEFAULT_OPTIMIZATION,
    context: int = DEFAULT_CONTEXT,
    stop: Sequence[int] = (),
) -> Generation:
    """Greedy generation with the unsplit ONNX decoder at ``model`` and its KV cache.

    One session at the tiers' settings (``threads``, ``optimization``: ONNX Runtime's last
    bits depend on both, [Note: optimization level and exactness] in
    :mod:`tierflow.onnxrt.inference`). The decoder tensors and state pairs are found by
    name ([Note: state pairs] in :mod:`tierflow.state.pairs`).
    """
    session = open_session(
        model, threads=threads, optimization=optimization, what=f"decoder {model}"
    )
    decoder, states = decoder_of_session(
        session, context=context, max_tokens=max_tokens, where=str(model)
    )
    return greedy_generate(session_step(session), decoder, states, prompt, max_tokens, stop=stop)
