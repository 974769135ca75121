"""``tierflow plan --adaptive``: split and write every plan of a rate grid into one directory.

The choice is pure (:func:`~.grid.grid_search` over the cost tables); this module does
the rest, as :func:`~.plan_writing.write_plan` does for one plan: split the model at each
chosen plan's cuts, check each split bit for bit, and write the segments and one
``plan.json`` (format ``tierflow.plan/2``, :class:`~tierflow.plan.PlanSet`).

Plans share segment files where their cuts coincide: a segment is named after what it
computes (the model, the tensors it takes and gives, its exits), ``seg-<hash>.onnx``, so
the device-only part of two plans that cut the device at the same place is one file.
``plan.json`` records each file's sha256 and size (``tierflow.plan.save_plan_set``): a
tier started without the files fetches and checks them, and the device prices a switch
to a plan whose files it lacks by the time that fetch takes ([Note: switching with
hysteresis] in ``device/switching.py``; [Note: segments on demand] in
``tierflow/runtime/segment_store.py``). The choice of plans itself stays pure and knows no files.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tierflow.errors import UsageError
from tierflow.link.spec import LINKS, TIERS
from tierflow.partitioner.candidates import codec_candidates, ensure_codecs
from tierflow.partitioner.cost import build_tables
from tierflow.partitioner.exits.plan import exit_points, split_with_exits
from tierflow.partitioner.fidelity import FidelityScore
from tierflow.partitioner.graph import ModelGraph
from tierflow.partitioner.grid import GridChoice, RateGrid, grid_search
from tierflow.partitioner.plan_options import PlanOptions
from tierflow.partitioner.plan_writing import check_split, estimate_dict
from tierflow.partitioner.profile import Profile
from tierflow.partitioner.split import (
    Segment,
    check_plan_dir,
    remove_old_plan,
    write_segments,
)
from tierflow.plan import Plan, PlanSet, SegmentSpec, save_plan_set


@dataclass(frozen=True)
class PlanSetOutcome:
    """The written plan set, the grid choice it came from, and what was written."""

    plans: PlanSet
    plan_dir: Path
    choice: GridChoice
    segment_files: int
    segments_named: int
    verified: bool
    notes: tuple[str, ...]


def segment_file(model_sha256: str, spec: SegmentSpec) -> str:
    """The shared file name of a segment: a hash of what it computes, not of its tier."""
    key = json.dumps(
        {
            "model": model_sha256,
            "inputs": list(spec.inputs),
            "outputs": list(spec.outputs),
            "exits": [e.to_dict() for e in spec.exits],
        },
        sort_keys=True,
    )
    return f"seg-{hashlib.sha256(key.encode()).hexdigest()[:12]}.onnx"


def make_plan_set(
    graph: ModelGraph,
    profiles: Mapping[str, Profile],
    options: PlanOptions,
    grid: RateGrid,
    plan_dir: str | Path,
) -> PlanSetOutcome:
    """Choose the best plan at every grid point, split, verify and write them as one set.

    The plan for ``options.links`` is the set's default (what a tier loads with
    :func:`~tierflow.plan.load_plan`). Lossless codecs only: a lossy budget would need
    every plan measured on the sample.
    """
    if not options.fidelity.lossless_only:
        raise UsageError("--adaptive plans with lossless codecs only: drop --fidelity")
    if options.images:
        raise UsageError("--adaptive does not take --image-input yet")
    codecs = codec_candidates(options.codec, options.fidelity)
    profiles = dict(profiles)
    notes = ensure_codecs(graph, profiles, codecs)
    points, exit_notes = exit_points(graph)
    problem = options.problem(profiles, codecs, points)
    choice = grid_search(build_tables(problem), grid, options.links)
    directory = check_plan_dir(plan_dir)
    files: dict[str, Segment] = {}
    plans: list[Plan] = []
    named = 0
    for chosen, anchor in zip(choice.plans, choice.anchors, strict=True):
        segments = split_with_exits(graph, chosen)
        if options.verify:
            check_split(graph, segments, chosen.cuts)
        specs = []
        for spec, model in segments:
            spec = replace(spec, file=segment_file(graph.sha256, spec))
            files.setdefault(spec.file, (spec, model))
            specs.append(spec)
        named += len(specs)
        plans.append(_plan(graph, chosen, anchor, specs, options, profiles))
    plan_set = PlanSet(
        tuple(plans), tuple(tuple(dict(p) for p in region) for region in choice.regions)
    )
    remove_old_plan(directory)
    write_segments(files.values(), directory)
    save_plan_set(plan_set, directory)
    return PlanSetOutcome(
        plan_set,
        directory,
        choice,
        len(files),
        named,
        options.verify,
        tuple(notes + exit_notes),
    )


def _plan(
    graph: ModelGraph,
    chosen: Any,
    anchor: Mapping[str, Any],
    specs: Sequence[SegmentSpec],
    options: PlanOptions,
    profiles: Mapping[str, Profile],
) -> Plan:
    """One plan of the set, recorded with the links of its representative point."""
    estimate = estimate_dict(chosen, graph, options.objective)
    estimate["tiers"] = {t: profiles[t].machine.to_dict() for t in TIERS}
    fidelity = {}
    if options.verify:
        estimate["verified"] = {"bitwise_equal": True, "inputs": 1, "max_abs_diff": 0.0}
        fidelity = FidelityScore("exact", 1.0, 1, True, str(options.fidelity)).to_dict()
    return Plan(
        model_file=Path(graph.path).name,
        model_sha256=graph.sha256,
        inputs=tuple(i.name for i in graph.travelling_inputs),
        outputs=tuple(o.name for o in graph.answered_outputs),
        segments=tuple(specs),
        links=dict(anchor),
        codec={name: chosen.links[name].codec for name in LINKS},
        estimate=estimate,
        cuts=tuple(graph.cuts[c].position for c in chosen.cuts),
        fidelity=fidelity,
        state_pairs=tuple((s.input, s.output) for s in graph.state),
    )
