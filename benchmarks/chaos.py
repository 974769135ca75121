"""Chaos benchmark: answers across crashes and stalls, many streams, fuzzed messages, TLS cost.

Not a test. Everything runs on this machine, on loopback, as real processes
(``tierflow serve`` for the edge and the cloud, ``redis-server`` for the cloud's shared
cache); the devices run in this process. Four parts, each with its own counts as flags:

* **faults**: ``--requests`` requests stream through device -> edge -> cloud (Redis
  cache on the cloud, entries authenticated with an HMAC key) while each of edge, cloud
  and Redis in turn is stopped with SIGSTOP for ``--stall`` s, then killed with SIGKILL
  and restarted on the same port. Every answer is compared bit for bit with the unsplit
  model's output for the same input (same ONNX Runtime level and one thread, as the
  tiers run). Counted: correct, wrong (an answer that differs), failed (a typed error:
  the promise is one answer or one error per request, never silence), lost (no result
  within the deadline + 10 s), duplicated (a second reply for a request already
  answered: the device's stream drops it, and it is counted by its wire id), and all
  replies the device's stream dropped (duplicates and replies after their deadline). A
  tier found dead that was not killed is a crash: its log's end is quoted and it is
  restarted.
* **streams**: ``--streams`` devices, each its own channel and stream, first paced
  (``--stream-paced`` requests each, one every ``--stream-interval`` s), then saturated
  (``--stream-requests`` each, back to back); p50 / p99 latency of each phase and errors.
* **fuzz**: ``--fuzz`` messages of each of several classes (random bytes and mutated
  messages on ``Infer`` and on ``Probe``, headers that lie about shapes and codecs,
  poison deadlines, many-tensor requests); every ``Infer`` message must get exactly one
  reply, both tiers must stay up and answer a valid request correctly afterwards; peak
  resident memory (VmHWM) of both tiers is reported.
* **tls**: one request at a time, plaintext against mutual TLS on both hops, for a
  256-byte and a 100 KB feature, the two pairs of tiers side by side and the requests
  interleaved ([Note: measuring the TLS overhead]): the ratio of medians and the
  overhead per hop, with their spread over rounds.

Every server's stderr is kept, one log per start (``--logs``, a new folder by default);
each part's logs are summed up in chaos.json (lines per level, the commonest messages,
tracebacks and errors quoted). Prints a table per part and writes
``benchmarks/results/chaos.json`` and the chaos section of ``benchmarks/results/RESULTS.md``
(which ``comparison/run.py`` copies from chaos.json when it rewrites that file). Usage::

    python -m benchmarks.chaos [--requests 100000] [--streams 256] [--fuzz 10000]
                               [--tls-rounds 40] [--parts faults,streams,fuzz,tls]

Needs ``redis-server`` on the PATH and the ``cryptography`` package (the ``dev`` extra).
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import json
import logging
import os
import platform
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from onnx import helper

from benchmarks import lib
from benchmarks.lib.plans import Stage, chain_plan
from benchmarks.lib.report import load_average, load_span, load_words
from benchmarks.lib.tiers import peak_rss
from tierflow.cli.table import format_table
from tierflow.device.client import DeviceClient, Result, Ticket
from tierflow.errors import DeadlineError, RemoteError
from tierflow.onnxrt.inference import open_session
from tierflow.options import RuntimeOptions
from tierflow.plan import load_plan
from tierflow.rpc import tier_pb2
from tierflow.runtime.processes import ServeProcess
from tierflow.runtime.segment_runner import TierRunner
from tierflow.transport.security import Security
from tierflow.transport.stream_client import channel_options
from tierflow.transport.wire import put_tensors

RESULTS = lib.RESULTS / "chaos.json"
INPUTS = 64  # distinct inputs, each with its reference answer; request i uses i % INPUTS


# ---------------------------------------------------------------------------- plans


def _mlp_plan(directory: Path) -> Path:
    """x[1,64] -> Gemm+Relu | Gemm+Relu | Gemm -> y[1,10]: device | edge | cloud."""
    rng = np.random.default_rng(0)
    weights = {
        "w1": rng.standard_normal((64, 64)).astype(np.float32) / 8,
        "w2": rng.standard_normal((64, 64)).astype(np.float32) / 8,
        "w3": rng.standard_normal((10, 64)).astype(np.float32) / 8,
    }
    stages = [
        Stage(
            "device",
            [
                helper.make_node("Gemm", ["x", "w1"], ["a"], transB=1),
                helper.make_node("Relu", ["a"], ["h1"]),
            ],
            "h1",
            64,
        ),
        Stage(
            "edge",
            [
                helper.make_node("Gemm", ["h1", "w2"], ["b"], transB=1),
                helper.make_node("Relu", ["b"], ["h2"]),
            ],
            "h2",
            64,
        ),
        Stage("cloud", [helper.make_node("Gemm", ["h2", "w3"], ["y"], transB=1)], "y", 10),
    ]
    return chain_plan(directory, 64, stages, weights)


def _wide_plan(directory: Path, width: int) -> Path:
    """x[1,W] -> Relu | Sigmoid | ReduceMax -> y: features of 4 W bytes, trivial compute."""
    stages = [
        Stage("device", [helper.make_node("Relu", ["x"], ["h1"])], "h1", width),
        Stage("edge", [helper.make_node("Sigmoid", ["h1"], ["h2"])], "h2", width),
        Stage("cloud", [helper.make_node("ReduceMax", ["h2"], ["y"], keepdims=1)], "y", 1),
    ]
    return chain_plan(directory, width, stages)


class Reference:
    """``INPUTS`` inputs of a plan's model and the unsplit model's answer to each."""

    def __init__(self, plan_dir: Path, width: int) -> None:
        rng = np.random.default_rng(1)
        self.inputs = [rng.standard_normal((1, width)).astype(np.float32) for _ in range(INPUTS)]
        session = open_session(plan_dir / "model.onnx")
        self.outputs = [session.run(["y"], {"x": x})[0] for x in self.inputs]

    def feeds(self, index: int) -> dict[str, np.ndarray]:
        return {"x": self.inputs[index % INPUTS]}

    def correct(self, index: int, result: Result) -> bool:
        answer = result.outputs.get("y")
        expected = self.outputs[index % INPUTS]
        return answer is not None and answer.tobytes() == expected.tobytes()


# ---------------------------------------------------------------------------- processes


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Redis:
    """A throw-away ``redis-server`` on a fixed loopback port (restartable on it)."""

    def __init__(self, directory: Path, log: Path) -> None:
        self.port = _free_port()
        self.directory, self.log = directory, log
        self.process: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        command = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1"]
        command += ["--save", "", "--appendonly", "no", "--dir", str(self.directory)]
        command += ["--logfile", str(self.log)]  # appended to by every start
        self.process = subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()


class Tier:
    """A ``tierflow serve`` process on a fixed port, so that it can be killed and restarted.

    Each start writes its stderr to a log of its own, ``LOG-N.log`` for the N-th start,
    so that a killed server's last lines survive its restart (see :func:`log_findings`).
    """

    def __init__(self, tier: str, plan_dir: Path, args: list[str], log: Path) -> None:
        self.tier, self.plan_dir, self.args, self.log = tier, plan_dir, args, log
        self.port = _free_port()
        self.process: ServeProcess | None = None
        self.starts = 0
        self.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def start(self) -> None:
        self.starts += 1
        log = self.log.with_name(f"{self.log.name}-{self.starts}.log")
        self.process = ServeProcess(
            self.tier, self.plan_dir, *self.args, listen=self.address, log=log
        )

    def log_tail(self, lines: int = 20) -> str:
        """The last lines of the current (or last) start's log."""
        return self.process.log_tail(lines) if self.process is not None else ""

    def kill(self) -> None:
        if self.process is not None:
            self.process.kill()

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop(5)


