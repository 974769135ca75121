"""The overheads and limits section: transport, pipelining, codecs, the cost model.

Each figure comes from the module that owns it, called here rather than copied:
``benchmarks.transport`` (overhead per hop, pipelined throughput against the slowest stage),
``benchmarks.codec_speed`` (ratio and speed per scheme on its feature set), and this run's own
measurements (codecs on the benchmark models' real cut features; the cost model's error
on every strategy's plan). ``benchmarks.planning`` profiles full-size models with sleeping
emulation, which takes minutes, so its last saved results are summarised when present.
A part that cannot run says so instead of showing numbers.
"""

from __future__ import annotations

import json
import logging
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.lib import RESULTS
from benchmarks.lib.report import load_words
from tierflow.codec.base import PLANNER_CODECS

logger = logging.getLogger(__name__)


def transport(quick: bool) -> tuple[list[str], dict[str, Any]]:
    """Overhead per hop (100 KB and 1 MB features) and pipelined throughput.

    A quick run's 30 requests in one round say little on a shared machine, so it shows
    ``transport.py``'s last saved run (``results/transport.json``) when there is one.
    """
    out = ["### Transport overhead per hop and pipelined throughput\n"]
    saved = RESULTS / "transport.json"
    if quick and saved.is_file():
        last = json.loads(saved.read_text())
        load = load_words(last.get("machine", {}).get("load_average"))
        out.append(
            "Not measured in this run (a `--quick` run or a refold): these are the last saved "
            "figures of "
            f"`{last.get('command', 'python -m benchmarks.transport')}` "
            f"(`transport.json`, {last.get('date', 'undated')}, {load}).\n"
        )
        out += _transport_lines(last)
        for row in last.get("against", {}).get("rows", []):
            low, _, high = row["other_over_this_quartiles"]
            out.append(
                f"- {row['feature']}, side by side with the servers of "
                f"{last['against']['label'] or row['other_python']}: "
                f"{row['other_overhead_per_hop_ms_p50']:.3f} ms per hop there, "
                f"{row['this_overhead_per_hop_ms_p50']:.3f} ms here; there / here "
                f"{row['other_over_this_p50']:.3f} (median of {row['rounds']} interleaved "
                f"rounds; quartiles {low:.3f}–{high:.3f})"
            )
        return [*out, ""], last
    try:
        from benchmarks import transport as transport_bench
    except ImportError as exc:
        out.append(f"Not measured: `benchmarks.transport` cannot be imported ({exc}).\n")
        return out, {"error": str(exc)}
    count = 30 if quick else 150
    figures: dict[str, Any] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="tierflow-transport-") as folder:
            work = Path(folder)
            figures["overhead"] = [
                transport_bench.overhead(name, size, count, work, rounds=1 if quick else 3)
                for name, size in transport_bench.SIZES.items()
            ]
            figures["throughput"] = transport_bench.throughput(60 if quick else 300, work)
    except Exception as exc:  # a benchmark part failing must not sink the whole report
        logger.exception("[bench] transport benchmark failed")
        out.append(f"Not measured: `benchmarks.transport` failed ({type(exc).__name__}: {exc}).\n")
        return out, {"error": repr(exc)}
    try:
        out += _transport_lines(figures)
    except (KeyError, TypeError, ValueError) as exc:  # transport_bench changed its fields
        out.append(
            f"Measured, but not tabulated here (unexpected field {exc}); the figures "
            "are in `results_meta.json` under `overheads.transport`.\n"
        )
    return out, figures


