"""Link traces: a link whose rate and RTT change over time, replayed from a CSV file.

``--link-emulation trace=FILE.csv`` shapes the links a process sends on by a trace
instead of the plan's fixed rates, so that one machine can show what a drifting link
(Wi-Fi, 4G, a shared uplink) does to a stream. A trace file has one ``SECONDS,RATE,RTT``
line per step, e.g. ``3,2mbit,30ms``: from 3 s on, the link carries 2 Mbit/s with a 30 ms
round trip, until the next line. Rates and RTTs are written as on the command line
(``tierflow.units``); blank lines, ``#`` comments and one ``seconds,rate,rtt`` header are
skipped. The first step starts at 0 and steps are in increasing time order; the last one
holds for ever. Time 0 is when a sender opens the link (see [Note: link shaping] in
``tierflow.link.emulation``).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tierflow.errors import UsageError, shown
from tierflow.link.spec import LinkSpec
from tierflow.units import format_duration, parse_duration, parse_rate

_HEADER = ("seconds", "rate", "rtt")


@dataclass(frozen=True)
class TraceStep:
    """From ``start_s`` seconds on (until the next step), the link is ``link``."""

    start_s: float
    link: LinkSpec


@dataclass(frozen=True)
class LinkTrace:
    """Steps of a link over time; checked when made. ``source`` names it in messages."""

    steps: tuple[TraceStep, ...]
    source: str = "trace"

    def __post_init__(self) -> None:
        object.__setattr__(self, "steps", tuple(self.steps))
        if not self.steps:
            raise UsageError(
                f"{self.source}: a link trace needs at least one SECONDS,RATE,RTT line"
            )
        if self.steps[0].start_s != 0:
            raise UsageError(
                f"{self.source}: the first step must start at 0 s, got {self.steps[0].start_s:g} s"
            )
        for before, after in zip(self.steps, self.steps[1:], strict=False):
            if not before.start_s < after.start_s < math.inf:
                raise UsageError(
                    f"{self.source}: steps must start at increasing, finite times; "
                    f"{after.start_s:g} s follows {before.start_s:g} s"
                )

    @classmethod
    def constant(cls, link: LinkSpec) -> LinkTrace:
        """A link that never changes."""
        return cls((TraceStep(0.0, link),), source=str(link))

    def at(self, t: float) -> LinkSpec:
        """The link at ``t`` seconds (before 0: the first step)."""
        starts = [step.start_s for step in self.steps]
        return self.steps[max(bisect.bisect_right(starts, t) - 1, 0)].link

    def serialised(self, start_s: float, nbytes: int) -> float:
        """When ``nbytes`` put on the link at ``start_s`` have left it (seconds).

        A message that spans a step goes at each step's rate for the part sent in it.
        """
        bits = nbytes * 8.0
        t = start_s
        index = max(bisect.bisect_right([step.start_s for step in self.steps], t) - 1, 0)
        while True:
            rate = self.steps[index].link.rate_bps
            if index + 1 == len(self.steps):
                return t + bits / rate
            room = (self.steps[index + 1].start_s - t) * rate
            if bits <= room:
                return t + bits / rate
            bits -= room
            t = self.steps[index + 1].start_s
            index += 1

    def to_csv(self) -> str:
        """The trace as a file :func:`parse_trace` reads back."""
        lines = ["seconds,rate,rtt"]
        lines += [
            f"{_number(step.start_s)},{_number(step.link.rate_bps)}bit,"
            f"{format_duration(step.link.rtt_s)}"
            for step in self.steps
        ]
        return "\n".join(lines) + "\n"


def _number(value: float) -> str:
    """``value`` as written for people (``3``, ``2e+06``) where that reads back exactly,
    else in full (the shortest form that does)."""
    short = f"{value:g}"
    return short if float(short) == value else repr(value)


def parse_trace(text: str, source: str = "trace") -> LinkTrace:
    """Read a trace file's text; errors name ``source`` and the line."""
    steps: list[TraceStep] = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        fields = [field.strip() for field in line.split(",")]
        if not steps and tuple(field.lower() for field in fields) == _HEADER:
            continue
        where = f"{source} line {number}"
        if len(fields) != 3:
            raise UsageError(
                f"{where}: expected SECONDS,RATE,RTT like 3,2mbit,30ms, got {shown(raw.strip())}"
            )
        try:
            start_s = float(fields[0])
        except ValueError:
            raise UsageError(
                f"{where}: expected a time in seconds first, like 3 or 0.5, got {shown(fields[0])}"
            ) from None
        if not 0 <= start_s < math.inf:
            raise UsageError(
                f"{where}: a step's time must be finite and not negative, got {start_s:g}"
            )
        if steps and start_s <= steps[-1].start_s:
            raise UsageError(
                f"{where}: steps must be in increasing time order; {start_s:g} s follows "
                f"{steps[-1].start_s:g} s"
            )
        try:
            link = LinkSpec(parse_rate(fields[1]), parse_duration(fields[2]))
        except UsageError as exc:
            raise UsageError(f"{where}: {exc}") from None
        steps.append(TraceStep(start_s, link))
    return LinkTrace(tuple(steps), source=source)


def load_trace(path: str | Path) -> LinkTrace:
    """Read a trace file (``--link-emulation trace=FILE.csv``)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"cannot read link trace {str(path)!r}: {exc}") from exc
    return parse_trace(text, source=str(path))


def step_trace(points: Sequence[tuple[float, LinkSpec]], source: str = "trace") -> LinkTrace:
    """A trace from ``(start_s, link)`` pairs, e.g. for a test or a benchmark."""
    return LinkTrace(tuple(TraceStep(start_s, link) for start_s, link in points), source=source)
