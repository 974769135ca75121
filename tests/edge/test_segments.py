"""Segments on demand: tiers started with only plan.json fetch, check and bound their segments.

See [Note: segments on demand] in tierflow/runtime/segment_store.py. The tiers run in this
process and fetch through the next tier's own ``FetchSegment`` path ([Note: the next tier
in process] in tierflow/runtime/upstream.py); the integration tests at the end take the
fetches over gRPC: between processes, over mutual TLS, and from the command line.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import shutil
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import onnx.utils
import pytest

from tierflow.device.client import DeviceClient
from tierflow.edge.forwarding import Forwarding
from tierflow.errors import SegmentError, TransportError
from tierflow.link.spec import LinkSpec
from tierflow.options import RuntimeOptions
from tierflow.plan import (
    PLAN_FILE,
    Plan,
    PlanSet,
    SegmentSpec,
    load_plan,
    load_plan_set,
    save_plan,
    save_plan_set,
)
from tierflow.rpc import tier_pb2
from tierflow.runtime.segment_store import PART_SUFFIX, SegmentSource, SegmentStore
from tierflow.runtime.server import TierServer
from tierflow.runtime.tier import Tier
from tierflow.runtime.upstream import LocalUpstream
from tierflow.transport.security import Security, open_channel
from tierflow.transport.stream_client import channel_options

OPTIONS = RuntimeOptions(workers=2)


def _bare(plan_dir: Path, directory: Path) -> Path:
    """A plan directory holding only ``plan_dir``'s plan.json."""
    directory.mkdir(parents=True)
    shutil.copy(plan_dir / PLAN_FILE, directory / PLAN_FILE)
    return directory


@contextmanager
def _cloud_and_edge(
    rt: Any, cloud_dir: Path, edge_dir: Path, *, edge: RuntimeOptions = OPTIONS
) -> Iterator[Any]:
    """A cloud serving ``cloud_dir`` and an edge on ``edge_dir`` above it, in this process."""
    tiers = rt.services(cloud_dir, edge_dir=edge_dir, edge_options=edge, workers=2)
    try:
        yield tiers
    finally:
        tiers.edge.close(0.5)
        tiers.cloud.close(0.5)


@contextmanager
def _cloud(plan_dir: Path) -> Iterator[Tier]:
    """A cloud serving ``plan_dir`` in this process."""
    cloud = Tier("cloud", load_plan_set(plan_dir), plan_dir, options=OPTIONS)
    cloud.load()
    try:
        yield cloud
    finally:
        cloud.close(0.5)


def _source(cloud: Tier, **settings: Any) -> SegmentSource:
    """An edge's way to fetch from ``cloud``'s ``FetchSegment`` in this process."""
    upstream = LocalUpstream(cloud, me="edge")
    return SegmentSource(upstream, "cloud", known_down=upstream.known_down, **settings)


def _fetched(store: SegmentStore | None) -> list[str]:
    assert store is not None
    return [report.file for report in store.fetched]


def _fetches_ahead_done() -> None:
    """Wait for the device's fetches ahead begun so far (threads, no sleeping)."""
    for thread in threading.enumerate():
        if thread.name == "device-fetch-ahead":
            thread.join(30.0)
            assert not thread.is_alive()


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_plan_json_records_every_segments_sha256_and_size(tmp_path: Path, rt: Any) -> None:
    split = rt.cnn(tmp_path / "plan")
    for spec in load_plan(split.plan_dir).segments:
        path = split.plan_dir / spec.file
        assert (spec.sha256, spec.size) == (_sha256(path), path.stat().st_size)


