"""Chaos benchmark: answers across crashes and stalls, many streams, fuzzed messages, TLS cost.

Not a test. Everything runs on this machine, on loopback, as real processes
(``tierflow serve`` for the edge and the cloud, ``redis-server`` for the cloud's shared
cache); the devices run in this process. Four parts, each with its own counts as flags:

* **faults**: ``--requests`` requests stream through device -> edge -> cloud (Redis
  cache on the cloud) while each of edge, cloud and Redis in turn is stopped with SIGSTOP
  for ``--stall`` s, then killed with SIGKILL and restarted on the same port. Every
  answer is compared bit for bit with the unsplit model's output for the same input
  (same ONNX Runtime level and one thread, as the tiers run). Counted: correct, wrong
  (an answer that differs), failed (a typed error: the promise is one answer or one
  error per request, never silence), lost (no result within the deadline + 10 s),
  duplicated (a request whose result was delivered twice), and extra replies the
  device's stream dropped (a second reply for an id, or one after its deadline).
* **streams**: ``--streams`` devices, each its own channel and stream, each sending
  ``--stream-requests`` requests one after another; p50 / p99 latency and errors.
* **fuzz**: ``--fuzz`` messages in several classes (random bytes and mutated messages on
  ``Infer`` and on ``Probe``, headers that lie about shapes and codecs, poison deadlines,
  many-tensor requests); every ``Infer`` message must get exactly one reply, both tiers
  must stay up and answer a valid request correctly afterwards; peak resident memory
  (VmHWM) of both tiers is reported.
* **tls**: one request at a time, plaintext against mutual TLS on both hops, for a
  256-byte and a 100 KB feature; the overhead per hop is half the difference of the
  medians.

Prints a table per part and writes ``benchmarks/results/chaos.json``. Usage::

    python benchmarks/chaos.py [--requests 20000] [--streams 256] [--fuzz 10000]
                               [--tls-requests 300] [--parts faults,streams,fuzz,tls]

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
import onnx
from onnx import TensorProto, helper, numpy_helper

from tierflow.device.client import DeviceClient, Result, Ticket
from tierflow.errors import DeadlineError, RemoteError
from tierflow.mux import channel_options
from tierflow.options import RuntimeOptions
from tierflow.plan import Plan, SegmentSpec, load_plan, save_plan
from tierflow.processes import ServeProcess
from tierflow.rpc import tier_pb2
from tierflow.security import Security
from tierflow.segment_runner import TierRunner
from tierflow.sessions import open_session
from tierflow.table import format_table
from tierflow.wire import put_tensors

RESULTS = Path(__file__).resolve().parent / "results" / "chaos.json"
INPUTS = 64  # distinct inputs, each with its reference answer; request i uses i % INPUTS


# ---------------------------------------------------------------------------- plans


def _mlp_plan(directory: Path) -> Path:
    """x[1,64] -> Gemm+Relu | Gemm+Relu | Gemm -> y[1,10]: device | edge | cloud."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    weights = {
        "w1": rng.standard_normal((64, 64)).astype(np.float32) / 8,
        "w2": rng.standard_normal((64, 64)).astype(np.float32) / 8,
        "w3": rng.standard_normal((10, 64)).astype(np.float32) / 8,
    }
    nodes = [
        helper.make_node("Gemm", ["x", "w1"], ["a"], transB=1),
        helper.make_node("Relu", ["a"], ["h1"]),
        helper.make_node("Gemm", ["h1", "w2"], ["b"], transB=1),
        helper.make_node("Relu", ["b"], ["h2"]),
        helper.make_node("Gemm", ["h2", "w3"], ["y"], transB=1),
    ]
    parts = [("device", [0, 1], "x", "h1", 64), ("edge", [2, 3], "h1", "h2", 64)]
    parts.append(("cloud", [4], "h2", "y", 10))
    return _write(directory, nodes, weights, parts, 64)


