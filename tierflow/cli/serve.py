"""``tierflow serve TIER``: the ``serve`` command and the options every tier's server takes.

Each tier adds its subcommand with :func:`add_serve_parser` (``tierflow.edge.commands``,
``tierflow.cloud.commands``) and runs its server with
``tierflow.runtime.server.serve_until_stopped``.
"""

from __future__ import annotations

import argparse
import weakref
from typing import Any

from tierflow.cli.arguments import argument_type
from tierflow.cli.helptext import HelpFormatter, examples
from tierflow.cli.runtime_arguments import add_runtime_arguments
from tierflow.transport.address import listen_address
from tierflow.units import parse_seconds

# The ``serve`` command of each top-level parser, and its TIER subcommands.
_SERVE_TIERS: weakref.WeakKeyDictionary[
    argparse.ArgumentParser, argparse._SubParsersAction[argparse.ArgumentParser]
] = weakref.WeakKeyDictionary()


def add_serve_parser(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
    tier: str,
    help: str,
    *,
    description: str,
    epilog: str,
) -> argparse.ArgumentParser:
    """``tierflow serve TIER``: one tier's subcommand, with the options every server takes.

    The first tier to call this creates the ``serve`` command; the tier's own options
    (``--upstream``, ``--cache``) and its handler are for the caller to add.
    """
    serve = subparsers.choices.get("serve")
    if serve is None:
        serve = subparsers.add_parser(
            "serve",
            help="run the edge or the cloud tier of a plan",
            description="Serve one tier of a plan over gRPC until SIGTERM or SIGINT: the "
            "edge takes devices' streams and forwards to the cloud, the cloud answers. Each "
            "prints one line saying where it serves once its segment is loaded.",
            epilog=examples(
                "tierflow serve cloud --plan plan/ --listen 127.0.0.1:50052",
                "tierflow serve edge --plan plan/ --listen 127.0.0.1:50051 "
                "--upstream 127.0.0.1:50052",
            ),
            formatter_class=HelpFormatter,
        )
        _SERVE_TIERS[serve] = serve.add_subparsers(dest="tier", metavar="TIER", required=True)
    parser = _SERVE_TIERS[serve].add_parser(
        tier, help=help, description=description, epilog=epilog, formatter_class=HelpFormatter
    )
    _add_server_arguments(parser)
    return parser


def _add_server_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--plan", required=True, metavar="PLAN_DIR", help="the plan directory `tierflow plan` wrote"
    )
    parser.add_argument(
        "--listen",
        type=listen_address,
        default="127.0.0.1:0",
        metavar="HOST:PORT",
        help="address to serve on (port 0: one the OS picks, printed when serving)",
    )
    parser.add_argument(
        "--grace",
        type=parse_seconds,
        default="5s",
        metavar="DURATION",
        help="how long open streams get to finish on shutdown",
    )
    add_runtime_arguments(parser, server=True)
    parser.add_argument(
        "--metrics-port",
        type=int,
        metavar="N",
        help="serve Prometheus metrics on http://HOST:N/metrics, HOST as in --listen "
        "(0 picks a port; needs pip install 'tierflow[metrics]')",
    )
    parser.add_argument(
        "--cpus-awake",
        action="store_true",
        help="keep every CPU of the machine from sleeping while serving (the kernel's CPU "
        "latency setting, /dev/cpu_dma_latency; needs root): a step that follows an idle "
        "spell runs at full speed, at the cost of power",
    )


def _cache_argument(text: str) -> Any:
    # The cache modules are imported only when the option is given.
    from tierflow.cache.config import parse_cache_spec

    return argument_type(parse_cache_spec)(text)


def add_cache_argument(parser: argparse.ArgumentParser) -> None:
    """``--cache``, for the servers of both tiers (``tierflow.cache.redis.build_server_cache``
    builds it)."""
    parser.add_argument(
        "--cache",
        type=_cache_argument,
        default="off",
        help="feature cache: off | exact:SIZE[,ttl=DUR] | approx:SIZE[,...] | redis://...",
    )