def test_an_edge_with_only_plan_json_fetches_its_segment_and_answers_bit_exact(
    tmp_path: Path, rt: Any
) -> None:
    split = rt.cnn(tmp_path / "plan", {"device-edge": "raw", "edge-cloud": "raw"})
    plan = load_plan(split.plan_dir)
    edge_dir = _bare(split.plan_dir, tmp_path / "edge")
    samples = split.sample(seed=51, count=3)
    with _cloud_and_edge(rt, split.plan_dir, edge_dir) as tiers:
        with tiers.device(split.plan_dir, deadline_s=10.0) as device:
            results = [device.infer(feeds) for feeds in samples]
        assert _fetched(tiers.edge.segments) == [plan.segments[1].file]
    (edge_file,) = [p.name for p in edge_dir.iterdir() if p.name != PLAN_FILE]
    assert edge_file == plan.segments[1].file
    assert _sha256(edge_dir / edge_file) == plan.segments[1].sha256
    for feeds, result in zip(samples, results, strict=True):
        assert result.answered_by == "cloud"
        np.testing.assert_array_equal(result.outputs["y"], split.reference(feeds)["y"])


def _weights_beside(plan_dir: Path) -> Plan:
    """Rewrite the plan's segments with their weights in ``<file>.data``, as a large model's."""
    plan = load_plan(plan_dir)
    for spec in plan.segments:
        path = plan_dir / spec.file
        onnx.save_model(
            onnx.load(path),
            path,
            save_as_external_data=True,
            all_tensors_to_one_file=True,
            location=spec.file + ".data",
            size_threshold=0,
        )
    save_plan(plan, plan_dir)
    return load_plan(plan_dir)


def test_a_segment_whose_weights_lie_beside_it_travels_with_them(tmp_path: Path, rt: Any) -> None:
    split = rt.cnn(tmp_path / "plan", {"device-edge": "raw", "edge-cloud": "raw"})
    plan = _weights_beside(split.plan_dir)
    for spec in plan.segments:
        assert spec.data_file is not None
        data = split.plan_dir / spec.data_file
        assert (spec.data_sha256, spec.data_size) == (_sha256(data), data.stat().st_size)
    edge_dir = _bare(split.plan_dir, tmp_path / "edge")
    device_dir = _bare(split.plan_dir, tmp_path / "device")
    samples = split.sample(seed=53, count=2)
    with _cloud_and_edge(rt, split.plan_dir, edge_dir) as tiers:
        with tiers.device(device_dir, deadline_s=10.0) as device:
            results = [device.infer(feeds) for feeds in samples]
        edge_spec, device_spec = plan.segments[1], plan.segments[0]
        assert _fetched(tiers.edge.segments) == [
            edge_spec.file,
            edge_spec.data_file,
            device_spec.file,
            device_spec.data_file,
        ]
    assert sorted(p.name for p in device_dir.iterdir()) == sorted(
        [PLAN_FILE, device_spec.file, str(device_spec.data_file)]
    )
    for feeds, result in zip(samples, results, strict=True):
        np.testing.assert_array_equal(result.outputs["y"], split.reference(feeds)["y"])
    # A weights file that differs from plan.json's sha256 is refused like a segment.
    cloud_data = split.plan_dir / str(edge_spec.data_file)
    cloud_data.write_bytes(cloud_data.read_bytes()[:-4] + b"\0\0\0\1")
    again = _bare(split.plan_dir, tmp_path / "edge2")
    with pytest.raises(SegmentError, match=rf"{edge_spec.data_file} .*sha256 .*refused"):
        rt.services(split.plan_dir, edge_dir=again)
    # The segment came and stays; its weights were refused and are not there.
    assert sorted(p.name for p in again.iterdir()) == sorted([edge_spec.file, PLAN_FILE])


def test_a_device_with_only_plan_json_fetches_through_an_edge_that_lacks_it_too(
    tmp_path: Path, rt: Any
) -> None:
    split = rt.cnn(tmp_path / "plan", {"device-edge": "raw", "edge-cloud": "raw"})
    plan = load_plan(split.plan_dir)
    edge_dir = _bare(split.plan_dir, tmp_path / "edge")
    device_dir = _bare(split.plan_dir, tmp_path / "device")
    samples = split.sample(seed=52, count=3)
    with _cloud_and_edge(rt, split.plan_dir, edge_dir) as tiers:
        with tiers.device(device_dir, deadline_s=10.0) as device:
            results = [device.infer(feeds) for feeds in samples]
        # The edge fetched its own segment, then the device's (to serve it on).
        assert _fetched(tiers.edge.segments) == [s.file for s in plan.segments[1::-1]]
    device_file = device_dir / plan.segments[0].file
    assert _sha256(device_file) == plan.segments[0].sha256
    for feeds, result in zip(samples, results, strict=True):
        np.testing.assert_array_equal(result.outputs["y"], split.reference(feeds)["y"])


