"""Split plans of a trained model, latency composed from parts measured here.

``bottleneck.py`` asks whether any plan that runs layers on the device beats
uploading the frame as JPEG. Two kinds of split are measured on the held-out requests:

- ``tierflow-lowbit``: the device runs the model up to a cut and sends the features with a
  low-bit codec (``int8``/``int4``/``int2``, ``sparse+``, ``drop+``, zstd behind), the
  cloud runs the rest;
- ``tierflow-budget``: the planner's own choice (:func:`tierflow.partitioner.ranking.rank`) under
  a fidelity budget, with the image input declared (``--image-input``), so its search
  space holds the JPEG/WebP/PNG uploads themselves as well as every split; profiled here
  and emulated 10x/2x/1x as ``tierflow plan`` does, its lossy candidates measured on the
  calibration pages, never on the held-out ones it is judged on.

Parts are timed as ``benchmarks/comparison/run.py`` times them: the calling thread's CPU time (ONNX
Runtime with one intra-op thread, the codecs and zstd all compute on it), which other jobs
on this shared machine cannot inflate, median over the timed requests. A plan's latency
follows the cost model's [Note: what crosses a link] in ``partitioner/cost.py``: each
tier's compute times its slowdown, encode times the sender's and decode times the
receiver's, a link its serialisation plus one RTT; an edge with no work forwards the
device's bytes (one encode on the device, one decode on the cloud). Fidelity is
measured end to end by the planner's ``FidelityProbe``.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from benchmarks.lib import emulation as emu
from benchmarks.lib import timing
from tierflow.link.spec import LinkSpec

logger = logging.getLogger(__name__)

#: Low-bit codecs tried at every cut (the planner's lossy ones and the drop+ variant).
LOWBIT_CODECS: tuple[str, ...] = (
    "int8+zstd",
    "int4+zstd",
    "int2+zstd",
    "sparse+int4+zstd",
    "drop+sparse+int4+zstd",
)


def shrinking_cuts(graph: Any) -> list[int]:
    """The first cut (least device compute), then each cut smaller than every earlier one."""
    last = len(graph.cuts) - 1
    chosen, smallest = [], graph.cuts[0].nbytes
    for cut in graph.cuts[1:last]:
        if cut.index == 1 or cut.nbytes < smallest:
            chosen.append(cut.index)
            smallest = min(smallest, cut.nbytes)
    return chosen


class Parts:
    """Measured parts of split plans of one model on the held-out requests.

    Segment and codec times are medians over the first ``timed`` requests (``repeats``
    runs each); bytes are means over all held-out requests; fidelity is over all of them.
    """

    def __init__(
        self,
        graph: Any,
        requests: Sequence[Mapping[str, np.ndarray]],
        images: Mapping[str, Any],
        *,
        timed: int,
        repeats: int,
    ) -> None:
        from tierflow.partitioner.fidelity_probe import FidelityProbe

        self.graph = graph
        self.images = dict(images)
        self.probe = FidelityProbe(graph, [dict(r) for r in requests], images=images)
        self.last = self.probe.last
        self.timed = min(timed, len(requests))
        self.repeats = repeats
        self._segments: dict[tuple[int, int], float] = {}
        self._codecs: dict[tuple[int, str], dict[str, float]] = {}
        self._fidelity: dict[tuple[Any, ...], float] = {}

    def segment_ms(self, start: int, end: int) -> float:
        """CPU ms here of cuts ``[start, end)`` (0 when empty)."""
        if start >= end:
            return 0.0
        if (start, end) not in self._segments:
            from tierflow.partitioner.split import extract_segment

            session = timing.session(extract_segment(self.graph, start, end))
            names = [i.name for i in session.get_inputs()]
            times = []
            for index in range(self.timed):
                features = self.probe.crossing(start, index)
                feeds = {n: features[n] for n in names}
                _, ms = timing.cpu_ms(self.repeats, session.run, None, feeds)
                times.append(ms)
            self._segments[(start, end)] = statistics.median(times)
        return self._segments[(start, end)]

    def codec(self, cut: int, codec: str) -> dict[str, float]:
        """Mean bytes, median encode and decode CPU ms here of cut ``cut``'s tensors."""
        key = (cut, codec)
        if key not in self._codecs:
            from tierflow.codec.base import CodecSpec, decode, encode

            spec = CodecSpec.parse(codec)
            plain = spec.lossless_part() if spec.image else spec
            sizes, enc, dec = [], [], []
            for index in range(len(self.probe.requests)):
                features = self.probe.crossing(cut, index)
                size, e_ms, d_ms = 0, 0.0, 0.0
                timed = index < self.timed
                for name, array in features.items():
                    norm = self.images.get(name) if spec.image else None
                    args = (name, array, spec if norm else plain)
                    if timed:
                        encoded, ms = timing.cpu_ms(self.repeats, encode, *args, image=norm)
                        e_ms += ms
                        _, ms = timing.cpu_ms(self.repeats, decode, encoded)
                        d_ms += ms
                    else:
                        encoded = encode(*args, image=norm)
                    size += encoded.nbytes
                sizes.append(size)
                if timed:
                    enc.append(e_ms)
                    dec.append(d_ms)
            self._codecs[key] = {
                "bytes": float(np.mean(sizes)),
                "encode_ms": statistics.median(enc),
                "decode_ms": statistics.median(dec),
            }
        return self._codecs[key]

    def adopt(
        self,
        *,
        codecs: Mapping[tuple[int, str], Mapping[str, float]] | None = None,
        segments: Mapping[tuple[int, int], float] | None = None,
    ) -> None:
        """Take figures measured elsewhere on the same held-out requests, in the same
        CPU time: ``codecs[(cut, codec)]`` (``bytes``, ``encode_ms``, ``decode_ms``) and
        ``segments[(start, end)]`` (ms here).

        So a plan that is a baseline (the planner's JPEG upload is ``cloud-only-jpeg-qNN``
        itself) composes from the very figures the baseline's row does, and the two rows
        differ only where the plans do, not by two measurements' noise.
        """
        for key, figures in (codecs or {}).items():
            self._codecs[key] = {k: float(figures[k]) for k in ("bytes", "encode_ms", "decode_ms")}
        self._segments.update(segments or {})

    def fidelity(self, cuts: tuple[int, int], codec: Mapping[str, str]) -> float:
        """Top-1 agreement with the exact model over the held-out requests."""
        from tierflow.partitioner.fidelity import FidelityBudget

        key = (cuts, tuple(sorted(codec.items())))
        if key not in self._fidelity:
            measured = self.probe.measure(cuts, codec, FidelityBudget("top1", 1.0))
            self._fidelity[key] = measured.score.value
        return self._fidelity[key]

    def compose(
        self, cuts: tuple[int, int], codec: Mapping[str, str], link: LinkSpec
    ) -> dict[str, Any]:
        """Latency of plan ``cuts`` with ``codec`` per link at device-edge ``link``.

        Parts in ms (device, edge, cloud compute; codec; wire) and bytes per link.
        """
        a, b = cuts
        slow = {name: spec.slowdown for name, spec in emu.TIER_SPECS.items()}
        parts = {
            "device": self.segment_ms(0, a) * slow["device"],
            "edge": self.segment_ms(a, b) * slow["edge"],
            "cloud": self.segment_ms(b, self.last) * slow["cloud"],
            "codec": 0.0,
            "wire": 0.0,
        }
        sent: dict[str, float] = {}
        if a == b < self.last:
            # The edge runs nothing and forwards the device's bytes as they came ([Note: an
            # edge that runs nothing] in tierflow.plan): one encode on the device, one
            # decode on the cloud, the same bytes on both links.
            figures = self.codec(a, codec.get("device-edge", "raw"))
            parts["codec"] = (
                figures["encode_ms"] * slow["device"] + figures["decode_ms"] * slow["cloud"]
            )
            for name, spec in (("device-edge", link), ("edge-cloud", emu.EDGE_CLOUD)):
                parts["wire"] += (figures["bytes"] * 8.0 / spec.rate_bps + spec.rtt_s) * 1e3
                sent[name] = figures["bytes"]
            return {"p50_ms": sum(parts.values()), "parts_ms": parts, "bytes": sent}
        crossings = (
            ("device-edge", a, link, "device", "edge"),
            ("edge-cloud", b, emu.EDGE_CLOUD, "edge", "cloud"),
        )
        for name, cut, spec, sender, receiver in crossings:
            if cut >= self.last:
                continue
            figures = self.codec(cut, codec.get(name, "raw"))
            parts["codec"] += (
                figures["encode_ms"] * slow[sender] + figures["decode_ms"] * slow[receiver]
            )
            parts["wire"] += (figures["bytes"] * 8.0 / spec.rate_bps + spec.rtt_s) * 1e3
            sent[name] = figures["bytes"]
        return {"p50_ms": sum(parts.values()), "parts_ms": parts, "bytes": sent}


