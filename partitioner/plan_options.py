"""What the planner is asked: the user's options, parsed once, and the kinds of model it plans.

:class:`PlanOptions` is ``tierflow plan``'s flags as one typed value (parsed in
:mod:`.commands`); everything inward (:mod:`.ranking`, :mod:`.plan_writing`,
:mod:`.planner`, :mod:`.plan_sets`) takes it, never the text again.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from tierflow.codec.base import ImageNorm
from tierflow.link.spec import LinkSpec
from tierflow.partitioner.cost import ExitPoint, Problem
from tierflow.partitioner.decoder_graph import DecoderGraph
from tierflow.partitioner.fidelity import EXACT, FidelityBudget
from tierflow.partitioner.graph import ModelGraph
from tierflow.partitioner.profile import Profile

DEFAULT_LINKS: dict[str, str] = {"device-edge": "20mbit,10ms", "edge-cloud": "200mbit,30ms"}


@dataclass(frozen=True)
class PlanOptions:
    """What the user asked for, parsed and checked (see ``tierflow plan --help``)."""

    links: Mapping[str, LinkSpec]
    memory: Mapping[str, int] = field(default_factory=dict)
    objective: str = "latency"
    codec: str = "auto"
    verify: bool = True
    top: int = 5
    fidelity: FidelityBudget = EXACT
    images: Mapping[str, ImageNorm] = field(default_factory=dict)

    def problem(
        self,
        profiles: Mapping[str, Profile],
        codecs: tuple[str, ...],
        exits: tuple[ExitPoint, ...] = (),
    ) -> Problem:
        """What the search scores plans against: these options with ``profiles``."""
        return Problem(
            profiles=profiles,
            links=self.links,
            memory=self.memory,
            objective=self.objective,
            codecs=codecs,
            exits=exits,
        )


#: What the planner plans: an analysed model, or a decoder analysed at its two points.
Planned = ModelGraph | DecoderGraph
