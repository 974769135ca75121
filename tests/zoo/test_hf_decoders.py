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
