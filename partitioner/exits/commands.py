"""``tierflow exits add`` and ``tierflow exits show``: early-exit heads from the command line.

The work happens in :mod:`tierflow.partitioner.exits.add`; this module parses options,
prints the calibration table (or JSON with ``--json``) and writes the model. onnx and
scikit-learn are imported inside the handlers, so registering costs nothing.
"""

from __future__ import annotations

import argparse
import json
import logging
from typing import Any

from tierflow.cli.helptext import HelpFormatter, examples
from tierflow.cli.paths import output_file
from tierflow.errors import UsageError

logger = logging.getLogger(__name__)


def parse_fraction(text: str) -> float:
    """``1%`` -> 0.01, ``0.5%`` -> 0.005, ``0.01`` -> 0.01; must lie in [0, 1)."""
    value_text = text.strip()
    percent = value_text.endswith("%")
    try:
        value = float(value_text.rstrip("%").strip())
    except ValueError as exc:
        raise UsageError(
            f"malformed fraction {text!r}: expected a percentage like 1% or 0.5%"
        ) from exc
    if percent:
        value /= 100.0
    if not 0.0 <= value < 1.0:
        raise UsageError(f"malformed fraction {text!r}: expected 0% up to (not including) 100%")
    return value


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "exits",
        help="add early-exit heads to a classifier and calibrate their thresholds",
        description="Early exits: small heads that let confident requests leave early.",
        epilog=examples(
            "tierflow exits add model.onnx --data calib.npz -o model-exits.onnx",
            "tierflow exits show model-exits.onnx",
        ),
        formatter_class=HelpFormatter,
    )
    commands = parser.add_subparsers(dest="exits_command", metavar="ACTION", required=True)

    add = commands.add_parser(
        "add",
        help="graft exit heads onto a model and calibrate their thresholds",
        description=(
            "Train an exit head (pool + linear + softmax) at chosen cut tensors on the "
            "calibration data, graft the heads as extra outputs, and set each threshold, on "
            "held-out data, to the lowest that keeps the requests leaving there within the "
            "target disagreement with the full model (or accuracy drop, with labels)."
        ),
        epilog=examples(
            "tierflow exits add model.onnx --data calib.npz -o model-exits.onnx "
            "--max-disagreement 1%",
            "# two exits at named tensors, thresholds for at most 0.5% accuracy lost",
            "tierflow exits add model.onnx --data calib.npz -o model-exits.onnx "
            "--at layer2_out --at layer3_out --max-accuracy-drop 0.5%",
        ),
        formatter_class=HelpFormatter,
    )
    add.add_argument("model", metavar="MODEL.onnx", help="the classifier to add exits to")
    add.add_argument(
        "--data",
        required=True,
        metavar="CALIB.npz",
        help="calibration inputs (leading request axis), optionally with 'labels'",
    )
    add.add_argument(
        "-o",
        "--output",
        type=output_file,
        required=True,
        metavar="OUT.onnx",
        help="the model with exits to write",
    )
    target = add.add_mutually_exclusive_group()
    target.add_argument(
        "--max-disagreement",
        metavar="PCT",
        default=None,
        help="most disagreement with the full model allowed among requests leaving at an exit "
        "(default: 1%%)",
    )
    target.add_argument(
        "--max-accuracy-drop",
        metavar="PCT",
        default=None,
        help="most accuracy lost against the full model among leaving requests (needs labels)",
    )
    where = add.add_mutually_exclusive_group()
    where.add_argument(
        "--exits",
        type=int,
        default=None,
        metavar="N",
        help="number of exits, spread over the compute (default: 3)",
    )
    where.add_argument(
        "--at",
        action="append",
        default=[],
        metavar="TENSOR",
        help="put an exit at this one-tensor cut (repeatable)",
    )
    add.add_argument(
        "--declare-exit",
        action="append",
        default=[],
        metavar="OUTPUT",
        help="an output the model already has that is an exit (repeatable)",
    )
    add.add_argument(
        "--holdout",
        default=None,
        metavar="HOLDOUT.npz",
        help="data for the thresholds (default: 40%% of --data, split with seed 0)",
    )
    add.add_argument(
        "--pool-grid",
        type=int,
        default=2,
        metavar="G",
        help="heads on image features average-pool to a GxG grid, 1 being global average pooling",
    )
    add.add_argument(
        "--shape",
        action="append",
        default=[],
        metavar="NAME=DIMS",
        help="fix a symbolic input dimension for the analysis (default: from --data)",
    )
    add.add_argument("--json", action="store_true", help="print the result as JSON")
    add.set_defaults(handler=_add, extra="train")  # scikit-learn fits the heads

    show = commands.add_parser(
        "show",
        help="print the exits recorded in a model",
        description="Print the early exits a model carries (from `tierflow exits add`): "
        "where each head reads, its threshold, and what calibration measured for it.",
        epilog=examples(
            "tierflow exits show model-exits.onnx",
            "tierflow exits show model-exits.onnx --json",
        ),
        formatter_class=HelpFormatter,
    )
    show.add_argument("model", metavar="MODEL.onnx", help="a model with exits")
    show.add_argument("--json", action="store_true", help="print the exits as JSON")
    show.set_defaults(handler=_show)


def _add(args: argparse.Namespace) -> int:
    from tierflow.partitioner.exits.add import add_exits
    from tierflow.partitioner.shapes import parse_shape_option

    shapes = dict(parse_shape_option(text) for text in args.shape) or None
    result = add_exits(
        args.model,
        args.data,
        exits=args.exits,
        at=args.at,
        declare=args.declare_exit,
        max_disagreement=None
        if args.max_disagreement is None
        else parse_fraction(args.max_disagreement),
        max_accuracy_drop=None
        if args.max_accuracy_drop is None
        else parse_fraction(args.max_accuracy_drop),
        holdout=args.holdout,
        pool_grid=args.pool_grid,
        shapes=shapes,
    )
    path = result.save(args.output)
    if args.json:
        record = {
            "model": str(path),
            "exits": [e.to_dict() for e in result.exits],
            "summary": result.summary,
        }
        print(json.dumps(record, indent=2))
    else:
        print(result.table())
        print(f"wrote {path}")
    return 0


def _show(args: argparse.Namespace) -> int:
    from tierflow.partitioner.exits.metadata import exits_table, read_exit_summary, read_exits

    exits = read_exits(args.model)
    summary = read_exit_summary(args.model)
    if args.json:
        print(json.dumps({"exits": [e.to_dict() for e in exits], "summary": summary}, indent=2))
    elif not exits:
        print(f"{args.model} has no exits")
    else:
        print(exits_table(exits, summary))
    return 0
