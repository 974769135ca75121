"""Weights in external data files: checked, hashed, run and written where they lie.

See [Note: weights stay on disk].

[Note: weights stay on disk]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Weights are nearly all of a model's bytes (Qwen2-0.5B: 2.5 GB of fp32 in
``model.onnx_data`` beside a graph of a few MB), and a protobuf message cannot pass 2 GB,
so planning never loads them into the ModelProto. :func:`anchor` keeps each external
tensor a reference (location, offset, length), checked against its file (there, long
enough) and with its location made absolute, so every proto cut from the model (a unit,
a segment, the decode point's copy) still says where its bytes lie wherever it goes, and
copying one costs its graph only. What needs the bytes reads them from there:

* ONNX Runtime, through :func:`session_source`: a copy of the graph with the locations
  relative to their folder again, and that folder as the session's
  ``session.model_external_initializers_file_folder_path`` (a model from bytes may not
  name an absolute path);
* the onnx checker, through :func:`check_graph`, on the graph without its weights (each
  external tensor a declared input of its type and shape): the in-memory checker would
  look for the files beside the working directory and refuses absolute locations;
* a written segment, through :func:`save_model`: its own tensors copied, a tensor at a
  time, into ``<file>.data`` beside it (the plan's segments are self-contained and a tier
  fetches both files), locations relative to the segment.

A model whose weights are inside its file (under 2 GB) and larger than
:data:`SPILL_BYTES` has them written to a temporary data file as it is read
(:func:`spill`), and goes on as one with external data: without it the prefill and the
decode analyses and the shipped graph each held a copy (8.4 GB of memory to plan 0.95 GB of
weights). Its segments keep their weights in ``<file>.data`` too.

Small tensors the exporter kept inside the graph (shapes, the rotary tables' inputs) stay
there, so shape inference and folding see their values as before.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import onnx
import onnx.checker
import onnx.external_data_helper
import onnx.helper

from tierflow.errors import ModelError, PlanError
from tierflow.partitioner.tensors import all_tensors, first_line
from tierflow.units import format_size

#: The session option that tells ONNX Runtime where a model from bytes keeps its weights.
FOLDER_KEY = "session.model_external_initializers_file_folder_path"
#: Bytes read at a time when hashing or copying weights.
_CHUNK = 16 << 20
# Protobuf cannot serialize one message over 2 GiB; a segment over it keeps its weights out.
PROTOBUF_LIMIT = 2**31 - 1


def external_tensors(model: onnx.ModelProto) -> Iterator[onnx.TensorProto]:
    """Every tensor of the model (subgraphs and Constant nodes too) kept in a data file."""
    for tensor in all_tensors(model.graph):
        if onnx.external_data_helper.uses_external_data(tensor):
            yield tensor


def _fields(tensor: onnx.TensorProto) -> dict[str, str]:
    return {entry.key: entry.value for entry in tensor.external_data}


def _set_location(tensor: onnx.TensorProto, location: str) -> None:
    for entry in tensor.external_data:
        if entry.key == "location":
            entry.value = location


def anchor(model: onnx.ModelProto, path: Path) -> list[Path]:
    """Check the model's external tensors against their files; make their locations absolute.

    Returns the data files in sorted location order. A location outside the model's
    directory, a file that is missing, or one too short for a tensor's offset and length
    is a ModelError that names the file ([Note: weights stay on disk]).
    """
    files: dict[str, Path] = {}
    sizes: dict[Path, int] = {}
    for tensor in external_tensors(model):
        fields = _fields(tensor)
        location = fields.get("location", "")
        if not location or Path(location).is_absolute() or ".." in Path(location).parts:
            raise ModelError(
                f"{path} names external data {location!r} outside its directory; "
                "expected a file name beside the model"
            )
        data_path = files.get(location)
        if data_path is None:
            data_path = (path.parent / location).resolve()
            try:
                sizes[data_path] = data_path.stat().st_size
            except OSError as exc:
                raise ModelError(
                    f"{path} keeps its weights in external data file {location!r}, which cannot be "
                    "read: "
                    f"{exc.strerror or exc}"
                ) from exc
            files[location] = data_path
        try:
            offset = int(fields.get("offset", "0"))
            length = int(fields["length"]) if "length" in fields else None
        except ValueError as exc:
            raise ModelError(f"{path}: tensor {tensor.name!r} has a malformed offset") from exc
        end = offset + (length if length is not None else 0)
        if end > sizes[data_path] or (length is None and offset > sizes[data_path]):
            raise ModelError(
                f"{path}: {location!r} is truncated: {sizes[data_path]} bytes, but tensor "
                f"{tensor.name!r} lies at {offset}..{end}"
            )
        _set_location(tensor, str(data_path))
    return [files[location] for location in sorted(files)]


def weight_files_digest(files: list[Path], digest: hashlib._Hash, root: Path) -> None:
    """Add each data file, its location first, to ``digest`` (read in chunks, not whole)."""
    for data_path in files:
        location = os.path.relpath(data_path, root)
        digest.update(b"\0" + location.encode() + b"\0")
        try:
            with data_path.open("rb") as handle:
                while chunk := handle.read(_CHUNK):
                    digest.update(chunk)
        except OSError as exc:
            raise ModelError(f"cannot read weights file {data_path}: {exc}") from exc


def has_external(model: onnx.ModelProto) -> bool:
    return next(external_tensors(model), None) is not None


def session_source(model: onnx.ModelProto) -> tuple[bytes, str | None]:
    """The bytes ONNX Runtime loads ``model`` from, and the folder of its weights (or None)."""
    if not has_external(model):
        return model.SerializeToString(), None
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    folders = set()
    for tensor in external_tensors(copy):
        location = Path(_fields(tensor)["location"])
        folders.add(location.parent)
    folder = Path(os.path.commonpath([str(f) for f in folders]))
    for tensor in external_tensors(copy):
        _set_location(tensor, os.path.relpath(_fields(tensor)["location"], folder))
    return copy.SerializeToString(), str(folder)


def check_graph(model: onnx.ModelProto) -> None:
    """The onnx checker on ``model``, its external weights declared as inputs instead.

    Raises onnx.checker.ValidationError as the checker does.
    """
    if not has_external(model):
        onnx.checker.check_model(model)
        return
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    graph = copy.graph
    kept = [t for t in graph.initializer if not onnx.external_data_helper.uses_external_data(t)]
    moved = [t for t in graph.initializer if onnx.external_data_helper.uses_external_data(t)]
    graph.input.extend(
        onnx.helper.make_tensor_value_info(t.name, t.data_type, t.dims) for t in moved
    )
    del graph.initializer[:]
    graph.initializer.extend(kept)
    copy.ir_version = max(copy.ir_version, 4)  # initializers need not be inputs from IR 4
    for tensor in external_tensors(copy):  # in Constant nodes or subgraphs: read in
        data = _read(tensor)
        tensor.data_location = onnx.TensorProto.DEFAULT
        del tensor.external_data[:]
        tensor.raw_data = data
    onnx.checker.check_model(copy)


def _read(tensor: onnx.TensorProto) -> bytes:
    fields = _fields(tensor)
    offset = int(fields.get("offset", "0"))
    with open(fields["location"], "rb") as handle:
        handle.seek(offset)
        if "length" in fields:
            return handle.read(int(fields["length"]))
        return handle.read()


def save_model(model: onnx.ModelProto, path: Path) -> None:
    """Write ``model`` to ``path``: its external weights copied into ``<name>.data`` beside it.

    A model without external weights is written whole unless it passes protobuf's limit,
    then as onnx writes external data. Each tensor is read and written alone, so memory
    holds one tensor at a time ([Note: weights stay on disk]).
    """
    try:
        if not has_external(model):
            if model.ByteSize() > PROTOBUF_LIMIT:
                onnx.save_model(
                    model,
                    str(path),
                    save_as_external_data=True,
                    all_tensors_to_one_file=True,
                    location=path.name + ".data",
                )
            else:
                onnx.save_model(model, str(path))
            return
        copy = onnx.ModelProto()
        copy.CopyFrom(model)
        data_name = path.name + ".data"
        offset = 0
        with (path.parent / data_name).open("wb") as out:
            for tensor in external_tensors(copy):
                data = _read(tensor)
                # Each tensor starts on a 4 KiB boundary, as onnx aligns large ones.
                pad = -offset % 4096
                out.write(b"\0" * pad)
                offset += pad
                out.write(data)
                del tensor.external_data[:]
                for key, value in (
                    ("location", data_name),
                    ("offset", offset),
                    ("length", len(data)),
                ):
                    tensor.external_data.add(key=key, value=str(value))
                offset += len(data)
        onnx.save_model(copy, str(path))
    except (OSError, ValueError) as exc:
        raise PlanError(f"cannot write {path}: {first_line(exc)}") from exc


def open_model_session(model: onnx.ModelProto, **options: Any) -> Any:
    """An ONNX Runtime session on an in-memory model whose weights may lie in data files.

    ``options`` are :func:`tierflow.onnxrt.inference.open_session`'s.
    """
    from tierflow.onnxrt.inference import open_session

    data, folder = session_source(model)
    return open_session(data, weights_folder=folder, **options)


#: Planning's peak memory per byte of weights, and what it needs besides (the planner's
#: own code and libraries): what :func:`check_planning_memory` asks for. Measured
#: (benchmarks/big_model.py, [Note: weights stay on disk]) on Qwen2-0.5B's shapes with
#: 2.52 GB in external data, a peak of 4.87 GB (1.93x), and on its 12 blocks with a 32k
#: vocabulary, 0.95 GB inside the .onnx file, 2.15 GB (2.28x): reading such a file holds
#: its bytes and the parsed message at once, before they are spilled to disk.
PLANNING_MEMORY_PER_WEIGHT_BYTE = 2.0
PLANNING_MEMORY_BASE = 512 << 20
# A graph file up to this size is parsed to find its weights files; a larger one holds
# its weights itself, and its size is taken as theirs.
_GRAPH_PARSE_LIMIT = 64 << 20


def model_weight_bytes(path: Path) -> int:
    """Bytes of the model's weights: the .onnx file and the external data files it names."""
    try:
        size = path.stat().st_size
    except OSError:
        return 0  # read_model says why, in its own words
    if size > _GRAPH_PARSE_LIMIT:
        return size
    try:
        model = onnx.load_model(str(path), load_external_data=False)
    except Exception:  # not a model: read_model says so
        return size
    total = size
    for location in {_fields(t).get("location", "") for t in external_tensors(model)}:
        with contextlib.suppress(OSError, ValueError):
            total += (path.parent / location).stat().st_size
    return total


