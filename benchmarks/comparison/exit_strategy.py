"""``tierflow-exits``: a tierflow plan run with early exits and the edge's feature cache.

Exits and caches make latency depend on the request (an easy one leaves early, a repeat
is answered from the cache), so this is measured per request by walking the plan the way
the runtime does ([Note: a request at a tier] in ``tierflow.runtime.tier``), in-process:

* the model is cut at the plan's cuts *and* at every exit's cut, and each piece runs in
  its own ONNX Runtime session (1 thread, times the tier's slowdown);
* after a piece that ends at an exit's cut, the exit head (extracted from the model that
  ``tierflow.partitioner.exits.add_exits`` grafted and calibrated) runs on the same tier
  and the runtime's rule decides (``segment_runner.exit_confidence`` ≥ threshold);
* crossing a link encodes and decodes the real tensors with the plan's codec (so lossy
  codecs reach the later pieces and the exits as they would in the runtime) and costs
  the link model's bytes × 8 / rate + RTT/2; the answer costs the same on the way back;
* the first tier after the device keeps the runtime's exact cache
  (``tierflow.cache.memory.MemoryCache``, keyed by ``cache.cache_key`` on the
  decoded features): a hit is answered there. Lookups are timed; stores are not (the
  edge stores the cloud's answers after passing them on, off the request's path).

The workload is held-out digits with a share of exact repeats (a camera looking at the
same scene); the same walk with exits and cache switched off gives plain tierflow on the
very same requests, for a like-for-like comparison.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from benchmarks.lib import timing
from tierflow.cache.base import CacheAnswer, cache_key
from tierflow.cache.memory import MemoryCache
from tierflow.codec import base as codec_lib
from tierflow.link.spec import LinkSpec
from tierflow.runtime.segment_runner import exit_confidence

logger = logging.getLogger(__name__)

# Stage times are the calling thread's CPU time: ONNX Runtime with one intra-op thread
# computes on the calling thread, and so do numpy and zstd, so other jobs sharing this
# machine cannot inflate them (wall time on a busy 2-core machine can be 5x the CPU
# time). On a dedicated core, which is what each emulated tier stands for, the two agree.
_clock = time.thread_time

REPEAT_SHARE = 0.25
CACHE_BUDGET = 64 << 20


@dataclass(frozen=True)
class Head:
    """One exit: the cut it reads, its head session and its calibrated threshold."""

    name: str
    cut: int
    session: ort.InferenceSession
    threshold: float


@dataclass(frozen=True)
class Walked:
    """One request's walk: latency, who answered, which exit, cache hit, class answered."""

    latency_s: float
    answered_by: str
    exit: str | None
    cache_hit: bool
    predicted: int


def _timed(
    session: ort.InferenceSession, feeds: Mapping[str, np.ndarray]
) -> tuple[float, dict[str, np.ndarray]]:
    names = [o.name for o in session.get_outputs()]
    args = {i.name: feeds[i.name] for i in session.get_inputs()}
    start = _clock()
    values = session.run(names, args)
    return _clock() - start, dict(zip(names, values, strict=True))


def workload(count: int, unique: int, seed: int = 0) -> list[int]:
    """Request order over ``unique`` inputs: ``REPEAT_SHARE`` of them repeat an earlier one."""
    rng = np.random.default_rng(seed)
    order: list[int] = []
    fresh = 0
    for _ in range(count):
        if order and rng.random() < REPEAT_SHARE:
            order.append(order[int(rng.integers(len(order)))])
        else:
            order.append(fresh % unique)
            fresh += 1
    return order


