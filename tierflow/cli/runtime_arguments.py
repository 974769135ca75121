"""The flags of a :class:`~tierflow.options.RuntimeOptions`, as ``serve``, ``run``,
``device`` and ``generate`` declare them, and the value made from them.

[Note: flags only in cli]
Command-line flags are declared in ``tierflow/cli/`` and in the command modules it wires
(``tierflow.cli.main.COMMAND_MODULES``), nowhere else: the core below ``cli`` offers plain
parsers that raise :class:`~tierflow.errors.UsageError` (``parse_providers``,
``parse_cache_spec``, ``LinkOption.parse``...) and typed values (:class:`RuntimeOptions`,
:class:`~tierflow.transport.security.Security`), and knows nothing of argparse
(tests/tierflow/test_layering.py checks). :func:`runtime_options` and
:func:`security_from_args` read each flag by name into those values, once, for a server's
flags or a client's (``server``), so a flag renamed here is a mistake mypy and the tests
see, not a default silently kept.
"""

from __future__ import annotations

import argparse
import functools

from tierflow.cli.arguments import add_deprecated, argument_type
from tierflow.link.emulation import LinkEmulation, resolve_links
from tierflow.link.spec import LinkOption
from tierflow.onnxrt.inference import DEFAULT_OPTIMIZATION, OPTIMIZATION_LEVELS
from tierflow.onnxrt.providers import DEFAULT_PROVIDERS, available, describe, parse_providers
from tierflow.options import MAX_BATCH_DELAY_S, RuntimeOptions
from tierflow.plan import Plan
from tierflow.state.store import DEFAULT_MEMORY_SHARE
from tierflow.transport.security import Security
from tierflow.units import (
    format_duration,
    format_size,
    parse_seconds,
    parse_size,
    parse_slowdown,
    positive_seconds,
)


def add_runtime_arguments(parser: argparse.ArgumentParser, *, server: bool) -> None:
    """The flags of a :class:`RuntimeOptions`, with its defaults, for ``serve`` (``server``)
    or for ``run`` and ``device``.

    The defaults are ``RuntimeOptions()``'s, so ``--help`` shows what a library user gets.
    """
    defaults = RuntimeOptions()
    parser.add_argument(
        "--threads",
        type=int,
        default=defaults.threads,
        help="ONNX Runtime intra-op threads per request (0: one per core)",
    )
    if server:
        parser.add_argument(
            "--workers",
            type=int,
            default=defaults.workers,
            help="requests run at once (the pipeline's depth on this tier) (default: one per core)",
        )
    parser.add_argument(
        "--slowdown",
        type=parse_slowdown,
        default=f"{defaults.slowdown:g}",
        metavar="X",
        help="emulate a tier X times slower than this machine, 8 or 8x (its compute and its codec "
        "work; plan --slowdown TIER=X says the same for planning)",
    )
    add_optimization_argument(parser)
    add_providers_argument(parser)
    if server:
        parser.add_argument(
            "--max-tensor-bytes",
            type=parse_size,
            default=format_size(defaults.max_tensor_bytes),
            metavar="SIZE",
            help="largest decoded tensor accepted",
        )
        parser.add_argument(
            "--max-streams",
            type=int,
            default=defaults.max_streams,
            metavar="N",
            help="streams served at once, all peers together; more are refused OVERLOADED",
        )
        parser.add_argument(
            "--max-streams-per-peer",
            type=int,
            default=defaults.max_streams_per_peer,
            metavar="N",
            help="streams served at once from one host; more are refused OVERLOADED",
        )
        parser.add_argument(
            "--reply-timeout",
            type=positive_seconds,
            default=format_duration(defaults.reply_timeout),
            metavar="DURATION",
            help="how long a reply waits for a client that does not read it before its "
            "stream is cancelled",
        )
        parser.add_argument(
            "--stream-idle",
            type=parse_seconds,
            default=format_duration(defaults.stream_idle_s),
            metavar="DURATION",
            help="close a stream with nothing in flight after this long without a message "
            "(its client opens another when it has a request)",
        )
    add_segment_budget_argument(parser)
    parser.add_argument(
        "--state-budget",
        type=parse_size,
        default=defaults.state_budget,
        metavar="SIZE",
        help="keep at most SIZE of session state (KV caches, recurrent states) on this tier, "
        "least recently used sessions evicted, from callers over their share first; an "
        f"evicted session is replayed by its device (default: {DEFAULT_MEMORY_SHARE * 100:.0f}%% "
        f"of this machine's memory, {format_size(defaults.state_budget or 0)} here)",
    )
    parser.add_argument(
        "--state-share",
        type=parse_size,
        default=defaults.state_share,
        metavar="SIZE",
        help="keep at most SIZE of session state for each caller (default: an equal split "
        "of --state-budget among the callers holding state, applied when it is full)",
    )
    parser.add_argument(
        "--state-idle",
        type=parse_seconds,
        default=format_duration(defaults.state_idle_s),
        metavar="DURATION",
        help="drop a session's state after this long without a request (e.g. 90s, 3600s)",
    )
    add_batch_arguments(parser, defaults)
    add_link_arguments(parser)
    add_security_arguments(parser, server=server)


