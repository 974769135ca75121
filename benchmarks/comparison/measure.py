"""Measuring plans: every stage of every candidate plan, run for real on real requests.

See [Note: how plans are measured]. The cost model predicts a plan from per-unit profiles;
this module measures it instead: the plan's actual segment files (cut out of the model by
``split_model``) run in ONNX Runtime on each request, and the tensors that actually cross
each cut are encoded and decoded with each codec. Latency of a plan at a link setting is
then composed per request from those measurements, so one measuring pass serves every
bandwidth of the sweep and every codec pair.

[Note: how plans are measured]
A plan is cuts ``a <= b`` (device ``[0, a)``, edge ``[a, b)``, cloud ``[b, last)``) and a
codec per link. For request ``i``:

    latency_i = dev * T_prefix(a)_i + edge * T_middle(a, b)_i + cloud * T_suffix(b)_i
              + Σ_links used [ sender * enc_i + bytes_i * 8 / rate + RTT
                               + receiver * dec_i + reply_bytes * 8 / rate ]

except that an edge that runs nothing (``a == b < last``) forwards the device's bytes as
they came, as the runtime does: the device-edge codec crosses both links, encoded once on
the device and decoded once on the cloud (no edge decode or encode).

where ``dev``, ``edge`` and ``cloud`` are the tiers' slowdowns (1-thread sessions timed on
this machine, times the slowdown: what ``SegmentRunner`` sleeps to emulate), ``T_*`` are
the measured times of that request through those exact segment files, and ``enc_i``,
``bytes_i``, ``dec_i`` are the measured encode time, encoded size and decode time of that
request's own features at the cut. The link term is the runtime link shaper's model
(serialisation plus RTT/2 each way, the answer coming back uncompressed). Nothing here
reads the profiles the planner used: measurements are taken independently, later.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import onnxruntime as ort

from benchmarks.lib import timing
from tierflow.codec import base as codec_lib
from tierflow.link.spec import LinkSpec

logger = logging.getLogger(__name__)

# Stage times are the calling thread's CPU time: ONNX Runtime with one intra-op thread
# computes on the calling thread, and so do numpy and zstd, so other jobs sharing this
# machine cannot inflate them (wall time on a busy 2-core machine can be 5x the CPU
# time). On a dedicated core, which is what each emulated tier stands for, the two agree.
_clock = time.thread_time

Progress = Callable[[str], None]
Key = TypeVar("Key")


@dataclass
class CodecSample:
    """One codec on one cut's crossing tensors, per request: seconds, bytes, seconds."""

    encode_s: np.ndarray
    nbytes: np.ndarray
    decode_s: np.ndarray


@dataclass
class Measurements:
    """Per-request stage times of one model's candidate plans. See the module note."""

    model: str
    last: int
    requests: int
    cuts: tuple[int, ...]
    raw_bytes: dict[int, int] = field(default_factory=dict)
    prefix_s: dict[int, np.ndarray] = field(default_factory=dict)
    suffix_s: dict[int, np.ndarray] = field(default_factory=dict)
    middle_s: dict[tuple[int, int], np.ndarray] = field(default_factory=dict)
    codecs: dict[int, dict[str, CodecSample]] = field(default_factory=dict)
    reply_bytes: int = 0
    seconds: float = 0.0
    rounds: int = 1

    def pairs(self) -> list[tuple[int, int]]:
        """Every measured cut pair ``(a, b)``."""
        out = [(a, a) for a in self.cuts]
        out += list(self.middle_s)
        return sorted(set(out))

    def has(self, a: int, b: int) -> bool:
        return a in self.prefix_s and b in self.suffix_s and (a == b or (a, b) in self.middle_s)


def _time_runs(
    session: ort.InferenceSession, feeds: Sequence[Mapping[str, np.ndarray]]
) -> tuple[np.ndarray, list[dict[str, np.ndarray]]]:
    """Run every request once (after one untimed warm-up); seconds and outputs per request."""
    names = [o.name for o in session.get_outputs()]
    inputs = [i.name for i in session.get_inputs()]
    session.run(names, {n: feeds[0][n] for n in inputs})
    times = np.zeros(len(feeds))
    outputs: list[dict[str, np.ndarray]] = []
    for i, feed in enumerate(feeds):
        args = {n: feed[n] for n in inputs}
        start = _clock()
        values = session.run(names, args)
        times[i] = _clock() - start
        outputs.append(dict(zip(names, values, strict=True)))
    return times, outputs