class PlanWalker:
    """Walks requests through one plan of ``graph`` with optional exits and cache."""

    def __init__(
        self,
        graph: Any,
        cuts: tuple[int, int],
        codec: Mapping[str, str],
        heads: Sequence[Head],
        slowdown: Mapping[str, float],
    ) -> None:
        from tierflow.partitioner.split import extract_segment

        self.graph = graph
        self.last = len(graph.cuts) - 1
        self.a, self.b = cuts
        self.codec = dict(codec)
        self.slowdown = dict(slowdown)
        self.heads = {h.cut: h for h in heads if 0 < h.cut < self.last}
        bounds = sorted({0, self.a, self.b, self.last, *self.heads})
        self.pieces: list[tuple[int, int, ort.InferenceSession | None]] = []
        for s, e in itertools.pairwise(bounds):
            empty = graph.cuts[s].position == graph.cuts[e].position
            self.pieces.append(
                (s, e, None if empty else timing.session(extract_segment(graph, s, e)))
            )
        self.plan_id = f"{cuts}-{sorted(self.codec.items())}"

    def tier(self, cut: int) -> str:
        return "device" if cut < self.a else ("edge" if cut < self.b else "cloud")

    def _cross(
        self,
        link: str,
        cut: int,
        env: dict[str, np.ndarray],
        sender: str,
        receiver: str,
        spec: LinkSpec,
    ) -> tuple[float, dict[str, np.ndarray]]:
        codec = codec_lib.CodecSpec.parse(self.codec[link])
        names = self.graph.cuts[cut].tensors
        start = _clock()
        encoded = [codec_lib.encode(n, np.ascontiguousarray(env[n]), codec) for n in names]
        enc = _clock() - start
        start = _clock()
        decoded = {t.name: codec_lib.decode(t) for t in encoded}
        dec = _clock() - start
        nbytes = sum(t.nbytes for t in encoded)
        seconds = (
            self.slowdown[sender] * enc
            + nbytes * 8.0 / spec.rate_bps
            + spec.rtt_s / 2
            + self.slowdown[receiver] * dec
        )
        return seconds, decoded

    def walk(
        self,
        inputs: Mapping[str, np.ndarray],
        links: Mapping[str, LinkSpec],
        cache: MemoryCache | None,
        use_exits: bool,
    ) -> Walked:
        env: dict[str, np.ndarray] = dict(inputs)
        total = 0.0
        hops: list[LinkSpec] = []
        key: bytes | None = None
        keyed: dict[str, np.ndarray] = {}
        answer_tier = "device"
        for s, e, session in self.pieces:
            if s == self.a and self.a < self.last and not hops:
                seconds, env = self._cross(
                    "device-edge", s, env, "device", "edge", links["device-edge"]
                )
                total += seconds
                hops.append(links["device-edge"])
                answer_tier = "edge"
                if cache is not None:
                    start = _clock()
                    keyed = dict(env)
                    key = cache_key(self.graph.sha256, self.plan_id, s, keyed)
                    hit = cache.lookup(key, keyed)
                    total += self.slowdown["edge"] * (_clock() - start)
                    if hit is not None:
                        return self._reply(total, hops, hit.outputs, "edge", hit.exit, True)
            if s == self.b and self.b < self.last and len(hops) < 2:
                seconds, env = self._cross(
                    "edge-cloud", s, env, "edge", "cloud", links["edge-cloud"]
                )
                total += seconds
                hops.append(links["edge-cloud"])
                answer_tier = "cloud"
            tier = self.tier(s)
            if session is not None:
                seconds, out = _timed(session, env)
                total += self.slowdown[tier] * seconds
                env.update(out)
            head = self.heads.get(e)
            if use_exits and head is not None:
                seconds, out = _timed(head.session, env)
                total += self.slowdown[tier] * seconds
                probs = out[head.name]
                if exit_confidence(probs) >= head.threshold:
                    walked = self._reply(total, hops, {head.name: probs}, tier, head.name, False)
                    if cache is not None and key is not None:
                        cache.store(key, keyed, CacheAnswer({head.name: probs}, head.name))
                    return walked
        outputs = {o.name: env[o.name] for o in self.graph.outputs}
        if cache is not None and key is not None:
            cache.store(key, keyed, CacheAnswer(dict(outputs), None))
        return self._reply(total, hops, outputs, answer_tier, None, False)

    def _reply(
        self,
        total: float,
        hops: Sequence[LinkSpec],
        outputs: Mapping[str, np.ndarray],
        tier: str,
        exit_name: str | None,
        hit: bool,
    ) -> Walked:
        nbytes = sum(int(np.asarray(v).nbytes) for v in outputs.values())
        for spec in hops:
            total += nbytes * 8.0 / spec.rate_bps + spec.rtt_s / 2
        scores = next(iter(outputs.values()))
        return Walked(total, tier, exit_name, hit, int(np.asarray(scores).reshape(-1).argmax()))


