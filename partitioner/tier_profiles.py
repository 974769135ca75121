"""One profile per tier for the planner: the given ones, the rest measured here and emulated.

Profiling measures (:mod:`.profile`); this module decides what must be measured for a
plan and says so in notes for the user: a tier without a profile is profiled on this
machine once and emulated as a slower one (:data:`DEFAULT_EMULATION`), and a decoder is
profiled at both of its points and, for ``plan --sessions``, at several batch sizes of
its decode step (:class:`DecoderProfiles`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from tierflow.codec.base import PLANNER_CODECS, CodecSpec
from tierflow.errors import UsageError
from tierflow.link.spec import TIERS
from tierflow.partitioner.decoder_cost import batch_sizes
from tierflow.partitioner.decoder_graph import DecoderGraph, check_batches, load_batched_decode
from tierflow.partitioner.graph import ModelGraph
from tierflow.partitioner.profile import Profile, ProgressFn, profile_model
from tierflow.units import format_duration

# How much slower than this machine tiers without a profile are emulated to be.
DEFAULT_EMULATION: dict[str, float] = {"device": 4.0, "edge": 2.0, "cloud": 1.0}


@dataclass(frozen=True)
class DecoderProfiles:
    """A decoder's profiles: one per tier at each of its points ([Note: decoder analysis
    points] in :mod:`.decoder_points`), and with ``plan --sessions`` at each batch size
    of the decode step measured beyond 1 ([Note: pricing batched steps] in
    :mod:`.decoder_cost`)."""

    prefill: Mapping[str, Profile]
    decode: Mapping[str, Profile]
    batched: Mapping[int, Mapping[str, Profile]] = field(default_factory=dict)

    def by_batch(self, tier: str) -> dict[int, Profile]:
        """``tier``'s decode-step profile at each measured batch size, 1 included."""
        return {1: self.decode[tier], **{b: p[tier] for b, p in self.batched.items()}}

    def step_s_by_batch(self) -> dict[int, float]:
        """The whole model's decode step on this machine at each measured batch size."""
        return {
            batch: profile.emulate(1.0).segment_s(0, len(profile.units))
            for batch, profile in self.by_batch("cloud").items()
        }


#: What a plan is priced from: one profile per tier, or a decoder's at both points.
Profiles = Mapping[str, Profile] | DecoderProfiles


def complete_profiles(
    graph: ModelGraph,
    given: Mapping[str, Profile],
    *,
    emulation: Mapping[str, float] = DEFAULT_EMULATION,
    threads: int = 1,
    time_budget_s: float = 20.0,
    progress: ProgressFn | None = None,
    codecs: Sequence[str] = PLANNER_CODECS,
) -> tuple[dict[str, Profile], list[str]]:
    """One profile per tier: the given ones, the rest measured here once and emulated.

    ``codecs`` are those measured at each cut: the candidates
    (:func:`~.candidates.codec_candidates`)
    are enough, image codecs are measured apart. Returns the profiles and one note per
    tier profiled here, for the user.
    """
    for tier, profile in given.items():
        if tier not in TIERS:
            raise UsageError(f"unknown tier {tier!r}: expected one of {', '.join(TIERS)}")
        profile.check_model(graph, where=f"the {tier} profile")
    profiles = dict(given)
    missing = [t for t in TIERS if t not in profiles]
    notes: list[str] = []
    if missing:
        base = profile_model(
            graph,
            threads=threads,
            time_budget_s=time_budget_s,
            progress=progress,
            codecs=[c for c in codecs if not CodecSpec.parse(c).image],
        )
        for tier in missing:
            slowdown = emulation.get(tier, 1.0)
            profiles[tier] = base.emulate(slowdown)
            notes.append(
                f"{tier}: no profile given, profiled on this machine "
                f"({profiles[tier].machine.describe()})"
            )
    return profiles, notes


def decoder_profiles(
    graph: DecoderGraph,
    *,
    emulation: Mapping[str, float] = DEFAULT_EMULATION,
    threads: int = 1,
    time_budget_s: float = 10.0,
    progress: ProgressFn | None = None,
    codecs: Sequence[str] = ("raw",),
) -> tuple[DecoderProfiles, list[str]]:
    """:func:`complete_profiles` for a decoder: every tier profiled here at both points,
    and with ``--sessions`` the decode step at several batch sizes."""
    check_batches(graph, graph.settings.sessions or 1)
    profiles = {}
    said: list[str] = []
    for name, analysed in (("prefill", graph.prefill), ("decode", graph.decode)):
        profiles[name], lines = complete_profiles(
            analysed,
            {},
            emulation=emulation,
            threads=threads,
            time_budget_s=time_budget_s,
            progress=progress,
            codecs=codecs,
        )
        said += [line for line in lines if line not in said]
    prefill, decode = graph.points
    where = (
        f" at the prefill point (seq {prefill.seq}, past {prefill.past}) and the decode point "
        f"(seq {decode.seq}, past {decode.past})"
    )
    notes = [line + where for line in said]
    sessions = graph.settings.sessions
    batched: dict[int, dict[str, Profile]] = {}
    for batch in batch_sizes(sessions or 1)[1:]:
        batched[batch], _ = complete_profiles(
            load_batched_decode(graph, batch),
            {},
            emulation=emulation,
            threads=threads,
            time_budget_s=time_budget_s,
            progress=progress,
            codecs=codecs,
        )
    profiled = DecoderProfiles(profiles["prefill"], profiles["decode"], batched)
    if sessions is not None:
        steps = ", ".join(
            f"{batch}: {format_duration(s)}" for batch, s in profiled.step_s_by_batch().items()
        )
        notes.append(
            f"decode step profiled here at batch {', '.join(map(str, batch_sizes(sessions)))} "
            f"for {sessions} sessions (the whole model on this machine, by batch: {steps})"
        )
    return profiled, notes