_LEVELS = ("WARNING", "ERROR", "CRITICAL")
_NUMBERS = re.compile(r"\d+(\.\d+)?")


def log_findings(logs: Path, prefix: str) -> dict[str, Any]:
    """What the server logs of one part say: lines per level, tracebacks, the commonest.

    Messages are counted with their numbers blanked (ports, ids, times), so that a few
    kinds stand for thousands of lines; every ERROR and CRITICAL line and every
    traceback's last line (the exception) is quoted, up to ten.
    """
    levels: Counter[str] = Counter()
    kinds: Counter[str] = Counter()
    quoted: list[str] = []
    tracebacks = 0
    files = sorted(logs.glob(f"{prefix}-*.log"))
    for path in files:
        lines = path.read_text(errors="replace").splitlines()
        in_traceback = False
        for number, line in enumerate(lines):
            if line.startswith("Traceback"):
                tracebacks += 1
                in_traceback = True
                continue
            if in_traceback and not line.startswith((" ", "\t", "During", "The above")):
                in_traceback = False  # the exception line ends the traceback
                if len(quoted) < 10:
                    quoted.append(f"{path.name}:{number + 1}: {line.strip()}")
                continue
            parts = line.split(" ", 3)  # date time LEVEL name: message (tierflow.cli.main)
            level = parts[2] if len(parts) > 3 and parts[2] in _LEVELS else None
            if level is None:
                continue
            levels[level] += 1
            message = parts[3]
            kinds[f"{level} {_NUMBERS.sub('N', message)[:160]}"] += 1
            if level != "WARNING" and len(quoted) < 10:
                quoted.append(f"{path.name}:{number + 1}: {line.strip()}")
    return {
        "dir": str(logs),
        "files": len(files),
        "lines_by_level": dict(levels),
        "tracebacks": tracebacks,
        "commonest": [{"message": k, "count": n} for k, n in kinds.most_common(8)],
        "quoted": quoted,
    }


@contextmanager
def _tiers(
    plan_dir: Path, logs: Path, *extra: str, cloud_extra: tuple[str, ...] = ()
) -> Iterator[tuple[Tier, Tier]]:
    """An edge and a cloud; their logs are ``LOGS-cloud-N.log`` and ``LOGS-edge-N.log``."""
    common = ["--grace", "0.5", "--workers", "2", *extra]
    cloud = Tier("cloud", plan_dir, [*common, *cloud_extra], logs.with_name(f"{logs.name}-cloud"))
    try:
        edge_log = logs.with_name(f"{logs.name}-edge")
        edge = Tier("edge", plan_dir, [*common, "--upstream", cloud.address], edge_log)
        try:
            yield edge, cloud
        finally:
            edge.stop()
    finally:
        cloud.stop()


# ---------------------------------------------------------------------------- faults


class _DroppedReplies(logging.Handler):
    """The wire ids of replies a device's stream dropped: no request was waiting for them.

    That is a reply after its request's deadline, or a second reply for an id already
    answered, a duplicate, which the caller never sees but which :func:`faults` counts.
    """

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.ids: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "came after its deadline" in record.getMessage() and isinstance(record.args, tuple):
            self.ids.append(str(record.args[-1]))


def _failure_windows(events: list[dict[str, Any]], outcomes: list[tuple[float, bool]]) -> None:
    """Add to each fault the requests that failed from its start to the next, and for how long.

    A request counts where the device saw it end (a request in flight when a tier is
    killed ends at the kill, one failed fast when it is sent). ``failing_s`` runs from the
    fault's start to the last failure before the next fault: set beside ``s`` (how long
    the fault itself lasted: the stall, or the kill and the restart until the new process
    serves), it shows how long clients take to find a restarted tier again.
    """
    starts = [event["at_s"] for event in events] + [float("inf")]
    for event, end in zip(events, starts[1:], strict=True):
        failed = [at for at, ok in outcomes if event["at_s"] <= at < end and not ok]
        event["failed_after"] = len(failed)
        event["failing_s"] = round(max(failed) - event["at_s"], 2) if failed else 0.0


def _replied(ticket: Ticket) -> str | None:
    """The wire id of a request that a reply settled (which a second reply would carry)."""
    sent = ticket._sent
    if sent is None or sent.future.cancelled() or sent.future.exception() is not None:
        return None
    return sent.wire_id


def _kind(error: BaseException | None) -> str:
    """A failed request's error, in a few words."""
    text = str(error)
    if isinstance(error, DeadlineError):
        return "deadline passed"
    if isinstance(error, RemoteError):
        return f"{error.tier or 'remote'} answered {error.code}"
    if " is down" in text:
        return "edge known down: failed fast"
    if "went away" in text:
        return "stream broke (tier killed)"
    return type(error).__name__


