"""The emulated deployment the benchmark measures: three tiers and the links between them.

All three tiers run on this one machine, one ONNX Runtime thread each; a tier ``slowdown``
times slower than this machine is emulated the way ``tierflow profile --slowdown`` and
the runtime's ``SegmentRunner`` do it: what was measured here, times ``slowdown``.
Links are emulated by the link model of :mod:`tierflow.link.spec` (serialisation at the
rate plus RTT/2 each way), the same model the runtime's link shaper enforces.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tierflow.link.spec import LinkSpec


@dataclass(frozen=True)
class TierSpec:
    """How one tier is emulated: ONNX Runtime threads and slowdown against this machine."""

    name: str
    threads: int
    slowdown: float
    stands_for: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "threads": self.threads,
            "slowdown": self.slowdown,
            "stands_for": self.stands_for,
        }


TIER_SPECS: dict[str, TierSpec] = {
    "device": TierSpec("device", 1, 10.0, "a phone / Raspberry-Pi-class CPU core"),
    "edge": TierSpec("edge", 1, 2.0, "a small edge server core (half this machine's speed)"),
    "cloud": TierSpec("cloud", 1, 1.0, "one core of this machine"),
}

#: Device-edge rates swept (Mbit/s) and the RTT a link of that rate typically has.
DEVICE_EDGE_RTT_MS: dict[float, float] = {
    1.0: 40.0,  # weak cellular uplink
    5.0: 20.0,  # LTE uplink
    20.0: 10.0,  # good LTE / busy Wi-Fi
    50.0: 6.0,  # LTE-Advanced / a fair Wi-Fi uplink
    100.0: 4.0,  # Wi-Fi 5 to an on-site edge box
    1000.0: 1.0,  # wired gigabit to the edge box
}
QUICK_BANDWIDTHS: tuple[float, ...] = (1.0, 20.0, 1000.0)
FULL_BANDWIDTHS: tuple[float, ...] = tuple(DEVICE_EDGE_RTT_MS)

#: The edge-cloud link: a metro/WAN path from the edge site to a cloud region.
EDGE_CLOUD = LinkSpec(rate_bps=200e6, rtt_s=0.020)


def device_edge(mbit: float) -> LinkSpec:
    """The device-edge link at ``mbit`` Mbit/s with its typical RTT."""
    return LinkSpec(rate_bps=mbit * 1e6, rtt_s=DEVICE_EDGE_RTT_MS[mbit] / 1e3)


def links_at(mbit: float) -> dict[str, LinkSpec]:
    return {"device-edge": device_edge(mbit), "edge-cloud": EDGE_CLOUD}


def describe() -> dict[str, Any]:
    """The emulation as data, for results.json and RESULTS.md."""
    return {
        "tiers": {name: spec.to_dict() for name, spec in TIER_SPECS.items()},
        "device_edge": {
            f"{mbit:g}": {"rate_mbit": mbit, "rtt_ms": rtt}
            for mbit, rtt in DEVICE_EDGE_RTT_MS.items()
        },
        "edge_cloud": {"rate_mbit": EDGE_CLOUD.rate_bps / 1e6, "rtt_ms": EDGE_CLOUD.rtt_s * 1e3},
    }
