"""The planner's low-bit and lossless-stage codecs on a trained model, served by the tiers.

The demo's digit classifier (trained once per run by the ``demo_build`` fixture: random
weights say nothing about fidelity). The device is emulated 50 times slower than this
machine and both links are 1 Mbit/s, so sending the input, or features, in few bytes is
what the planner wants; a budget lets ``int4``/``int2`` in, and the answers on held-out
requests the planner never saw are checked through the tiers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tierflow.codec import EXACT_PLANNER_CODECS, PLANNER_CODECS, CodecSpec
from tierflow.device.client import DeviceClient
from tierflow.links import LinkSpec
from tierflow.partitioner.codec_pruning import CutTraits
from tierflow.partitioner.cost import Problem, build_tables, estimate
from tierflow.partitioner.fidelity import FidelityBudget
from tierflow.partitioner.fidelity_probe import FidelityProbe, sample_requests
from tierflow.partitioner.graph import load_model
from tierflow.partitioner.planner import PlanOptions, make_plan, rank, write_plan
from tierflow.partitioner.profile import capture_features, profile_model
from tierflow.sessions import open_session

SLOW = {"device-edge": LinkSpec.parse("1mbit,5ms"), "edge-cloud": LinkSpec.parse("1mbit,5ms")}
FAST = {"device-edge": LinkSpec.parse("1gbit,1ms"), "edge-cloud": LinkSpec.parse("1gbit,1ms")}
BUDGET = FidelityBudget.parse("top1=97%")


@pytest.fixture(scope="module")
def digits(demo_build: Any) -> dict[str, Any]:
    demo, _ = demo_build
    graph = load_model(demo.model_path)
    base = profile_model(graph, time_budget_s=0.5, codecs=PLANNER_CODECS)
    profiles = {"device": base.emulate(50.0), "edge": base.emulate(2.0), "cloud": base}
    calib = np.load(demo.calib_path)["image"][:200]
    heldout = np.load(demo.heldout_path)["image"]
    return {
        "path": demo.model_path,
        "graph": graph,
        "profiles": profiles,
        "calib": calib,
        "heldout": heldout,
    }


def _serve(rt: Any, plan_dir: Path, images: np.ndarray) -> list[np.ndarray]:
    requests = [{"image": image} for image in images]
    with rt.tiers(plan_dir) as (edge, _, _), DeviceClient(plan_dir, edge, window=8) as device:
        return [r.unwrap().outputs["logits"] for r in device.run_stream(requests)]


def _reference(path: Path, images: np.ndarray) -> list[np.ndarray]:
    """The unsplit model at the tiers' optimisation level and thread count."""
    session = open_session(path)
    return [session.run(["logits"], {"image": image})[0] for image in images]


def test_a_budget_plan_picks_a_low_bit_codec_on_a_slow_link_and_holds_on_held_out_requests(
    digits: dict[str, Any], tmp_path: Path, rt: Any
) -> None:
    options = PlanOptions(links=SLOW, fidelity=BUDGET)
    sample = {"image": digits["calib"]}
    outcome = make_plan(digits["graph"], digits["profiles"], options, tmp_path / "p", sample=sample)
    used = [c for c in outcome.plan.codec.values() if CodecSpec.parse(c).quant in ("int4", "int2")]
    assert used, f"expected a 4- or 2-bit codec on a 1 Mbit/s link, got {outcome.plan.codec}"
    assert outcome.fidelity is not None and outcome.fidelity.value >= BUDGET.value
    held_out = digits["heldout"]
    served = _serve(rt, tmp_path / "p", held_out)
    reference = _reference(digits["path"], held_out)
    agree = sum(int(a.argmax() == b.argmax()) for a, b in zip(reference, served, strict=True))
    assert agree >= BUDGET.value * len(held_out), f"{agree} of {len(held_out)} agree"
    # With a fast link the bytes saved are not worth the encoding: no low bits then.
    probe = FidelityProbe(digits["graph"], sample_requests(digits["graph"].inputs, sample))
    fast, _ = rank(
        digits["graph"], digits["profiles"], PlanOptions(links=FAST, fidelity=BUDGET), probe=probe
    )
    assert all(CodecSpec.parse(c).quant not in ("int4", "int2") for c in fast.best.codec.values())


@pytest.mark.parametrize("codec", ["sparse+zstd", "drop+sparse+zstd", "sparse+shuffle+zstd"])
def test_lossless_stages_reproduce_the_model_bit_for_bit_through_the_tiers(
    digits: dict[str, Any], tmp_path: Path, rt: Any, codec: str
) -> None:
    graph = digits["graph"]
    assert codec in EXACT_PLANNER_CODECS
    features = capture_features(graph)
    inner = range(1, len(graph.cuts) - 1)
    traits = {i: CutTraits.of([features[t] for t in graph.cuts[i].tensors]) for i in inner}
    # A post-ReLU cut where a channel is constant, so both stages have work to do.
    cut = max(inner, key=lambda i: (traits[i].constant_channel, traits[i].zero_share))
    assert traits[cut].constant_channel and traits[cut].zero_share > 0.25
    problem = Problem(profiles=digits["profiles"], links=SLOW, codecs=(codec,))
    last = len(graph.cuts) - 1
    chosen = estimate(build_tables(problem), cut, last, {"device-edge": codec, "edge-cloud": codec})
    options = PlanOptions(links=SLOW, codec=codec)
    written = write_plan(graph, digits["profiles"], options, chosen, tmp_path / "p")
    assert written.plan.codec["device-edge"] == codec
    images = digits["heldout"][:8]
    served = _serve(rt, tmp_path / "p", images)
    for expected, got in zip(_reference(digits["path"], images), served, strict=True):
        assert got.dtype == expected.dtype and got.tobytes() == expected.tobytes()
