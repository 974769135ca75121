"""The byte decoder family on three tiers: its plans, its prompts, and measured generations.

Shared by ``tierflow demo --generate`` (:mod:`.generate`, tiers as processes) and
``python -m benchmarks.generation`` (tiers in-process, links swept): both plan the large
model and the small one the same way (:func:`plan_family`), feed the same held-out
prompts (:func:`heldout_prompts`), and measure a generation the same way
(:func:`measure`), against the large model's own greedy output computed here
(:func:`tierflow.greedy.reference_generate`).

[Note: where the byte family splits]
A decoder's request starts as token ids (8 bytes a token, 24 with ``attention_mask`` and
``position_ids``) and a cut between blocks carries a hidden state of 256 bytes a token:
no cut saves bytes. The emulated device is 20x slower than this machine, the edge 2x,
the cloud 1x. So with the device's memory bounded alone (the large model needs 3.86 MiB
with its KV cache at ``--context`` 512), the planner keeps the whole model on the edge
(one round trip over the device-edge link per token), and with the edge bounded as well
in the cloud: any plan that uses the cloud pays both links' round trips, and the cloud
computes fastest. A split over all three tiers is the planner's real choice where no tier
can hold the model: here every tier has :data:`MEMORY_BUDGET` for one session (a phone
app's share; an edge box and a cloud server serving many sessions give each a slice),
so the planner spreads the blocks, each tier keeping its blocks' KV cache, and pays in
hidden states on both links and in compute; the round trips are those cloud-only pays.
Cloud-only is then over the cloud's budget: it is the comparison with a cloud that holds
the whole model. The small model (two blocks, about 1 MiB with its KV cache) fits the
device: device-only runs it, and it drafts for the split ([Note: speculation] in
device/speculation.py).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tierflow.errors import PlanError
from tierflow.link.spec import LINKS, TIERS, LinkSpec
from tierflow.units import parse_size

#: How the generation demo emulates its tiers on one machine, as ``tierflow demo``'s
#: ``EMULATION``: ONNX Runtime threads, and how many times slower than this machine each
#: tier runs. A phone-class device (20x one core here), an edge box on site (2x), a cloud
#: core. (The digits demo's device is slower: see [Note: the demo's margin].)
EMULATION: dict[str, tuple[int, float]] = {
    "device": (1, 20.0),
    "edge": (1, 2.0),
    "cloud": (1, 1.0),
}
#: Wi-Fi to an edge 30 ms away (a real round trip, so that round trips are what a token
#: costs), and the demo's metro link on to the cloud.
DEFAULT_LINKS: dict[str, str] = {"device-edge": "20mbit,30ms", "edge-cloud": "200mbit,20ms"}
#: Each tier's memory for one session ([Note: where the byte family splits]).
MEMORY_BUDGET = parse_size("2MiB")
CONTEXT = 512
MAX_TOKENS = 64
PROMPT_BYTES = 64
#: The strategies, in the order tables list them.
STRATEGIES = ("cloud-only", "device-only", "split", "split+draft")
#: Which family member each strategy runs (the split's draft is the small one).
MODEL_OF = {"cloud-only": "large", "device-only": "small", "split": "large", "split+draft": "large"}


def budgets() -> dict[str, int]:
    return dict.fromkeys(TIERS, MEMORY_BUDGET)


def heldout_prompts(count: int, length: int = PROMPT_BYTES) -> list[list[int]]:
    """``count`` prompts of ``length`` bytes: top-level ``def`` lines of the held-out
    standard-library files (never trained on), spread evenly, the first one first."""
    from tierflow.zoo.byte_corpus import load_corpus

    heldout = load_corpus().heldout
    starts = [m.start() + 1 for m in re.finditer(rb"\ndef ", heldout)]
    if len(starts) < count:
        raise PlanError(f"the held-out files hold {len(starts)} functions, {count} asked for")
    chosen = np.linspace(0, len(starts) - 1, count).astype(int) if count > 1 else [0]
    return [list(heldout[starts[i] : starts[i] + length]) for i in chosen]


@dataclass(frozen=True)
class FamilyPlans:
    """The three plans the strategies run, and the rankings they came from."""

    split: Path
    cloud_only: Path
    device_only: Path
    large: Any  # SearchResult[DecoderEstimate] of the large model
    small: Any  # SearchResult[DecoderEstimate] of the small model
    budgets: Mapping[str, int]
    #: The large model's blocks (KV layers) by cut-search unit (DecoderGraph.unit_blocks),
    #: so its plan table says which blocks each tier holds, as ``tierflow plan`` does.
    large_blocks: Sequence[Sequence[int]] = ()

    def plan_dir(self, strategy: str) -> Path:
        return {
            "cloud-only": self.cloud_only,
            "device-only": self.device_only,
            "split": self.split,
            "split+draft": self.split,
        }[strategy]

    def estimate(self, strategy: str) -> Any:
        """The planner's DecoderEstimate of the plan ``strategy`` runs."""
        if strategy == "device-only":
            return self.small.baselines["device-only"]
        if strategy == "cloud-only":
            return self.large.baselines["cloud-only"]
        return self.large.best


