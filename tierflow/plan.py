"""The plan directory: ``plan.json`` plus one ONNX file per segment.

This is a contract other tools read (the runtimes, the benchmarks, users' scripts); see
docs/design.md, "Plan directory". Reading a plan validates it completely, so the
runtimes can trust what they get. Reading needs no onnx and no torch.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from tierflow.codec.base import CodecSpec, ImageNorm
from tierflow.errors import PlanError, TierflowError, UsageError
from tierflow.link.spec import LINKS, TIERS, LinkSpec
from tierflow.state.spec import DecoderSpec, StateSpec

__all__ = [
    "PLAN_FILE",
    "PLAN_FORMAT",
    "PLAN_SET_FORMAT",
    "DecoderSpec",
    "ExitSpec",
    "Plan",
    "PlanSet",
    "SegmentSpec",
    "StateSpec",
    "load_plan",
    "load_plan_set",
    "save_plan",
    "save_plan_set",
]

PLAN_FORMAT = "tierflow.plan/1"
#: A plan set (``tierflow plan --adaptive``): several plans, each with its rate region.
PLAN_SET_FORMAT = "tierflow.plan/2"
PLAN_FILE = "plan.json"
#: The suffix of the file beside a segment that holds its weights.
DATA_SUFFIX = ".data"
#: Largest plan.json read (a real one is a few kB; estimates and calibration add little).
MAX_PLAN_BYTES = 16 * 1024 * 1024
#: Deepest nesting of JSON objects and lists accepted in plan.json (a real one has 5).
MAX_PLAN_DEPTH = 32
_SHA256 = re.compile(r"[0-9a-f]{64}")


def _str_tuple(value: Any, what: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise PlanError(f"malformed plan: {what} must be a list of names, got {value!r}")
    return tuple(value)


@dataclass(frozen=True)
class ExitSpec:
    """An early exit: a segment output holding class probabilities, and its threshold.

    A request leaves at this exit when the top class probability is at least
    ``threshold``. ``calibration`` records how the threshold was chosen (target and
    achieved figures), for people reading the plan.

    An exit saves compute when the model is cut *at* its feature: the segment ending
    there outputs the exit's probabilities and the crossing feature; if confident the
    tier answers, else it runs its next segment (a tier may run several consecutive
    segments). ``tierflow.partitioner.exits.plan.attach_exits`` builds such segments.
    """

    name: str
    threshold: float
    calibration: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "threshold": self.threshold, "calibration": self.calibration}

    @classmethod
    def from_dict(cls, data: Any) -> ExitSpec:
        if not isinstance(data, dict) or not isinstance(data.get("name"), str):
            raise PlanError(f"malformed plan: an exit must be an object with a name, got {data!r}")
        try:
            threshold = float(data["threshold"])
        except (KeyError, TypeError, ValueError) as exc:
            raise PlanError(
                f"malformed plan: exit {data['name']!r} has no numeric threshold"
            ) from exc
        if not 0 <= threshold < math.inf:
            raise PlanError(
                f"malformed plan: exit {data['name']!r} threshold must be a finite number "
                f">= 0, found {threshold}"
            )
        calibration = data.get("calibration") or {}
        if not isinstance(calibration, dict):
            raise PlanError(f"malformed plan: exit {data['name']!r} calibration must be an object")
        return cls(data["name"], threshold, dict(calibration))


@dataclass(frozen=True)
class TensorShape:
    """A tensor that crosses a link: its dtype and declared shape (None: symbolic).

    ``plan.json`` records one for every tensor a request or an answer carries (key
    ``"tensors"``), so that each tier knows the largest request its plans can send it
    before any segment is loaded ([Note: a tier's largest request] in
    tierflow/runtime/limits.py).
    """

    dtype: str
    shape: tuple[int | None, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "shape": list(self.shape)}

    @classmethod
    def from_dict(cls, name: str, data: Any) -> TensorShape:
        if not isinstance(data, dict) or not isinstance(data.get("dtype"), str):
            raise PlanError(f"malformed plan: tensor {name!r} needs a 'dtype' and a 'shape'")
        shape = data.get("shape")
        if not isinstance(shape, list) or not all(
            d is None or (isinstance(d, int) and not isinstance(d, bool) and d >= 0) for d in shape
        ):
            raise PlanError(
                f"malformed plan: tensor {name!r} shape must list sizes or null, got {shape!r}"
            )
        try:
            np.dtype(data["dtype"])
        except TypeError as exc:
            raise PlanError(f"malformed plan: tensor {name!r} has no numpy dtype") from exc
        return cls(data["dtype"], tuple(shape))


@dataclass(frozen=True)
class SegmentSpec:
    """One segment of the split model: which tier runs it, its file, inputs and outputs.

    ``sha256`` and ``size`` describe the file's bytes (``plan.json`` keys ``"sha256"`` and
    ``"bytes"``): a tier that fetches the file checks it against them, and the device
    weighs the fetch when it switches plans ([Note: segments on demand] in
    ``tierflow.runtime.segment_store``). :func:`save_plan` records them; plans written before have
    none (None). They describe the file, not what it computes, so they take no part in
    equality or in the plan's id.

    ``state`` lists the state pairs the segment owns (:class:`StateSpec`): each pair's
    input is among ``inputs`` and its output among ``outputs``, but the tier running the
    segment feeds the input from its session store and keeps the output there; neither
    crosses a link ([Note: state pairs] in :mod:`tierflow.state.pairs`).
    """

    tier: str
    file: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    exits: tuple[ExitSpec, ...] = ()
    state: tuple[StateSpec, ...] = ()
    sha256: str | None = field(default=None, compare=False)
    size: int | None = field(default=None, compare=False)
    data_sha256: str | None = field(default=None, compare=False)
    data_size: int | None = field(default=None, compare=False)

    @property
    def data_file(self) -> str | None:
        """The file beside the segment that holds its weights (``<file>.data``), if any.

        A segment of a model whose weights lie in external data files keeps its own in
        ``<file>.data`` (``plan.json``: ``"data": {"sha256", "bytes"}``); the two travel
        and are checked together ([Note: weights stay on disk] in
        partitioner/weights.py).
        """
        return self.file + DATA_SUFFIX if self.data_sha256 is not None else None

    def data_spec(self) -> SegmentSpec | None:
        """The data file as a file of its own (for the segment store), if the segment has one."""
        if self.data_file is None:
            return None
        return SegmentSpec(
            self.tier, self.data_file, (), (), sha256=self.data_sha256, size=self.data_size
        )

    def to_dict(self) -> dict[str, Any]:
        data = self.computes()
        if self.sha256 is not None:
            data["sha256"] = self.sha256
        if self.size is not None:
            data["bytes"] = self.size
        if self.data_sha256 is not None:
            data["data"] = {"sha256": self.data_sha256, "bytes": self.data_size}
        return data

    def computes(self) -> dict[str, Any]:
        """What the segment computes, and where: :meth:`to_dict` without the file's digest."""
        data: dict[str, Any] = {
            "tier": self.tier,
            "file": self.file,
            "inputs": list(self.inputs),
            "outputs": list(self.outputs),
        }
        if self.exits:
            data["exits"] = [e.to_dict() for e in self.exits]
        if self.state:
            data["state"] = [s.to_dict() for s in self.state]
        return data

    @property
    def state_inputs(self) -> tuple[str, ...]:
        """The inputs the tier feeds from its session store, not from the request."""
        return tuple(s.input for s in self.state)

    @property
    def state_outputs(self) -> tuple[str, ...]:
        """The outputs the tier keeps for the session's next request and sends nowhere."""
        return tuple(s.output for s in self.state)

    @property
    def sent_outputs(self) -> tuple[str, ...]:
        """The outputs that leave the segment: its outputs minus its state outputs."""
        kept = set(self.state_outputs)
        return tuple(name for name in self.outputs if name not in kept)

    @classmethod
    def from_dict(cls, data: Any) -> SegmentSpec:
        if not isinstance(data, dict):
            raise PlanError(f"malformed plan: a segment must be an object, got {data!r}")
        tier = data.get("tier")
        if tier not in TIERS:
            raise PlanError(
                f"malformed plan: segment tier {tier!r} is not one of {', '.join(TIERS)}"
            )
        file = data.get("file")
        if (
            not isinstance(file, str)
            or not file
            or "/" in file
            or "\\" in file
            or file.startswith(".")
        ):
            raise PlanError(f"malformed plan: segment file {file!r} must be a plain file name")
        exits = data.get("exits") or []
        if not isinstance(exits, list):
            raise PlanError(f"malformed plan: segment {file} exits must be a list, got {exits!r}")
        state = data.get("state") or []
        if not isinstance(state, list):
            raise PlanError(f"malformed plan: segment {file} state must be a list, got {state!r}")
        sha256 = data.get("sha256")
        if sha256 is not None and not (
            isinstance(sha256, str) and _SHA256.fullmatch(sha256) is not None
        ):
            raise PlanError(
                f"malformed plan: segment {file} sha256 must be 64 lowercase hex digits, "
                f"got {sha256!r}"
            )
        size = data.get("bytes")
        if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 0):
            raise PlanError(
                f"malformed plan: segment {file} bytes must be a whole number >= 0, got {size!r}"
            )
        weights = data.get("data")
        data_sha256 = data_size = None
        if weights is not None:
            if (
                not isinstance(weights, dict)
                or not isinstance(weights.get("sha256"), str)
                or _SHA256.fullmatch(weights["sha256"]) is None
                or not isinstance(weights.get("bytes"), int)
                or isinstance(weights["bytes"], bool)
                or weights["bytes"] < 0
            ):
                raise PlanError(
                    f"malformed plan: segment {file} data must be an object with a sha256 of "
                    f"64 lowercase hex digits and whole bytes >= 0, got {weights!r}"
                )
            data_sha256, data_size = weights["sha256"], weights["bytes"]
        return cls(
            tier=tier,
            file=file,
            inputs=_str_tuple(data.get("inputs"), "segment inputs"),
            outputs=_str_tuple(data.get("outputs"), "segment outputs"),
            exits=tuple(ExitSpec.from_dict(e) for e in exits),
            state=tuple(StateSpec.from_dict(s) for s in state),
            sha256=sha256,
            size=size,
            data_sha256=data_sha256,
            data_size=data_size,
        )


