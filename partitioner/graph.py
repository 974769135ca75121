"""Graph analysis of an ONNX model: static shapes, topological order and candidate cuts.

Pure analysis: :func:`load_model` reads the model file (and its external data) and returns
a :class:`ModelGraph`; nothing is written. The planner profiles the "units" between
consecutive cuts and scores pairs of cuts; :mod:`tierflow.partitioner.split` turns a pair
into segment models. See ``Note [cut sets]`` for what a cut is and which positions are
candidates.
"""

from __future__ import annotations

import hashlib
import heapq
import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx.external_data_helper
import onnx.helper
import onnx.numpy_helper
import onnx.shape_inference
from google.protobuf.message import DecodeError

from tierflow.errors import InputError, ModelError, UsageError

logger = logging.getLogger(__name__)

# Note [cut sets]
# ~~~~~~~~~~~~~~~
# A cut is a position p in the topological node order (0 <= p <= len(nodes)): nodes
# [0, p) run before it, nodes [p, len) after. The tensors crossing it are the
# *activations* defined before p (model inputs count as defined at -1) and needed at or
# after p, where "needed" means used as a node input, referenced from inside a
# control-flow subgraph of a node (If/Loop/Scan bodies read outer-scope names; such a
# reference is an input of the node that owns the subgraph, so the node is atomic and
# never cut inside), or being a model output. Model outputs therefore cross every cut
# after the node that makes them, and cuts[-1] carries exactly the model outputs.
#
# Constants never cross. A constant is an initializer, a Constant node's output, or the
# output of any deterministic node all of whose inputs are constants. Because every cut
# happens at fixed (analysed) input shapes, Shape and Size of a tensor with a static shape
# are constants too: load_model replaces those nodes by Constant nodes holding the value,
# so shape arithmetic (Shape -> Gather -> Concat -> Reshape, as the legacy exporter writes
# for dynamic batch) is recomputed inside each segment that needs it instead of being
# sent. onnx.utils.Extractor pulls such constant chains into whichever segment uses them,
# since it walks back from a segment's outputs until it reaches the segment's inputs.
#
# Candidates. Position 0 (the model inputs) and len(nodes) (the model outputs) are always
# cuts. An interior position is a candidate when its crossing set is non-empty, holds only
# tensors (no sequences or optionals) and has at most max_cut_tensors tensors (default
# DEFAULT_MAX_CUT_TENSORS = 3: a chain CNN gives 1, a residual block interior 2, a
# transformer the hidden state plus a mask bias, and 3 leaves room for a
# downsampling block's interior; larger sets are rarely worth sending and multiply the
# number of units the planner must profile). Consecutive candidates that differ only by a
# cheap one-in-one-out elementwise or layout node (Relu after a Conv, a bias Add, a
# Reshape; see _CHEAP_OPS), or by a node that only computes constants, carry the same
# information; such a run is collapsed to the position with the fewest bytes, ties to the
# later one (so a cut after Conv+Relu, never between them). A run that reaches position 0
# or len(nodes) collapses onto that end. A full-size ResNet-18 gets 32 cuts.
#
# Bitwise equality. Segments are plain sub-graphs of the analysed model, so each node runs
# with the same inputs and kernel in the chain as in the whole model. ONNX Runtime's
# graph optimizations, though, rewrite across node boundaries, and a cut can break a
# rewrite, which changes rounding. Measured with onnxruntime 1.32 on the zoo models, a
# chain of segments equals the whole model bit for bit at ORT_DISABLE_ALL and
# ORT_ENABLE_BASIC (constant folding, Conv+BN/Conv+Add/Conv+Relu fusions: the same
# arithmetic); at ORT_ENABLE_EXTENDED the transformer differs by ~6e-8 (LayerNorm/Gelu/
# MatMul+Add fusions) and at ORT_ENABLE_ALL ResNet does too (NCHWc layouts change the
# accumulation order). verify_split therefore runs both sides at the same level,
# "disabled" by default; runtimes that must match the unsplit model bit for bit should
# use at most "basic".

DEFAULT_MAX_CUT_TENSORS = 3

# One-in-one-out nodes that cost next to nothing: a cut before one is as good as after it.
_CHEAP_OPS = frozenset(
    {
        "Abs", "Add", "BatchNormalization", "Cast", "Ceil", "Clip", "Div", "Dropout", "Elu",
        "Erf", "Exp", "Flatten", "Floor", "Gelu", "HardSigmoid", "HardSwish", "Identity",
        "LeakyRelu", "Log", "Mul", "Neg", "Not", "PRelu", "Pow", "Reciprocal", "Relu",
        "Reshape", "Round", "Selu", "Sigmoid", "Sign", "Softplus", "Softsign", "Sqrt",
        "Squeeze", "Sub", "Tanh", "ThresholdedRelu", "Unsqueeze", "Where",
    }
)  # fmt: skip

# Nodes whose output differs from run to run: never constant, even without inputs.
_NONDETERMINISTIC_OPS = frozenset(
    {"RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Multinomial",
     "Bernoulli"}
)  # fmt: skip

