"""``tierflow device``: be the device, continuously, from a camera, a folder or stdin.

Frames come from ``--source`` (:mod:`tierflow.device.sources`), become the model input
by the declared preprocessing (:mod:`tierflow.device.preprocess`), and run through a
:class:`~tierflow.device.app.Device` with up to ``--window`` in flight. Each result is one
JSON line in ``--results`` (default stdout): the ``tierflow run`` report line (``id``
counts results from 0), plus ``source`` (the file name or frame number) and ``outputs``
(each model output, or the exit's scores, as nested lists).

[Note: stopping the device]
The source is read in a thread of its own and handed over through a small queue, so the
main thread never blocks in a read (a camera, or stdin with nothing to say) and SIGINT
and SIGTERM only set an event. The reader then stops taking frames; every frame already
submitted is answered or fails by its deadline, its line is written, and the process
exits with status 0 (1 if any request failed). A second signal is not caught.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import queue
import signal
import sys
import threading
from collections.abc import Iterator
from typing import IO, TYPE_CHECKING, Any

from tierflow.cli import json_output
from tierflow.cli.helptext import HelpFormatter, examples
from tierflow.cli.paths import output_file_or_stdout
from tierflow.cli.runtime_arguments import add_runtime_arguments, runtime_options
from tierflow.device.commands import (
    add_adaptation_arguments,
    add_deadline_argument,
    add_plan_arguments,
    check_session,
    edge_address,
)
from tierflow.errors import UsageError
from tierflow.plan import load_plan_set
from tierflow.units import positive_seconds

if TYPE_CHECKING:
    from collections.abc import Callable

    from tierflow.device.client import Result, Ticket
    from tierflow.device.in_flight import InFlight
    from tierflow.device.sources import Frame
    from tierflow.runtime.metrics import TierMetrics

logger = logging.getLogger(__name__)

_END = object()  # the source has no more frames


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "device",
        help="be the device: stream a camera, a folder of images or stdin through a plan",
        description="Run the plan's device part continuously: read frames from a camera, a "
        "folder of PNG/JPEG images (with --watch, also the files added later) or stdin (.npy "
        "arrays one after another), resize and normalise each to the model's image input, "
        "stream it through the edge and the cloud, and write one JSON line per result. "
        "Ctrl-C or SIGTERM stops reading; every frame already sent is answered first.",
        epilog=examples(
            "tierflow device --plan plan/ --edge edge:50051 --source /dev/video0 "
            "--results results.jsonl",
            "tierflow device --plan plan/ --edge edge:50051 --source frames/ --watch",
            "# raw arrays on stdin: uint8 HxWxC pictures, or the model input itself",
            "python make_frames.py | tierflow device --plan plan/ --edge edge:50051 --source -",
        ),
        formatter_class=HelpFormatter,
    )
    add_plan_arguments(parser)
    parser.add_argument(
        "--source",
        required=True,
        metavar="CAMERA|DIR|-",
        help="a camera (/dev/videoN or an index; needs pip install 'tierflow[camera]'), a "
        "folder of PNG/JPEG images read in name order, or - for .npy arrays on stdin",
    )
    parser.add_argument(
        "--results",
        type=output_file_or_stdout,
        default="-",
        metavar="R.jsonl",
        help="one JSON line per result (- stdout)",
    )
    parser.add_argument(
        "--watch", action="store_true", help="keep watching the folder for new images"
    )
    parser.add_argument(
        "--poll",
        type=positive_seconds,
        default="500ms",
        metavar="DURATION",
        help="how often --watch looks",
    )
    parser.add_argument(
        "--image-norm",
        metavar="SPEC",
        help="how the model input is made from pixels, x = (pixel / scale - mean) / std, when "
        "the plan records none: a preset (unit, imagenet, symmetric) or "
        "'mean=M[,M,M];std=S[,S,S][;scale=255][;layout=NCHW|NHWC]' (default: unit)",
    )
    parser.add_argument("--window", type=int, default=16, help="frames in flight")
    parser.add_argument(
        "--session",
        metavar="NAME",
        help="the frames are one session's chunks of a stateful model, in order (its state "
        "kept on the tier that owns it, replayed from the frames kept if that tier loses it)",
    )
    add_deadline_argument(parser, "per-frame deadline, from sending to the answer")
    add_adaptation_arguments(parser)
    parser.add_argument(
        "--metrics-port",
        type=int,
        metavar="N",
        help="serve Prometheus metrics on http://HOST:N/metrics, HOST from --metrics-host "
        "(0 picks a port; needs pip install 'tierflow[metrics]')",
    )
    parser.add_argument(
        "--metrics-host", default="127.0.0.1", help="the address --metrics-port listens on"
    )
    add_runtime_arguments(parser, server=False)
    parser.set_defaults(handler=_device)


def _device(args: argparse.Namespace) -> int:
    from tierflow.device.app import Device
    from tierflow.device.client import DeviceClient
    from tierflow.device.in_flight import tagged
    from tierflow.device.sessions import StreamSession
    from tierflow.device.sources import check_source, open_source

    check_source(args.source, watch=args.watch)  # before the plan loads and the edge is reached
    plans = load_plan_set(args.plan, require_segments=False)
    check_session(args, plans)
    plan = plans.default_plan
    stop = threading.Event()
    count = failed = 0
    options = runtime_options(args, plan, server=False)
    edge = edge_address(args, options, plans)
    with contextlib.ExitStack() as stack:
        results: IO[str] = sys.stdout
        if args.results != "-":
            results = stack.enter_context(open(args.results, "w"))
        device = stack.enter_context(
            Device(
                DeviceClient(
                    args.plan,
                    edge,
                    options=options,
                    window=args.window,
                    deadline_s=args.deadline,
                    idle_probe_s=args.idle_probe,
                    retry_s=args.retry,
                ),
                image_norm=args.image_norm,
            )
        )
        window: InFlight[tuple[Frame, Ticket], tuple[Frame, Result]] = tagged(args.window)
        metrics = _start_metrics(args, lambda: len(window))
        if metrics is not None:
            stack.callback(metrics.stop)
        stack.enter_context(_stop_on_signals(stop))
        frames = open_source(args.source, watch=args.watch, stop=stop, poll_s=args.poll)
        print(f"tierflow device: reading {args.source}", file=sys.stderr, flush=True)

        def record(frame: Frame, result: Result) -> None:
            nonlocal count, failed
            _write(results, count, frame.source, result)
            if metrics is not None:
                metrics.observe_result(result)
            count += 1
            if result.error is not None:
                failed += 1
                logger.warning("[device] %s failed: %s", frame.source, result.error)

        if args.session:  # one session's chunks, in order, replayed if a tier loses them
            readable = (f for f in _handed_over(frames, stop, args.window) if f is not None)
            session = StreamSession(device.client, args.session)
            for frame, result in session.pairs(readable, device.inputs):
                record(frame, result)
        else:
            for item in _handed_over(frames, stop, args.window):
                if item is not None:
                    for frame, result in window.room():
                        record(frame, result)
                    window.add((item, device.submit(item)))
                for frame, result in window.ready():
                    record(frame, result)
            for frame, result in window.drain():
                record(frame, result)
    ended = "stopped" if stop.is_set() else "source ended"
    print(f"tierflow device: {ended}; {count} results, {failed} failed", file=sys.stderr)
    return 1 if failed else 0


def _start_metrics(args: argparse.Namespace, in_flight: Callable[[], int]) -> TierMetrics | None:
    """The device's Prometheus metrics (``tierflow.runtime.metrics``), when ``--metrics-port``."""
    if args.metrics_port is None:
        return None
    if not 0 <= args.metrics_port <= 65535:
        raise UsageError(f"--metrics-port must be a port number, got {args.metrics_port}")
    from tierflow.runtime.metrics import TierMetrics

    metrics = TierMetrics("device", in_flight)
    port = metrics.start(args.metrics_host, args.metrics_port)
    print(
        f"tierflow device metrics on http://{args.metrics_host}:{port}/metrics",
        file=sys.stderr,
        flush=True,
    )
    return metrics


