"""``tierflow serve edge`` and ``tierflow probe``.

The server runs until SIGTERM or SIGINT and then stops gracefully; the options it shares
with ``tierflow serve cloud``, ``--cache`` among them, are in ``tierflow.cli.serve``.
``probe`` measures the link to a running tier and prints it the way ``tierflow plan --link``
takes it.
"""

from __future__ import annotations

import argparse
import logging

from tierflow.cli import json_output
from tierflow.cli.arguments import add_deprecated
from tierflow.cli.helptext import HelpFormatter, examples
from tierflow.cli.runtime_arguments import (
    add_security_arguments,
    runtime_options,
    security_from_args,
)
from tierflow.cli.serve import add_cache_argument, add_serve_parser
from tierflow.cli.table import format_table
from tierflow.plan import load_plan_set
from tierflow.runtime.server import serve_until_stopped
from tierflow.transport.address import Address, check_answering_tier
from tierflow.units import format_duration, format_rate, parse_size

logger = logging.getLogger(__name__)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    edge = add_serve_parser(
        subparsers,
        "edge",
        help="serve devices; run the edge segment; forward to the cloud",
        description="Serve devices' request streams: run the plan's edge segment (answer "
        "at an early exit or from the cache where the plan allows) and forward the rest to "
        "the cloud, many requests in flight on one long-lived stream.",
        epilog=examples(
            "tierflow serve edge --plan plan/ --listen 127.0.0.1:50051 --upstream 127.0.0.1:50052",
            "# on a Raspberry Pi, with two cloud replicas and the plan's link shaped locally",
            "tierflow serve edge --plan plan/ --listen 0.0.0.0:50051 --insecure "
            "--upstream ipv4:10.0.0.5:50052,10.0.0.6:50052 --link-emulation plan",
        ),
    )
    add_cache_argument(edge)
    edge.add_argument(
        "--upstream",
        type=Address.parse,
        metavar="HOST:PORT",
        help="the cloud (needed if the plan uses it); replicas as a gRPC target list, "
        "ipv4:H1:P1,H2:P2 or dns:///NAME:PORT, balanced round robin",
    )
    edge.add_argument(
        "--upstream-token-file",
        metavar="F",
        help="the bearer token sent to the cloud, when --token-file lists this edge's "
        "clients (default: --token-file, which then holds one token)",
    )
    edge.set_defaults(handler=_serve)

    probe = subparsers.add_parser(
        "probe",
        help="measure RTT and rate to a running edge or cloud",
        description="Measure the link to a running `tierflow serve` tier: the RTT from small "
        "round trips and the rate each way from larger transfers; print it as "
        "`tierflow plan --link` takes it, or as JSON that plan reads from a file.",
        epilog=examples(
            "tierflow probe 127.0.0.1:50051",
            "tierflow probe 10.0.0.2:50051 --json > edge.json && "
            "tierflow plan model.onnx -o plan/ --link edge.json",
        ),
        formatter_class=HelpFormatter,
    )
    probe.add_argument(
        "address", type=Address.parse, metavar="HOST:PORT", help="the tier to measure"
    )
    probe.add_argument("--json", action="store_true", help="print JSON (plan --link reads it)")
    link_name = probe.add_argument(
        "--link-name",
        dest="link",
        metavar="NAME",
        help="name the link, device-edge or edge-cloud (default: from the tier that answers); "
        "elsewhere --link is a link's rate and RTT",
    )
    add_deprecated(probe, "--link", link_name)  # [Note: deprecated spellings]
    probe.add_argument("--pings", type=int, default=20, help="small round trips for the RTT")
    probe.add_argument(
        "--payload", type=parse_size, default="2MiB", metavar="SIZE", help="bytes per rate transfer"
    )
    probe.add_argument("--transfers", type=int, default=3, help="rate transfers each way")
    add_security_arguments(probe, server=False)
    probe.set_defaults(handler=_probe)


def _serve(args: argparse.Namespace) -> int:
    from tierflow.cache.redis import build_server_cache
    from tierflow.edge.forwarding import Forwarding
    from tierflow.runtime.server import TierServer

    plan = load_plan_set(args.plan, require_segments=False).default_plan
    options = runtime_options(args, plan, server=True)
    if args.upstream is not None:  # [Note: which tier answers] in tierflow.transport.address
        check_answering_tier(
            args.upstream, "cloud", options.security.upstream(), option="--upstream"
        )
    server = TierServer.from_plan(
        "edge",
        args.plan,
        args.listen,
        forwarder=None if args.upstream is None else Forwarding(args.upstream.target),
        cache=build_server_cache(args.cache),
        options=options,
    )
    return serve_until_stopped(server, args.grace, args.metrics_port, args.cpus_awake)


def _probe(args: argparse.Namespace) -> int:
    from tierflow.edge.probe import probe

    result = probe(
        args.address,
        link=args.link,
        pings=args.pings,
        payload_bytes=args.payload,
        transfers=args.transfers,
        security=security_from_args(args, server=False),
    )
    if args.json:
        print(json_output.dumps(result.to_dict(), indent=2))
        return 0
    samples = result.samples
    rows = [
        ("link", result.link),
        ("rtt (median)", format_duration(result.rtt_s)),
        ("rate up", format_rate(samples["up_rate_bps"])),
        ("rate down", format_rate(samples["down_rate_bps"])),
    ]
    print(format_table((), rows, align="ll"))
    print(result.link_option())
    return 0