def add_batch_arguments(parser: argparse.ArgumentParser, defaults: RuntimeOptions) -> None:
    """``--max-batch``, ``--batch-delay`` and ``--batch-padding`` ([Note: the step batcher]
    in tierflow/runtime/batching.py)."""
    parser.add_argument(
        "--max-batch",
        type=int,
        default=defaults.max_batch,
        metavar="N",
        help="run the queued decode steps of up to N sessions as one ONNX Runtime call "
        "(1: no batching); a step that finds the tier idle runs at once, and batches "
        "grow with the steps queued (a queued step holds none of --workers)",
    )
    parser.add_argument(
        "--batch-delay",
        type=parse_seconds,
        default=format_duration(defaults.batch_delay_s),
        metavar="DURATION",
        help="let a step (at an idle tier, or leading a batch) wait up to this long for "
        "the steps of the sessions that stepped with its own last time, so lockstep "
        "sessions share one call instead of taking turns, and a session's first step "
        "for the first steps of sessions starting with it (at most "
        f"{format_duration(MAX_BATCH_DELAY_S)}; a lone session's later steps never "
        "wait, its first waits the delay once on each tier)",
    )
    parser.add_argument(
        "--batch-padding",
        action="store_true",
        default=defaults.batch_padding,
        help="also batch steps of different past lengths, left-padding their KV caches "
        "and masks: more steps share a call, but each pays for the padding's compute and "
        "its logits differ from running alone in the last bits (about 3e-6), so greedy "
        "tokens can differ; for Hugging Face style decoders only (default: only steps "
        "of the same shapes, bit-exact)",
    )


def add_link_arguments(parser: argparse.ArgumentParser) -> None:
    """``--link-emulation`` and ``--emulate-link``, as every runtime command takes them.

    ``--link`` is the old spelling of ``--emulate-link`` ([Note: deprecated spellings] in
    ``tierflow.cli.arguments``): ``plan --link`` says which link to plan for, and a
    runtime's link is the one it emulates.
    """
    parser.add_argument(
        "--link-emulation",
        type=LinkEmulation.parse,
        default="off",
        metavar="{off,plan,trace=FILE.csv}",
        help="shape every link this process sends on: 'off' leaves them alone, 'plan' uses "
        "the plan's rates and RTTs, 'trace=FILE.csv' replays SECONDS,RATE,RTT lines (e.g. "
        "3,2mbit,30ms: from 3 s on) from when each link opens. A process shapes only what "
        "it sends: set the same on every process (the device's run, device or generate, "
        "and serve edge and serve cloud) for a link to be shaped both ways",
    )
    emulate = parser.add_argument(
        "--emulate-link",
        type=functools.partial(LinkOption.parse, option="--emulate-link"),
        action="append",
        default=[],
        metavar="NAME=RATE[,RTT]",
        help="shape one link to a fixed rate and RTT whatever --link-emulation says, e.g. "
        "device-edge=20mbit,10ms (repeatable; without an RTT the link keeps the plan's)",
    )
    add_deprecated(parser, "--link", emulate)


def add_optimization_argument(parser: argparse.ArgumentParser) -> None:
    """``--optimization``, for every command that runs segments ([Note: optimization level
    and exactness] in ``tierflow.onnxrt.inference``)."""
    parser.add_argument(
        "--optimization",
        choices=tuple(OPTIMIZATION_LEVELS),
        default=DEFAULT_OPTIMIZATION,
        help="ONNX Runtime graph optimization; 'extended' or lower makes split outputs "
        "bit-identical to the unsplit model's, 'all' is faster",
    )


