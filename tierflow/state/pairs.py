"""Finding a model's state pairs (by name, or given as ``--state IN=OUT``) and its decoder tensors.

Works on :class:`TensorSig` (a name, a numpy dtype and a declared shape), so the planner
(from ONNX value infos) and the runtime (from ONNX Runtime's inputs and outputs) find the
same pairs without onnx. See [Note: state pairs].

[Note: state pairs]
~~~~~~~~~~~~~~~~~~~
A state pair is a model input and the model output that replaces it on the session's next
request. Pairs are found by name for the conventions exporters use, conservatively: a
name must match one of these rules exactly, and the output must exist with the same dtype
and a matching shape, else the input stays an ordinary input.

* ``past_key_values.N.key`` -> ``present.N.key`` (or ``present_key_values.N.key``), and
  ``.value`` alike: Hugging Face ``text-generation-with-past`` exports (optimum, the torch
  exporters given those names);
* ``past.REST`` -> ``present.REST``, ``past_REST`` -> ``present_REST`` (older GPT-2 and
  T5 exports: ``past_key_0`` -> ``present_key_0``);
* a name ending in ``state`` -> the same plus ``N``, ``_out`` or ``_new``, or ``new_``
  before it (Silero VAD: ``state`` -> ``stateN``);
* ``h0`` -> ``hn``, ``c0`` -> ``cn``, ``h`` -> ``hn``, ``c`` -> ``cn`` (ONNX RNN/LSTM
  naming and the recurrent exports that copy it), ``X_in`` -> ``X_out``.

Rules are tried in this order and the first output that exists wins. ``plan --state
IN=OUT`` gives pairs the rules miss (repeatable; ``*`` and ``?`` in IN match input names
and the same pieces fill OUT's wildcards in order: ``--state 'past.*=present.*'``); given
pairs come first, and a given pair that does not match is an error naming what differs
rather than a pair skipped.

Shapes match when every axis agrees (equal sizes, the same symbolic name, or an output
dimension the exporter left unknown or named where the input has a size) except at most
one: that one must be symbolic in the input and named otherwise in the output (``past``
in, ``past + seq`` out): the axis the state *grows* along, a KV cache. With no such axis
the state keeps its shape, a recurrent state. An output whose shape says nothing (no
shape, or no dimension known) keeps the input's shape, except a ``past*`` input's, which
grows along its one symbolic axis after the first.
"""

from __future__ import annotations

import fnmatch
import logging
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from tierflow.errors import ModelError, UsageError
from tierflow.state.spec import DecoderSpec, StateSpec

logger = logging.getLogger(__name__)

#: A declared dimension: a size, a symbolic name, or None when the model says nothing.
DeclaredDim = int | str | None

#: Input names taken as a decoder's token ids, and its logits output (in this order).
TOKEN_NAMES = ("input_ids", "tokens")
LOGITS_NAMES = ("logits",)
ATTENTION_MASK = "attention_mask"
POSITION_IDS = "position_ids"


@dataclass(frozen=True)
class TensorSig:
    """A model input or output as declared: name, numpy dtype name, shape (None: unranked)."""

    name: str
    dtype: str
    shape: tuple[DeclaredDim, ...] | None

    def shown(self) -> str:
        if self.shape is None:
            return f"{self.dtype}[?]"
        return f"{self.dtype}[{', '.join('?' if d is None else str(d) for d in self.shape)}]"


class PairMismatch(Exception):
    """Why an input and an output cannot be a state pair (internal; callers translate it)."""


def growing_axis(state_in: TensorSig, state_out: TensorSig) -> int | None:
    """The axis along which ``state_out`` grows from ``state_in``, None for a fixed state.

    Raises :class:`PairMismatch` saying what differs. See [Note: state pairs].
    """
    if state_in.dtype != state_out.dtype:
        raise PairMismatch(f"dtypes differ ({state_in.dtype} in, {state_out.dtype} out)")
    if state_in.shape is None:
        raise PairMismatch(f"input {state_in.name!r} declares no shape")
    if state_out.shape is None or all(d is None for d in state_out.shape):
        if state_out.shape is not None and len(state_out.shape) != len(state_in.shape):
            raise PairMismatch(f"ranks differ ({state_in.shown()} in, {state_out.shown()} out)")
        if not state_in.name.startswith("past"):
            return None
        symbolic = [a for a, d in enumerate(state_in.shape) if a > 0 and not isinstance(d, int)]
        return symbolic[0] if len(symbolic) == 1 else None
    if len(state_in.shape) != len(state_out.shape):
        raise PairMismatch(f"ranks differ ({state_in.shown()} in, {state_out.shown()} out)")
    fixed, growing = [], []
    for axis, (a, b) in enumerate(zip(state_in.shape, state_out.shape, strict=True)):
        if a == b or b is None:
            continue  # the same, or the output says nothing about it
        if isinstance(a, int):
            if isinstance(b, int):
                fixed.append(axis)  # two sizes that differ
            continue  # a size in, a symbol out: the exporter did not know it is the same
        growing.append(axis)
    if fixed or len(growing) > 1:
        raise PairMismatch(
            f"shapes differ on axes {sorted(fixed + growing)} ({state_in.shown()} in, "
            f"{state_out.shown()} out); a state may differ only along one symbolic axis, "
            "the one it grows along"
        )
    return growing[0] if growing else None


