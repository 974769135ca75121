"""``IN.npz`` to requests and results to ``OUT.npz`` (DESIGN.md, command line contract).

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
import onnxruntime as ort

from tierflow.device.client import Result
from tierflow.errors import ModelError, UsageError
from tierflow.npz import read_requests
from tierflow.plan import Plan
from tierflow.segment_runner import session_options


def input_ranks(
    plan: Plan, plan_dir: str | Path, known: Mapping[str, int] | None = None
) -> dict[str, int]:
    """The rank each model input has in the first segment that reads it.

    ``known`` ranks (from sessions the caller already holds) spare loading a segment.
    """
    ranks: dict[str, int] = dict(known or {})
    for spec in plan.segments:
        wanted = [name for name in spec.inputs if name in plan.inputs and name not in ranks]
        if not wanted:
            continue
        path = Path(plan_dir) / spec.file
        try:
            session = ort.InferenceSession(
                str(path), session_options(1), providers=["CPUExecutionProvider"]
            )
        except Exception as exc:
            raise ModelError(f"cannot load segment {path}: {exc}") from exc
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


def save_outputs(
    path: str | Path, results: Sequence[Result], plan: Plan, *, batch_added: bool
) -> list[str]:
    """Write ``OUT.npz``; return the names written."""
    rows: list[dict[str, np.ndarray]] = []
    for result in results:
        outputs = dict(result.outputs)
        if result.exit and len(plan.outputs) == 1 and plan.outputs[0] not in outputs:
            outputs[plan.outputs[0]] = outputs.pop(result.exit)
        if batch_added:
            outputs = {n: a[0] if a.ndim and a.shape[0] == 1 else a for n, a in outputs.items()}
        rows.append(outputs)
    names = sorted({name for row in rows for name in row})
    stacked: dict[str, np.ndarray] = {}
    for name in names:
        present = [row[name] for row in rows if name in row]
        shapes = {a.shape for a in present}
        if len(shapes) != 1:
            raise UsageError(f"output {name!r} has different shapes across requests: {shapes}")
        template = present[0]
        fill = np.nan if template.dtype.kind in "fc" else 0
        stacked[name] = np.stack(
            [row[name] if name in row else np.full_like(template, fill) for row in rows]
        )
    np.savez(path, **stacked)  # type: ignore[arg-type]
    return names
