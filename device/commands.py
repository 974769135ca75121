"""``tierflow run``: run a plan from the device over IN.npz, write OUT.npz and a report.

The report (``--report R.jsonl``) has one JSON object per request: id, answered_by,
exit, cache_hit, bytes and achieved rate per link, milliseconds per tier and in total,
and the error if it failed. A summary table goes to stdout (with ``--json``, the same
summary as one JSON object). The exit status is 1 when
any request failed. Outputs are kept as they come (``tierflow.device.progress``), so a
killed run keeps what was answered and ``--resume`` runs only the rest.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tierflow.cli import json_output
from tierflow.cli.arguments import argument_type
from tierflow.cli.helptext import HelpFormatter, examples
from tierflow.cli.paths import output_file
from tierflow.cli.runtime_arguments import add_runtime_arguments, runtime_options
from tierflow.cli.table import format_table
from tierflow.device.fallback import runs_on_device_only
from tierflow.errors import UsageError
from tierflow.link.spec import LINKS, TIERS
from tierflow.options import RuntimeOptions
from tierflow.plan import PlanSet, load_plan_set
from tierflow.transport.address import Address, check_answering_tier
from tierflow.transport.deadline import DEFAULT_DEADLINE, Deadline
from tierflow.transport.reach import check_reachable
from tierflow.units import format_duration, format_rate, format_size, positive_seconds

if TYPE_CHECKING:
    import numpy as np

    from tierflow.device.client import Result

logger = logging.getLogger(__name__)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "run",
        help="run requests from the device through the edge and the cloud",
        description="Be the device: read the requests in IN.npz (one array per model input, "
        "a leading request axis), run the plan's device segment, stream the features to the "
        "edge with many requests in flight, and write the answers to OUT.npz and one JSON "
        "line per request to the report. Exits with status 1 if any request failed.",
        epilog=examples(
            "tierflow run --plan plan/ --edge 127.0.0.1:50051 --input in.npz --output out.npz "
            "--report r.jsonl",
            "# a device-only plan needs no edge; emulate a Pi 8x slower than this machine",
            "tierflow run --plan plan/ --input in.npz --output out.npz --slowdown 8",
            "# answer repeated frames on the device",
            "tierflow run --plan plan/ --edge 127.0.0.1:50051 --input in.npz --cache exact:16MiB",
            "# a streaming model: the rows are one session's chunks, its state kept on its tier",
            "tierflow run --plan vad-plan/ --edge 127.0.0.1:50051 --input chunks.npz "
            "--output out.npz --session mic-1",
        ),
        formatter_class=HelpFormatter,
    )
    add_plan_arguments(parser)
    parser.add_argument(
        "--input",
        required=True,
        metavar="IN.npz",
        help="the requests: one array per model input, leading request axis",
    )
    parser.add_argument(
        "--output", type=output_file, metavar="OUT.npz", help="where to write the outputs"
    )
    parser.add_argument(
        "--report", type=output_file, metavar="R.jsonl", help="one JSON line per request"
    )
    parser.add_argument(
        "--json", action="store_true", help="print the summary as one JSON object, not a table"
    )
    parser.add_argument("--window", type=int, default=16, help="requests in flight at once")
    add_deadline_argument(parser, "per-request deadline, from sending to the answer")
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue a stopped run: keep what it answered (OUT.npz.partial), run the rest",
    )
    parser.add_argument(
        "--session",
        metavar="NAME",
        help="IN.npz's rows are one session's chunks, in order (a streaming model whose "
        "state stays on the tier that keeps it); a state input in IN.npz is taken from "
        "its first row only",
    )
    parser.add_argument(
        "--replay-chunks",
        type=int,
        metavar="N",
        help="with --session: chunks the device keeps to rebuild a state a tier lost "
        "(default: all of them)",
    )
    add_adaptation_arguments(parser)
    parser.add_argument(
        "--cache",
        type=_cache_argument,
        default="off",
        metavar="SPEC",
        help="answer repeated (exact:SIZE[,ttl=DUR]) or near-identical "
        "(approx:SIZE[,target=RATE|threshold=D]...) inputs on the device, without compute "
        "or network",
    )
    add_runtime_arguments(parser, server=False)
    parser.set_defaults(handler=_run)


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    """``--plan`` and ``--edge``, as ``run`` and ``device`` both take them."""
    parser.add_argument(
        "--plan", required=True, metavar="PLAN_DIR", help="the plan directory `tierflow plan` wrote"
    )
    parser.add_argument(
        "--edge",
        type=Address.parse,
        metavar="HOST:PORT",
        help="the edge (not needed for a device-only plan)",
    )


def check_session(args: argparse.Namespace, plans: PlanSet) -> None:
    """A plan that keeps state between requests needs ``--session``: refused once, up front.

    Without it every request would fail for that same reason, one line each.
    """
    stateful = next((plan for plan in plans.plans if plan.states), None)
    if stateful is not None and not args.session:
        pairs = ", ".join(f"{s.input} <- {s.output}" for s in stateful.states)
        raise UsageError(
            f"the plan in {args.plan} keeps state between requests ({pairs}): its requests "
            "are one session's chunks, in order; give --session NAME"
        )


def add_deadline_argument(parser: argparse.ArgumentParser, help: str) -> None:
    """``--deadline``, as ``run`` and ``device`` take it ([Note: one deadline] in
    ``tierflow.transport.deadline``)."""
    parser.add_argument(
        "--deadline",
        type=Deadline.parse,
        default=str(DEFAULT_DEADLINE),
        metavar="DURATION",
        help=help,
    )


def edge_address(args: argparse.Namespace, options: RuntimeOptions, plans: PlanSet) -> str | None:
    """``--edge`` for the device client, once it is known that an edge answers there.

    An edge that cannot be reached fails here, in one line, unless ``plans`` holds a
    device-only plan to fall back on ([Note: reaching a tier first] in
    ``tierflow.transport.reach``, [Note: device fallback]); a cloud answering at the address
    fails too ([Note: which tier answers] in ``tierflow.transport.address``).
    """
    if args.edge is None:
        return None
    if not any(runs_on_device_only(plan) for plan in plans.plans):
        check_reachable(str(args.edge), options.security, option="--edge")
    check_answering_tier(args.edge, "edge", options.security, option="--edge")
    return str(args.edge.target)


def add_adaptation_arguments(parser: argparse.ArgumentParser) -> None:
    """How a device keeps its link estimate fresh and tries a missing cloud again.

    The defaults are ``DeviceClient``'s (``DEFAULT_IDLE_S``, ``DEFAULT_RETRY_S``), written
    out here so that ``--help`` needs no runtime import.
    """
    parser.add_argument(
        "--idle-probe",
        type=_idle_probe,
        default="1s",
        metavar="DURATION|off",
        help="with a plan set (plan --adaptive): probe the device-edge link once no request "
        "has crossed it for this long, then at doubling intervals up to 30 s while it stays "
        "idle; 'off': never probe",
    )
    parser.add_argument(
        "--retry",
        type=positive_seconds,
        default="1s",
        metavar="DURATION",
        help="while the cloud is missing and the device uses plans without it, one request "
        "this often tries the cloud again",
    )


def _idle_probe(text: str) -> float | None:
    if text.strip().lower() == "off":
        return None
    return positive_seconds(text)


def _cache_argument(text: str) -> Any:
    # The cache modules are imported only when the option is given.
    from tierflow.cache.config import parse_cache_spec

    spec = argument_type(parse_cache_spec)(text)
    if spec.kind == "redis":
        raise argparse.ArgumentTypeError(
            "a Redis cache is shared by servers; the device keeps exact: or approx:"
        )
    return spec


def _run(args: argparse.Namespace) -> int:
    from tierflow.cache.config import build_cache
    from tierflow.device.client import DeviceClient
    from tierflow.device.npz import load_requests, output_row, write_outputs
    from tierflow.device.progress import PartialWriter, partial_path, read_partial
    from tierflow.device.sessions import StreamSession, initial_states
    from tierflow.tuning import tune_for_latency

    tune_for_latency()

    plans = load_plan_set(args.plan, require_segments=False)
    check_session(args, plans)
    plan = plans.default_plan
    partial = partial_path(args.output) if args.output else None
    rows: dict[int, dict[str, np.ndarray]] = {}  # answered requests' OUT.npz rows
    if args.session and args.resume:
        raise UsageError(
            "--resume cannot continue a --session: a session's state is built "
            "from its first chunk on; run it again whole"
        )
    if args.replay_chunks is not None and not args.session:
        raise UsageError("--replay-chunks goes with --session")
    if args.resume:
        if partial is None or not partial.exists():
            raise UsageError(
                "--resume continues a run that was stopped: it needs the same --output, "
                f"and {partial or 'OUT.npz.partial'} left by that run"
            )
        rows = read_partial(partial, repair=True)
        if args.report:
            _keep_report_lines(Path(args.report), set(rows))
    elif partial is not None:
        partial.unlink(missing_ok=True)  # a fresh run
    results: list[Result] = []
    options = runtime_options(args, plan, server=False)
    with DeviceClient(
        args.plan,
        edge_address(args, options, plans),
        options=options,
        window=args.window,
        deadline_s=args.deadline,
        cache=build_cache(args.cache),
        idle_probe_s=args.idle_probe,
        retry_s=args.retry,
    ) as client:
        known = {
            name: len(runner.inputs[name].shape)
            for _, _, runner in client.runner.segments
            for name in runner.inputs
        }
        requests, batch_added = load_requests(args.input, plan, args.plan, known)
        todo = [index for index in range(len(requests)) if index not in rows]
        if args.resume:
            print(f"resuming: {len(rows)} requests answered before, {len(todo)} to run")
        start = time.perf_counter()
        mode = "a" if args.resume else "w"
        report = open(args.report, mode) if args.report else None  # noqa: SIM115 - streamed
        writer = PartialWriter(partial) if partial is not None else None
        try:
            stream = client.run_stream(requests[index] for index in todo)
            if args.session:
                session = StreamSession(
                    client,
                    args.session,
                    initial=initial_states(args.input, plan),
                    keep=args.replay_chunks,
                )
                stream = session.run(requests[index] for index in todo)
            for index, result in zip(todo, stream, strict=True):
                results.append(result)
                if writer is not None and result.error is None:
                    rows[index] = output_row(result, plan, batch_added=batch_added)
                    writer.add(index, rows[index])
                if report is not None:
                    line = result.to_dict()
                    line["id"] = index
                    report.write(json_output.dumps(line) + "\n")
                    report.flush()
                if result.error is not None:
                    logger.warning("[device] request %d failed: %s", index, result.error)
        finally:
            if report is not None:
                report.close()
            if writer is not None:
                writer.close()
    elapsed = time.perf_counter() - start
    if args.output and partial is not None:
        ordered = [rows.get(index, {}) for index in range(len(requests))]
        write_outputs(args.output, ordered, plan, batch_added=batch_added, plan_dir=args.plan)
        partial.unlink(missing_ok=True)
    summary = summarize(results, elapsed)
    print(json_output.dumps(summary) if args.json else _summary_table(summary))
    failed = sum(1 for r in results if r.error is not None)
    if failed:
        first = next(r.error for r in results if r.error is not None)
        print(
            f"tierflow run: {failed} of {len(results)} requests failed; first: {first}",
            file=sys.stderr,
        )
        return 1
    return 0


def _keep_report_lines(path: Path, answered: set[int]) -> None:
    """Keep only the report lines of ``answered`` requests (the rest run again)."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if int(json.loads(line)["id"]) in answered:
                kept.append(line)
        except (ValueError, KeyError, TypeError):
            continue  # a line cut short by the kill
    path.write_text("".join(f"{line}\n" for line in kept))


