"""``tierflow bottleneck add`` and ``tierflow bottleneck show``: learned bottlenecks.

The work happens in :func:`tierflow.partitioner.bottleneck.add.add_bottleneck`; this
module parses options, hands it the torch trainer (:mod:`tierflow.zoo.bottleneck_train`)
and the agreement measure (:mod:`tierflow.zoo.agreement`), prints the rate-fidelity table
(or JSON with ``--json``) and writes the model. It is the one planner module that reaches
the torch side, and only inside the handler: ``bottleneck add`` trains, so it needs the
``train`` extra; registering the command costs nothing.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from tierflow.cli.helptext import HelpFormatter, examples
from tierflow.cli.paths import output_file
from tierflow.errors import UsageError


def _percent(text: str) -> float:
    """``99%`` -> 0.99, ``0.99`` -> 0.99."""
    value_text = text.strip()
    try:
        value = float(value_text.rstrip("%"))
    except ValueError as exc:
        raise UsageError(f"malformed share {text!r}: expected a percentage like 99%") from exc
    return value / 100.0 if value_text.endswith("%") else value


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "bottleneck",
        help="graft a learned encoder/decoder at a cut, so fewer bytes cross the link",
        description="Learned bottlenecks: narrow a feature where it crosses a link.",
        formatter_class=HelpFormatter,
        epilog=examples(
            "tierflow bottleneck add model.onnx --data photos.npz -o model-bn.onnx",
            "tierflow bottleneck show model-bn.onnx",
        ),
    )
    commands = parser.add_subparsers(dest="bottleneck_command", metavar="ACTION", required=True)
    add = commands.add_parser(
        "add",
        help="train bottlenecks at a cut and graft the smallest that keeps the answers",
        formatter_class=HelpFormatter,
        description=(
            "At a one-tensor cut (--at, else chosen), train convolutional encoder/decoder "
            "pairs that narrow the feature to K channels of B-bit integer codes, by "
            "distillation from the frozen model on the (unlabeled) calibration inputs; "
            "measure each on held-out requests against the exact model; graft the one with "
            "the fewest bytes that meets --target. The codes are the new crossing tensor: "
            "plan the written model as usual, with a lossless codec."
        ),
        epilog=examples(
            "tierflow bottleneck add model.onnx --data photos.npz -o model-bn.onnx",
            "tierflow bottleneck add model.onnx --data calib.npz -o bn.onnx --at relu_6 "
            "--channels 4 --bits 8 --target 98%",
            "tierflow plan model-bn.onnx -o plan/ --link device-edge=5mbit,20ms",
        ),
    )
    add.add_argument("model", metavar="MODEL.onnx", help="the model to add a bottleneck to")
    add.add_argument(
        "--data", required=True, metavar="CALIB.npz", help="inputs (leading request axis)"
    )
    add.add_argument(
        "-o", "--output", type=output_file, required=True, metavar="OUT.onnx", help="model to write"
    )
    add.add_argument(
        "--at", default=None, metavar="CUT", help="tensor name or cut index (default: chosen)"
    )
    add.add_argument(
        "--channels",
        type=int,
        action="append",
        default=[],
        metavar="K",
        help="code channels to try, repeatable (default: C/4, C/8, C/16 of the feature)",
    )
    add.add_argument(
        "--bits",
        type=int,
        action="append",
        default=[],
        metavar="B",
        help="bits per code value to try, repeatable (default: 8, 4, 2)",
    )
    add.add_argument(
        "--target", default="99%", help="agreement with the exact model the written one needs"
    )
    add.add_argument(
        "--agreement",
        choices=("top1", "boxes", "text"),
        default="top1",
        help="how answers are compared: top-1 class, detected boxes (PicoDet), CTC text",
    )
    add.add_argument("--holdout", default="30%", help="share of --data kept for measuring")
    add.add_argument("--steps", type=int, default=300, help="training steps per point")
    add.add_argument(
        "--features-only",
        action="store_true",
        help="distil the feature only, not the model's outputs",
    )
    add.add_argument(
        "--shape",
        action="append",
        default=[],
        metavar="NAME=DIMS",
        help="fix a symbolic input dimension (default: from --data)",
    )
    add.add_argument("--json", action="store_true", help="print the result as JSON")
    add.set_defaults(handler=_add)

    show = commands.add_parser(
        "show",
        help="print the rate-fidelity points recorded in a model",
        formatter_class=HelpFormatter,
        description=(
            "Print the rate-fidelity points that `bottleneck add` measured and recorded in "
            "the model it wrote: bytes per request against agreement with the exact model."
        ),
        epilog=examples("tierflow bottleneck show model-bn.onnx --json"),
    )
    show.add_argument("model", metavar="MODEL.onnx", help="a model written by bottleneck add")
    show.add_argument("--json", action="store_true", help="print them as JSON")
    show.set_defaults(handler=_show)


def _agreement(kind: str) -> Any:
    from tierflow.partitioner.bottleneck.add import top1
    from tierflow.zoo import agreement

    if kind == "boxes":
        return lambda exact, changed: agreement.box_agreement(
            agreement.layout_boxes(exact), agreement.layout_boxes(changed)
        )
    if kind == "text":
        return lambda exact, changed: agreement.text_agreement(exact[0], changed[0])
    return top1


def _add(args: argparse.Namespace) -> int:
    from tierflow.extras import import_extra
    from tierflow.partitioner.bottleneck.add import DEFAULT_BITS, add_bottleneck
    from tierflow.partitioner.shapes import parse_shape_option

    import_extra("torch", "training a bottleneck")
    from tierflow.zoo.bottleneck_train import TorchTrainer, TrainSettings

    if args.steps < 1:
        raise UsageError(f"--steps must be at least 1, got {args.steps}")
    shapes = dict(parse_shape_option(text) for text in args.shape) or None
    result = add_bottleneck(
        args.model,
        args.data,
        at=args.at,
        channels=args.channels,
        bits=args.bits or DEFAULT_BITS,
        trainer=TorchTrainer(TrainSettings(steps=args.steps), outputs=not args.features_only),
        target=_percent(args.target),
        agreement=_agreement(args.agreement),
        agreement_name=args.agreement,
        holdout=_percent(args.holdout),
        shapes=shapes,
    )
    path = result.save(args.output)
    if args.json:
        print(json.dumps({"model": str(path), **result.summary()}, indent=2))
    else:
        print(result.table())
        print(f"wrote {path}: plan it as usual; the codes {result.code!r} are its cheapest cut")
    return 0


def _show(args: argparse.Namespace) -> int:
    from tierflow.partitioner.bottleneck.graft import read_bottleneck

    summary = read_bottleneck(args.model)
    if args.json:
        print(json.dumps(summary, indent=2))
    elif not summary:
        print(f"{args.model} has no learned bottleneck")
    else:
        for key in ("at", "code", "agreement", "distillation", "trained_on", "measured_on"):
            print(f"{key}: {summary[key]}")
        for point in summary["points"]:
            print("  " + ", ".join(f"{k} {v}" for k, v in point.items()))
    return 0
