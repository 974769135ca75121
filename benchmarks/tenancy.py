"""Many tenants on one edge and one cloud (issue 28, item 8): a multi-tenant load test.

    python -m benchmarks.tenancy            # 32 clients under 8 identities (~2 min)
    python -m benchmarks.tenancy --quick    # 16 clients, fewer tokens (~1 min)

Eight identities (named bearer tokens on the edge; the edge holds its own token at the
cloud and vouches for each device: [Note: who a caller is] in
tierflow/transport/callers.py) each run clients of two kinds at once: half generate
greedily with a tiny decoder split over device, edge and cloud (``tierflow.zoo.tiny_stateful``,
its KV cache on the edge and the cloud), half stream chunks of a tiny streaming model
whose recurrent state the cloud keeps. Every client names its session the same way
(``gen-0``, ``mic-0``, ...), so every identity's sessions share their ids with the
others'. Alongside: one flooding client (its own identity) opening a new decoder session
with a 48-token prefill as fast as the tiers answer, and one attacker (its own
identity) naming the victims' sessions at the positions they hold, to read them, and at
position 0, to reset and overwrite them. The edge and the cloud run in this process with
a ``--state-budget`` that the flood passes many times over.

It counts: wrong answers (tokens against the unsplit model's own greedy loop, stream
outputs against a local loop feeding the state back), lost sessions (a victim request
that failed), cross-identity successes (an attacker's read answered with anything but
STATE_LOST, or a victim's answer changed), each victim's ms per token (or per chunk)
loaded against alone, its replays, and each tier's peak session state (sampled every
10 ms) against its budget. Results go to ``benchmarks/results/TENANCY.md`` and a section of
``RESULTS.md`` there.
"""

from __future__ import annotations

import os

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

import argparse
import datetime
import json
import platform
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.lib import RESULTS
from benchmarks.lib.report import load_average, load_span, load_words, replace_section
from tierflow.cli.table import format_table
from tierflow.device.client import DeviceClient
from tierflow.device.generation import Generator
from tierflow.device.sessions import StreamSession
from tierflow.edge.forwarding import Forwarding
from tierflow.greedy import reference_generate
from tierflow.onnxrt.inference import open_session
from tierflow.options import RuntimeOptions
from tierflow.partitioner.decoder_graph import load_decoder, split_decoder
from tierflow.partitioner.decoder_points import DecoderSettings
from tierflow.partitioner.graph import load_model
from tierflow.partitioner.split import save_split_plan, split_model
from tierflow.runtime.server import TierServer
from tierflow.transport.security import Security
from tierflow.units import format_size
from tierflow.zoo.tiny_stateful import streaming_model, tiny_decoder

IDENTITIES = 8
CONTEXT = 128
PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]
FLOOD_PROMPT = [1 + n % 31 for n in range(48)]  # 48 tokens of the 32-token vocabulary
SECTION_START = "<!-- tenancy-bench: start -->"
SECTION_END = "<!-- tenancy-bench: end -->"


# ---------------------------------------------------------------------- models and tiers


