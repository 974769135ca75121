"""The cost model: predicted latency, throughput and memory of a plan. Pure.

A plan is a pair of cut indices ``a <= b``: the device runs units ``[0, a)``, the edge
``[a, b)``, the cloud ``[b, last)`` (``last`` = the index of the output cut); any tier
may be empty. Given the three tiers' profiles, the two links and the memory budgets,
the model predicts (docs/design.md, "Cost model"):

    latency = Σ_tiers compute(segment on tier)
            + Σ_links used [ encode + bytes_after_codec / rate + RTT/2 + decode
                             + reply_bytes / rate + RTT/2 ]

See [Note: what crosses a link]. The throughput objective pipelines requests: its period
is the slowest stage (a tier's compute plus its encode/decode) or link (serialisation).

Everything is computed as numpy tables over all cut indices at once (:class:`CostTables`)
so the search can score every plan in one pass; :func:`estimate` reads one plan out of
the same tables, so the ranking and the printed breakdown never disagree.

[Note: what crosses a link]
The device-edge link is used when the edge or the cloud has work (``a < last``): the
tensors of cut ``a`` cross it, encoded on the device and decoded on the edge; when the
device has no work that is cut 0, the raw model inputs. The edge-cloud link is used when
the cloud has work (``b < last``) and carries cut ``b``. The answer (the model outputs,
small, or ``Problem.reply_bytes`` where the runtime answers less: a decoder's last
position, or its token choice alone) comes back over every link used, uncompressed: one
more serialisation and RTT/2 per link. So a device-only plan pays no link at all, and a
cloud-only plan pays the full round trip on both links. Codec speeds come from the
sending tier's profile (encode) and the receiving tier's (decode); the compression ratio
from the sender's, measured on the real features at that cut. An edge with no work
(``a == b < last``) forwards what it receives as it came ([Note: an edge that runs
nothing] in tierflow/plan.py): the device-edge codec crosses both links, encoded once on the
device and decoded once on the cloud: such a plan pays no codec time on the edge, and
the same bytes on both links (:func:`forwarded_plans` scores them for the search).

[Note: expected cost with early exits]
A model may carry early exits (:class:`ExitPoint`): a head reads the tensor of one-tensor
cut ``k`` and a request whose top probability reaches the threshold is answered there by
the tier that computed cut ``k`` (the tier running unit ``k - 1``: the device when
``k <= a``, the edge when ``k <= b``, else the cloud), skipping everything after it. The
exit's ``rate`` is the fraction of *all* requests that left there during calibration
(not conditional on reaching it; exits are tried in order), so the chance of still
running after cut ``c`` is ``reach(c) = 1 - sum(rate of exits at cuts <= c)``.
Latency and stage times become expectations:

* unit ``i`` (cut ``i`` to ``i + 1``) is weighted by ``reach(i)``; a tier's call
  overhead by ``reach`` at its first cut, the output cost of its last unit by that
  unit's weight;
* a link whose crossing cut is ``c`` costs ``reach(c)`` times its full cost (encode,
  wire, RTT, decode, reply): an exit taken at the edge leaves the edge-cloud link
  unused; a request answered at the edge still pays the device-edge link both ways;
* each exit adds, weighted by the chance of arriving at it (``reach`` just before ``k``),
  its head (pool + small matrix product: estimated as one pass over the feature,
  ``output_s_per_byte * bytes(k)``) and, when ``k`` lies inside a tier's stretch, the
  extra segment boundary the tier needs to check it (one more call overhead and one
  more output copy).

Without exits ``reach`` is 1 everywhere and every figure is the plain one. Bytes in a
:class:`LinkCost` stay what one crossing request sends; ``LinkCost.reach`` says how
often a request crosses. Memory ignores the heads (a few kilobytes of weights).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from tierflow.errors import PlanError, UsageError
from tierflow.link.spec import LINKS, TIERS, LinkSpec
from tierflow.partitioner.profile_data import Profile

OBJECTIVES: tuple[str, ...] = ("latency", "throughput")

# Which tiers a link joins: (sender, receiver) for features going up.
LINK_ENDS: dict[str, tuple[str, str]] = {
    "device-edge": ("device", "edge"),
    "edge-cloud": ("edge", "cloud"),
}


@dataclass(frozen=True)
class ExitPoint:
    """An early exit as the cost model sees it: the cut it reads and how often it answers.

    ``rate`` is the fraction of all requests that leave here (see
    [Note: expected cost with early exits]).
    """

    name: str
    cut: int
    rate: float

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "cut": self.cut, "rate": self.rate}


@dataclass(frozen=True)
class PlacedExit:
    """An exit in one plan: which tier checks it and how often it answers."""

    name: str
    cut: int
    tier: str
    rate: float

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "cut": self.cut, "tier": self.tier, "rate": self.rate}


@dataclass(frozen=True)
class Problem:
    """Everything a plan is scored against: profiles, links, budgets, objective, codecs.

    ``memory`` holds budgets in bytes for the tiers that have one; ``codecs`` the codecs
    the search may choose from on each link (one name = that codec everywhere).
    """

    profiles: Mapping[str, Profile]
    links: Mapping[str, LinkSpec]
    memory: Mapping[str, int] = field(default_factory=dict)
    objective: str = "latency"
    codecs: tuple[str, ...] = ("raw",)
    exits: tuple[ExitPoint, ...] = ()
    #: The answer's bytes back over each used link; None: the model outputs (the last
    #: cut's tensors). A decoder's answer is smaller ([Note: pricing a decoder]).
    reply_bytes: int | None = None

    def __post_init__(self) -> None:
        missing = [t for t in TIERS if t not in self.profiles]
        if missing:
            raise PlanError(f"no profile for tier(s) {', '.join(missing)}")
        unknown = [t for t in list(self.profiles) + list(self.memory) if t not in TIERS]
        if unknown:
            raise UsageError(f"unknown tier {unknown[0]!r}: expected one of {', '.join(TIERS)}")
        absent = [name for name in LINKS if name not in self.links]
        if absent:
            raise PlanError(f"no rate given for link(s) {', '.join(absent)}")
        if self.objective not in OBJECTIVES:
            raise UsageError(
                f"unknown objective {self.objective!r}: expected one of {', '.join(OBJECTIVES)}"
            )
        first = self.profiles["device"]
        for tier in TIERS:
            profile = self.profiles[tier]
            if profile.model_sha256 != first.model_sha256 or len(profile.cuts) != len(first.cuts):
                raise PlanError(
                    f"the {tier} profile was made for another model or other cuts than the "
                    f"device profile ({profile.model_file!r} vs {first.model_file!r})"
                )
            unmeasured = [c for c in self.codecs if c not in profile.codecs]
            if unmeasured:
                raise PlanError(
                    f"the {tier} profile has no figures for codec(s) {', '.join(unmeasured)}; "
                    f"it measured {', '.join(profile.codecs)}"
                )
        if not self.codecs:
            raise UsageError("no codec to choose from")
        if self.reply_bytes is not None and self.reply_bytes < 0:
            raise PlanError(f"reply_bytes must not be negative, got {self.reply_bytes}")
        self._check_exits()

    def _check_exits(self) -> None:
        last = self.ncuts - 1
        cuts = [e.cut for e in self.exits]
        if cuts != sorted(set(cuts)):
            raise PlanError(f"exits must read distinct cuts in order, got cuts {cuts}")
        for point in self.exits:
            if not 0 < point.cut < last:
                raise PlanError(
                    f"exit {point.name} reads cut {point.cut}: expected an interior cut, "
                    f"1..{last - 1}"
                )
            if not 0.0 <= point.rate <= 1.0:
                raise PlanError(f"exit {point.name} has rate {point.rate}: expected 0..1")
        total = sum(e.rate for e in self.exits)
        if total > 1.0 + 1e-9:
            raise PlanError(f"exit rates add up to {total:g}, more than every request")

    def reach(self) -> np.ndarray:
        """(ncuts,) chance that a request is still running after each cut."""
        reach = np.ones(self.ncuts)
        for point in self.exits:
            reach[point.cut :] -= point.rate
        return np.clip(reach, 0.0, 1.0)

    def place_exits(self, a: int, b: int) -> tuple[PlacedExit, ...]:
        """The tier that checks each exit in plan ``(a, b)``."""
        return tuple(PlacedExit(e.name, e.cut, exit_tier(e.cut, a, b), e.rate) for e in self.exits)

    @property
    def ncuts(self) -> int:
        return len(self.profiles["device"].cuts)

    @property
    def answer_bytes(self) -> int:
        """What comes back over each used link ([Note: what crosses a link])."""
        if self.reply_bytes is not None:
            return self.reply_bytes
        return self.profiles["device"].cuts[-1].nbytes


@dataclass(frozen=True)
class LinkCost:
    """What one link costs in a plan, in seconds and bytes; all zero when it is unused."""

    codec: str
    raw_bytes: int
    bytes: float
    encode_s: float
    wire_s: float
    propagation_s: float
    decode_s: float
    reply_s: float
    reach: float = 1.0  # chance a request crosses; the times above are weighted by it

    @property
    def total_s(self) -> float:
        return self.encode_s + self.wire_s + self.propagation_s + self.decode_s + self.reply_s

    @property
    def used(self) -> bool:
        return self.raw_bytes > 0 or self.total_s > 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "codec": self.codec,
            "raw_bytes": self.raw_bytes,
            "bytes": round(self.bytes),
            "encode_s": self.encode_s,
            "wire_s": self.wire_s,
            "propagation_s": self.propagation_s,
            "decode_s": self.decode_s,
            "reply_s": self.reply_s,
            "total_s": self.total_s,
            **({"reach": self.reach} if self.reach != 1.0 else {}),
        }


@dataclass(frozen=True)
class Estimate:
    """The cost model's prediction for one plan (cuts ``a <= b`` and a codec per link)."""

    cuts: tuple[int, int]
    last: int
    latency_s: float
    period_s: float
    compute_s: Mapping[str, float]
    links: Mapping[str, LinkCost]
    memory_bytes: Mapping[str, int]
    feasible: bool
    exits: tuple[PlacedExit, ...] = ()

    @property
    def throughput_rps(self) -> float:
        return 1.0 / self.period_s if self.period_s > 0 else float("inf")

    @property
    def codec(self) -> dict[str, str]:
        """The codec of each link used."""
        return {name: cost.codec for name, cost in self.links.items() if cost.used}

    @property
    def tiers(self) -> tuple[str, ...]:
        """The tiers with work, in order."""
        span = spans(*self.cuts, self.last)
        return tuple(t for t in TIERS if span[t][0] < span[t][1])

    def score(self, objective: str) -> float:
        return self.latency_s if objective == "latency" else self.period_s

    def to_dict(self) -> dict[str, Any]:
        return {
            "cuts": list(self.cuts),
            "latency_s": self.latency_s,
            "throughput_rps": self.throughput_rps,
            "period_s": self.period_s,
            "compute_s": dict(self.compute_s),
            "transfer_s": {name: cost.total_s for name, cost in self.links.items()},
            "links": {name: cost.to_dict() for name, cost in self.links.items()},
            "memory_bytes": dict(self.memory_bytes),
            "feasible": self.feasible,
            **({"exits": [e.to_dict() for e in self.exits]} if self.exits else {}),
        }