def faults(plan_dir: Path, reference: Reference, work: Path, args: argparse.Namespace) -> dict:
    """``args.requests`` requests across SIGSTOP, SIGKILL and restart of each process."""
    logs: Path = args.logs
    redis = Redis(work, logs / "faults-redis-1.log")
    key = work / "redis-hmac.key"  # entries authenticated, as a deployment should run
    key.write_bytes(os.urandom(32))
    cache = (
        f"redis://127.0.0.1:{redis.port}/0?budget=16MiB&timeout=100ms&cooldown=1s"
        f"&hmac_key_file={key}"
    )
    dropped = _DroppedReplies()
    mux_logger = logging.getLogger("tierflow.transport.stream_client")
    mux_logger.addHandler(dropped)
    mux_logger.setLevel(logging.DEBUG)
    mux_logger.propagate = False  # counted here; its warnings would flood the output
    events: list[dict[str, Any]] = []
    crashes: list[dict[str, str]] = []  # a process found dead that was not killed
    broken: list[BaseException] = []  # the injector's own failure (a restart that failed)
    done = threading.Event()
    try:
        with _tiers(plan_dir, logs / "faults", cloud_extra=("--cache", cache)) as (edge, cloud):
            targets: dict[str, Any] = {"edge": edge, "cloud": cloud, "redis": redis}

            def check(name: str) -> None:
                """A tier that died by itself is a crash: quote its log, start it again."""
                for tier in (edge, cloud):
                    status = tier.process.process.poll() if tier.process else None
                    if status is not None:
                        crashes.append(
                            {"tier": tier.tier, "status": str(status), "log": tier.log_tail(20)}
                        )
                        print(
                            f"[chaos] {tier.tier} exited by itself ({status}) before "
                            f"{name}; its log ends:\n{tier.log_tail(20)}",
                            file=sys.stderr,
                        )
                        tier.start()

            def inject() -> None:
                try:
                    faulting()
                except BaseException as exc:  # reported by the main thread
                    broken.append(exc)
                    done.set()

            def faulting() -> None:
                while not done.is_set():
                    for name, target in targets.items():
                        for action in ("SIGSTOP", "SIGKILL"):
                            if done.wait(args.fault_every):
                                return
                            check(f"{action} {name}")
                            started = time.monotonic()
                            if action == "SIGSTOP":
                                os.kill(target.pid, signal.SIGSTOP)
                                time.sleep(args.stall)
                                os.kill(target.pid, signal.SIGCONT)
                            else:
                                target.kill()
                                time.sleep(0.2)
                                target.start()
                            took = time.monotonic() - started
                            events.append(
                                {
                                    "target": name,
                                    "action": action,
                                    "s": round(took, 2),
                                    "at_s": round(started - began, 2),
                                }
                            )

            injector = threading.Thread(target=inject, name="faults", daemon=True)
            counts: Counter[str] = Counter()
            answered: set[str] = set()  # wire ids of the requests a reply settled
            errors: Counter[str] = Counter()
            outcomes: list[tuple[float, bool]] = []  # (settled at, answered) per request
            began = started = time.monotonic()
            with DeviceClient(
                plan_dir, edge.address, window=args.window, deadline_s=args.deadline
            ) as device:
                injector.start()
                in_flight: list[tuple[int, Ticket]] = []

                def settle(index: int, ticket: Ticket) -> None:
                    limit = time.monotonic() + args.deadline + 10.0
                    while not ticket.done() and time.monotonic() < limit:
                        time.sleep(0.005)
                    if not ticket.done():
                        counts["lost"] += 1
                        return
                    result = ticket.result()
                    outcomes.append((time.monotonic() - began, result.ok))
                    wire_id = _replied(ticket)
                    if wire_id is not None:
                        answered.add(wire_id)
                    if result.ok:
                        counts["correct" if reference.correct(index, result) else "wrong"] += 1
                    else:
                        counts["failed"] += 1
                        errors[_kind(result.error)] += 1

                due = started  # when the next request is offered
                for index in range(args.requests):
                    if broken:
                        break
                    # A steady offered load, so that the run spans the faults. One that
                    # falls behind (a stalled tier filled the window) goes on at the same
                    # rate, never in a burst: a backlog fired at once at a tier that is
                    # down would fail thousands of requests in a second.
                    due = max(due + 1 / args.rate, time.monotonic())
                    pause = due - time.monotonic()
                    if pause > 0:
                        time.sleep(pause)
                    in_flight.append((index, device.submit(reference.feeds(index))))
                    if len(in_flight) >= args.window:
                        settle(*in_flight.pop(0))
                for entry in in_flight:
                    settle(*entry)
            elapsed = time.monotonic() - started
            done.set()
            injector.join()
            check("the end")
    finally:
        done.set()
        mux_logger.removeHandler(dropped)
        mux_logger.propagate = True
        redis.kill()
    if broken:
        raise RuntimeError(f"the fault injector failed: {broken[0]}") from broken[0]
    _failure_windows(events, outcomes)
    return {
        "requests": args.requests,
        "crashes": crashes,
        "seconds": round(elapsed, 1),
        "correct": counts["correct"],
        "wrong": counts["wrong"],
        "failed": counts["failed"],
        "lost": counts["lost"],
        "duplicated": sum(1 for wire_id in dropped.ids if wire_id in answered),
        "dropped_extra_replies": len(dropped.ids),
        "errors_by_code": dict(errors),
        "faults": events,
        "window": args.window,
        "rate_per_s": args.rate,
        "deadline_s": args.deadline,
    }


# ---------------------------------------------------------------------------- streams


def _tiers_ms(result: Result) -> float:
    """The time a request spent in the edge and the cloud: queues, codecs, compute."""
    spent = sum(
        result.timings.get(tier, {}).get(part, 0.0)
        for tier in ("edge", "cloud")
        for part in ("queue_ms", "codec_ms", "compute_ms")
    )
    return spent + result.links.get("edge-cloud", {}).get("queue_ms", 0.0)


def _latencies(samples: list[tuple[float, float]], elapsed: float) -> dict[str, Any]:
    """Percentiles of (end-to-end ms, ms in the tiers) samples, and the rate."""
    totals = sorted(total for total, _ in samples)
    tiers = sorted(spent for _, spent in samples)

    def pick(ordered: list[float], q: float) -> float | None:
        return round(float(np.percentile(ordered, q)), 2) if ordered else None

    return {
        "p50_ms": pick(totals, 50),
        "p90_ms": pick(totals, 90),
        "p99_ms": pick(totals, 99),
        "max_ms": round(totals[-1], 2) if totals else None,
        "tiers_p50_ms": pick(tiers, 50),
        "tiers_p99_ms": pick(tiers, 99),
        "requests_per_s": round(len(totals) / elapsed, 1),
    }