def test_a_segment_whose_hash_is_wrong_is_refused_and_never_used(tmp_path: Path, rt: Any) -> None:
    split = rt.cnn(tmp_path / "plan")
    plan = load_plan(split.plan_dir)
    edge_file = plan.segments[1].file
    edge_dir = _bare(split.plan_dir, tmp_path / "edge")
    # The cloud holds a different file of the same name and size: a weight changed.
    path = split.plan_dir / edge_file
    data = bytearray(path.read_bytes())
    data[-20] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(SegmentError, match=rf"{edge_file} .*sha256 .*refused, not used"):
        rt.services(split.plan_dir, edge_dir=edge_dir)
    assert sorted(p.name for p in edge_dir.iterdir()) == [PLAN_FILE]  # nothing kept


def test_a_tier_refuses_a_segment_its_plans_do_not_name_or_with_another_hash(
    tmp_path: Path, rt: Any
) -> None:
    split = rt.cnn(tmp_path / "plan")
    plan = load_plan(split.plan_dir)
    with _cloud(split.plan_dir) as cloud:
        source = _source(cloud)
        stranger = SegmentSpec("edge", "model.onnx", ("x",), ("y",), sha256="0" * 64)
        with pytest.raises(SegmentError, match="no plan here names segment"):
            source.fetch(stranger, tmp_path)
        wrong = SegmentSpec("edge", plan.segments[1].file, ("h1",), ("h2",), sha256="1" * 64)
        with pytest.raises(SegmentError, match="here has sha256"):
            source.fetch(wrong, tmp_path)
    assert list(tmp_path.glob("*.onnx*")) == []


class _Restarting:
    """The cloud at one place, stopped after the first chunk it sends and started again:
    each ``FetchSegment`` goes to the cloud running then, in this process."""

    def __init__(self, plan_dir: Path) -> None:
        self.plan_dir = plan_dir
        self.clouds = [self._start()]
        self.seen: list[int] = []

    def _start(self) -> Tier:
        cloud = Tier("cloud", load_plan_set(self.plan_dir), self.plan_dir, options=OPTIONS)
        cloud.load()
        return cloud

    def FetchSegment(
        self, request: tier_pb2.SegmentRequest, timeout: float | None = None
    ) -> Iterable[tier_pb2.SegmentChunk]:
        return LocalUpstream(self.clouds[-1], me="edge").FetchSegment(request, timeout)

    def break_once(self, file: str, held: int, size: int) -> None:
        self.seen.append(held)
        if len(self.clouds) == 1:  # after the first chunk: the cloud stops, then comes back
            self.clouds[0].close(0)
            self.clouds.append(self._start())

    def close(self) -> None:
        for cloud in self.clouds:
            cloud.close(0.5)


def test_an_interrupted_fetch_resumes_where_it_broke_off(tmp_path: Path, rt: Any) -> None:
    split = rt.cnn(tmp_path / "plan")
    plan = load_plan(split.plan_dir)
    spec = plan.segments[1]
    assert spec.size is not None and spec.size > 4 * 512
    edge_dir = _bare(split.plan_dir, tmp_path / "edge")
    cloud = _Restarting(split.plan_dir)
    waits: list[float] = []
    try:
        source = SegmentSource(
            cloud, "cloud", chunk_bytes=512, on_chunk=cloud.break_once, sleep=waits.append
        )
        store = SegmentStore(edge_dir, PlanSet((plan,)), tier="edge", source=source)
        with store.holding([spec.file]):
            pass
    finally:
        cloud.close()
    (report,) = store.fetched
    assert report.attempts == 2 and len(waits) == 1  # one wait before the second try
    assert report.received == spec.size  # no byte came twice
    assert cloud.seen[0] == 512 and cloud.seen[1] == 1024  # the second try went on from the first
    assert _sha256(edge_dir / spec.file) == spec.sha256
    assert not (edge_dir / (spec.file + PART_SUFFIX)).exists()


