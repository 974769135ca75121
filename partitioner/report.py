"""What ``tierflow profile`` and ``tierflow plan`` show people: tables and progress.

Only formatting: callers print the strings. The progress bar redraws one line on a
terminal and writes a plain line every few seconds otherwise (logs, CI), always on
stderr so stdout stays clean for ``--json``.
"""

from __future__ import annotations

import itertools
import sys
import time
from collections.abc import Mapping, Sequence
from typing import TextIO

from tierflow.cli.table import format_table
from tierflow.link.spec import LINKS, TIERS
from tierflow.partitioner.cost import Estimate, spans
from tierflow.partitioner.decoder_cost import DecoderEstimate
from tierflow.partitioner.grid import GridChoice
from tierflow.partitioner.search import SearchResult
from tierflow.units import format_size


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def _spans(estimate: Estimate) -> list[tuple[str, str, int, int]]:
    """Each tier, its cell in the ``units`` column (``D0-3``, ``C-``) and its units [start, end)."""
    a, b = estimate.cuts
    spans = {"device": (0, a), "edge": (a, b), "cloud": (b, estimate.last)}
    return [
        (tier, f"{tier[0].upper()}{s}-{e}" if s < e else f"{tier[0].upper()}-", s, e)
        for tier, (s, e) in ((tier, spans[tier]) for tier in TIERS)
    ]


def _split(estimate: Estimate) -> str:
    """Which units each tier runs, like ``D0-3 E3-12 C-``."""
    return " ".join(cell for _, cell, _, _ in _spans(estimate))


def units_legend(estimate: Estimate) -> str:
    """The line under a plan table that says how to read its ``units`` column.

    A unit is the stretch of layers between two candidate cuts (what ``tierflow
    profile`` times), numbered from 0 in graph order; ``E3-12`` is half open, like a
    Python range: the edge runs units 3 to 11. Explained on ``estimate``'s own split.
    """
    readings = []
    for tier, cell, start, end in _spans(estimate):
        if start >= end:
            runs = "none"
        elif end - start == 1:
            runs = f"unit {start}"
        else:
            runs = f"units {start}-{end - 1}"
        readings.append(f"{cell}: the {tier} runs {runs}")
    return (
        f"units: the model's {estimate.last} units (the layers between two candidate cuts, "
        "numbered from 0); TIER START-END runs units START to END-1, TIER- none. "
        f"{', '.join(readings)}"
    )


def _link(estimate: Estimate, name: str) -> str:
    cost = estimate.links[name]
    if not cost.used:
        return "-"
    share = f" ({100 * cost.reach:.0f}%)" if cost.reach < 1.0 else ""
    return f"{cost.codec} {format_size(cost.bytes)} {_ms(cost.total_s)}{share}"


def exits_cell(estimate: Estimate) -> str:
    """Where the plan's exits fall and how often each answers, like ``edge:exit0(62%)``."""
    if not estimate.exits:
        return "-"
    return " ".join(
        f"{e.tier}:{e.name.removesuffix('_probs')}({100 * e.rate:.0f}%)" for e in estimate.exits
    )


def _row(label: str, estimate: Estimate, memory: Mapping[str, int]) -> list[str]:
    compute = [
        _ms(estimate.compute_s[t]) if estimate.compute_s[t] > 0 or t in estimate.tiers else "-"
        for t in TIERS
    ]
    fits = "" if estimate.feasible else " (over budget)"
    budgeted = [t for t in TIERS if t in memory]
    mem = " ".join(f"{t[0].upper()}{format_size(estimate.memory_bytes[t])}" for t in budgeted)
    return [
        label,
        _split(estimate),
        *compute,
        *(_link(estimate, name) for name in LINKS),
        _ms(estimate.latency_s) + fits,
        f"{estimate.throughput_rps:.1f}",
        *([exits_cell(estimate)] if estimate.exits else []),
        *([mem] if budgeted else []),
    ]