@dataclass(frozen=True)
class Plan:
    """A validated plan: segments in execution order and the links between tiers.

    ``codec`` maps each link name to the codec spec used on it (see
    :mod:`tierflow.codec.base`); ``estimate`` is the cost model's prediction (free-form,
    at least ``latency_s``); ``cuts`` the cut positions the planner chose; ``fidelity``
    the chosen plan measured against the exact model (``budget``, ``metric``, ``value``,
    ``samples``, ``bitwise_equal``; see ``tierflow.partitioner.fidelity``), empty in
    plans written before it was recorded; ``images`` the model inputs that are
    normalised 8-bit images, with their normalisation (see [Note: image inputs]).

    [Note: image inputs]
    A link whose codec is an image codec (``jpeg:Q``, ``webp:Q``, ``png``) carries the
    image inputs among its tensors as images, each encoded with its ``images`` entry
    and decoded back into the model's tensor by the receiver; every other tensor on
    that link goes raw (the image codec's lossless part). The planner only chooses an
    image codec where the model inputs cross (the device runs nothing); an edge that runs
    nothing either forwards the images as they came ([Note: an edge that runs nothing]).
    ``plan.json`` holds them as ``"image_inputs": {NAME: {"mean": [...], "std": [...],
    "scale": ..., "layout": ...}}``; plans without image inputs leave the key out.
    """

    model_file: str
    model_sha256: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    segments: tuple[SegmentSpec, ...]
    links: dict[str, LinkSpec] = field(default_factory=dict)
    codec: dict[str, str] = field(default_factory=dict)
    estimate: dict[str, Any] = field(default_factory=dict)
    cuts: tuple[int, ...] = ()
    fidelity: dict[str, Any] = field(default_factory=dict)
    images: dict[str, ImageNorm] = field(default_factory=dict)
    state_pairs: tuple[tuple[str, str], ...] = ()
    decoder: DecoderSpec | None = None
    #: The dtype and shape of every tensor a request or an answer carries (None: a plan
    #: written before they were recorded). Not part of the plan's id.
    tensors: dict[str, TensorShape] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        self._check()
        self._check_state()

    @functools.cached_property
    def states(self) -> tuple[StateSpec, ...]:
        """Every segment's state pairs, in segment order (read on every request's way)."""
        return tuple(s for segment in self.segments for s in segment.state)

    @functools.cached_property
    def state_inputs(self) -> frozenset[str]:
        """The names of :attr:`states`' inputs."""
        return frozenset(s.input for s in self.states)

    def _check_state(self) -> None:
        """Each pair on exactly one segment, never crossing; the decoder's tensors exist."""
        owned = {
            (s.input, s.output): segment.file for segment in self.segments for s in segment.state
        }
        if len(owned) != len(self.states):
            raise PlanError("malformed plan: a state pair appears in more than one segment")
        listed = set(self.state_pairs)
        if len(listed) != len(self.state_pairs):
            raise PlanError(f"malformed plan: state_pairs lists a pair twice: {self.state_pairs}")
        if set(owned) != listed:
            strays = sorted(set(owned) ^ listed)
            raise PlanError(
                f"malformed plan: state pairs {strays} are not both in 'state_pairs' and in "
                "one segment's 'state'"
            )
        names = {name for pair in listed for name in pair}
        leaked = sorted(names & (set(self.inputs) | set(self.outputs)))
        if leaked:
            raise PlanError(
                f"malformed plan: state tensors {leaked} are among the plan's inputs or "
                "outputs; a state stays on its tier"
            )
        for segment in self.segments:
            for state in segment.state:
                if state.input not in segment.inputs or state.output not in segment.outputs:
                    raise PlanError(
                        f"malformed plan: segment {segment.file} owns state "
                        f"{state.input} -> {state.output} but does not take the one and "
                        "make the other"
                    )
        if self.decoder is not None:
            self._check_decoder(self.decoder)

    def _check_decoder(self, decoder: DecoderSpec) -> None:
        wanted = [decoder.tokens, *decoder.companions]
        missing = [name for name in wanted if name not in self.inputs]
        if missing or decoder.logits not in self.outputs:
            raise PlanError(
                f"malformed plan: decoder tensors {missing or [decoder.logits]} are not among "
                f"the plan's inputs {list(self.inputs)} and outputs {list(self.outputs)}"
            )
        if not any(s.growing for s in self.states):
            raise PlanError("malformed plan: a decoder plan needs a growing state (a KV cache)")

    def _check(self) -> None:
        if not self.segments:
            raise PlanError("malformed plan: it has no segments")
        order = [TIERS.index(s.tier) for s in self.segments]
        if order != sorted(order):
            tiers = [s.tier for s in self.segments]
            raise PlanError(
                f"malformed plan: segments must run device, then edge, then cloud; found {tiers}"
            )
        files = [s.file for s in self.segments]
        if len(set(files)) != len(files):
            raise PlanError(f"malformed plan: segment files must be distinct, found {files}")
        available = set(self.inputs)
        for segment in self.segments:
            own = set(segment.state_inputs)
            missing = [name for name in segment.inputs if name not in available | own]
            if missing:
                raise PlanError(
                    f"malformed plan: segment {segment.file} needs {missing}, which no earlier "
                    "segment or model input provides"
                )
            available.update(segment.sent_outputs)
            exit_names = {e.name for e in segment.exits}
            if not exit_names <= set(segment.outputs):
                raise PlanError(
                    f"malformed plan: exits {sorted(exit_names - set(segment.outputs))} of "
                    f"{segment.file} are not among its outputs"
                )
        missing_outputs = [name for name in self.outputs if name not in available]
        if missing_outputs:
            raise PlanError(f"malformed plan: no segment yields model outputs {missing_outputs}")
        for name in list(self.links) + list(self.codec):
            if name not in LINKS:
                raise PlanError(
                    f"malformed plan: unknown link {name!r}, expected one of {', '.join(LINKS)}"
                )
        for name, text in self.codec.items():
            try:
                CodecSpec.parse(text)
            except UsageError as exc:
                raise PlanError(f"malformed plan: codec of link {name}: {exc}") from exc
        strangers = [name for name in self.images if name not in self.inputs]
        if strangers:
            raise PlanError(
                f"malformed plan: image inputs {strangers} are not model inputs {list(self.inputs)}"
            )
        for name, text in self.codec.items():
            if CodecSpec.parse(text).image and not self.images:
                raise PlanError(
                    f"malformed plan: link {name} uses image codec {text}, but the plan names "
                    "no image inputs ('image_inputs')"
                )

    @functools.cached_property
    def plan_id(self) -> str:
        """A short hash naming this plan on the wire: model, segments and codecs.

        Computed once per plan (kept outside the fields, so not in equality): tiers look
        a request's plan up by its id on every request, and hashing each plan of a set
        every time cost 45 us per plan and request.
        """
        key = json.dumps(
            {
                "model": self.model_sha256,
                "segments": [s.computes() for s in self.segments],
                "codec": self.codec,
                **({"images": self._images_dict()} if self.images else {}),
            },
            sort_keys=True,
        )
        return hashlib.sha256(key.encode()).hexdigest()[:16]

    def carried(self, index: int) -> tuple[str, ...]:
        """Tensors a request entering at segment ``index`` carries, sorted.

        [Note: what crosses to the next tier]
        A request entering the tier whose first segment is ``index`` carries every tensor
        that a segment at ``index`` or later reads, plus every model output already
        computed before ``index`` (the answer must contain all model outputs). A state
        input is never carried: the tier that owns it feeds it ([Note: state pairs] in
        tierflow/state/pairs.py).
        """
        available = set(self.inputs)
        for spec in self.segments[:index]:
            available.update(spec.outputs)
        needed: set[str] = set()
        for spec in self.segments[index:]:
            needed.update(spec.inputs)
        needed.update(self.outputs)
        return tuple(sorted(needed & available))

    def entry(self, tier: str) -> int:
        """The index of the first segment ``tier`` or a tier after it runs (the segment a
        request arriving at ``tier`` names); the number of segments when there is none."""
        rank = TIERS.index(tier)
        later = [i for i, s in enumerate(self.segments) if TIERS.index(s.tier) >= rank]
        return later[0] if later else len(self.segments)

    def segments_for(self, tier: str) -> list[tuple[int, SegmentSpec]]:
        """The segments a tier runs, with their indices, in order; empty if it has no work.

        A tier usually runs one segment; it runs several when early exits split its
        work (it checks each exit before going on).
        """
        return [(i, s) for i, s in enumerate(self.segments) if s.tier == tier]

    def _images_dict(self) -> dict[str, Any]:
        return {name: norm.to_dict() for name, norm in self.images.items()}

    @property
    def edge_forwards(self) -> bool:
        """Whether the edge runs nothing and passes requests on to the cloud as they came.

        [Note: an edge that runs nothing]
        When a plan gives the edge no segment but the cloud some, the edge forwards the
        tensors it receives verbatim, encoded as the device encoded them: it checks their
        headers and its limits but decodes nothing (unless it keeps a feature cache, which
        needs the values), and re-encodes nothing. A lossy codec is so applied once, as a
        camera app's JPEG upload through a router is, and the edge spends no time on it.
        The edge-cloud link then carries the device-edge codec by definition: the planner
        writes that codec for both links, the cost model charges one encode (device) and
        one decode (cloud) with the same bytes on both links, and :meth:`link_codec` gives
        the device-edge codec for the edge-cloud link whatever an older plan file says.
        """
        tiers = {s.tier for s in self.segments}
        return "edge" not in tiers and "cloud" in tiers

    def link_codec(self, link: str | None) -> CodecSpec:
        """The codec for ``link`` ('raw' when the plan names none, or for no link).

        The edge-cloud link of a plan whose edge runs nothing carries the device-edge
        codec ([Note: an edge that runs nothing]).
        """
        if link is None:
            return CodecSpec.parse("raw")
        if link == "edge-cloud" and self.edge_forwards:
            link = "device-edge"
        return CodecSpec.parse(self.codec.get(link, "raw"))

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": PLAN_FORMAT,
            "model": {"file": self.model_file, "sha256": self.model_sha256},
            "inputs": list(self.inputs),
            "outputs": list(self.outputs),
            "segments": [s.to_dict() for s in self.segments],
            "links": {name: link.to_dict() for name, link in self.links.items()},
            "codec": dict(self.codec),
            "estimate": dict(self.estimate),
            "cuts": list(self.cuts),
            **({"fidelity": dict(self.fidelity)} if self.fidelity else {}),
            **({"image_inputs": self._images_dict()} if self.images else {}),
            **({"state_pairs": [list(p) for p in self.state_pairs]} if self.state_pairs else {}),
            **({"decoder": self.decoder.to_dict()} if self.decoder is not None else {}),
            **(
                {"tensors": {n: s.to_dict() for n, s in sorted(self.tensors.items())}}
                if self.tensors
                else {}
            ),
        }

    @classmethod
    def from_dict(cls, data: Any) -> Plan:
        if not isinstance(data, dict):
            raise PlanError("malformed plan: plan.json must hold a JSON object")
        if data.get("format") != PLAN_FORMAT:
            raise PlanError(
                f"unsupported plan format {data.get('format')!r}: expected {PLAN_FORMAT!r}"
            )
        model = data.get("model")
        if not isinstance(model, dict) or not isinstance(model.get("sha256"), str):
            raise PlanError("malformed plan: 'model' must be an object with 'file' and 'sha256'")
        segments = data.get("segments")
        if not isinstance(segments, list):
            raise PlanError("malformed plan: 'segments' must be a list")
        links = data.get("links") or {}
        codec = data.get("codec") or {}
        if not isinstance(links, dict) or not isinstance(codec, dict):
            raise PlanError(
                "malformed plan: 'links' and 'codec' must be objects keyed by link name"
            )
        try:
            parsed_links = {name: LinkSpec.from_dict(value) for name, value in links.items()}
        except Exception as exc:
            raise PlanError(f"malformed plan links: {exc}") from exc
        estimate = data.get("estimate") or {}
        if not isinstance(estimate, dict):
            raise PlanError("malformed plan: 'estimate' must be an object")
        fidelity = data.get("fidelity") or {}
        if not isinstance(fidelity, dict):
            raise PlanError("malformed plan: 'fidelity' must be an object")
        cuts = data.get("cuts") or []
        if not isinstance(cuts, list) or not all(isinstance(c, int) for c in cuts):
            raise PlanError("malformed plan: 'cuts' must be a list of integers")
        images = data.get("image_inputs") or {}
        if not isinstance(images, dict):
            raise PlanError("malformed plan: 'image_inputs' must be an object keyed by input")
        try:
            norms = {str(name): ImageNorm.from_dict(norm) for name, norm in images.items()}
        except UsageError as exc:
            raise PlanError(f"malformed plan: image_inputs: {exc}") from exc
        pairs = data.get("state_pairs") or []
        if not isinstance(pairs, list) or not all(
            isinstance(p, list) and len(p) == 2 and all(isinstance(n, str) and n for n in p)
            for p in pairs
        ):
            raise PlanError(
                f"malformed plan: 'state_pairs' must be a list of [input, output] names, "
                f"got {pairs!r}"
            )
        decoder = data.get("decoder")
        tensors = data.get("tensors") or {}
        if not isinstance(tensors, dict):
            raise PlanError("malformed plan: 'tensors' must be an object keyed by tensor name")
        return cls(
            model_file=str(model.get("file", "")),
            model_sha256=model["sha256"],
            inputs=_str_tuple(data.get("inputs"), "inputs"),
            outputs=_str_tuple(data.get("outputs"), "outputs"),
            segments=tuple(SegmentSpec.from_dict(s) for s in segments),
            links=parsed_links,
            codec={str(k): str(v) for k, v in codec.items()},
            estimate=dict(estimate),
            cuts=tuple(cuts),
            fidelity=dict(fidelity),
            images=norms,
            state_pairs=tuple((p[0], p[1]) for p in pairs),
            decoder=DecoderSpec.from_dict(decoder) if decoder is not None else None,
            tensors={str(n): TensorShape.from_dict(str(n), s) for n, s in tensors.items()},
        )


