"""Tiny split models for the runtime tests, built with onnx.helper, and tier fixtures.

Each model is written whole (the reference) and as three segment files with a plan, the
way the partitioner would: the device, edge and cloud segments together compute exactly
the whole model's nodes.
"""

from __future__ import annotations

import contextlib
import hashlib
import socket
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tierflow.cache.base import FeatureCache
from tierflow.device.client import DeviceClient
from tierflow.edge.forwarding import Forwarding
from tierflow.onnxrt.inference import open_session
from tierflow.options import RuntimeOptions
from tierflow.plan import ExitSpec, Plan, SegmentSpec, load_plan_set, save_plan
from tierflow.runtime.processes import ServeProcess
from tierflow.runtime.server import TierServer
from tierflow.runtime.tier import Tier
from tierflow.runtime.upstream import LocalUpstream


@dataclass(frozen=True)
class Split:
    """A model and its plan directory."""

    plan_dir: Path
    model_path: Path
    inputs: dict[str, tuple[int, ...]]

    def sample(self, seed: int, count: int = 1) -> list[dict[str, np.ndarray]]:
        rng = np.random.default_rng(seed)
        return [
            {
                name: rng.standard_normal(shape).astype(np.float32)
                for name, shape in self.inputs.items()
            }
            for _ in range(count)
        ]

    def reference(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The unsplit model's outputs, run at the tiers' optimization level.

        See [Note: optimization level and exactness] in tierflow/onnxrt/inference.py.
        """
        session = open_session(self.model_path)
        names = [o.name for o in session.get_outputs()]
        return dict(zip(names, session.run(names, feeds), strict=True))


def _weights(rng: np.random.Generator, name: str, shape: Sequence[int]) -> TensorProto:
    return numpy_helper.from_array((rng.standard_normal(shape) * 0.3).astype(np.float32), name)


def _write_split(
    directory: Path,
    nodes: list[onnx.NodeProto],
    initializers: list[TensorProto],
    inputs: dict[str, tuple[int, ...]],
    outputs: list[str],
    segments: list[tuple[str, list[int], list[str], list[str], list[ExitSpec]]],
    codec: dict[str, str],
) -> Split:
    directory.mkdir(parents=True, exist_ok=True)
    graph_inputs = [
        helper.make_tensor_value_info(n, TensorProto.FLOAT, list(s)) for n, s in inputs.items()
    ]
    exit_names = [e.name for seg in segments for e in seg[4]]
    full = helper.make_model(
        helper.make_graph(
            nodes,
            "full",
            graph_inputs,
            [
                helper.make_tensor_value_info(n, TensorProto.FLOAT, None)
                for n in outputs + exit_names
            ],
            initializers,
        ),
        opset_imports=[helper.make_opsetid("", 17)],
    )
    full = onnx.shape_inference.infer_shapes(full, strict_mode=True)
    types = {v.name: v for v in list(full.graph.value_info) + list(full.graph.input)}
    types.update({v.name: v for v in full.graph.output})
    # The reference model has only the real outputs.
    reference = onnx.ModelProto()
    reference.CopyFrom(full)
    del reference.graph.output[:]
    reference.graph.output.extend(types[n] for n in outputs)
    model_path = directory / "model.onnx"
    onnx.save(reference, model_path)
    by_name = {t.name: t for t in initializers}
    specs = []
    for index, (tier, node_ids, seg_in, seg_out, exits) in enumerate(segments):
        seg_nodes = [nodes[i] for i in node_ids]
        used = {name for node in seg_nodes for name in node.input}
        graph = helper.make_graph(
            seg_nodes,
            f"seg{index}",
            [types[n] for n in seg_in],
            [types[n] for n in seg_out],
            [by_name[n] for n in sorted(used) if n in by_name],
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        onnx.checker.check_model(model)
        file = f"segment{index}_{tier}.onnx"
        onnx.save(model, directory / file)
        specs.append(SegmentSpec(tier, file, tuple(seg_in), tuple(seg_out), tuple(exits)))
    plan = Plan(
        model_file="model.onnx",
        model_sha256=hashlib.sha256(model_path.read_bytes()).hexdigest(),
        inputs=tuple(inputs),
        outputs=tuple(outputs),
        segments=tuple(specs),
        codec=codec,
    )
    save_plan(plan, directory)
    return Split(directory, model_path, inputs)


def make_cnn(
    directory: Path,
    codec: dict[str, str] | None = None,
    exit_threshold: float | None = None,
    batch: int = 1,
    dead_channel: bool = False,
) -> Split:
    """conv-relu | conv-relu (exit head) | pool-flatten-gemm, device | edge | cloud.

    ``dead_channel``: the first conv's first filter is zero, so that channel of the
    device's features is constant (zero), as dead ReLUs of a trained model leave them."""
    rng = np.random.default_rng(0)
    w1 = _weights(rng, "w1", (8, 3, 3, 3))
    if dead_channel:
        filters = numpy_helper.to_array(w1).copy()
        filters[0] = 0
        w1 = numpy_helper.from_array(filters, "w1")
    inits = [
        w1,
        _weights(rng, "w2", (8, 8, 3, 3)),
        _weights(rng, "w3", (10, 8)),
        _weights(rng, "we", (10, 8)),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["h1"]),
        helper.make_node("Conv", ["h1", "w2"], ["c2"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c2"], ["h2"]),
        helper.make_node("GlobalAveragePool", ["h2"], ["p"]),
        helper.make_node("Flatten", ["p"], ["f"]),
        helper.make_node("Gemm", ["f", "w3"], ["y"], transB=1),
        helper.make_node("Gemm", ["f", "we"], ["exit_edge"], transB=1),
    ]
    exits = [] if exit_threshold is None else [ExitSpec("exit_edge", exit_threshold)]
    edge_nodes = [2, 3] + ([4, 5, 7] if exits else [])
    edge_out = ["h2"] + (["exit_edge"] if exits else [])
    cloud_nodes = [6] if exits else [4, 5, 6]
    cloud_in = ["f"] if exits else ["h2"]
    if exits:
        edge_out = ["f", "exit_edge"]
    segments = [
        ("device", [0, 1], ["x"], ["h1"], []),
        ("edge", edge_nodes, ["h1"], edge_out, exits),
        ("cloud", cloud_nodes, cloud_in, ["y"], []),
    ]
    return _write_split(
        directory, nodes, inits, {"x": (batch, 3, 8, 8)}, ["y"], segments, codec or {}
    )


def make_residual(directory: Path, codec: dict[str, str] | None = None) -> Split:
    """A residual MLP whose cuts carry two tensors, one passing through the edge untouched."""
    rng = np.random.default_rng(1)
    inits = [
        _weights(rng, "wa", (16, 16)),
        _weights(rng, "wb", (16, 16)),
        _weights(rng, "wc", (16, 16)),
        _weights(rng, "wd", (4, 16)),
    ]
    nodes = [
        helper.make_node("Gemm", ["x", "wa"], ["a"], transB=1),
        helper.make_node("Relu", ["a"], ["h"]),
        helper.make_node("Gemm", ["h", "wb"], ["g"], transB=1),
        helper.make_node("Add", ["g", "a"], ["b"]),
        helper.make_node("Tanh", ["b"], ["t"]),
        helper.make_node("Gemm", ["t", "wc"], ["u"], transB=1),
        helper.make_node("Add", ["u", "a"], ["v"]),
        helper.make_node("Gemm", ["v", "wd"], ["y"], transB=1),
        helper.make_node("Softmax", ["y"], ["p"], axis=1),
    ]
    segments: list[tuple[str, list[int], list[str], list[str], list[ExitSpec]]] = [
        ("device", [0, 1], ["x"], ["a", "h"], []),
        ("edge", [2, 3, 4], ["h", "a"], ["t"], []),
        ("cloud", [5, 6, 7, 8], ["t", "a"], ["y", "p"], []),
    ]
    return _write_split(directory, nodes, inits, {"x": (1, 16)}, ["y", "p"], segments, codec or {})


def make_wide(directory: Path, width: int = 65536, codec: str = "raw") -> Split:
    """x -> Relu | Neg | Sigmoid, each tier's tensor ``width`` float32s: large replies;
    ``codec`` on both links."""
    nodes = [
        helper.make_node("Relu", ["x"], ["h1"]),
        helper.make_node("Neg", ["h1"], ["h2"]),
        helper.make_node("Sigmoid", ["h2"], ["y"]),
    ]
    segments: list[tuple[str, list[int], list[str], list[str], list[ExitSpec]]] = [
        ("device", [0], ["x"], ["h1"], []),
        ("edge", [1], ["h1"], ["h2"], []),
        ("cloud", [2], ["h2"], ["y"], []),
    ]
    codecs = {"device-edge": codec, "edge-cloud": codec}
    return _write_split(directory, nodes, [], {"x": (1, width)}, ["y"], segments, codecs)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def running_tiers(
    plan_dir: Path, *, cache: FeatureCache | None = None, **settings: Any
) -> Iterator[tuple[str, TierServer, TierServer]]:
    """A cloud and an edge server in this process on free ports; stopped afterwards.

    ``settings`` are :class:`RuntimeOptions` fields, the same for both tiers (``links``,
    ``optimization``, ``slowdown``, ``security``, ...); ``workers`` is 2 unless given.
    """
    options = RuntimeOptions(**{"workers": 2, **settings})
    cloud = TierServer.from_plan("cloud", plan_dir, "127.0.0.1:0", cache=cache, options=options)
    cloud.start()
    edge = TierServer.from_plan(
        "edge", plan_dir, "127.0.0.1:0", forwarder=Forwarding(cloud.address), options=options
    )
    try:
        edge.start()
        yield edge.address, edge, cloud
    finally:
        edge.stop(0.5)
        cloud.stop(0.5)


class FakeClock:
    """The time emulated links run on in the fast layer: ``sleep(s)`` moves it ``s`` on at
    once, so a link is timed exactly and never waited for. ``runs=False``: nothing moves
    it, as if every request were handed over at one moment (a full window's)."""

    def __init__(self, runs: bool = True) -> None:
        self.now = 1000.0
        self.runs = runs
        self._lock = threading.Lock()

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        if self.runs:
            with self._lock:
                self.now += max(seconds, 0.0)

    def links(self) -> dict[str, Any]:
        """A LocalUpstream's ``clock`` and ``sleep``."""
        return {"clock": self, "sleep": self.sleep}


@dataclass
class InProcess:
    """A cloud and an edge in this process, no server and no channel ([Note: the next tier
    in process] in tierflow/runtime/upstream.py). ``clock``: what their links run on
    (None: the real time)."""

    plan_dir: Path
    edge: Tier
    cloud: Tier
    clock: FakeClock | None = None

    def upstream(self, **settings: Any) -> LocalUpstream:
        """A device's way to :attr:`edge` (``settings``: LocalUpstream's)."""
        return LocalUpstream(self.edge, me="device", **self.links(), **settings)

    def links(self) -> dict[str, Any]:
        return {} if self.clock is None else self.clock.links()

    def device(self, plan_dir: Path | None = None, **settings: Any) -> DeviceClient:
        """A device client whose edge is :attr:`edge` (``settings``: DeviceClient's; its
        ``options`` shape its link up), on :attr:`plan_dir` unless given."""
        upstream = self.upstream(options=settings.get("options"))
        return DeviceClient(plan_dir or self.plan_dir, upstream=upstream, **settings)


def in_process_services(
    plan_dir: Path,
    *,
    edge_dir: Path | None = None,
    cache: FeatureCache | None = None,
    edge_cache: FeatureCache | None = None,
    clock: FakeClock | None = None,
    edge_options: RuntimeOptions | None = None,
    **settings: Any,
) -> InProcess:
    """A cloud on ``plan_dir`` and an edge on ``edge_dir`` (``plan_dir`` unless given) in
    this process, loaded; the caller closes them. ``settings`` are the RuntimeOptions
    fields of both (``edge_options`` the edge's, if given)."""
    options = RuntimeOptions(**{"workers": 2, **settings})
    plans = load_plan_set(plan_dir, require_segments=False)
    links = {} if clock is None else clock.links()
    cloud = Tier("cloud", plans, plan_dir, cache=cache, options=options)
    cloud.load()
    edge_dir = edge_dir or plan_dir
    edge_options = edge_options or options
    forwarding = Forwarding(upstream=LocalUpstream(cloud, me="edge", options=edge_options, **links))
    edge = Tier(
        "edge",
        load_plan_set(edge_dir, require_segments=False),
        edge_dir,
        forwarder=forwarding,
        cache=edge_cache,
        options=edge_options,
    )
    try:
        edge.load()
    except BaseException:
        edge.close(0.5)
        cloud.close(0.5)
        raise
    return InProcess(plan_dir, edge, cloud, clock)


@contextlib.contextmanager
def in_process_tiers(
    plan_dir: Path,
    *,
    cache: FeatureCache | None = None,
    edge_cache: FeatureCache | None = None,
    clock: FakeClock | None = None,
    **settings: Any,
) -> Iterator[InProcess]:
    """As :func:`running_tiers`, with the tiers called in this process: the fast layer's
    way through every tier. ``cache`` is the cloud's, ``edge_cache`` the edge's; the links
    (``settings["links"]``) run on ``clock`` (None: the real time, and they sleep)."""
    tiers = in_process_services(
        plan_dir, cache=cache, edge_cache=edge_cache, clock=clock, **settings
    )
    try:
        yield tiers
    finally:
        tiers.edge.close(0.5)
        tiers.cloud.close(0.5)


@contextlib.contextmanager
def device_client(
    plan_dir: Path,
    *,
    grpc: bool = False,
    cloud_cache: FeatureCache | None = None,
    edge_cache: FeatureCache | None = None,
    tiers: dict[str, Any] | None = None,
    **client: Any,
) -> Iterator[DeviceClient]:
    """A device client to an edge and a cloud, in this process (the fast layer) or, with
    ``grpc``, as servers on free ports. ``tiers``: the tiers' RuntimeOptions fields;
    ``client``: DeviceClient's settings (``cache`` is the device's)."""
    if grpc:
        with (
            running_tiers(plan_dir, cache=cloud_cache, **(tiers or {})) as (edge, _, _),
            DeviceClient(plan_dir, edge, **client) as device,
        ):
            yield device
        return
    with (
        in_process_tiers(
            plan_dir, cache=cloud_cache, edge_cache=edge_cache, **(tiers or {})
        ) as inp,
        inp.device(**client) as device,
    ):
        yield device


@contextlib.contextmanager
def server_processes() -> Iterator[Callable[..., ServeProcess]]:
    """Start servers with the yielded function; every one is killed afterwards.

    Each is ``tierflow serve`` with a short ``--grace`` (``tierflow.runtime.processes``).
    """
    started: list[ServeProcess] = []

    def start(tier: str, plan_dir: Path, *args: str, listen: str = "127.0.0.1:0") -> ServeProcess:
        server = ServeProcess(tier, plan_dir, "--grace", "0.5", *args, listen=listen)
        started.append(server)
        return server

    try:
        yield start
    finally:
        for server in started:
            server.kill()


class RuntimeKit:
    """What the runtime tests use, handed out by the ``rt`` fixture (conftest is not importable)."""

    cnn = staticmethod(make_cnn)
    residual = staticmethod(make_residual)
    wide = staticmethod(make_wide)
    tiers = staticmethod(running_tiers)
    in_process = staticmethod(in_process_tiers)
    services = staticmethod(in_process_services)
    clock = FakeClock
    device = staticmethod(device_client)
    free_port = staticmethod(free_port)
    processes = staticmethod(server_processes)


@pytest.fixture
def rt() -> RuntimeKit:
    return RuntimeKit()
