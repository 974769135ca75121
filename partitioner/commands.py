"""The ``tierflow profile`` and ``tierflow plan`` commands.

Options are parsed and checked before any model is loaded, so a typo fails at once with
one line naming it. onnx and onnxruntime are imported inside the handlers.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tierflow.cli.arguments import add_deprecated
from tierflow.cli.helptext import HelpFormatter, examples
from tierflow.cli.paths import output_file, output_folder
from tierflow.cli.runtime_arguments import add_providers_argument
from tierflow.codec.base import CodecSpec
from tierflow.codec.spec import CODEC_FORMS, EXACT_PLANNER_CODECS, LOSSY_PLANNER_CODECS
from tierflow.errors import UsageError, shown
from tierflow.link.spec import LINKS, LinkOption, LinkSpec, apply_links, check_link, check_tier
from tierflow.units import (
    format_duration,
    format_size,
    parse_size,
    parse_slowdown,
    positive_seconds,
)

DEFAULT_THREADS = 1
DEFAULT_TIME_BUDGET_S = 20.0


class DecoderDefaults:
    """``plan --context``, ``--max-tokens`` and ``--prompt-tokens`` when not given."""

    context = 2048
    max_tokens = 64
    prompt_tokens = 32


def _model_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL.onnx", help="the ONNX model")
    parser.add_argument(
        "--shape",
        action="append",
        default=[],
        metavar="NAME=DIMS",
        help="fix an input's symbolic dimensions, like input=1x3x640x640 (repeatable)",
    )
    parser.add_argument(
        "--sample",
        metavar="IN.npz",
        help="real inputs (one array per model input, leading request axis); the first "
        "request fixes shapes and is what codecs are measured on",
    )


def register(subparsers: Any) -> None:
    """Add ``profile`` and ``plan`` to the ``tierflow`` command."""
    profile = subparsers.add_parser(
        "profile",
        help="measure a model's per-layer costs on this machine",
        description="Measure each unit of MODEL (the layers between two candidate cuts) on "
        "this machine in ONNX Runtime, the codecs on the real features at every cut, and the "
        "memory each unit needs; write a JSON profile for `tierflow plan --profile`.",
        epilog=examples(
            "# on the device itself (or here, emulated 8x slower on one thread)",
            "tierflow profile model.onnx -o pi4.json --threads 1 --slowdown 8",
            "# symbolic dimensions fixed from real inputs",
            "tierflow profile model.onnx -o server.json --sample in.npz --threads 8",
        ),
        formatter_class=HelpFormatter,
    )
    _model_options(profile)
    profile.add_argument(
        "-o",
        "--output",
        type=output_file,
        required=True,
        metavar="PROFILE.json",
        help="the profile to write",
    )
    profile.add_argument(
        "--threads", type=int, default=DEFAULT_THREADS, help="ONNX Runtime intra-op threads"
    )
    profile.add_argument(
        "--slowdown",
        type=parse_slowdown,
        default="1",
        metavar="X",
        help="emulate a machine X times slower than this one (8 or 8x)",
    )
    profile.add_argument(
        "--time-budget",
        type=positive_seconds,
        default=f"{DEFAULT_TIME_BUDGET_S:g}s",
        metavar="DURATION",
        help="time for repeated measurements (fixed costs come on top)",
    )
    add_providers_argument(profile)
    profile.set_defaults(handler=run_profile)

    plan = subparsers.add_parser(
        "plan",
        help="choose where each layer runs and write a plan directory",
        description="Score every split of MODEL over device, edge and cloud with the cost "
        "model, print the best plans next to the single-tier ones, split the model at the "
        "best and write PLAN_DIR (plan.json and one ONNX file per segment). Tiers without "
        "--profile are profiled on this machine, emulated slower (see --slowdown).",
        epilog=examples(
            "tierflow plan model.onnx -o plan/ --profile device=pi4.json --memory device=64MiB",
            "tierflow plan model.onnx -o plan/ --link device-edge=20mbit,10ms "
            "--objective throughput",
            "# links measured by `tierflow probe --json`, rates in bytes, exact features",
            "tierflow plan model.onnx -o plan/ --link edge.json --link edge-cloud=25MB/s,30ms "
            "--codec zstd",
            "# an audio model with a scalar input: shapes and values from real requests",
            "tierflow plan vad.onnx -o plan/ --sample in.npz",
            "# lossy codecs allowed where 99.5% of the sample keeps its top-1 class; the "
            "input may go as JPEG",
            "tierflow plan model.onnx -o plan/ --sample photos.npz --fidelity top1=99.5% "
            "--image-input input --image-norm input=imagenet",
            "# a decoder (past_key_values.N -> present.N): KV cache at 2048 tokens counted in "
            "each tier's memory",
            "tierflow plan decoder.onnx -o plan/ --context 2048 --memory device=256MiB "
            "--link device-edge=20mbit,30ms --max-tokens 64",
            "# a streaming model whose recurrent state has names the conventions miss",
            "tierflow plan stream.onnx -o plan/ --state mem_in=mem_out",
        ),
        formatter_class=HelpFormatter,
    )
    _model_options(plan)
    plan.add_argument(
        "-o",
        "--output",
        type=output_folder,
        required=True,
        metavar="PLAN_DIR",
        help="the plan directory to write (a plan already there is replaced)",
    )
    plan.add_argument(
        "--profile",
        type=profile_argument,
        action="append",
        default=[],
        metavar="TIER=PROFILE.json",
        help="a tier's profile from `tierflow profile` (repeatable)",
    )
    plan.add_argument(
        "--link",
        type=link_argument,
        action="append",
        default=[],
        metavar="LINK=RATE[,RTT]",
        help="a link's rate and RTT, like device-edge=20mbit,10ms (rates in bits: kbit, mbit, "
        "gbit, Mbps; or bytes: MB/s, MiB/s), or LINK=PROBE.json or PROBE.json from "
        "`tierflow probe --json` (repeatable); a rate alone keeps that link's RTT "
        "(default: device-edge=20mbit,10ms, edge-cloud=200mbit,30ms)",
    )
    plan.add_argument(
        "--memory",
        type=memory_argument,
        action="append",
        default=[],
        metavar="TIER=SIZE",
        help="a tier's memory budget for weights and activations, like device=64MiB (a size "
        "needs its unit: 64B for bytes)",
    )
    plan.add_argument(
        "--objective",
        choices=("latency", "throughput"),
        default="latency",
        help="minimise one request's latency, or maximise pipelined requests per second "
        "(a decoder: the whole generation's time, or tokens per second; with --sessions N, "
        "the aggregate tokens per second of N sessions whose decode steps are batched)",
    )
    plan.add_argument(
        "--codec",
        default="auto",
        metavar="CODEC",
        help="feature codec on every link. auto: the cost model picks per link among "
        f"{', '.join(EXACT_PLANNER_CODECS)}, and under a lossy --fidelity budget also "
        f"{', '.join(LOSSY_PLANNER_CODECS)} (with --image-input, an image input may go as "
        f"png, or jpeg:Q/webp:Q under a lossy budget); or one codec for every link: "
        f"{CODEC_FORMS}",
    )
    plan.add_argument(
        "--fidelity",
        default="exact",
        metavar="BUDGET",
        help="exact (lossless codecs only: the split reproduces the model bit for bit), "
        "top1=P%% (at least P%% of the sample's requests keep the exact model's argmax) or "
        "rel=E (no request's outputs move by more than E relative to their largest value); "
        "a lossy budget needs --sample, on which every lossy candidate is measured end to end",
    )
    plan.add_argument(
        "--image-input",
        action="append",
        default=[],
        metavar="NAME",
        help="model input NAME is a normalised 8-bit image: where the inputs cross a link it "
        "may travel as JPEG (quality 5..95), WebP or PNG (repeatable; lossy ones need a "
        "--fidelity budget, png an exact round trip on --sample)",
    )
    plan.add_argument(
        "--image-norm",
        action="append",
        default=[],
        metavar="NAME=SPEC",
        help="how an --image-input was normalised, x = (pixel / scale - mean) / std: a preset "
        "(unit: pixel/255, imagenet, symmetric: pixel/127.5-1) or "
        "'mean=M[,M,M];std=S[,S,S][;scale=255][;layout=NCHW|NHWC]' (default: unit)",
    )
    plan.add_argument(
        "--state",
        action="append",
        default=[],
        metavar="IN=OUT",
        help="a state pair the name conventions miss (past_key_values.N.key -> present.N.key, "
        "state -> stateN, h0 -> hn, ...): input IN takes output OUT of the session's previous "
        "request; repeatable, globs pair every match, like 'past.*=present.*'. A pair stays on "
        "one tier and never crosses a link",
    )
    plan.add_argument(
        "--context",
        type=int,
        metavar="N",
        help="decoders: the longest past + new tokens a session holds; each tier's memory "
        f"counts its blocks' KV cache at this length (default: {DecoderDefaults.context})",
    )
    plan.add_argument(
        "--max-tokens",
        type=int,
        metavar="N",
        help="decoders: tokens generated per prompt; the latency objective is time to first "
        f"token + (N - 1) x time per token (default: {DecoderDefaults.max_tokens})",
    )
    plan.add_argument(
        "--prompt-tokens",
        type=int,
        metavar="P",
        help="decoders: the prompt length whose prefill is priced (at most --context) "
        f"(default: {DecoderDefaults.prompt_tokens}, or --context if shorter)",
    )
    plan.add_argument(
        "--sampled",
        action="store_true",
        help="decoders: price sampled generation (each step's answer is the last position's "
        "logits) instead of greedy (the token choice alone, 8 bytes)",
    )
    plan.add_argument(
        "--sessions",
        type=int,
        metavar="N",
        help="decoders, with --objective throughput: plan for N concurrent sessions, each "
        "tier running their decode steps as one batch; the decode step is profiled here at "
        "batch 1, 2, 4, ... up to N (the next power of two, interpolated at N), a plan's "
        "time per token is its batched step's, and it maximises the N sessions' tokens per "
        "second in all; plan.json records sessions, aggregate_tokens_per_s and the batch "
        "profile (default: not batched, sessions pipelined one step per stage)",
    )
    slowdown = plan.add_argument(
        "--slowdown",
        type=slowdown_argument,
        action="append",
        default=[],
        metavar="TIER=X",
        help="how many times slower than this machine a tier without --profile is, as "
        "serve and run --slowdown X emulate it (repeatable) "
        "(default: device=4, edge=2, cloud=1)",
    )
    add_deprecated(plan, "--emulate", slowdown)
    plan.add_argument(
        "--threads",
        type=int,
        default=DEFAULT_THREADS,
        help="ONNX Runtime threads when profiling tiers here",
    )
    plan.add_argument("--top", type=int, default=5, help="how many plans to list")
    plan.add_argument(
        "--no-verify",
        dest="verify",
        action="store_false",
        help="skip checking that the split reproduces the model (it is checked unless given)",
    )
    plan.add_argument(
        "--adaptive",
        action="store_true",
        help="write a plan set: the best plan at every point of a grid of link rates and "
        "RTTs (see --grid), with the region where each is best; segments shared where cuts "
        "coincide; tiers load the plan for --link unless told otherwise",
    )
    plan.add_argument(
        "--grid",
        action="append",
        default=[],
        metavar="LINK=RATE,...[/RTT,...]",
        help="with --adaptive, the rates (and RTTs) tried on a link, like "
        "device-edge=1mbit,10mbit,100mbit/5ms,50ms (repeatable; the --link values are always "
        "tried) (default: device-edge 1..200mbit, edge-cloud 10mbit..1gbit, the --link RTTs)",
    )
    plan.add_argument("--json", action="store_true", help="print the ranking as JSON")
    plan.set_defaults(handler=run_plan)


# --------------------------------------------------------------------------- parsing


def _pair(text: str, option: str, example: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name.strip() or not value.strip():
        raise UsageError(f"malformed {option} {shown(text)}: expected {example}")
    return name.strip(), value.strip()


def _link_record(record: dict[str, Any], path: Path) -> LinkSpec:
    """A probe record's link; a file of another kind (a profile...) is named as such."""
    if "rate_bps" not in record:
        kind = str(record.get("format", ""))
        hint = (
            "; it is a profile: give it as --profile TIER=FILE"
            if kind.startswith("tierflow.profile")
            else ""
        )
        raise UsageError(
            f"link file {path} is not a probe result: expected rate_bps and rtt_s, as "
            f"`tierflow probe --json` writes them, found keys {shown(', '.join(record))}{hint}"
        )
    return LinkSpec.from_dict(record)