def state_spec(state_in: TensorSig, state_out: TensorSig) -> StateSpec:
    """The :class:`StateSpec` of a pair (raises :class:`PairMismatch` when it is none)."""
    grows = growing_axis(state_in, state_out)
    assert state_in.shape is not None  # growing_axis checked it
    shape = tuple(d if isinstance(d, int) else None for d in state_in.shape)
    return StateSpec(state_in.name, state_out.name, state_in.dtype, shape, grows)


def _candidates(name: str) -> list[str]:
    """Output names that would pair with input ``name`` by [Note: state pairs], in order."""
    found: list[str] = []
    if name.startswith("past_key_values."):
        rest = name.removeprefix("past_key_values.")
        found += [f"present.{rest}", f"present_key_values.{rest}"]
    elif name.startswith("past."):
        found.append("present." + name.removeprefix("past."))
    elif name.startswith("past_"):
        found.append("present_" + name.removeprefix("past_"))
    if name.endswith("state"):
        found += [f"{name}N", f"{name}_out", f"{name}_new", f"new_{name}"]
    if name in ("h0", "c0"):
        found.append(name[0] + "n")
    if name in ("h", "c"):
        found.append(name + "n")
    if name.endswith("_in"):
        found.append(name.removesuffix("_in") + "_out")
    return found


def _glob_regex(pattern: str) -> tuple[re.Pattern[str], int]:
    """A regex matching ``pattern``'s ``*`` and ``?`` as groups, and how many it has."""
    parts: list[str] = []
    groups = 0
    for char in pattern:
        if char == "*":
            parts.append("(.*?)")
            groups += 1
        elif char == "?":
            parts.append("(.)")
            groups += 1
        else:
            parts.append(re.escape(char))
    return re.compile("".join(parts) + r"\Z"), groups


def _fill(pattern: str, pieces: Sequence[str]) -> str:
    out, used = [], 0
    for char in pattern:
        if char in "*?":
            out.append(pieces[used])
            used += 1
        else:
            out.append(char)
    return "".join(out)


def parse_state_option(text: str) -> tuple[str, str]:
    """``--state IN=OUT`` as the two patterns; wildcards must agree in number."""
    name, sep, value = text.partition("=")
    name, value = name.strip(), value.strip()
    if not sep or not name or not value:
        raise UsageError(
            f"malformed --state {text!r}: expected IN=OUT, like state=stateN or 'past.*=present.*'"
        )
    _, wild_in = _glob_regex(name)
    _, wild_out = _glob_regex(value)
    if wild_out and wild_out != wild_in:
        raise UsageError(
            f"malformed --state {text!r}: OUT has {wild_out} wildcard(s), IN has {wild_in}; "
            "each of OUT's is filled with what the same one of IN matched"
        )
    return name, value


def _given_pairs(
    given: Sequence[tuple[str, str]],
    inputs: Mapping[str, TensorSig],
    outputs: Mapping[str, TensorSig],
) -> list[tuple[str, str]]:
    """Expand ``--state`` patterns into ``(input, output)`` names; every one must resolve."""
    pairs: list[tuple[str, str]] = []
    for pattern_in, pattern_out in given:
        regex, _ = _glob_regex(pattern_in)
        matched = [n for n in inputs if regex.match(n)]
        if not matched:
            near = fnmatch.filter(inputs, f"*{pattern_in.strip('*?')}*")[:3]
            hint = f" (did you mean {', '.join(near)}?)" if near else ""
            raise UsageError(
                f"--state {pattern_in}={pattern_out}: no model input matches {pattern_in!r}"
                f"{hint}; inputs are {', '.join(inputs)}"
            )
        for name in matched:
            match = regex.match(name)
            assert match is not None
            output = (
                _fill(pattern_out, match.groups())
                if "*" in pattern_out or "?" in (pattern_out)
                else pattern_out
            )
            if output not in outputs:
                raise UsageError(
                    f"--state {pattern_in}={pattern_out}: input {name!r} would pair with "
                    f"{output!r}, which is not a model output; outputs are "
                    f"{', '.join(outputs)}"
                )
            pairs.append((name, output))
    return pairs