def test_a_part_left_by_a_stopped_tier_is_resumed(tmp_path: Path, rt: Any) -> None:
    split = rt.cnn(tmp_path / "plan")
    plan = load_plan(split.plan_dir)
    spec = plan.segments[0]
    assert spec.size is not None
    edge_dir = _bare(split.plan_dir, tmp_path / "edge")
    half = spec.size // 2
    whole = (split.plan_dir / spec.file).read_bytes()
    (edge_dir / (spec.file + PART_SUFFIX)).write_bytes(whole[:half])
    with _cloud(split.plan_dir) as cloud:
        store = SegmentStore(edge_dir, PlanSet((plan,)), tier="edge", source=_source(cloud))
        with store.holding([spec.file]):
            assert (edge_dir / spec.file).read_bytes() == whole
    (report,) = store.fetched
    assert (report.resumed_from, report.received, report.attempts) == (half, spec.size - half, 1)


def _two_edge_plans(split: Any) -> tuple[Plan, Plan]:
    """The cnn's split (edge: conv) and one whose edge runs conv + pool: no edge file shared."""
    first = load_plan(split.plan_dir)
    model = str(split.plan_dir / first.model_file)
    onnx.utils.extract_model(model, str(split.plan_dir / "edge-pool.onnx"), ["h1"], ["f"])
    onnx.utils.extract_model(model, str(split.plan_dir / "head.onnx"), ["f"], ["y"])
    second = Plan(
        first.model_file,
        first.model_sha256,
        first.inputs,
        first.outputs,
        (
            first.segments[0],
            SegmentSpec("edge", "edge-pool.onnx", ("h1",), ("f",)),
            SegmentSpec("cloud", "head.onnx", ("f",), ("y",)),
        ),
        codec=first.codec,
    )
    save_plan_set(PlanSet((first, second)), split.plan_dir)
    return first, second


def test_a_budgeted_edge_stays_within_it_while_plans_alternate(tmp_path: Path, rt: Any) -> None:
    split = rt.cnn(tmp_path / "plan", {"device-edge": "raw", "edge-cloud": "raw"})
    first, second = _two_edge_plans(split)
    sizes = [(split.plan_dir / p.segments[1].file).stat().st_size for p in (first, second)]
    budget = max(sizes)
    assert budget < sum(sizes)  # the two edge segments never fit together
    edge_dir = _bare(split.plan_dir, tmp_path / "edge")
    devices = []
    for number, plan in enumerate((first, second)):  # each device sends one plan's id
        directory = tmp_path / f"device{number}"
        shutil.copytree(split.plan_dir, directory)
        save_plan_set(PlanSet((plan,)), directory)
        devices.append(directory)
    samples = split.sample(seed=53, count=6)
    options = RuntimeOptions(workers=2, segment_budget=budget)
    used = []
    with _cloud_and_edge(rt, split.plan_dir, edge_dir, edge=options) as tiers:
        store = tiers.edge.segments
        assert store is not None
        with (
            tiers.device(devices[0], deadline_s=10.0) as one,
            tiers.device(devices[1], deadline_s=10.0) as other,
        ):
            results = []
            for number, feeds in enumerate(samples):
                results.append((one if number % 2 == 0 else other).infer(feeds))
                used.append(store.used_bytes)
    assert max(used) <= budget
    files = [first.segments[1].file, second.segments[1].file]
    assert [r.file for r in store.fetched] == files * 3  # each switch fetched again
    assert store.evicted == files * 2 + files[:1]
    for feeds, result in zip(samples, results, strict=True):
        np.testing.assert_array_equal(result.outputs["y"], split.reference(feeds)["y"])
    assert {r.plan for r in results} == {first.plan_id, second.plan_id}