# numpy has no dtype for these ONNX element types; their sizes in bytes.
_ITEMSIZE_FALLBACK = {"bfloat16": 2, "float8e4m3fn": 1, "float8e4m3fnuz": 1, "float8e5m2": 1,
                      "float8e5m2fnuz": 1, "int4": 1, "uint4": 1, "float4e2m1": 1}  # fmt: skip

# Measure every intermediate by running the model unless that would hold more than this
# much memory at once (then only when inference left some shape unknown).
_MEASURE_LIMIT_BYTES = 1 << 30


def first_line(exc: BaseException) -> str:
    """An exception's message cut to its first line (onnx and ORT write whole reports)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _itemsize(dtype: str) -> int:
    try:
        return int(np.dtype(dtype).itemsize)
    except TypeError:
        return _ITEMSIZE_FALLBACK.get(dtype, 1)


@dataclass(frozen=True)
class TensorInfo:
    """An activation tensor: its name, numpy dtype name and static shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * _itemsize(self.dtype)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}

    @classmethod
    def from_dict(cls, data: Any) -> TensorInfo:
        try:
            return cls(str(data["name"]), str(data["dtype"]), tuple(int(d) for d in data["shape"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelError(f"malformed tensor description {data!r}: {exc}") from exc


@dataclass(frozen=True)
class Cut:
    """A candidate cut: a position in the node order and the activations crossing it.

    See ``Note [cut sets]``.
    """

    index: int
    position: int
    tensors: tuple[str, ...]
    nbytes: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "position": self.position,
            "tensors": list(self.tensors),
            "nbytes": self.nbytes,
        }

    @classmethod
    def from_dict(cls, data: Any) -> Cut:
        try:
            return cls(
                index=int(data["index"]),
                position=int(data["position"]),
                tensors=tuple(str(t) for t in data["tensors"]),
                nbytes=int(data["nbytes"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelError(f"malformed cut description {data!r}: {exc}") from exc


@dataclass(frozen=True)
class _Usage:
    """Per-node facts the analysis and the segment queries share (indexed like nodes)."""

    uses: tuple[tuple[str, ...], ...]  # inputs plus outer-scope names read by subgraphs
    constant_nodes: frozenset[int]  # nodes that compute only constants
    constants: frozenset[str]  # every constant tensor name
    weights: tuple[frozenset[str], ...]  # weight sources (initializers, Constant outputs)
    private_weight_bytes: tuple[int, ...]  # weights stored inside the node's subgraphs
    weight_nbytes: dict[str, int]  # size of each weight source
    last_use: dict[str, int]  # activation -> last node index needing it (len(nodes): output)


@dataclass(frozen=True, eq=False)
class ModelGraph:
    """A loaded and analysed model: static shapes, node order, candidate cuts.

    ``model`` has its symbolic dimensions fixed, shapes inferred (and measured), nodes in
    the order of ``nodes`` and Shape/Size of static tensors folded to constants (see
    ``Note [cut sets]``); it is what segments are extracted from. ``sample`` holds the
    first request of ``--sample`` when one was given.
    """

    path: str
    sha256: str
    model: onnx.ModelProto
    nodes: tuple[onnx.NodeProto, ...]
    inputs: tuple[TensorInfo, ...]
    outputs: tuple[TensorInfo, ...]
    tensors: dict[str, TensorInfo]
    cuts: tuple[Cut, ...]
    sample: dict[str, np.ndarray] | None = None
    usage: _Usage | None = field(default=None, repr=False)
    # Objects derived from the model on demand (the segment extractor); not part of its value.
    cache: dict[str, Any] = field(default_factory=dict, repr=False)

    def _usage(self) -> _Usage:
        assert self.usage is not None, "ModelGraph built without load_model"
        return self.usage

    def _span(self, start: int, end: int) -> tuple[int, int]:
        if not 0 <= start <= end < len(self.cuts):
            raise ModelError(
                f"cut range {start}..{end} is not within 0..{len(self.cuts) - 1} in order"
            )
        return self.cuts[start].position, self.cuts[end].position

    def weight_bytes(self, start: int, end: int) -> int:
        """Bytes of the weights the nodes between ``cuts[start]`` and ``cuts[end]`` read.

        Counts initializers and Constant data each once, however many nodes share them,
        including constants computed from them and weights inside control-flow bodies.
        """
        first, last = self._span(start, end)
        usage = self._usage()
        sources: set[str] = set()
        private = 0
        for i in range(first, last):
            if i in usage.constant_nodes:
                continue
            sources |= usage.weights[i]
            private += usage.private_weight_bytes[i]
        return private + sum(usage.weight_nbytes[name] for name in sources)

    def peak_activation_bytes(self, start: int, end: int) -> int:
        """Peak bytes of live activations while running the segment ``cuts[start..end]``.

        The segment's inputs are live from the start; a tensor is freed after its last
        use unless the segment outputs it; a node's inputs and outputs are live together.
        Weights are not included (see :meth:`weight_bytes`).
        """
        first, last = self._span(start, end)
        usage = self._usage()
        keep = set(self.cuts[end].tensors)
        live = {name: self.tensors[name].nbytes for name in self.cuts[start].tensors}
        current = peak = sum(live.values())
        for i in range(first, last):
            if i in usage.constant_nodes:
                continue
            for name in self.nodes[i].output:
                if name in self.tensors and name not in live:
                    live[name] = self.tensors[name].nbytes
                    current += live[name]
            peak = max(peak, current)
            for name in (*usage.uses[i], *self.nodes[i].output):
                if name in live and name not in keep and usage.last_use.get(name, -1) <= i:
                    current -= live.pop(name)
        return peak

    def representative_inputs(self, seed: int = 0) -> dict[str, np.ndarray]:
        """One request's inputs: the sample's first row if given, else seeded random data.

        Random floats are standard normal; integers are 0 or 1 (valid indices for any
        embedding table); booleans are fair coin flips.
        """
        return _representative_inputs(self.inputs, self.sample, seed)

    def unit_count(self) -> int:
        """Number of units (stretches between consecutive cuts) the planner profiles."""
        return len(self.cuts) - 1


# --- public helpers ---------------------------------------------------------------------


def parse_shape_option(text: str) -> tuple[str, tuple[int, ...]]:
    """Parse ``--shape NAME=1x3x640x640`` into ``("NAME", (1, 3, 640, 640))``."""
    name, sep, dims = text.rpartition("=")
    if not sep or not name:
        raise UsageError(f"malformed --shape {text!r}: expected NAME=DIMS, like input=1x3x224x224")
    try:
        shape = tuple(int(d) for d in dims.lower().split("x"))
    except ValueError as exc:
        raise UsageError(
            f"malformed --shape {text!r}: dimensions must be positive integers joined by 'x'"
        ) from exc
    if any(d <= 0 for d in shape):
        raise UsageError(f"malformed --shape {text!r}: dimensions must be positive, got {dims!r}")
    return name, shape


def load_sample(path: str | Path) -> dict[str, np.ndarray]:
    """Read ``IN.npz``: one array per model input with a leading request axis.

    An optional ``labels`` array (calibration files have one) is left out.
    """
    try:
        with np.load(Path(path), allow_pickle=False) as archive:
            arrays = {name: archive[name] for name in archive.files if name != "labels"}
    except FileNotFoundError as exc:
        raise InputError(f"sample file {path} does not exist") from exc
    except (OSError, ValueError) as exc:
        raise InputError(f"cannot read sample file {path} as .npz: {exc}") from exc
    if not arrays:
        raise InputError(f"sample file {path} holds no input arrays")
    for name, array in arrays.items():
        if array.ndim == 0 or array.shape[0] == 0:
            raise InputError(
                f"sample array {name!r} in {path} has shape {array.shape}; expected a leading "
                "request axis with at least one request"
            )
    return arrays


# --- loading ------------------------------------------------------------------------------


def _subgraphs(node: onnx.NodeProto) -> Iterator[onnx.GraphProto]:
    for attr in node.attribute:
        if attr.type == onnx.AttributeProto.GRAPH:
            yield attr.g
        elif attr.type == onnx.AttributeProto.GRAPHS:
            yield from attr.graphs


def _outer_refs(graph: onnx.GraphProto) -> set[str]:
    """Names a subgraph reads from enclosing scopes (recursively through nested bodies)."""
    defined = {v.name for v in graph.input} | {t.name for t in graph.initializer}
    refs: set[str] = set()
    for node in graph.node:
        for name in node.input:
            if name and name not in defined:
                refs.add(name)
        for sub in _subgraphs(node):
            refs |= _outer_refs(sub) - defined
        defined.update(n for n in node.output if n)
    return refs


def node_uses(node: onnx.NodeProto) -> tuple[str, ...]:
    """A node's inputs plus the outer-scope names its subgraphs read, without duplicates.

    For liveness a control-flow node reads everything its bodies reference, so it is
    atomic: see ``Note [cut sets]``.
    """
    names = [n for n in node.input if n]
    for sub in _subgraphs(node):
        names.extend(sorted(_outer_refs(sub)))
    return tuple(dict.fromkeys(names))


def _all_tensors(graph: onnx.GraphProto) -> Iterator[onnx.TensorProto]:
    yield from graph.initializer
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.TENSOR:
                yield attr.t
            elif attr.type == onnx.AttributeProto.TENSORS:
                yield from attr.tensors
        for sub in _subgraphs(node):
            yield from _all_tensors(sub)


def _read(path: Path) -> tuple[onnx.ModelProto, str]:
    """Parse the model, load its external data, and hash the bytes it came from.

    The hash is sha256 of the .onnx file when the weights are inside it; with external
    data it also covers each data file, in sorted location order, each preceded by its
    location, so moving weights between files changes it.
    """
    try:
        raw = path.read_bytes()
    except FileNotFoundError as exc:
        raise ModelError(f"model file {path} does not exist") from exc
    except OSError as exc:
        raise ModelError(f"cannot read model file {path}: {exc}") from exc
    if not raw:
        raise ModelError(f"{path} is empty, not an ONNX model")
    try:
        model = onnx.load_model_from_string(raw)
    except (DecodeError, ValueError, RuntimeError) as exc:
        raise ModelError(
            f"{path} is not an ONNX model (or is truncated): {first_line(exc)}"
        ) from exc
    if not model.HasField("graph") or not model.opset_import:
        raise ModelError(f"{path} is not an ONNX model: it has no graph or no opset import")
    digest = hashlib.sha256(raw)
    locations = sorted(
        {
            onnx.external_data_helper.ExternalDataInfo(t).location
            for t in _all_tensors(model.graph)
            if onnx.external_data_helper.uses_external_data(t)
        }
    )
    for location in locations:
        if Path(location).is_absolute() or ".." in Path(location).parts:
            raise ModelError(
                f"{path} names external data {location!r} outside its directory; "
                "expected a file name beside the model"
            )
        data_path = path.parent / location
        try:
            data = data_path.read_bytes()
        except OSError as exc:
            raise ModelError(
                f"{path} keeps weights in external file {location!r}, which cannot be read: {exc}"
            ) from exc
        digest.update(b"\0" + location.encode() + b"\0")
        digest.update(data)
    if locations:
        try:
            onnx.external_data_helper.load_external_data_for_model(model, str(path.parent))
        except (OSError, ValueError, onnx.checker.ValidationError) as exc:
            raise ModelError(f"cannot load the external data of {path}: {first_line(exc)}") from exc
    return model, digest.hexdigest()


def _topological_order(graph: onnx.GraphProto, path: Path) -> list[int]:
    """The file's node order if it is topological, else a deterministic Kahn sort.

    Ties go to the node that comes first in the file. A name nothing defines, or a
    cycle, is a ModelError.
    """
    nodes = list(graph.node)
    available = {v.name for v in graph.input} | {t.name for t in graph.initializer}
    uses = [node_uses(n) for n in nodes]
    valid = True
    seen = set(available)
    for node, needed in zip(nodes, uses, strict=True):
        if any(name not in seen for name in needed):
            valid = False
            break
        seen.update(n for n in node.output if n)
    if valid:
        return list(range(len(nodes)))
    producer: dict[str, int] = {}
    for i, node in enumerate(nodes):
        for name in node.output:
            if name:
                producer[name] = i
    waiting = [0] * len(nodes)
    consumers: dict[int, list[int]] = {}
    for i, needed in enumerate(uses):
        for name in set(needed):
            if name in available:
                continue
            if name not in producer:
                raise ModelError(
                    f"invalid graph in {path}: node {nodes[i].name or nodes[i].op_type!r} "
                    f"reads {name!r}, which no input, initializer or node provides"
                )
            waiting[i] += 1
            consumers.setdefault(producer[name], []).append(i)
    ready = [i for i, count in enumerate(waiting) if count == 0]
    heapq.heapify(ready)
    order: list[int] = []
    while ready:
        i = heapq.heappop(ready)
        order.append(i)
        for j in consumers.get(i, []):
            waiting[j] -= 1
            if waiting[j] == 0:
                heapq.heappush(ready, j)
    if len(order) != len(nodes):
        raise ModelError(f"invalid graph in {path}: its nodes form a cycle")
    logger.info("[graph] %s: nodes were not in topological order; sorted them", path)
    return order


def _sort_nodes(model: onnx.ModelProto, path: Path) -> None:
    """Put the nodes in topological order (the checker and the Extractor need it)."""
    order = _topological_order(model.graph, path)
    if order != sorted(order):
        graph = model.graph
        ordered = [onnx.NodeProto.FromString(graph.node[i].SerializeToString()) for i in order]
        del graph.node[:]
        graph.node.extend(ordered)


def _dims(value: onnx.ValueInfoProto) -> list[int | str | None] | None:
    """Dimensions of a tensor value info: ints, symbolic names, None for unknown."""
    tensor_type = value.type.tensor_type
    if not tensor_type.HasField("shape"):
        return None
    dims: list[int | str | None] = []
    for d in tensor_type.shape.dim:
        if d.HasField("dim_value") and d.dim_value > 0:
            dims.append(int(d.dim_value))
        elif d.HasField("dim_param") and d.dim_param:
            dims.append(d.dim_param)
        else:
            dims.append(None)
    return dims


def _np_dtype_name(elem_type: int) -> str:
    try:
        return str(onnx.helper.tensor_dtype_to_np_dtype(elem_type).name)
    except (KeyError, TypeError) as exc:
        raise ModelError(
            f"unsupported tensor element type {elem_type} "
            f"({onnx.TensorProto.DataType.Name(elem_type)})"
        ) from exc


def _elem_type(dtype: str) -> int:
    """The ONNX element type of a numpy dtype name (inverse of :func:`_np_dtype_name`)."""
    for elem in onnx.TensorProto.DataType.values():
        try:
            if onnx.helper.tensor_dtype_to_np_dtype(elem).name == dtype:
                return int(elem)
        except (KeyError, TypeError):
            continue
    raise ModelError(f"no ONNX element type for numpy dtype {dtype!r}")


def _input_shapes(
    values: Sequence[onnx.ValueInfoProto],
    path: Path,
    shapes: Mapping[str, Sequence[int]],
    sample: Mapping[str, np.ndarray] | None,
) -> dict[str, tuple[int, ...]]:
    """Fix every input dimension: --shape, else the sample's row, else batch 1 / error."""
    names = [v.name for v in values]
    for name in shapes:
        if name not in names:
            raise UsageError(
                f"--shape names {name!r}, which is not an input of {path}; "
                f"its inputs are {', '.join(names)}"
            )
    if sample is not None:
        missing = [n for n in names if n not in sample]
        if missing:
            raise InputError(
                f"the sample has no array for model input(s) {missing}; it has {sorted(sample)}"
            )
    fixed: dict[str, tuple[int, ...]] = {}
    for value in values:
        if not value.type.HasField("tensor_type"):
            raise ModelError(
                f"input {value.name!r} of {path} is not a tensor; only tensors are supported"
            )
        dims = _dims(value)
        if value.name in shapes:
            given = tuple(int(d) for d in shapes[value.name])
            if dims is not None and len(dims) != len(given):
                raise UsageError(
                    f"--shape {value.name}={'x'.join(map(str, given))} has {len(given)} "
                    f"dimensions; the model declares {len(dims)}"
                )
            for declared, wanted in zip(dims or [], given, strict=False):
                if isinstance(declared, int) and declared != wanted:
                    raise UsageError(
                        f"--shape {value.name}={'x'.join(map(str, given))} conflicts with the "
                        f"model's fixed shape {dims}"
                    )
            fixed[value.name] = given
            continue
        if sample is not None:
            row = sample[value.name][0]
            if dims is not None and (
                len(dims) != row.ndim
                or any(isinstance(d, int) and d != r for d, r in zip(dims, row.shape, strict=True))
            ):
                raise InputError(
                    f"sample array {value.name!r} has requests of shape {row.shape}; the model "
                    f"expects {dims} (the sample needs a leading request axis before them)"
                )
            fixed[value.name] = tuple(int(d) for d in row.shape)
            continue
        if dims is None:
            raise ModelError(
                f"input {value.name!r} of {path} has no declared shape; give it with "
                f"--shape {value.name}=DIMS"
            )
        resolved: list[int] = []
        for axis, d in enumerate(dims):
            if isinstance(d, int):
                resolved.append(d)
            elif axis == 0:
                resolved.append(1)  # a leading batch dimension: one request at a time
            else:
                shown = "x".join("?" if not isinstance(x, int) else str(x) for x in dims)
                raise ModelError(
                    f"input {value.name!r} of {path} has unknown dimension {axis} "
                    f"({d or 'unnamed'}) in shape {shown}; fix it with --shape {value.name}=DIMS "
                    "or --sample IN.npz"
                )
        fixed[value.name] = tuple(resolved)
    return fixed


def _sample_row(array: np.ndarray, info: TensorInfo) -> np.ndarray:
    """The first request of a sample array, in the input's dtype (same kind only)."""
    row = np.asarray(array[0])
    try:
        return row.astype(info.dtype, casting="same_kind", copy=False)
    except TypeError as exc:
        raise InputError(
            f"sample array {info.name!r} holds {row.dtype}; the model input is {info.dtype}"
        ) from exc


def _representative_inputs(
    inputs: Sequence[TensorInfo], sample: Mapping[str, np.ndarray] | None, seed: int
) -> dict[str, np.ndarray]:
    if sample is not None:
        return {info.name: np.array(sample[info.name], copy=True) for info in inputs}
    rng = np.random.default_rng(seed)
    arrays: dict[str, np.ndarray] = {}
    for info in inputs:
        dtype = np.dtype(info.dtype)
        if dtype.kind == "f":
            arrays[info.name] = rng.standard_normal(info.shape).astype(dtype)
        elif dtype.kind == "b":
            arrays[info.name] = rng.random(info.shape) < 0.5
        elif dtype.kind in "iu":
            arrays[info.name] = rng.integers(0, 2, info.shape).astype(dtype)
        else:
            raise ModelError(
                f"cannot make a representative value for input {info.name!r} of type "
                f"{info.dtype}; pass --sample IN.npz"
            )
    return arrays


def _static_model(
    model: onnx.ModelProto, input_shapes: Mapping[str, tuple[int, ...]], path: Path
) -> onnx.ModelProto:
    """Fix the input dimensions, drop declared shapes, and infer shapes afresh.

    Declared intermediate and output shapes are not trusted (exporters and hand edits
    get them wrong); inference recomputes them from the fixed inputs and the ops.
    """
    graph = model.graph
    for i, value in enumerate(graph.input):
        if value.name in input_shapes:
            elem = value.type.tensor_type.elem_type
            fixed = onnx.helper.make_tensor_value_info(value.name, elem, input_shapes[value.name])
            graph.input[i].CopyFrom(fixed)
    for i, value in enumerate(graph.output):
        if value.type.HasField("tensor_type"):
            elem = value.type.tensor_type.elem_type
            graph.output[i].CopyFrom(onnx.helper.make_tensor_value_info(value.name, elem, None))
    del graph.value_info[:]
    try:
        return onnx.shape_inference.infer_shapes(
            model, check_type=False, strict_mode=False, data_prop=True
        )
    except (onnx.shape_inference.InferenceError, onnx.checker.ValidationError) as exc:
        raise ModelError(f"shape inference failed on {path}: {first_line(exc)}") from exc


def _inferred_infos(model: onnx.ModelProto) -> dict[str, TensorInfo | None]:
    """Static tensor infos from inference; None where type or shape is not fully known."""
    infos: dict[str, TensorInfo | None] = {}
    graph = model.graph
    for value in (*graph.input, *graph.value_info, *graph.output):
        tensor_type = value.type.tensor_type
        dims = _dims(value) if value.type.HasField("tensor_type") else None
        if dims is None or not tensor_type.elem_type or not all(isinstance(d, int) for d in dims):
            infos.setdefault(value.name, None)
            continue
        dtype = _np_dtype_name(tensor_type.elem_type)
        infos[value.name] = TensorInfo(value.name, dtype, tuple(int(d) for d in dims))  # type: ignore[arg-type]
    return infos


def _measure(
    model: onnx.ModelProto, names: Sequence[str], feeds: Mapping[str, np.ndarray], path: Path
) -> dict[str, TensorInfo]:
    """Run the model once in ONNX Runtime with every listed tensor as an extra output.

    Returns the dtype and shape each one actually had. Graph optimizations are off so
    every intermediate exists as the graph names it.
    """
    import onnxruntime as ort

    graph = model.graph
    declared = {v.name for v in graph.output}
    extra = [n for n in names if n not in declared]
    original = len(graph.output)
    graph.output.extend(onnx.ValueInfoProto(name=n) for n in extra)
    try:
        data = model.SerializeToString()
    finally:
        del graph.output[original:]
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3
    try:
        session = ort.InferenceSession(data, options, providers=["CPUExecutionProvider"])
        wanted = [o.name for o in session.get_outputs()]
        values = session.run(wanted, dict(feeds))
    except Exception as exc:  # onnxruntime raises its own exception types
        raise ModelError(f"ONNX Runtime cannot run {path}: {first_line(exc)}") from exc
    measured: dict[str, TensorInfo] = {}
    for name, value in zip(wanted, values, strict=True):
        if isinstance(value, np.ndarray):
            measured[name] = TensorInfo(name, value.dtype.name, tuple(int(d) for d in value.shape))
    return measured


def _fold_shapes(model: onnx.ModelProto, infos: Mapping[str, TensorInfo]) -> int:
    """Replace Shape/Size of statically shaped tensors by Constant nodes; return how many.

    See ``Note [cut sets]``: at fixed input shapes these are constants.
    """
    folded = 0
    graph = model.graph
    for i, node in enumerate(graph.node):
        if node.domain not in ("", "ai.onnx") or node.op_type not in ("Shape", "Size"):
            continue
        source = infos.get(node.input[0])
        if source is None:
            continue
        if node.op_type == "Shape":
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
            dims = list(source.shape)
            start, end = int(attrs.get("start", 0)), int(attrs.get("end", len(dims)))
            value = np.array(dims[slice(start, end if "end" in attrs else None)], dtype=np.int64)
        else:
            value = np.array(int(np.prod(source.shape, dtype=np.int64)), dtype=np.int64)
        constant = onnx.helper.make_node(
            "Constant",
            [],
            [node.output[0]],
            name=node.name or f"folded_{node.op_type}_{i}",
            value=onnx.numpy_helper.from_array(value, name=node.output[0]),
        )
        graph.node[i].CopyFrom(constant)
        folded += 1
    return folded


def _tensor_nbytes(tensor: onnx.TensorProto) -> int:
    count = int(np.prod(tensor.dims, dtype=np.int64))
    return count * _itemsize(_np_dtype_name(tensor.data_type))


def _subgraph_weight_bytes(graph: onnx.GraphProto) -> int:
    return sum(_tensor_nbytes(t) for t in _all_tensors(graph))


def _usage(
    graph: onnx.GraphProto, infos: Mapping[str, TensorInfo], outputs: Sequence[str]
) -> _Usage:
    """Constants, weight sources and last uses; see ``Note [cut sets]``."""
    nodes = list(graph.node)
    uses = tuple(node_uses(n) for n in nodes)
    weight_nbytes = {t.name: _tensor_nbytes(t) for t in graph.initializer}
    constants = set(weight_nbytes)
    sources: dict[str, frozenset[str]] = {name: frozenset({name}) for name in constants}
    constant_nodes: set[int] = set()
    weights: list[frozenset[str]] = []
    private: list[int] = []
    for i, node in enumerate(nodes):
        node_sources = frozenset().union(*(sources[u] for u in uses[i] if u in sources))
        weights.append(node_sources)
        private.append(sum(_subgraph_weight_bytes(g) for g in _subgraphs(node)))
        deterministic = node.op_type not in _NONDETERMINISTIC_OPS
        if deterministic and all(u in constants for u in uses[i]):
            constant_nodes.add(i)
            for name in node.output:
                if not name:
                    continue
                constants.add(name)
                if node.op_type == "Constant":
                    info = infos.get(name)
                    weight_nbytes[name] = info.nbytes if info is not None else 0
                    sources[name] = frozenset({name})
                else:
                    sources[name] = node_sources
    last_use: dict[str, int] = {}
    for i, needed in enumerate(uses):
        if i in constant_nodes:
            continue
        for name in needed:
            if name not in constants:
                last_use[name] = i
    for name in outputs:
        last_use[name] = len(nodes)
    return _Usage(
        uses=uses,
        constant_nodes=frozenset(constant_nodes),
        constants=frozenset(constants),
        weights=tuple(weights),
        private_weight_bytes=tuple(private),
        weight_nbytes=weight_nbytes,
        last_use=last_use,
    )


def _crossing_sets(
    graph: onnx.GraphProto, usage: _Usage, input_names: Sequence[str]
) -> list[tuple[str, ...]]:
    """The activations crossing each position 0..len(nodes), in order of definition."""
    live: dict[str, None] = {name: None for name in input_names if name in usage.last_use}
    sets = [tuple(input_names)]
    for i, node in enumerate(graph.node):
        if i not in usage.constant_nodes:
            for name in node.output:
                if name and usage.last_use.get(name, -1) > i:
                    live[name] = None
            for name in usage.uses[i]:
                if name in live and usage.last_use[name] <= i:
                    del live[name]
        sets.append(tuple(live))
    return sets


def _candidate_cuts(
    graph: onnx.GraphProto,
    usage: _Usage,
    sets: Sequence[tuple[str, ...]],
    tensors: Mapping[str, TensorInfo],
    outputs: Sequence[str],
    max_cut_tensors: int,
) -> list[Cut]:
    """Filter and collapse positions into candidate cuts; see ``Note [cut sets]``."""
    end = len(sets) - 1

    def nbytes(names: Sequence[str]) -> int:
        return sum(tensors[n].nbytes for n in names)

    def candidate(p: int) -> bool:
        crossing = sets[p]
        return 0 < len(crossing) <= max_cut_tensors and all(n in tensors for n in crossing)

    def equivalent(p: int) -> bool:
        """Whether positions p and p+1 differ only by a cheap or constant node."""
        if p in usage.constant_nodes or sets[p] == sets[p + 1]:
            return True
        node = graph.node[p]
        active_in = [u for u in usage.uses[p] if u not in usage.constants]
        active_out = [o for o in node.output if o and o in tensors]
        return (
            node.domain in ("", "ai.onnx")
            and node.op_type in _CHEAP_OPS
            and len(active_in) == 1
            and len(active_out) == 1
            and len(sets[p]) == len(sets[p + 1])
        )

    positions = [0] + [p for p in range(1, end) if candidate(p)] + [end]
    kept: list[int] = []
    run: list[int] = [positions[0]]
    for p in positions[1:]:
        if p == run[-1] + 1 and equivalent(run[-1]):
            run.append(p)
            continue
        kept.append(_best(run, sets, nbytes, end))
        run = [p]
    kept.append(_best(run, sets, nbytes, end))
    cuts = []
    for index, p in enumerate(kept):
        names = tuple(outputs) if p == end else sets[p]
        cuts.append(Cut(index=index, position=p, tensors=names, nbytes=nbytes(names)))
    return cuts


def _best(run: Sequence[int], sets: Sequence[tuple[str, ...]], nbytes: Any, end: int) -> int:
    """The position a run of equivalent positions collapses to."""
    if run[0] == 0:
        return 0
    if run[-1] == end:
        return end
    return min(reversed(run), key=lambda p: nbytes(sets[p]))


def _drop_initializer_inputs(model: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    """Remove initializers from the graph inputs; return the real inputs.

    Initializers listed as inputs (keep_initializers_as_inputs) are overridable in ONNX
    Runtime, which then cannot pre-pack them and rounds differently from the segments,
    where they are plain weights. They are constants here (Note [cut sets]).
    """
    graph = model.graph
    initializer_names = {t.name for t in graph.initializer}
    real = [v for v in graph.input if v.name not in initializer_names]
    if len(real) != len(graph.input):
        kept = [onnx.ValueInfoProto.FromString(v.SerializeToString()) for v in real]
        del graph.input[:]
        graph.input.extend(kept)
        model.ir_version = max(model.ir_version, 4)  # IR 3 required them among the inputs
        real = list(graph.input)
    return real


def _static_infos(
    model: onnx.ModelProto,
    inputs: Sequence[TensorInfo],
    sample_row: Mapping[str, np.ndarray] | None,
    path: Path,
) -> dict[str, TensorInfo | None]:
    """Static infos of every top-level tensor: inferred, then checked by running.

    Running is skipped only when inference knew every shape and holding all
    intermediates at once would be too much memory.
    """
    infos = _inferred_infos(model)
    produced = [n for node in model.graph.node for n in node.output if n]
    known = [infos.get(n) for n in produced]
    estimate = sum(i.nbytes for i in known if i is not None)
    if any(i is None for i in known) or estimate <= _MEASURE_LIMIT_BYTES:
        feeds = _representative_inputs(inputs, sample_row, seed=0)
        for name, info in _measure(model, produced, feeds, path).items():
            if infos.get(name) not in (None, info):
                logger.debug("[graph] %s: inferred %s, measured %s", name, infos[name], info)
            infos[name] = info
    return infos


def load_model(
    path: str | Path,
    *,
    shapes: Mapping[str, Sequence[int]] | None = None,
    sample: Mapping[str, np.ndarray] | None = None,
    max_cut_tensors: int = DEFAULT_MAX_CUT_TENSORS,
) -> ModelGraph:
    """Load an ONNX model as users have it and analyse it for cutting.

    Accepts both torch exporters' output and hand-built graphs; weights in initializers,
    Constant nodes or external data files beside the model; opset 11 and newer. Symbolic
    input dimensions are fixed from ``shapes`` (``--shape``), else from the first request
    of ``sample`` (``--sample``, arrays with a leading request axis), else a leading
    batch dimension becomes 1 and any other unknown one is a ModelError. Shapes are
    inferred, then measured by running the model once in ONNX Runtime. See
    ``Note [cut sets]`` for the cuts.
    """
    path = Path(path)
    if max_cut_tensors < 1:
        raise UsageError(f"max_cut_tensors must be at least 1, got {max_cut_tensors}")
    model, sha256 = _read(path)
    _sort_nodes(model, path)
    try:
        onnx.checker.check_model(model)
    except (onnx.checker.ValidationError, ValueError) as exc:
        raise ModelError(f"invalid ONNX graph in {path}: {first_line(exc)}") from exc

    input_values = _drop_initializer_inputs(model)
    input_shapes = _input_shapes(input_values, path, shapes or {}, sample)
    model = _static_model(model, input_shapes, path)
    graph = model.graph
    inputs = tuple(
        TensorInfo(v.name, _np_dtype_name(v.type.tensor_type.elem_type), input_shapes[v.name])
        for v in graph.input
        if v.name in input_shapes
    )
    sample_row = None
    if sample is not None:
        sample_row = {i.name: _sample_row(sample[i.name], i) for i in inputs}

    infos = _static_infos(model, inputs, sample_row, path)
    produced = [n for node in graph.node for n in node.output if n]
    unknown = [n for n in produced if infos.get(n) is None]

    static = {k: v for k, v in infos.items() if v is not None}
    folded = _fold_shapes(model, static)
    output_names = [v.name for v in graph.output]
    for name in (*output_names, *(i.name for i in inputs)):
        if name not in static:
            raise ModelError(f"cannot determine the shape of {name!r} in {path}")
    _write_value_infos(model, static, {i.name for i in inputs})

    usage = _usage(graph, static, output_names)
    constant_outputs = [n for n in output_names if n in usage.constants]
    if constant_outputs:
        raise ModelError(
            f"model outputs {constant_outputs} of {path} are constants; nothing to run"
        )
    input_names = [i.name for i in inputs]
    tensors = {
        name: static[name]
        for name in (*input_names, *produced)
        if name not in usage.constants and name in static
    }
    sets = _crossing_sets(graph, usage, input_names)
    cuts = _candidate_cuts(graph, usage, sets, tensors, output_names, max_cut_tensors)
    logger.info(
        "[graph] %s: %d nodes, %d cuts, %d shapes folded, %d tensors of unknown shape",
        path,
        len(graph.node),
        len(cuts),
        folded,
        len(unknown),
    )
    return ModelGraph(
        path=str(path),
        sha256=sha256,
        model=model,
        nodes=tuple(graph.node),
        inputs=inputs,
        outputs=tuple(static[n] for n in output_names),
        tensors=tensors,
        cuts=tuple(cuts),
        sample=sample_row,
        usage=usage,
    )


def _write_value_infos(
    model: onnx.ModelProto, infos: Mapping[str, TensorInfo], input_names: set[str]
) -> None:
    """Record the static shapes in the model so extracted segments declare them."""
    graph = model.graph

    def value_info(info: TensorInfo) -> onnx.ValueInfoProto:
        return onnx.helper.make_tensor_value_info(
            info.name, _elem_type(info.dtype), list(info.shape)
        )

    output_names = {v.name for v in graph.output}
    for i, value in enumerate(graph.output):
        graph.output[i].CopyFrom(value_info(infos[value.name]))
    del graph.value_info[:]
    graph.value_info.extend(
        value_info(infos[n])
        for node in graph.node
        for n in node.output
        if n and n in infos and n not in output_names and n not in input_names
    )
