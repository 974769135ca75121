"""Batched decoding benchmark: 1-16 concurrent generate sessions through served tiers, against ORT.

    python -m benchmarks.batching            # 1, 2, 4, 8, 16 sessions (~25 min)
    python -m benchmarks.batching --repeats 1   # the goals' rows once each, not three times
    python -m benchmarks.batching --quick    # 1, 4, 8 sessions, fewer tokens
    python -m benchmarks.batching --render   # the committed results rendered again
    python -m benchmarks.batching --sessions 1,8 --tokens 8 --configs cloud --delay-ms 5  # smoke

The decoder has Qwen2-0.5B's block shapes (hidden 896, 14/2 heads, MLP 4864) with 12
blocks and a 32k vocabulary, random weights, built from a transformers config and exported
by optimum (``tierflow.zoo.hf_decoders``; 0.95 GB), once, into ``--workdir``. It is planned
cloud-only and split over three tiers (device, edge, cloud at the block boundaries a third
and two thirds in).

Served as users serve it. Each configuration (a plan and its tier settings) starts
``tierflow serve cloud`` and ``tierflow serve edge`` in a process each, on free ports of
127.0.0.1 (:mod:`benchmarks.lib.tiers`; both stopped when the configuration ends, or fails),
every tier with ``--threads 2`` ONNX Runtime intra-op threads, the default ``--workers``
(one per core) and the configuration's ``--max-batch``, ``--batch-delay`` and
``--batch-padding``. The device runs in a child process of the benchmark: one
``DeviceClient`` with the same settings serving every session over its one stream to the
edge, as a phone app or a gateway serving several users would; N threads of it generate
greedily at once, each from its own prompt of the same length (so their steps have the
same shapes and group: [Note: batching exactness] in tierflow/runtime/batching.py). The
three tiers and the sessions so share the machine's two cores as three processes, each
with its own interpreter, not one GIL.

The settings, per plan: batched with ``--batch-delay 0`` (the default), batched with one
positive delay, both with a thread a session; batched with ``--batch-delay 0`` and the
sessions "stepped together", one thread stepping them all (``TierDecoder.choose_together``,
[Note: sessions stepped together] in device/client.py), as a gateway that serves its
users' sessions in one loop would; and not batched (``--max-batch 1``: each step its own
ONNX Runtime call), a thread a session.
With a delay D > 0 a step that reaches a tier while other sessions are active waits up to
D for their steps ([Note: the step batcher]); the positive delay is chosen per plan by a
sweep in the same run, before the measured rows: ``SWEEP_DELAYS_MS`` (2 to 100 ms, the
most ``--batch-delay`` allows) at each of ``SWEEP_SESSIONS`` sessions, the second shortest
delay at which the cloud runs whole rounds (``WHOLE_ROUNDS`` of its steps in calls of
every session's step) at each (the shortest, if only it does); if none does, the one with
the most tokens/s at the most sessions. Why by whole rounds and not by tokens/s: once
rounds are whole, a longer delay changes nothing but the wait it allows, and tokens/s at
whole rounds differ only by the machine's noise (a run of 2026-12-06: 66.7 to 97.6
tokens/s for split delays of 5 to 100 ms, every call all 8 steps), which would pick the
delay at random. Why not the shortest: it is by definition at the edge of how far apart
a round's steps reach the tier, and a measured row's tries are not the sweep's. In the
run of 2026-12-07 07:58 the sweep's 2 ms gathered every round cloud-only at 16 sessions,
and the three tries that followed ran 56%, 66% and 79% of the ceiling (the median's
cloud: 17 calls of all 16 steps, and 14 rounds split 1 + 15). A longer delay costs nothing while the
company it waits for comes (the wait ends when the last expected step queues). Why a
delay buys batch size with latency, and which pays depends on how far apart a round's
steps reach a tier; that is the machine's and the plan's ([Note: the step batcher]).
``--delay-ms`` fixes the delay instead (no sweep).

[Note: the ceiling beside each row]
The ceiling is ONNX Runtime alone doing the row's work: in one process, with no tierflow,
the row's N sessions (the same prompts) generate the same number of tokens greedily as
one batch through each segment graph the plan ships (cloud-only: the one, the whole
decoder; split: the device's, the edge's and the cloud's), opened with the same threads
and optimization as the tiers, each call fed by the segment before it and by the step
before (its KV caches and its token) (:class:`Ceiling`). Its step time is its decode
steps' calls, every segment's, over the steps: a mean, as a row's round is its decode
span over its rounds. (Until 2026-12-07 it was the sum of the segments' median calls,
which set a row's mean against the ceiling's medians: a call slowed by the machine
counted in the row and not in the ceiling.) A row's share of the ceiling is against the
ceiling at its own batch size measured beside it: a process of its own (:class:`Bursts`;
the device's memory stays the device's) generates just before the row's sessions start
and again just after they end, while the tiers wait, and the faster of the two is the
row's ceiling.

Why beside each row: the machine's speed drifts by more than the goal's margin within
minutes. In the run of 2026-12-06 21:02 the ceiling measured before a plan's runs and the
one after, 13 minutes apart, differed by up to 32%, and three runs of the same code gave
59% to 88% of the faster at 8 sessions cloud-only. Why generating, and not one step at
the mean past length repeated with made-up caches (the ceiling until 2026-12-06): a
ceiling should differ from its row by tierflow alone, and a row's calls read caches that
the call before wrote and that grow each step. (The two differed by less than the
machine's drift: at 8 sessions split, in one process on 2026-12-06, 49.1 and 50.5 ms a
step generating, 44.6 and 54.4 repeated.) The plan's whole ceiling is still measured
before its runs and after them (the segments' table), which shows the drift.

Why the goals' rows three times: a row is a few seconds of the machine, and even beside
its own ceiling its share moved by several points from one run of the same code to the
next (2026-12-07, split at 16 sessions stepped together: 81%, 77.7% and 80.6% in three
runs), more than the margin it is judged by. So each batched setting's rows at
``GOAL_SESSIONS`` are measured ``--repeats`` times, one after another, each beside its
own ceiling, and the row kept, every figure of it, is the one whose share is the median
(:func:`median_of`); the table gives the range of the tries' shares, the goals each one.
A median of three moves less from run to run than one try does; it does not raise the
mean.

[Note: a round outside the calls]
What a row has and its ceiling has not is the tiers' work between their calls: each
message read, decoded and checked; each session's state found and kept; the batch
stacked and split; the answers encoded and sent; and four hops. The results' round table
sets each tier's call against the same segment's in the ceiling beside the row, and gives
each process's CPU time a round. Traced on each process's timeline (``time.perf_counter``,
one clock for every process; 2026-12-07, split, 8 sessions stepped together, medians of 60
rounds of 70 ms): the device 1.0 ms from a round's start to its call, 0.8 from its call
to its message leaving, and 1.0 from the edge's reply to the round's end; the edge and
the cloud 1.4-1.5 ms from a message's arrival to their call and 0.9-1.2 from the call to
the message or the answer leaving; each hop up 0.7-0.9 ms, each down 0.4-0.5 with its
write; handing a call to the batcher's thread and back, 0.2 ms of it. Most of that is
Python running with cold caches: a call reads its segment's weights, hundreds of MB,
through every cache, and the work after it finds none of its own there. Decoding a batch
message's stacked rows for 8 members (``member_rows``) took 0.21 ms served, on the edge
and on the cloud alike; the same request decoded in a loop in one process took 0.04 ms,
and 0.35 ms when each turn first read 64 MB. So what is left of the ceiling is in doing
less between calls, not in any one step of it.
At 16 sessions (2026-12-07 07:00, medians of 43 rounds) the same parts take a little
longer. Split: the device 1.3 ms to its call, 1.0 from it to its message leaving and 1.2
from the edge's reply to the round's end (0.85 of it each session's result made and its
token read); the edge 1.5 to its call (0.4 decoding the stacked rows, 0.55 the members'
climbs, 0.3 the batcher's queueing, 0.3 stacking: from a second trace, whose timestamps
added about 0.2 ms to each side) and 1.0 after it (0.55 the members' climbs on); the
cloud 1.4 and 1.1; the four hops 0.4-0.6 each: 11.6 ms in all. Cloud-only, 8.0: the
edge, which runs nothing, 0.9 up and 0.25 down; the cloud's stacking 0.6 ms, 24 caches of
16 rows each found in place.
The tiers' calls, against the ceiling's same segment: where the edge's or the cloud's ran
longer than the ceiling's, it was not other work taking their CPUs. Traced with ``perf``
(the scheduler's switches, cloud-only, 16 sessions): while the cloud's call ran, its
calling thread ran 99.5% of it and ONNX Runtime's other thread 81%, as the ceiling's
threads do, and every other thread of the machine together 0.9 ms of the call's 60.6. The
same call run twice in the served cloud, back to back, took 57.4 and then 56.5 ms
(medians of 30 rounds): 1.6% for a call that follows the other tiers' work. The rest of
such a gap lies within the ceiling's own spread: the faster of the two ceilings beside a
row is the one set against it, and the two differ by up to 5% (62.8 and 59.9 ms at 16
cloud-only on 2026-12-07 07:11).

The whole run keeps the machine's CPUs awake where it may (the kernel's CPU latency setting
held at 0, as ``tierflow serve --cpus-awake`` holds it; ``--let-cpus-sleep`` not): a
pipeline of tiers leaves each CPU idle between its calls, and on this machine a call that
follows an idle spell ran up to a third slower than the ceiling's calls back to back
([Note: CPUs that sleep between steps] in tierflow/tuning.py). The ceiling runs under the
same setting, and the report says which it was.

``--batch-padding`` is measured like a lossy codec: 8 sessions whose prompts differ in
length (16, 15, ..., 9 tokens: their past lengths never match, so the exact default runs
each step alone), cloud-only, with and without padding; its token agreement is the share
of generated tokens equal, position by position, to the unsplit model's own greedy output
for the same prompt, and the sessions whose every token is.

Per configuration and session count: aggregate decode tokens/s (every session's tokens
after its first, over the time from when every session has its first token to the last
session's end), p50/p99 ms per token (each decode step's round trip, every session's steps
together, stepped together each round's; each session's own p50 is kept too), the batches
each tier ran (the device's from its batcher, the edge's and the cloud's from their metrics
endpoint, ``tierflow_batch_calls_total``), the share of a round spent in the tiers' ONNX
Runtime calls of every session's decode step, each tier's mean decode call as timed while
it ran (``tierflow_batch_call_seconds_total``, counted from when every session has its
first token: the prefill call of every session's prompt at once, of the same size, takes
ten times a decode step's, and runs before 2026-12-06 counted it in; unlike the ceiling,
measured in the same moment as the round), each process's peak resident memory (VmHWM), and
whether every session's tokens equal the unsplit model's own greedy output
(``tierflow.greedy.reference_generate``)."""