def measure_codecs(
    tensors: Sequence[Mapping[str, np.ndarray]],
    codecs: Sequence[str],
    images: Mapping[str, codec_lib.ImageNorm] | None = None,
) -> dict[str, CodecSample]:
    """Encode and decode each request's crossing tensors with every codec, timing both.

    An image codec sends the tensors named in ``images`` as images (with their
    normalisation) and the others with its lossless part, as the runtime does.
    """
    samples: dict[str, CodecSample] = {}
    norms = dict(images or {})
    for name in codecs:
        spec = codec_lib.CodecSpec.parse(name)
        plain = spec.lossless_part() if spec.image else spec
        enc = np.zeros(len(tensors))
        dec = np.zeros(len(tensors))
        size = np.zeros(len(tensors))
        for i, group in enumerate(tensors):
            start = _clock()
            encoded = [
                codec_lib.encode(n, a, spec, image=norms[n])
                if spec.image and n in norms
                else codec_lib.encode(n, a, plain)
                for n, a in group.items()
            ]
            enc[i] = _clock() - start
            size[i] = sum(t.nbytes for t in encoded)
            start = _clock()
            for t in encoded:
                codec_lib.decode(t)
            dec[i] = _clock() - start
        samples[name] = CodecSample(enc, size, dec)
    return samples


def _segment(graph: Any, start: int, end: int) -> Any | None:
    """The segment file for cuts ``start..end``, or None when it holds no nodes."""
    from tierflow.partitioner.split import extract_segment

    if start >= end or graph.cuts[start].position == graph.cuts[end].position:
        return None
    return extract_segment(graph, start, end)


def measure_model(
    name: str,
    graph: Any,
    requests: Sequence[Mapping[str, np.ndarray]],
    cuts: Sequence[int],
    pairs: Sequence[tuple[int, int]],
    codecs: Sequence[str],
    *,
    threads: int = 1,
    rounds: int = 1,
    progress: Progress | None = None,
    extra_codecs: Mapping[int, Sequence[str]] | None = None,
    images: Mapping[str, codec_lib.ImageNorm] | None = None,
) -> Measurements:
    """Measure prefixes, suffixes and middles of ``pairs`` over ``cuts`` on ``requests``.

    ``codecs`` are measured at every cut, ``extra_codecs[k]`` at cut ``k`` only (the image
    uploads at cut 0, a budgeted plan's lossy codecs at its cuts); ``images`` are the
    image inputs' normalisations, which image codecs need.

    ``graph`` is a :class:`tierflow.partitioner.graph.ModelGraph`; segments are cut out
    with the partitioner's own ``extract_segment`` (what ``split_model`` writes into plan
    directories). Only one cut's features are held at a time, so large models fit.

    With ``rounds`` > 1 the whole pass is repeated and every stage keeps, per request, its
    fastest round. On a shared machine (this one is a VM whose CPU time still grows
    when neighbours thrash caches and memory) a busy spell then costs a stage one round,
    not the result; rounds are a whole pass apart, so they rarely share a spell.
    """
    started = time.perf_counter()
    extra = {k: tuple(v) for k, v in (extra_codecs or {}).items()}
    norms = dict(images or {})
    args = (name, graph, requests, cuts, pairs, codecs, extra, norms, threads, progress)
    result = _measure_once(*args)
    for _ in range(rounds - 1):
        again = _measure_once(*args)
        _keep_fastest(result.prefix_s, again.prefix_s)
        _keep_fastest(result.suffix_s, again.suffix_s)
        _keep_fastest(result.middle_s, again.middle_s)
        for cut, samples in again.codecs.items():
            for codec, sample in samples.items():
                mine = result.codecs[cut][codec]
                mine.encode_s = np.minimum(mine.encode_s, sample.encode_s)
                mine.decode_s = np.minimum(mine.decode_s, sample.decode_s)
    result.rounds = rounds
    result.seconds = time.perf_counter() - started
    return result


def _keep_fastest(mine: dict[Key, np.ndarray], other: Mapping[Key, np.ndarray]) -> None:
    for key, values in other.items():
        mine[key] = np.minimum(mine[key], values)


def _measure_once(
    name: str,
    graph: Any,
    requests: Sequence[Mapping[str, np.ndarray]],
    cuts: Sequence[int],
    pairs: Sequence[tuple[int, int]],
    codecs: Sequence[str],
    extra: Mapping[int, Sequence[str]],
    images: Mapping[str, codec_lib.ImageNorm],
    threads: int,
    progress: Progress | None,
) -> Measurements:
    """One pass of :func:`measure_model`."""
    last = len(graph.cuts) - 1
    cut_list = sorted(set(cuts) | {0, last} | {k for k in extra if k < last})
    wanted = sorted({(a, b) for a, b in pairs if a < b and a in cut_list and b in cut_list})
    result = Measurements(name, last, len(requests), tuple(cut_list))
    zeros = np.zeros(len(requests))
    for k in cut_list:
        if progress is not None:
            progress(f"{name}: cut {k}/{last}")
        crossing = list(graph.cuts[k].tensors)
        prefix = _segment(graph, 0, k)
        if prefix is None:
            result.prefix_s[k] = zeros.copy()
            envs = [{t: np.asarray(r[t]) for t in crossing} for r in requests]
        else:
            times, envs = _time_runs(timing.session(prefix, threads=threads), requests)
            result.prefix_s[k] = times
        suffix = _segment(graph, k, last)
        if suffix is None:
            result.suffix_s[k] = zeros.copy()
        else:
            times, outs = _time_runs(timing.session(suffix, threads=threads), envs)
            result.suffix_s[k] = times
            result.reply_bytes = sum(int(v.nbytes) for v in outs[0].values())
        groups = [{t: np.ascontiguousarray(env[t]) for t in crossing} for env in envs]
        result.raw_bytes[k] = sum(int(a.nbytes) for a in groups[0].values())
        if k < last:
            here = list(dict.fromkeys([*codecs, *extra.get(k, ())]))
            result.codecs[k] = measure_codecs(groups, here, images)
        for a, b in wanted:
            if a != k:
                continue
            middle = _segment(graph, a, b)
            if middle is None:
                result.middle_s[(a, b)] = zeros.copy()
                continue
            times, _ = _time_runs(timing.session(middle, threads=threads), envs)
            result.middle_s[(a, b)] = times
    return result


