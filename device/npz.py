"""``IN.npz`` to requests and results to ``OUT.npz`` (docs/design.md, "Command line").

``IN.npz`` holds one array per model input with a leading request axis: request ``i``
uses ``a[i]``, read by :mod:`tierflow.npz` exactly as ``plan --sample`` reads it
([Note: request rows]). When a batch dimension of 1 was added to the rows, the outputs lose it
again, so that ``OUT.npz`` holds the model outputs the same way: ``out[name][i]`` is
request ``i``'s.

When an early exit answered a request and the model has a single output, the exit's
class scores stand in for it (the report says which exit answered). A failed request's
rows are NaN (0 for integer outputs); the report holds its error.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from tierflow.device.client import Result
from tierflow.errors import UsageError
from tierflow.npz import read_requests
from tierflow.onnxrt.inference import open_session
from tierflow.plan import Plan


def input_ranks(
    plan: Plan, plan_dir: str | Path, known: Mapping[str, int] | None = None
) -> dict[str, int]:
    """The rank each model input has in the first segment that reads it.

    ``known`` ranks (from sessions the caller already holds) spare loading a segment. An
    input read first by a segment file this device does not hold (it runs no segment, and
    fetches only its own: [Note: segments on demand] in ``tierflow.runtime.segment_store``) is left
    out: its rank is unknown, and its rows are taken as they are.
    """
    ranks: dict[str, int] = dict(known or {})
    for spec in plan.segments:
        wanted = [name for name in spec.inputs if name in plan.inputs and name not in ranks]
        if not wanted:
            continue
        path = Path(plan_dir) / spec.file
        if not path.exists():
            continue
        session = open_session(path, what=f"segment {path}")
        shapes = {arg.name: len(arg.shape) for arg in session.get_inputs()}
        for name in wanted:
            ranks[name] = shapes[name]
    return ranks


def load_requests(
    path: str | Path,
    plan: Plan,
    plan_dir: str | Path,
    known_ranks: Mapping[str, int] | None = None,
) -> tuple[list[dict[str, np.ndarray]], bool]:
    """The requests in ``IN.npz``, and whether a batch dimension of 1 was added.

    Read as ``plan --sample`` reads it (:mod:`tierflow.npz`, [Note: request rows]).
    """
    ranks = input_ranks(plan, plan_dir, known_ranks)
    return read_requests(path, {name: ranks.get(name) for name in plan.inputs})


def output_row(result: Result, plan: Plan, *, batch_added: bool) -> dict[str, np.ndarray]:
    """What ``OUT.npz`` holds for one request (empty when it failed)."""
    outputs = dict(result.outputs)
    if result.exit and len(plan.outputs) == 1 and plan.outputs[0] not in outputs:
        outputs[plan.outputs[0]] = outputs.pop(result.exit)
    if batch_added:
        outputs = {n: a[0] if a.ndim and a.shape[0] == 1 else a for n, a in outputs.items()}
    return outputs


def save_outputs(
    path: str | Path,
    results: Sequence[Result],
    plan: Plan,
    *,
    batch_added: bool,
    plan_dir: str | Path | None = None,
) -> list[str]:
    """Write ``OUT.npz``; return the names written (see :func:`write_outputs`)."""
    rows = [output_row(result, plan, batch_added=batch_added) for result in results]
    return write_outputs(path, rows, plan, batch_added=batch_added, plan_dir=plan_dir)


def write_outputs(
    path: str | Path,
    rows: Sequence[Mapping[str, np.ndarray]],
    plan: Plan,
    *,
    batch_added: bool,
    plan_dir: str | Path | None = None,
) -> list[str]:
    """Write ``OUT.npz`` from one :func:`output_row` per request; return the names written.

    With ``plan_dir``, a model output that no request answered (all failed) is still
    written, all NaN, its shape read from the segment that makes it.
    """
    names = sorted({name for row in rows for name in row})
    templates: dict[str, np.ndarray] = {}
    if plan_dir is not None:
        missing = [name for name in plan.outputs if name not in names]
        templates = _output_templates(plan, plan_dir, missing, batch_added=batch_added)
        names = sorted({*names, *templates})
    stacked: dict[str, np.ndarray] = {}
    for name in names:
        present = [row[name] for row in rows if name in row]
        shapes = {a.shape for a in present}
        if len(shapes) > 1:
            raise UsageError(f"output {name!r} has different shapes across requests: {shapes}")
        template = present[0] if present else templates[name]
        fill = np.nan if template.dtype.kind in "fc" else 0
        stacked[name] = np.stack(
            [row[name] if name in row else np.full_like(template, fill) for row in rows]
        )
    np.savez(path, **stacked)  # type: ignore[arg-type]
    return names


_ORT_TYPES = {
    "tensor(float)": np.float32,
    "tensor(double)": np.float64,
    "tensor(float16)": np.float16,
    "tensor(int64)": np.int64,
    "tensor(int32)": np.int32,
    "tensor(int8)": np.int8,
    "tensor(uint8)": np.uint8,
    "tensor(bool)": np.bool_,
}


def _output_templates(
    plan: Plan, plan_dir: str | Path, names: Sequence[str], *, batch_added: bool
) -> dict[str, np.ndarray]:
    """An empty row for each of ``names``, shaped as the segment making it declares."""
    templates: dict[str, np.ndarray] = {}
    for spec in reversed(plan.segments):
        wanted = [name for name in names if name in spec.outputs and name not in templates]
        if not wanted:
            continue
        path = Path(plan_dir) / spec.file
        if not path.exists():  # not held here ([Note: segments on demand]): no template
            continue
        session = open_session(path, what=f"segment {path}")
        declared = {arg.name: arg for arg in session.get_outputs()}
        for name in wanted:
            shape = [d if isinstance(d, int) and d >= 0 else 1 for d in declared[name].shape]
            if batch_added and shape and shape[0] == 1:
                shape = shape[1:]
            dtype = _ORT_TYPES.get(declared[name].type, np.float32)
            templates[name] = np.zeros(shape, dtype=dtype)
    return templates