def _read_probe(path: Path, wanted: str | None) -> tuple[LinkOption, ...]:
    """Links measured by ``tierflow probe --json``: one record, a list, or ``{"links": [...]}``."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise UsageError(f"link file {path} does not exist") from exc
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UsageError(f"cannot read link file {path}: {shown(str(exc))}") from exc
    if isinstance(data, dict) and isinstance(data.get("links"), list):
        data = data["links"]
    records = data if isinstance(data, list) else [data]
    links: list[LinkOption] = []
    for record in records:
        if not isinstance(record, dict):
            raise UsageError(f"malformed link file {path}: expected objects with link, rate_bps")
        name = record.get("link", wanted)
        if not isinstance(name, str):
            raise UsageError(f"malformed link file {path}: a record names no link")
        if wanted is not None and name != wanted:
            if len(records) > 1:
                continue
            name = wanted
        links.append(LinkOption.of(check_link(name), _link_record(record, path)))
    if not links:
        raise UsageError(f"link file {path} has no record for {wanted}")
    return tuple(links)


def link_argument(text: str) -> tuple[LinkOption, ...]:
    """One ``plan --link`` value: ``NAME=RATE[,RTT]``, ``NAME=PROBE.json`` or ``PROBE.json``."""
    name, sep, value = text.partition("=")
    if sep and value.strip().endswith(".json"):
        return _read_probe(Path(value.strip()), check_link(name.strip()))
    if not sep and (text.strip().endswith(".json") or _is_file(text)):
        return _read_probe(Path(text.strip()), None)
    return (LinkOption.parse(text),)


def _is_file(text: str) -> bool:
    try:
        return Path(text).is_file()
    except (OSError, ValueError):  # a name too long for the file system, a NUL byte
        return False


def memory_argument(text: str) -> tuple[str, int]:
    """One ``--memory TIER=SIZE`` value (a size needs its unit).

    See [Note: sizes carry a unit] in ``tierflow.units``.
    """
    tier, size = _pair(text, "--memory", "TIER=SIZE, like device=64MiB")
    return check_tier(tier), parse_size(size)


def slowdown_argument(text: str) -> tuple[str, float]:
    """One ``plan --slowdown TIER=X`` value: how much slower than this machine a tier is."""
    tier, value = _pair(text, "--slowdown", "TIER=X, like device=4")
    return check_tier(tier), parse_slowdown(value)


def profile_argument(text: str) -> tuple[str, Path]:
    """One ``--profile TIER=PROFILE.json`` value."""
    tier, path = _pair(text, "--profile", "TIER=PROFILE.json, like device=pi4.json")
    return check_tier(tier), Path(path)


def plan_links(
    values: Sequence[Sequence[LinkOption]],
) -> tuple[dict[str, LinkSpec], dict[str, str]]:
    """The links ``--link`` values make over the planner's defaults, and the RTTs kept.

    The second mapping names each link whose value gave a rate but no RTT, with the RTT
    it kept (printed, so that a kept 10 ms is never a surprise).
    """
    from tierflow.partitioner.plan_options import DEFAULT_LINKS

    options = [option for group in values for option in group]
    defaults = {name: LinkSpec.parse(text) for name, text in DEFAULT_LINKS.items()}
    links = apply_links(defaults, options)
    kept: dict[str, str] = {}
    for option in options:
        if option.rtt_given:
            kept.pop(option.name, None)
        else:
            kept[option.name] = format_duration(links[option.name].rtt_s)
    return links, kept


def _shapes(values: Sequence[str]) -> dict[str, tuple[int, ...]]:
    from tierflow.partitioner.shapes import parse_shape_option

    return dict(parse_shape_option(v) for v in values)


def _load_graph(args: argparse.Namespace, sample: Any = None) -> Any:
    """The model as planned: its trunk when it carries early exits (see exits.plan)."""
    from tierflow.partitioner.exits.plan import load_planning_graph
    from tierflow.partitioner.shapes import load_sample

    shapes = _shapes(args.shape)
    if sample is None and args.sample:
        sample = load_sample(args.sample)
    state = parse_states(getattr(args, "state", []))
    return load_planning_graph(args.model, shapes=shapes or None, sample=sample, state=state)


def parse_states(values: Sequence[str]) -> list[tuple[str, str]]:
    """The ``--state IN=OUT`` patterns, checked before any model is read."""
    from tierflow.state.pairs import parse_state_option

    return [parse_state_option(text) for text in values]


def parse_decoder_settings(args: argparse.Namespace) -> Any:
    """``--context``, ``--max-tokens``, ``--prompt-tokens`` as one checked value."""
    from tierflow.partitioner.decoder_points import DecoderSettings

    context = DecoderDefaults.context if args.context is None else args.context
    prompt = args.prompt_tokens
    if prompt is None:  # the default prompt, shortened to a short context
        prompt = min(DecoderDefaults.prompt_tokens, max(context, 1))
    return DecoderSettings(
        context=context,
        max_tokens=DecoderDefaults.max_tokens if args.max_tokens is None else args.max_tokens,
        prompt_tokens=prompt,
        sampled=bool(args.sampled),
        sessions=args.sessions,
    )


def _decoder_only_options(args: argparse.Namespace) -> list[str]:
    given = [("--context", args.context), ("--max-tokens", args.max_tokens)]
    given.append(("--prompt-tokens", args.prompt_tokens))
    given.append(("--sampled", True if args.sampled else None))
    given.append(("--sessions", args.sessions))
    return [flag for flag, value in given if value is not None]


def parse_fidelity(text: str, sample: str | None) -> Any:
    """The ``--fidelity`` budget; a lossy one needs ``--sample``."""
    from tierflow.partitioner.fidelity import FidelityBudget

    budget = FidelityBudget.parse(text)
    if not budget.lossless_only and not sample:
        raise UsageError(
            f"--fidelity {budget} needs --sample IN.npz: lossy codecs are measured end to end "
            "on real inputs"
        )
    return budget


def _positive(value: float, option: str) -> None:
    if not value > 0:
        raise UsageError(f"{option} must be positive, got {value:g}")


# --------------------------------------------------------------------------- handlers


def run_profile(args: argparse.Namespace) -> int:
    from tierflow.partitioner.profile import profile_model, save_profile
    from tierflow.partitioner.report import Progress

    _positive(args.threads, "--threads")
    _positive(args.slowdown, "--slowdown")
    _positive(args.time_budget, "--time-budget")
    _shapes(args.shape)
    from tierflow.partitioner.decoder_graph import inspect_decoder

    if inspect_decoder(args.model) is not None:
        raise UsageError(
            f"{args.model} is a decoder: `tierflow plan` profiles it here at its prefill and "
            "decode points; a profile of one shape would price neither"
        )
    graph = _load_graph(args)
    progress = Progress("profiling")
    try:
        profile = profile_model(
            graph,
            threads=args.threads,
            slowdown=args.slowdown,
            time_budget_s=args.time_budget,
            progress=progress,
            providers=args.providers,
        )
    finally:
        progress.close()
    path = save_profile(profile, args.output)
    whole = profile.segment_s(0, len(profile.units))
    print(
        f"profiled {Path(graph.path).name}: {len(profile.units)} units between "
        f"{len(profile.cuts)} cuts in {profile.calibration.get('profile_s', 0.0):.1f} s"
    )
    print(f"machine: {profile.machine.describe()}")
    print(
        f"whole model: {format_duration(whole)} predicted per request "
        f"(call overhead {format_duration(profile.overhead_s)}, "
        f"unit-time correction {profile.calibration.get('correction', 1.0):.2f})"
    )
    print(f"wrote {path}")
    return 0


def _verdict_line(outcome: Any, lossy: bool) -> str:
    """How the written plan was checked: bit for bit only when it is and that was run.

    ``lossy``: a codec other than ``png`` changes values (png is exact only on 8-bit
    pixels, so it counts as exact only where the measurement found every output equal).
    """
    fidelity = outcome.fidelity
    if fidelity is not None:
        if fidelity.bitwise_equal and not lossy:
            inputs = fidelity.samples
            return (
                f"verified: split reproduces the model bit-for-bit on {inputs} "
                f"input{'s' if inputs != 1 else ''}"
            )
        exactness = "" if fidelity.bitwise_equal else "; not bit-for-bit"
        return (
            f"fidelity: {fidelity.describe()} (budget {fidelity.budget}, measured end to end)"
            f"{exactness}"
        )
    if outcome.verified_bitwise is None:
        return "not verified (--no-verify)"
    return f"split verified bit-for-bit on {outcome.verify_inputs} input, without its codecs"


def run_plan(args: argparse.Namespace) -> int:
    from tierflow.image_norm import parse_norm
    from tierflow.partitioner.candidates import codec_candidates
    from tierflow.partitioner.decoder_commands import (
        profiled_decoder,
        refuse_for_decoder,
        report_decoder_plan,
    )
    from tierflow.partitioner.decoder_graph import inspect_decoder
    from tierflow.partitioner.fidelity import check_sample_size
    from tierflow.partitioner.image_inputs import resolve_images
    from tierflow.partitioner.plan_options import PlanOptions
    from tierflow.partitioner.planner import make_plan
    from tierflow.partitioner.profile_data import load_profile
    from tierflow.partitioner.report import Progress
    from tierflow.partitioner.shapes import load_sample
    from tierflow.partitioner.split import check_plan_dir
    from tierflow.partitioner.tier_profiles import DEFAULT_EMULATION, complete_profiles
    from tierflow.partitioner.weights import available_memory, check_planning_memory

    links, assumed = plan_links(args.link)
    memory = dict(args.memory)
    emulation = {**DEFAULT_EMULATION, **dict(args.slowdown)}
    profile_paths = dict(args.profile)
    budget = parse_fidelity(args.fidelity, args.sample)
    norms = dict(parse_norm(text) for text in args.image_norm)
    candidates = codec_candidates(args.codec, budget, args.image_input)
    _positive(args.threads, "--threads")
    _positive(args.top, "--top")
    _shapes(args.shape)
    check_plan_dir(args.output)
    states = parse_states(args.state)
    settings = parse_decoder_settings(args)
    check_planning_memory(Path(args.model), available_memory())
    decoder = inspect_decoder(args.model, states, settings) is not None
    if decoder:
        refuse_for_decoder(args, budget)
    elif stray := _decoder_only_options(args):
        raise UsageError(
            f"{', '.join(stray)} set a decoder's lengths; {args.model} is no decoder (no "
            "input pairs with an output as a growing state, like past_key_values.0.key -> "
            "present.0.key)"
        )
    grid = _grid(args, links)
    options = PlanOptions(
        links=links,
        memory=memory,
        objective=args.objective,
        codec=args.codec,
        verify=args.verify,
        top=args.top,
        fidelity=budget,
    )
    sample = load_sample(args.sample) if args.sample else None
    if decoder:
        graph, profiles, notes = profiled_decoder(args, settings, memory, emulation, candidates)
    else:
        if sample is not None:
            check_sample_size(budget, min(len(a) for a in sample.values()))
        graph = _load_graph(args, sample)
        if args.image_input or norms:
            images = resolve_images(graph.inputs, args.image_input, norms)
            options = dataclasses.replace(options, images=images)
        given = {}
        for tier, path in profile_paths.items():
            given[tier] = load_profile(path)
            given[tier].check_model(graph, where=f"--profile {tier}={path}")
        progress = Progress("profiling here")
        try:
            profiles, notes = complete_profiles(
                graph,
                given,
                emulation=emulation,
                threads=args.threads,
                progress=progress,
                codecs=candidates,
            )
        finally:
            progress.close()
        if grid is not None:
            return _run_adaptive(args, graph, profiles, options, grid, notes)
    progress = Progress("measuring fidelity")
    try:
        outcome = make_plan(graph, profiles, options, args.output, sample=sample, progress=progress)
    finally:
        progress.close()
    if args.json:
        report = outcome.result.to_dict()
        report["plan_dir"] = str(outcome.plan_dir)
        if decoder:
            report["decoder"] = {**graph.decoder.to_dict(), **settings.to_dict()}
            report["verified"] = outcome.plan.estimate.get("verified")
        else:
            report["verified"] = outcome.verified_bitwise
            report["fidelity"] = outcome.fidelity.to_dict() if outcome.fidelity else None
        report["notes"] = list(notes) + list(outcome.notes)
        report["notes"] += [
            f"{name}: no RTT given, kept the default {rtt}" for name, rtt in assumed.items()
        ]
        json.dump(report, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    for note in (*notes, *outcome.notes):
        print(note)
    for name in LINKS:
        kept = f" (no RTT given: kept the default {assumed[name]})" if name in assumed else ""
        print(f"{name}: {links[name]}{kept}")
    if memory:
        budgets = ", ".join(f"{t} {format_size(size)}" for t, size in memory.items())
        print(f"memory budgets: {budgets}")
    if decoder:
        report_decoder_plan(outcome, graph, memory, args.objective)
    else:
        _report_plan(outcome, profiles, memory, args.objective)
    print(f"wrote {outcome.plan_dir / 'plan.json'} and {len(outcome.plan.segments)} segment(s)")
    return 0


def _report_plan(
    outcome: Any, profiles: Mapping[str, Any], memory: Mapping[str, int], objective: str
) -> None:
    """Print a plan's ranking, the chosen plan, what its codecs do and how it was checked."""
    from tierflow.partitioner.report import exits_cell, plan_table

    result = outcome.result
    print(
        f"\n{result.considered} plans scored for {objective}, {result.feasible} fit the "
        "budgets; compute per tier and link cost (codec, bytes sent, encode+wire+RTT+decode+reply):"
    )
    if result.best.exits:
        print(
            "with early exits every time is expected: weighted by the chance a request gets "
            "there (share of requests crossing a link in brackets)"
        )
    providers = {tier: profile.machine.provider_names for tier, profile in profiles.items()}
    print(plan_table(result, memory, providers))
    best = result.best
    expected = "expected (with early exits)" if best.exits else "predicted"
    print(
        f"\nchosen: {' -> '.join(best.tiers)}, {expected} {format_duration(best.latency_s)} "
        f"per request, {best.throughput_rps:.1f} requests/s pipelined"
    )
    if best.exits:
        print(f"early exits: {exits_cell(best)}")
    crossing = dict(zip(LINKS, best.cuts, strict=True))
    lossy = False
    for name, codec in best.codec.items():
        spec = CodecSpec.parse(codec)
        if spec.image:
            carried = ", ".join(outcome.plan.images)
            print(f"note: {codec} on {name} carries image input(s) {carried} as images")
        if not spec.bit_exact:
            lossy = lossy or codec != "png"  # png: exact where the sample shows it
            sender = profiles[name.split("-")[0]]
            stats = sender.cuts[crossing[name]].codecs.get(codec)
            by = f" by up to {stats.max_abs_error:.3g} (measured at that cut)" if stats else ""
            print(f"note: {codec} on {name} changes values{by}")
    print(_verdict_line(outcome, lossy))
    for segment in outcome.plan.segments:
        for state in segment.state:
            print(
                f"state {state.input} -> {state.output} stays on the {segment.tier} "
                "(checked over consecutive requests, each fed the previous one's state)"
            )