def streams(plan_dir: Path, reference: Reference, work: Path, args: argparse.Namespace) -> dict:
    """``args.streams`` devices at once: paced, then each as fast as its answers come.

    Paced: each device sends ``args.stream_paced`` requests, one every
    ``args.stream_interval`` s (first ones spread over the interval), which offers
    streams / interval requests per second: the latency a device sees among many that
    are all connected. Saturated: each sends ``args.stream_requests`` more, the next as
    soon as the last is answered, which measures the most the tiers (and this process's
    256 clients) answer on this machine; there p50 is about streams / throughput (Little's
    law), and the spread between p50, p99 and max shows whether some streams wait longer.
    """
    counts: Counter[str] = Counter()
    lock = threading.Lock()
    cap = str(max(args.streams, 256))
    phases: dict[str, dict[str, Any]] = {}
    with _tiers(plan_dir, args.logs / "streams", "--max-streams-per-peer", cap) as (edge, _):
        clients = [
            DeviceClient(plan_dir, edge.address, window=1, deadline_s=60)
            for _ in range(args.streams)
        ]
        connect_ms: list[float] = []
        latencies: dict[str, list[tuple[float, float]]] = {"paced": [], "saturated": []}
        barriers = {name: threading.Barrier(args.streams + 1) for name in ("open", *latencies)}
        started: dict[str, float] = {}

        def one(client: DeviceClient, index: int, phase: str) -> None:
            start = time.perf_counter()
            result = client.submit(reference.feeds(index)).result()
            ms = (time.perf_counter() - start) * 1e3
            with lock:
                if result.ok and reference.correct(index, result):
                    counts["correct"] += 1
                    latencies[phase].append((ms, _tiers_ms(result)))
                else:
                    counts["wrong" if result.ok else "failed"] += 1

        def device(number: int, client: DeviceClient) -> None:
            start = time.perf_counter()  # the first request opens the stream: not counted
            first = client.submit(reference.feeds(number)).result()
            with lock:
                connect_ms.append((time.perf_counter() - start) * 1e3)
                if not first.ok:
                    counts["failed to open"] += 1
            barriers["open"].wait()
            barriers["paced"].wait()
            offset = random.Random(number).random() * args.stream_interval
            for k in range(args.stream_paced):
                pause = started["paced"] + offset + k * args.stream_interval - time.monotonic()
                if pause > 0:
                    time.sleep(pause)
                one(client, number * 1000 + k, "paced")
            barriers["saturated"].wait()
            for k in range(args.stream_requests):
                one(client, number * 1000 + 500 + k, "saturated")

        threads = [
            threading.Thread(target=device, args=(n, c), daemon=True) for n, c in enumerate(clients)
        ]
        for thread in threads:
            thread.start()
        barriers["open"].wait()  # every stream is open
        started["paced"] = time.monotonic()
        barriers["paced"].wait()
        barriers["saturated"].wait()  # every device's paced requests are answered
        started["saturated"] = time.monotonic()
        phases["paced"] = _latencies(latencies["paced"], started["saturated"] - started["paced"])
        for thread in threads:
            thread.join()
        phases["saturated"] = _latencies(
            latencies["saturated"], time.monotonic() - started["saturated"]
        )
        edge_rss = peak_rss(edge.pid) / 2**20
        for client in clients:
            client.close()
    phases["paced"]["offered_per_s"] = round(args.streams / args.stream_interval, 1)
    phases["paced"]["requests_per_stream"] = args.stream_paced
    phases["saturated"]["requests_per_stream"] = args.stream_requests
    return {
        "streams": args.streams,
        "requests_per_stream": args.stream_paced + args.stream_requests,
        "correct": counts["correct"],
        "wrong": counts["wrong"],
        "failed": counts["failed"],
        "paced": phases["paced"],
        "saturated": phases["saturated"],
        "failed_to_open": counts["failed to open"],
        "first_request_p50_ms": round(float(np.percentile(connect_ms, 50)), 1),
        "first_request_max_ms": round(max(connect_ms), 1),
        "edge_peak_rss_mib": round(edge_rss, 1),
    }


# ---------------------------------------------------------------------------- fuzz


def _valid_request(plan_dir: Path, reference: Reference, index: int) -> tier_pb2.Request:
    plan = load_plan(plan_dir)
    outcome = TierRunner(plan, plan_dir, "device").run(reference.feeds(index))
    request = tier_pb2.Request(id=f"v{index}", plan_id=plan.plan_id, segment=outcome.next_segment)
    put_tensors(request.tensors, outcome.tensors, plan.link_codec("device-edge"))
    return request


def _mutate(data: bytes, rng: random.Random) -> bytes:
    buffer = bytearray(data)
    for _ in range(rng.randint(1, 8)):
        kind = rng.random()
        position = rng.randrange(len(buffer)) if buffer else 0
        if kind < 0.5 and buffer:
            buffer[position] = rng.randrange(256)
        elif kind < 0.75:
            buffer[position:position] = os.urandom(rng.randint(1, 16))
        else:
            del buffer[position : position + rng.randint(1, 16)]
    return bytes(buffer)


def _lying(valid: tier_pb2.Request, rng: random.Random, number: int) -> bytes:
    request = tier_pb2.Request()
    request.CopyFrom(valid)
    request.id = f"lie{number}"
    tensor = request.tensors[0]
    choice = rng.randrange(6)
    if choice == 0:
        del tensor.shape[:]
        tensor.shape.extend([1, 1 << rng.randint(20, 62)])
    elif choice == 1:
        tensor.codec = rng.choice(["zstd", "int8", "fp16+zstd", "jpeg:90", "bogus", "zstd:99"])
    elif choice == 2:
        tensor.dtype = rng.choice(["float64", "int8", "bool", "complex64", "object", ""])
    elif choice == 3:
        tensor.data = os.urandom(rng.randint(0, 4096))
    elif choice == 4:
        tensor.codec = "zstd"
        import zstandard

        tensor.data = zstandard.ZstdCompressor().compress(bytes(1 << 24))  # a 16 MiB bomb
    else:
        tensor.params = os.urandom(rng.randint(1, 64))
        tensor.codec = "int8"
    return request.SerializeToString()


def _poison(valid: tier_pb2.Request, rng: random.Random, number: int) -> bytes:
    request = tier_pb2.Request()
    request.CopyFrom(valid)
    request.id = f"poison{number}"
    request.deadline_unix_s = rng.choice([float("inf"), float("-inf"), float("nan"), 1e300, -1.0])
    return request.SerializeToString()


def _many(valid: tier_pb2.Request, number: int) -> bytes:
    request = tier_pb2.Request(id=f"many{number}", plan_id=valid.plan_id, segment=valid.segment)
    for i in range(200_000):
        request.tensors.add(name=f"t{i}", dtype="float32", shape=[1], codec="raw", data=b"0000")
    return request.SerializeToString()


def _infer_replies(address: str, messages: list[bytes]) -> tuple[int, str | None]:
    """Send raw ``messages`` on one Infer stream; the replies received and how it ended."""
    channel = grpc.insecure_channel(address, options=channel_options())
    call = channel.stream_stream(
        "/tierflow.rpc.Tier/Infer",
        request_serializer=None,
        response_deserializer=tier_pb2.Reply.FromString,
    )
    replies, ended = 0, None
    try:
        for _ in call(iter(messages), timeout=60):
            replies += 1
    except grpc.RpcError as exc:
        ended = exc.code().name if isinstance(exc, grpc.Call) else str(exc)
    finally:
        channel.close()
    return replies, ended


