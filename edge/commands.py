"""``tierflow serve edge``, ``tierflow serve cloud`` and ``tierflow probe``.

Both servers run until SIGTERM or SIGINT and then stop gracefully. ``probe`` measures
the link to a running tier and prints it the way ``tierflow plan --link`` takes it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from typing import Any

from tierflow.errors import UsageError
from tierflow.linkemu import add_link_arguments, resolve_links
from tierflow.plan import load_plan
from tierflow.security import Security, add_security_arguments
from tierflow.segment_runner import add_optimization_argument
from tierflow.units import format_duration, format_rate, parse_size

logger = logging.getLogger(__name__)


def _cache_argument(text: str) -> Any:
    from tierflow.cloud.cache_config import cache_spec_argument

    return cache_spec_argument(text)


def _add_server_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--plan", required=True, metavar="PLAN_DIR", help="plan directory")
    parser.add_argument(
        "--listen", default="127.0.0.1:0", metavar="HOST:PORT", help="address to serve on"
    )
    parser.add_argument("--threads", type=int, default=1, help="ONNX Runtime threads per request")
    parser.add_argument(
        "--workers",
        type=int,
        default=os.cpu_count() or 1,
        help="requests run at once (the pipeline's depth on this tier)",
    )
    parser.add_argument(
        "--slowdown",
        type=float,
        default=1.0,
        help="emulate a tier this many times slower than this machine",
    )
    add_optimization_argument(parser)
    parser.add_argument(
        "--cache",
        type=_cache_argument,
        default="off",
        help="feature cache: off | exact:SIZE[,ttl=DUR] | approx:SIZE[,...] | redis://...",
    )
    parser.add_argument(
        "--max-tensor-bytes",
        type=parse_size,
        default="1GiB",
        metavar="SIZE",
        help="largest decoded tensor accepted",
    )
    parser.add_argument(
        "--grace", type=float, default=5.0, help="seconds open streams get to finish on shutdown"
    )
    add_link_arguments(parser)
    add_security_arguments(parser, server=True)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    defaults = argparse.ArgumentDefaultsHelpFormatter
    serve = subparsers.add_parser(
        "serve", help="run the edge or the cloud tier of a plan", formatter_class=defaults
    )
    tiers = serve.add_subparsers(dest="tier", metavar="TIER", required=True)
    edge = tiers.add_parser(
        "edge",
        help="serve devices; run the edge segment; forward to the cloud",
        formatter_class=defaults,
    )
    _add_server_arguments(edge)
    edge.add_argument(
        "--upstream", metavar="HOST:PORT", help="the cloud (needed if the plan uses it)"
    )
    edge.set_defaults(handler=_serve)
    cloud = tiers.add_parser(
        "cloud",
        help="finish the model and answer, with early exits and caches",
        formatter_class=defaults,
    )
    _add_server_arguments(cloud)
    cloud.set_defaults(handler=_serve, upstream=None)

    probe = subparsers.add_parser(
        "probe",
        help="measure RTT and rate to a running edge or cloud",
        formatter_class=defaults,
    )
    probe.add_argument("address", metavar="HOST:PORT")
    probe.add_argument("--json", action="store_true", help="print JSON (plan --link reads it)")
    probe.add_argument("--link", help="name the link (default: from the tier that answers)")
    probe.add_argument("--pings", type=int, default=20, help="small round trips for the RTT")
    probe.add_argument("--payload", type=parse_size, default="2MiB", help="bytes per rate transfer")
    probe.add_argument("--transfers", type=int, default=3, help="rate transfers each way")
    add_security_arguments(probe, server=False)
    probe.set_defaults(handler=_probe)


def _serve(args: argparse.Namespace) -> int:
    from tierflow.server import TierServer
    from tierflow.service import TierService
    from tierflow.tuning import tune_for_latency

    if args.threads < 0 or args.workers < 1:
        raise UsageError("--threads must be >= 0 and --workers >= 1")
    plan = load_plan(args.plan)
    links = resolve_links(plan, args.link_emulation, args.link)
    from tierflow.cloud.cache_config import build_cache

    cache = build_cache(args.cache)
    security = Security.from_args(args)
    service = TierService(
        args.tier,
        plan,
        args.plan,
        upstream=args.upstream,
        cache=cache,
        threads=args.threads,
        slowdown=args.slowdown,
        optimization=args.optimization,
        workers=args.workers,
        links=links,
        max_tensor_bytes=args.max_tensor_bytes,
        security=security,
    )
    server = TierServer(service, args.listen, security)
    tune_for_latency()
    server.start()
    # One line on stdout, so that scripts (and tests) can learn a port picked by the OS.
    print(f"tierflow {args.tier} serving plan {plan.plan_id} on {server.address}", flush=True)
    server.serve_until_signal(grace=args.grace)
    return 0


def _probe(args: argparse.Namespace) -> int:
    from tierflow.edge.probe import probe

    result = probe(
        args.address,
        link=args.link,
        pings=args.pings,
        payload_bytes=args.payload,
        transfers=args.transfers,
        security=Security.from_args(args),
    )
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
        return 0
    samples = result.samples
    rows = [
        ("link", result.link),
        ("rtt (median)", format_duration(result.rtt_s)),
        ("rate up", format_rate(samples["up_rate_bps"])),
        ("rate down", format_rate(samples["down_rate_bps"])),
    ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    print(result.link_option())
    return 0
