"""Planning a decoder: both points analysed, symbolic segments, greedy bit-exactness, the CLI."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest

from tierflow.cli.main import main
from tierflow.errors import UsageError
from tierflow.greedy import greedy_generate, reference_generate
from tierflow.onnxrt.inference import open_session
from tierflow.partitioner.decoder_graph import (
    DecoderGraph,
    check_generation,
    load_decoder,
    split_decoder,
)
from tierflow.partitioner.decoder_points import DecoderSettings, analysis_points
from tierflow.partitioner.plan_writing import batching_dict
from tierflow.plan import load_plan
from tierflow.state.spec import DecoderSpec, StateSpec
from tierflow.zoo.tiny_stateful import tiny_decoder

SETTINGS = DecoderSettings(context=64, max_tokens=8, prompt_tokens=5)


@pytest.fixture(scope="module")
def decoder_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_decoder(tmp_path_factory.mktemp("decoder") / "decoder.onnx", blocks=3)


@pytest.fixture(scope="module")
def graph(decoder_path: Path) -> DecoderGraph:
    return load_decoder(decoder_path, SETTINGS)


def test_the_decoder_is_analysed_at_both_points_with_the_same_cuts(graph: DecoderGraph) -> None:
    prefill, decode = graph.points
    assert (prefill.seq, prefill.past) == (5, 0)
    assert (decode.seq, decode.past) == (1, 9)  # prompt + max_tokens / 2
    assert [c.position for c in graph.prefill.cuts] == [c.position for c in graph.decode.cuts]
    assert len(graph.states) == 6 and all(s.grows == 2 for s in graph.states)
    assert graph.decoder.vocab == 16 and graph.decoder.context == 64
    # What crosses: the hidden state and the companions, never a cache.
    assert graph.prefill.cuts[0].tensors == ("input_ids", "attention_mask", "position_ids")
    assert graph.prefill.cuts[-1].tensors == ("logits",)
    caches = {n for s in graph.states for n in (s.input, s.output)}
    for cut in graph.prefill.cuts:
        assert not caches & set(cut.tensors)
    # Hidden states are [1, T, 8] at each point: more bytes at the prefill.
    block_cut = next(c for c in graph.prefill.cuts if len(c.tensors) == 3 and c.index > 0)
    assert block_cut.nbytes > graph.decode.cuts[block_cut.index].nbytes
    # Each block's KV cache at --context 64: key and value, [1, 1, 64, 8] float32.
    assert sum(graph.state_bytes()) == 6 * 64 * 8 * 4


def test_analysis_points_tell_the_lengths_apart() -> None:
    for prompt, tokens, context in [(1, 1, 2), (7, 12, 2048), (40, 10, 44), (64, 2, 2048)]:
        prefill, decode = analysis_points(DecoderSettings(context, tokens, prompt))
        assert prefill.seq != decode.seq and prefill.past != decode.past
        assert prefill.total != decode.total
        assert decode.past <= max(context - 1, 1) + 1


def test_segments_keep_symbolic_lengths_and_own_their_blocks_caches(graph: DecoderGraph) -> None:
    # Cuts where one hidden state crosses beside the model inputs.
    inputs = {"input_ids", "attention_mask", "position_ids"}
    clean = [c.index for c in graph.prefill.cuts[1:-1] if len(set(c.tensors) - inputs) == 1]
    segments = split_decoder(graph, (clean[1], clean[-2]))
    assert [spec.tier for spec, _ in segments] == ["device", "edge", "cloud"]
    owned = [s.input for spec, _ in segments for s in spec.state]
    assert sorted(owned) == sorted(s.input for s in graph.states)
    for spec, model in segments:
        hidden = 0
        for value in model.graph.input:
            dims = [d.dim_param or d.dim_value for d in value.type.tensor_type.shape.dim]
            name = value.name
            if name in ("input_ids", "position_ids"):
                assert dims[1] == "seq"
            elif name.startswith("past_key_values"):
                assert dims[2] == "past"
            elif value.type.tensor_type.elem_type == onnx.TensorProto.FLOAT and len(dims) == 3:
                assert dims == ["batch", "seq", 8], (spec.file, name, dims)  # a hidden state
                hidden += 1
        assert hidden == (0 if spec.tier == "device" else 1)


@pytest.mark.parametrize("cuts", [(0, 0), (1, 1), (3, 9), (5, 12), (-1, -1)])
def test_a_greedy_generation_through_the_segments_is_bit_exact(
    graph: DecoderGraph, cuts: tuple[int, int]
) -> None:
    last = len(graph.prefill.cuts) - 1
    a, b = (min(c % (last + 1), last) for c in cuts)
    segments = split_decoder(graph, (a, b))
    check = check_generation(graph, segments, [3, 1, 4, 1, 5], 6)
    assert check.bitwise_equal and check.max_abs_diff == 0.0 and check.steps == 6
    assert len(check.tokens) == 6


def test_plan_writes_a_decoder_plan_that_generates_like_the_model(
    decoder_path: Path, tmp_path: Path, capsys: Any
) -> None:
    plan_dir = tmp_path / "plan"
    args = ["plan", str(decoder_path), "-o", str(plan_dir), "--context", "64", "--max-tokens",
            "8", "--prompt-tokens", "5", "--memory", "device=8KiB", "--link",
            "device-edge=20mbit,30ms"]  # fmt: skip
    code = main(args)
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "TTFT ms" in out and "ms/token" in out and "memory (KV cache)" in out
    assert "bit for bit over 8 greedy steps" in out
    plan = load_plan(plan_dir)
    assert plan.decoder is not None and plan.decoder.context == 64
    assert plan.inputs == ("input_ids", "attention_mask", "position_ids")
    assert plan.outputs == ("logits",)
    assert len(plan.state_pairs) == 6 and sorted(plan.state_pairs) == sorted(
        (s.input, s.output) for s in plan.states
    )
    estimate = plan.estimate
    assert estimate["decoder"]["ttft_s"] > 0 and estimate["decoder"]["per_token_s"] > 0
    batching = estimate["decoder"]["batching"]  # the exact default, and padding's costs
    assert "bit for bit" in batching["exact"]
    assert batching["padding"].startswith("opt-in (serve --batch-padding)")
    assert "compute" in batching["padding"] and "3e-6" in batching["padding"]
    assert estimate["memory_bytes"]["device"] <= 8 * 1024
    # The written segment files, chained with their caches fed back, generate exactly what
    # the unsplit model generates (the same ORT settings on both sides, also the
    # runtimes' default, "extended", since segments declare only their inputs' and
    # outputs' shapes, as the model does).
    for level in ("disabled", "extended"):
        _generates_like_the_model(plan_dir, decoder_path, level)


def _generates_like_the_model(plan_dir: Path, decoder_path: Path, level: str) -> None:
    plan = load_plan(plan_dir)
    assert plan.decoder is not None
    sessions = [
        (spec, open_session(plan_dir / spec.file, threads=1, optimization=level))
        for spec in plan.segments
    ]

    def step(feeds: Any) -> dict[str, np.ndarray]:
        available, made = dict(feeds), {}
        for spec, session in sessions:
            names = [o.name for o in session.get_outputs()]
            values = session.run(names, {n: available[n] for n in spec.inputs})
            made.update(zip(names, values, strict=True))
            available.update({n: made[n] for n in spec.sent_outputs})
        return made

    prompt = [2, 7, 1, 8, 2, 8]
    split = greedy_generate(step, plan.decoder, plan.states, prompt, 10)
    whole = reference_generate(decoder_path, prompt, 10, optimization=level, context=64)
    assert split.tokens == whole.tokens
    assert all(a.tobytes() == b.tobytes() for a, b in zip(split.logits, whole.logits, strict=True))


def test_decoder_plan_json_report(decoder_path: Path, tmp_path: Path, capsys: Any) -> None:
    # A context shorter than the default prompt (32) prices a prompt of the context's length.
    code = main(["plan", str(decoder_path), "-o", str(tmp_path / "p"), "--context", "16",
                 "--max-tokens", "4", "--json"])  # fmt: skip
    out, err = capsys.readouterr()
    assert code == 0, err
    report = json.loads(out)
    assert report["decoder"]["prompt_tokens"] == 16 and report["decoder"]["context"] == 16
    best = report["ranked"][0]
    assert best["generation_s"] == pytest.approx(best["ttft_s"] + 3 * best["per_token_s"])
    assert report["verified"]["bitwise_equal"] is True
    assert set(report["baselines"]) == {"device-only", "edge-only", "cloud-only"}
    # Greedy steps answer their choice (8 B); sampled ones the last position's 16 logits.
    assert report["decoder"]["sampled"] is False
    code = main(["plan", str(decoder_path), "-o", str(tmp_path / "s"), "--context", "16",
                 "--max-tokens", "4", "--json", "--sampled"])  # fmt: skip
    out, err = capsys.readouterr()
    assert code == 0, err
    sampled = json.loads(out)
    assert sampled["decoder"]["sampled"] is True
    for point in ("prefill", "step"):
        greedy_link = report["baselines"]["cloud-only"][point]["links"]["device-edge"]
        sampled_link = sampled["baselines"]["cloud-only"][point]["links"]["device-edge"]
        assert sampled_link["reply_s"] == pytest.approx(greedy_link["reply_s"] * 16 * 4 / 8)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--prompt-tokens", "100", "--context", "64"], "--prompt-tokens 100 is longer than"),
        (["--context", "0"], "--context must be a whole number >= 1"),
        (["--fidelity", "top1=99%", "--sample", "x.npz"], "does not apply to a decoder"),
        (["--shape", "input_ids=1x4"], "--shape does not apply to a decoder"),
        ([f"--memory={t}=1KiB" for t in ("device", "edge", "cloud")], "KV cache at --context"),
        (["--state", "input_ids=logits"], "state pair input_ids -> logits"),
        (["--sessions", "4"], "concurrent sessions' aggregate tokens per second: add --objective"),
        (["--objective", "throughput", "--sessions", "0"], "--sessions must be a whole number"),
    ],
)  # fmt: skip
def test_bad_decoder_options_are_one_line_errors(
    decoder_path: Path, tmp_path: Path, capsys: Any, extra: list[str], message: str
) -> None:
    code = main(["plan", str(decoder_path), "-o", str(tmp_path / "p"), *extra])
    _, err = capsys.readouterr()
    assert code == 2
    progress = ("analysing", "profiling here")
    (line,) = [line for line in err.splitlines() if not line.startswith(progress)]
    assert message in line


def test_settings_are_checked_where_they_enter() -> None:
    with pytest.raises(UsageError, match="--max-tokens must be"):
        DecoderSettings(max_tokens=0)


def test_a_decoder_without_declared_names_still_pairs_by_glob(tmp_path: Path) -> None:
    path = tiny_decoder(tmp_path / "d.onnx", blocks=2)
    model = onnx.load(str(path))
    renames = {
        f"{old}.{i}.{kind}": f"{new}{kind}{i}"
        for i in range(2)
        for kind in ("key", "value")
        for old, new in (("past_key_values", "cache_"), ("present", "next_cache_"))
    }
    for value in (*model.graph.input, *model.graph.output):
        value.name = renames.get(value.name, value.name)
    for node in model.graph.node:
        node.input[:] = [renames.get(n, n) for n in node.input]
        node.output[:] = [renames.get(n, n) for n in node.output]
    onnx.save(model, str(path))
    graph = load_decoder(path, SETTINGS, [("cache_*", "next_cache_*")])
    assert {s.input for s in graph.states} == {"cache_key0", "cache_value0", "cache_key1",
                                                "cache_value1"}  # fmt: skip


def test_a_batch_size_read_from_a_cache_does_not_tie_its_block_to_the_start(
    tmp_path: Path,
) -> None:
    path = tiny_decoder(tmp_path / "d.onnx", blocks=3, batch_from_last_cache=True)
    graph = load_decoder(path, SETTINGS)
    # Rebound to the token ids: block 2's cache spans only block 2's nodes, so cuts
    # between blocks 0 and 1 remain, and splits there generate bit for bit.
    lo, _ = graph.prefill.spans["past_key_values.2.value"]
    assert lo > len(graph.prefill.nodes) // 2
    assert any(c.position < lo for c in graph.prefill.cuts[1:])
    segments = split_decoder(graph, (2, 6))
    check = check_generation(graph, segments, [1, 2, 3], 4)
    assert check.bitwise_equal


def test_profile_refuses_a_decoder_in_one_line(
    decoder_path: Path, tmp_path: Path, capsys: Any
) -> None:
    code = main(["profile", str(decoder_path), "-o", str(tmp_path / "p.json")])
    _, err = capsys.readouterr()
    assert code == 2
    assert "is a decoder: `tierflow plan` profiles it here" in err and err.count("\n") == 1


def test_a_context_past_the_models_position_table_is_refused_at_plan_time(
    tmp_path: Path, capsys: Any
) -> None:
    """plan --context 300 on a model with 256 positions was accepted, and generation died
    at position 256 in ONNX Runtime (issue 30, item 12)."""
    from tierflow.errors import PlanError
    from tierflow.partitioner.decoder_graph import learned_positions

    path = tiny_decoder(tmp_path / "gpt2ish.onnx", blocks=2, vocab=16, positions=256)
    model = onnx.load(str(path))
    assert learned_positions(model, "position_ids") == 256
    assert (
        learned_positions(onnx.load(str(tiny_decoder(tmp_path / "r.onnx"))), "position_ids") is None
    )
    with pytest.raises(PlanError, match="has position embeddings for 256 positions"):
        load_decoder(path, DecoderSettings(context=300))
    assert load_decoder(path, DecoderSettings(context=256, max_tokens=8)).decoder.context == 256
    assert main(["plan", str(path), "-o", str(tmp_path / "plan"), "--context", "300"]) == 2
    err = capsys.readouterr().err
    (line,) = [line for line in err.splitlines() if not line.startswith("analysing")]
    assert "give --context 256 or less" in line


def test_the_decoder_table_says_which_blocks_each_tier_holds(graph: DecoderGraph) -> None:
    """Its units column (D0-3 E3-12) counted the cut search's units, not blocks."""
    from tierflow.partitioner.cost import Estimate
    from tierflow.partitioner.report import block_ranges

    blocks = graph.unit_blocks()  # the fixture's decoder has 3 blocks
    held = [b for unit in blocks for b in unit]
    assert held == [0, 1, 2]
    last = len(blocks)
    # The edge holds the units up to and including block 1's; the cloud the rest.
    cut = 1 + max(i for i, unit in enumerate(blocks) if 1 in unit)
    estimate = Estimate((0, cut), last, 0.0, 0.0, {}, {}, {}, True)
    assert block_ranges(estimate, blocks) == "D- E0-1 C2"
    assert block_ranges(Estimate((last, last), last, 0.0, 0.0, {}, {}, {}, True), blocks) == (
        "D0-2 E- C-"
    )


