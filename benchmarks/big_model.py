"""Planning a decoder of real size: Qwen2-0.5B's shapes, 2.5 GB of weights in external data.

The benchmark builds the decoder from a ``transformers`` config with random weights and
exports it with optimum (:mod:`tierflow.zoo.hf_decoders`; the ``hf`` extra), then runs
``tierflow plan`` on it as a user would, under ``/usr/bin/time -v``, and records

* the export's and the plan's wall time and peak memory (maximum resident set size),
* the plan's peak memory over the model's weight bytes (goal: at most 2.5, [Note: weights
  stay on disk] in partitioner/weights.py) and its time (goal: 15 minutes on
  2 cores),
* the plan it chose (tiers, predicted time to first token and per token) and whether it
  verified bit for bit.

Usage::

    python -m benchmarks.big_model [--work DIR] [--context 2048]

It writes ``big_model.json`` in the results folder beside it. The export takes about 6 minutes and
5.5 GB; it is kept in ``--work`` and reused.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tierflow.zoo.hf_decoders import QWEN2_0_5B, export_decoder

RESULTS = Path(__file__).resolve().parent / "results" / "big_model.json"
BUDGETS = ("device=800MiB", "edge=1GiB", "cloud=1GiB")


def timed(argv: list[str], log: Path) -> dict[str, Any]:
    """Run ``argv`` under ``/usr/bin/time -v``; its exit status, wall time and peak memory."""
    started = time.monotonic()
    with log.open("w") as out:
        done = subprocess.run(
            ["/usr/bin/time", "-v", *argv], stdout=out, stderr=subprocess.STDOUT, check=False
        )
    text = log.read_text()
    peak = re.search(r"Maximum resident set size \(kbytes\): (\d+)", text)
    return {
        "exit_status": done.returncode,
        "wall_s": round(time.monotonic() - started, 1),
        "peak_rss_bytes": int(peak.group(1)) * 1024 if peak else None,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/tierflow-big-model"))
    parser.add_argument("--context", type=int, default=2048)
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    model = args.work / "qwen2" / "model.onnx"
    export: dict[str, Any] = {"reused": model.exists()}
    if not model.exists():
        started = time.monotonic()
        export_decoder(QWEN2_0_5B, model.parent)
        export["wall_s"] = round(time.monotonic() - started, 1)
    weights = sum(p.stat().st_size for p in model.parent.glob("model.onnx*"))
    plan_dir = args.work / "plan"
    argv = [
        sys.executable, "-m", "tierflow.cli.main", "plan", str(model), "-o", str(plan_dir),
        "--context", str(args.context), "--json",
        *(f"--memory={b}" for b in BUDGETS),
    ]  # fmt: skip
    log = args.work / "plan.log"
    run = timed(argv, log)
    result: dict[str, Any] = {
        "model": {"shape": QWEN2_0_5B.to_dict(), "parameters": QWEN2_0_5B.parameters},
        "weight_bytes": weights,
        "export": export,
        "plan": {**run, "argv": argv[2:], "budgets": list(BUDGETS)},
    }
    if run["peak_rss_bytes"]:
        result["plan"]["peak_over_weights"] = round(run["peak_rss_bytes"] / weights, 2)
    text = log.read_text()
    start = text.find("{\n")
    if run["exit_status"] == 0 and start >= 0:
        report = json.JSONDecoder().raw_decode(text[start:])[0]
        best = (report.get("ranked") or [{}])[0]
        keys = ("cuts", "codec", "ttft_s", "per_token_s", "tokens_per_s", "bytes_per_token")
        result["plan"]["chosen"] = {key: best.get(key) for key in keys}
        result["plan"]["predicted_baselines"] = {
            name: {key: e.get(key) for key in ("ttft_s", "per_token_s")}
            for name, e in (report.get("baselines") or {}).items()
        }
        result["plan"]["verified"] = report.get("verified")
        files = sorted(p.name for p in plan_dir.iterdir())
        result["plan"]["files"] = {name: (plan_dir / name).stat().st_size for name in files}
    else:
        result["plan"]["last_line"] = text.strip().splitlines()[-1] if text.strip() else ""
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["plan"], indent=2))
    return 0 if run["exit_status"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