def _no_constant(name: str) -> Any:
    raise PlanError(f"malformed plan: {name} is not a number plan.json may hold")


def _check_depth(data: Any, path: Path) -> None:
    """Raise unless ``data`` nests at most :data:`MAX_PLAN_DEPTH` containers deep."""
    level: list[Any] = [data]
    for _ in range(MAX_PLAN_DEPTH + 1):
        level = [
            child
            for item in level
            if isinstance(item, (dict, list))
            for child in (item.values() if isinstance(item, dict) else item)
        ]
        if not level:
            return
    raise PlanError(f"malformed plan {path}: nested deeper than {MAX_PLAN_DEPTH} levels")


def read_plan_json(path: Path) -> Any:
    """``plan.json`` parsed, bounded: size, nesting depth, no NaN or Infinity."""
    try:
        with path.open("rb") as file:
            raw = file.read(MAX_PLAN_BYTES + 1)
    except FileNotFoundError as exc:
        raise PlanError(f"no plan at {path.parent}: {PLAN_FILE} not found") from exc
    except OSError as exc:
        raise PlanError(f"cannot read {path}: {exc}") from exc
    if len(raw) > MAX_PLAN_BYTES:
        raise PlanError(f"cannot read {path}: larger than {MAX_PLAN_BYTES} bytes")
    try:
        data = json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
    except RecursionError as exc:
        raise PlanError(f"malformed plan {path}: nested too deeply") from exc
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PlanError(f"cannot read {path}: {exc}") from exc
    _check_depth(data, path)
    return data