def test_budgets_that_cannot_hold_the_weights_are_refused_before_profiling(
    decoder_path: Path, tmp_path: Path, capsys: Any
) -> None:
    budgets = [f"--memory={t}=1KiB" for t in ("device", "edge", "cloud")]
    code = main(["plan", str(decoder_path), "-o", str(tmp_path / "p"), *budgets])
    _, err = capsys.readouterr()
    assert code == 2 and "profiling here" not in err and "Traceback" not in err
    assert "3KiB in all): the model's weights are" in err


def test_the_one_planner_plans_a_decoder_as_it_plans_any_model(
    graph: DecoderGraph, tmp_path: Path
) -> None:
    """make_plan and write_plan take a decoder with its profiles at both points: ranked by
    the decoder's own cost terms, split, checked by a greedy generation and written."""
    from tierflow.link.spec import LinkSpec
    from tierflow.partitioner.plan_options import PlanOptions
    from tierflow.partitioner.plan_writing import write_plan
    from tierflow.partitioner.planner import make_plan
    from tierflow.partitioner.tier_profiles import decoder_profiles

    profiles, notes = decoder_profiles(graph, time_budget_s=0.2)
    assert all("at the prefill point (seq 5, past 0)" in note for note in notes)
    links = {"device-edge": LinkSpec.parse("20mbit,30ms"), "edge-cloud": LinkSpec.parse("1gbit")}
    options = PlanOptions(links=links, memory={"device": 8 * 1024})
    outcome = make_plan(graph, profiles, options, tmp_path / "plan")
    best = outcome.result.best
    assert best.generation_s == pytest.approx(best.ttft_s + 7 * best.per_token_s)
    assert outcome.verified_bitwise is True and outcome.verify_inputs == 8
    assert outcome.plan.decoder == graph.decoder
    assert outcome.plan.estimate["cut_indices"] == list(best.cuts)
    assert outcome.plan.estimate["verified"]["steps"] == 8
    # No lossy crossing ([Note: fidelity search]): the plan records itself exact.
    assert outcome.plan.fidelity is not None and outcome.plan.fidelity["metric"] == "exact"
    cloud = write_plan(graph, profiles, options, outcome.result.baselines["cloud-only"],
                       tmp_path / "cloud")  # fmt: skip
    assert [s.tier for s in cloud.plan.segments] == ["cloud"]
    sample = {"input_ids": np.zeros((1, 1, 5), dtype=np.int64)}
    with pytest.raises(UsageError, match="--sample does not apply to a decoder"):
        make_plan(graph, profiles, options, tmp_path / "x", sample=sample)