def test_a_segment_larger_than_the_budget_is_a_typed_error(tmp_path: Path, rt: Any) -> None:
    split = rt.cnn(tmp_path / "plan")
    edge_dir = _bare(split.plan_dir, tmp_path / "edge")
    tight = RuntimeOptions(workers=2, segment_budget=100)
    with pytest.raises(SegmentError, match="does not fit --segment-budget"):
        rt.services(split.plan_dir, edge_dir=edge_dir, edge_options=tight)


def _with_device_only_plan(split: Any) -> Plan:
    """The split plus a plan running the whole model on the device (model.onnx)."""
    first = load_plan(split.plan_dir)
    whole = SegmentSpec("device", first.model_file, first.inputs, first.outputs)
    alone = Plan(first.model_file, first.model_sha256, first.inputs, first.outputs, (whole,))
    save_plan_set(PlanSet((first, alone)), split.plan_dir)
    return load_plan_set(split.plan_dir).plans[1]  # with its file's sha256 and size


def test_the_device_fetches_its_fallback_plan_ahead_and_answers_alone_with_it(
    tmp_path: Path, rt: Any
) -> None:
    split = rt.cnn(tmp_path / "plan", {"device-edge": "raw", "edge-cloud": "raw"})
    alone = _with_device_only_plan(split)
    device_dir = _bare(split.plan_dir, tmp_path / "device")
    samples = split.sample(seed=54, count=4)
    with (
        rt.in_process(split.plan_dir) as tiers,
        tiers.device(device_dir, window=1, deadline_s=10.0) as device,
    ):
        assert not device.segments.present(alone.segments[0].file)
        assert device.infer(samples[0]).answered_by == "cloud"
        _fetches_ahead_done()
        assert device.segments.present(alone.segments[0].file)
        tiers.edge.close(0.5)
        during = [device.submit(feeds).result() for feeds in samples[1:]]
    for feeds, result in zip(samples[1:], during, strict=True):
        assert result.fallback and result.answered_by == "device", result.error
        np.testing.assert_array_equal(result.outputs["y"], split.reference(feeds)["y"])
    assert _sha256(device_dir / alone.segments[0].file) == alone.segments[0].sha256


def test_the_device_fetches_nothing_ahead_beyond_its_budget(tmp_path: Path, rt: Any) -> None:
    split = rt.cnn(tmp_path / "plan", {"device-edge": "raw", "edge-cloud": "raw"})
    alone = _with_device_only_plan(split)
    first = load_plan(split.plan_dir)
    device_dir = _bare(split.plan_dir, tmp_path / "device")
    budget = (split.plan_dir / first.segments[0].file).stat().st_size  # its own plan only
    options = RuntimeOptions(segment_budget=budget)
    samples = split.sample(seed=55, count=4)
    with (
        rt.in_process(split.plan_dir) as tiers,
        tiers.device(device_dir, options=options, deadline_s=10.0) as device,
    ):
        results = [device.infer(feeds) for feeds in samples]
        _fetches_ahead_done()  # none was begun, or it is over
        assert device.segments.used_bytes <= budget
        assert not device.segments.present(alone.segments[0].file)
    assert [r.file for r in device.segments.fetched] == [first.segments[0].file]
    for feeds, result in zip(samples, results, strict=True):
        np.testing.assert_array_equal(result.outputs["y"], split.reference(feeds)["y"])


def test_the_least_recently_used_file_goes_first_but_never_a_held_one(
    tmp_path: Path, rt: Any
) -> None:
    split = rt.cnn(tmp_path / "plan")
    plan = load_plan(split.plan_dir)
    first, second, third = (spec.file for spec in plan.segments)
    size = {s.file: s.size or 0 for s in plan.segments}
    budget = size[first] + max(size[second], size[third])
    edge_dir = _bare(split.plan_dir, tmp_path / "edge")
    with _cloud(split.plan_dir) as cloud:
        store = SegmentStore(
            edge_dir, PlanSet((plan,)), tier="edge", budget=budget, source=_source(cloud)
        )
        with store.holding([first]):  # the oldest, but a request runs on it
            with store.holding([second]):
                pass
            with store.holding([third]):
                assert store.evicted == [second]
            assert store.used_bytes <= budget
        with store.holding([second]):  # nothing is held now: the oldest goes
            assert store.evicted == [second, first]
        with (
            pytest.raises(SegmentError, match="does not fit --segment-budget"),
            store.holding([first, second, third]),
        ):
            pass
    assert store.used_bytes <= budget
    held = [name for name in (first, second, third) if store.present(name)]
    assert sorted(p.name for p in edge_dir.iterdir()) == sorted([PLAN_FILE, *held])