def plan_table(
    result: SearchResult[Estimate],
    memory: Mapping[str, int],
    providers: Mapping[str, str] | None = None,
) -> str:
    """The ranked plans, then the single-tier baselines, with the cost breakdown.

    Compute is per tier (ms); each link shows codec, bytes after the codec and its total
    cost (encode, wire, RTT, decode and the reply; ms). With early exits every time is
    an expectation over where requests leave, the latency column says so, a link used by
    only some requests shows their share in brackets, and an ``exits`` column shows the
    tier checking each exit and its exit rate. ``providers`` (tier -> ``cuda,cpu``) names
    what each tier's profile was measured on, in its compute column's header. A legend
    line under the table reads the ``units`` column (:func:`units_legend`).
    """
    with_exits = bool(result.best.exits)
    measured_on = dict(providers or {})
    headers = [
        "plan",
        "units",
        *(
            f"{tier} ms ({measured_on[tier]})" if tier in measured_on else f"{tier} ms"
            for tier in TIERS
        ),
        "device-edge",
        "edge-cloud",
        "exp. latency ms" if with_exits else "latency ms",
        "req/s",
    ]
    if with_exits:
        headers.append("exits")
    if memory:
        headers.append("memory")
    rows = [_row(f"#{i + 1}", e, memory) for i, e in enumerate(result.ranked)]
    rows += [_row(name, e, memory) for name, e in result.baselines.items()]
    return format_table(headers, rows) + "\n" + units_legend(result.best)


class Progress:
    """A progress bar on ``stream``; on a non-terminal, one line every ``every_s`` seconds."""

    def __init__(
        self, label: str, stream: TextIO | None = None, *, every_s: float = 5.0, width: int = 30
    ) -> None:
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.every_s = every_s
        self.width = width
        self._last = 0.0
        self._started = time.monotonic()
        self._drawn = False

    def __call__(self, done: int, total: int, what: str) -> None:
        now = time.monotonic()
        if self.tty:
            filled = self.width * done // max(total, 1)
            bar = "#" * filled + "." * (self.width - filled)
            self.stream.write(f"\r{self.label} [{bar}] {done}/{total} {what[:30]:<30}")
            self._drawn = True
        elif now - self._last >= self.every_s or done == total:
            elapsed = now - self._started
            self.stream.write(f"{self.label}: {done}/{total} ({what}), {elapsed:.0f} s\n")
            self._last = now
        self.stream.flush()

    def close(self) -> None:
        """End the bar's line so what follows starts clean."""
        if self._drawn:
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = False


def plan_letter(index: int) -> str:
    """How region tables name the plans of a set: A, B, ..., Z, then P26, P27, ..."""
    return chr(ord("A") + index) if index < 26 else f"P{index}"


def region_tables(choice: GridChoice) -> str:
    """Which plan of a set is best where: one table per pair of RTTs.

    Rows are device-edge rates, columns edge-cloud rates, each cell the letter of the
    best plan there; then each plan's split, codecs and latency at its own point.
    """
    from tierflow.units import format_duration, format_rate

    rtts = sorted({(p["device-edge"].rtt_s, p["edge-cloud"].rtt_s) for p in choice.points})
    de_rates = sorted({p["device-edge"].rate_bps for p in choice.points})
    ec_rates = sorted({p["edge-cloud"].rate_bps for p in choice.points})
    best = {
        tuple((n, p[n].rate_bps, p[n].rtt_s) for n in LINKS): index
        for index, region in enumerate(choice.regions)
        for p in region
    }
    blocks = []
    for de_rtt, ec_rtt in rtts:
        rows = []
        for de in de_rates:
            cells = []
            for ec in ec_rates:
                key = (("device-edge", de, de_rtt), ("edge-cloud", ec, ec_rtt))
                cells.append(plan_letter(best[key]) if key in best else "")
            rows.append([format_rate(de), *cells])
        title = (
            f"best plan by link rate (device-edge RTT {format_duration(de_rtt)}, "
            f"edge-cloud RTT {format_duration(ec_rtt)}); rows: device-edge, columns: edge-cloud"
        )
        headers = ["device-edge", *(format_rate(ec) for ec in ec_rates)]
        blocks.append(title + "\n" + format_table(headers, rows))
    legend = []
    for index, (estimate, anchor) in enumerate(zip(choice.plans, choice.anchors, strict=True)):
        at = ", ".join(f"{n} {anchor[n]}" for n in LINKS)
        legend.append(
            [
                plan_letter(index) + (" (default)" if index == 0 else ""),
                _split(estimate),
                *(_link(estimate, name) for name in LINKS),
                _ms(estimate.latency_s),
                str(len(choice.regions[index])),
                at,
            ]
        )
    headers = ["plan", "units", "device-edge", "edge-cloud", "latency ms", "points", "at"]
    blocks.append(
        format_table(headers, legend, align="llllrrl") + "\n" + units_legend(choice.plans[0])
    )
    return "\n\n".join(blocks)


