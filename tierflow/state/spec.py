"""State pairs and decoders as ``plan.json`` records them: :class:`StateSpec`, :class:`DecoderSpec`.

A stateful model takes a tensor it produced on its previous request (a decoder's KV cache,
a streaming model's recurrent state): a *state pair* is that input and the output that
replaces it. The planner keeps each pair on one tier, and the tier keeps the state per
session; see [Note: state pairs] in :mod:`tierflow.state.pairs` for how pairs are found and
the planner's notes for how they are priced. These records are the contract between the
planner, which writes them, and the runtime, which reads them; reading needs numpy only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from tierflow.errors import PlanError, StateError

#: A dimension in a recorded shape: a size, or None where the model leaves it symbolic.
Dim = int | None


def _name(data: dict[str, Any], key: str, what: str) -> str:
    value = data.get(key)
    if not isinstance(value, str) or not value:
        raise PlanError(f"malformed plan: {what} needs a tensor name in {key!r}, got {value!r}")
    return value


def _count(data: dict[str, Any], key: str, what: str, *, minimum: int = 1) -> int:
    value = data.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise PlanError(
            f"malformed plan: {what} {key!r} must be a whole number >= {minimum}, got {value!r}"
        )
    return value


@dataclass(frozen=True)
class StateSpec:
    """One state pair of a segment: ``input`` is fed with the last ``output`` of the session.

    ``dtype`` (numpy name) and ``shape`` describe the input; None marks a dimension the
    model leaves symbolic. ``grows`` is the axis that grows by the step's length on every
    request (a KV cache: the runtime truncates it to the request's position there to roll
    back rejected tokens); None for a state of fixed shape (a recurrent state).
    """

    input: str
    output: str
    dtype: str
    shape: tuple[Dim, ...]
    grows: int | None = None

    def __post_init__(self) -> None:
        if self.grows is not None and not 0 <= self.grows < len(self.shape):
            raise PlanError(
                f"malformed plan: state {self.input!r} grows along axis {self.grows}, which its "
                f"shape {list(self.shape)} does not have"
            )
        if any(d is not None and d < 0 for d in self.shape):
            raise PlanError(
                f"malformed plan: state {self.input!r} has a negative size in {list(self.shape)}"
            )

    def check_initial(self, dtype: str, shape: tuple[int, ...]) -> None:
        """Raise a :class:`StateError` unless a session's first value of this state may be
        ``dtype``/``shape``: a fixed state only (a growing one starts empty), its dtype
        exactly (never cast), its sizes where the plan fixes them and 1 where it leaves
        them symbolic (one sequence at a time, as the zeros it would start from)."""
        dims = "x".join(str(d) for d in shape)
        if self.grows is not None:
            raise StateError(
                f"state {self.input!r} grows with every step and starts empty; a session "
                f"takes no first value for it (found {dtype}[{dims}])"
            )
        expected = tuple(1 if d is None else d for d in self.shape)
        if dtype != self.dtype or tuple(shape) != expected:
            want = "x".join(str(d) for d in expected)
            raise StateError(
                f"state {self.input!r}: a first value must be {self.dtype}[{want}], found "
                f"{dtype}[{dims}]"
            )

    @property
    def growing(self) -> bool:
        """Whether the state grows with every step (a KV cache), rather than keeping its shape."""
        return self.grows is not None

    def nbytes(self, length: int = 0, symbolic: int = 1) -> int:
        """Bytes of the state with ``length`` on the growing axis, other symbolic dims ``symbolic``.

        A decoder's KV cache at ``--context N`` is ``nbytes(N)``; a fixed state ignores
        ``length``.
        """
        dims = [
            length if axis == self.grows else (symbolic if d is None else d)
            for axis, d in enumerate(self.shape)
        ]
        return int(math.prod(dims)) * int(np.dtype(self.dtype).itemsize)

    def to_dict(self) -> dict[str, Any]:
        return {
            "input": self.input,
            "output": self.output,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "grows": self.grows,
        }

    @classmethod
    def from_dict(cls, data: Any) -> StateSpec:
        if not isinstance(data, dict):
            raise PlanError(f"malformed plan: a state pair must be an object, got {data!r}")
        what = "a state pair"
        shape = data.get("shape")
        if not isinstance(shape, list) or not all(
            d is None or (isinstance(d, int) and not isinstance(d, bool)) for d in shape
        ):
            raise PlanError(
                f"malformed plan: state {data.get('input')!r} shape must be a list of sizes "
                f"or null, got {shape!r}"
            )
        grows = data.get("grows")
        if grows is not None and (not isinstance(grows, int) or isinstance(grows, bool)):
            raise PlanError(
                f"malformed plan: state {data.get('input')!r} grows must be an axis or null, "
                f"got {grows!r}"
            )
        dtype = _name(data, "dtype", what)
        try:
            np.dtype(dtype)
        except TypeError as exc:
            raise PlanError(f"malformed plan: state dtype {dtype!r} is not a numpy dtype") from exc
        return cls(
            input=_name(data, "input", what),
            output=_name(data, "output", what),
            dtype=dtype,
            shape=tuple(shape),
            grows=grows,
        )


@dataclass(frozen=True)
class DecoderSpec:
    """How to drive a decoder plan: its token, logits and companion tensors, and its limits.

    One graph serves prefill and decode (Hugging Face ``text-generation-with-past``):
    ``tokens`` int64 [batch, seq]; ``attention_mask`` int64 [batch, past + seq], all ones
    for one sequence; ``position_ids`` int64 [batch, seq] = past + 0..seq-1; ``logits``
    [batch, seq, vocab]. The companions are None when the model has no such input.
    ``context`` is the longest ``past + seq`` the plan's memory was counted for
    (``plan --context``), ``max_tokens`` the generation length its objective was computed
    for.
    """

    tokens: str
    logits: str
    attention_mask: str | None
    position_ids: str | None
    vocab: int
    context: int
    max_tokens: int

    def __post_init__(self) -> None:
        for key in ("vocab", "context", "max_tokens"):
            value = getattr(self, key)
            if not isinstance(value, int) or value < 1:
                raise PlanError(f"malformed plan: decoder {key} must be >= 1, got {value!r}")

    @property
    def companions(self) -> tuple[str, ...]:
        """The inputs besides the tokens that every step feeds (mask, position ids)."""
        return tuple(n for n in (self.attention_mask, self.position_ids) if n is not None)

    def to_dict(self) -> dict[str, Any]:
        return {
            "tokens": self.tokens,
            "logits": self.logits,
            "attention_mask": self.attention_mask,
            "position_ids": self.position_ids,
            "vocab": self.vocab,
            "context": self.context,
            "max_tokens": self.max_tokens,
        }

    @classmethod
    def from_dict(cls, data: Any) -> DecoderSpec:
        if not isinstance(data, dict):
            raise PlanError(f"malformed plan: 'decoder' must be an object, got {data!r}")
        what = "the decoder"
        optional: dict[str, str | None] = {}
        for key in ("attention_mask", "position_ids"):
            value = data.get(key)
            if value is not None and (not isinstance(value, str) or not value):
                raise PlanError(
                    f"malformed plan: decoder {key} must be a tensor name or null, got {value!r}"
                )
            optional[key] = value
        return cls(
            tokens=_name(data, "tokens", what),
            logits=_name(data, "logits", what),
            attention_mask=optional["attention_mask"],
            position_ids=optional["position_ids"],
            vocab=_count(data, "vocab", what),
            context=_count(data, "context", what),
            max_tokens=_count(data, "max_tokens", what),
        )

    def step_feeds(self, tokens: Any, position: int) -> dict[str, Any]:
        """The token and companion inputs of one step: ``tokens`` [1, T] after ``position``.

        ``attention_mask`` is ones [1, position + T], ``position_ids`` [[position ..
        position + T - 1]], as the contract fixes them for one sequence.
        """
        ids = np.asarray(tokens, dtype=np.int64).reshape(1, -1)
        length = ids.shape[1]
        feeds: dict[str, Any] = {self.tokens: ids}
        if self.attention_mask is not None:
            feeds[self.attention_mask] = np.ones((1, position + length), dtype=np.int64)
        if self.position_ids is not None:
            feeds[self.position_ids] = np.arange(
                position, position + length, dtype=np.int64
            ).reshape(1, length)
        return feeds