def test_a_device_whose_edge_is_gone_cannot_fetch_and_says_so(tmp_path: Path, rt: Any) -> None:
    split = rt.cnn(tmp_path / "plan")
    device_dir = _bare(split.plan_dir, tmp_path / "device")
    with rt.in_process(split.plan_dir) as tiers:
        tiers.edge.close(0)
        with pytest.raises(TransportError, match=r"fetching segment \S+ from the edge broke off"):
            tiers.device(device_dir, deadline_s=5.0)
    assert sorted(p.name for p in device_dir.iterdir()) == [PLAN_FILE]


def test_an_edge_whose_plan_needs_no_cloud_fetches_from_its_upstream(
    tmp_path: Path, rt: Any
) -> None:
    """Issue 20, item 2: started from plan.json alone with --upstream, an edge fetches its
    segments from the tier above whatever its plan (here device -> edge, no cloud)."""
    split = rt.cnn(tmp_path / "cnn", {"device-edge": "raw", "edge-cloud": "raw"})
    three = load_plan(split.plan_dir)
    segments = tuple(
        dataclasses.replace(spec, tier="edge") if spec.tier == "cloud" else spec
        for spec in three.segments
    )
    full = tmp_path / "full"
    full.mkdir()
    for spec in segments:
        shutil.copy(split.plan_dir / spec.file, full / spec.file)
    save_plan(dataclasses.replace(three, segments=segments), full)
    edge_dir = _bare(full, tmp_path / "edge")
    samples = split.sample(seed=7, count=2)
    with _cloud_and_edge(rt, full, edge_dir) as tiers:
        with tiers.device(full, deadline_s=10.0) as device:
            results = [device.infer(feeds) for feeds in samples]
        assert sorted(_fetched(tiers.edge.segments)) == sorted(s.file for s in segments[1:])
    for feeds, result in zip(samples, results, strict=True):
        assert result.answered_by == "edge"
        np.testing.assert_array_equal(result.outputs["y"], split.reference(feeds)["y"])


# ---------------------------------------------------------------------- over gRPC


@contextmanager
def _servers(
    cloud_dir: Path,
    edge_dir: Path,
    *,
    edge: RuntimeOptions = OPTIONS,
    cloud: RuntimeOptions = OPTIONS,
) -> Iterator[tuple[TierServer, TierServer]]:
    """A cloud server on ``cloud_dir`` and an edge server on ``edge_dir`` above it."""
    upper = TierServer.from_plan("cloud", cloud_dir, options=cloud)
    upper.start()
    server = TierServer.from_plan(
        "edge", edge_dir, forwarder=Forwarding(upper.address), options=edge
    )
    try:
        server.start()
        yield upper, server
    finally:
        server.stop(0.5)
        upper.stop(0.5)