@dataclass(frozen=True)
class LinkTable:
    """Per cut (rows) and codec (columns): the parts of one link's cost."""

    used: np.ndarray  # (n,) bool: the link carries something when its cut is that row
    raw_bytes: np.ndarray  # (n,)
    bytes: np.ndarray  # (n, C)
    encode_s: np.ndarray  # (n, C)
    wire_s: np.ndarray  # (n, C)
    decode_s: np.ndarray  # (n, C)
    propagation_s: float  # both directions, when used
    reply_s: float  # serialisation of the answer, when used
    reach: np.ndarray | None = None  # (n,) chance of crossing; encode/wire/decode include it

    @property
    def crossing(self) -> np.ndarray:
        """(n,) chance that a request crosses when its crossing cut is the row (1 w/o exits)."""
        return np.ones(len(self.used)) if self.reach is None else self.reach

    @property
    def reply_row_s(self) -> np.ndarray:
        """(n,) expected serialisation of the answer per row; 0 where unused."""
        return np.where(self.used, self.reply_s * self.crossing, 0.0)

    @property
    def fixed_row_s(self) -> np.ndarray:
        """(n,) expected propagation both ways and answer serialisation; 0 where unused."""
        return np.where(self.used, (self.propagation_s + self.reply_s) * self.crossing, 0.0)

    @property
    def total_s(self) -> np.ndarray:
        """(n, C) expected latency of the link for a plan whose crossing cut is the row."""
        return self.encode_s + self.wire_s + self.decode_s + self.fixed_row_s[:, None]