def decoder_plan(model: Path, plan_dir: Path) -> Path:
    graph = load_decoder(model, DecoderSettings(context=CONTEXT, max_tokens=64, prompt_tokens=8))
    last = len(graph.prefill.cuts) - 1
    cuts = (last // 3, 2 * last // 3)
    segments = split_decoder(graph, cuts)
    codec = {"device-edge": "raw", "edge-cloud": "zstd"}
    save_split_plan(
        graph.prefill, segments, plan_dir, cuts=cuts, codec=codec, decoder=graph.decoder
    )
    return plan_dir


def stream_plan(model: Path, plan_dir: Path) -> Path:
    """The streaming model with its state on the cloud."""
    graph = load_model(model)
    cuts = (0, 0)
    save_split_plan(graph, split_model(graph, cuts), plan_dir, cuts=cuts)
    return plan_dir


class Pair:
    """A cloud and an edge in this process, the edge's clients named by their tokens."""

    def __init__(self, plan_dir: Path, root: Path, budget: int | None) -> None:
        root.mkdir(parents=True, exist_ok=True)
        clients = "".join(f"{name} {name}-secret\n" for name in names())
        (root / "clients").write_text(clients)
        (root / "cloud").write_text("edge edge-secret\n")
        (root / "up").write_text("edge-secret\n")
        cloud_security = Security(token_file=str(root / "cloud"))
        edge_security = Security(
            token_file=str(root / "clients"), upstream_token_file=str(root / "up")
        )
        self.cloud = TierServer.from_plan(
            "cloud",
            plan_dir,
            options=RuntimeOptions(workers=2, state_budget=budget, security=cloud_security),
        )
        self.cloud.start()
        self.edge = TierServer.from_plan(
            "edge",
            plan_dir,
            forwarder=Forwarding(self.cloud.address),
            options=RuntimeOptions(workers=2, state_budget=budget, security=edge_security),
        )
        self.edge.start()
        self.plan_dir = plan_dir
        self.root = root
        self.peak = {"edge": 0, "cloud": 0}
        self.budget = budget

    def client(self, name: str) -> DeviceClient:
        token = self.root / f"{name}.token"
        token.write_text(f"{name}-secret\n")
        options = RuntimeOptions(security=Security(token_file=str(token)))
        return DeviceClient(self.plan_dir, self.edge.address, options=options, window=4)

    def states(self, tier: str) -> Any:
        server = self.edge if tier == "edge" else self.cloud
        assert server.tier.pipeline is not None
        return server.tier.pipeline.states

    def sample(self) -> None:
        for tier in self.peak:
            self.peak[tier] = max(self.peak[tier], self.states(tier).nbytes)

    def stop(self) -> None:
        self.edge.stop(0)
        self.cloud.stop(0)


def names() -> list[str]:
    return [f"id{n}" for n in range(IDENTITIES)] + ["flood", "attacker"]


# ---------------------------------------------------------------------- clients


class Outcome:
    """What one victim client saw."""

    def __init__(self, kind: str, identity: str, session: str) -> None:
        self.kind, self.identity, self.session = kind, identity, session
        self.wrong = 0
        self.lost = 0
        self.replays = 0
        self.ms_per_step = 0.0
        self.steps = 0


def generate(pair: Pair, identity: str, session: str, tokens: int, want: list[int]) -> Outcome:
    outcome = Outcome("generate", identity, session)
    with pair.client(identity) as client:
        generator = Generator(client)
        generator.target.session = session  # the same names under every identity
        try:
            report = generator.generate(PROMPT, tokens)
        except Exception:
            outcome.lost = 1
            return outcome
    outcome.wrong = int(list(report.tokens) != want)
    outcome.replays = report.replays
    outcome.ms_per_step = report.ms_per_token
    outcome.steps = len(report.tokens)
    return outcome


def stream(
    pair: Pair, identity: str, session: str, chunks: list[Any], state: Any, want: list[Any]
) -> Outcome:
    outcome = Outcome("stream", identity, session)
    with pair.client(identity) as client:
        started = time.perf_counter()
        run = StreamSession(client, session, initial={"state": state})
        results = list(run.run(chunks))
        elapsed = time.perf_counter() - started
    for result, expected in zip(results, want, strict=True):
        if not result.ok:
            outcome.lost += 1
        elif not np.array_equal(result.outputs["out"], expected):
            outcome.wrong += 1
    outcome.replays = run.replays
    outcome.ms_per_step = elapsed * 1e3 / len(chunks)
    outcome.steps = len(chunks)
    return outcome


def flood(pair: Pair, stop: threading.Event, counts: dict[str, int]) -> None:
    with pair.client("flood") as client:
        assert client.plan.decoder is not None
        feeds = client.plan.decoder.step_feeds(FLOOD_PROMPT, 0)
        number = failed = 0
        while not stop.is_set():
            tickets = [
                client.submit(
                    feeds,
                    session=f"flood-{number + i}",
                    choices_only=True,
                    keep_last=1,
                )
                for i in range(4)
            ]
            number += len(tickets)
            failed += sum(not ticket.result().ok for ticket in tickets)
        counts["flood_sessions"] = number - failed
        counts["flood_failed"] = failed


def attack(pair: Pair, stop: threading.Event, counts: dict[str, int], sessions: list[str]) -> None:
    """Name each victim's stream session at a position it may hold (a read), and now and
    then at position 0 and 1 (a reset and a write). The decoder's sessions are not named:
    its first segment keeps state on the device, so a device cannot form another's step;
    the tiers' check is the same for both (tierflow/state/store.py)."""
    reads = successes = refused = 0
    with pair.client("attacker") as streamer:
        rng = np.random.default_rng(7)
        while not stop.is_set():
            for session in sessions:
                # From 3 on: the attacker's own session of that name holds 2 steps at most.
                position = int(rng.integers(3, 24))
                feeds = {"audio": rng.standard_normal((1, 6)).astype(np.float32)}
                result = streamer.submit(feeds, session=session, position=position).result()
                reads += 1
                if result.ok:  # an answer from another identity's state
                    successes += 1
                elif getattr(result.error, "code", None) != "STATE_LOST":
                    refused += 1
                if rng.random() < 0.2:  # reset and overwrite
                    streamer.submit(feeds, session=session, position=0).result()
                    streamer.submit(feeds, session=session, position=1).result()
                if stop.is_set():
                    break
    counts["attacker_reads"] = reads
    counts["cross_identity_successes"] = successes
    counts["attacker_refused_otherwise"] = refused


# ---------------------------------------------------------------------- the run


def run(quick: bool, workdir: Path) -> dict[str, Any]:
    load = load_average()
    per_identity = 2 if quick else 4
    tokens = 16 if quick else 32
    chunk_count = 24 if quick else 40
    decoder = tiny_decoder(workdir / "decoder.onnx", blocks=6, vocab=32, seed=1)
    streamer = streaming_model(workdir / "stream.onnx")
    plans = {
        "generate": decoder_plan(decoder, workdir / "gen-plan"),
        "stream": stream_plan(streamer, workdir / "stream-plan"),
    }
    want_tokens = list(reference_generate(decoder, PROMPT, tokens, context=CONTEXT).tokens)
    rng = np.random.default_rng(0)
    chunks = [{"audio": rng.standard_normal((1, 6)).astype(np.float32)} for _ in range(chunk_count)]
    state = rng.standard_normal((1, 8)).astype(np.float32)
    session = open_session(streamer)
    want_stream, held = [], state
    for chunk in chunks:
        out, held = session.run(["out", "stateN"], {"audio": chunk["audio"], "state": held})
        want_stream.append(out)

    # Alone: one client of each kind, no one else; its session's state sizes the budget.
    alone_pairs = {k: Pair(p, workdir / f"alone-{k}", None) for k, p in plans.items()}
    try:
        alone_gen = generate(alone_pairs["generate"], "id0", "gen-0", tokens, want_tokens)
        gen_bytes = max(alone_pairs["generate"].states(t).nbytes for t in ("edge", "cloud"))
        alone_stream = stream(alone_pairs["stream"], "id0", "mic-0", chunks, state, want_stream)
        stream_bytes = alone_pairs["stream"].states("cloud").nbytes
    finally:
        for pair in alone_pairs.values():
            pair.stop()
    victims = IDENTITIES * per_identity // 2  # of each kind
    # Room for every victim's sessions and as much again: the flood passes it many times.
    budgets = {"generate": 2 * victims * gen_bytes, "stream": 2 * victims * stream_bytes}

    def phase(name: str, flooded: bool) -> dict[str, Any]:
        """The victims at once; with ``flooded``, the flood and the attacker beside them."""
        pairs = {k: Pair(p, workdir / f"{name}-{k}", budgets[k]) for k, p in plans.items()}
        stop = threading.Event()
        counts: dict[str, int] = {}
        outcomes: list[Outcome] = []
        lock = threading.Lock()

        def victim(kind: str, identity: str, number: int) -> None:
            if kind == "generate":
                got = generate(pairs[kind], identity, f"gen-{number}", tokens, want_tokens)
            else:
                got = stream(pairs[kind], identity, f"mic-{number}", chunks, state, want_stream)
            with lock:
                outcomes.append(got)

        def sampler() -> None:
            while not stop.wait(0.01):
                for pair in pairs.values():
                    pair.sample()

        background = [threading.Thread(target=sampler)]
        if flooded:
            sessions = [f"mic-{n}" for n in range(per_identity // 2)]
            background += [
                threading.Thread(target=flood, args=(pairs["generate"], stop, counts)),
                threading.Thread(target=attack, args=(pairs["stream"], stop, counts, sessions)),
            ]
        clients = [
            threading.Thread(target=victim, args=(kind, f"id{i}", n))
            for i in range(IDENTITIES)
            for n in range(per_identity // 2)
            for kind in ("generate", "stream")
        ]
        started = time.perf_counter()
        try:
            for thread in background:
                thread.start()
            if flooded:
                time.sleep(0.5)  # the flood first fills the budget
            for thread in clients:
                thread.start()
            for thread in clients:
                thread.join(600)
        finally:
            stop.set()
            for thread in background:
                thread.join(60)
            evicted = {
                k: {t: pair.states(t).evicted for t in ("edge", "cloud")}
                for k, pair in pairs.items()
            }
            peaks = {k: dict(pair.peak) for k, pair in pairs.items()}
            for pair in pairs.values():
                pair.stop()
        elapsed = time.perf_counter() - started
        return {
            "outcomes": outcomes,
            "counts": counts,
            "evicted": evicted,
            "peaks": peaks,
            "seconds": elapsed,
            "clients": len(clients),
        }

    calm = phase("calm", False)
    loaded = phase("flood", True)
    outcomes, counts, evicted, peaks = (
        loaded["outcomes"],
        loaded["counts"],
        loaded["evicted"],
        loaded["peaks"],
    )
    unflooded = {(o.kind, o.identity, o.session): o.ms_per_step for o in calm["outcomes"]}
    elapsed = calm["seconds"] + loaded["seconds"]
    alone = {"generate": alone_gen.ms_per_step, "stream": alone_stream.ms_per_step}
    rows = []
    for kind in ("generate", "stream"):
        mine = [o for o in outcomes if o.kind == kind]
        ratios = [o.ms_per_step / alone[kind] for o in mine if o.ms_per_step]
        flooding = [
            o.ms_per_step / unflooded[o.kind, o.identity, o.session]
            for o in mine
            if o.ms_per_step and unflooded.get((o.kind, o.identity, o.session))
        ]
        calm_mine = [o for o in calm["outcomes"] if o.kind == kind]
        rows.append(
            {
                "kind": kind,
                "clients": len(mine),
                "wrong": sum(o.wrong for o in mine),
                "lost": sum(o.lost for o in mine),
                "replays_max": max((o.replays for o in mine), default=0),
                "replays_total": sum(o.replays for o in mine),
                "ms_alone": round(alone[kind], 3),
                "ms_unflooded_median": round(
                    statistics.median(o.ms_per_step for o in calm_mine), 3
                ),
                "ms_loaded_median": round(statistics.median(o.ms_per_step for o in mine), 3),
                "flood_slowdown_median": round(statistics.median(flooding), 2)
                if flooding
                else None,
                "flood_slowdown_max": round(max(flooding), 2) if flooding else None,
                "unflooded_wrong_or_lost": sum(o.wrong + o.lost for o in calm_mine),
                "slowdown_median": round(statistics.median(ratios), 2) if ratios else None,
                "slowdown_max": round(max(ratios), 2) if ratios else None,
                "budget": budgets[kind],
                "peak_edge": peaks[kind]["edge"],
                "peak_cloud": peaks[kind]["cloud"],
                "evicted_edge": evicted[kind]["edge"],
                "evicted_cloud": evicted[kind]["cloud"],
            }
        )
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "load_average": load_span(load),
        "quick": quick,
        "identities": IDENTITIES,
        "clients": loaded["clients"],
        "tokens": tokens,
        "chunks": chunk_count,
        "seconds": round(elapsed, 1),
        "counts": counts,
        "rows": rows,
    }


def tables(results: dict[str, Any]) -> str:
    rows = [
        (
            r["kind"],
            r["clients"],
            r["wrong"],
            r["lost"],
            f"{r['replays_max']} / {r['replays_total']}",
            f"{r['ms_alone']:.2f}",
            f"{r['ms_unflooded_median']:.2f}",
            f"{r['ms_loaded_median']:.2f}",
            f"{r['flood_slowdown_median']}x / {r['flood_slowdown_max']}x",
            f"{format_size(r['peak_edge'])} / {format_size(r['peak_cloud'])}",
            format_size(r["budget"]),
            f"{r['evicted_edge']} / {r['evicted_cloud']}",
        )
        for r in results["rows"]
    ]
    head = (
        "victims", "clients", "wrong", "lost", "replays max/all", "ms alone",
        "ms all, no flood", "ms all, flood", "flood/no flood med/max",
        "peak state edge/cloud", "budget", "evicted edge/cloud",
    )  # fmt: skip
    counts = results["counts"]
    return "\n".join(
        [
            format_table(head, rows),
            "",
            f"flood: {counts.get('flood_sessions', 0)} sessions of a {len(FLOOD_PROMPT)}-token "
            f"prefill ({counts.get('flood_failed', 0)} failed); attacker: "
            f"{counts.get('attacker_reads', 0)} reads of victims' sessions, "
            f"{counts.get('cross_identity_successes', 0)} answered, "
            f"{counts.get('attacker_refused_otherwise', 0)} refused with another error than "
            "STATE_LOST",
        ]
    )


def markdown(results: dict[str, Any]) -> str:
    return "\n".join(
        [
            "# Many tenants on one edge and one cloud",
            "",
            "`python -m benchmarks.tenancy`"
            + (" --quick" if results["quick"] else "")
            + f": {results['date']}, {results['machine']}, "
            f"{load_words(results['load_average'])}, {results['seconds']} s.",
            "",
            f"{results['clients']} clients under {results['identities']} identities (named "
            "tokens), half generating "
            f"{results['tokens']} tokens with a decoder split over three tiers, half streaming "
            f"{results['chunks']} chunks whose state the cloud keeps; one client floods "
            "new decoder sessions, one names the victims' stream sessions (reads, resets, "
            "writes). ms are per token (generate) and per chunk (stream), medians over the "
            "victims: alone (one client, nobody else), all victims at once without the flood, "
            "and with it; flood/no flood compares each victim with itself. The budget is each "
            "tier's `--state-budget`, twice what the victims' sessions need. Every tier runs "
            "in this one Python process (for its state to be read), on the cores the machine "
            "has, so the victims' times measure CPU contention as much as the tiers.",
            "",
            "```",
            tables(results),
            "```",
            "",
            "```json",
            json.dumps(results, indent=1),
            "```",
            "",
        ]
    )


def results_section(results: dict[str, Any]) -> list[str]:
    """RESULTS.md's section for a run: written here, and drawn again from ``tenancy.json`` by
    the comparison's report, which rewrites RESULTS.md whole."""
    return [
        SECTION_START,
        "## Many tenants on one edge and one cloud (issue 28)",
        "",
        f"`python -m benchmarks.tenancy`, {results['date']}; see [TENANCY.md](TENANCY.md).",
        "",
        "```",
        *tables(results).splitlines(),
        "```",
        SECTION_END,
    ]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="16 clients, fewer tokens")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        results = run(args.quick, Path(tmp))
    print(tables(results))
    if not args.no_write:
        (RESULTS / "TENANCY.md").write_text(markdown(results))
        (RESULTS / "tenancy.json").write_text(json.dumps(results, indent=1) + "\n")
        replace_section(
            RESULTS / "RESULTS.md", SECTION_START, SECTION_END, results_section(results)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
