"""Profile data: what one tier's machine costs for each unit of a model, as JSON.

A *unit* is the run of nodes between two consecutive candidate cuts (``cuts[i]`` to
``cuts[i + 1]``). A :class:`Profile` holds, for one machine (real or emulated), the
compute time of every unit, the fixed overhead of one session call, the bytes and codec
figures of every cut, and the memory each unit needs. The cost model (:mod:`.cost`) only
reads profiles; :mod:`tierflow.partitioner.profile` measures them (see
[Note: segment latency] there for what the numbers mean).

Profiles are JSON (``"format": "tierflow.profile/1"``) so one can be made on the real
device (``tierflow profile`` on a Raspberry Pi) and planned with elsewhere. A profile is
tied to one model: its sha256 and cut list must match the model it is used with.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tierflow.codec.base import CodecStats
from tierflow.errors import ProfileError, TierflowError
from tierflow.onnxrt.providers import CPU
from tierflow.onnxrt.providers import describe as describe_providers

if TYPE_CHECKING:
    from tierflow.partitioner.graph import ModelGraph

PROFILE_FORMAT = "tierflow.profile/1"


@dataclass(frozen=True)
class MachineInfo:
    """The machine a profile describes: where it was measured and how it was emulated."""

    hostname: str
    cpu: str
    cores: int
    threads: int
    slowdown: float
    emulated: bool
    onnxruntime: str
    # ONNX Runtime execution providers measured with; profiles older than the field say CPU.
    providers: tuple[str, ...] = (CPU,)

    def to_dict(self) -> dict[str, Any]:
        return {
            "hostname": self.hostname,
            "cpu": self.cpu,
            "cores": self.cores,
            "threads": self.threads,
            "slowdown": self.slowdown,
            "emulated": self.emulated,
            "onnxruntime": self.onnxruntime,
            "providers": list(self.providers),
        }

    @classmethod
    def from_dict(cls, data: Any) -> MachineInfo:
        try:
            return cls(
                hostname=str(data["hostname"]),
                cpu=str(data["cpu"]),
                cores=int(data["cores"]),
                threads=int(data["threads"]),
                slowdown=float(data["slowdown"]),
                emulated=bool(data["emulated"]),
                onnxruntime=str(data["onnxruntime"]),
                providers=tuple(str(p) for p in data.get("providers", [CPU])),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ProfileError(f"malformed profile machine {data!r}: {exc}") from exc

    def describe(self) -> str:
        """One line for people: ``host (cpu), 1 thread, emulated 4x slower``."""
        threads = f"{self.threads} thread{'s' if self.threads != 1 else ''}"
        how = f"emulated {self.slowdown:g}x slower" if self.emulated else "measured"
        return f"{self.hostname} ({self.cpu}), {threads}, {how}, on {self.provider_names}"

    @property
    def provider_names(self) -> str:
        """The providers as short names, like ``cuda,cpu``."""
        return describe_providers(self.providers)


@dataclass(frozen=True)
class CutProfile:
    """A candidate cut: the tensors crossing it, their raw bytes, and each codec on them."""

    index: int
    position: int
    tensors: tuple[str, ...]
    nbytes: int
    codecs: Mapping[str, CodecStats]

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "position": self.position,
            "tensors": list(self.tensors),
            "nbytes": self.nbytes,
            "codecs": {name: stats.to_dict() for name, stats in self.codecs.items()},
        }

    @classmethod
    def from_dict(cls, data: Any) -> CutProfile:
        try:
            codecs = {str(k): CodecStats.from_dict(v) for k, v in dict(data["codecs"]).items()}
            return cls(
                index=int(data["index"]),
                position=int(data["position"]),
                tensors=tuple(str(t) for t in data["tensors"]),
                nbytes=int(data["nbytes"]),
                codecs=codecs,
            )
        except (KeyError, TypeError, ValueError, TierflowError) as exc:
            raise ProfileError(f"malformed profile cut: {exc}") from exc


@dataclass(frozen=True)
class UnitProfile:
    """The nodes between cut ``index`` and cut ``index + 1``: time and memory."""

    index: int
    compute_s: float
    weight_bytes: int
    peak_activation_bytes: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "compute_s": self.compute_s,
            "weight_bytes": self.weight_bytes,
            "peak_activation_bytes": self.peak_activation_bytes,
        }

    @classmethod
    def from_dict(cls, data: Any) -> UnitProfile:
        try:
            unit = cls(
                index=int(data["index"]),
                compute_s=float(data["compute_s"]),
                weight_bytes=int(data["weight_bytes"]),
                peak_activation_bytes=int(data["peak_activation_bytes"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ProfileError(f"malformed profile unit {data!r}: {exc}") from exc
        if unit.compute_s < 0 or unit.weight_bytes < 0 or unit.peak_activation_bytes < 0:
            raise ProfileError(f"malformed profile unit {data!r}: negative figures")
        return unit


@dataclass(frozen=True)
class Profile:
    """One tier's measured costs for one model. See [Note: segment latency]."""

    machine: MachineInfo
    model_file: str
    model_sha256: str
    cuts: tuple[CutProfile, ...]
    units: tuple[UnitProfile, ...]
    overhead_s: float
    calibration: Mapping[str, Any] = field(default_factory=dict)
    output_s_per_byte: float = 0.0

    def __post_init__(self) -> None:
        if len(self.cuts) < 2:
            raise ProfileError(f"malformed profile: it needs at least 2 cuts, has {len(self.cuts)}")
        if len(self.units) != len(self.cuts) - 1:
            raise ProfileError(
                f"malformed profile: {len(self.cuts)} cuts need {len(self.cuts) - 1} units, "
                f"found {len(self.units)}"
            )
        if [c.index for c in self.cuts] != list(range(len(self.cuts))):
            raise ProfileError("malformed profile: cut indices must be 0, 1, 2, ... in order")
        if [u.index for u in self.units] != list(range(len(self.units))):
            raise ProfileError("malformed profile: unit indices must be 0, 1, 2, ... in order")
        if not self.overhead_s >= 0:
            raise ProfileError(f"malformed profile: overhead_s must be >= 0, got {self.overhead_s}")
        if not self.output_s_per_byte >= 0:
            raise ProfileError(
                f"malformed profile: output_s_per_byte must be >= 0, got {self.output_s_per_byte}"
            )
        names = {frozenset(c.codecs) for c in self.cuts}
        if len(names) != 1:
            raise ProfileError("malformed profile: every cut must list the same codecs")

    @property
    def codecs(self) -> tuple[str, ...]:
        """The codecs measured at every cut, in the order of the first cut."""
        return tuple(self.cuts[0].codecs)

    @property
    def slowdown(self) -> float:
        return self.machine.slowdown

    def segment_s(self, start: int, end: int) -> float:
        """Predicted time of cuts ``start`` to ``end`` as one session; 0 when empty."""
        if start >= end:
            return 0.0
        return (
            self.overhead_s
            + sum(u.compute_s for u in self.units[start:end])
            + self.output_s_per_byte * self.cuts[end].nbytes
        )

    def emulate(self, slowdown: float, threads: int | None = None) -> Profile:
        """This profile as seen on a machine ``slowdown`` times slower than the measured one.

        Every time scales by ``slowdown / self.slowdown``; bytes and ratios stay.
        """
        if not slowdown > 0:
            raise ProfileError(f"a slowdown must be positive, got {slowdown!r}")
        factor = slowdown / self.machine.slowdown
        cuts = tuple(
            replace(cut, codecs={name: s.slower(factor) for name, s in cut.codecs.items()})
            for cut in self.cuts
        )
        units = tuple(replace(u, compute_s=u.compute_s * factor) for u in self.units)
        machine = replace(
            self.machine,
            slowdown=slowdown,
            emulated=self.machine.emulated or slowdown != 1.0,
            threads=self.machine.threads if threads is None else threads,
        )
        return replace(
            self,
            machine=machine,
            cuts=cuts,
            units=units,
            overhead_s=self.overhead_s * factor,
            output_s_per_byte=self.output_s_per_byte * factor,
        )

    def check_model(self, graph: ModelGraph, *, where: str = "profile") -> None:
        """Raise :class:`ProfileError` unless this profile was made for ``graph``."""
        if self.model_sha256 != graph.sha256:
            raise ProfileError(
                f"{where} was made for another model: it names {self.model_file or '?'} "
                f"(sha256 {self.model_sha256[:12]}), but the model is {graph.path} "
                f"(sha256 {graph.sha256[:12]})"
            )
        ours = [(c.position, c.tensors) for c in self.cuts]
        theirs = [(c.position, tuple(c.tensors)) for c in graph.cuts]
        if ours != theirs:
            raise ProfileError(
                f"{where} was made for the same model with other cuts: it has {len(ours)} "
                f"cuts, the model {graph.path} has {len(theirs)} (another --shape?)"
            )

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": PROFILE_FORMAT,
            "machine": self.machine.to_dict(),
            "model": {"file": self.model_file, "sha256": self.model_sha256},
            "overhead_s": self.overhead_s,
            "output_s_per_byte": self.output_s_per_byte,
            "cuts": [c.to_dict() for c in self.cuts],
            "units": [u.to_dict() for u in self.units],
            "calibration": dict(self.calibration),
        }

    @classmethod
    def from_dict(cls, data: Any) -> Profile:
        if not isinstance(data, dict):
            raise ProfileError("malformed profile: expected a JSON object")
        if data.get("format") != PROFILE_FORMAT:
            raise ProfileError(
                f"unsupported profile format {data.get('format')!r}: expected {PROFILE_FORMAT!r}"
            )
        model = data.get("model")
        if not isinstance(model, dict) or not isinstance(model.get("sha256"), str):
            raise ProfileError("malformed profile: 'model' must be an object with 'sha256'")
        cuts, units = data.get("cuts"), data.get("units")
        if not isinstance(cuts, list) or not isinstance(units, list):
            raise ProfileError("malformed profile: 'cuts' and 'units' must be lists")
        try:
            overhead = float(data["overhead_s"])
            per_byte = float(data.get("output_s_per_byte", 0.0))
        except (KeyError, TypeError, ValueError) as exc:
            raise ProfileError(
                "malformed profile: 'overhead_s' and 'output_s_per_byte' must be numbers"
            ) from exc
        return cls(
            machine=MachineInfo.from_dict(data.get("machine")),
            model_file=str(model.get("file", "")),
            model_sha256=model["sha256"],
            cuts=tuple(CutProfile.from_dict(c) for c in cuts),
            units=tuple(UnitProfile.from_dict(u) for u in units),
            overhead_s=overhead,
            calibration=dict(data.get("calibration") or {}),
            output_s_per_byte=per_byte,
        )


def save_profile(profile: Profile, path: str | Path) -> Path:
    """Write ``profile`` as JSON; return the path."""
    target = Path(path)
    if target.parent != Path():
        target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(profile.to_dict(), indent=1) + "\n")
    return target


def load_profile(path: str | Path, graph: ModelGraph | None = None) -> Profile:
    """Read a profile; with ``graph``, also check it was made for that model."""
    source = Path(path)
    try:
        data = json.loads(source.read_text())
    except FileNotFoundError as exc:
        raise ProfileError(f"no profile at {source}") from exc
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProfileError(f"cannot read profile {source}: {exc}") from exc
    try:
        profile = Profile.from_dict(data)
    except ProfileError as exc:
        raise ProfileError(f"{source}: {exc}") from exc
    if graph is not None:
        profile.check_model(graph, where=f"profile {source}")
    return profile