def test_sessions_profile_the_decode_step_at_several_batch_sizes(decoder_path: Path) -> None:
    """Each batch size is analysed and measured at its own shapes, not scaled from batch 1."""
    from tierflow.partitioner.tier_profiles import decoder_profiles

    graph = load_decoder(decoder_path, dataclasses.replace(SETTINGS, sessions=3))
    profiles, notes = decoder_profiles(graph, time_budget_s=0.2)
    assert sorted(profiles.batched) == [2, 4]  # 1, 2, 4: up to a power of two >= 3
    assert "decode step profiled here at batch 1, 2, 4 for 3 sessions" in notes[-1]
    one = profiles.decode["cloud"]
    for batch, tiers in profiles.batched.items():
        measured = tiers["cloud"]
        # The ids, mask and positions of `batch` sequences cross cut 0, their logits the last.
        assert measured.cuts[0].nbytes == batch * one.cuts[0].nbytes
        assert measured.cuts[-1].nbytes == batch * one.cuts[-1].nbytes
        assert measured.calibration["profile_s"] > 0
        timed = zip(
            [u.compute_s for u in one.units], [u.compute_s for u in measured.units], strict=True
        )
        ratios = {round(b / a, 9) for a, b in timed if a > 0 and b > 0}
        assert len(ratios) > 1  # timed unit by unit, no one factor
    step_s = profiles.step_s_by_batch()
    assert sorted(step_s) == [1, 2, 4] and all(s > 0 for s in step_s.values())