def add_providers_argument(parser: argparse.ArgumentParser) -> None:
    """``--providers``, for every command that runs segments (checked as it is parsed,
    by ``tierflow.onnxrt.providers.parse_providers``)."""
    parser.add_argument(
        "--providers",
        type=argument_type(parse_providers),
        default=DEFAULT_PROVIDERS,
        metavar="LIST",
        help="ONNX Runtime execution providers in order of preference, like cuda,cpu or "
        "tensorrt,cuda,cpu or coreml; auto: all this onnxruntime offers "
        f"(here: {describe(available())})",
    )


def add_segment_budget_argument(parser: argparse.ArgumentParser) -> None:
    """``--segment-budget``, for every command that runs segments of a plan ([Note:
    segments on demand] in ``tierflow.runtime.segment_store``)."""
    parser.add_argument(
        "--segment-budget",
        type=parse_size,
        metavar="SIZE",
        help="keep at most SIZE of segment files, least recently used evicted; files "
        "missing from the plan directory are fetched from the tier above (default: no bound)",
    )


def add_security_arguments(parser: argparse.ArgumentParser, *, server: bool) -> None:
    """``--tls-cert``, ``--tls-key``, ``--tls-ca``, ``--token-file``, ``--tls-server-name``
    (and a server's ``--insecure``): a :class:`Security` ([Note: tier security])."""
    group = parser.add_argument_group("security (TLS between tiers, tokens)")
    group.add_argument("--tls-cert", metavar="PEM", help="this tier's certificate (TLS)")
    group.add_argument("--tls-key", metavar="KEY", help="the private key of --tls-cert")
    group.add_argument(
        "--tls-ca",
        metavar="PEM",
        help=(
            "CA that signs the clients' certificates: only they are served (mutual TLS)"
            if server
            else "CA that signed the server's certificate (default: the system's roots)"
        ),
    )
    group.add_argument(
        "--token-file",
        metavar="F",
        help=(
            "serve only calls bearing a token this file lists: one TOKEN, or a NAME TOKEN "
            "line per client (for TLS terminated elsewhere)"
            if server
            else "send this bearer token with every call"
        ),
    )
    group.add_argument(
        "--tls-server-name",
        metavar="NAME",
        help="the name the next tier's certificate must carry, when its address does not "
        "say it (needed with TLS for a list of replicas, ipv4:H1:P1,H2:P2)",
    )
    if server:
        group.add_argument(
            "--insecure",
            action="store_true",
            help="allow plaintext on addresses other than loopback (without TLS flags)",
        )


def security_from_args(args: argparse.Namespace, *, server: bool) -> Security:
    """The :class:`Security` that :func:`add_security_arguments` (``server`` as given
    there) put on ``args``. A server's ``upstream_token_file`` is the edge's
    ``--upstream-token-file`` (``serve cloud`` sets it to None: it has no next tier)."""
    return Security(
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        tls_ca=args.tls_ca,
        token_file=args.token_file,
        insecure=args.insecure if server else False,
        server_name=args.tls_server_name,
        upstream_token_file=args.upstream_token_file if server else None,
    )


def runtime_options(args: argparse.Namespace, plan: Plan, *, server: bool) -> RuntimeOptions:
    """The :class:`RuntimeOptions` a runtime command was given ([Note: flags only in cli]).

    ``args`` comes from a parser set up by :func:`add_runtime_arguments` with the same
    ``server``; a client (``run``, ``device``, ``generate``) has no server's flags and
    keeps ``RuntimeOptions()``'s for them. Links are resolved against ``plan``'s.
    """
    defaults = RuntimeOptions()
    return RuntimeOptions(
        threads=args.threads,
        slowdown=args.slowdown,
        optimization=args.optimization,
        providers=args.providers,
        links=resolve_links(plan.links, args.link_emulation, args.emulate_link),
        security=security_from_args(args, server=server),
        segment_budget=args.segment_budget,
        state_budget=args.state_budget,
        state_share=args.state_share,
        state_idle_s=args.state_idle,
        max_batch=args.max_batch,
        batch_delay_s=args.batch_delay,
        batch_padding=args.batch_padding,
        workers=args.workers if server else defaults.workers,
        max_tensor_bytes=args.max_tensor_bytes if server else defaults.max_tensor_bytes,
        max_streams=args.max_streams if server else defaults.max_streams,
        max_streams_per_peer=(
            args.max_streams_per_peer if server else defaults.max_streams_per_peer
        ),
        reply_timeout=args.reply_timeout if server else defaults.reply_timeout,
        stream_idle_s=args.stream_idle if server else defaults.stream_idle_s,
    )
