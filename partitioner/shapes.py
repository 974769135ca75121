"""Static shapes: fixing symbolic input dimensions, inferring, measuring and folding.

Every cut happens at fixed input shapes. :func:`fix_input_shapes` resolves each input
from ``--shape``, the ``--sample`` file's first request, or a leading batch of 1;
:func:`static_model` re-infers every shape from there; :func:`static_infos` checks them by
running the model once in ONNX Runtime; :func:`fold_shapes` turns Shape/Size of static
tensors into constants ([Note: cut sets] in :mod:`tierflow.partitioner.cuts`) and
:func:`write_value_infos` records the result so extracted segments declare it.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path

import numpy as np
import onnx
import onnx.helper
import onnx.numpy_helper
import onnx.shape_inference

from tierflow.errors import InputError, ModelError, UsageError, shown
from tierflow.npz import adds_batch, read_arrays, request, request_count
from tierflow.partitioner.tensors import TensorInfo, first_line, node_uses, np_dtype_name

logger = logging.getLogger(__name__)

# Measure every intermediate by running the model unless that would hold more than this
# much memory at once (then only when inference left some shape unknown).
_MEASURE_LIMIT_BYTES = 1 << 30


def parse_shape_option(text: str) -> tuple[str, tuple[int, ...]]:
    """Parse ``--shape NAME=1x3x640x640`` into ``("NAME", (1, 3, 640, 640))``."""
    name, sep, dims = text.rpartition("=")
    if not sep or not name:
        raise UsageError(
            f"malformed --shape {shown(text)}: expected NAME=DIMS, like input=1x3x224x224"
        )
    try:
        shape = tuple(int(d) for d in dims.lower().split("x"))
    except ValueError as exc:
        raise UsageError(
            f"malformed --shape {shown(text)}: dimensions must be positive integers joined by 'x'"
        ) from exc
    if any(d <= 0 for d in shape):
        raise UsageError(
            f"malformed --shape {shown(text)}: dimensions must be positive, got {shown(dims)}"
        )
    return name, shape


def load_sample(path: str | Path) -> dict[str, np.ndarray]:
    """Read ``IN.npz`` as ``tierflow run`` does: one array per input, leading request axis.

    An optional ``labels`` array (calibration files have one) is left out.
    """
    return read_arrays(path)


def sample_request(
    values: Sequence[onnx.ValueInfoProto], sample: Mapping[str, np.ndarray], path: Path
) -> dict[str, np.ndarray]:
    """The sample's first request, its rows shaped as ``tierflow run`` shapes them.

    A row gains a batch dimension of 1 exactly when ``run`` would add one ([Note: request
    rows] in :mod:`tierflow.npz`), so the shapes fixed here are those requests have.
    """
    ranks: dict[str, int | None] = {}
    for value in values:
        dims = declared_dims(value) if value.type.HasField("tensor_type") else None
        ranks[value.name] = None if dims is None else len(dims)
    missing = [name for name in ranks if name not in sample]
    if missing:
        raise InputError(
            f"the sample has no array for model input(s) {missing}; it has {sorted(sample)}"
        )
    request_count(sample, list(ranks), path)
    return request(sample, ranks, 0, batch=adds_batch(sample, ranks, path))


def declared_dims(value: onnx.ValueInfoProto) -> list[int | str | None] | None:
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


def _elem_type(dtype: str) -> int:
    """The ONNX element type of a numpy dtype name (inverse of :func:`np_dtype_name`)."""
    for elem in onnx.TensorProto.DataType.values():
        try:
            if onnx.helper.tensor_dtype_to_np_dtype(elem).name == dtype:
                return int(elem)
        except (KeyError, TypeError):
            continue
    raise ModelError(f"no ONNX element type for numpy dtype {dtype!r}")


def fix_input_shapes(
    values: Sequence[onnx.ValueInfoProto],
    path: Path,
    shapes: Mapping[str, Sequence[int]],
    sample: Mapping[str, np.ndarray] | None,
) -> dict[str, tuple[int, ...]]:
    """Fix every input dimension: --shape, else the sample's request, else batch 1 / error.

    ``sample`` is one request (:func:`sample_request`), not the file's arrays.
    """
    names = [v.name for v in values]
    for name in shapes:
        if name not in names:
            raise UsageError(
                f"--shape names {name!r}, which is not an input of {path}; "
                f"its inputs are {', '.join(names)}"
            )
    fixed: dict[str, tuple[int, ...]] = {}
    for value in values:
        if not value.type.HasField("tensor_type"):
            raise ModelError(
                f"input {value.name!r} of {path} is not a tensor; only tensors are supported"
            )
        dims = declared_dims(value)
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
            row = np.asarray(sample[value.name])
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


def first_request(row: np.ndarray, info: TensorInfo) -> np.ndarray:
    """A sample request's row in the input's dtype (same kind only)."""
    row = np.asarray(row)
    try:
        return row.astype(info.dtype, casting="same_kind", copy=False)
    except TypeError as exc:
        raise InputError(
            f"sample array {info.name!r} holds {row.dtype}; the model input is {info.dtype}"
        ) from exc


def representative_inputs_for(
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


def _forget_declared_shapes(graph: onnx.GraphProto) -> None:
    """Drop the declared shapes of outputs and intermediates (inputs keep theirs).

    Exporters and hand edits get them wrong; inference recomputes them from the inputs.
    """
    for i, value in enumerate(graph.output):
        if value.type.HasField("tensor_type"):
            elem = value.type.tensor_type.elem_type
            graph.output[i].CopyFrom(onnx.helper.make_tensor_value_info(value.name, elem, None))
    del graph.value_info[:]


def _infer(model: onnx.ModelProto, path: Path) -> onnx.ModelProto:
    try:
        return onnx.shape_inference.infer_shapes(
            model, check_type=False, strict_mode=False, data_prop=True
        )
    except (onnx.shape_inference.InferenceError, onnx.checker.ValidationError) as exc:
        raise ModelError(f"shape inference failed on {path}: {first_line(exc)}") from exc


def static_model(
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
    _forget_declared_shapes(graph)
    inferred = _infer(model, path)
    _keep_bodies(inferred.graph, graph)
    return inferred


def _keep_bodies(inferred: onnx.GraphProto, source: onnx.GraphProto) -> None:
    """Put the source's control-flow bodies back in place of the inferred ones.

    See [Note: shapes that follow a branch]: inference annotates both branches of an If
    with shapes for the fixed inputs, and ONNX Runtime then checks the branch the input
    never takes against them. Only top-level shapes are kept.
    """
    for node, original in zip(inferred.node, source.node, strict=True):
        bodies = (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
        if any(a.type in bodies for a in node.attribute):
            del node.attribute[:]
            node.attribute.extend(original.attribute)


# [Note: shapes that follow a branch]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Fixing the inputs' shapes fixes most tensors' shapes, but not those an If chooses: its
# branches may make outputs of different shapes, even ranks (an audio model unsqueezes
# its input once at 16 kHz and twice at 8 kHz; the sample rate is an input, not a shape).
# Shape inference then leaves the If's output unknown, and running the model measures
# only the branch the sample took. Declaring that measured shape (in value_info, or as a
# segment's input) would make ONNX Runtime check the other branch against it and refuse
# the model ("LSTM: first input tensor must have rank 3"). So such tensors, and what
# inference cannot shape downstream of them, keep no declared shape and no cut carries
# them: :func:`branch_shaped` finds them.

_CONTROL_FLOW = frozenset({"If", "Loop", "Scan"})


def branch_shaped(model: onnx.ModelProto) -> set[str]:
    """Tensors whose shape depends on the branch a control-flow node takes.

    Outputs of If/Loop/Scan that shape inference could not shape, and every tensor
    inference could not shape that is computed from one. See [Note: shapes that follow a
    branch]. ``model`` is the output of :func:`static_model`.
    """
    infos = _inferred_infos(model)
    varying: set[str] = set()
    for node in model.graph.node:
        control = node.domain in ("", "ai.onnx") and node.op_type in _CONTROL_FLOW
        if control or any(name in varying for name in node_uses(node)):
            varying.update(n for n in node.output if n and infos.get(n) is None)
    return varying


# [Note: shapes a branch reads]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# ONNX Runtime type-checks both branches of an If when it loads a model, and from its
# "basic" level on folds what it can inside them: the Shape of a static tensor becomes a
# constant, an If on a constant becomes the branch it picks. Fixing the inputs' shapes
# from the sample makes the branch the sample takes static, and the branch it never takes
# too, at a shape that branch was not made for. A streaming VAD whose whole network sits
# in an If on the sample rate fails so: given the 16 kHz frame (576 samples), its 8 kHz
# branch keeps two time steps where it expects one, the squeeze of the last step (an If
# on the step count, as torch exports it) folds to nothing, and the LSTM meets a rank-4
# input ("First input tensor must have rank 3"), though the model as shipped loads. So
# every tensor a control-flow node reads (its inputs and what its bodies read from outer
# scope) and every tensor those are computed from is declared as the model shipped it:
# graph inputs as the file declares them, other tensors as inference gives them from
# those, with the rank kept and a dimension unknown where that differs from the measured
# one (:func:`branch_reads`, :func:`shipped_values`). ONNX Runtime then sees in the
# branches what it sees in the shipped model. Shape/Size of these tensors is not folded to
# a constant either (:func:`fold_shapes`): the constant would carry the fixed shape into
# the branches as data. Their static shapes still price cuts and size the features sent
# (``ModelGraph.tensors``); a segment only accepts inputs of other sizes, as the model did.


def branch_reads(model: onnx.ModelProto) -> set[str]:
    """Top-level tensors a control-flow node reads, and every tensor they are computed from.

    See [Note: shapes a branch reads]. Names of initializers are included; only tensors
    the graph declares are redeclared.
    """
    graph = model.graph
    producer = {name: node for node in graph.node for name in node.output if name}
    pending = [
        name
        for node in graph.node
        if node.domain in ("", "ai.onnx") and node.op_type in _CONTROL_FLOW
        for name in node_uses(node)
    ]
    reads: set[str] = set()
    while pending:
        name = pending.pop()
        if name in reads:
            continue
        reads.add(name)
        node = producer.get(name)
        if node is not None:
            pending.extend(node_uses(node))
    return reads


def shipped_values(
    model: onnx.ModelProto, names: Collection[str], path: Path
) -> dict[str, onnx.ValueInfoProto]:
    """How the model as shipped declares ``names``: inputs as given, the rest inferred.

    Call it before :func:`static_model` fixes the inputs; like it, it drops the declared
    shapes of outputs and intermediates first. A name inference cannot type is left out.
    See [Note: shapes a branch reads].
    """
    if not names:
        return {}
    graph = model.graph
    values = {v.name: v for v in graph.input if v.name in names}
    if set(names) - set(values) - {t.name for t in graph.initializer}:
        _forget_declared_shapes(graph)
        inferred = _infer(model, path).graph
        for value in (*inferred.value_info, *inferred.output):
            if value.name in names and value.name not in values:
                values[value.name] = value
    copies = {}
    for name, value in values.items():
        copies[name] = onnx.ValueInfoProto()
        copies[name].CopyFrom(value)
    return copies


def _as_shipped(info: TensorInfo, shipped: onnx.ValueInfoProto | None) -> onnx.ValueInfoProto:
    """``info``'s declaration with the dimensions the shipped model leaves open left open.

    A shipped dimension is kept where it is symbolic or equals the measured one; any other
    (or every one, when the shipped rank differs or is unknown) is declared unknown.
    """
    declared = None
    if shipped is not None and shipped.type.HasField("tensor_type"):
        declared = declared_dims(shipped)
    dims: list[int | str | None] = [None] * len(info.shape)
    if declared is not None and len(declared) == len(info.shape):
        dims = [
            d if isinstance(d, str) or d == measured else None
            for d, measured in zip(declared, info.shape, strict=True)
        ]
    return onnx.helper.make_tensor_value_info(info.name, _elem_type(info.dtype), dims)


def _inferred_infos(model: onnx.ModelProto) -> dict[str, TensorInfo | None]:
    """Static tensor infos from inference; None where type or shape is not fully known."""
    infos: dict[str, TensorInfo | None] = {}
    graph = model.graph
    for value in (*graph.input, *graph.value_info, *graph.output):
        tensor_type = value.type.tensor_type
        dims = declared_dims(value) if value.type.HasField("tensor_type") else None
        if dims is None or not tensor_type.elem_type or not all(isinstance(d, int) for d in dims):
            infos.setdefault(value.name, None)
            continue
        dtype = np_dtype_name(tensor_type.elem_type)
        infos[value.name] = TensorInfo(value.name, dtype, tuple(int(d) for d in dims))  # type: ignore[arg-type]
    return infos


def _measure(
    model: onnx.ModelProto, names: Sequence[str], feeds: Mapping[str, np.ndarray], path: Path
) -> dict[str, TensorInfo]:
    """Run the model once in ONNX Runtime with every listed tensor as an extra output.

    Returns the dtype and shape each one actually had. Graph optimizations are off so
    every intermediate exists as the graph names it.
    """
    from tierflow.onnxrt.inference import open_session
    from tierflow.partitioner.weights import session_source

    graph = model.graph
    declared = {v.name for v in graph.output}
    extra = [n for n in names if n not in declared]
    original = len(graph.output)
    graph.output.extend(onnx.ValueInfoProto(name=n) for n in extra)
    try:
        data, folder = session_source(model)
    finally:
        del graph.output[original:]
    session = open_session(
        data, threads=0, optimization="disabled", what=str(path), weights_folder=folder
    )
    try:
        wanted = [o.name for o in session.get_outputs()]
        values = session.run(wanted, dict(feeds))
    except Exception as exc:  # onnxruntime raises its own exception types
        raise ModelError(f"ONNX Runtime cannot run {path}: {first_line(exc)}") from exc
    measured: dict[str, TensorInfo] = {}
    for name, value in zip(wanted, values, strict=True):
        if isinstance(value, np.ndarray):
            measured[name] = TensorInfo(name, value.dtype.name, tuple(int(d) for d in value.shape))
    return measured


def _made_up_integers(inputs: Sequence[TensorInfo], sample_row: object) -> str:
    """A hint naming the integer inputs filled with 0 or 1 when no sample was given."""
    names = [i.name for i in inputs if np.dtype(i.dtype).kind in "iu"]
    if sample_row is not None or not names:
        return ""
    return (
        f"; without --sample, integer input(s) {', '.join(map(repr, names))} were filled "
        "with 0 or 1, which this model may not accept: give real inputs with --sample IN.npz"
    )


def static_infos(
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
        feeds = representative_inputs_for(inputs, sample_row, seed=0)
        try:
            measured = _measure(model, produced, feeds, path)
        except ModelError as exc:
            raise ModelError(f"{exc}{_made_up_integers(inputs, sample_row)}") from exc
        for name, info in measured.items():
            if infos.get(name) not in (None, info):
                logger.debug("[graph] %s: inferred %s, measured %s", name, infos[name], info)
            infos[name] = info
    return infos


def fold_shapes(
    model: onnx.ModelProto, infos: Mapping[str, TensorInfo], keep: Collection[str] = ()
) -> int:
    """Replace Shape/Size of statically shaped tensors by Constant nodes; return how many.

    See [Note: cut sets]: at fixed input shapes these are constants. A Shape/Size whose
    output is in ``keep`` (:func:`branch_reads`) stays: see [Note: shapes a branch reads].
    """
    folded = 0
    graph = model.graph
    for i, node in enumerate(graph.node):
        if node.domain not in ("", "ai.onnx") or node.op_type not in ("Shape", "Size"):
            continue
        if node.output[0] in keep:
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


def write_value_infos(
    model: onnx.ModelProto,
    infos: Mapping[str, TensorInfo],
    input_names: set[str],
    branch_shaped: Collection[str] = (),
    shipped: Mapping[str, onnx.ValueInfoProto] | None = None,
) -> None:
    """Record the static shapes in the model so extracted segments declare them.

    ``branch_shaped`` tensors are left undeclared ([Note: shapes that follow a branch]);
    inputs, outputs and intermediates named in ``shipped`` (:func:`shipped_values`) are
    declared as the model shipped them ([Note: shapes a branch reads]).
    """
    graph = model.graph
    shipped = shipped or {}

    def value_info(info: TensorInfo) -> onnx.ValueInfoProto:
        if info.name in shipped:
            return _as_shipped(info, shipped[info.name])
        return onnx.helper.make_tensor_value_info(
            info.name, _elem_type(info.dtype), list(info.shape)
        )

    for i, value in enumerate(graph.input):
        if value.name in shipped and value.name in infos:
            graph.input[i].CopyFrom(value_info(infos[value.name]))
    output_names = {v.name for v in graph.output}
    for i, value in enumerate(graph.output):
        graph.output[i].CopyFrom(value_info(infos[value.name]))
    del graph.value_info[:]
    graph.value_info.extend(
        value_info(infos[n])
        for node in graph.node
        for n in node.output
        if n
        and n in infos
        and n not in output_names
        and n not in input_names
        and n not in branch_shaped
    )
