"""Decoders of real architectures from transformers configs, exported by optimum, plan and split."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tierflow.cli.main import main
from tierflow.greedy import Generation, greedy_generate, reference_generate
from tierflow.onnxrt.inference import open_session
from tierflow.plan import load_plan
from tierflow.zoo.hf_decoders import (
    QWEN2_0_5B,
    TOOLCHAIN_ENV,
    DecoderShape,
    ExportError,
    export_decoder,
)


def test_qwen2_0_5b_shapes_count_its_published_parameters() -> None:
    assert QWEN2_0_5B.parameters == 494_032_768  # Qwen2-0.5B's 494M
    llama = DecoderShape("llama", hidden=64, layers=2, heads=4, kv_heads=2, vocab=100)
    assert llama.parameters < DecoderShape("qwen2", 64, 2, 4, 2, 100).parameters  # no biases
    assert DecoderShape.from_dict(QWEN2_0_5B.to_dict()) == QWEN2_0_5B


def test_a_shape_that_cannot_be_built_is_refused() -> None:
    with pytest.raises(ValueError, match="arch must be one of"):
        DecoderShape("gpt2")
    with pytest.raises(ValueError, match="must divide by heads"):
        DecoderShape(hidden=60, heads=8)


def _generate(plan_dir: Path, prompt: list[int], tokens: int) -> Generation:
    """Greedy tokens through the plan's segment files, each cache fed back."""
    plan = load_plan(plan_dir)
    assert plan.decoder is not None
    sessions = [
        (s, open_session(plan_dir / s.file, threads=1, optimization="basic")) for s in plan.segments
    ]

    def step(feeds: Any) -> dict[str, Any]:
        available, made = dict(feeds), {}
        for spec, session in sessions:
            names = [o.name for o in session.get_outputs()]
            values = session.run(names, {n: available[n] for n in spec.inputs})
            made.update(zip(names, values, strict=True))
            available.update({n: made[n] for n in spec.sent_outputs})
        return made

    return greedy_generate(step, plan.decoder, plan.states, prompt, tokens)


@pytest.mark.integration
@pytest.mark.timeout(900)  # the export imports torch and transformers: minutes on a busy machine
def test_an_optimum_export_with_external_data_splits_and_generates_identically(
    tmp_path: Path, capsys: Any
) -> None:
    shape = DecoderShape("qwen2", hidden=64, layers=3, heads=4, kv_heads=2, vocab=512)
    path = export_decoder(shape, tmp_path / "qwen2", external_data=True, timeout=600)
    assert (path.parent / "model.onnx_data").stat().st_size > 4 * shape.parameters
    plan_dir = tmp_path / "plan"
    lengths = ["--context", "128", "--prompt-tokens", "8", "--max-tokens", "8"]
    budgets = [f"--memory={tier}=320KiB" for tier in ("device", "edge", "cloud")]
    code = main(["plan", str(path), "-o", str(plan_dir), *lengths, *budgets])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "bit for bit over 8 greedy steps" in out
    plan = load_plan(plan_dir)
    assert len(plan.state_pairs) == 2 * shape.layers and plan.decoder is not None
    assert len(plan.segments) >= 2
    # Each tier rebuilds the rotary tables from position_ids: no cut carries them
    # ([Note: derived tensors stay home] in partitioner/rebuild.py).
    received = [name for spec in plan.segments[1:] for name in spec.inputs]
    assert "position_ids" in received and not [n for n in received if "rotary_emb" in n]
    prompt = [5, 17, 300, 2, 9, 44]
    split = _generate(plan_dir, prompt, 12)
    whole = reference_generate(path, prompt, 12, context=128, optimization="basic")
    assert split.tokens == whole.tokens
    assert [a.tobytes() for a in split.logits] == [b.tobytes() for b in whole.logits]


@pytest.mark.integration
def test_an_export_without_the_exporter_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An empty toolchain directory: the environment's own packages, which lack optimum.
    (tmp_path / "empty").mkdir()
    monkeypatch.setenv(TOOLCHAIN_ENV, str(tmp_path / "empty"))
    with pytest.raises(ExportError, match=r"pip install 'tierflow\[hf\]'") as caught:
        export_decoder(DecoderShape(), tmp_path / "out", timeout=240)
    assert "\n" not in str(caught.value)


# ---------------------------------------------------------------- what crosses a cut
# [Note: derived tensors stay home] in partitioner/rebuild.py, [Note: shape stand-ins] in
# partitioner/stand_ins.py, [Note: a split decoder's batch axis] in decoder_points.py.

SMALL = DecoderShape("qwen2", hidden=64, layers=3, heads=4, kv_heads=2, vocab=512)
SETTINGS = {"context": 128, "max_tokens": 8, "prompt_tokens": 8}
#: A block's input: the residual stream, as optimum names it.
BLOCK_INPUT = "input_layernorm/Cast_output_0"


@pytest.fixture(scope="module")
def small_qwen2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export_decoder(SMALL, tmp_path_factory.mktemp("qwen2") / "qwen2", timeout=600)