# --------------------------------------------------------------------------- driving


def exited_demo(work_dir: Path) -> tuple[Path, Path, list[Any], dict[str, Any]]:
    """The demo model and its copy with calibrated exits (made once, cached by sha256).

    Returns both paths, the exits (``ExitInfo``) and the calibration summary.
    """
    from tierflow.partitioner.exits.add import add_exits
    from tierflow.partitioner.exits.metadata import read_exit_summary, read_exits
    from tierflow.zoo.digits import build_demo_model

    demo = build_demo_model()
    sha = demo.meta.sha256.get("model.onnx", "")[:12] or "demo"
    path = work_dir / "models" / f"demo-exits-{sha}.onnx"
    if not path.is_file():
        logger.info("[bench] adding exits to the demo model (once)")
        exited = add_exits(demo.model_path, demo.calib_path)
        tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp.onnx")  # concurrent runs
        exited.save(tmp)
        tmp.replace(path)
    return demo.model_path, path, read_exits(path), read_exit_summary(path)


def exit_heads(exited_path: Path, graph: Any, exits: Sequence[Any]) -> list[Head]:
    """Each enabled exit's head as its own session, placed at its cut of ``graph``."""
    import onnx
    import onnx.shape_inference
    import onnx.utils

    from tierflow.partitioner.exits.cost import exit_cut_indices

    proto = onnx.shape_inference.infer_shapes(onnx.load(str(exited_path)))
    extractor = onnx.utils.Extractor(proto)
    cuts = exit_cut_indices(graph, exits)
    heads: list[Head] = []
    for info in exits:
        if info.threshold > 1.0 or info.name not in cuts:
            continue  # disabled by calibration, or not at a one-tensor cut
        model = extractor.extract_model([info.at], [info.name])
        heads.append(Head(info.name, cuts[info.name], timing.session(model), info.threshold))
    return heads


@dataclass(frozen=True)
class ExitPoint:
    """tierflow-exits at one bandwidth, and plain tierflow walked on the same requests."""

    latency_s: np.ndarray
    plain_s: np.ndarray
    answered_by: list[str]
    exits: list[str | None]
    hits: list[bool]
    predicted: np.ndarray
    plain_predicted: np.ndarray


def measure_point(
    walker: PlanWalker,
    requests: Sequence[Mapping[str, np.ndarray]],
    order: Sequence[int],
    links: Mapping[str, LinkSpec],
) -> ExitPoint:
    """Walk the workload with exits and a fresh cache, then without either."""
    walker.walk(requests[order[0]], links, None, True)  # warm the sessions
    cache = MemoryCache(CACHE_BUDGET)
    with_exits = [walker.walk(requests[i], links, cache, True) for i in order]
    plain = [walker.walk(requests[i], links, None, False) for i in order]
    return ExitPoint(
        latency_s=np.array([w.latency_s for w in with_exits]),
        plain_s=np.array([w.latency_s for w in plain]),
        answered_by=[w.answered_by for w in with_exits],
        exits=[w.exit for w in with_exits],
        hits=[w.cache_hit for w in with_exits],
        predicted=np.array([w.predicted for w in with_exits]),
        plain_predicted=np.array([w.predicted for w in plain]),
    )