from __future__ import annotations

import os

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

import argparse
import contextlib
import dataclasses
import json
import math
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.lib import RESULTS as FOLDER
from benchmarks.lib.report import load_average, load_span, load_words
from benchmarks.lib.tiers import ServedTiers, batch_calls, cpu_seconds, peak_rss, served
from tierflow.tuning import cpus_awake

ROOT = Path(__file__).resolve().parents[1]
RESULTS = FOLDER / "batching.json"
PLOT = FOLDER / "batching.png"
REPORT = FOLDER / "BATCHING.md"
THREADS = 2
#: Sessions of the --batch-padding runs, each prompt a token shorter than the one before.
PADDED_SESSIONS = 8
#: The positive --batch-delay candidates (ms), and the sessions they are tried with.
SWEEP_DELAYS_MS = (2.0, 5.0, 10.0, 20.0, 50.0, 100.0)
SWEEP_SESSIONS = (8, 16)
#: The share of the cloud's steps that must run in calls of every session's step for a
#: delay to gather whole rounds.
WHOLE_ROUNDS = 0.9
#: The session counts the goals judge: each batched setting's rows there are measured
#: ``--repeats`` times (by default ``REPEATS``), each beside its own ceiling, and the row
#: kept is the one whose share of its ceiling is the median ([Note: the ceiling beside
#: each row]).
GOAL_SESSIONS = (8, 16)
REPEATS = 3
#: The most tokens a session generates: the plans' --max-tokens (their context is the
#: prompt's length and this), built once for every run's --tokens.
MAX_TOKENS = 64
#: Sessions, one after another, on each start of the side-by-side measurement's tiers.
SIDE_BY_SIDE_SESSIONS = 3
#: Seconds a configuration's device and sessions get before they are stopped.
CHILD_TIMEOUT_S = 900


@dataclasses.dataclass(frozen=True)
class Setting:
    """The tiers' batching flags of one configuration."""

    max_batch: int = 16
    delay_ms: float = 0.0
    padding: bool = False
    #: The device steps its sessions from one thread (``TierDecoder.choose_together``),
    #: not a thread each.
    together: bool = False

    @property
    def name(self) -> str:
        if self.max_batch == 1:
            return "not batched"
        if self.padding:
            return "--batch-padding"
        named = f"batched, delay {self.delay_ms:g} ms"
        return f"{named}, stepped together" if self.together else named

    def flags(self) -> list[str]:
        """As ``tierflow serve`` (and the device's child) take them."""
        return [
            "--max-batch",
            str(self.max_batch),
            "--batch-delay",
            f"{self.delay_ms:g}ms",
            *(["--batch-padding"] if self.padding else []),
        ]


def shape() -> Any:
    """Qwen2-0.5B's blocks, 12 of them, with a 32k vocabulary (0.95 GB)."""
    from tierflow.zoo.hf_decoders import QWEN2_0_5B

    return dataclasses.replace(QWEN2_0_5B, layers=12, vocab=32000, max_positions=4096)