def _transport_lines(figures: dict[str, Any]) -> list[str]:
    out = [
        "From `benchmarks.transport.overhead` / `.throughput` (real `tierflow serve` processes on "
        "127.0.0.1, unshaped links, raw codec). Overhead per hop = (end-to-end − every "
        "tier's compute and codec) / 2, beside a bare gRPC round trip with the same payload, "
        "the same chain in bare gRPC (a relay process, per hop), tierflow's device and cloud "
        "alone with that relay in the edge's place (ends alone, against the relay chain) "
        "and, as the machine's floor, a bare TCP round trip to another process.\n",
        "| feature | requests | end-to-end p50 ms | work p50 ms | overhead per hop p50 ms "
        "| bare gRPC relay per hop ms | tierflow / relay (quartiles) | ends alone / relay | "
        "mTLS adds ms | metrics add ms | bare gRPC round trip ms | bare TCP round trip ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in figures["overhead"]:
        low, _, high = row["vs_relay_quartiles"]
        ends = row.get("ends_vs_relay_p50")  # runs before the ends chain lack it
        out.append(
            f"| {row['feature']} | {row['requests']} | {row['total_ms_p50']:.2f} | "
            f"{row['work_ms_p50']:.2f} | {row['overhead_per_hop_ms_p50']:.2f} | "
            f"{row['grpc_relay_per_hop_ms_p50']:.2f} | {row['vs_relay_p50']:.2f}x "
            f"({low:.2f}–{high:.2f}) | {'–' if ends is None else f'{ends:.2f}x'} | "
            f"{row['tls_adds_ms_per_hop']:+.3f} | "
            f"{row['metrics_adds_ms_per_hop']:+.3f} | {row['grpc_round_trip_ms_p50']:.2f} | "
            f"{row['tcp_round_trip_ms_p50']:.2f} |"
        )
    out.append("")
    for row in figures["overhead"]:
        out.append(f"- {row['feature']}: {row['verdict']}")
    tp = figures["throughput"]
    stage_key = next(k for k in tp if k.startswith("stage_ms"))
    kind = stage_key.rsplit("_", 1)[-1]
    stages = ", ".join(f"{k} {v:.2f} ms" for k, v in tp[stage_key].items())
    out.append("")
    out.append(
        f"Pipelined throughput ({tp['requests']} requests, window {tp['window']}, "
        f"{tp['feature_bytes'] // 1000} KB features; stage {kind}s {stages}): "
        f"**{tp['achieved_req_s']:.1f} req/s** against the slowest stage's "
        f"({tp['slowest_stage']}) bound of {tp['bound_req_s']:.1f} req/s "
        f"= **{tp['ratio']:.0%}** of the bound.\n"
    )
    return out


def codecs(measured: Sequence[Any], quick: bool) -> tuple[list[str], dict[str, Any]]:
    """Codec ratio and speed per scheme: ``benchmarks.codec_speed``'s set and this run's."""
    out = ["### Codec ratio and speed per scheme\n"]
    figures: dict[str, Any] = {}
    try:
        from benchmarks import codec_speed as codec_bench

        features = codec_bench.cnn_features()
        stats = codec_bench.run({"cnn": features}, 2 if quick else 5)["cnn"]
        figures["codec_bench"] = [s.to_dict() for s in stats]
        raw = sum(a.nbytes for a in features) / 1e6
        out.append(
            f"`benchmarks.codec_speed.run` on its CNN feature set ({raw:.1f} MB of post-ReLU "
            "features; one core, wall time):\n"
        )
        out.append("| codec | ratio | encode MB/s | decode MB/s | max abs error |")
        out.append("|---|---|---|---|---|")
        for s in stats:
            out.append(
                f"| {s.codec} | {s.ratio:.2f} | {1 / s.encode_s_per_mb:,.0f} | "
                f"{1 / s.decode_s_per_mb:,.0f} | {s.max_abs_error:.3g} |"
            )
        out.append("")
    except Exception as exc:
        logger.exception("[bench] codec benchmark failed")
        out.append(f"`benchmarks.codec_speed` not measured ({type(exc).__name__}: {exc}).\n")
    # This run's real features: every measured cut of every model, every request.
    per_codec: dict[str, dict[str, list[float]]] = {
        c: {"ratio": [], "enc": [], "dec": []} for c in PLANNER_CODECS
    }
    for m in measured:
        for cut, samples in m.codecs.items():
            raw = m.raw_bytes[cut]
            if cut == 0 or raw < 4096:
                continue  # model inputs and tiny tensors say little about features
            for name, sample in samples.items():
                per_codec[name]["ratio"].append(float(np.median(raw / sample.nbytes)))
                per_codec[name]["enc"].append(float(np.median(raw / 1e6 / sample.encode_s)))
                per_codec[name]["dec"].append(float(np.median(raw / 1e6 / sample.decode_s)))
    out.append(
        "On this run's real cut features (all measured cuts ≥ 4 KiB of all models, "
        "medians over cuts of the per-request medians; CPU time):\n"
    )
    out.append("| codec | median ratio | min–max ratio | encode MB/s | decode MB/s | cuts |")
    out.append("|---|---|---|---|---|---|")
    summary: dict[str, Any] = {}
    for name, values in per_codec.items():
        if not values["ratio"]:
            continue
        summary[name] = {k: float(np.median(v)) for k, v in values.items()}
        out.append(
            f"| {name} | {np.median(values['ratio']):.2f} | {min(values['ratio']):.2f}–"
            f"{max(values['ratio']):.2f} | {np.median(values['enc']):,.0f} | "
            f"{np.median(values['dec']):,.0f} | {len(values['ratio'])} |"
        )
    out.append("")
    figures["run_features"] = summary
    return out, figures


def planning() -> tuple[list[str], dict[str, Any]]:
    """The planning benchmark's last saved results, when present."""
    path = RESULTS / "planning.json"
    out = ["### Cost model: `python -m benchmarks.planning`'s last saved run\n"]
    if not path.is_file():
        out.append(
            "Not measured: no `benchmarks/results/planning.json` (run "
            "`python -m benchmarks.planning`).\n"
        )
        return out, {}
    data = json.loads(path.read_text())
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(path.stat().st_mtime))
    summary = data.get("summary", {})
    out.append(
        f"From `{path.name}` (written {stamp}; its own emulation and scenarios, see that script):\n"
    )
    out.append(
        "| model | profile s | plan s | scenario | chosen | predicted ms | measured ms "
        "| error | regret |"
    )
    out.append("|---|---|---|---|---|---|---|---|---|")
    for model in data.get("models", []):
        for name, sc in model.get("scenarios", {}).items():
            out.append(
                f"| {model['model']} | {model['profile_s']:.1f} | {model['plan_s']:.4f} | "
                f"{name} | {sc['chosen']} | {sc['predicted_s'] * 1e3:.1f} | "
                f"{sc['measured_s'] * 1e3:.1f} | {sc['error']:+.0%} | {sc['regret']:.1%} |"
            )
    if summary:
        out.append("")
        out.append(
            f"Summary: worst |error| of a chosen plan "
            f"{summary.get('max_abs_error_chosen', float('nan')):.0%}, median |error| "
            f"over candidates {summary.get('median_abs_error_candidates', float('nan')):.0%}."
        )
    out.append("")
    return out, {"planning_bench": summary}
