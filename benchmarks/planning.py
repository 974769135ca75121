"""Planning benchmark: how long profiling and planning take, and how right the cost model is.

For each model (built in code from the zoo, full size) it reports

* the time ``profile_model`` takes on this machine (target: under 30 s for ResNet-18),
* the time to plan from existing profiles: cost tables plus the exhaustive search
  (target: under 1 s),
* for a few link settings, the cost model's predicted end-to-end latency of the chosen
  plan against the latency measured by running the chosen segments back to back in this
  process (target: within 15 %), and the planner's regret: how much slower the chosen
  plan measured than the fastest of the candidates measured (the top plans and the
  single-tier baselines).

See [Note: emulated run]. Usage::

    python -m benchmarks.planning [--models resnet18,mobilenet_v2,chain_cnn]

It prints an aligned table and writes ``benchmarks/results/planning.json``.

[Note: emulated run]
The three tiers are emulated on this machine exactly as ``tierflow plan`` emulates tiers
it has no profile for: each runs its segment in its own ONNX Runtime session with one
intra-op thread, and a tier ``slowdown`` times slower sleeps ``(slowdown - 1)`` times the
time it measured; its encoding and decoding are real (the chosen codec, on the real
features) and slowed the same way. A link sleeps ``bytes * 8 / rate + RTT / 2`` for the
encoded features going up, and once more for the model outputs coming back. The
measured latency is the wall time from the input on the device to the answer back there,
read over the runs as the profile reads its runs (the lower quartile, see
``profile.typical_s``: this machine is shared, and other people's work only ever adds);
the median is reported beside it.

Because the machine is shared, its speed drifts between profiling and measuring; the
"load-adjusted" error separates that drift from the cost model's own error. Before every
run the whole model is timed once (one thread) as a speed reference, and the prediction's
compute and codec parts are rescaled by that reference over the whole model's time by the
profile (wire time, RTT and the reply are sleeps and are not rescaled)
(:func:`load_adjusted`). Both errors are reported.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import lib
from tierflow.cli.table import format_table
from tierflow.codec import base as codec_lib
from tierflow.link.spec import LINKS, TIERS, LinkSpec
from tierflow.partitioner.candidates import codec_candidates
from tierflow.partitioner.cost import Estimate, Problem, build_tables
from tierflow.partitioner.graph import ModelGraph, load_model
from tierflow.partitioner.profile import (
    Profile,
    make_session,
    profile_model,
    run_session,
    typical_s,
)
from tierflow.partitioner.search import search
from tierflow.partitioner.split import extract_segment, split_model
from tierflow.partitioner.tier_profiles import DEFAULT_EMULATION

RESULTS = lib.RESULTS / "planning.json"

SCENARIOS: dict[str, dict[str, str]] = {
    "wifi": {"device-edge": "20mbit,10ms", "edge-cloud": "200mbit,30ms"},
    "slow-uplink": {"device-edge": "2mbit,20ms", "edge-cloud": "100mbit,30ms"},
    "fast-lan": {"device-edge": "500mbit,2ms", "edge-cloud": "1gbit,5ms"},
}


def _builders() -> dict[str, Callable[[], Any]]:
    from tierflow.zoo import models

    return {
        "resnet18": lambda: models.resnet18(size=224),
        "mobilenet_v2": lambda: models.mobilenet_v2(size=224),
        "chain_cnn": lambda: models.chain_cnn(size=128),
    }


def _sleep(seconds: float) -> None:
    if seconds > 0:
        time.sleep(seconds)


@dataclass
class EmulatedRun:
    """Runs plans of one model back to back on this machine; see [Note: emulated run]."""

    graph: ModelGraph
    profiles: Mapping[str, Profile]
    links: Mapping[str, LinkSpec]

    def __post_init__(self) -> None:
        self._segments: dict[tuple[int, int], list[tuple[str, Any]]] = {}
        self.inputs = self.graph.representative_inputs()
        self.reply_bytes = sum(o.nbytes for o in self.graph.outputs)
        whole = extract_segment(self.graph, 0, len(self.graph.cuts) - 1)
        self._reference = make_session(whole, 1)

    def reference_s(self) -> float:
        """One run of the whole model here, 1 thread: how fast this machine is right now."""
        start = time.perf_counter()
        run_session(self._reference, self.inputs)
        return time.perf_counter() - start

    def _sessions(self, cuts: tuple[int, int]) -> list[tuple[str, Any]]:
        if cuts not in self._segments:
            self._segments[cuts] = [
                (spec.tier, make_session(model, self.profiles[spec.tier].machine.threads))
                for spec, model in split_model(self.graph, cuts)
            ]
        return self._segments[cuts]

    def _cross(self, name: str, codec: str, arrays: dict[str, np.ndarray]) -> dict[str, Any]:
        sender, receiver = (self.profiles[t].slowdown for t in LINK_TIERS[name])
        start = time.perf_counter()
        encoded = [codec_lib.encode(k, v, codec) for k, v in arrays.items()]
        _sleep((sender - 1) * (time.perf_counter() - start))
        _sleep(self.links[name].transfer_s(sum(t.nbytes for t in encoded)))
        start = time.perf_counter()
        decoded = {t.name: codec_lib.decode(t) for t in encoded}
        _sleep((receiver - 1) * (time.perf_counter() - start))
        return decoded

    def once(self, plan: Estimate) -> float:
        """Wall seconds of one request through ``plan``."""
        a, b = plan.cuts
        sessions = dict(self._sessions(plan.cuts))
        crossing = {"device-edge": a, "edge-cloud": b}
        entering = {"edge": "device-edge", "cloud": "edge-cloud"}
        features: dict[str, Any] = dict(self.inputs)
        start = time.perf_counter()
        for tier in TIERS:
            link = entering.get(tier)
            if link is not None and plan.links[link].used:
                names = self.graph.cuts[crossing[link]].tensors
                features = self._cross(
                    link, plan.links[link].codec, {n: features[n] for n in names}
                )
            if tier in sessions:
                began = time.perf_counter()
                features.update(run_session(sessions[tier], features))
                _sleep((self.profiles[tier].slowdown - 1) * (time.perf_counter() - began))
        for name in LINKS:
            if plan.links[name].used:
                _sleep(self.links[name].transfer_s(self.reply_bytes))
        return time.perf_counter() - start

    def measure_all(
        self, plans: Mapping[tuple[Any, ...], Estimate], repeats: int
    ) -> dict[tuple[Any, ...], list[tuple[float, float]]]:
        """Per plan, each run's wall seconds and the reference time taken just before it.

        Runs are interleaved over the plans so that drifts in load hit all alike.
        """
        times: dict[tuple[Any, ...], list[tuple[float, float]]] = {key: [] for key in plans}
        for plan in plans.values():
            self.once(plan)  # warm-up: sessions built, caches filled
        for _ in range(repeats):
            for key, plan in plans.items():
                reference = self.reference_s()
                times[key].append((self.once(plan), reference))
        return times


def load_adjusted(plan: Estimate, reference_now: float, reference_profiled: float) -> float:
    """The prediction rescaled to this machine's speed at the moment of a run.

    Compute and codec time scale with the machine's speed; wire time, RTT and the reply
    are sleeps and do not. On a shared machine this separates the cost model's error
    from the drift of the machine's load between profiling and measuring.
    """
    links = plan.links.values()
    scalable = sum(plan.compute_s.values()) + sum(c.encode_s + c.decode_s for c in links)
    fixed = sum(c.wire_s + c.propagation_s + c.reply_s for c in links)
    return fixed + scalable * reference_now / reference_profiled


LINK_TIERS = {"device-edge": ("device", "edge"), "edge-cloud": ("edge", "cloud")}


def _describe(plan: Estimate) -> str:
    a, b = plan.cuts
    codecs = ",".join(f"{n.split('-')[1][0]}:{c}" for n, c in plan.codec.items())
    return f"{'+'.join(t[0].upper() for t in plan.tiers)} ({a},{b}) {codecs}".strip()


def bench_model(name: str, workdir: Path, repeats: int) -> dict[str, Any]:
    from tierflow.zoo import models

    module, example = _builders()[name]()
    path = models.export_onnx(module, example, workdir / f"{name}.onnx", dynamo=False)
    started = time.perf_counter()
    graph = load_model(path)
    load_s = time.perf_counter() - started
    started = time.perf_counter()
    base = profile_model(graph, threads=1)
    profile_s = time.perf_counter() - started
    profiles = {t: base.emulate(DEFAULT_EMULATION[t]) for t in TIERS}
    # The whole model's time on this machine by the profile: what the reference runs
    # taken during the measurements are compared with.
    reference = base.segment_s(0, len(base.units))
    print(
        f"{name}: {len(graph.cuts)} cuts, loaded in {load_s:.1f} s, profiled in {profile_s:.1f} s",
        file=sys.stderr,
    )

    scenarios: dict[str, Any] = {}
    plan_times: list[float] = []
    for scenario, texts in SCENARIOS.items():
        links = {k: LinkSpec.parse(v) for k, v in texts.items()}
        problem = Problem(profiles, links, codecs=codec_candidates("auto"))
        for _ in range(3):
            began = time.perf_counter()
            result = search(problem, tables=build_tables(problem))
            plan_times.append(time.perf_counter() - began)
        runner = EmulatedRun(graph, profiles, links)
        candidates: dict[tuple[Any, ...], Estimate] = {}
        for plan in (*result.ranked, *result.baselines.values()):
            candidates.setdefault((plan.cuts, tuple(sorted(plan.codec.items()))), plan)
        runs = runner.measure_all(candidates, repeats)
        measured = {key: typical_s([w for w, _ in values]) for key, values in runs.items()}
        medians = {key: statistics.median(w for w, _ in values) for key, values in runs.items()}
        adjusted = {
            key: statistics.median(
                load_adjusted(candidates[key], ref, reference) / wall - 1 for wall, ref in values
            )
            for key, values in runs.items()
        }
        best = result.best
        chosen_key = (best.cuts, tuple(sorted(best.codec.items())))
        chosen = measured[chosen_key]
        fastest = min(measured.values())
        scenarios[scenario] = {
            "links": texts,
            "chosen": _describe(best),
            "cuts": list(best.cuts),
            "codec": best.codec,
            "predicted_s": best.latency_s,
            "measured_s": chosen,
            "measured_median_s": medians[chosen_key],
            "error": (best.latency_s - chosen) / chosen,
            "error_vs_median": (best.latency_s - medians[chosen_key]) / medians[chosen_key],
            "load_adjusted_error": adjusted[chosen_key],
            "regret": chosen / fastest - 1.0,
            "candidates": [
                {
                    "plan": _describe(candidates[k]),
                    "predicted_s": candidates[k].latency_s,
                    "measured_s": v,
                    "measured_median_s": medians[k],
                    "runs_s": [w for w, _ in runs[k]],
                    "reference_s": [r for _, r in runs[k]],
                    "error": (candidates[k].latency_s - v) / v,
                    "load_adjusted_error": adjusted[k],
                }
                for k, v in measured.items()
            ],
        }
        print(
            f"  {scenario}: {_describe(best)} predicted {best.latency_s * 1e3:.1f} ms, "
            f"measured {chosen * 1e3:.1f} ms",
            file=sys.stderr,
        )
    return {
        "model": name,
        "cuts": len(graph.cuts),
        "load_s": load_s,
        "profile_s": profile_s,
        "plan_s": statistics.median(plan_times),
        "emulation": dict(DEFAULT_EMULATION),
        "calibration": dict(base.calibration),
        "scenarios": scenarios,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="resnet18,mobilenet_v2,chain_cnn")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per plan")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    unknown = [n for n in names if n not in _builders()]
    if unknown:
        parser.error(f"unknown models {unknown}: expected some of {', '.join(_builders())}")
    with tempfile.TemporaryDirectory() as tmp:
        results = [bench_model(name, Path(tmp), args.repeats) for name in names]

    rows = []
    for r in results:
        for scenario, s in r["scenarios"].items():
            rows.append(
                [
                    r["model"],
                    scenario,
                    f"{r['profile_s']:.1f}",
                    f"{r['plan_s'] * 1e3:.0f}",
                    s["chosen"],
                    f"{s['predicted_s'] * 1e3:.1f}",
                    f"{s['measured_s'] * 1e3:.1f}",
                    f"{s['error'] * 100:+.1f}%",
                    f"{s['load_adjusted_error'] * 100:+.1f}%",
                    f"{s['regret'] * 100:.1f}%",
                ]
            )
    print(
        format_table(
            [
                "model",
                "links",
                "profile s",
                "plan ms",
                "chosen plan",
                "predicted ms",
                "measured ms",
                "error",
                "load-adj. error",
                "regret",
            ],
            rows,
        )
    )
    errors = [abs(s["error"]) for r in results for s in r["scenarios"].values()]
    all_errors = [
        abs(c["error"]) for r in results for s in r["scenarios"].values() for c in s["candidates"]
    ]
    adjusted = [abs(s["load_adjusted_error"]) for r in results for s in r["scenarios"].values()]
    all_adjusted = [
        abs(c["load_adjusted_error"])
        for r in results
        for s in r["scenarios"].values()
        for c in s["candidates"]
    ]
    summary = {
        "max_abs_error_chosen": max(errors),
        "median_abs_error_candidates": statistics.median(all_errors),
        "max_abs_load_adjusted_error_chosen": max(adjusted),
        "median_abs_load_adjusted_error_candidates": statistics.median(all_adjusted),
        "max_profile_s": max(r["profile_s"] for r in results),
        "max_plan_s": max(r["plan_s"] for r in results),
    }
    print(
        f"\nchosen plans: worst |error| {summary['max_abs_error_chosen'] * 100:.1f}% "
        f"(target 15%); all candidates: median |error| "
        f"{summary['median_abs_error_candidates'] * 100:.1f}%\n"
        f"load-adjusted: chosen plans worst |error| "
        f"{summary['max_abs_load_adjusted_error_chosen'] * 100:.1f}%, all candidates median "
        f"{summary['median_abs_load_adjusted_error_candidates'] * 100:.1f}%\nslowest profile "
        f"{summary['max_profile_s']:.1f} s (target 30 s); slowest planning "
        f"{summary['max_plan_s'] * 1e3:.0f} ms (target 1000 ms)"
    )
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"summary": summary, "models": results}, indent=2) + "\n")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
