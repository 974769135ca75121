"""The ``tierflow`` command: one entry point with subcommands.

Each subcommand lives with the code it drives and contributes a ``register(subparsers)``
function; this module only wires them together, configures logging, and turns every
:class:`~tierflow.errors.TierflowError` into one line on stderr and an exit status
(:func:`exit_status`); a missing optional module becomes one such line naming the extra
to install (a command may name the extra it needs with ``set_defaults(extra=...)``).

[Note: exit statuses]
0: done. 1: the command was right but the work failed while it ran: a tier could not be
reached or went away, a request failed or missed its deadline, a tier lost a session's
state, a cache backend failed (``TransportError``, ``StateLostError``, ``CacheError``;
``run`` and ``device`` also exit 1 when any request failed). Running it again may work. 2:
what was given is wrong: a flag or its value, a model, profile or plan that cannot be
used, inputs that do not fit, a missing extra; running it again as it is will not work.
130: interrupted. A script can so tell "retry later" from "fix the command".
Subcommand modules import heavy libraries (onnx, torch) inside their handlers, so
``tierflow serve edge`` never imports them.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Sequence

from tierflow import __version__
from tierflow.cli.arguments import ArgumentParser, OptionError
from tierflow.cli.config import add_config_option, apply_config, check_config_used
from tierflow.cli.helptext import HelpFormatter, examples
from tierflow.errors import CacheError, StateLostError, TierflowError, TransportError
from tierflow.extras import missing_extra

# Modules that define ``register(subparsers)``, in the order their commands are listed.
COMMAND_MODULES: tuple[str, ...] = (
    "tierflow.partitioner.commands",  # profile, plan
    "tierflow.edge.commands",  # serve edge, probe
    "tierflow.cloud.commands",  # serve cloud
    "tierflow.device.commands",  # run
    "tierflow.device.process",  # device
    "tierflow.device.generate",  # generate
    "tierflow.partitioner.exits.commands",  # exits add, exits show
    "tierflow.partitioner.bottleneck.commands",  # bottleneck add, bottleneck show
    "tierflow.demos.local",  # demo
)

# Commands that also read their options from ``--config FILE.toml`` (see tierflow/cli/config.py).
CONFIG_COMMANDS: tuple[str, ...] = ("serve edge", "serve cloud", "run", "device", "generate")

logger = logging.getLogger(__name__)

#: The exit status of a failure while the work ran, and of a usage error ([Note: exit statuses]).
EXIT_FAILED = 1
EXIT_USAGE = 2

#: gRPC C-core's log level in tierflow's processes unless GRPC_VERBOSITY says otherwise.
GRPC_LOG_DEFAULT = "ERROR"


def quiet_grpc_core() -> None:
    """Keep gRPC C-core's INFO and WARNING notices out of stderr unless the user asks.

    C-core logs on stderr, bypassing Python logging, and with GRPC_VERBOSITY unset it
    writes INFO lines like ``chttp2_transport.cc ... Got goaway [2]`` into a tier's log
    whenever a peer closes its connection with an error code (an edge's upstream, when the
    cloud stops): transport events the tiers already handle and report in their own words.
    C-core reads the variable once, when grpc is first imported, so this runs before the
    commands (which import grpc) are loaded; ``tierflow serve`` processes started by the
    demo, the tests or the benchmarks inherit it. An explicit GRPC_VERBOSITY (``INFO``,
    ``DEBUG``, with GRPC_TRACE) is left as it is; errors still show.
    """
    os.environ.setdefault("GRPC_VERBOSITY", GRPC_LOG_DEFAULT)


def exit_status(error: TierflowError) -> int:
    """1 for a failure while the work ran, 2 for what was given ([Note: exit statuses])."""
    if isinstance(error, (TransportError, StateLostError, CacheError)):
        return EXIT_FAILED
    return EXIT_USAGE


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="tierflow",
        description="Run one neural network across a device, an edge server and the cloud. "
        "`tierflow COMMAND --help` describes each command.",
        epilog=examples(
            "tierflow demo                       # everything on this machine, no arguments",
            "tierflow profile model.onnx -o pi4.json --threads 1 --slowdown 8",
            "tierflow plan model.onnx -o plan/ --profile device=pi4.json "
            "--link device-edge=20mbit,10ms --memory device=64MiB",
            "tierflow serve cloud --plan plan/ --listen 127.0.0.1:50052",
            "tierflow serve edge --plan plan/ --listen 127.0.0.1:50051 --upstream 127.0.0.1:50052",
            "tierflow run --plan plan/ --edge 127.0.0.1:50051 --input in.npz --output out.npz",
        )
        + "\n\nexit status: 0 done; 1 the work failed while it ran (a tier unreachable or "
        "gone, a request failed or missed its deadline): running it again may work; 2 what "
        "was given is wrong (a flag, a model, a plan, the inputs); 130 interrupted",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"tierflow {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more log output")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module_name in COMMAND_MODULES:
        importlib.import_module(module_name).register(subparsers)
    add_config_option(parser, CONFIG_COMMANDS)
    for leaf in _commands(parser).values():
        leaf.set_defaults(command_prog=leaf.prog)
    return parser


def _commands(parser: argparse.ArgumentParser) -> dict[tuple[str, ...], argparse.ArgumentParser]:
    """Every command's own parser by its words (``("serve", "edge")``), nested ones included."""
    found: dict[tuple[str, ...], argparse.ArgumentParser] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                inner = _commands(sub)
                found.update({(name, *words): p for words, p in inner.items()} or {(name,): sub})
    return found


def command_prog(parser: argparse.ArgumentParser, argv: Sequence[str]) -> str:
    """The command ``argv`` names, as every error line starts (``tierflow serve edge``),
    read from its words alone: for errors found before argparse has parsed it."""
    words = tuple(word for word in argv if not word.startswith("-"))
    best = max((w for w in _commands(parser) if words[: len(w)] == w), key=len, default=None)
    return parser.prog if best is None else f"{parser.prog} {' '.join(best)}"


def main(argv: Sequence[str] | None = None) -> int:
    quiet_grpc_core()  # before build_parser imports grpc
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        config = apply_config(parser, argv)
    except TierflowError as exc:
        print(f"{command_prog(parser, argv)}: error: {exc}", file=sys.stderr)
        return 2
    try:
        args = parser.parse_args(argv)
    except OptionError as exc:  # a value its option's parser refused: one line
        print(f"{exc.prog}: error: {exc}", file=sys.stderr)
        return 2
    prog = args.command_prog  # every line below starts as argparse's own errors do
    level = logging.WARNING - 10 * min(args.verbose, 2)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        check_config_used(args, config)
        result = args.handler(args)
    except TierflowError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return exit_status(exc)
    except ModuleNotFoundError as exc:  # an extra is not installed: say which, no traceback
        missing = missing_extra(exc, getattr(args, "extra", None))
        if missing is None:
            raise
        print(f"{prog}: error: {missing}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