def available_memory() -> int | None:
    """Memory the kernel says a new process can use without swapping (None if it cannot say)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key == "MemAvailable":
                return int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_planning_memory(path: Path, available: int | None) -> None:
    """Refuse, in one line, to plan a model this machine has not the memory for.

    Before any work, so that planning too big a model ends in this message rather than in
    the kernel's OOM killer ([Note: weights stay on disk]).
    """
    if available is None:
        return
    weights = model_weight_bytes(path)
    needed = int(weights * PLANNING_MEMORY_PER_WEIGHT_BYTE) + PLANNING_MEMORY_BASE
    if needed > available:
        raise PlanError(
            f"planning {path} needs about {format_size(needed)} of memory (its weights are "
            f"{format_size(weights)}), but this machine has {format_size(available)} "
            "available: plan it on a machine with more, or free some"
        )


#: A model file larger than this (its weights inside it) has them written to a temporary
#: data file as it is read, and planning goes on as for external data: graph in memory,
#: weights on disk ([Note: weights stay on disk]).
SPILL_BYTES = 256 << 20
#: Tensors smaller than this stay in the graph (shapes, scalars: what folding reads).
_SPILL_MIN = 1024


def spill(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with its large inline tensors moved to a temporary data file.

    Returns a new proto holding the graph only (protobuf frees a message's bytes only with
    the message, so the caller drops the one it passed). The file is removed when the
    process exits.
    """
    directory = Path(tempfile.mkdtemp(prefix="tierflow-weights-"))
    atexit.register(shutil.rmtree, directory, True)
    data_path = directory / "weights.data"
    offset = 0
    try:
        with data_path.open("wb") as out:
            for tensor in all_tensors(model.graph):
                if (
                    onnx.external_data_helper.uses_external_data(tensor)
                    or len(tensor.raw_data) < _SPILL_MIN
                ):
                    continue
                pad = -offset % 4096
                out.write(b"\0" * pad)
                offset += pad
                length = len(tensor.raw_data)
                out.write(tensor.raw_data)
                tensor.ClearField("raw_data")
                tensor.data_location = onnx.TensorProto.EXTERNAL
                del tensor.external_data[:]
                for key, value in (
                    ("location", str(data_path)),
                    ("offset", offset),
                    ("length", length),
                ):
                    tensor.external_data.add(key=key, value=str(value))
                offset += length
    except OSError as exc:
        raise ModelError(
            f"cannot write the model's weights to a temporary file in {directory}: {exc}"
        ) from exc
    return onnx.ModelProto.FromString(model.SerializeToString())