def plan_family(
    family: Any,
    links: Mapping[str, LinkSpec],
    workdir: Path,
    *,
    memory: Mapping[str, int] | None = None,
    context: int = CONTEXT,
    max_tokens: int = MAX_TOKENS,
    prompt_tokens: int = PROMPT_BYTES,
    progress: Callable[[int, int, str], None] | None = None,
) -> FamilyPlans:
    """Profile both models here (tiers emulated), rank, and write the three plans.

    The split is the planner's best plan for the large model under ``memory`` (default
    :func:`budgets`); cloud-only is its cloud-only baseline; device-only is the small
    model's device-only baseline, which must fit the device's budget.
    """
    from tierflow.partitioner.decoder_graph import load_decoder
    from tierflow.partitioner.decoder_points import DecoderSettings
    from tierflow.partitioner.plan_options import PlanOptions
    from tierflow.partitioner.plan_writing import write_plan
    from tierflow.partitioner.ranking import rank
    from tierflow.partitioner.tier_profiles import decoder_profiles

    settings = DecoderSettings(context=context, max_tokens=max_tokens, prompt_tokens=prompt_tokens)
    options = PlanOptions(links=links, memory=dict(memory or budgets()))
    emulation = {tier: slowdown for tier, (_, slowdown) in EMULATION.items()}
    ranked = {}
    for size in ("large", "small"):
        graph = load_decoder(family.path(size), settings)
        profiles, _ = decoder_profiles(graph, emulation=emulation, progress=progress)
        result, _ = rank(graph, profiles, options)
        ranked[size] = (graph, profiles, result)
    large_graph, large_profiles, large = ranked["large"]
    small_graph, small_profiles, small = ranked["small"]
    alone = small.baselines["device-only"]
    if not alone.feasible:
        raise PlanError(
            f"the small model does not fit the device's {options.memory.get('device')} bytes "
            f"with its KV cache at --context {context}: {alone.memory_bytes['device']} bytes"
        )
    dirs = {name: workdir / name for name in ("split", "cloud-only", "device-only")}
    write_plan(large_graph, large_profiles, options, large.best, dirs["split"])
    cloud = large.baselines["cloud-only"]
    write_plan(large_graph, large_profiles, options, cloud, dirs["cloud-only"])
    write_plan(small_graph, small_profiles, options, alone, dirs["device-only"])
    return FamilyPlans(
        dirs["split"],
        dirs["cloud-only"],
        dirs["device-only"],
        large,
        small,
        options.memory,
        large_graph.unit_blocks(),
    )


@dataclass
class GenerationRun:
    """What one strategy did over the prompts: figures summed, then read per token."""

    strategy: str
    model: str
    tiers: tuple[str, ...] = ()  # the tiers the plan runs on, in order
    blocks: dict[str, list[int]] = field(default_factory=dict)  # KV layers by tier
    tokens: list[list[int]] = field(default_factory=list)  # per prompt
    ttft_ms: list[float] = field(default_factory=list)
    ms_per_token: list[float] = field(default_factory=list)
    seconds: float = 0.0  # prompts' generations, first token included
    round_trips: int = 0  # requests that crossed the device-edge link
    bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(LINKS, 0))
    drafted: int = 0
    accepted: int = 0
    judged: int = 0  # drafts the large model looked at ([Note: speculation])
    agree: int = 0  # tokens equal to the large model's greedy token at their position
    compared: int = 0
    replays: int = 0
    memory: dict[str, dict[str, int]] = field(default_factory=dict)  # by tier (benchmark)

    @property
    def count(self) -> int:
        return sum(len(t) for t in self.tokens)

    def to_dict(self) -> dict[str, Any]:
        count = max(self.count, 1)
        return {
            "strategy": self.strategy,
            "model": self.model,
            "tiers": list(self.tiers),
            "blocks": self.blocks,
            "prompts": len(self.tokens),
            "tokens": self.count,
            "ttft_ms": float(np.median(self.ttft_ms)) if self.ttft_ms else None,
            "ms_per_token": float(np.mean(self.ms_per_token)) if self.ms_per_token else None,
            "tokens_per_s": self.count / self.seconds if self.seconds > 0 else None,
            "round_trips_per_token": self.round_trips / count,
            "bytes_per_token": {link: n / count for link, n in self.bytes.items()},
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance": self.accepted / self.drafted if self.drafted else None,
            "judged": self.judged,
            "acceptance_rate": self.accepted / self.judged if self.judged else None,
            "agreement": self.agree / self.compared if self.compared else None,
            "replays": self.replays,
            "memory": self.memory,
        }


