"""``tierflow generate``: text from a decoder plan across the tiers, streamed as it comes.

The prompt is text with ``--tokenizer`` (a Hugging Face ``tokenizer.json``, the
``tokenizer`` extra; or ``bytes`` for a byte-level model: the ids are the prompt's UTF-8
bytes) or token ids (``--prompt-ids``). Tokens print as they arrive; the summary says how
long the first took, the time per token after it, the round trips and bytes per token on
each link, and which tier ran which blocks. ``--json`` ends with one JSON line instead
(:class:`~tierflow.device.generation.GenerationReport`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from tierflow.cli import json_output
from tierflow.cli.helptext import HelpFormatter, examples
from tierflow.cli.runtime_arguments import add_runtime_arguments, runtime_options
from tierflow.cli.table import format_table
from tierflow.device.commands import add_deadline_argument, add_plan_arguments, edge_address
from tierflow.errors import DeadlineError, MissingExtraError, TierflowError, UsageError
from tierflow.plan import load_plan_set
from tierflow.units import format_size

if TYPE_CHECKING:
    from tierflow.device.generation import GenerationReport


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "generate",
        help="generate text with a decoder plan across the tiers",
        description="Be the device of a decoder plan (tierflow plan on a decoder exported "
        "with its KV cache): prefill the prompt, then generate token by token, each tier "
        "keeping its blocks' KV cache for the session. With --draft, a small model of the "
        "same vocabulary drafts several tokens on the device and the tiers check them in "
        "one pass: fewer round trips, the same greedy output. Emulated links "
        "(--link-emulation, --emulate-link) shape only what this process sends: give the "
        "same to serve edge and serve cloud, or the replies cross unshaped.",
        epilog=examples(
            'tierflow generate --plan plan/ --edge 127.0.0.1:50051 --prompt "def fib(n):" '
            "--tokenizer tok.json --max-tokens 64",
            "tierflow generate --plan plan/ --edge 127.0.0.1:50051 --prompt-ids 1,2,3 "
            "--max-tokens 64 --draft small.onnx --json",
            "# a byte-level model: the prompt's UTF-8 bytes are its ids",
            'tierflow generate --plan plan/ --edge 127.0.0.1:50051 --prompt "import " '
            "--tokenizer bytes --temperature 0.8 --seed 1",
        ),
        formatter_class=HelpFormatter,
    )
    add_plan_arguments(parser)
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", metavar="TEXT", help="the prompt, encoded with --tokenizer")
    prompt.add_argument(
        "--prompt-ids", type=_ids, metavar="ID,ID,...", help="the prompt as token ids"
    )
    parser.add_argument(
        "--tokenizer",
        metavar="FILE|bytes",
        help="a Hugging Face tokenizer.json (pip install 'tierflow[tokenizer]'), or 'bytes' "
        "for a byte-level model",
    )
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most")
    parser.add_argument(
        "--stop", type=int, action="append", default=[], metavar="ID", help="stop after this token"
    )
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="0: greedy; above 0: sampled"
    )
    parser.add_argument("--seed", type=int, help="the sampler's seed (with --temperature)")
    parser.add_argument(
        "--draft", metavar="SMALL.onnx", help="a draft decoder of the same vocabulary, run here"
    )
    parser.add_argument(
        "--draft-tokens",
        type=_draft_tokens,
        default="auto",
        metavar="K|auto",
        help="tokens the draft proposes per round; auto: chosen from the acceptance and "
        "round-trip time measured",
    )
    parser.add_argument(
        "--fallback",
        choices=("none", "draft"),
        default="none",
        help="draft: when the tiers cannot be reached, go on with the draft model alone "
        "(those tokens are marked)",
    )
    add_deadline_argument(parser, "per-step deadline, from sending to the answer")
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    add_runtime_arguments(parser, server=False)
    parser.set_defaults(handler=_generate)


def _ids(text: str) -> list[int]:
    try:
        ids = [int(part) for part in text.replace(" ", "").split(",") if part]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected token ids like 1,2,3, got {text[:60]!r}"
        ) from None
    if not ids:
        raise argparse.ArgumentTypeError("the prompt holds no token ids")
    return ids


def _draft_tokens(text: str) -> int | None:
    if text.strip().lower() == "auto":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or auto, got {text[:60]!r}") from None


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """Token ids are UTF-8 bytes (a byte-level model's vocabulary of 256)."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class HuggingFaceTokenizer:
    """A ``tokenizer.json`` read with the ``tokenizers`` library."""

    def __init__(self, path: str | Path) -> None:
        try:
            from tokenizers import Tokenizer as HFTokenizer
        except ModuleNotFoundError as exc:
            raise MissingExtraError(
                "--tokenizer FILE needs the tokenizers package: pip install 'tierflow[tokenizer]'",
                module="tokenizers",
                extra="tokenizer",
            ) from exc
        if not Path(path).is_file():
            raise UsageError(f"tokenizer file {path} does not exist")
        try:
            self._tokenizer = HFTokenizer.from_file(str(path))
        except Exception as exc:  # the library raises its own exception types
            first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
            raise UsageError(f"tokenizer file {path} does not load: {first}") from exc

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tokenizer.decode(list(ids)))