def find_state_pairs(
    inputs: Iterable[TensorSig],
    outputs: Iterable[TensorSig],
    given: Sequence[tuple[str, str]] = (),
    *,
    where: str = "the model",
) -> tuple[StateSpec, ...]:
    """The model's state pairs: ``given`` (``--state`` patterns) first, then by name.

    A given pair whose dtypes or shapes do not match is a :class:`ModelError`; so is an
    input or output in two pairs. See [Note: state pairs].
    """
    by_input = {t.name: t for t in inputs}
    by_output = {t.name: t for t in outputs}
    specs: list[StateSpec] = []
    taken_in: set[str] = set()
    taken_out: set[str] = set()

    def add(name_in: str, name_out: str) -> None:
        for name, taken, role in ((name_in, taken_in, "input"), (name_out, taken_out, "output")):
            if name in taken:
                raise ModelError(f"state {role} {name!r} of {where} is in two state pairs")
        try:
            specs.append(state_spec(by_input[name_in], by_output[name_out]))
        except PairMismatch as exc:
            raise ModelError(f"state pair {name_in} -> {name_out} of {where}: {exc}") from exc
        taken_in.add(name_in)
        taken_out.add(name_out)

    for name_in, name_out in _given_pairs(given, by_input, by_output):
        add(name_in, name_out)
    for name, sig in by_input.items():
        if name in taken_in:
            continue
        for candidate in _candidates(name):
            if candidate not in by_output or candidate in taken_out:
                continue
            try:
                spec = state_spec(sig, by_output[candidate])
            except PairMismatch as exc:
                logger.info("[state] %s -> %s is no state pair: %s", name, candidate, exc)
                continue
            specs.append(spec)
            taken_in.add(name)
            taken_out.add(candidate)
            break
    return tuple(specs)


def find_decoder(
    inputs: Iterable[TensorSig],
    outputs: Iterable[TensorSig],
    states: Sequence[StateSpec],
    *,
    context: int,
    max_tokens: int,
    where: str = "the model",
) -> DecoderSpec | None:
    """The decoder's tensors when the model is one (a growing state, token ids in, logits out).

    None for a model without a growing state. A model with a growing state but no
    ``input_ids``/``tokens`` input or no ``logits`` output is a :class:`ModelError`: its
    state cannot be sized or driven.
    """
    if not any(s.growing for s in states):
        return None
    by_input = {t.name: t for t in inputs}
    by_output = {t.name: t for t in outputs}
    tokens = next((n for n in TOKEN_NAMES if n in by_input), None)
    logits = next((n for n in LOGITS_NAMES if n in by_output), None)
    if tokens is None or logits is None:
        grown = [s.input for s in states if s.growing]
        raise ModelError(
            f"{where} has growing state {grown[0]!r} but no decoder tensors: expected an "
            f"input named {' or '.join(TOKEN_NAMES)} and an output named "
            f"{' or '.join(LOGITS_NAMES)}"
        )
    if by_input[tokens].dtype != "int64":
        raise ModelError(
            f"decoder input {tokens!r} of {where} is {by_input[tokens].dtype}, not int64"
        )
    shape = by_output[logits].shape
    vocab = shape[-1] if shape else None
    if not isinstance(vocab, int):
        raise ModelError(
            f"decoder output {logits!r} of {where} declares no vocabulary size on its last "
            f"axis ({by_output[logits].shown()})"
        )
    return DecoderSpec(
        tokens=tokens,
        logits=logits,
        attention_mask=ATTENTION_MASK if ATTENTION_MASK in by_input else None,
        position_ids=POSITION_IDS if POSITION_IDS in by_input else None,
        vocab=vocab,
        context=context,
        max_tokens=max_tokens,
    )


_ORT_TYPES = {
    "float": "float32",
    "double": "float64",
    "float16": "float16",
    "bool": "bool",
}


def ort_sig(arg: object) -> TensorSig:
    """A :class:`TensorSig` from an ONNX Runtime ``NodeArg`` (``session.get_inputs()``)."""
    name = str(getattr(arg, "name", ""))
    kind = str(getattr(arg, "type", ""))
    inner = kind.removeprefix("tensor(").removesuffix(")")
    dtype = _ORT_TYPES.get(inner, inner)
    shape = getattr(arg, "shape", None)
    dims: tuple[DeclaredDim, ...] | None = None
    if isinstance(shape, (list, tuple)):
        dims = tuple(d if isinstance(d, (int, str)) or d is None else None for d in shape)
    return TensorSig(name, dtype, dims)