def _wide_plan(directory: Path, width: int) -> Path:
    """x[1,W] -> Relu | Sigmoid | ReduceMax -> y: features of 4 W bytes, trivial compute."""
    directory.mkdir(parents=True, exist_ok=True)
    nodes = [
        helper.make_node("Relu", ["x"], ["h1"]),
        helper.make_node("Sigmoid", ["h1"], ["h2"]),
        helper.make_node("ReduceMax", ["h2"], ["y"], keepdims=1),
    ]
    parts = [("device", [0], "x", "h1", width), ("edge", [1], "h1", "h2", width)]
    parts.append(("cloud", [2], "h2", "y", 1))
    return _write(directory, nodes, {}, parts, width)


def _write(
    directory: Path,
    nodes: list[Any],
    weights: dict[str, np.ndarray],
    parts: list[tuple[str, list[int], str, str, int]],
    width: int,
) -> Path:
    def vec(name: str, size: int) -> Any:
        return helper.make_tensor_value_info(name, TensorProto.FLOAT, [1, size])

    def model(picked: list[Any], src: str, dst: str, size_in: int, size_out: int) -> Any:
        used = {i for node in picked for i in node.input}
        inits = [numpy_helper.from_array(w, n) for n, w in weights.items() if n in used]
        graph = helper.make_graph(picked, "g", [vec(src, size_in)], [vec(dst, size_out)], inits)
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])

    onnx.save(model(nodes, "x", "y", width, parts[-1][4]), directory / "model.onnx")
    segments, size_in = [], width
    for tier, picked, src, dst, size_out in parts:
        onnx.save(
            model([nodes[i] for i in picked], src, dst, size_in, size_out),
            directory / f"{tier}.onnx",
        )
        segments.append(SegmentSpec(tier, f"{tier}.onnx", (src,), (dst,)))
        size_in = size_out
    plan = Plan(
        "model.onnx",
        "0" * 64,
        ("x",),
        ("y",),
        tuple(segments),
        codec={"device-edge": "raw", "edge-cloud": "raw"},
    )
    save_plan(plan, directory)
    return directory


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

    def __init__(self, directory: Path) -> None:
        self.port = _free_port()
        self.directory = directory
        self.process: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        command = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1"]
        command += ["--save", "", "--appendonly", "no", "--dir", str(self.directory)]
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
    """A ``tierflow serve`` process on a fixed port, so that it can be killed and restarted."""

    def __init__(self, tier: str, plan_dir: Path, args: list[str], log: Path) -> None:
        self.tier, self.plan_dir, self.args, self.log = tier, plan_dir, args, log
        self.port = _free_port()
        self.process: ServeProcess | None = None
        self.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def start(self) -> None:
        listen = self.address
        self.process = ServeProcess(self.tier, self.plan_dir, *self.args, listen=listen)

    def kill(self) -> None:
        if self.process is not None:
            self.process.kill()

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop(5)


def _peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


@contextmanager
def _tiers(
    plan_dir: Path, work: Path, *extra: str, cloud_extra: tuple[str, ...] = ()
) -> Iterator[tuple[Tier, Tier]]:
    common = ["--grace", "0.5", "--workers", "2", *extra]
    cloud = Tier("cloud", plan_dir, [*common, *cloud_extra], work / "cloud.log")
    try:
        edge = Tier("edge", plan_dir, [*common, "--upstream", cloud.address], work / "edge.log")
        try:
            yield edge, cloud
        finally:
            edge.stop()
    finally:
        cloud.stop()


# ---------------------------------------------------------------------------- faults