def _probe_once(address: str, message: bytes) -> str:
    channel = grpc.insecure_channel(address, options=channel_options())
    call = channel.stream_stream(
        "/tierflow.rpc.Tier/Probe", request_serializer=None, response_deserializer=None
    )
    try:
        for _ in call(iter([message]), timeout=10):
            pass
        return "OK"
    except grpc.RpcError as exc:
        return exc.code().name if isinstance(exc, grpc.Call) else "ERROR"
    finally:
        channel.close()


def fuzz(plan_dir: Path, reference: Reference, work: Path, args: argparse.Namespace) -> dict:
    """``args.fuzz`` hostile messages of each class; both tiers must stay up and correct.

    A tier found dead after a class is a crash: its log's end is kept and it is started
    again, so that the classes after it are still tried.
    """
    rng = random.Random(0)
    valid = _valid_request(plan_dir, reference, 0)
    valid_bytes = valid.SerializeToString()
    probe = tier_pb2.ProbeMessage(seq=1, payload=bytes(64), reply_bytes=64).SerializeToString()
    count = args.fuzz
    classes: dict[str, list[bytes]] = {
        "infer: random bytes": [os.urandom(rng.randint(0, 2048)) for _ in range(count)],
        "infer: mutated request": [_mutate(valid_bytes, rng) for _ in range(count)],
        "infer: lying headers": [_lying(valid, rng, n) for n in range(count)],
        "infer: poison deadline": [_poison(valid, rng, n) for n in range(count)],
        "infer: 200k tensors": [_many(valid, n) for n in range(args.many_tensor_messages)],
    }
    probes = [os.urandom(rng.randint(0, 256)) for _ in range(count // 2)]
    probes += [_mutate(probe, rng) for _ in range(count - count // 2)]
    rows: list[dict[str, Any]] = []
    crashes: list[dict[str, str]] = []
    peak = {"edge": 0.0, "cloud": 0.0}
    with _tiers(plan_dir, args.logs / "fuzz") as (edge, cloud):

        def survived(after: str) -> None:
            for tier in (edge, cloud):
                assert tier.process is not None
                peak[tier.tier] = max(peak[tier.tier], peak_rss(tier.pid) / 2**20)
                status = tier.process.process.poll()
                if status is not None:
                    tail = tier.log_tail(20)
                    crashes.append({"tier": tier.tier, "after": after, "log": tail})
                    print(f"[chaos] {tier.tier} died during {after}:\n{tail}", file=sys.stderr)
                    tier.start()

        for name, messages in classes.items():
            started = time.monotonic()
            replies, broken = 0, Counter[str]()
            for start in range(0, len(messages), 200):
                batch = messages[start : start + 200]
                got, ended = _infer_replies(edge.address, batch)
                replies += got
                if ended is not None:
                    broken[ended] += 1
            rows.append(
                {
                    "class": name,
                    "messages": len(messages),
                    "replies": replies,
                    "streams_ended_by_error": dict(broken),
                    "seconds": round(time.monotonic() - started, 2),
                }
            )
            survived(name)
        started = time.monotonic()
        outcomes = Counter(_probe_once(edge.address, message) for message in probes)
        rows.append(
            {
                "class": "probe: random and mutated",
                "messages": len(probes),
                "replies": None,
                "streams_ended_by_error": {k: v for k, v in outcomes.items() if k != "OK"},
                "seconds": round(time.monotonic() - started, 2),
            }
        )
        survived("probe: random and mutated")
        with DeviceClient(plan_dir, edge.address, deadline_s=10) as device:
            after = device.submit(reference.feeds(7)).result()
        survived("the valid request after")
    return {
        "messages": sum(r["messages"] for r in rows),
        "messages_per_class": count,
        "classes": rows,
        "crashes": len(crashes),
        "crashed": crashes,
        "correct_after": bool(after.ok and reference.correct(7, after)),
        "peak_rss_mib": {k: round(v, 1) for k, v in peak.items()},
    }


# ---------------------------------------------------------------------------- tls


def certificates(directory: Path) -> dict[str, str]:
    """A throw-away CA and one certificate (server and client use, 127.0.0.1) signed by it."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def name(text: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, text)])

    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())

    def build(subject: str, public: Any, ca: bool) -> x509.CertificateBuilder:
        return (
            x509.CertificateBuilder()
            .subject_name(name(subject))
            .issuer_name(name("chaos CA"))
            .public_key(public)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )

    ca = build("chaos CA", ca_key.public_key(), True).sign(ca_key, hashes.SHA256())
    tier = (
        build("tier", key.public_key(), False)
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    files = {
        "ca": directory / "ca.pem",
        "cert": directory / "tier.pem",
        "key": directory / "tier.key",
    }
    files["ca"].write_bytes(ca.public_bytes(pem))
    files["cert"].write_bytes(tier.public_bytes(pem))
    files["key"].write_bytes(
        key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return {k: str(v) for k, v in files.items()}


def _quartiles(values: list[float]) -> list[float]:
    return [round(float(q), 4) for q in np.percentile(values, [25, 50, 75])]


def _tls_row(
    label: str,
    plan_dir: Path,
    reference: Reference,
    files: dict[str, str],
    args: argparse.Namespace,
) -> dict[str, Any]:
    """One feature size: a plaintext and an mTLS pair of tiers side by side, interleaved.

    See [Note: measuring the TLS overhead].
    """
    flags = ["--tls-cert", files["cert"], "--tls-key", files["key"], "--tls-ca", files["ca"]]
    secure = RuntimeOptions(
        security=Security(tls_cert=files["cert"], tls_key=files["key"], tls_ca=files["ca"])
    )
    tag = label.replace(" ", "")
    times: dict[str, list[list[float]]] = {"plaintext": [], "mtls": []}
    bad = 0
    with ExitStack() as stack:
        edges = {
            "plaintext": stack.enter_context(_tiers(plan_dir, args.logs / f"tls-{tag}-plain"))[0],
            "mtls": stack.enter_context(_tiers(plan_dir, args.logs / f"tls-{tag}-mtls", *flags))[0],
        }
        devices = {
            mode: stack.enter_context(
                DeviceClient(
                    plan_dir,
                    edges[mode].address,
                    options=secure if mode == "mtls" else RuntimeOptions(),
                    deadline_s=30,
                )
            )
            for mode in edges
        }
        index = 0
        for round_number in range(-1, args.tls_rounds):  # round -1: warm-up, not kept
            order = ("plaintext", "mtls") if round_number % 2 == 0 else ("mtls", "plaintext")
            kept: dict[str, list[float]] = {mode: [] for mode in order}
            for _ in range(args.tls_requests):
                for mode in order:
                    index += 1
                    start = time.perf_counter()
                    result = devices[mode].submit(reference.feeds(index)).result()
                    kept[mode].append((time.perf_counter() - start) * 1e3)
                    if not (result.ok and reference.correct(index, result)):
                        bad += 1
            if round_number >= 0:
                for mode in order:
                    times[mode].append(kept[mode])
    plain = [statistics.median(r) for r in times["plaintext"]]
    mtls = [statistics.median(r) for r in times["mtls"]]
    ratios = [t / p for t, p in zip(mtls, plain, strict=True)]
    per_hop = [(t - p) / 2 for t, p in zip(mtls, plain, strict=True)]
    half = len(ratios) // 2
    every = {mode: [ms for r in rounds for ms in r] for mode, rounds in times.items()}
    return {
        "feature": label,
        "rounds": len(ratios),
        "requests_per_mode": len(every["mtls"]),
        "plaintext_p50_ms": round(statistics.median(every["plaintext"]), 3),
        "mtls_p50_ms": round(statistics.median(every["mtls"]), 3),
        "ratio_p50": round(statistics.median(ratios), 4),
        "ratio_quartiles": _quartiles(ratios),
        "ratio_p50_halves": [
            round(statistics.median(ratios[:half]), 4),
            round(statistics.median(ratios[half:]), 4),
        ],
        "overhead_per_hop_ms": round(statistics.median(per_hop), 3),
        "overhead_per_hop_ms_quartiles": _quartiles(per_hop),
        "wrong_or_failed": bad,
    }


def tls(work: Path, args: argparse.Namespace) -> dict:
    """Plaintext against mutual TLS on both hops, one request at a time, interleaved.

    [Note: measuring the TLS overhead]
    On a shared machine the time of one request drifts by milliseconds within a minute,
    more than what TLS costs, so plaintext and mTLS runs one after the other compare two
    different machines. Here both pairs of tiers run at once and the device alternates
    single requests between them (plaintext, mTLS, plaintext, ... and the other way round
    in the next round, so neither always goes first). Each round of ``--tls-requests``
    pairs gives a median per mode and their ratio; the figure is the median of those
    per-round ratios, which a spell of load cannot move much since it hits both modes
    of a round alike. Its quartiles and the medians of the first and second half of the
    rounds say how stable it is. Overhead per hop = (mTLS - plaintext) / 2 per round,
    both hops carrying the same feature size.
    """
    files = certificates(work)
    rows = []
    for label, width in (("256 B", 64), ("100 KB", 25_000)):
        plan_dir = (
            _mlp_plan(work / "tls-mlp") if width == 64 else _wide_plan(work / "tls-wide", width)
        )
        rows.append(_tls_row(label, plan_dir, Reference(plan_dir, width), files, args))
    return {"rounds": args.tls_rounds, "pairs_per_round": args.tls_requests, "rows": rows}


# ---------------------------------------------------------------------------- report


def _print(results: dict[str, Any]) -> None:
    f = results.get("faults")
    if f:
        print(f"\nfaults: {f['requests']} requests in {f['seconds']} s, {len(f['faults'])} faults")
        head = ["correct", "wrong", "failed", "lost", "duplicated", "extra replies dropped"]
        keys = ["correct", "wrong", "failed", "lost", "duplicated", "dropped_extra_replies"]
        print(format_table(head, [[f[k] for k in keys]]))
        print("errors by code:", f["errors_by_code"])
        for crash in f.get("crashes", []):
            print(f"CRASH: {crash['tier']} exited by itself ({crash['status']}):\n{crash['log']}")
    s = results.get("streams")
    if s:
        print(
            f"\nstreams: {s['streams']} devices x {s['requests_per_stream']} requests: "
            f"{s['correct']} correct, {s['wrong']} wrong, {s['failed']} failed, edge peak "
            f"{s['edge_peak_rss_mib']} MiB"
        )
        head = ["phase", "requests/stream", "p50 ms", "p99 ms", "max ms", "req/s"]
        head += ["tiers p50 ms", "tiers p99 ms"]
        keys = ["requests_per_stream", "p50_ms", "p99_ms", "max_ms", "requests_per_s"]
        keys += ["tiers_p50_ms", "tiers_p99_ms"]
        print(format_table(head, [[phase, *(s[phase][k] for k in keys)] for phase in PHASES]))
    z = results.get("fuzz")
    if z:
        print(
            f"\nfuzz: {z['messages']} messages, {z['crashes']} crashes, correct after: "
            f"{z['correct_after']}, peak RSS MiB {z['peak_rss_mib']}"
        )
        rows = [
            [
                r["class"],
                r["messages"],
                r["replies"] if r["replies"] is not None else "-",
                ", ".join(f"{k} {v}" for k, v in r["streams_ended_by_error"].items()) or "-",
                r["seconds"],
            ]
            for r in z["classes"]
        ]
        print(format_table(["class", "messages", "replies", "streams ended", "s"], rows))
    t = results.get("tls")
    if t:
        print(
            f"\ntls: {t['rounds']} interleaved rounds of {t['pairs_per_round']} request pairs, "
            "one request at a time"
        )
        head = ["feature", "plain p50 ms", "mTLS p50 ms", "ratio (rounds' median)"]
        head += ["ratio quartiles", "halves", "per hop ms", "bad"]
        rows = [
            [
                r["feature"],
                r["plaintext_p50_ms"],
                r["mtls_p50_ms"],
                r["ratio_p50"],
                " / ".join(str(x) for x in r["ratio_quartiles"]),
                " / ".join(str(x) for x in r["ratio_p50_halves"]),
                r["overhead_per_hop_ms"],
                r["wrong_or_failed"],
            ]
            for r in t["rows"]
        ]
        print(format_table(head, rows))
    for part in ("faults", "streams", "fuzz", "tls"):
        found = results.get(part, {}).get("server_logs")
        if found:
            print(
                f"\n{part} server logs ({found['files']} files in {found['dir']}): "
                f"{found['lines_by_level'] or 'no warnings'}, {found['tracebacks']} tracebacks"
            )
            for line in found["quoted"]:
                print("  " + line)


PHASES = ("paced", "saturated")
SECTION = "## Chaos: faults, many streams, fuzzed messages, TLS"


def _fault_rows(events: list[dict[str, Any]]) -> list[str]:
    rows = []
    for kind in sorted({(e["action"], e["target"]) for e in events}):
        some = [e for e in events if (e["action"], e["target"]) == kind]
        lasted = statistics.median(e["s"] for e in some)
        failing = statistics.median(e.get("failing_s", float("nan")) for e in some)
        failed = sum(e.get("failed_after", 0) for e in some)
        rows.append(f"| {' '.join(kind)} | {len(some)} | {lasted:.2f} | {failing:.2f} | {failed} |")
    return rows


def _logs_line(part: dict[str, Any]) -> list[str]:
    """What a part's server logs say, in one paragraph (tracebacks and errors quoted)."""
    found = part.get("server_logs")
    if not found:
        return []
    levels = found["lines_by_level"]
    counts = ", ".join(f"{levels[k]} {k}" for k in ("CRITICAL", "ERROR", "WARNING") if k in levels)
    text = (
        f"Server logs ({found['files']} files, kept for the run): {counts or 'no warnings'}, "
        f"{found['tracebacks']} tracebacks."
    )
    if found["commonest"]:
        text += " Commonest: " + "; ".join(
            f"`{c['message']}` ×{c['count']}" for c in found["commonest"][:3]
        )
        text += "."
    if found["quoted"]:
        text += " Quoted: " + "; ".join(f"`{q}`" for q in found["quoted"][:5]) + "."
    return [text + "\n"]


def markdown(results: dict[str, Any]) -> list[str]:
    """The RESULTS.md section for ``results`` (chaos.json), as a list of paragraphs."""
    machine = results.get("machine", {})
    lines = [
        f"{SECTION}\n",
        "From `"
        + f"python -m benchmarks.chaos {results.get('command', '')}".strip()
        + "`"
        + " (counts in `flags` of chaos.json)"
        + f" on {results.get('date', '?')} ({machine.get('cpus')} cores, shared; "
        f"{load_words(machine.get('load_average'))}). "
        "Real `tierflow serve` processes and `redis-server` on 127.0.0.1; the devices run in "
        "the benchmark's process. Raw figures: `chaos.json`.\n",
    ]
    f = results.get("faults")
    if f:
        kinds = Counter(f"{e['action']} {e['target']}" for e in f["faults"])
        crashes = f.get("crashes", [])
        lines += [
            "### Requests across SIGSTOP, SIGKILL and restart of each tier and of Redis\n",
            f"{f['requests']:,} requests (window {f['window']}, deadline {f['deadline_s']} s, "
            f"offered at {f.get('rate_per_s', '?')}/s) in {f['seconds']} s, while edge, cloud "
            "and Redis were in turn stopped with SIGSTOP and then killed with SIGKILL and "
            "restarted on the same port: "
            + ", ".join(f"{k} ×{v}" for k, v in sorted(kinds.items()))
            + ". Every answer compared bit for bit with the unsplit model's.\n",
            "| correct | wrong | failed (typed error) | lost | duplicated "
            "| extra replies dropped | tiers that died by themselves |",
            "|---|---|---|---|---|---|---|",
            f"| {f['correct']} | {f['wrong']} | {f['failed']} | {f['lost']} | "
            f"{f['duplicated']} | {f['dropped_extra_replies']} | {len(crashes)} |\n",
            f"Failed requests by error: {f['errors_by_code'] or 'none'}. A request in flight on "
            "a tier that is killed may have reached it, so it is failed with a typed error, "
            "never sent twice ([Note: retries and failing fast] in "
            "`tierflow/transport/stream_client.py`); while "
            "a killed edge restarts, the device fails requests at once (`known down`), and "
            "while a killed cloud restarts the edge answers UPSTREAM_UNAVAILABLE, so most "
            "failures are requests offered at the steady rate during a restart, which takes "
            "seconds on a machine this loaded. Per kind of fault (medians): how long it "
            "lasted (the stall, or the kill and the restart until the new process serves), "
            "and from its start to the last request that failed before the next fault (where "
            "the device saw it end):\n",
            "| fault | times | lasted s | failing s | failed requests |",
            "|---|---|---|---|---|",
            *_fault_rows(f["faults"]),
            "",
            *_logs_line(f),
        ]
    s = results.get("streams")
    if s:
        lines += [
            "### Concurrent device streams\n",
            f"{s['streams']} devices at once, each with its own channel and stream "
            f"(`--max-streams-per-peer {max(s['streams'], 256)}`: all come from 127.0.0.1). "
            "Each device first opens its stream with one request (first-request p50 "
            f"{s['first_request_p50_ms']} ms, max {s['first_request_max_ms']} ms, "
            f"{s['failed_to_open']} failed); then, all together, **paced**: each sends "
            f"{s['paced']['requests_per_stream']} requests, one every "
            f"{s['streams'] / s['paced']['offered_per_s']:g} s ({s['paced']['offered_per_s']:g}"
            "/s in all, the devices' phases spread), the latency one device sees among many "
            "connected ones; then **saturated**: each "
            f"sends {s['saturated']['requests_per_stream']} more, the next as soon as the "
            "last is answered, the most this machine answers with 256 clients in one process; "
            "there p50 is about streams / throughput (Little's law), and p99 and max against "
            f"p50 show whether some streams wait longer than others. Of "
            f"{s['correct'] + s['wrong'] + s['failed']:,} requests: {s['correct']:,} correct, "
            f"{s['wrong']} wrong, {s['failed']} failed; edge peak RSS "
            f"{s['edge_peak_rss_mib']} MiB.\n",
            "| streams | phase | requests per stream | p50 ms | p90 ms | p99 ms | max ms | req/s "
            "| in the tiers: p50 ms | p99 ms |",
            "|---|---|---|---|---|---|---|---|---|---|",
            *(
                f"| {s['streams']} | {phase} | {s[phase]['requests_per_stream']} | "
                f"{s[phase]['p50_ms']} | {s[phase].get('p90_ms')} | **{s[phase]['p99_ms']}** | "
                f"{s[phase]['max_ms']} | {s[phase]['requests_per_s']} | "
                f"{s[phase].get('tiers_p50_ms')} | {s[phase].get('tiers_p99_ms')} |"
                for phase in PHASES
            ),
            "",
            "In the tiers: the time a request spent in the edge and the cloud (queues, codecs "
            "and compute, as the tiers report it); the rest of end to end is the device's "
            "segment, gRPC and sockets, and this process's 256 clients and their threads "
            "waiting for the same two cores as the tiers.\n",
            *_logs_line(s),
        ]
    z = results.get("fuzz")
    if z:
        lines += [
            "### Fuzzed messages\n",
            f"{z['messages']:,} messages to the edge ({z.get('messages_per_class', '?'):,} of "
            "each class but the 200k-tensor one, whose messages are 2.6 MB each); crashes: "
            f"**{z['crashes']}**; a valid request answered correctly afterwards: "
            f"{z['correct_after']}; peak resident memory (VmHWM): edge "
            f"{z['peak_rss_mib']['edge']} MiB, cloud {z['peak_rss_mib']['cloud']} MiB. Every "
            "`Infer` message gets one reply (an undecodable one a typed error); an undecodable "
            "probe message ends its probe INVALID_ARGUMENT.\n",
            "| class | messages | replies | streams ended by an error | seconds |",
            "|---|---|---|---|---|",
            *(
                f"| {r['class']} | {r['messages']} | "
                f"{r['replies'] if r['replies'] is not None else '-'} | "
                + (", ".join(f"{k} {v}" for k, v in r["streams_ended_by_error"].items()) or "-")
                + f" | {r['seconds']} |"
                for r in z["classes"]
            ),
            "",
            *_logs_line(z),
        ]
    t = results.get("tls")
    if t:
        lines += [
            "### TLS overhead per hop\n",
            "Device -> edge -> cloud, one request at a time, a plaintext pair of tiers and a "
            "mutual-TLS pair (P-256 certificates, both hops) running side by side; the device "
            f"alternates single requests between them, {t['pairs_per_round']} pairs per round, "
            f"{t['rounds']} rounds (the order flips every round). Ratio = the median over "
            "rounds of each round's mTLS p50 / plaintext p50, so load that comes and goes hits "
            "both sides of a ratio alike; its quartiles over rounds and its medians over the "
            "first and second half of the rounds show how stable it is. Overhead per hop = "
            "the median over rounds of (mTLS p50 − plaintext p50) / 2 "
            "([Note: measuring the TLS overhead] in `benchmarks/chaos.py`).\n",
            "| feature | plaintext p50 ms | mTLS p50 ms | mTLS / plaintext | ratio quartiles "
            "| ratio, 1st / 2nd half | overhead per hop ms (quartiles) | wrong or failed |",
            "|---|---|---|---|---|---|---|---|",
            *(
                f"| {r['feature']} | {r['plaintext_p50_ms']} | {r['mtls_p50_ms']} | "
                f"**{r['ratio_p50']:.3f}** | "
                + " – ".join(f"{x:.3f}" for x in r["ratio_quartiles"][::2])
                + " | "
                + " / ".join(f"{x:.3f}" for x in r["ratio_p50_halves"])
                + f" | **{r['overhead_per_hop_ms']}** ("
                + " – ".join(f"{x:.3f}" for x in r["overhead_per_hop_ms_quartiles"][::2])
                + f") | {r['wrong_or_failed']} |"
                for r in t["rows"]
            ),
            "",
            *_logs_line(t),
        ]
    return lines


def update_results_md(path: Path, lines: list[str]) -> None:
    """Put the chaos section into RESULTS.md, replacing the one there (if any)."""
    text = path.read_text() if path.exists() else "# tierflow benchmark results\n"
    section = "\n".join(lines).rstrip() + "\n"
    start = text.find(SECTION)
    if start < 0:
        text = text.rstrip() + "\n\n" + section
    else:
        end = text.find("\n## ", start + len(SECTION))
        text = text[:start] + section + ("" if end < 0 else text[end:])
    path.write_text(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=100_000, help="requests across faults")
    parser.add_argument("--window", type=int, default=16, help="requests in flight (faults)")
    parser.add_argument("--rate", type=float, default=400.0, help="requests offered per second")
    parser.add_argument("--deadline", type=float, default=5.0, help="per request, seconds")
    parser.add_argument("--fault-every", type=float, default=2.0, help="seconds between faults")
    parser.add_argument("--stall", type=float, default=1.0, help="seconds a SIGSTOP lasts")
    parser.add_argument("--streams", type=int, default=256, help="concurrent device streams")
    parser.add_argument(
        "--stream-paced", type=int, default=10, help="paced requests per stream, first"
    )
    parser.add_argument(
        "--stream-interval", type=float, default=4.0, help="seconds between paced requests"
    )
    parser.add_argument(
        "--stream-requests", type=int, default=20, help="then requests per stream, back to back"
    )
    parser.add_argument("--fuzz", type=int, default=10_000, help="fuzzed messages per class")
    parser.add_argument(
        "--many-tensor-messages", type=int, default=20, help="200k-tensor messages (2.6 MB each)"
    )
    parser.add_argument("--tls-rounds", type=int, default=40, help="interleaved rounds per size")
    parser.add_argument(
        "--tls-requests", type=int, default=25, help="plaintext/mTLS request pairs per round"
    )
    parser.add_argument(
        "--logs",
        type=Path,
        default=None,
        help="folder kept for the servers' logs (default: a new tierflow-chaos-logs-* folder "
        "in the temporary folder)",
    )
    parser.add_argument(
        "--parts", default="faults,streams,fuzz,tls", help="which parts to run, comma-separated"
    )
    parser.add_argument("--output", type=Path, default=RESULTS)
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="run nothing: print the tables of --output and rewrite RESULTS.md's section",
    )
    args = parser.parse_args(argv)
    if args.report_only:
        saved = json.loads(args.output.read_text())
        _print(saved)
        update_results_md(RESULTS.parent / "RESULTS.md", markdown(saved))
        return 0
    logging.basicConfig(level=logging.ERROR, format="%(message)s")
    # SIGTERM unwinds like Ctrl-C, so that the servers and Redis are stopped on the way out.
    signal.signal(signal.SIGTERM, lambda number, frame: sys.exit(128 + number))
    parts = args.parts.split(",")
    if args.logs is None:
        args.logs = Path(tempfile.mkdtemp(prefix="tierflow-chaos-logs-"))
    args.logs.mkdir(parents=True, exist_ok=True)
    print(f"[chaos] server logs in {args.logs}", file=sys.stderr, flush=True)
    results: dict[str, Any] = {
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "load_average": {"start": load_average()},
        },
        "flags": {k: str(v) for k, v in vars(args).items() if k not in ("output", "logs")},
        "command": " ".join(sys.argv[1:] if argv is None else argv),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }
    with tempfile.TemporaryDirectory(prefix="tierflow-chaos-") as temp, ExitStack():
        work = Path(temp)
        plan_dir = _mlp_plan(work / "plan")
        reference = Reference(plan_dir, 64)
        for part in parts:
            started = time.monotonic()
            print(f"[chaos] {part} ...", file=sys.stderr, flush=True)
            if part == "tls":
                results[part] = tls(work, args)
            else:
                results[part] = {"faults": faults, "streams": streams, "fuzz": fuzz}[part](
                    plan_dir, reference, work, args
                )
            results[part]["wall_s"] = round(time.monotonic() - started, 1)
            results[part]["server_logs"] = log_findings(args.logs, part)
    machine = results["machine"]
    machine["load_average"] = load_span(machine["load_average"]["start"])
    _print(results)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=1) + "\n")
    if args.output == RESULTS:
        update_results_md(RESULTS.parent / "RESULTS.md", markdown(results))
        print(f"\nwrote {args.output} and the chaos section of benchmarks/results/RESULTS.md")
    else:
        print(f"\nwrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