@dataclass(frozen=True)
class CostTables:
    """Every plan's costs, as arrays over cut indices. Build with :func:`build_tables`."""

    problem: Problem
    segment_s: Mapping[str, np.ndarray]  # tier -> (n, n) compute of cuts [s, e)
    memory: Mapping[str, np.ndarray]  # tier -> (n, n) bytes needed to run [s, e)
    links: Mapping[str, LinkTable]

    @property
    def last(self) -> int:
        return self.problem.ncuts - 1


def _segment_table(
    profile: Profile, reach: np.ndarray | None = None, exits: tuple[ExitPoint, ...] = ()
) -> np.ndarray:
    """(n, n) expected compute of cuts ``[s, e)`` on this tier.

    See [Note: expected cost with early exits]; without exits, the plain segment time.
    """
    n = len(profile.cuts)
    if reach is None:
        reach = np.ones(n)
    units = np.array([u.compute_s for u in profile.units], dtype=np.float64)
    prefix = np.concatenate([[0.0], np.cumsum(units * reach[:-1])])
    nbytes = np.array([c.nbytes for c in profile.cuts], dtype=float)
    outputs = profile.output_s_per_byte * nbytes
    last_unit = np.concatenate([[1.0], reach[:-1]])  # weight of the unit ending at cut e
    table = (
        prefix[None, :]
        - prefix[:, None]
        + profile.overhead_s * reach[:, None]
        + (outputs * last_unit)[None, :]
    )
    start, end = np.indices((n, n))
    arrived = 1.0
    for point in exits:
        k = point.cut
        head = outputs[k] * arrived
        split = (profile.overhead_s + outputs[k]) * arrived
        table = table + np.where((start < k) & (k <= end), head, 0.0)
        table = table + np.where((start < k) & (k < end), split, 0.0)
        arrived -= point.rate
    return np.where(start < end, table, 0.0)