def load_plan(plan_dir: str | Path) -> Plan:
    """Read and validate ``PLAN_DIR/plan.json``; every segment file must exist.

    Segment files must be regular files inside the plan directory: a symbolic link that
    leads out of it is refused, so a plan cannot make a tier load (or reveal) other files.
    A plan set's directory gives its default plan (the one for the links it was planned
    for); :func:`load_plan_set` gives them all.
    """
    return load_plan_set(plan_dir).default_plan


def load_plan_set(plan_dir: str | Path, *, require_segments: bool = True) -> PlanSet:
    """Read and validate a plan directory as a :class:`PlanSet` (one plan: a set of one).

    With ``require_segments`` False a segment file may be missing (a tier that fetches
    its segments, ``tierflow.runtime.segment_store``); one that is there is still checked.
    """
    directory = Path(plan_dir)
    plans = PlanSet.from_dict(read_plan_json(directory / PLAN_FILE))
    for plan in plans.plans:
        _check_segment_files(plan, directory, require_segments)
    return plans


def _check_segment_files(plan: Plan, directory: Path, required: bool = True) -> None:
    root = directory.resolve()
    for segment in plan.segments:
        path = directory / segment.file
        if not path.is_file():
            if not required and not path.is_symlink() and not path.exists():
                continue
            raise PlanError(f"plan {directory} names segment file {segment.file}, which is missing")
        if path.resolve().parent != root:
            raise PlanError(
                f"plan {directory}: segment file {segment.file} is a link to "
                f"{path.resolve()}, outside the plan directory"
            )


