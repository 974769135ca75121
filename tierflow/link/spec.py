"""The link model: what crossing a link costs, and the names of the links.

A link carries features one way between two neighbouring tiers. Its cost for a message
of ``n`` bytes is ``n * 8 / rate + rtt / 2`` (serialisation plus one-way propagation);
the cost model adds the codec's encode and decode time on either side.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tierflow.errors import UsageError
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
        raise UsageError(f"unknown link {name!r}: expected one of {', '.join(LINKS)}")
    return name


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

        Without an RTT the link gets ``default_rtt_s``; :func:`parse_link_option` passes
        the RTT the link had before (see its note), never a silent 0 for a named link.
        """
        rate, _, rtt = text.partition(",")
        return cls(parse_rate(rate), parse_duration(rtt) if rtt else default_rtt_s)

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
            raise UsageError(f"malformed link {data!r}: expected rate_bps and rtt_s") from exc


def parse_link_option(
    text: str, defaults: Mapping[str, LinkSpec] | None = None
) -> tuple[str, LinkSpec]:
    """Read one ``--link NAME=RATE[,RTT]`` value.

    A value without an RTT keeps the RTT the link has in ``defaults`` (the planner's
    default links for ``plan``, the plan's links for ``serve`` and ``run``): a rate
    alone says how fast the link is, not that it has no latency. Commands print the RTT
    they assumed (:func:`rtt_given` tells which values lacked one).
    """
    name, sep, value = text.partition("=")
    if not sep or not value:
        raise UsageError(
            f"malformed --link {text!r}: expected NAME=RATE[,RTT], like device-edge=20mbit,10ms"
        )
    link = check_link(name.strip())
    default = (defaults or {}).get(link)
    return link, LinkSpec.parse(value, default.rtt_s if default is not None else 0.0)


def rtt_given(text: str) -> bool:
    """Whether a ``--link`` value names an RTT (``device-edge=20mbit,10ms``: yes)."""
    return "," in text.partition("=")[2]