def _memory_table(profile: Profile) -> np.ndarray:
    """Weights of the segment plus the largest activation peak of its units.

    A unit's peak already counts the tensors it holds across it (skip paths), so the
    segment's peak is the largest of its units'.
    """
    n = len(profile.cuts)
    weights = np.concatenate([[0], np.cumsum([u.weight_bytes for u in profile.units])])
    peaks = np.array([u.peak_activation_bytes for u in profile.units], dtype=np.float64)
    table = np.zeros((n, n))
    for start in range(n - 1):
        running = np.maximum.accumulate(peaks[start:])
        table[start, start + 1 :] = weights[start + 1 :] - weights[start] + running
    return table


def _stat(cut: Any, codec: str, figure: str, missing: float) -> float:
    stats = cut.codecs.get(codec)
    return missing if stats is None else float(getattr(stats, figure))


def _link_table(problem: Problem, name: str, reach: np.ndarray | None = None) -> LinkTable:
    sender, receiver = (problem.profiles[t] for t in LINK_ENDS[name])
    link = problem.links[name]
    n, codecs = problem.ncuts, problem.codecs
    raw = np.array([c.nbytes for c in sender.cuts], dtype=np.float64)
    used = np.arange(n) < n - 1
    # A codec measured only at some cuts (an image codec: where the model inputs cross)
    # cannot carry the others: infinitely slow there.
    ratio = np.array([[_stat(c, k, "ratio", 1.0) for k in codecs] for c in sender.cuts])
    enc = np.array([[_stat(c, k, "encode_s_per_mb", np.inf) for k in codecs] for c in sender.cuts])
    dec = np.array(
        [[_stat(c, k, "decode_s_per_mb", np.inf) for k in codecs] for c in receiver.cuts]
    )
    mb = (raw / 1e6)[:, None]
    wire_bytes = np.where(used[:, None], raw[:, None] / ratio, 0.0)
    live = used[:, None]
    weight = np.ones((n, 1)) if reach is None else reach[:, None]
    with np.errstate(invalid="ignore"):  # inf * 0 where an unmeasured codec has no bytes
        encode_s = np.where(live, np.nan_to_num(enc * mb * weight, nan=np.inf, posinf=np.inf), 0.0)
        decode_s = np.where(live, np.nan_to_num(dec * mb * weight, nan=np.inf, posinf=np.inf), 0.0)
    return LinkTable(
        used=used,
        raw_bytes=np.where(used, raw, 0.0),
        bytes=wire_bytes,
        encode_s=encode_s,
        wire_s=wire_bytes * 8.0 / link.rate_bps * weight,
        decode_s=decode_s,
        propagation_s=link.rtt_s,
        reply_s=problem.answer_bytes * 8.0 / link.rate_bps,
        reach=reach,
    )