def figure_cells(row: Mapping[str, Any]) -> dict[str, str]:
    """The measured figures of one :meth:`GenerationRun.to_dict` row as table cells, by
    column header: the demo's table and the benchmark's show them alike."""
    per_token = row["bytes_per_token"]
    return {
        "TTFT ms": _cell(row["ttft_ms"], ".1f"),
        "ms/token": _cell(row["ms_per_token"], ".1f"),
        "tokens/s": _cell(row["tokens_per_s"], ".1f"),
        "round trips/token": f"{row['round_trips_per_token']:.2f}",
        "device-edge B/token": f"{per_token.get('device-edge', 0):,.0f}",
        "edge-cloud B/token": f"{per_token.get('edge-cloud', 0):,.0f}",
        "drafts kept": _kept(row["accepted"], row["drafted"], row["acceptance"]),
        "acceptance rate": _kept(row["accepted"], row.get("judged"), row.get("acceptance_rate")),
        "agrees": _cell(row["agreement"], ".1%"),
    }


def _cell(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _kept(accepted: int, of: int | None, share: float | None) -> str:
    return f"{accepted}/{of} ({share:.0%})" if of else "-"


TokenHook = Callable[[int, bool], None]


def measure(
    run: GenerationRun,
    client: Any,
    prompts: Sequence[Sequence[int]],
    references: Sequence[Sequence[int]],
    max_tokens: int,
    *,
    draft: Path | None = None,
    on_token: Callable[[int], TokenHook | None] | None = None,
    after: Callable[[Any], None] | None = None,
) -> GenerationRun:
    """Generate greedily from each prompt through ``client`` (a DeviceClient) into ``run``.

    Each prompt is a session of its own; ``draft`` speculates with that model on the
    device (K chosen ``auto``). ``on_token(i)`` gives prompt ``i``'s token hook (for
    streaming), ``after(generator)`` is called once each generation ends (the benchmark
    reads the tiers' state there). Agreement compares each token with ``references``
    (the large model's greedy output) at its position: computed, never assumed.
    """
    from tierflow.device.generation import Generator

    run.tiers = tuple(spec.tier for spec in client.plan.segments)
    for i, (prompt, reference) in enumerate(zip(prompts, references, strict=True)):
        generator = Generator(client, draft=draft)
        started = time.perf_counter()
        report = generator.generate(
            prompt, max_tokens, on_token=on_token(i) if on_token is not None else None
        )
        run.seconds += time.perf_counter() - started
        if after is not None:
            after(generator)
        run.blocks = report.tiers
        run.tokens.append(report.tokens)
        run.ttft_ms.append(report.ttft_ms)
        run.ms_per_token.append(report.ms_per_token)
        results = generator.target.results
        run.round_trips += sum(1 for r in results if r.bytes.get("device-edge", 0) > 0)
        for link in LINKS:
            run.bytes[link] += sum(r.bytes.get(link, 0) for r in results)
        run.drafted += report.drafted
        run.accepted += report.accepted
        run.judged += report.judged
        run.replays += report.replays
        run.agree += sum(1 for a, b in zip(report.tokens, reference, strict=False) if a == b)
        run.compared += max(len(report.tokens), len(reference))
    return run


def references(
    family: Any, prompts: Sequence[Sequence[int]], max_tokens: int, context: int = CONTEXT
) -> list[list[int]]:
    """The large model's own greedy output for each prompt, unsplit, at the tiers' settings."""
    from tierflow.greedy import reference_generate

    return [
        list(reference_generate(family.path("large"), p, max_tokens, context=context).tokens)
        for p in prompts
    ]
