"""``tierflow serve cloud``: finish the model and answer, until SIGTERM or SIGINT.

The options every server takes, ``--cache`` among them, are in ``tierflow.cli.serve``;
``--cache`` builds an in-process cache (``tierflow.cache.config``) or the Redis cache
replicas share (``tierflow.cache.redis``).
"""

from __future__ import annotations

import argparse

from tierflow.cli.helptext import examples
from tierflow.cli.runtime_arguments import runtime_options
from tierflow.cli.serve import add_cache_argument, add_serve_parser
from tierflow.plan import load_plan_set
from tierflow.runtime.server import serve_until_stopped


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    cloud = add_serve_parser(
        subparsers,
        "cloud",
        help="finish the model and answer, with early exits and caches",
        description="Finish the model for every request the edge forwards and answer: look "
        "the feature up in the cache if one is configured, else run the plan's cloud "
        "segment, leaving at an early exit where the plan has one.",
        epilog=examples(
            "tierflow serve cloud --plan plan/ --listen 127.0.0.1:50052",
            "tierflow serve cloud --plan plan/ --listen 127.0.0.1:50052 --cache exact:64MiB",
            "# replicas sharing one cache",
            "tierflow serve cloud --plan plan/ --cache 'redis://10.0.0.9:6379/0?budget=256MiB'",
        ),
    )
    add_cache_argument(cloud)
    cloud.set_defaults(handler=_serve, upstream=None, upstream_token_file=None)


def _serve(args: argparse.Namespace) -> int:
    from tierflow.cache.redis import build_server_cache
    from tierflow.runtime.server import TierServer

    plan = load_plan_set(args.plan, require_segments=False).default_plan
    options = runtime_options(args, plan, server=True)
    server = TierServer.from_plan(
        "cloud", args.plan, args.listen, cache=build_server_cache(args.cache), options=options
    )
    return serve_until_stopped(server, args.grace, args.metrics_port, args.cpus_awake)