def block_ranges(estimate: Estimate, unit_blocks: Sequence[Sequence[int]]) -> str:
    """Which blocks (KV layers) each tier holds in ``estimate``, like ``D- E0-3 C4-7``."""
    cells = []
    for tier, (start, end) in spans(*estimate.cuts, estimate.last).items():
        held = sorted({b for unit in unit_blocks[start:end] for b in unit})
        groups = []
        for _, run in itertools.groupby(enumerate(held), lambda pair: pair[1] - pair[0]):
            values = [v for _, v in run]
            groups.append(str(values[0]) if len(values) == 1 else f"{values[0]}-{values[-1]}")
        cells.append(f"{tier[0].upper()}{','.join(groups) or '-'}")
    return " ".join(cells)


def decoder_table(
    result: SearchResult[DecoderEstimate],
    memory: Mapping[str, int],
    unit_blocks: Sequence[Sequence[int]] | None = None,
) -> str:
    """A decoder's ranked plans and baselines: TTFT, ms per token, bytes per token, memory.

    ``unit_blocks`` (:meth:`DecoderGraph.unit_blocks`) adds a ``blocks`` column: the
    transformer blocks, by their KV caches' numbers, each tier holds (``D- E0-3 C4-7``).

    Compute is per token (the decode step) on each tier; each link shows its codec and
    the bytes it carries per token (up and down); ``generation`` is TTFT plus
    ``max_tokens - 1`` steps ([Note: pricing a decoder] in :mod:`.decoder_cost`). Memory is
    each tier's weights, activations and KV cache at ``--context`` (the cache in brackets).
    Planned for ``--sessions N``, ``ms/token xN`` is each session's time per token with
    the N batched and ``all tok/s`` their tokens per second together, memory their N
    caches ([Note: pricing batched steps] in :mod:`.decoder_cost`).
    """
    sessions = result.best.sessions
    headers = [
        "plan",
        "units",
        *(["blocks"] if unit_blocks is not None else []),
        *(f"{tier} ms/tok" for tier in TIERS),
        *(f"{name} B/tok" for name in LINKS),
        "TTFT ms",
        "ms/token",
        f"{result.best.max_tokens} tokens s",
        "tok/s",
        *([f"ms/token x{sessions}", "all tok/s"] if sessions else []),
        "memory (KV cache)",
    ]

    def row(label: str, e: DecoderEstimate) -> list[str]:
        step = e.step
        compute = [
            _ms(step.compute_s[t]) if step.compute_s[t] > 0 or t in step.tiers else "-"
            for t in TIERS
        ]
        sent = e.bytes_per_token()
        links = [
            f"{step.links[n].codec} {format_size(sent[n])}" if step.links[n].used else "-"
            for n in LINKS
        ]
        held = " ".join(
            f"{t[0].upper()}{format_size(e.memory_bytes[t])}({format_size(e.state_bytes[t])})"
            for t in TIERS
            if t in step.tiers or t in memory
        )
        fits = "" if e.feasible else " (over budget)"
        return [
            label,
            _split(step),
            *([block_ranges(step, unit_blocks)] if unit_blocks is not None else []),
            *compute,
            *links,
            _ms(e.ttft_s),
            _ms(e.per_token_s),
            f"{e.generation_s:.3g}{fits}",
            f"{e.tokens_per_s:.1f}",
            *([_ms(e.session_per_token_s), f"{e.aggregate_tokens_per_s:.1f}"] if sessions else []),
            held,
        ]

    rows = [row(f"#{i + 1}", e) for i, e in enumerate(result.ranked)]
    rows += [row(name, e) for name, e in result.baselines.items()]
    return format_table(headers, rows)
