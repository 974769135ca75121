"""The link model: what crossing a link costs, and the names of the links.

A link carries features one way between two neighbouring tiers. Its cost for a message
of ``n`` bytes is ``n * 8 / rate + rtt / 2`` (serialisation plus one-way propagation);
the cost model adds the codec's encode and decode time on either side.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from tierflow.errors import UsageError, shown
from tierflow.units import format_duration, format_rate, parse_duration, parse_rate

TIERS: tuple[str, ...] = ("device", "edge", "cloud")
LINKS: tuple[str, ...] = ("device-edge", "edge-cloud")


def link_between(lower: str, upper: str) -> str:
    """The name of the link between two neighbouring tiers, e.g. ``device-edge``."""
    return f"{lower}-{upper}"


def downstream_link(tier: str) -> str | None:
    """The link a tier's replies travel on (None for the device)."""
    rank = TIERS.index(tier)
    return link_between(TIERS[rank - 1], tier) if rank > 0 else None


def upstream_link(tier: str) -> str | None:
    """The link a tier forwards requests on (None for the cloud)."""
    rank = TIERS.index(tier)
    return link_between(tier, TIERS[rank + 1]) if rank + 1 < len(TIERS) else None


def check_tier(name: str) -> str:
    """Return ``name`` if it is a tier name, else raise a :class:`UsageError`."""
    if name not in TIERS:
        raise UsageError(f"unknown tier {name!r}: expected one of {', '.join(TIERS)}")
    return name


def check_link(name: str) -> str:
    """Return ``name`` if it is a link name, else raise a :class:`UsageError`."""
    if name not in LINKS:
        raise UsageError(f"unknown link {shown(name)}: expected one of {', '.join(LINKS)}")
    return name


def _rate_and_rtt(text: str) -> tuple[float, float | None]:
    """``RATE[,RTT]`` as typed: the rate in bits per second, the RTT (None if not given)."""
    rate, _, rtt = text.partition(",")
    return parse_rate(rate), parse_duration(rtt) if rtt.strip() else None


@dataclass(frozen=True)
class LinkSpec:
    """Rate (bits per second) and round-trip time (seconds) of one link."""

    rate_bps: float
    rtt_s: float = 0.0

    def __post_init__(self) -> None:
        if not 0 < self.rate_bps < math.inf:
            raise UsageError(f"a link rate must be positive and finite, got {self.rate_bps!r}")
        if not 0 <= self.rtt_s < math.inf:
            raise UsageError(f"a link RTT must be finite and not negative, got {self.rtt_s!r}")

    @classmethod
    def parse(cls, text: str, default_rtt_s: float = 0.0) -> LinkSpec:
        """Read ``RATE[,RTT]`` as the command line writes it, e.g. ``20mbit,10ms``.

        Without an RTT the link gets ``default_rtt_s``. A ``--link NAME=...`` value is a
        :class:`LinkOption`, which keeps the RTT the link had instead.
        """
        rate_bps, rtt_s = _rate_and_rtt(text)
        return cls(rate_bps, default_rtt_s if rtt_s is None else rtt_s)

    def transfer_s(self, nbytes: float) -> float:
        """Seconds for ``nbytes`` to arrive: serialisation plus one-way propagation."""
        return nbytes * 8.0 / self.rate_bps + self.rtt_s / 2.0

    def __str__(self) -> str:
        return f"{format_rate(self.rate_bps)},{format_duration(self.rtt_s)}"

    def to_dict(self) -> dict[str, Any]:
        return {"rate_bps": self.rate_bps, "rtt_s": self.rtt_s}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LinkSpec:
        try:
            return cls(float(data["rate_bps"]), float(data.get("rtt_s", 0.0)))
        except (KeyError, TypeError, ValueError) as exc:
            raise UsageError(f"malformed link {shown(data)}: expected rate_bps and rtt_s") from exc


@dataclass(frozen=True)
class LinkOption:
    """One ``NAME=RATE[,RTT]`` value, parsed once: which link, its rate, and its RTT if given.

    ``rtt_s`` is None when the value named no RTT: a rate alone says how fast the link
    is, not that it has no latency, so the link keeps the RTT it had (:meth:`spec`: the
    planner's default links for ``plan``, the plan's links on a runtime). Commands print
    the RTT they kept for such values (:attr:`rtt_given`). The same value is what
    ``plan --link``, ``demo --link`` and the runtimes' ``--emulate-link`` take.
    """

    name: str
    rate_bps: float
    rtt_s: float | None = None

    def __post_init__(self) -> None:
        check_link(self.name)
        LinkSpec(self.rate_bps, 0.0 if self.rtt_s is None else self.rtt_s)  # checks both

    @property
    def rtt_given(self) -> bool:
        """Whether the value named an RTT (``device-edge=20mbit,10ms``: yes)."""
        return self.rtt_s is not None

    @classmethod
    def parse(cls, text: str, option: str = "--link") -> LinkOption:
        """Read ``NAME=RATE[,RTT]``, like ``device-edge=20mbit,10ms``; ``option`` names the flag."""
        name, sep, value = text.partition("=")
        if not sep or not name.strip() or not value.strip():
            raise UsageError(
                f"malformed {option} {shown(text)}: expected NAME=RATE[,RTT], like "
                "device-edge=20mbit,10ms"
            )
        return cls(check_link(name.strip()), *_rate_and_rtt(value))

    @classmethod
    def of(cls, name: str, spec: LinkSpec) -> LinkOption:
        """A link given whole (rate and RTT), as a probe file gives it."""
        return cls(name, spec.rate_bps, spec.rtt_s)

    def spec(self, links: Mapping[str, LinkSpec] | None = None) -> LinkSpec:
        """The link this value sets: without an RTT, the one ``links`` has for it (else 0)."""
        if self.rtt_s is not None:
            return LinkSpec(self.rate_bps, self.rtt_s)
        before = (links or {}).get(self.name)
        return LinkSpec(self.rate_bps, before.rtt_s if before is not None else 0.0)

    def __str__(self) -> str:
        rtt = "" if self.rtt_s is None else f",{format_duration(self.rtt_s)}"
        return f"{self.name}={format_rate(self.rate_bps)}{rtt}"


def apply_links(
    links: Mapping[str, LinkSpec], options: Iterable[LinkOption]
) -> dict[str, LinkSpec]:
    """``links`` with each of ``options`` applied in order (a later value wins)."""
    result = dict(links)
    for option in options:
        result[option.name] = option.spec(result)
    return result