def save_plan(plan: Plan, plan_dir: str | Path) -> Path:
    """Write ``plan.json`` into ``plan_dir`` (created if needed); return its path.

    Each segment whose file is in ``plan_dir`` is recorded with its sha256 and size
    (:func:`with_digests`).
    """
    directory = Path(plan_dir)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / PLAN_FILE
    recorded = with_tensors(with_digests(plan, directory), directory)
    path.write_text(json.dumps(recorded.to_dict(), indent=2) + "\n")
    return path


def save_plan_set(plans: PlanSet, plan_dir: str | Path) -> Path:
    """Write a plan set's ``plan.json`` into ``plan_dir`` (created if needed).

    Segments are recorded with their files' sha256 and size, as :func:`save_plan` does.
    """
    directory = Path(plan_dir)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / PLAN_FILE
    digests: dict[str, tuple[str, int]] = {}
    recorded = PlanSet(
        tuple(
            with_tensors(with_digests(plan, directory, digests), directory) for plan in plans.plans
        ),
        plans.regions,
        plans.default,
    )
    path.write_text(json.dumps(recorded.to_dict(), indent=2) + "\n")
    return path


def with_tensors(plan: Plan, directory: Path) -> Plan:
    """``plan`` with the dtype and declared shape of every tensor its requests carry.

    Read from the segment files in ``directory`` when the plan records none yet (a plan
    the planner wrote has them from its graph); a plan whose files are not all there is
    returned as it is. See [Note: a tier's largest request] in tierflow/runtime/limits.py.
    """
    if plan.tensors or not all((directory / s.file).is_file() for s in plan.segments):
        return plan
    from tierflow.onnxrt.inference import open_session
    from tierflow.state.pairs import ort_sig

    found: dict[str, TensorShape] = {}
    for spec in plan.segments:
        kept = set(spec.state_inputs) | set(spec.state_outputs)
        try:
            session = open_session(directory / spec.file, optimization="disabled")
        except TierflowError:  # a file ONNX Runtime cannot load is reported when it is run
            return plan
        for arg in [*session.get_inputs(), *session.get_outputs()]:
            sig = ort_sig(arg)
            if sig.name in kept or sig.name in found or sig.shape is None:
                continue
            dims = tuple(d if isinstance(d, int) and d >= 0 else None for d in sig.shape)
            try:
                found[sig.name] = TensorShape(str(np.dtype(sig.dtype)), dims)
            except TypeError:
                continue  # a type numpy has no name for (strings, maps): no bound for it
    return replace(plan, tensors=found)