class _DroppedReplies(logging.Handler):
    """Counts the replies a device's stream dropped (a second one for an id, or a late one)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        if "came after its deadline" in record.getMessage():
            self.count += 1


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
    redis = Redis(work)
    cache = f"redis://127.0.0.1:{redis.port}/0?budget=16MiB&timeout=100ms&cooldown=1s"
    dropped = _DroppedReplies()
    mux_logger = logging.getLogger("tierflow.mux")
    mux_logger.addHandler(dropped)
    mux_logger.setLevel(logging.DEBUG)
    mux_logger.propagate = False  # counted here; its warnings would flood the output
    events: list[dict[str, Any]] = []
    done = threading.Event()
    try:
        with _tiers(plan_dir, work, cloud_extra=("--cache", cache)) as (edge, cloud):
            targets: dict[str, Any] = {"edge": edge, "cloud": cloud, "redis": redis}

            def inject() -> None:
                while not done.is_set():
                    for name, target in targets.items():
                        for action in ("SIGSTOP", "SIGKILL"):
                            if done.wait(args.fault_every):
                                return
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
                            events.append({"target": name, "action": action, "s": round(took, 2)})

            injector = threading.Thread(target=inject, name="faults", daemon=True)
            counts: Counter[str] = Counter()
            delivered: Counter[int] = Counter()
            errors: Counter[str] = Counter()
            started = time.monotonic()
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
                    delivered[index] += 1
                    if result.ok:
                        counts["correct" if reference.correct(index, result) else "wrong"] += 1
                    else:
                        counts["failed"] += 1
                        errors[_kind(result.error)] += 1

                for index in range(args.requests):
                    pause = started + index / args.rate - time.monotonic()
                    if pause > 0:  # a steady offered load, so that the run spans the faults
                        time.sleep(pause)
                    in_flight.append((index, device.submit(reference.feeds(index))))
                    if len(in_flight) >= args.window:
                        settle(*in_flight.pop(0))
                for entry in in_flight:
                    settle(*entry)
            elapsed = time.monotonic() - started
            done.set()
            injector.join()
    finally:
        done.set()
        mux_logger.removeHandler(dropped)
        mux_logger.propagate = True
        redis.kill()
    return {
        "requests": args.requests,
        "seconds": round(elapsed, 1),
        "correct": counts["correct"],
        "wrong": counts["wrong"],
        "failed": counts["failed"],
        "lost": counts["lost"],
        "duplicated": sum(1 for n in delivered.values() if n > 1),
        "dropped_extra_replies": dropped.count,
        "errors_by_code": dict(errors),
        "faults": events,
        "window": args.window,
        "rate_per_s": args.rate,
        "deadline_s": args.deadline,
    }


# ---------------------------------------------------------------------------- streams


def streams(plan_dir: Path, reference: Reference, work: Path, args: argparse.Namespace) -> dict:
    """``args.streams`` devices at once, each sending requests one after another."""
    latencies: list[float] = []
    counts: Counter[str] = Counter()
    lock = threading.Lock()
    cap = str(max(args.streams, 256))
    with _tiers(plan_dir, work, "--max-streams-per-peer", cap) as (edge, _):
        clients = [
            DeviceClient(plan_dir, edge.address, window=1, deadline_s=60)
            for _ in range(args.streams)
        ]
        barrier = threading.Barrier(args.streams + 1)
        connect_ms: list[float] = []

        def device(number: int, client: DeviceClient) -> None:
            start = time.perf_counter()  # the first request opens the stream: not counted
            first = client.submit(reference.feeds(number)).result()
            with lock:
                connect_ms.append((time.perf_counter() - start) * 1e3)
                if not first.ok:
                    counts["failed to open"] += 1
            barrier.wait()
            for k in range(args.stream_requests):
                index = number * args.stream_requests + k
                start = time.perf_counter()
                result = client.submit(reference.feeds(index)).result()
                ms = (time.perf_counter() - start) * 1e3
                with lock:
                    if result.ok and reference.correct(index, result):
                        counts["correct"] += 1
                        latencies.append(ms)
                    else:
                        counts["wrong" if result.ok else "failed"] += 1

        threads = [
            threading.Thread(target=device, args=(n, c), daemon=True) for n, c in enumerate(clients)
        ]
        for thread in threads:
            thread.start()
        barrier.wait()
        started = time.monotonic()
        for thread in threads:
            thread.join()
        elapsed = time.monotonic() - started
        edge_rss = _peak_rss_mib(edge.pid)
        for client in clients:
            client.close()
    ordered = sorted(latencies)
    return {
        "streams": args.streams,
        "requests_per_stream": args.stream_requests,
        "correct": counts["correct"],
        "wrong": counts["wrong"],
        "failed": counts["failed"],
        "p50_ms": round(float(np.percentile(ordered, 50)), 2) if ordered else None,
        "p99_ms": round(float(np.percentile(ordered, 99)), 2) if ordered else None,
        "max_ms": round(ordered[-1], 2) if ordered else None,
        "requests_per_s": round(len(ordered) / elapsed, 1),
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
    """``args.fuzz`` hostile messages of every class; both tiers must stay up and correct."""
    rng = random.Random(0)
    valid = _valid_request(plan_dir, reference, 0)
    valid_bytes = valid.SerializeToString()
    probe = tier_pb2.ProbeMessage(seq=1, payload=bytes(64), reply_bytes=64).SerializeToString()
    share = max((args.fuzz - args.many_tensor_messages) // 5, 1)
    classes: dict[str, list[bytes]] = {
        "infer: random bytes": [os.urandom(rng.randint(0, 2048)) for _ in range(share)],
        "infer: mutated request": [_mutate(valid_bytes, rng) for _ in range(share)],
        "infer: lying headers": [_lying(valid, rng, n) for n in range(share)],
        "infer: poison deadline": [_poison(valid, rng, n) for n in range(share)],
        "infer: 200k tensors": [_many(valid, n) for n in range(args.many_tensor_messages)],
    }
    probes = [os.urandom(rng.randint(0, 256)) for _ in range(share // 2)]
    probes += [_mutate(probe, rng) for _ in range(share - share // 2)]
    rows = []
    with _tiers(plan_dir, work) as (edge, cloud):
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
        alive = {"edge": edge.process.process.poll() is None}  # type: ignore[union-attr]
        alive["cloud"] = cloud.process.process.poll() is None  # type: ignore[union-attr]
        with DeviceClient(plan_dir, edge.address, deadline_s=10) as device:
            after = device.submit(reference.feeds(7)).result()
        peak = {"edge": _peak_rss_mib(edge.pid), "cloud": _peak_rss_mib(cloud.pid)}
    return {
        "messages": sum(r["messages"] for r in rows),
        "classes": rows,
        "crashes": sum(1 for up in alive.values() if not up),
        "correct_after": bool(after.ok and reference.correct(7, after)),
        "peak_rss_mib": {k: round(v, 1) for k, v in peak.items()},
    }


# ---------------------------------------------------------------------------- tls


def _certificates(directory: Path) -> dict[str, str]:
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


def _sequential_ms(
    plan_dir: Path, reference: Reference, address: str, count: int, security: Security
) -> tuple[list[float], int]:
    options = RuntimeOptions(security=security)
    times, wrong = [], 0
    with DeviceClient(plan_dir, address, options=options, deadline_s=30) as device:
        for index in range(count + 20):
            start = time.perf_counter()
            result = device.submit(reference.feeds(index)).result()
            if index >= 20:  # warm-up: connection set-up, first runs
                times.append((time.perf_counter() - start) * 1e3)
            if not (result.ok and reference.correct(index, result)):
                wrong += 1
    return times, wrong


def tls(work: Path, args: argparse.Namespace) -> dict:
    """Plaintext against mutual TLS on both hops, one request at a time."""
    files = _certificates(work)
    flags = ["--tls-cert", files["cert"], "--tls-key", files["key"], "--tls-ca", files["ca"]]
    security = Security(tls_cert=files["cert"], tls_key=files["key"], tls_ca=files["ca"])
    rows = []
    for label, width in (("256 B", 64), ("100 KB", 25_000)):
        plan_dir = (
            _mlp_plan(work / "tls-mlp") if width == 64 else _wide_plan(work / "tls-wide", width)
        )
        reference = Reference(plan_dir, width)
        medians, wrong = {}, 0
        for mode in ("plaintext", "mtls", "plaintext-again"):
            extra = flags if mode == "mtls" else []
            with _tiers(plan_dir, work, *extra) as (edge, _):
                times, bad = _sequential_ms(
                    plan_dir,
                    reference,
                    edge.address,
                    args.tls_requests,
                    security if mode == "mtls" else Security(),
                )
            medians[mode] = statistics.median(times)
            wrong += bad
        plain = min(medians["plaintext"], medians["plaintext-again"])
        rows.append(
            {
                "feature": label,
                "plaintext_p50_ms": round(plain, 3),
                "mtls_p50_ms": round(medians["mtls"], 3),
                "overhead_per_hop_ms": round((medians["mtls"] - plain) / 2, 3),
                "plaintext_runs_p50_ms": [
                    round(medians["plaintext"], 3),
                    round(medians["plaintext-again"], 3),
                ],
                "wrong_or_failed": wrong,
            }
        )
    return {"requests_per_mode": args.tls_requests, "rows": rows}


# ---------------------------------------------------------------------------- report


def _print(results: dict[str, Any]) -> None:
    f = results.get("faults")
    if f:
        print(f"\nfaults: {f['requests']} requests in {f['seconds']} s, {len(f['faults'])} faults")
        head = ["correct", "wrong", "failed", "lost", "duplicated", "extra replies dropped"]
        keys = ["correct", "wrong", "failed", "lost", "duplicated", "dropped_extra_replies"]
        print(format_table(head, [[f[k] for k in keys]]))
        print("errors by code:", f["errors_by_code"])
    s = results.get("streams")
    if s:
        print(f"\nstreams: {s['streams']} devices x {s['requests_per_stream']} requests")
        head = ["correct", "wrong", "failed", "p50 ms", "p99 ms", "max ms", "req/s", "edge MiB"]
        keys = ["correct", "wrong", "failed", "p50_ms", "p99_ms", "max_ms", "requests_per_s"]
        print(format_table(head, [[*(s[k] for k in keys), s["edge_peak_rss_mib"]]]))
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
        print(f"\ntls: {t['requests_per_mode']} requests per mode, one at a time")
        rows = [
            [
                r["feature"],
                r["plaintext_p50_ms"],
                r["mtls_p50_ms"],
                r["overhead_per_hop_ms"],
                r["wrong_or_failed"],
            ]
            for r in t["rows"]
        ]
        print(format_table(["feature", "plain p50 ms", "mTLS p50 ms", "per hop ms", "bad"], rows))


SECTION = "## Chaos: faults, many streams, fuzzed messages, TLS"


def markdown(results: dict[str, Any]) -> list[str]:
    """The RESULTS.md section for ``results`` (chaos.json), as a list of paragraphs."""
    machine = results.get("machine", {})
    lines = [
        f"{SECTION}\n",
        "From `"
        + f"python benchmarks/chaos.py {results.get('command', '')}".strip()
        + "`"
        + " (counts in `flags` of chaos.json)"
        + f" on {results.get('date', '?')} ({machine.get('cpus')} cores, shared; 1-minute "
        f"load average {machine.get('load_average_at_start', ['?'])[0]} at the start). "
        "Real `tierflow serve` processes and `redis-server` on 127.0.0.1; the devices run in "
        "the benchmark's process. Raw figures: `results/chaos.json`. The issue asked for "
        "100,000 requests across faults and 256 streams; on this shared 2-core machine the "
        "counts below are what ran in a few minutes (each is a flag).\n",
    ]
    f = results.get("faults")
    if f:
        kinds = Counter(f"{e['action']} {e['target']}" for e in f["faults"])
        lines += [
            "### Requests across SIGSTOP, SIGKILL and restart of each tier and of Redis\n",
            f"{f['requests']} requests (window {f['window']}, deadline {f['deadline_s']} s) in "
            f"{f['seconds']} s, while edge, cloud and Redis were in turn stopped with SIGSTOP "
            "and then killed with SIGKILL and restarted on the same port: "
            + ", ".join(f"{k} ×{v}" for k, v in sorted(kinds.items()))
            + ". Every answer compared bit for bit with the unsplit model's.\n",
            "| correct | wrong | failed (typed error) | lost | duplicated "
            "| extra replies dropped |",
            "|---|---|---|---|---|---|",
            f"| {f['correct']} | {f['wrong']} | {f['failed']} | {f['lost']} | "
            f"{f['duplicated']} | {f['dropped_extra_replies']} |\n",
            f"Failed requests by error: {f['errors_by_code'] or 'none'}. A request in flight on "
            "a tier that is killed may have reached it, so it is failed with a typed error, "
            "never sent twice ([Note: retries and failing fast] in `tierflow/mux.py`); while "
            "a killed edge restarts, the device fails requests at once (`known down`), and "
            "while a killed cloud restarts the edge answers UPSTREAM_UNAVAILABLE, so most "
            "failures are requests offered at the steady rate "
            f"({f.get('rate_per_s', '?')}/s) during a restart, which takes seconds on a "
            "machine this loaded.\n",
        ]
    s = results.get("streams")
    if s:
        lines += [
            "### Concurrent device streams\n",
            f"{s['streams']} devices at once, each with its own channel and stream, each sending "
            f"{s['requests_per_stream']} requests one after another "
            f"(`--max-streams-per-peer {max(s['streams'], 256)}`: all come from 127.0.0.1). "
            "Each device first opens its stream with one request (first-request p50 "
            f"{s['first_request_p50_ms']} ms, max {s['first_request_max_ms']} ms, "
            f"{s['failed_to_open']} failed), then all start together; the latencies below "
            "are of the requests after that.\n",
            "| streams | correct | wrong | failed | p50 ms | p99 ms | max ms | req/s | "
            "edge peak RSS MiB |",
            "|---|---|---|---|---|---|---|---|---|",
            f"| {s['streams']} | {s['correct']} | {s['wrong']} | {s['failed']} | {s['p50_ms']} | "
            f"{s['p99_ms']} | {s['max_ms']} | {s['requests_per_s']} | "
            f"{s['edge_peak_rss_mib']} |\n",
        ]
    z = results.get("fuzz")
    if z:
        lines += [
            "### Fuzzed messages\n",
            f"{z['messages']} messages to the edge; crashes: **{z['crashes']}**; a valid "
            f"request answered correctly afterwards: {z['correct_after']}; peak resident "
            f"memory (VmHWM): edge {z['peak_rss_mib']['edge']} MiB, cloud "
            f"{z['peak_rss_mib']['cloud']} MiB. Every `Infer` message gets one reply (an "
            "undecodable one a typed error); an undecodable probe message ends its probe "
            "INVALID_ARGUMENT.\n",
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
        ]
    t = results.get("tls")
    if t:
        lines += [
            "### TLS overhead per hop\n",
            f"One request at a time ({t['requests_per_mode']} per mode after 20 warm-up), "
            "device -> edge -> cloud, plaintext against mutual TLS on both hops (P-256 "
            "certificates); overhead per hop = (mTLS p50 − plaintext p50) / 2, the plaintext "
            "p50 the lower of two runs, one before and one after the TLS run. With the load "
            "average above the core count, medians of single requests move by milliseconds "
            "between runs (compare the two plaintext runs): read the overhead as an upper "
            "bound, not a precise figure.\n",
            "| feature | plaintext p50 ms (two runs) | mTLS p50 ms | overhead per hop ms | "
            "wrong or failed |",
            "|---|---|---|---|---|",
            *(
                f"| {r['feature']} | "
                + " / ".join(str(x) for x in r["plaintext_runs_p50_ms"])
                + f" | {r['mtls_p50_ms']} | "
                f"{r['overhead_per_hop_ms']} | {r['wrong_or_failed']} |"
                for r in t["rows"]
            ),
            "",
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
    parser.add_argument("--requests", type=int, default=20_000, help="requests across faults")
    parser.add_argument("--window", type=int, default=16, help="requests in flight (faults)")
    parser.add_argument("--rate", type=float, default=400.0, help="requests offered per second")
    parser.add_argument("--deadline", type=float, default=5.0, help="per request, seconds")
    parser.add_argument("--fault-every", type=float, default=2.0, help="seconds between faults")
    parser.add_argument("--stall", type=float, default=1.0, help="seconds a SIGSTOP lasts")
    parser.add_argument("--streams", type=int, default=256, help="concurrent device streams")
    parser.add_argument("--stream-requests", type=int, default=4, help="requests per stream")
    parser.add_argument("--fuzz", type=int, default=10_000, help="fuzzed messages in all")
    parser.add_argument("--many-tensor-messages", type=int, default=5)
    parser.add_argument("--tls-requests", type=int, default=300, help="per mode and size")
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
        results = json.loads(args.output.read_text())
        _print(results)
        update_results_md(RESULTS.parent.parent / "RESULTS.md", markdown(results))
        return 0
    logging.basicConfig(level=logging.ERROR, format="%(message)s")
    parts = args.parts.split(",")
    results: dict[str, Any] = {
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        },
        "flags": {k: str(v) for k, v in vars(args).items() if k != "output"},
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
    _print(results)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=1) + "\n")
    if args.output == RESULTS:
        update_results_md(RESULTS.parent.parent / "RESULTS.md", markdown(results))
        print(f"\nwrote {args.output} and the chaos section of benchmarks/RESULTS.md")
    else:
        print(f"\nwrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