# --------------------------------------------------------------------------- composing


@dataclass(frozen=True)
class Composed:
    """A plan's composed per-request latency (seconds) and its parts' medians."""

    cuts: tuple[int, int]
    codec: dict[str, str]
    latency_s: np.ndarray
    parts_ms: dict[str, float]
    bytes: dict[str, float]

    @property
    def p50_ms(self) -> float:
        return float(np.median(self.latency_s) * 1e3)

    @property
    def p90_ms(self) -> float:
        return float(np.percentile(self.latency_s, 90) * 1e3)


def compose(
    m: Measurements,
    a: int,
    b: int,
    codec: Mapping[str, str],
    links: Mapping[str, LinkSpec],
    slowdown: Mapping[str, float],
) -> Composed:
    """Latency of plan ``(a, b, codec)`` per request at ``links`` (see the module note)."""
    last = m.last
    dev, edge, cloud = slowdown["device"], slowdown["edge"], slowdown["cloud"]
    middle = m.middle_s[(a, b)] if a < b else np.zeros(m.requests)
    parts: dict[str, np.ndarray] = {
        "device": dev * m.prefix_s[a],
        "edge": edge * middle,
        "cloud": cloud * m.suffix_s[b],
    }
    sent: dict[str, float] = {}
    chosen: dict[str, str] = {}
    # An edge that runs nothing forwards the device's bytes as they came ([Note: an edge
    # that runs nothing] in tierflow/plan.py): the device-edge codec crosses both links,
    # encoded on the device and decoded on the cloud; the edge spends nothing on it.
    forwards = a == b < last
    for link, cut, sender, receiver, used in (
        ("device-edge", a, dev, 0.0 if forwards else edge, a < last),
        ("edge-cloud", b, 0.0 if forwards else edge, cloud, b < last),
    ):
        if not used:
            continue
        name = codec["device-edge" if forwards else link]
        sample = m.codecs[cut][name]
        spec = links[link]
        parts[f"{link} codec"] = sender * sample.encode_s + receiver * sample.decode_s
        parts[f"{link} wire"] = (
            sample.nbytes * 8.0 / spec.rate_bps + spec.rtt_s + m.reply_bytes * 8.0 / spec.rate_bps
        )
        sent[link] = float(np.median(sample.nbytes))
        chosen[link] = name
    total = np.sum(list(parts.values()), axis=0)
    return Composed(
        cuts=(a, b),
        codec=chosen,
        latency_s=total,
        parts_ms={k: float(np.median(v) * 1e3) for k, v in parts.items()},
        bytes=sent,
    )


def device_ms_here(m: Measurements, a: int, codec: str | None) -> float:
    """The device's own work in plan ``(a, ...)`` on this machine (ms, median per request):
    its segment ``[0, a)`` plus encoding what it sends at ``a`` with ``codec``.

    Composed latency charges it ``slowdown`` times; a row at another device speed is the
    same row with this share scaled (``comparison.fronts.at_device_speed``).
    """
    work = np.array(m.prefix_s[a], dtype=float)
    if a < m.last and codec is not None:
        work = work + m.codecs[a][codec].encode_s
    return float(np.median(work) * 1e3)


def best_plan(
    m: Measurements,
    links: Mapping[str, LinkSpec],
    slowdown: Mapping[str, float],
    codecs: Sequence[str],
    *,
    only: Callable[[int, int], bool] | None = None,
) -> tuple[Composed, int]:
    """The measured-fastest plan (by p50) over measured cut pairs and codec pairs.

    Returns it and how many plans were compared. ``only`` restricts the cut pairs.
    """
    best: Composed | None = None
    count = 0
    for a, b in m.pairs():
        if not m.has(a, b) or (only is not None and not only(a, b)):
            continue
        de_options = codecs if a < m.last else codecs[:1]
        # An edge that runs nothing forwards the device-edge codec: one choice, not two.
        ec_options = codecs if a < b < m.last else codecs[:1]
        for de in de_options:
            for ec in ec_options:
                plan = compose(m, a, b, {"device-edge": de, "edge-cloud": ec}, links, slowdown)
                count += 1
                if best is None or plan.p50_ms < best.p50_ms:
                    best = plan
    assert best is not None, "no measured plan"
    return best, count


def median_ms(values: Sequence[float]) -> float:
    return statistics.median(values) * 1e3 if values else float("nan")