def file_digest(path: Path) -> tuple[str, int]:
    """The sha256 (hex) and size of a file, read in 1 MiB pieces."""
    digest = hashlib.sha256()
    size = 0
    with path.open("rb") as file:
        while piece := file.read(1 << 20):
            digest.update(piece)
            size += len(piece)
    return digest.hexdigest(), size


def with_digests(
    plan: Plan, directory: Path, known: dict[str, tuple[str, int]] | None = None
) -> Plan:
    """``plan`` with the sha256 and size of every segment file found in ``directory``,
    and of its ``.data`` (its weights) when it has one.

    A segment whose file is not there keeps what it had. ``known`` caches digests by file
    name across the plans of a set (they share files).
    """
    known = {} if known is None else known
    segments = []
    for segment in plan.segments:
        for name in (segment.file, segment.file + DATA_SUFFIX):
            if name not in known and (directory / name).is_file():
                known[name] = file_digest(directory / name)
        if segment.file in known:
            sha256, size = known[segment.file]
            segment = replace(segment, sha256=sha256, size=size)
            if segment.file + DATA_SUFFIX in known:
                data_sha256, data_size = known[segment.file + DATA_SUFFIX]
                segment = replace(segment, data_sha256=data_sha256, data_size=data_size)
        segments.append(segment)
    return replace(plan, segments=tuple(segments))