def test_a_plan_says_batch_padding_does_not_apply_where_the_decoder_has_nothing_to_pad() -> None:
    """No attention mask to pad, or a state that is not a KV cache (a recurrent state):
    ``--batch-padding`` changes nothing there, and plan.json says so."""
    cache = StateSpec("past", "present", "float32", (None, 2, None, 4), grows=2)
    recurrent = StateSpec("h", "h_out", "float32", (None, 8))
    masked = DecoderSpec("input_ids", "logits", "attention_mask", None, 32, 64, 8)
    unmasked = dataclasses.replace(masked, attention_mask=None)
    assert batching_dict(masked, [cache])["padding"].startswith("opt-in")
    assert batching_dict(unmasked, [cache])["padding"] == (
        "does not apply: the decoder has no attention mask to pad"
    )
    assert batching_dict(masked, [cache, recurrent])["padding"] == (
        "does not apply: a state of the decoder is not a KV cache"
    )


def test_plan_for_sessions_reports_their_aggregate_tokens_per_second(
    decoder_path: Path, tmp_path: Path, capsys: Any
) -> None:
    plan_dir = tmp_path / "plan"
    code = main(["plan", str(decoder_path), "-o", str(plan_dir), "--context", "64",
                 "--max-tokens", "8", "--prompt-tokens", "5", "--objective", "throughput",
                 "--sessions", "4"])  # fmt: skip
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "plans scored for the tokens per second of 4 sessions" in out
    assert "ms/token x4" in out and "all tok/s" in out
    (line,) = [line for line in out.splitlines() if line.startswith("with 4 sessions batched")]
    assert "tokens/s in all" in line
    decoder = load_plan(plan_dir).estimate["decoder"]
    assert decoder["sessions"] == 4 and sorted(decoder["batch_step_s"]) == ["1", "2", "4"]
    assert decoder["aggregate_tokens_per_s"] == pytest.approx(4 / decoder["session_per_token_s"])
    assert decoder["aggregate_tokens_per_s"] > 0
    # Memory holds four sessions' caches: 6 of [1, 1, 64, 8] float32 each.
    assert sum(decoder["state_bytes"].values()) == 4 * 6 * 64 * 8 * 4


def test_sessions_of_a_decoder_that_takes_one_sequence_are_refused_before_profiling(
    tmp_path: Path, capsys: Any
) -> None:
    path = tiny_decoder(tmp_path / "d.onnx", blocks=2)
    model = onnx.load(str(path))
    for value in (*model.graph.input, *model.graph.output):
        first = value.type.tensor_type.shape.dim[0]
        if first.dim_param:
            first.dim_value = 1  # clears the symbolic batch axis
    onnx.save(model, str(path))
    args = ["--context", "64", "--objective", "throughput", "--sessions", "2"]
    assert main(["plan", str(path), "-o", str(tmp_path / "p"), *args]) == 2
    err = capsys.readouterr().err
    assert "profiling here" not in err
    (line,) = [line for line in err.splitlines() if not line.startswith("analysing")]
    assert "--sessions 2: d.onnx takes one sequence at a time" in line