def build_tables(problem: Problem) -> CostTables:
    """Tabulate compute, memory and link costs for every cut index of ``problem``.

    With exits the costs are expectations ([Note: expected cost with early exits]).
    """
    reach = problem.reach() if problem.exits else None
    return CostTables(
        problem=problem,
        segment_s={t: _segment_table(problem.profiles[t], reach, problem.exits) for t in TIERS},
        memory={t: _memory_table(problem.profiles[t]) for t in TIERS},
        links={name: _link_table(problem, name, reach) for name in LINKS},
    )


def with_state_memory(tables: CostTables, state_bytes: Sequence[int]) -> CostTables:
    """``tables`` with each segment's state pairs added to every tier's memory.

    ``state_bytes[i]`` is what unit ``i``'s pairs keep per session ([Note: state pairs in
    the cut search] in :mod:`tierflow.partitioner.stateful`): the tier running the unit
    holds it between requests.
    """
    n = tables.problem.ncuts
    if len(state_bytes) != n - 1:
        raise PlanError(f"state bytes for {len(state_bytes)} units, the model has {n - 1}")
    held = np.concatenate([[0.0], np.cumsum(np.asarray(state_bytes, dtype=np.float64))])
    extra = np.triu(held[None, :] - held[:, None], k=1)
    return replace(tables, memory={t: m + extra for t, m in tables.memory.items()})


def with_links(tables: CostTables, links: Mapping[str, LinkSpec]) -> CostTables:
    """``tables`` for other link rates and RTTs: only the link tables are built again.

    Compute and memory do not depend on the links, so a search over many link
    conditions (:mod:`.grid`) tabulates them once.
    """
    problem = replace(tables.problem, links={**tables.problem.links, **links})
    reach = problem.reach() if problem.exits else None
    return replace(
        tables,
        problem=problem,
        links={name: _link_table(problem, name, reach) for name in LINKS},
    )


def spans(a: int, b: int, last: int) -> dict[str, tuple[int, int]]:
    """The cut range ``[start, end)`` each tier runs in plan ``(a, b)``."""
    return {"device": (0, a), "edge": (a, b), "cloud": (b, last)}


def exit_tier(cut: int, a: int, b: int) -> str:
    """The tier that checks an exit reading cut ``cut`` in plan ``(a, b)``: the one that
    computed that cut (runs unit ``cut - 1``)."""
    if cut <= a:
        return "device"
    return "edge" if cut <= b else "cloud"