@pytest.mark.integration
def test_serve_and_run_started_with_only_plan_json_answer_bit_exact(
    tmp_path: Path, rt: Any
) -> None:
    """The commands, as processes: ``serve edge --segment-budget`` and ``run`` on bare dirs."""
    from tierflow.cli.main import main

    split = rt.cnn(tmp_path / "plan", {"device-edge": "raw", "edge-cloud": "raw"})
    plan = load_plan(split.plan_dir)
    edge_dir = _bare(split.plan_dir, tmp_path / "edge")
    device_dir = _bare(split.plan_dir, tmp_path / "device")
    samples = split.sample(seed=56, count=3)
    np.savez(tmp_path / "in.npz", x=np.concatenate([s["x"] for s in samples]))
    with rt.processes() as serve:
        cloud = serve("cloud", split.plan_dir, "--workers", "1")
        edge = serve("edge", edge_dir, "--upstream", cloud.address, "--segment-budget", "64KiB")
        args = ["run", "--plan", str(device_dir), "--edge", edge.address, "--segment-budget"]
        args += ["64KiB", "--input", str(tmp_path / "in.npz")]
        assert main([*args, "--output", str(tmp_path / "out.npz")]) == 0
    for directory, spec in ((edge_dir, plan.segments[1]), (device_dir, plan.segments[0])):
        assert _sha256(directory / spec.file) == spec.sha256
    with np.load(tmp_path / "out.npz") as out:
        for i, feeds in enumerate(samples):
            np.testing.assert_array_equal(out["y"][i], split.reference(feeds)["y"][0])


@pytest.mark.integration
def test_segments_are_fetched_over_mutual_tls_with_the_token_and_only_with_them(
    tmp_path: Path, rt: Any, tls_files: dict[str, Path]
) -> None:
    split = rt.cnn(tmp_path / "plan")
    plan = load_plan(split.plan_dir)
    token = tmp_path / "token"
    token.write_text("s3cret-token\n")
    server = Security(
        tls_cert=str(tls_files["server_cert"]),
        tls_key=str(tls_files["server_key"]),
        tls_ca=str(tls_files["ca"]),
        token_file=str(token),
    )
    client = Security(
        tls_cert=str(tls_files["client_cert"]),
        tls_key=str(tls_files["client_key"]),
        tls_ca=str(tls_files["ca"]),
        token_file=str(token),
    )
    edge_dir = _bare(split.plan_dir, tmp_path / "edge")
    # The edge's segment comes from the cloud over mutual TLS, with the token.
    with _servers(
        split.plan_dir,
        edge_dir,
        edge=RuntimeOptions(workers=1, security=client),
        cloud=RuntimeOptions(workers=1, security=server),
    ) as (cloud, _edge):
        untokened = dataclasses.replace(client, token_file=None)
        with (
            open_channel(cloud.address, untokened, channel_options()) as channel,
            pytest.raises(SegmentError, match="bearer token"),
        ):
            SegmentSource(channel, "cloud").fetch(plan.segments[0], tmp_path)
    assert _sha256(edge_dir / plan.segments[1].file) == plan.segments[1].sha256
    assert not (tmp_path / plan.segments[0].file).exists()


@pytest.mark.integration
def test_run_on_a_bare_plan_dir_where_the_device_runs_nothing_fetches_nothing(
    tmp_path: Path, rt: Any
) -> None:
    from tierflow.cli.main import main

    split = rt.cnn(tmp_path / "plan", {"device-edge": "raw", "edge-cloud": "raw"})
    split_plan = load_plan(split.plan_dir)
    first, second, third = split_plan.segments
    edge_only = dataclasses.replace(
        split_plan,
        segments=(dataclasses.replace(first, tier="edge"), second, third),
    )
    save_plan_set(PlanSet((edge_only,)), split.plan_dir)
    device_dir = _bare(split.plan_dir, tmp_path / "device")
    samples = split.sample(seed=57, count=2)
    # The device holds no segment to learn the input's rank from: rows are taken as given.
    np.savez(tmp_path / "in.npz", x=np.stack([s["x"] for s in samples]))
    with rt.tiers(split.plan_dir) as (address, _, _):
        args = ["run", "--plan", str(device_dir), "--edge", address]
        args += ["--input", str(tmp_path / "in.npz"), "--output", str(tmp_path / "out.npz")]
        assert main(args) == 0
    assert sorted(p.name for p in device_dir.iterdir()) == [PLAN_FILE]
    with np.load(tmp_path / "out.npz") as out:
        for i, feeds in enumerate(samples):
            np.testing.assert_array_equal(out["y"][i], split.reference(feeds)["y"])