def lowbit_points(parts: Parts, cuts: Sequence[int], codecs: Sequence[str]) -> list[dict[str, Any]]:
    """Each low-bit codec at each cut (device up to the cut, cloud the rest): the figures."""
    points = []
    for a in cuts:
        for codec in codecs:
            figures = parts.codec(a, codec)
            points.append(
                {
                    "cut": a,
                    "cut_position": parts.graph.cuts[a].position,
                    "tensors": list(parts.graph.cuts[a].tensors),
                    "codec": codec,
                    "bytes": figures["bytes"],
                    "encode_ms_here": figures["encode_ms"],
                    "decode_ms_here": figures["decode_ms"],
                    "device_ms_here": parts.segment_ms(0, a),
                    "cloud_ms": parts.segment_ms(a, parts.last),
                    # Cloud-run rest, one crossing: the edge forwards the bytes.
                    "fidelity": parts.fidelity((a, parts.last), {"device-edge": codec}),
                }
            )
            logger.info("[bench] low-bit %s", points[-1])
    return points


def lowbit_row(point: Mapping[str, Any], mbit: float, link: LinkSpec) -> dict[str, Any]:
    """A ``tierflow-lowbit`` row at ``mbit``: device, encode, both links, decode, cloud."""
    device = point["device_ms_here"] * emu.TIER_SPECS["device"].slowdown
    codec_ms = point["encode_ms_here"] * emu.TIER_SPECS["device"].slowdown + point["decode_ms_here"]
    wire = sum(
        (point["bytes"] * 8.0 / spec.rate_bps + spec.rtt_s) * 1e3 for spec in (link, emu.EDGE_CLOUD)
    )
    return {
        "bandwidth_mbit": mbit,
        "strategy": "tierflow-lowbit",
        "variant": f"cut {point['cut']} {point['codec']}",
        "p50_ms": device + codec_ms + wire + point["cloud_ms"],
        "fidelity": point["fidelity"],
        "codec": point["codec"],
        "bytes": {"device-edge": point["bytes"], "edge-cloud": point["bytes"]},
        "parts_ms": {"device": device, "codec": codec_ms, "wire": wire, "cloud": point["cloud_ms"]},
        "cuts": [point["cut"], point["cut"]],
        "measured": "composed",
    }