def edge_forwards(a: int, b: int, last: int) -> bool:
    """Whether the edge runs nothing in plan ``(a, b)`` and passes the device's tensors on
    to the cloud as they came ([Note: what crosses a link])."""
    return a == b < last


def forwarded_plans(tables: CostTables) -> tuple[np.ndarray, np.ndarray]:
    """``(n, C)`` latency and period of each plan ``(a, a)``, codec column ``j`` on both links.

    The plans whose edge runs nothing: the device encodes once, the cloud decodes once,
    the edge only forwards ([Note: what crosses a link]); the same figures as
    :func:`estimate` gives. Row ``last`` (device-only) uses no link.
    """
    last = tables.last
    de, ec = tables.links["device-edge"], tables.links["edge-cloud"]
    device = tables.segment_s["device"][0, :][:, None]
    cloud = tables.segment_s["cloud"][:, last][:, None]
    links = (
        de.encode_s
        + de.wire_s
        + ec.wire_s
        + ec.decode_s
        + (de.fixed_row_s + ec.fixed_row_s)[:, None]
    )
    latency = device + cloud + links
    period = np.maximum.reduce(
        [
            device + de.encode_s,
            ec.decode_s + cloud,
            de.wire_s + de.reply_row_s[:, None],
            ec.wire_s + ec.reply_row_s[:, None],
        ]
    )
    return latency, period


def estimate(tables: CostTables, a: int, b: int, codec: Mapping[str, str]) -> Estimate:
    """The prediction for plan ``(a, b)`` with ``codec[link]`` on each used link.

    Links that are unused in this plan need no codec entry. When the edge runs nothing
    (``a == b``) the device-edge codec crosses both links and ``codec["edge-cloud"]``
    is not read ([Note: what crosses a link]).
    """
    problem, last = tables.problem, tables.last
    if not 0 <= a <= b <= last:
        raise PlanError(f"cuts must satisfy 0 <= a <= b <= {last}, got ({a}, {b})")
    forwards = edge_forwards(a, b, last)
    span = spans(a, b, last)
    compute = {t: float(tables.segment_s[t][span[t]]) for t in TIERS}
    memory = {t: int(tables.memory[t][span[t]]) for t in TIERS}
    crossing = {"device-edge": a, "edge-cloud": b}
    links: dict[str, LinkCost] = {}
    for name in LINKS:
        table, row = tables.links[name], crossing[name]
        if not table.used[row]:
            links[name] = LinkCost("raw", 0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
            continue
        chosen = codec.get("device-edge" if forwards else name)
        if chosen not in problem.codecs:
            raise PlanError(
                f"no codec {chosen!r} for link {name}: expected one of {', '.join(problem.codecs)}"
            )
        col = problem.codecs.index(chosen)
        share = float(table.crossing[row])
        links[name] = LinkCost(
            codec=chosen,
            raw_bytes=int(table.raw_bytes[row]),
            bytes=float(table.bytes[row, col]),
            encode_s=0.0 if forwards and name == "edge-cloud" else float(table.encode_s[row, col]),
            wire_s=float(table.wire_s[row, col]),
            propagation_s=table.propagation_s * share,
            decode_s=0.0 if forwards and name == "device-edge" else float(table.decode_s[row, col]),
            reply_s=table.reply_s * share,
            reach=share,
        )
    de, ec = links["device-edge"], links["edge-cloud"]
    stages = (
        compute["device"] + de.encode_s,
        de.decode_s + compute["edge"] + ec.encode_s,
        ec.decode_s + compute["cloud"],
        de.wire_s + de.reply_s,
        ec.wire_s + ec.reply_s,
    )
    feasible = all(memory[t] <= problem.memory[t] for t in problem.memory)
    return Estimate(
        cuts=(a, b),
        last=last,
        latency_s=sum(compute.values()) + de.total_s + ec.total_s,
        period_s=max(stages),
        compute_s=compute,
        links=links,
        memory_bytes=memory,
        feasible=feasible,
        exits=problem.place_exits(a, b),
    )