def _split(model: Path, plan_dir: Path, where: str) -> Path:
    """Three tiers cut between blocks (``blocks``: the device embeds and runs block 0, the
    edge block 1), or at a third and two thirds of the cuts (``thirds``), as
    benchmarks/batching.py cuts."""
    from tierflow.partitioner.decoder_graph import load_decoder, split_decoder
    from tierflow.partitioner.decoder_points import DecoderSettings
    from tierflow.partitioner.split import save_split_plan

    graph = load_decoder(model, DecoderSettings(**SETTINGS))
    last = len(graph.prefill.cuts) - 1
    between = [c.index for c in graph.decode.cuts if c.tensors[-1].endswith(BLOCK_INPUT)]
    cuts = (between[1], between[2]) if where == "blocks" else (last // 3, 2 * last // 3)
    save_split_plan(
        graph.prefill, split_decoder(graph, cuts), plan_dir, cuts=cuts, decoder=graph.decoder
    )
    return plan_dir


@pytest.fixture(scope="module")
def split_plan(small_qwen2: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _split(small_qwen2, tmp_path_factory.mktemp("blocks"), "blocks")


@pytest.mark.integration
@pytest.mark.timeout(900)
def test_only_the_hidden_state_and_model_inputs_cross_an_optimum_decoders_cuts(
    small_qwen2: Path, split_plan: Path
) -> None:
    from tierflow.partitioner.decoder_graph import load_decoder
    from tierflow.partitioner.decoder_points import DecoderSettings

    graph = load_decoder(small_qwen2, DecoderSettings(**SETTINGS))
    inputs = {"input_ids", "attention_mask", "position_ids"}
    for analysed in (graph.prefill, graph.decode):
        for cut in analysed.cuts[1:-1]:
            for name in cut.tensors:
                shape = analysed.tensors[name].shape
                # No shape scalar or size vector, no causal mask, no rotary table.
                assert len(shape) >= 2 and shape[0] == 1, (cut.index, name, shape)
                assert name != "/model/Expand_output_0" and "rotary_emb" not in name, name
    # Between blocks: the hidden state and the model inputs, nothing else.
    between = [c for c in graph.decode.cuts if c.tensors[-1].endswith(BLOCK_INPUT)]
    assert len(between) == SMALL.layers
    assert all(set(c.tensors[:-1]) <= inputs for c in between)
    plan = load_plan(split_plan)
    assert [s.tier for s in plan.segments] == ["device", "edge", "cloud"]
    for spec in plan.segments[1:]:
        for name in (n for n in spec.inputs if n not in spec.state_inputs):
            assert name in inputs or plan.tensors[name].shape[0] is None, (spec.file, name)
    prompt = [5, 17, 300, 2, 9, 44, 7, 8]
    split = _generate(split_plan, prompt, 12)
    whole = reference_generate(small_qwen2, prompt, 12, context=128, optimization="basic")
    assert split.tokens == whole.tokens
    assert [a.tobytes() for a in split.logits] == [b.tobytes() for b in whole.logits]


@pytest.mark.integration
@pytest.mark.timeout(900)
def test_a_split_optimum_decoders_edge_and_cloud_batch_concurrent_sessions(
    small_qwen2: Path, tmp_path: Path
) -> None:
    import threading

    from tierflow.device.client import DeviceClient
    from tierflow.device.generation import Generator
    from tierflow.edge.forwarding import Forwarding
    from tierflow.options import RuntimeOptions
    from tierflow.runtime.server import TierServer

    # A small model's steps take well under a millisecond: --batch-delay lets the
    # sessions' steps meet on each tier ([Note: the step batcher]).
    options = RuntimeOptions(workers=8, max_batch=8, batch_delay_s=0.02)
    split_plan = _split(small_qwen2, tmp_path / "plan", "thirds")
    cloud = TierServer.from_plan("cloud", split_plan, options=options)
    cloud.start()
    edge = TierServer.from_plan(
        "edge", split_plan, forwarder=Forwarding(cloud.address), options=options
    )
    edge.start()
    prompts = [[5, 17, 300, 2, 9, 44, 7, 8], [1, 2, 3, 4, 5, 6, 7, 8], [9, 8, 7, 6, 5, 4, 3, 2]]
    prompts.append([11, 22, 33, 44, 55, 66, 77, 88])
    outputs: dict[int, Any] = {}
    try:
        with DeviceClient(split_plan, edge.address) as client:

            def generate(i: int) -> None:
                try:
                    outputs[i] = list(Generator(client).generate(prompts[i], 10).tokens)
                except Exception as exc:
                    outputs[i] = exc

            threads = [threading.Thread(target=generate, args=(i,)) for i in range(len(prompts))]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(300)
        batched = {}
        for name, server in (("edge", edge), ("cloud", cloud)):
            pipeline = server.tier.pipeline
            assert pipeline is not None
            batcher = pipeline.runner(0).batcher
            assert batcher is not None, f"the {name} of a split optimum decoder cannot batch"
            batched[name] = batcher.stats.batched
    finally:
        edge.stop(0)
        cloud.stop(0)
    for i, prompt in enumerate(prompts):
        expected = reference_generate(small_qwen2, prompt, 10, context=128).tokens
        assert outputs[i] == list(expected), f"session {i}"
    # Steps of several sessions shared calls on both tiers.
    assert batched["edge"] > 0 and batched["cloud"] > 0, batched