def planner_choices(
    graph: Any,
    calibration: Mapping[str, np.ndarray],
    images: Mapping[str, Any],
    budget: str,
    links: Mapping[float, LinkSpec],
) -> tuple[dict[float, Any], list[str]]:
    """The planner's best plan at each device-edge rate, as ``tierflow plan`` would choose it.

    ``--codec auto --fidelity BUDGET --image-input``: profiled on this machine and emulated
    10x/2x/1x, lossy candidates measured on ``calibration`` (``IN.npz`` arrays).
    """
    from tierflow.partitioner.candidates import codec_candidates
    from tierflow.partitioner.fidelity import FidelityBudget
    from tierflow.partitioner.fidelity_probe import FidelityProbe, sample_requests
    from tierflow.partitioner.plan_options import PlanOptions
    from tierflow.partitioner.ranking import rank
    from tierflow.partitioner.tier_profiles import complete_profiles

    fidelity = FidelityBudget.parse(budget)
    codecs = codec_candidates("auto", fidelity, tuple(images))
    emulation = {name: spec.slowdown for name, spec in emu.TIER_SPECS.items()}
    profiles, notes = complete_profiles(graph, {}, emulation=emulation, codecs=codecs)
    probe = FidelityProbe(graph, sample_requests(graph.inputs, calibration), images=images)
    chosen = {}
    for mbit, link in links.items():
        options = PlanOptions(
            links={"device-edge": link, "edge-cloud": emu.EDGE_CLOUD},
            fidelity=fidelity,
            images=images,
        )
        result, more = rank(graph, profiles, options, probe=probe)
        chosen[mbit] = result.best
        notes += more
        logger.info(
            "[bench] planner at %g Mbit/s: cuts %s %s, predicted %.1f ms",
            mbit,
            result.best.cuts,
            result.best.codec,
            result.best.latency_s * 1e3,
        )
    return chosen, notes


def planner_row(
    parts: Parts, best: Any, mbit: float, link: LinkSpec, strategy: str = "tierflow-budget"
) -> dict[str, Any]:
    """A planner's row (``tierflow-budget``, or ``strategy`` for another budget): its plan
    at ``mbit``, composed and measured here."""
    cuts = (int(best.cuts[0]), int(best.cuts[1]))
    codec = dict(best.codec)
    composed = parts.compose(cuts, codec, link)
    used = {name: c for name, c in codec.items()}
    return {
        "bandwidth_mbit": mbit,
        "strategy": strategy,
        "variant": f"cuts {cuts[0]},{cuts[1]} " + " ".join(f"{k}={v}" for k, v in used.items()),
        "p50_ms": composed["p50_ms"],
        "predicted_ms": best.latency_s * 1e3,
        "fidelity": parts.fidelity(cuts, codec),
        "codec": " / ".join(used.values()) or "none",
        "codec_used": used,
        "bytes": composed["bytes"],
        "parts_ms": composed["parts_ms"],
        "cuts": list(cuts),
        "measured": "composed",
    }