def load_tokenizer(spec: str) -> Tokenizer:
    """``bytes``, or the tokenizer.json at ``spec``."""
    return ByteTokenizer() if spec.strip().lower() == "bytes" else HuggingFaceTokenizer(spec)


class _Printer:
    """Prints tokens as they arrive: text through the tokenizer, else ids."""

    def __init__(self, tokenizer: Tokenizer | None, stream: Any) -> None:
        self.tokenizer = tokenizer
        self.stream = stream
        self.ids: list[int] = []
        self.shown = ""
        self.warned = False

    def __call__(self, token: int, draft_only: bool) -> None:
        if draft_only and not self.warned:
            self.warned = True
            print(
                "\n[tierflow] the tiers cannot be reached: the tokens from here on come from "
                "the draft model alone",
                file=sys.stderr,
                flush=True,
            )
        self.ids.append(token)
        if self.tokenizer is None:
            self.stream.write(f"{token} ")
        else:  # the new text: decoding the whole keeps multi-byte characters whole
            text = self.tokenizer.decode(self.ids)
            if text.startswith(self.shown):
                self.stream.write(text[len(self.shown) :])
            self.shown = text
        self.stream.flush()


def _json_line(report: GenerationReport, tokenizer: Tokenizer | None) -> dict[str, Any]:
    line = report.to_dict()
    if tokenizer is not None:
        line["text"] = tokenizer.decode(report.tokens)
    return line


def _prefill_too_slow(
    exc: TierflowError, report: GenerationReport | None, prompt_tokens: int, deadline: Any
) -> TierflowError:
    """A deadline missed before the first token says so, and what to do: a long prompt
    on a large model can take longer to prefill than a step's ``--deadline``."""
    if not isinstance(exc, DeadlineError) or (report is not None and report.tokens):
        return exc
    return DeadlineError(
        f"{exc}: the prefill of the prompt's {prompt_tokens} tokens took longer than "
        f"--deadline {deadline}; a long prompt on a large model needs a longer one"
    )


def _generate(args: argparse.Namespace) -> int:
    from tierflow.device.client import DeviceClient
    from tierflow.device.generation import GenerationReport, Generator, layer_ranges
    from tierflow.tuning import tune_for_latency

    tune_for_latency()
    tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer else None
    if args.prompt is not None:
        if tokenizer is None:
            raise UsageError(
                "--prompt TEXT needs --tokenizer (a tokenizer.json, or 'bytes' for a "
                "byte-level model); or give --prompt-ids"
            )
        prompt = tokenizer.encode(args.prompt)
    else:
        prompt = args.prompt_ids
    if args.seed is not None and args.temperature <= 0:
        raise UsageError("--seed goes with --temperature above 0 (greedy needs no seed)")
    out = sys.stderr if args.json else sys.stdout
    generator: Generator | None = None
    try:
        plans = load_plan_set(args.plan, require_segments=False)
        options = runtime_options(args, plans.default_plan, server=False)
        with DeviceClient(
            args.plan,
            edge_address(args, options, plans),
            options=options,
            window=1,
            deadline_s=args.deadline,
            adaptive=False,
        ) as client:
            generator = Generator(
                client,
                draft=args.draft,
                draft_tokens=args.draft_tokens,
                temperature=args.temperature,
                seed=args.seed,
                fallback_draft=args.fallback == "draft",
            )
            printer: Callable[[int, bool], None] = _Printer(tokenizer, out)
            report = generator.generate(prompt, args.max_tokens, stop=args.stop, on_token=printer)
    except TierflowError as exc:
        failed = generator.report if generator is not None else None
        error = _prefill_too_slow(exc, failed, len(prompt), args.deadline)
        # --json still ends with its line: the tokens made before the failure, and why.
        if args.json:
            if failed is None:
                failed = GenerationReport(prompt=list(prompt), stopped="error")
            failed.error = str(error)
            if failed.tokens:
                print(file=out, flush=True)  # end the line of tokens printed as they came
            print(json_output.dumps(_json_line(failed, tokenizer)), flush=True)
        if error is exc:
            raise
        raise error from exc
    print(file=out, flush=True)
    if args.json:
        print(json_output.dumps(_json_line(report, tokenizer)))
        return 0
    rows = [
        ("tokens", f"{len(report.tokens)} (stopped: {report.stopped})"),
        ("time to first token", f"{report.ttft_ms:.1f} ms"),
        ("per token after it", f"{report.ms_per_token:.2f} ms"),
        ("round trips", str(report.round_trips)),
    ]
    if report.drafted:
        share = report.accepted / report.drafted
        rows.append(("drafts kept", f"{report.accepted} of {report.drafted} ({share:.0%})"))
        rate = report.accepted / max(report.judged, 1)
        rows.append(
            ("acceptance rate", f"{rate:.0%} ({report.accepted} of {report.judged} judged)")
        )
    if report.replays:
        rows.append(("sessions replayed", str(report.replays)))
    for link, size in report.bytes_per_token.items():
        rows.append((f"{link} per token", format_size(size)))
    rows.append(("blocks (KV layers)", layer_ranges(report.tiers) or "-"))
    if report.draft_only:
        rows.append(("draft-only tokens", str(len(report.draft_only))))
    print(format_table((), rows, align="ll"))
    return 0
