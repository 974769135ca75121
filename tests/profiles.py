"""Profiles made from given numbers, for tests whose planner choice must not depend on load.

A profile measured here changes with whatever else the machine runs, and with it the
plan; tests that check what the planner does with given figures build them here instead
(as ``tests/partitioner/conftest.py``'s ``make_profile`` does for graph-free problems).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from tierflow.codec.base import PLANNER_CODECS, CodecStats
from tierflow.partitioner.graph import ModelGraph
from tierflow.partitioner.profile import CutProfile, MachineInfo, Profile, UnitProfile

# Every --codec auto candidate, for profiles of a real graph: with all of them in the
# profile the planner measures none itself (ensure_codecs), so its choice is these numbers'.
# codec -> (ratio, encode s/MB, decode s/MB), of the order of this machine's: lossy ones
# send fewer bytes for more encoding.
PLANNER_CODEC_FIGURES: Mapping[str, tuple[float, float, float]] = {
    "raw": (1.0, 0.0005, 0.0005),
    "zstd": (1.1, 0.004, 0.002),
    "shuffle+zstd": (1.2, 0.006, 0.003),
    "sparse+zstd": (1.1, 0.005, 0.003),
    "sparse+shuffle+zstd": (1.2, 0.007, 0.004),
    "drop+sparse+zstd": (1.2, 0.01, 0.006),
    "fp16": (2.0, 0.002, 0.002),
    "fp16+zstd": (2.2, 0.005, 0.003),
    "int8": (4.0, 0.004, 0.002),
    "int8+zstd": (4.4, 0.007, 0.003),
    "int8c+zstd": (4.3, 0.008, 0.004),
    "int4+zstd": (8.0, 0.01, 0.005),
    "int2+zstd": (16.0, 0.01, 0.005),
    "sparse+int8+zstd": (4.4, 0.01, 0.005),
    "sparse+int4+zstd": (8.5, 0.012, 0.006),
}


def graph_profile(
    graph: ModelGraph,
    unit_s: Sequence[float],
    *,
    overhead_s: float = 1e-5,
    codecs: Mapping[str, tuple[float, float, float]] = PLANNER_CODEC_FIGURES,
    ratios: Mapping[str, float] | None = None,
    slowdown: float = 1.0,
) -> Profile:
    """A profile of ``graph`` with these times: its cuts and bytes, nothing measured.

    What the planner then chooses follows from the numbers given, never from this
    machine's load; planning with it still analyses, splits and runs the real model.
    ``ratios`` replace some codecs' ratios at every cut (a per-channel codec on a tensor
    of one value per channel sends more than raw, say).
    """
    codecs = {
        name: (ratios.get(name, ratio) if ratios else ratio, enc, dec)
        for name, (ratio, enc, dec) in codecs.items()
    }
    assert len(unit_s) == len(graph.cuts) - 1, f"{len(graph.cuts) - 1} units"
    assert set(PLANNER_CODECS) <= set(codecs), "give figures for every planner codec"
    machine = MachineInfo("synthetic", "none", 1, 1, slowdown, slowdown != 1.0, "0")
    cuts = tuple(
        CutProfile(
            index=cut.index,
            position=cut.position,
            tensors=tuple(cut.tensors),
            nbytes=cut.nbytes,
            codecs={
                name: CodecStats(name, ratio, enc, dec, 0.0)
                for name, (ratio, enc, dec) in codecs.items()
            },
        )
        for cut in graph.cuts
    )
    units = tuple(UnitProfile(i, float(s), 0, 0) for i, s in enumerate(unit_s))
    return Profile(machine, Path(graph.path).name, graph.sha256, cuts, units, overhead_s)
