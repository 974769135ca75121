"""What a model with exits records about them: :class:`ExitInfo` in its metadata.

The model from ``tierflow exits add`` keeps every original node and output untouched;
heads are extra outputs named ``exit0_probs``, ``exit1_probs``..., recorded in the
model's ``metadata_props`` under ``tierflow.exits`` (a JSON list of :class:`ExitInfo`)
with the overall calibration figures under ``tierflow.exits.summary``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import onnx
from onnx import helper

from tierflow.cli.table import format_table
from tierflow.errors import ModelError
from tierflow.plan import ExitSpec

METADATA_KEY = "tierflow.exits"
SUMMARY_KEY = "tierflow.exits.summary"


@dataclass(frozen=True)
class ExitInfo:
    """One exit of a model: its output, the feature it reads, and its threshold.

    ``at`` is the cut tensor the head reads (empty when a declared exit's source is not a
    single tensor). ``calibration`` holds the target and the achieved figures.
    """

    name: str
    at: str
    threshold: float
    calibration: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "at": self.at,
            "threshold": self.threshold,
            "calibration": dict(self.calibration),
        }

    @classmethod
    def from_dict(cls, data: Any) -> ExitInfo:
        if not isinstance(data, dict) or not isinstance(data.get("name"), str):
            raise ModelError(f"malformed exit record: expected an object with a name, got {data!r}")
        try:
            threshold = float(data["threshold"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelError(
                f"malformed exit record {data['name']!r}: no numeric threshold"
            ) from exc
        return cls(
            name=data["name"],
            at=str(data.get("at") or ""),
            threshold=threshold,
            calibration=dict(data.get("calibration") or {}),
        )

    def to_spec(self) -> ExitSpec:
        """The plan's view of this exit.

        See [Note: exits in a plan] in :mod:`tierflow.partitioner.exits.plan`.
        """
        return ExitSpec(self.name, self.threshold, {"at": self.at, **self.calibration})

    @property
    def exit_rate(self) -> float:
        """Fraction of held-out requests that left here during calibration (0 if unknown)."""
        return float(self.calibration.get("exit_rate", 0.0))


@dataclass(frozen=True)
class ExitedModel:
    """A model with exit heads grafted on and thresholds calibrated.

    ``summary`` holds the overall achieved figures on the held-out calibration data.
    """

    model: onnx.ModelProto
    exits: tuple[ExitInfo, ...]
    summary: dict[str, Any]

    def save(self, path: str | Path) -> Path:
        """Write the model as one ONNX file (weights embedded)."""
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.tmp")
        try:
            onnx.save_model(self.model, str(tmp))
            tmp.replace(target)
        except (OSError, ValueError) as exc:
            raise ModelError(f"cannot write {target}: {exc}") from exc
        finally:
            tmp.unlink(missing_ok=True)
        return target

    def table(self) -> str:
        """The calibration figures as an aligned table for people."""
        return exits_table(self.exits, self.summary)


def read_exits(model: onnx.ModelProto | str | Path) -> list[ExitInfo]:
    """The exits recorded in a model's metadata, in order; empty if it has none."""
    proto = model if isinstance(model, onnx.ModelProto) else load_proto(model)
    for prop in proto.metadata_props:
        if prop.key == METADATA_KEY:
            try:
                records = json.loads(prop.value)
            except json.JSONDecodeError as exc:
                raise ModelError(f"malformed {METADATA_KEY} metadata: {exc}") from exc
            if not isinstance(records, list):
                raise ModelError(f"malformed {METADATA_KEY} metadata: expected a JSON list")
            return [ExitInfo.from_dict(r) for r in records]
    return []


def read_exit_summary(model: onnx.ModelProto | str | Path) -> dict[str, Any]:
    """The overall calibration figures recorded with the exits; empty if none."""
    proto = model if isinstance(model, onnx.ModelProto) else load_proto(model)
    for prop in proto.metadata_props:
        if prop.key == SUMMARY_KEY:
            try:
                summary = json.loads(prop.value)
            except json.JSONDecodeError as exc:
                raise ModelError(f"malformed {SUMMARY_KEY} metadata: {exc}") from exc
            return dict(summary) if isinstance(summary, dict) else {}
    return {}


def exits_table(exits: Sequence[ExitInfo], summary: Mapping[str, Any]) -> str:
    """Per-exit figures and the overall line as an aligned table."""
    metric = str(summary.get("metric", "disagreement"))
    header = ("exit", "at", "threshold", "exit rate", metric)
    rows = [
        (
            e.name,
            e.at or "?",
            "never" if e.threshold > 1 else f"{e.threshold:.4f}",
            f"{100 * e.exit_rate:.1f}%",
            f"{100 * float(e.calibration.get('achieved', 0.0)):.2f}%",
        )
        for e in exits
    ]
    rows.append(
        (
            "overall",
            f"target {100 * float(summary.get('target', 0.0)):.2f}%",
            "",
            f"{100 * float(summary.get('exit_rate', 0.0)):.1f}%",
            f"{100 * float(summary.get('achieved', 0.0)):.2f}%",
        )
    )
    return format_table(header, rows, align="l" * len(header), rule=False)


def write_metadata(
    model: onnx.ModelProto, exits: Sequence[ExitInfo], summary: Mapping[str, Any]
) -> None:
    """Record ``exits`` and ``summary`` in ``model``'s metadata, replacing earlier records."""
    props = {p.key: p.value for p in model.metadata_props}
    props[METADATA_KEY] = json.dumps([e.to_dict() for e in exits])
    props[SUMMARY_KEY] = json.dumps(dict(summary))
    helper.set_model_props(model, props)


def load_proto(path: str | Path) -> onnx.ModelProto:
    """Read an ONNX file; a missing or unreadable file is a :class:`ModelError`."""
    try:
        return onnx.load(str(path))
    except FileNotFoundError as exc:
        raise ModelError(f"model {path} not found") from exc
    except Exception as exc:
        raise ModelError(f"cannot read ONNX model {path}: {exc}") from exc