@pytest.mark.integration
def test_a_budgeted_device_fetches_again_what_a_switch_back_needs(
    tmp_path: Path, rt: Any, caplog: Any
) -> None:
    """A rate drop and recovery switch plans whose device files cannot both be held."""
    from tierflow.cli.main import main

    split = rt.cnn(tmp_path / "plan", {"device-edge": "raw", "edge-cloud": "raw"})
    fast = load_plan(split.plan_dir)
    model = str(split.plan_dir / fast.model_file)
    onnx.utils.extract_model(model, str(split.plan_dir / "device-both.onnx"), ["x"], ["h2"])
    conv1, _, head = fast.segments
    slow = dataclasses.replace(
        fast, segments=(SegmentSpec("device", "device-both.onnx", ("x",), ("h2",)), head)
    )
    rtt = 0.02
    regions = (({"device-edge": LinkSpec(200e6, rtt)},), ({"device-edge": LinkSpec(2e6, rtt)},))
    save_plan_set(PlanSet((fast, slow), regions), split.plan_dir)
    sizes = [(split.plan_dir / name).stat().st_size for name in (conv1.file, "device-both.onnx")]
    budget = max(sizes)
    assert budget < sum(sizes)
    device_dir = _bare(split.plan_dir, tmp_path / "device")
    count = 200
    samples = split.sample(seed=58, count=count)
    np.savez(tmp_path / "in.npz", x=np.concatenate([s["x"] for s in samples]))
    trace = tmp_path / "trace.csv"
    trace.write_text("seconds,rate,rtt\n0,200mbit,20ms\n0.4,2mbit,20ms\n1.4,200mbit,20ms\n")
    caplog.set_level("INFO", logger="tierflow.runtime.segment_store")
    with rt.tiers(split.plan_dir) as (edge, _, _):
        args = ["run", "--plan", str(device_dir), "--edge", edge, "--window", "1"]
        args += ["--input", str(tmp_path / "in.npz"), "--output", str(tmp_path / "out.npz")]
        args += ["--report", str(tmp_path / "r.jsonl"), "--link-emulation", f"trace={trace}"]
        args += ["--segment-budget", f"{budget}B"]
        assert main(args) == 0
    lines = [json.loads(line) for line in (tmp_path / "r.jsonl").read_text().splitlines()]
    plans = [line["plan"] for line in sorted(lines, key=lambda line: int(line["id"]))]
    runs = [plans[0]] + [b for a, b in itertools.pairwise(plans) if a != b]
    assert runs == [fast.plan_id, slow.plan_id, fast.plan_id]
    fetched = [r.getMessage() for r in caplog.records if "[device] segment" in r.getMessage()]
    assert [m.split()[2] for m in fetched if "fetched" in m] == [
        conv1.file,
        "device-both.onnx",
        conv1.file,
    ]
    evicted = [m.split()[2] for m in fetched if "evicted" in m]
    assert evicted == [conv1.file, "device-both.onnx"]
    held = [p for p in device_dir.iterdir() if p.name != PLAN_FILE]
    assert sum(p.stat().st_size for p in held) <= budget
    with np.load(tmp_path / "out.npz") as out:
        for i, feeds in enumerate(samples):
            np.testing.assert_array_equal(out["y"][i], split.reference(feeds)["y"][0])


@pytest.mark.integration
def test_an_edge_whose_upstream_is_not_there_says_so_and_never_says_it_went_away(
    tmp_path: Path, rt: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 20, item 9: a warning at start naming the address, and requests that needed
    the cloud say it was never reached."""
    split = rt.cnn(tmp_path / "plan")
    nowhere = f"127.0.0.1:{rt.free_port()}"
    edge = TierServer.from_plan("edge", split.plan_dir, forwarder=Forwarding(nowhere))
    with caplog.at_level("WARNING"):
        edge.start()
    try:
        warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert any(nowhere in line and "does not answer" in line for line in warnings)
        with DeviceClient(split.plan_dir, edge.address, deadline_s=5.0) as device:
            result = device.submit(split.sample(0)[0]).result()
        assert result.error is not None
        assert "never reached" in str(result.error) and "went away" not in str(result.error)
    finally:
        edge.stop(0)