def build(workdir: Path, prompt: int) -> dict[str, Path]:
    """The decoder (exported once, kept in ``workdir``) and its two plans, for prompts of
    ``prompt`` tokens and up to ``MAX_TOKENS`` new ones (any run's ``--tokens``)."""
    from tierflow.partitioner.decoder_graph import load_decoder, split_decoder
    from tierflow.partitioner.decoder_points import DecoderSettings
    from tierflow.partitioner.split import save_split_plan
    from tierflow.zoo.hf_decoders import export_decoder

    model = workdir / "model" / "model.onnx"
    if not model.exists():
        progress("exporting the decoder with optimum (a few minutes) ...")
        export_decoder(shape(), model.parent, timeout=1800)
    settings = DecoderSettings(
        context=prompt + MAX_TOKENS, max_tokens=MAX_TOKENS, prompt_tokens=prompt
    )
    paths = {"model": model}
    graph = None
    blocks = shape().layers
    thirds = (blocks // 3, 2 * blocks // 3)
    for where in ("cloud", "split"):
        # Named by its blocks: a workdir's plan split elsewhere (until 2026-12-06, the cut
        # list's thirds, inside a block's MLP) is not taken for this one.
        plan_dir = workdir / (
            "plan-cloud" if where == "cloud" else f"plan-split-{thirds[0]}-{thirds[1]}"
        )
        paths[where] = plan_dir
        if (plan_dir / "plan.json").exists():
            continue
        if graph is None:
            progress("analysing the decoder ...")
            graph = load_decoder(model, settings)
        cuts = (
            (0, 0) if where == "cloud" else tuple(block_cut(graph.prefill.cuts, b) for b in thirds)
        )
        save_split_plan(
            graph.prefill,
            split_decoder(graph, cuts),
            plan_dir,
            cuts=cuts,
            decoder=graph.decoder,
        )
    return paths


def block_cut(cuts: Sequence[Any], block: int) -> int:
    """The index of the cut just before decoder block ``block`` (optimum's names: the
    first cut that carries a tensor of ``/model/layers.{block}/``): the block's input,
    the one activation that crosses between two blocks."""
    inside = f"/model/layers.{block}/"
    return next(c.index for c in cuts if any(t.startswith(inside) for t in c.tensors))


def progress(text: str) -> None:
    """One line of progress, with the time (a long run's stages can be told apart)."""
    print(f"{time.strftime('%H:%M:%S', time.gmtime())} {text}", flush=True)


def prompts(count: int, length: int, vocab: int = 32000, *, vary: bool = False) -> list[list[int]]:
    """``count`` random prompts of ``length`` tokens; with ``vary``, the i-th is i tokens
    shorter (at least one), so that no two sessions' past lengths match."""
    rng = np.random.default_rng(7)
    texts = [rng.integers(0, vocab, length).tolist() for _ in range(count)]
    if vary:
        texts = [text[: max(1, length - i)] for i, text in enumerate(texts)]
    return texts


# ---------------------------------------------------------------------- the children


def run_sessions(plan: Path, counts: Sequence[int], args: argparse.Namespace) -> dict[str, Any]:
    """The device (this process) and N sessions at once through the served edge and cloud,
    for each N of ``counts``."""
    from tierflow.device.client import DeviceClient
    from tierflow.device.generation import TierDecoder
    from tierflow.options import RuntimeOptions
    from tierflow.runtime.batching import ACTIVE_S
    from tierflow.tuning import tune_for_latency

    options = RuntimeOptions(
        threads=args.threads,
        max_batch=args.max_batch,
        batch_delay_s=args.batch_delay_ms / 1e3,
        batch_padding=args.batch_padding,
    )
    tiers = {name: dict(tier) for name, tier in json.loads(args.tiers).items()}
    texts = prompts(max(counts), args.prompt, vary=args.vary)
    rows = []
    with (
        Bursts(plan, args) as bursts,
        DeviceClient(plan, args.edge, options=options, window=64) as client,
    ):
        TierDecoder(client).choose(texts[0], 0, keep=1)  # opens every tier's sessions
        batcher = client.runner.batcher

        def calls() -> dict[str, tuple[dict[int, int], dict[int, float]]]:
            at = {name: batch_calls(tier["metrics"]) for name, tier in tiers.items()}
            mine = (dict(batcher.stats.sizes), dict(batcher.stats.seconds)) if batcher else ({}, {})
            return {"device": mine, **at}

        pids = {"device": "self", **{name: tier["pid"] for name, tier in tiers.items()}}

        def cpu() -> dict[str, float]:
            return {name: cpu_seconds(pid) for name, pid in pids.items()}

        # What the calls and the CPU times were once every session had its first token.
        decoding: list[tuple[dict[str, tuple[dict[int, int], dict[int, float]]], dict[str, float]]]
        decoding = []

        def at_decode() -> None:  # every session has its first token
            decoding.append((calls(), cpu()))

        def measured(count: int) -> dict[str, Any]:
            # The sessions before are no longer active for --batch-delay (ACTIVE_S):
            # a row's sessions wait for no one who has left.
            time.sleep(ACTIVE_S + 0.1)
            alone = bursts.step(count)  # [Note: the ceiling beside each row]
            # One session as `tierflow generate` runs it; several, a thread each, with the
            # longer switch interval of [Note: GIL switch interval]; stepped together, one
            # thread drives them all.
            tune_for_latency(sessions=1 if args.together else count)
            # The calls counted are the decode steps' alone: a prefill call of the same
            # size (every session's prompt at once) takes ten times a decode step's.
            generate = _generate_together if args.together else _generate
            row = generate(client, texts[:count], args.tokens, prefilled=at_decode)
            used = cpu()
            before, used_before = decoding.pop()
            decoded = {name: used[name] - seconds for name, seconds in used_before.items()}
            after = calls()
            row["batches"] = {
                name: {
                    str(size): n - before[name][0].get(size, 0)
                    for size, n in sorted(after[name][0].items())
                    if n > before[name][0].get(size, 0)
                }
                for name in after
            }
            after_row = bursts.step(count)
            row["ceiling_ms"] = [alone["step_ms"], after_row["step_ms"]]
            # Each segment's call in the faster of the two, against the tiers' calls.
            faster = min(alone, after_row, key=lambda r: r["step_ms"])
            row["ceiling_segments_ms"] = faster["segments_ms"]
            row["ceiling_cpu_ms"] = faster["cpu_ms"]
            row["call_ms"] = {}  # each tier's mean call of every session's step
            for name in after:
                made = after[name][0].get(count, 0) - before[name][0].get(count, 0)
                took = after[name][1].get(count, 0.0) - before[name][1].get(count, 0.0)
                if made:
                    row["call_ms"][name] = 1e3 * took / made
            # Each process's CPU time, every thread's, a decode round.
            row["cpu_ms_per_round"] = {
                name: 1e3 * seconds / (args.tokens - 1) for name, seconds in decoded.items()
            }
            row["peak_rss"] = {
                "device": peak_rss(),
                **{name: peak_rss(tier["pid"]) for name, tier in tiers.items()},
            }
            return row

        for count in counts:
            repeats = args.repeats if count in GOAL_SESSIONS else 1
            rows.append(median_of([measured(count) for _ in range(repeats)]))
    return {"rows": rows}


def _generate(
    client: Any,
    texts: list[list[int]],
    tokens: int,
    *,
    prefilled: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """``len(texts)`` sessions generating ``tokens`` tokens each at once, a thread each;
    ``prefilled`` is called once every session has its first token, before any decodes."""
    from tierflow.device.generation import TierDecoder

    out: list[dict[str, Any]] = [{} for _ in texts]
    start = threading.Barrier(len(texts))
    decoding = threading.Barrier(len(texts), action=prefilled)

    def session(i: int) -> None:
        decoder = TierDecoder(client)
        sequence = list(texts[i])
        try:
            start.wait()
            token = int(decoder.choose(sequence, 0, keep=1)[-1])
        except BaseException:
            decoding.abort()  # the others stop at the barrier too: a failed row, not a hang
            raise
        decoding.wait()
        first = time.perf_counter()
        made, steps = [token], []
        for _ in range(tokens - 1):
            began = time.perf_counter()
            token = int(decoder.choose([token], len(sequence) + len(made) - 1, keep=1)[-1])
            steps.append((time.perf_counter() - began) * 1e3)
            made.append(token)
        out[i] = {"tokens": made, "first": first, "end": time.perf_counter(), "steps": steps}

    threads = [threading.Thread(target=session, args=(i,)) for i in range(len(texts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if not all(out):
        raise RuntimeError("a session failed (its thread's traceback is above)")
    span = max(o["end"] for o in out) - min(o["first"] for o in out)
    each = [o["steps"] for o in out]
    return _row([o["tokens"] for o in out], span, each, [s for steps in each for s in steps])


def _row(
    made: list[list[int]], span: float, each: list[list[float]], pooled: list[float]
) -> dict[str, Any]:
    """A row of ``len(made)`` sessions' tokens, their decode steps taking ``span``
    seconds: ``each`` session's step times (ms), and ``pooled``, those the row's
    p50/p99 are of."""
    return {
        "sessions": len(made),
        "tokens_per_s": sum(len(tokens) - 1 for tokens in made) / span,
        "p50_ms": float(np.percentile(pooled, 50)),
        "p99_ms": float(np.percentile(pooled, 99)),
        "session_p50_ms": [statistics.median(steps) for steps in each],
        "session_p99_ms": [float(np.percentile(steps, 99)) for steps in each],
        "tokens": made,
    }


def chosen_together(steps: Sequence[tuple[Any, list[int], int]]) -> list[int]:
    """Each ``(decoder, tokens, position)`` step's greedy token, the steps taken together
    (``TierDecoder.choose_together``); a step's error raised."""
    from tierflow.device.generation import TierDecoder

    chosen = []
    for answer in TierDecoder.choose_together(steps, keep=1):
        if isinstance(answer, Exception):
            raise answer
        chosen.append(int(answer[-1]))
    return chosen


def _generate_together(
    client: Any,
    texts: list[list[int]],
    tokens: int,
    *,
    prefilled: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """``len(texts)`` sessions generating ``tokens`` tokens each, stepped together from
    this thread (``TierDecoder.choose_together``): every session's prefill at once, then
    each decode step of them all at once; ``prefilled`` is called between. A step's ms
    per token is its round's, for every session."""
    from tierflow.device.generation import TierDecoder

    decoders = [TierDecoder(client) for _ in texts]
    prefills = [(d, t, 0) for d, t in zip(decoders, texts, strict=True)]
    made = [[token] for token in chosen_together(prefills)]
    if prefilled is not None:
        prefilled()
    first = time.perf_counter()
    rounds = []
    for _ in range(tokens - 1):
        began = time.perf_counter()
        steps = [
            (d, [m[-1]], len(t) + len(m) - 1) for d, t, m in zip(decoders, texts, made, strict=True)
        ]
        for m, token in zip(made, chosen_together(steps), strict=True):
            m.append(token)
        rounds.append((time.perf_counter() - began) * 1e3)
    return _row(made, time.perf_counter() - first, [rounds] * len(texts), rounds)


def side_by_side_child(plan: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One session at a time on each of the tier sets in ``args.sets`` (an edge address
    and the tiers' setting each), their steps alternating, the order rotated each token:
    ``SIDE_BY_SIDE_SESSIONS`` sessions in turn, each from its own prompt."""
    from tierflow.device.client import DeviceClient
    from tierflow.device.generation import TierDecoder
    from tierflow.options import RuntimeOptions
    from tierflow.tuning import tune_for_latency

    tune_for_latency()
    sets = json.loads(args.sets)
    together = [bool(tier_set["setting"]["together"]) for tier_set in sets]
    texts = prompts(SIDE_BY_SIDE_SESSIONS, args.prompt)
    steps: list[list[list[float]]] = [[] for _ in sets]  # by set, by session
    made: list[list[list[int]]] = [[] for _ in sets]
    with contextlib.ExitStack() as stack:
        clients = []
        for tier_set in sets:
            setting = Setting(**tier_set["setting"])
            options = RuntimeOptions(
                threads=args.threads,
                max_batch=setting.max_batch,
                batch_delay_s=setting.delay_ms / 1e3,
            )
            client = DeviceClient(plan, tier_set["edge"], options=options, window=64)
            clients.append(stack.enter_context(client))
            TierDecoder(client).choose(texts[0], 0, keep=1)  # opens every tier's sessions
        for text in texts:
            decoders = [TierDecoder(client) for client in clients]
            tokens = [[int(d.choose(list(text), 0, keep=1)[-1])] for d in decoders]
            times: list[list[float]] = [[] for _ in sets]
            for t in range(args.tokens - 1):
                position = len(text) + t
                for k in range(len(sets)):  # each set first, middle and last in turn
                    i = (t + k) % len(sets)
                    began = time.perf_counter()
                    last = [tokens[i][-1]]
                    if together[i]:  # a program that steps its sessions together, with one
                        (token,) = chosen_together([(decoders[i], last, position)])
                    else:
                        token = int(decoders[i].choose(last, position, keep=1)[-1])
                    times[i].append((time.perf_counter() - began) * 1e3)
                    tokens[i].append(token)
            for i in range(len(sets)):
                steps[i].append(times[i])
                made[i].append(tokens[i])
    return {"steps": steps, "tokens": made}


class Ceiling:
    """ONNX Runtime alone, in one process, generating N sessions' tokens batched through a
    plan's segments as its tiers open them (:meth:`step`)."""

    def __init__(self, plan_dir: Path, args: argparse.Namespace) -> None:
        from tierflow.onnxrt.inference import open_session
        from tierflow.plan import load_plan

        self.plan = load_plan(plan_dir)
        assert self.plan.decoder is not None, "a decoder plan"
        self.decoder = self.plan.decoder
        self.runs = []  # each segment's spec, session and output names
        for spec in self.plan.segments:
            session = open_session(plan_dir / spec.file, threads=args.threads, what=spec.file)
            self.runs.append((spec, session, [o.name for o in session.get_outputs()]))
        self.prompt, self.tokens = args.prompt, args.tokens

    def step(self, count: int) -> dict[str, Any]:
        """``count`` sessions, each from the prompt a row's session of that index has,
        generating the row's tokens greedily as one batch: every decode step's call of
        each segment, fed by the segment before it and by the step before (its KV caches,
        its token). Each segment's mean decode call and their sum (``step_ms``); ``cpu_ms``,
        the same for the calls' CPU time, every ONNX Runtime thread's (what the machine's
        load does not stretch); ``tokens``, each session's."""
        from tierflow.greedy import initial_state
        from tierflow.runtime.batching import stack

        decoder = self.decoder
        step = np.array(prompts(count, self.prompt, decoder.vocab), dtype=np.int64)
        # Each session's empty caches, and each step's companions, as one sequence has
        # them (greedy_generate's), stacked as a tier's batcher stacks its steps.
        past = stack([{state.input: initial_state(state) for state in self.plan.states}] * count)
        made: list[list[int]] = [[] for _ in range(count)]
        times: dict[str, list[float]] = {spec.tier: [] for spec, _, _ in self.runs}
        cpu: dict[str, list[float]] = {spec.tier: [] for spec, _, _ in self.runs}
        length = 0
        for token in range(self.tokens):
            steps = stack([decoder.step_feeds(ids, length) for ids in step])
            tensors: dict[str, np.ndarray] = {**steps, **past}
            for spec, session, names in self.runs:
                feeds = {name: tensors[name] for name in spec.inputs}
                began, used = time.perf_counter(), time.process_time()
                values = session.run(None, feeds)
                if token:  # decode steps only: the prefill is not what a row times
                    times[spec.tier].append(time.perf_counter() - began)
                    cpu[spec.tier].append(time.process_time() - used)
                tensors.update(zip(names, values, strict=True))
            past = {state.input: tensors[state.output] for state in self.plan.states}
            length += step.shape[1]
            chosen = tensors[decoder.logits][:, -1].argmax(axis=-1)
            for tokens, value in zip(made, chosen.tolist(), strict=True):
                tokens.append(int(value))
            step = chosen.astype(np.int64)[:, None]
        segments = {tier: statistics.fmean(t) * 1e3 for tier, t in times.items()}
        step_ms = sum(segments.values())
        return {
            "sessions": count,
            "step_ms": step_ms,
            "segments_ms": segments,
            "cpu_ms": sum(statistics.fmean(c) * 1e3 for c in cpu.values()),
            "tokens_per_s": count * 1e3 / step_ms,
            "tokens": made,
        }


def ceiling(plan_dir: Path, counts: Sequence[int], args: argparse.Namespace) -> dict[str, Any]:
    """The plan's :class:`Ceiling` at each of ``counts``."""
    from tierflow.tuning import tune_for_latency

    tune_for_latency()  # as the tiers do
    alone = Ceiling(plan_dir, args)
    return {"rows": [alone.step(count) for count in counts], "peak_rss": peak_rss()}


def ceiling_bursts(plan_dir: Path, args: argparse.Namespace) -> None:
    """The plan's :class:`Ceiling` for each batch size read from stdin (a line each), a
    JSON row each on stdout, until stdin ends: a sessions child's ceiling at each of its
    rows ([Note: the ceiling beside each row])."""
    from tierflow.tuning import tune_for_latency

    tune_for_latency()  # as the tiers do
    alone = Ceiling(plan_dir, args)
    print("ready", flush=True)
    for line in sys.stdin:
        print(json.dumps(alone.step(int(line))), flush=True)


class Bursts:
    """A :func:`ceiling_bursts` process: :meth:`step` is its ceiling step (ms) at a batch
    size, measured while the caller waits."""

    def __init__(self, plan_dir: Path, args: argparse.Namespace) -> None:
        command = child_command("ceiling-bursts", plan_dir, [1], args)
        self.process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT
        )
        self._read()

    def step(self, count: int) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write(f"{count}\n")
        self.process.stdin.flush()
        row: dict[str, Any] = json.loads(self._read())
        row.pop("tokens")
        return row

    def _read(self) -> str:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the ceiling process ended (exit {self.process.wait()})")
        return line

    def close(self) -> None:
        """End the process: its stdin closed, it ends of itself."""
        try:
            self.process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.communicate()

    def __enter__(self) -> Bursts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def fastest(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    """Two measurements of a plan's ceiling as one: each batch size's faster row, with
    both step times kept (``measured_ms``, in the order measured)."""
    rows = []
    for a, b in zip(first["rows"], second["rows"], strict=True):
        row = dict(min(a, b, key=lambda r: r["step_ms"]))
        row["measured_ms"] = [a["step_ms"], b["step_ms"]]
        rows.append(row)
    peak = max(first["peak_rss"], second["peak_rss"])
    return {"rows": rows, "peak_rss": peak}


def references(model: Path, count: int, args: argparse.Namespace) -> list[list[int]]:
    """The unsplit model's own greedy tokens for each session's prompt."""
    from tierflow.greedy import reference_generate

    return [
        list(
            reference_generate(
                model,
                text,
                args.tokens,
                threads=args.threads,
                context=args.prompt + args.tokens + 8,
            ).tokens
        )
        for text in prompts(count, args.prompt, vary=args.vary)
    ]


# ---------------------------------------------------------------------- the parent


def child(
    what: str, target: Path, counts: Sequence[int], args: argparse.Namespace, *extra: str
) -> Any:
    """Run one part in a child process (its own memory), its JSON result back."""
    command = child_command(what, target, counts, args, *extra)
    # On a timeout (or any exception here) subprocess.run kills the child.
    done = subprocess.run(
        command, capture_output=True, text=True, check=False, cwd=ROOT, timeout=CHILD_TIMEOUT_S
    )
    if done.returncode != 0:
        raise SystemExit(f"{what} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def child_command(
    what: str, target: Path, counts: Sequence[int], args: argparse.Namespace, *extra: str
) -> list[str]:
    """The command line of a child process running ``what``."""
    return [
        sys.executable,
        "-m",
        "benchmarks.batching",
        "--child",
        what,
        "--target",
        str(target),
        "--sessions",
        ",".join(map(str, counts)),
        "--tokens",
        str(args.tokens),
        "--prompt",
        str(args.prompt),
        "--threads",
        str(args.threads),
        *extra,
    ]


def generate_through(
    plan_dir: Path,
    counts: Sequence[int],
    args: argparse.Namespace,
    setting: Setting,
    *,
    vary: bool = False,
    repeats: int = 1,
) -> dict[str, Any]:
    """Serve ``plan_dir``'s cloud and edge with ``setting``, and run the device and its
    sessions in a child process against them; the tiers are stopped at the end. Rows at
    ``GOAL_SESSIONS`` are measured ``repeats`` times (:func:`median_of`)."""
    flags = ["--threads", str(args.threads), *setting.flags()]
    with served(plan_dir, flags, _logs(args, plan_dir, setting.name)) as tiers:
        run = child(
            "sessions",
            plan_dir,
            counts,
            args,
            *setting.flags(),
            *(["--vary"] if vary else []),
            *(["--together"] if setting.together else []),
            "--repeats",
            str(repeats),
            "--edge",
            tiers.edge,
            "--tiers",
            _tiers_json(tiers),
        )
    run.update(setting=dataclasses.asdict(setting))
    return run


def side_by_side(
    plan_dir: Path,
    settings: Sequence[Setting],
    args: argparse.Namespace,
    expected: list[list[int]],
) -> dict[str, Any]:
    """One session's ms per token with each of ``settings``, measured side by side: every
    setting's tiers served at once, one session on each, their steps alternating
    (:func:`side_by_side_child`), so the machine's drift falls on all of them alike.

    Twice, the tiers started in the settings' order and then in the reverse: a process's
    own speed differs by a few per cent from another's of the same tier and setting
    (measured here: the first of two identical sets 0.2-1.5 ms a step slower, 45.4 against
    45.2 ms, split plan), so each setting gets a first and a last place."""
    steps: list[list[list[float]]] = [[] for _ in settings]
    made: list[list[list[int]]] = [[] for _ in settings]
    for order in (list(range(len(settings))), list(reversed(range(len(settings))))):
        with contextlib.ExitStack() as stack:
            sets = []
            for i in order:
                flags = ["--threads", str(args.threads), *settings[i].flags()]
                logs = _logs(args, plan_dir, f"side-{settings[i].name}")
                tiers = stack.enter_context(served(plan_dir, flags, logs))
                sets.append({"edge": tiers.edge, "setting": dataclasses.asdict(settings[i])})
            run = child("side-by-side", plan_dir, [1], args, "--sets", json.dumps(sets))
        for i, got_steps, got_tokens in zip(order, run["steps"], run["tokens"], strict=True):
            steps[i].extend(got_steps)
            made[i].extend(got_tokens)
    rows = []
    for setting, each, tokens in zip(settings, steps, made, strict=True):
        rows.append(
            {
                "setting": setting.name,
                "p50_ms": statistics.median(ms for session in each for ms in session),
                # Every setting's steps in the same order: step i of each measured together.
                "steps_ms": [ms for session in each for ms in session],
                "session_p50_ms": [statistics.median(session) for session in each],
                "identical": all(  # each start's sessions run prompts 0, 1, ... again
                    m == expected[j % SIDE_BY_SIDE_SESSIONS][: len(m)] for j, m in enumerate(tokens)
                ),
            }
        )
    return {"sessions": 2 * SIDE_BY_SIDE_SESSIONS, "rows": rows}


def _logs(args: argparse.Namespace, plan_dir: Path, label: str) -> Path:
    """Where the tiers served for ``plan_dir`` under ``label`` (a setting's name) log."""
    slug = f"{plan_dir.name}-{label}".replace(" ", "-").replace(",", "")
    return Path(args.workdir) / "logs" / slug


def _tiers_json(tiers: ServedTiers) -> str:
    return json.dumps({name: dataclasses.asdict(tier) for name, tier in tiers.tiers.items()})


def measure(args: argparse.Namespace) -> dict[str, Any]:
    counts = [int(c) for c in args.sessions.split(",")]
    configs = args.configs.split(",")
    paths = build(Path(args.workdir), args.prompt)
    results: dict[str, Any] = {
        "settings": {
            "threads": args.threads,
            "workers": f"default ({os.cpu_count()})",
            "tokens": args.tokens,
            "prompt": args.prompt,
            "cpus": os.cpu_count(),
            "load_average": {"start": load_average()},
            "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "model_bytes": paths["model"].stat().st_size,
            "sweep": {"delays_ms": list(SWEEP_DELAYS_MS), "sessions": list(SWEEP_SESSIONS)},
            "repeats": args.repeats,
        },
        "ceiling": {},
        "sweep": {},
        "side_by_side": {},
        "runs": {},
    }
    progress("references ...")
    expected = child("references", paths["model"], [max(*counts, SIDE_BY_SIDE_SESSIONS)], args)
    for where in configs:
        progress(f"{where}: the ORT ceiling ...")
        results["ceiling"][where] = child("ceiling", paths[where], counts, args)
    for where in configs:
        delay = args.delay_ms
        if delay is None:
            delay = sweep(paths[where], where, args, results["sweep"])
        for setting in (
            Setting(16, 0.0),
            Setting(16, delay),
            Setting(16, 0.0, together=True),
            Setting(1, 0.0),
        ):
            name = f"{where}, {setting.name}"
            progress(f"{name} ...")
            repeats = args.repeats if setting.max_batch > 1 else 1
            run = generate_through(paths[where], counts, args, setting, repeats=repeats)
            for row in run["rows"]:
                tries = [row.pop("tokens")] + [r.pop("tokens") for r in row.get("repeats", [])]
                row["identical"] = all(
                    a == b for made in tries for a, b in zip(made, expected, strict=False)
                )
            results["runs"][name] = {"plan": where, **run}
        progress(f"{where}: one session, side by side ...")
        settings = (
            Setting(16, 0.0),
            Setting(16, delay),
            Setting(16, 0.0, together=True),
            Setting(1, 0.0),
        )
        results["side_by_side"][where] = side_by_side(paths[where], settings, args, expected)
        progress(f"{where}: the ORT ceiling again ...")
        again = child("ceiling", paths[where], counts, args)
        results["ceiling"][where] = fastest(results["ceiling"][where], again)
    if args.padding and "cloud" in configs:
        results["padding"] = padding_runs(paths, args)
    settings = results["settings"]
    settings["load_average"] = load_span(settings["load_average"]["start"])
    return results


def sweep(plan_dir: Path, where: str, args: argparse.Namespace, into: dict[str, Any]) -> float:
    """Each of ``SWEEP_DELAYS_MS`` at each of ``SWEEP_SESSIONS`` sessions; the delay
    :func:`choose_delay` chooses. Its rows go to ``into[where]``."""
    rows = []
    for delay in SWEEP_DELAYS_MS:
        counts = " and ".join(map(str, SWEEP_SESSIONS))
        progress(f"{where}: --batch-delay {delay:g} ms, {counts} sessions ...")
        run = generate_through(plan_dir, SWEEP_SESSIONS, args, Setting(16, delay))
        for row in run["rows"]:
            row.pop("tokens")
            rows.append({"delay_ms": delay, **row})
    best = choose_delay(rows)
    into[where] = {"rows": rows, "chosen_ms": best}
    return best


def whole_rounds(row: dict[str, Any]) -> float:
    """The share of the cloud's steps that ran in calls of every session's step."""
    calls = {int(size): n for size, n in row["batches"]["cloud"].items()}
    steps = sum(size * n for size, n in calls.items())
    return row["sessions"] * calls.get(row["sessions"], 0) / steps if steps else 0.0


def choose_delay(rows: Sequence[dict[str, Any]]) -> float:
    """The second shortest delay whose every session count gathered whole rounds
    (:func:`whole_rounds` at least ``WHOLE_ROUNDS``), a margin over the shortest; the
    shortest if only it did; if none did, the one with the most tokens/s at the most
    sessions (of equals, the shorter)."""
    delays = sorted({row["delay_ms"] for row in rows})
    whole = [
        delay
        for delay in delays
        if all(whole_rounds(r) >= WHOLE_ROUNDS for r in rows if r["delay_ms"] == delay)
    ]
    if whole:
        return float(whole[min(1, len(whole) - 1)])
    most = max(row["sessions"] for row in rows)
    tops = [row for row in rows if row["sessions"] == most]
    return float(max(tops, key=lambda r: (r["tokens_per_s"], -r["delay_ms"]))["delay_ms"])


def padding_runs(paths: dict[str, Path], args: argparse.Namespace) -> dict[str, Any]:
    """``--batch-padding``'s token agreement and speed: sessions of different past lengths,
    cloud-only, padded into batches and not (the exact default: each step alone)."""
    progress("references, prompts of different lengths ...")
    expected = child("references", paths["model"], [PADDED_SESSIONS], args, "--vary")
    out: dict[str, Any] = {"sessions": PADDED_SESSIONS, "runs": {}}
    for padded in (True, False):
        name = "cloud, --batch-padding" if padded else "cloud, exact (no padding)"
        progress(f"{name}, prompts of different lengths ...")
        setting = Setting(16, 0.0, padding=padded)
        run = generate_through(paths["cloud"], [PADDED_SESSIONS], args, setting, vary=True)
        row = run["rows"][0]
        row.update(agreement(row.pop("tokens"), expected))
        out["runs"][name] = row
    return out


def agreement(made: list[list[int]], expected: list[list[int]]) -> dict[str, Any]:
    """How many generated tokens equal the unsplit model's, position by position, and how
    many sessions match in every token (like a lossy codec's fidelity)."""
    same = total = whole = 0
    for tokens, want in zip(made, expected, strict=True):
        equal = sum(a == b for a, b in zip(tokens, want, strict=False))
        same += equal
        total += len(want)
        whole += tokens == want
    return {
        "token_agreement": same / total if total else 0.0,
        "sessions_identical": whole,
        "identical": whole == len(expected),
    }


# ---------------------------------------------------------------------- the report


def _share_cell(row: dict[str, Any]) -> str:
    """A row's share of its ceiling; measured several times, the range of its tries too."""
    each = shares(row)
    spread = f" ({100 * each[0]:.0f}-{100 * each[-1]:.0f})" if len(each) > 1 else ""
    return f"{100 * of_ceiling(row):.0f}%{spread}"


def _sizes(sizes: dict[str, int] | None) -> str:
    """A tier's batches as ``size:calls`` pairs (``-``: it batched nothing)."""
    if not sizes:
        return "-"
    return " ".join(f"{k}:{v}" for k, v in sorted(sizes.items(), key=lambda x: int(x[0])))


def _gib(row: dict[str, Any]) -> str:
    rss = row["peak_rss"]
    return " / ".join(f"{rss[tier] / 2**30:.2f}" for tier in ("device", "edge", "cloud"))


def of_ceiling(row: dict[str, Any]) -> float:
    """A row's tokens/s as a share of the ceiling's at its batch size, measured beside it:
    the faster of the steps just before and just after the row ([Note: the ceiling beside
    each row])."""
    return row["tokens_per_s"] * min(row["ceiling_ms"]) / (1e3 * row["sessions"])


def median_of(tries: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The row of ``tries`` (one row's measurements, each beside its own ceiling) whose
    share of its ceiling is the median, the lower of the two middle ones for an even
    count; with several, it keeps each try's tokens/s, ceiling and tokens as ``repeats``
    ([Note: the ceiling beside each row])."""
    kept = sorted(tries, key=of_ceiling)[(len(tries) - 1) // 2]
    if len(tries) > 1:
        kept["repeats"] = [
            {key: row[key] for key in ("sessions", "tokens_per_s", "ceiling_ms", "tokens")}
            for row in tries
        ]
    return kept


def shares(row: dict[str, Any]) -> list[float]:
    """A row's share of its ceiling in each of its tries, lowest first (one: its own)."""
    return sorted(of_ceiling(r) for r in row.get("repeats", [row]))


def in_ort(row: dict[str, Any], where: str) -> float | None:
    """The share of a round that the tiers spent in their ONNX Runtime calls of every
    session's step, each tier's mean call timed as it ran (None: a tier that runs a
    segment made no such call, the rounds fragmented). Measured in the same moment as the
    round, unlike the ceiling, it does not move with the machine's speed."""
    tiers = ("cloud",) if where == "cloud" else ("device", "edge", "cloud")
    calls = row.get("call_ms", {})
    if not all(tier in calls for tier in tiers):
        return None
    round_ms = 1e3 * row["sessions"] / row["tokens_per_s"]
    return sum(calls[tier] for tier in tiers) / round_ms


def table(results: dict[str, Any]) -> list[str]:
    lines = [
        "| plan, tiers' setting | sessions | tokens/s | x 1 session | % ORT ceiling | "
        "% in ORT calls | p50 ms/token | p99 ms/token | device batches | edge batches | "
        "cloud batches | token-identical | peak RSS device / edge / cloud GiB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|---|---|---|---:|",
    ]
    for name, run in results["runs"].items():
        one = run["rows"][0]["tokens_per_s"]
        for row in run["rows"]:
            batches = row["batches"]
            in_calls = in_ort(row, run["plan"])
            lines.append(
                f"| {name} | {row['sessions']} | {row['tokens_per_s']:.1f} | "
                f"{row['tokens_per_s'] / one:.2f} | {_share_cell(row)} | "
                f"{'-' if in_calls is None else f'{100 * in_calls:.0f}%'} | "
                f"{row['p50_ms']:.1f} | {row['p99_ms']:.1f} | {_sizes(batches['device'])} | "
                f"{_sizes(batches['edge'])} | {_sizes(batches['cloud'])} | "
                f"{'yes' if row['identical'] else 'NO'} | {_gib(row)} |"
            )
    for where, run in results["ceiling"].items():
        rows = run["rows"]
        tiers = list(rows[0]["segments_ms"])
        lines += [
            "",
            f"| ORT alone generating, {where} plan's segments (ceiling) | "
            + " | ".join(f"{r['sessions']}" for r in rows)
            + " |",
            "|---|" + "---:|" * len(rows),
            *(
                f"| {tier} segment ms | "
                + " | ".join(f"{r['segments_ms'][tier]:.1f}" for r in rows)
                + " |"
                for tier in tiers
            ),
            "| step ms (sum) | " + " | ".join(f"{r['step_ms']:.1f}" for r in rows) + " |",
            *(
                [
                    "| step ms, before / after the runs | "
                    + " | ".join(" / ".join(f"{m:.1f}" for m in r["measured_ms"]) for r in rows)
                    + " |"
                ]
                if "measured_ms" in rows[0]
                else []
            ),
            "| step CPU ms, all threads | " + " | ".join(f"{r['cpu_ms']:.1f}" for r in rows) + " |",
            "| tokens/s | " + " | ".join(f"{r['tokens_per_s']:.1f}" for r in rows) + " |",
        ]
    return lines


def round_table(results: dict[str, Any]) -> list[str]:
    """Where a round of the sessions stepped together went, at 8 and 16 sessions: each
    tier's ONNX Runtime call against the same segment's in the ceiling beside the row,
    the rest of the round, and each process's CPU time a round against the ceiling's."""
    lines = [
        "Where a round went, sessions stepped together ([Note: a round outside the calls] in "
        "benchmarks/batching.py): the round, the ceiling's step beside it, each tier's mean "
        "call against the same segment's in that ceiling, and each process's CPU time:",
        "",
        "| plan | sessions | round ms | ceiling ms | tiers' calls ms | the ceiling's calls ms "
        "| outside the calls ms | each process's CPU ms a round | the ceiling's CPU ms |",
        "|---|---:|---:|---:|---|---|---:|---|---:|",
    ]
    for run in results["runs"].values():
        if not run["setting"].get("together") or run["setting"]["max_batch"] == 1:
            continue
        tiers = ("cloud",) if run["plan"] == "cloud" else ("device", "edge", "cloud")
        for row in run["rows"]:
            if row["sessions"] not in GOAL_SESSIONS or "ceiling_segments_ms" not in row:
                continue
            calls, alone = row["call_ms"], row["ceiling_segments_ms"]
            if not all(tier in calls for tier in tiers):
                continue
            round_ms = 1e3 * row["sessions"] / row["tokens_per_s"]
            cpu = row["cpu_ms_per_round"]
            lines.append(
                f"| {run['plan']} | {row['sessions']} | {round_ms:.1f} | "
                f"{min(row['ceiling_ms']):.1f} | "
                + " / ".join(f"{tier} {calls[tier]:.1f}" for tier in tiers)
                + " | "
                + " / ".join(f"{alone[tier]:.1f}" for tier in tiers)
                + f" | {round_ms - sum(calls[tier] for tier in tiers):.1f} | "
                + " / ".join(f"{name} {cpu[name]:.1f}" for name in ("device", "edge", "cloud"))
                + f" | {row['ceiling_cpu_ms']:.1f} |"
            )
    return lines if len(lines) > 4 else []


def sweep_table(results: dict[str, Any]) -> list[str]:
    """The --batch-delay sweep that chose each plan's positive delay."""
    if not results.get("sweep"):
        return []
    lines = [
        "--batch-delay sweep (the positive delay measured above is the second shortest "
        f"whose cloud ran whole rounds, {100 * WHOLE_ROUNDS:.0f}% of its steps in calls of "
        "every session's step, at each session count; a margin over the shortest):",
        "",
        "| plan | --batch-delay | sessions | tokens/s | p50 ms/token | p99 ms/token | whole "
        "rounds | edge batches | cloud batches |",
        "|---|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for where, sweep_run in results["sweep"].items():
        for row in sweep_run["rows"]:
            chosen = " (chosen)" if row["delay_ms"] == sweep_run["chosen_ms"] else ""
            lines.append(
                f"| {where} | {row['delay_ms']:g} ms{chosen} | {row['sessions']} | "
                f"{row['tokens_per_s']:.1f} | {row['p50_ms']:.1f} | {row['p99_ms']:.1f} | "
                f"{100 * whole_rounds(row):.0f}% | "
                f"{_sizes(row['batches']['edge'])} | {_sizes(row['batches']['cloud'])} |"
            )
    return lines


def padding_table(results: dict[str, Any]) -> list[str]:
    """The --batch-padding runs: speed and token agreement with the unsplit model."""
    padding = results.get("padding")
    if not padding:
        return []
    lines = [
        f"`--batch-padding`, {padding['sessions']} sessions whose prompts differ in length "
        "(their past lengths never match), cloud-only, like a lossy codec: tokens equal to "
        "the unsplit model's greedy output, position by position.",
        "",
        "| run | tokens/s | p50 ms/token | p99 ms/token | cloud batches | tokens identical "
        "| sessions identical |",
        "|---|---:|---:|---:|---|---:|---:|",
    ]
    for name, row in padding["runs"].items():
        lines.append(
            f"| {name} | {row['tokens_per_s']:.1f} | {row['p50_ms']:.1f} | {row['p99_ms']:.1f} "
            f"| {_sizes(row['batches']['cloud'])} | {100 * row['token_agreement']:.1f}% | "
            f"{row['sessions_identical']} of {padding['sessions']} |"
        )
    return lines


def goals(results: dict[str, Any]) -> list[str]:
    """Issue 29's goals, judged on each batched run (delay 0 and the positive one); first,
    per plan, the settings that meet every goal and those that do not."""
    out = []
    every: dict[str, dict[str, bool]] = {}  # plan -> setting -> each of its goals met
    runs = results["runs"]
    for name, run in runs.items():
        where = run["plan"]
        if run["setting"]["max_batch"] == 1:
            continue
        plain = {r["sessions"]: r for r in runs[f"{where}, not batched"]["rows"]}
        batched = {r["sessions"]: r for r in run["rows"]}
        setting = name.split(", ", 1)[1]
        checks: list[bool] = []  # each goal, met or not
        if 8 in batched and 1 in batched:
            gain = batched[8]["tokens_per_s"] / batched[1]["tokens_per_s"]
            checks.append(gain >= 3)
            met = "met" if checks[-1] else "NOT met"
            out.append(f"- {name}: 8 sessions {gain:.2f}x one session's tokens/s (>= 3x): {met}")
        for n in GOAL_SESSIONS:
            if n in batched:
                share = of_ceiling(batched[n])
                checks.append(share >= 0.8)
                met = "met" if checks[-1] else "NOT met"
                in_calls = in_ort(batched[n], where)
                during = "" if in_calls is None else f"; {100 * in_calls:.0f}% in its ORT calls"
                each = shares(batched[n])
                tries = (
                    f" (the median of {len(each)}: {', '.join(f'{100 * x:.1f}%' for x in each)})"
                    if len(each) > 1
                    else ""
                )
                out.append(
                    f"- {name}: {n} sessions at {100 * share:.1f}% of the ORT ceiling{tries} "
                    f"(>= 80%): {met}{during}"
                )
        same = all(r["identical"] for r in batched.values())
        checks.append(same)
        out.append(
            f"- {name}: every session token-identical to the unsplit model: "
            f"{'met' if same else 'NOT met'}"
        )
        side = {
            r["setting"]: r for r in results.get("side_by_side", {}).get(where, {}).get("rows", [])
        }
        if setting in side and "not batched" in side:
            a, b = side[setting]["p50_ms"], side["not batched"]["p50_ms"]
            paired = paired_change(side[setting], side["not batched"])
            if paired is None:  # results from before the steps were kept
                no_worse, why = a <= b, ""
            else:
                middle, low, high = paired
                no_worse = low <= 0.0  # not measurably slower
                why = (
                    f"; step by step {100 * middle:+.1f}%, 95% CI {100 * low:+.1f}% to "
                    f"{100 * high:+.1f}%"
                )
            checks.append(no_worse)
            verdict = "met" if no_worse else "NOT met"
            out.append(
                f"- {name}: one session's p50 {a:.2f} ms/token, {b:.2f} not batched, side by "
                f"side (no worse: {verdict}, {100 * (a / b - 1):+.1f}%{why})"
            )
        elif 1 in batched and 1 in plain:
            a, b = batched[1]["p50_ms"], plain[1]["p50_ms"]
            checks.append(a <= b)
            out.append(
                f"- {name}: one session's p50 {a:.1f} ms/token, {b:.1f} not batched "
                f"(no worse: {'met' if a <= b else 'NOT met'}, {100 * (a / b - 1):+.1f}%)"
            )
        every.setdefault(where, {})[setting] = all(checks)
    summary = []
    for where, settings in every.items():
        meeting = [setting for setting, ok in settings.items() if ok]
        missed = [setting for setting, ok in settings.items() if not ok]
        summary.append(
            f"- {where}: every goal met by {' and '.join(meeting) or 'no setting'}"
            + (f"; not by {' and '.join(missed)}" if missed else "")
        )
    return summary + out


def paired_change(
    row: dict[str, Any], plain: dict[str, Any], level: float = 0.95
) -> tuple[float, float, float] | None:
    """How much slower ``row``'s steps were than ``plain``'s, step by step (each pair
    measured one after the other, side by side): the median of ``row / plain - 1`` over
    the pairs, and its ``level`` confidence interval (a sign test's: the order statistics
    that a binomial's tails put it between). None when the steps were not kept."""
    ours, theirs = row.get("steps_ms"), plain.get("steps_ms")
    if not ours or not theirs or len(ours) != len(theirs):
        return None
    changes = sorted(a / b - 1.0 for a, b in zip(ours, theirs, strict=True))
    n = len(changes)
    tail, cut, below = (1.0 - level) / 2, -1, 0.0
    for k in range(n):  # the most order statistics each end that the tail allows
        below += math.comb(n, k) / 2**n
        if below > tail:
            break
        cut = k
    low, high = (changes[cut], changes[n - 1 - cut]) if cut >= 0 else (changes[0], changes[-1])
    return statistics.median(changes), low, high


def side_by_side_table(results: dict[str, Any]) -> list[str]:
    """One session per setting, the settings' tiers served at once and their steps
    alternating (:func:`side_by_side`)."""
    sides = results.get("side_by_side")
    if not sides:
        return []
    lines = [
        "One session, side by side: each setting's tiers served at once, one session on each, "
        "their decode steps alternating (the order rotated each token), "
        f"{next(iter(sides.values()))['sessions']} sessions in turn:",
        "",
        "| plan | tiers' setting | p50 ms/token | x not batched | step by step against not "
        "batched, median (95% CI) | each session's p50 | token-identical |",
        "|---|---|---:|---:|---|---|---|",
    ]
    for where, side in sides.items():
        plain = next(r for r in side["rows"] if r["setting"] == "not batched")
        for row in side["rows"]:
            each = " / ".join(f"{ms:.2f}" for ms in row["session_p50_ms"])
            paired = paired_change(row, plain) if row is not plain else None
            change = (
                "-"
                if paired is None
                else "{:+.1f}% ({:+.1f}% to {:+.1f}%)".format(*(100 * x for x in paired))
            )
            lines.append(
                f"| {where} | {row['setting']} | {row['p50_ms']:.2f} | "
                f"{row['p50_ms'] / plain['p50_ms']:.3f} | {change} | {each} | "
                f"{'yes' if row['identical'] else 'NO'} |"
            )
    return lines


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7.5, 4.8))
    colours = {"cloud": "tab:blue", "split": "tab:orange"}
    for where, run in results["ceiling"].items():
        axis.plot(
            [r["sessions"] for r in run["rows"]],
            [r["tokens_per_s"] for r in run["rows"]],
            "--",
            color=colours[where],
            alpha=0.6,
            label=f"{where}: ORT alone generating, same segments (ceiling)",
        )
    for name, run in results["runs"].items():
        delay = run["setting"]["delay_ms"]
        style = ":x" if run["setting"]["max_batch"] == 1 else ("-o" if delay else "-s")
        if run["setting"].get("together"):
            style = "-^"
        axis.plot(
            [r["sessions"] for r in run["rows"]],
            [r["tokens_per_s"] for r in run["rows"]],
            style,
            color=colours[run["plan"]],
            label=name,
        )
    axis.set_xscale("log", base=2)
    axis.set_xlabel("concurrent generate sessions")
    axis.set_ylabel("aggregate decode tokens/s")
    axis.set_title("Batched decoding, Qwen2-shaped decoder (12 blocks, 0.95 GB)")
    axis.grid(alpha=0.3)
    axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


NOTES = [
    "Reading it (the run of 2026-12-07 09:18 UTC at d31cab1, 21 minutes, nothing trimmed:",
    "32 tokens a session; each batched setting's rows at 8 and 16 sessions three times). Load",
    "1.0 when it began; the 1.8 at the end counts this run's own processes. The CPUs were kept",
    "awake for the whole run, ceiling included. New in this run: the sweep chose the second",
    "shortest delay that gathers whole rounds (5 ms cloud-only, 10 ms split; at 07:58 the",
    "shortest, 2 and 5 ms); and a batch of steps that came one by one, a thread a session,",
    "left the device with its tensors stacked, as sessions stepped together did already. The",
    "machine was a little faster than at 07:58: one session cloud-only made 28.6 tokens/s",
    "stepped together, against 26.9.",
    "",
    "- Exactness: every session's 32 tokens equal the unsplit model's in all 40 rows, every",
    "  try of them, and in the side-by-side runs; --batch-padding kept 100% of the tokens (8",
    "  of 8 sessions).",
    "- Stepped together (one thread steps every session, TierDecoder.choose_together, at",
    "  the default --batch-delay 0): every call on every tier held all the sessions' steps",
    "  at every count (N:31). Cloud-only 85.0% of the ceiling at 8 sessions (its three tries",
    "  84.8-85.8%) and 83.4% at 16 (82.5-85.0%), 153.1 and 254.9 tokens/s, 5.35x and 8.91x",
    "  one session; split 82.4% (81.2-83.3%) and 82.3% (81.8-82.5%), 145.5 and 236.0 tokens/s,",
    "  5.52x and 8.95x. All twelve tries are at 81% or more, the lowest 81.2%.",
    "- A thread a session with the sweep's delay: cloud-only (5 ms) 83.9% at 8 sessions",
    "  (83.3-85.1%) and 82.1% at 16 (81.1-82.4%), every round whole on every tier, where 2 ms",
    "  at 07:58 made 82.8% and 65.6% (56-79%), many of its rounds split 1 + 15. Split (10 ms)",
    "  80.9% at 8 (79.1-81.4%) and 77.9% at 16 (76.6-78.7%), every round whole too: at 16",
    "  sessions a round took 71.4 ms against 67.8 stepped together. What the threads cost is",
    "  in [Note: sessions stepped together] (device/client.py): each session's thread wakes in",
    "  turn for its answer and again after the device's call.",
    "- The same tiers' code stepped together in the runs before, one try a row (cloud-only 8",
    "  and 16, split 8 and 16): 07:11, 83.1, 81.4, 84.3 and 80.6%; 05:55, 85, 82, 80.2 and",
    "  77.7%; 05:22, 82, 79, 83 and 81%; at 07:58, medians of three, 84.3, 84.0, 82.0 and",
    "  81.4%. The misses came with a slower machine: at 05:55 a split round at 16 spent 14.0",
    "  ms outside the tiers' calls, against 11.5 at 07:58 and 10.4 here.",
    "- The round table: each tier's call against the same segment's call in the ceiling",
    "  beside the row. Split at 16: device 16.7, edge 17.0 and cloud 23.8 ms against 16.8,",
    "  16.6 and 22.4; cloud-only at 16, 55.2 against 52.3. Outside the calls, a round: split",
    "  7.7 ms at 8 sessions and 10.4 at 16, cloud-only 6.0 and 7.6. The processes' CPU a",
    "  round, split at 16: 115.5 ms against the ceiling's 102.1. Where it goes, and why the",
    "  calls are not slowed by other work: [Note: a round outside the calls] in this file's",
    "  docstring.",
    "- With --batch-delay 0 and a thread a session the rounds fragment as before:",
    "  cloud-only 3.14x at 8 and 5.28x at 16 (1 + 15 every round at 16), split 1.83x and",
    "  3.31x.",
    "- Not batched, tokens/s stays at 26-30 whatever the sessions: one session's step",
    "  already keeps both cores busy.",
    "- One session, side by side (each setting's tiers served at once, steps alternating),",
    "  step by step against not batched: stepped together 1.0% faster cloud-only (95%",
    "  interval -1.9% to -0.5%) and 0.7% split (-1.3% to -0.2%); the sweep's delay 1.6% and",
    "  1.3% faster; --batch-delay 0 with a thread a session -0.1% (-1.9% to +1.1%) and -0.8%",
    "  (-1.3% to +0.2%), no difference either way.",
    "- The whole ceiling, measured before a plan's runs and after them, moved by up to 3%",
    "  cloud-only and 7% split (47.5 and 50.8 ms at 8 sessions).",
    "- Memory (peak resident, per process): cloud-only, the cloud 0.98-1.01 GiB (0.95 GB of",
    "  weights), the edge and the device 0.08-0.09; split, device 0.33-0.41, edge",
    "  0.33-0.37, cloud 0.52 GiB, growing with the sessions' caches and batches.",
    "- --batch-padding, 8 sessions of different past lengths: 81.2 tokens/s against 41.6 for",
    "  the exact default (1.95x), which runs them alone or in twos.",
]


def render(results: dict[str, Any]) -> None:
    settings = results["settings"]
    lines = [
        "# Batched decoding",
        "",
        "`python -m benchmarks.batching` (see its docstring), run "
        f"{settings['when']} on {settings['cpus']} CPUs "
        f"({load_words(settings['load_average'])}): the cloud and the edge each a "
        "`tierflow serve` process, the device and its sessions a third, ONNX Runtime "
        f"{settings['threads']} intra-op threads on every tier, --workers "
        f"{settings['workers']}, prompts of {settings['prompt']} tokens, {settings['tokens']} "
        "tokens per session"
        + (
            f"; each batched setting's rows at {' and '.join(map(str, GOAL_SESSIONS))} "
            f"sessions measured {settings['repeats']} times, each beside its own ceiling, the "
            "median's kept (the range of their shares in brackets)"
            if settings.get("repeats", 1) > 1
            else ""
        )
        + ". The machine's CPUs "
        + (
            "were kept awake for the whole run (ceiling included), as `tierflow serve "
            "--cpus-awake` keeps them ([Note: CPUs that sleep between steps] in "
            "tierflow/tuning.py)."
            if settings.get("cpus_awake")
            else "were let sleep between steps (`--let-cpus-sleep`, or the kernel's CPU "
            "latency setting could not be written)."
        ),
        "",
        "![tokens/s](batching.png)",
        "",
        *table(results),
        "",
        *round_table(results),
        "",
        *sweep_table(results),
        "",
        *side_by_side_table(results),
        "",
        "Goals:",
        "",
        *goals(results),
        "",
        *padding_table(results),
        "",
        *NOTES,
        "",
    ]
    REPORT.write_text("\n".join(lines))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--workdir", default=str(Path.home() / ".cache" / "tierflow" / "batching-bench")
    )
    parser.add_argument("--sessions", default="1,2,4,8,16")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--threads", type=int, default=THREADS)
    parser.add_argument(
        "--delay-ms",
        type=float,
        help="the positive --batch-delay to measure (default: from a sweep of "
        + ", ".join(f"{d:g}" for d in SWEEP_DELAYS_MS)
        + f" ms at {' and '.join(map(str, SWEEP_SESSIONS))} sessions: the second shortest "
        "that gathers whole rounds)",
    )
    parser.add_argument(
        "--configs", default="cloud,split", help="the plans to run: cloud, split or both"
    )
    parser.add_argument(
        "--no-padding",
        dest="padding",
        action="store_false",
        help="skip the --batch-padding runs (prompts of different lengths, cloud-only)",
    )
    parser.add_argument(
        "--let-cpus-sleep",
        dest="cpus_awake",
        action="store_false",
        help="measure without keeping the machine's CPUs awake (by default the run holds "
        "the kernel's CPU latency at 0 where it may, as `tierflow serve --cpus-awake` does)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=REPEATS,
        help="measure each batched setting's rows at "
        + " and ".join(map(str, GOAL_SESSIONS))
        + " sessions this many times, each beside its own ceiling, and keep the median "
        "(--quick: 1)",
    )
    parser.add_argument("--render", action="store_true", help="re-render the saved results")
    # A child's own arguments.
    parser.add_argument(
        "--child",
        choices=("sessions", "ceiling", "ceiling-bursts", "references", "side-by-side"),
    )
    parser.add_argument("--sets", help=argparse.SUPPRESS)
    parser.add_argument("--target", help=argparse.SUPPRESS)
    parser.add_argument("--edge", help=argparse.SUPPRESS)
    parser.add_argument("--tiers", help=argparse.SUPPRESS)
    parser.add_argument("--max-batch", type=int, default=16, help=argparse.SUPPRESS)
    parser.add_argument("--batch-delay", default="0ms", help=argparse.SUPPRESS)
    parser.add_argument("--batch-padding", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--vary", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--together", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        counts = [int(c) for c in args.sessions.split(",")]
        target = Path(args.target)
        args.batch_delay_ms = float(args.batch_delay.removesuffix("ms"))
        if args.child == "sessions":
            out: Any = run_sessions(target, counts, args)
        elif args.child == "ceiling":
            out = ceiling(target, counts, args)
        elif args.child == "ceiling-bursts":
            ceiling_bursts(target, args)
            return 0
        elif args.child == "side-by-side":
            out = side_by_side_child(target, args)
        else:
            out = references(target, counts[0], args)
        print(json.dumps(out))
        return 0
    if args.render:  # the committed results, rendered again
        results = json.loads(RESULTS.read_text())
        plot(results, PLOT)
        render(results)
        return 0
    if args.quick:
        args.sessions, args.tokens, args.repeats = "1,4,8", 12, 1
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    # SIGTERM (a timeout, a service manager) unwinds like ^C: the tiers are stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    Path(args.workdir).mkdir(parents=True, exist_ok=True)
    with cpus_awake(args.cpus_awake) as awake:
        results = measure(args)
    results["settings"]["cpus_awake"] = awake
    RESULTS.write_text(json.dumps(results, indent=1) + "\n")
    plot(results, PLOT)
    render(results)
    print("\n".join([*table(results), "", *round_table(results), "", *sweep_table(results), ""]))
    print("\n".join([*side_by_side_table(results), "", *goals(results)]))
    print("\n".join(padding_table(results)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