#: Where one plan of a set is best: one link condition per link name.
RegionPoint = dict[str, LinkSpec]


@dataclass(frozen=True)
class PlanSet:
    """Plans for one model over a range of link conditions, and where each is best.

    ``regions[i]`` holds the link conditions (grid points, see
    ``tierflow.partitioner.grid``) at which ``plans[i]`` is the best plan; ``default``
    indexes the plan for the links the set was planned for. A single-plan directory
    reads as a set of one with no regions. Plans may share segment files.

    ``plan.json`` of a set: ``{"format": "tierflow.plan/2", "default": 0, "plans":
    [PLAN, ...]}`` where each PLAN is a whole ``tierflow.plan/1`` object plus its
    ``"regions": [{"device-edge": {"rate_bps": ..., "rtt_s": ...}, "edge-cloud": ...}]``.
    """

    plans: tuple[Plan, ...]
    regions: tuple[tuple[RegionPoint, ...], ...] = ()
    default: int = 0

    def __post_init__(self) -> None:
        if not self.plans:
            raise PlanError("malformed plan set: it holds no plans")
        regions = self.regions or tuple(() for _ in self.plans)
        object.__setattr__(self, "regions", regions)
        if len(regions) != len(self.plans):
            raise PlanError(
                f"malformed plan set: {len(self.plans)} plans but {len(regions)} regions"
            )
        if not 0 <= self.default < len(self.plans):
            raise PlanError(
                f"malformed plan set: default plan {self.default} is not one of its "
                f"{len(self.plans)} plans"
            )
        first = self.plans[0]
        for plan in self.plans[1:]:
            if (plan.model_sha256, plan.inputs, plan.outputs) != (
                first.model_sha256,
                first.inputs,
                first.outputs,
            ):
                raise PlanError("malformed plan set: its plans are for different models")
        ids = [plan.plan_id for plan in self.plans]
        if len(set(ids)) != len(ids):
            raise PlanError(f"malformed plan set: a plan appears twice ({ids})")

    @property
    def default_plan(self) -> Plan:
        return self.plans[self.default]

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": PLAN_SET_FORMAT,
            "default": self.default,
            "plans": [
                dict(
                    plan.to_dict(),
                    regions=[
                        {name: link.to_dict() for name, link in point.items()} for point in region
                    ],
                )
                for plan, region in zip(self.plans, self.regions, strict=True)
            ],
        }

    @classmethod
    def from_dict(cls, data: Any) -> PlanSet:
        """A set from ``plan.json``: ``tierflow.plan/2``, or one ``tierflow.plan/1`` plan."""
        if isinstance(data, dict) and data.get("format") == PLAN_FORMAT:
            return cls((Plan.from_dict(data),))
        if not isinstance(data, dict) or data.get("format") != PLAN_SET_FORMAT:
            found = data.get("format") if isinstance(data, dict) else None
            raise PlanError(
                f"unsupported plan format {found!r}: expected {PLAN_FORMAT!r} or "
                f"{PLAN_SET_FORMAT!r}"
            )
        entries = data.get("plans")
        default = data.get("default", 0)
        if not isinstance(entries, list) or not isinstance(default, int):
            raise PlanError("malformed plan set: 'plans' must be a list, 'default' an index")
        plans, regions = [], []
        for number, entry in enumerate(entries):
            plans.append(Plan.from_dict(entry))
            points = entry.get("regions", [])
            if not isinstance(points, list) or not all(isinstance(p, dict) for p in points):
                raise PlanError(f"malformed plan set: plan {number} regions must be a list")
            try:
                regions.append(
                    tuple(
                        {check_link_name(n): LinkSpec.from_dict(v) for n, v in p.items()}
                        for p in points
                    )
                )
            except (UsageError, AttributeError) as exc:
                raise PlanError(f"malformed plan set: plan {number} regions: {exc}") from exc
        return cls(tuple(plans), tuple(regions), default)


def check_link_name(name: str) -> str:
    """``name`` if it is a link name (for plan files: a :class:`PlanError` otherwise)."""
    if name not in LINKS:
        raise PlanError(
            f"malformed plan: unknown link {name!r}, expected one of {', '.join(LINKS)}"
        )
    return name