def summarize(results: list[Result], elapsed: float) -> dict[str, Any]:
    """What ``run`` prints at the end, as data (``--json`` prints exactly this).

    Latencies are medians over the requests that were answered, in milliseconds; bytes are
    the mean per answered request and link; rates the median achieved rate (None where
    nothing crossed the link).
    """
    ok = [r for r in results if r.error is None]
    summary: dict[str, Any] = {
        "requests": len(results),
        "failed": len(results) - len(ok),
        "throughput_rps": len(results) / elapsed if elapsed > 0 else None,
        "answered_by": {tier: sum(1 for r in ok if r.answered_by == tier) for tier in TIERS},
        "exits": sum(1 for r in ok if r.exit),
        "cache_hits": sum(1 for r in ok if r.cache_hit),
        "fallbacks": sum(1 for r in ok if r.fallback),
        "p50_ms": {},
        "bytes_per_request": {},
        "rate_bps": {},
    }
    if ok:
        for key in ("total", "device", "edge", "cloud", "queue", "network"):
            summary["p50_ms"][key] = statistics.median(r.ms[key] for r in ok)
        for link in LINKS:
            rates = [r.rate_bps.get(link, 0.0) for r in ok if r.rate_bps.get(link, 0.0) > 0]
            summary["bytes_per_request"][link] = statistics.mean(r.bytes.get(link, 0) for r in ok)
            summary["rate_bps"][link] = statistics.median(rates) if rates else None
    return summary


def _summary_table(summary: dict[str, Any]) -> str:
    throughput = summary["throughput_rps"]
    rows: list[tuple[str, str]] = [
        ("requests", f"{summary['requests']} ({summary['failed']} failed)"),
        ("throughput", "-" if throughput is None else f"{throughput:.1f} req/s"),
    ]
    if summary["p50_ms"]:
        by = summary["answered_by"]
        rows.append(("answered by", ", ".join(f"{t} {n}" for t, n in by.items())))
        rows.append(("early exits", str(summary["exits"])))
        rows.append(("cache hits", str(summary["cache_hits"])))
        if summary["fallbacks"]:
            rows.append(("fallbacks", str(summary["fallbacks"])))
        for key, ms in summary["p50_ms"].items():
            rows.append((f"{key} p50", format_duration(ms / 1e3)))
        for link, sent in summary["bytes_per_request"].items():
            rate = summary["rate_bps"][link]
            shown = "-" if rate is None else format_rate(rate)
            rows.append((link, f"{format_size(sent)}/request, rate {shown}"))
    return format_table((), rows, align="ll")
