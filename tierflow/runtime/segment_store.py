"""Segments on demand: a tier's bounded store of segment files, fetched from the tier above.

:class:`SegmentStore` is the segment files one tier holds in its plan directory;
:class:`SegmentSource` fetches the ones it lacks from the next tier up; :func:`serve_segment`
is the server's side of that fetch (``FetchSegment`` in ``proto/tierflow/rpc/tier.proto``).

[Note: segments on demand]
A tier (device, edge or cloud) may start with a plan directory that holds only
``plan.json``. A segment file it needs, to run a plan or to serve it to the tier below,
is fetched when first needed from the tier above (the cloud serves the edge, the edge
serves the device; an edge that lacks a file the device asks for fetches it from the
cloud first), over the channel the tier already has to it, so the same TLS, token and
admission caps apply:

* in chunks of at most :data:`DEFAULT_CHUNK_BYTES` (the server sends no more than
  :data:`MAX_CHUNK_BYTES`), far under every gRPC message limit;
* resumable: the bytes go to ``FILE.part``, and after a broken connection the fetch asks
  for the rest from the ``.part``'s length, up to :data:`FETCH_ATTEMPTS` times; a ``.part``
  left by a stopped process is resumed the same way;
* checked: the whole file must have the sha256 ``plan.json`` records for it (``plan``
  writes it for every segment, see ``tierflow.plan.save_plan``) before it is renamed
  into place. A file that differs is deleted and the fetch fails with
  :class:`~tierflow.errors.SegmentError`; it is never opened. A plan written before
  hashes were recorded cannot be fetched from: plan again.

The store keeps at most ``budget`` bytes of segment files (``--segment-budget``), least
recently used evicted first. A file is *held* while a request runs on it or while it is
served to the tier below; a held file is never evicted. Evicting deletes the file and
tells the store's owner (``on_evict``), which drops its ONNX Runtime sessions on it:
memory, not disk, is what a small device lacks. A plan whose files were evicted fetches
them again on its next request. A fetch that does not fit even after every file not held
is evicted fails with a ``SegmentError``. With a budget the plan directory *is* the store:
any segment file in it may be evicted, also those it started with. Without a budget
nothing is evicted.

A segment whose weights lie in ``FILE.data`` beside it ([Note: weights stay on disk] in
partitioner/weights.py) is two files of the store: ``plan.json`` records the
data file's sha256 and size too, both are fetched and checked alike, held together and
evicted together (``on_evict`` names the segment).

How the device weighs a fetch when it switches plans, and when it fetches ahead, is in
[Note: switching plans on the device] (``tierflow.device.adaptation``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import grpc

from tierflow.errors import SegmentError, TransportError
from tierflow.link.emulation import LinkShaper, Sleep, real_sleep
from tierflow.plan import DATA_SUFFIX, PlanSet, SegmentSpec, file_digest
from tierflow.rpc import tier_pb2, tier_pb2_grpc
from tierflow.units import format_size

logger = logging.getLogger(__name__)

#: Bytes per chunk a fetch asks for.
DEFAULT_CHUNK_BYTES = 1024 * 1024
#: Most bytes per chunk a server sends, whatever it is asked for.
MAX_CHUNK_BYTES = 4 * 1024 * 1024
#: Tries of one fetch; each after the first resumes where the last one broke off.
FETCH_ATTEMPTS = 5
#: Seconds between tries: the first wait, doubled after each broken try.
RETRY_WAIT_S = 0.2
#: Suffix of a file being fetched.
PART_SUFFIX = ".part"

# Refusals a new try cannot change: the server does not have the file as the plan says,
# or will not serve this caller.
_FINAL_CODES = (
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.UNIMPLEMENTED,
)


@dataclass(frozen=True)
class FetchReport:
    """One segment fetched: ``received`` bytes came over the link in ``attempts`` tries,
    the first starting at ``resumed_from`` (a ``.part`` already there)."""

    file: str
    size: int
    received: int
    resumed_from: int
    attempts: int
    seconds: float


#: Called after each chunk written: file name, bytes of it held so far, its size.
ChunkCallback = Callable[[str, int, int], None]


class SegmentCalls(Protocol):
    """Where ``FetchSegment`` is called: a gRPC stub on a channel, or the tier above in
    this process ([Note: the next tier in process] in tierflow/runtime/upstream.py). A
    failed call raises :class:`grpc.RpcError` (a :class:`grpc.Call`, with its code)."""

    def FetchSegment(
        self, request: tier_pb2.SegmentRequest, timeout: float | None = None
    ) -> Iterable[tier_pb2.SegmentChunk]: ...


class SegmentSource:
    """Fetches segment files from the ``FetchSegment`` service of the tier above.

    ``channel`` is the tier's channel to it (its TLS and token: ``tierflow.transport.security``),
    or the :class:`SegmentCalls` that reach it otherwise (the tier in this process);
    ``peer`` names that tier in messages. ``on_chunk`` is called after each chunk is
    written (progress, or a test's way to break a connection midway). ``timeout_s``
    bounds each try. ``known_down`` says whether that tier is known to be unreachable
    (``StreamClient.known_down``): a broken fetch is then not tried again at once but
    fails, keeping its ``.part`` for the next fetch to resume, so a request that needed
    it fails fast (or falls back) instead of waiting out every try. ``sleep`` waits
    between tries (a test's fake clock need not wait).
    """

    def __init__(
        self,
        channel: grpc.Channel | SegmentCalls,
        peer: str,
        *,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        attempts: int = FETCH_ATTEMPTS,
        timeout_s: float = 600.0,
        on_chunk: ChunkCallback | None = None,
        known_down: Callable[[], bool] | None = None,
        sleep: Sleep = real_sleep,
    ) -> None:
        if not 0 < chunk_bytes <= MAX_CHUNK_BYTES or attempts < 1:
            raise ValueError(f"bad fetch settings: chunk {chunk_bytes}, attempts {attempts}")
        self.stub: SegmentCalls = (
            tier_pb2_grpc.TierStub(channel) if isinstance(channel, grpc.Channel) else channel
        )
        self.sleep = sleep
        self.peer = peer
        self.chunk_bytes = chunk_bytes
        self.attempts = attempts
        self.timeout_s = timeout_s
        self.on_chunk = on_chunk
        self.known_down = known_down

    def fetch(self, spec: SegmentSpec, directory: Path) -> FetchReport:
        """Fetch ``spec.file`` into ``directory`` ([Note: segments on demand]).

        Raises :class:`SegmentError` when the tier above does not offer the file as the
        plan describes it or the bytes differ from the plan's sha256, and
        :class:`TransportError` when every try broke off.
        """
        if spec.sha256 is None:
            raise SegmentError(
                f"segment {spec.file} is not in {directory}, and plan.json records no sha256 "
                "to check a fetched copy against: plan again with this tierflow, or copy "
                "the segment files"
            )
        part = directory / (spec.file + PART_SUFFIX)
        started = time.monotonic()
        resumed_from = _part_size(part, spec.size)
        received = 0
        wait = RETRY_WAIT_S
        attempt = 0
        while True:
            attempt += 1
            offset = _part_size(part, spec.size)
            try:
                received += self._try(spec, part, offset)
                break
            except grpc.RpcError as exc:
                code = exc.code() if isinstance(exc, grpc.Call) else None
                details = exc.details() if isinstance(exc, grpc.Call) else str(exc)
                if code in _FINAL_CODES:
                    part.unlink(missing_ok=True)  # nothing to resume from that tier
                    raise SegmentError(
                        f"the {self.peer} does not serve segment {spec.file}: {details}"
                    ) from exc
                received += max(_part_size(part, spec.size) - offset, 0)
                down = self.known_down is not None and self.known_down()
                if attempt >= self.attempts or down:
                    if _part_size(part, spec.size) == 0:
                        part.unlink(missing_ok=True)  # nothing came: nothing to resume
                    raise TransportError(
                        f"fetching segment {spec.file} from the {self.peer} broke off "
                        f"{attempt} times; the last: {details}"
                    ) from exc
                logger.info(
                    "[segments] fetching %s from the %s broke off at %d bytes (%s); resuming",
                    spec.file,
                    self.peer,
                    _part_size(part, spec.size),
                    details,
                )
                self.sleep(wait)
                wait *= 2
        sha256, size = file_digest(part)
        if sha256 != spec.sha256:
            part.unlink(missing_ok=True)
            raise SegmentError(
                f"segment {spec.file} fetched from the {self.peer} has sha256 {sha256}, but "
                f"plan.json says {spec.sha256}: refused, not used"
            )
        os.replace(part, directory / spec.file)
        return FetchReport(
            spec.file, size, received, resumed_from, attempt, time.monotonic() - started
        )

    def _try(self, spec: SegmentSpec, part: Path, offset: int) -> int:
        """One try from ``offset``: append what comes to ``part``; the bytes received."""
        request = tier_pb2.SegmentRequest(
            file=spec.file, sha256=spec.sha256, offset=offset, chunk_bytes=self.chunk_bytes
        )
        received = 0
        size: int | None = spec.size
        with part.open("ab") as out:
            for chunk in self.stub.FetchSegment(request, timeout=self.timeout_s):
                if size is None:
                    size = chunk.size
                if (
                    chunk.offset != offset
                    or chunk.size != size
                    or len(chunk.data) > MAX_CHUNK_BYTES
                    or offset + len(chunk.data) > size
                ):
                    out.close()
                    part.unlink(missing_ok=True)
                    raise SegmentError(
                        f"the {self.peer} sent segment {spec.file} out of order or of the "
                        f"wrong size (a chunk at {chunk.offset} of {len(chunk.data)} bytes, "
                        f"size {chunk.size}; expected offset {offset}, size {size})"
                    )
                out.write(chunk.data)
                out.flush()
                offset += len(chunk.data)
                received += len(chunk.data)
                if self.on_chunk is not None:
                    self.on_chunk(spec.file, offset, size)
        if size is None or offset != size:
            raise SegmentError(
                f"the {self.peer} ended segment {spec.file} at {offset} bytes of {size}"
            )
        return received


def _part_size(part: Path, size: int | None) -> int:
    """Bytes of a ``.part`` to resume from (0 if absent; a too-long one is dropped)."""
    try:
        held = part.stat().st_size
    except FileNotFoundError:
        return 0
    if size is not None and held > size:
        part.unlink()
        return 0
    return held


class SegmentStore:
    """The segment files of one tier's plan directory, bounded and fetched on demand.

    See [Note: segments on demand]. ``plans`` names every file the tier may be asked
    for; ``budget`` is in bytes (None: unbounded); ``source`` fetches what is missing
    (None: nothing can be fetched, a missing file is an error); ``on_evict(file)`` is
    called (with the store's lock held: it must not call back into the store) after a
    file was evicted. Thread-safe.
    """

    def __init__(
        self,
        directory: str | Path,
        plans: PlanSet,
        *,
        tier: str,
        budget: int | None = None,
        source: SegmentSource | None = None,
        on_evict: Callable[[str], None] | None = None,
    ) -> None:
        if budget is not None and budget < 0:
            raise ValueError(f"a segment budget must not be negative, got {budget}")
        self.directory = Path(directory)
        self.tier = tier
        self.budget = budget
        self.source = source
        self.on_evict = on_evict
        self.specs: dict[str, SegmentSpec] = {}
        # A segment's weights file (<file>.data) is a file of the store too, fetched,
        # held and evicted with its segment ([Note: segments on demand]).
        self.partner: dict[str, str] = {}
        for plan in plans.plans:
            for spec in plan.segments:
                for one in (spec, spec.data_spec()):
                    if one is not None and (
                        one.file not in self.specs or self.specs[one.file].sha256 is None
                    ):
                        self.specs[one.file] = one
                if spec.data_file is not None:
                    self.partner[spec.file] = spec.data_file
                    self.partner[spec.data_file] = spec.file
        self.fetched: list[FetchReport] = []
        self.evicted: list[str] = []
        self._lock = threading.Condition()
        self._sizes: OrderedDict[str, int] = OrderedDict()  # files here, least recent first
        self._holds: Counter[str] = Counter()
        self._fetching: dict[str, int] = {}  # file -> bytes reserved for it
        for name in sorted(self.specs):
            path = self.directory / name
            if path.is_file():
                self._sizes[name] = path.stat().st_size
        with self._lock:
            self._make_room(0, "the segments the plan directory holds")

    # ------------------------------------------------------------------ figures

    @property
    def used_bytes(self) -> int:
        """Bytes of segment files held here, and reserved for fetches in progress."""
        with self._lock:
            return self._used()

    def _used(self) -> int:
        return sum(self._sizes.values()) + sum(self._fetching.values())

    def present(self, file: str) -> bool:
        with self._lock:
            return file in self._sizes

    def _with_partners(self, files: Iterable[str]) -> list[str]:
        """``files`` and the weights file of each segment among them, in order, once each."""
        names: list[str] = []
        for name in files:
            names.append(name)
            if name in self.partner:
                names.append(self.partner[name])
        return list(dict.fromkeys(names))

    def missing_bytes(self, files: Iterable[str]) -> int:
        """Bytes a fetch of the files not held here would bring (size 0 if unrecorded)."""
        with self._lock:
            return sum(
                self.specs[name].size or 0
                for name in set(self._with_partners(files))
                if name not in self._sizes
            )

    def fits(self, files: Iterable[str], keep: Iterable[str] = ()) -> bool:
        """Whether the missing ``files`` fit the budget without evicting ``keep`` or a held file."""
        if self.budget is None:
            return True
        with self._lock:
            wanted = set(self._with_partners(files))
            stay = (
                set(self._with_partners(keep)) | {n for n, c in self._holds.items() if c}
            ) & set(self._sizes)
            need = sum(self.specs[n].size or 0 for n in wanted - set(self._sizes))
            kept = sum(self._sizes[n] for n in stay | (wanted & set(self._sizes)))
            return kept + sum(self._fetching.values()) + need <= self.budget

    # ------------------------------------------------------------------ use

    def holding(self, files: Iterable[str]) -> contextlib.AbstractContextManager[None]:
        """Hold ``files`` (fetched first if missing) for the ``with`` block: never evicted.

        Without a budget nothing is ever evicted, so files already here need no hold (the
        request path asks for one per request).
        """
        names = self._with_partners(files)
        if self.budget is None and all(name in self._sizes for name in names):
            return contextlib.nullcontext()  # reading a dict needs no lock
        return self._holding(names)

    @contextlib.contextmanager
    def _holding(self, files: Iterable[str]) -> Iterator[None]:
        names = list(dict.fromkeys(files))
        for name in names:
            if name not in self.specs:
                raise SegmentError(f"the {self.tier}'s plans name no segment file {name!r}")
        with self._lock:
            self._holds.update(names)
        try:
            for name in names:
                self._ensure(name)
            yield
        finally:
            with self._lock:
                self._holds.subtract(names)
                self._holds += Counter()  # drop the zero counts

    def _ensure(self, name: str) -> None:
        """Make ``name`` present (fetching it, or waiting for a fetch in progress)."""
        spec = self.specs[name]
        with self._lock:
            while name in self._fetching:
                self._lock.wait()
            if name in self._sizes:
                self._sizes.move_to_end(name)
                return
            if self.source is None:
                raise SegmentError(
                    f"segment file {name} is not in {self.directory}, and the {self.tier} "
                    "has no tier above it to fetch it from"
                )
            self._make_room(spec.size or 0, f"segment {name}")
            self._fetching[name] = spec.size or 0
        logger.info(
            "[%s] fetching segment %s (%s) from the %s",
            self.tier,
            name,
            format_size(spec.size or 0),
            self.source.peer,
        )
        try:
            report = self.source.fetch(spec, self.directory)
        finally:
            with self._lock:
                del self._fetching[name]
                self._lock.notify_all()
        with self._lock:
            self._sizes[name] = report.size
            self.fetched.append(report)
            self._make_room(0, f"segment {name}")
        logger.info(
            "[%s] segment %s fetched: %s in %.3g s (%d tries, resumed at %d)",
            self.tier,
            name,
            format_size(report.received),
            report.seconds,
            report.attempts,
            report.resumed_from,
        )

    def _make_room(self, need: int, what: str) -> None:
        """Evict least recently used files not held until ``need`` more bytes fit."""
        if self.budget is None:
            return
        while self._used() + need > self.budget:
            victim = next((n for n in self._sizes if not self._holds[n]), None)
            if victim is None:
                raise SegmentError(
                    f"{what} ({format_size(need)}) does not fit --segment-budget "
                    f"{format_size(self.budget)}: {format_size(self._used())} are held by "
                    "requests running on them"
                )
            self._evict(victim)

    def _evict(self, name: str) -> None:
        """Delete ``name``, and its segment or weights file with it (never held apart)."""
        partner = self.partner.get(name)
        for one in (name, partner):
            if one is None or one not in self._sizes:
                continue
            size = self._sizes.pop(one)
            (self.directory / one).unlink(missing_ok=True)
            self.evicted.append(one)
            logger.info("[%s] segment %s evicted (%s)", self.tier, one, format_size(size))
        segment = partner if partner is not None and name.endswith(DATA_SUFFIX) else name
        if self.on_evict is not None:
            self.on_evict(segment)


def tier_files(plans: PlanSet, index: int, tier: str) -> list[str]:
    """The segment files ``tier`` runs for plan ``index`` of ``plans``."""
    return [spec.file for _, spec in plans.plans[index].segments_for(tier)]


def serve_segment(
    store: SegmentStore,
    request: tier_pb2.SegmentRequest,
    context: grpc.ServicerContext,
    shaper: LinkShaper | None = None,
) -> Iterator[tier_pb2.SegmentChunk]:
    """The chunks of ``request.file`` from ``request.offset`` on; aborts the call if refused.

    Only a file the tier's plans name with the sha256 asked for is served (NOT_FOUND or
    FAILED_PRECONDITION otherwise); a file this tier lacks is fetched from the tier above
    first (UNAVAILABLE if that fails). The file is held while it is sent. With an
    emulated link (``shaper``) each chunk leaves when its serialisation on that link
    ends ([Note: link shaping] in ``tierflow.link.emulation``).
    """
    spec = store.specs.get(request.file)
    if spec is None:
        context.abort(grpc.StatusCode.NOT_FOUND, f"no plan here names segment {request.file!r}")
        return
    if spec.sha256 is not None and request.sha256 != spec.sha256:
        context.abort(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"segment {spec.file} here has sha256 {spec.sha256}, not {request.sha256}",
        )
        return
    chunk = min(request.chunk_bytes or DEFAULT_CHUNK_BYTES, MAX_CHUNK_BYTES)
    try:
        with store.holding([spec.file]):
            path = store.directory / spec.file
            size = path.stat().st_size
            if not 0 <= request.offset <= size or chunk < 1:
                context.abort(
                    grpc.StatusCode.OUT_OF_RANGE,
                    f"segment {spec.file} has {size} bytes; asked from {request.offset} "
                    f"in chunks of {request.chunk_bytes}",
                )
                return
            with path.open("rb") as file:
                file.seek(request.offset)
                offset = request.offset
                while offset < size and context.is_active():
                    data = file.read(min(chunk, size - offset))
                    if not data:
                        break
                    if shaper is not None and shaper.spec is not None:
                        shaper.wait_until(shaper.schedule(len(data)).left)
                    yield tier_pb2.SegmentChunk(offset=offset, data=data, size=size)
                    offset += len(data)
    except (SegmentError, TransportError) as exc:
        logger.warning("[%s] cannot serve segment %s: %s", store.tier, spec.file, exc)
        code = grpc.StatusCode.UNAVAILABLE
        if isinstance(exc, SegmentError):
            code = grpc.StatusCode.FAILED_PRECONDITION
        context.abort(code, str(exc))