def _grid(args: argparse.Namespace, links: Mapping[str, LinkSpec]) -> Any:
    """The rate grid of ``--adaptive`` (None without it), checked before any work."""
    from tierflow.partitioner.grid import RateGrid

    if not args.adaptive:
        if args.grid:
            raise UsageError("--grid sets the rates an --adaptive plan set covers: add --adaptive")
        return None
    if args.fidelity != "exact" or args.image_input:
        raise UsageError(
            "--adaptive plans with lossless codecs only: drop --fidelity/--image-input"
        )
    return RateGrid.around(links, args.grid)


def _run_adaptive(
    args: argparse.Namespace,
    graph: Any,
    profiles: Mapping[str, Any],
    options: Any,
    grid: Any,
    notes: Sequence[str],
) -> int:
    """``tierflow plan --adaptive``: write a plan set and print where each plan is best."""
    from tierflow.partitioner.plan_sets import make_plan_set
    from tierflow.partitioner.report import plan_letter, region_tables

    outcome = make_plan_set(graph, profiles, options, grid, args.output)
    choice = outcome.choice
    if args.json:
        report = {
            "plan_dir": str(outcome.plan_dir),
            "points": len(choice.points),
            "plans": [
                {
                    "letter": plan_letter(i),
                    "plan_id": plan.plan_id,
                    **plan.estimate,
                    "regions": [
                        {name: link.to_dict() for name, link in point.items()}
                        for point in outcome.plans.regions[i]
                    ],
                }
                for i, plan in enumerate(outcome.plans.plans)
            ],
            "segment_files": outcome.segment_files,
            "verified": outcome.verified,
            "notes": [*notes, *outcome.notes],
        }
        json.dump(report, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    for note in (*notes, *outcome.notes):
        print(note)
    print(
        f"{len(choice.points)} link conditions scored for {args.objective}: "
        f"{len(choice.plans)} plan(s) are best somewhere\n"
    )
    print(region_tables(choice))
    checked = "each split verified bit-for-bit on 1 input" if outcome.verified else "not verified"
    print(f"\n{checked}")
    print(
        f"wrote {outcome.plan_dir / 'plan.json'} (a plan set, default plan A) and "
        f"{outcome.segment_files} segment file(s) for {outcome.segments_named} segments"
    )
    return 0