def _write(out: IO[str], index: int, source: str | int, result: Result) -> None:
    line: dict[str, Any] = result.to_dict()
    line["id"] = index
    line["source"] = source
    line["outputs"] = {name: array.tolist() for name, array in result.outputs.items()}
    out.write(json_output.dumps(line) + "\n")
    out.flush()


def _handed_over(
    frames: Iterator[Frame], stop: threading.Event, size: int
) -> Iterator[Frame | None]:
    """``frames`` read in a thread, yielded here until they end or ``stop`` is set.

    None is yielded whenever no frame came for a moment, so that the caller writes the
    results that arrived meanwhile. See [Note: stopping the device]. A source's error is
    raised here, in order.
    """
    handoff: queue.Queue[Any] = queue.Queue(maxsize=max(1, size))

    def put(item: Any) -> bool:
        while not stop.is_set():
            with contextlib.suppress(queue.Full):
                handoff.put(item, timeout=0.1)
                return True
        return False

    def read() -> None:
        try:
            for frame in frames:
                if not put(frame):
                    return
        except BaseException as exc:  # handed to the main thread, raised there
            put(exc)
            return
        put(_END)

    reader = threading.Thread(target=read, name="tierflow-device-source", daemon=True)
    reader.start()
    while not stop.is_set():
        try:
            item = handoff.get(timeout=0.1)
        except queue.Empty:
            yield None
            continue
        if item is _END:
            return
        if isinstance(item, BaseException):
            raise item
        yield item


@contextlib.contextmanager
def _stop_on_signals(stop: threading.Event) -> Iterator[None]:
    """SIGINT and SIGTERM set ``stop`` once; the second one acts as usual."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}

    def handler(signum: int, frame: Any) -> None:
        logger.info("[device] %s: stopping after the frames in flight", signal.Signals(signum).name)
        stop.set()
        for sig, old in previous.items():
            signal.signal(sig, old)

    for sig in previous:
        signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
