"""Decoders as both torch exporters write them (one file, or weights in .onnx.data) plan alike."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tierflow.cli.main import main
from tierflow.greedy import Generation, greedy_generate, reference_generate
from tierflow.onnxrt.inference import open_session
from tierflow.plan import load_plan

LENGTHS = ["--context", "128", "--prompt-tokens", "8", "--max-tokens", "8"]


def _generate(plan_dir: Path, prompt: list[int], level: str) -> Generation:
    """12 greedy tokens through the plan's segment files, each cache fed back."""
    plan = load_plan(plan_dir)
    assert plan.decoder is not None
    sessions = [
        (s, open_session(plan_dir / s.file, threads=1, optimization=level)) for s in plan.segments
    ]

    def step(feeds: Any) -> dict[str, Any]:
        available, made = dict(feeds), {}
        for spec, session in sessions:
            names = [o.name for o in session.get_outputs()]
            values = session.run(names, {n: available[n] for n in spec.inputs})
            made.update(zip(names, values, strict=True))
            available.update({n: made[n] for n in spec.sent_outputs})
        return made

    return greedy_generate(step, plan.decoder, plan.states, prompt, 12)


@pytest.mark.integration
@pytest.mark.parametrize(("exporter", "external"), [("dynamo", True), ("legacy", False)])
def test_plan_a_torch_exported_decoder(
    tmp_path: Path, capsys: Any, exporter: str, external: bool
) -> None:
    import torch

    from tierflow.zoo.bytelm import ByteLMConfig, export_onnx, make_model

    torch.manual_seed(3)
    model = make_model(ByteLMConfig("tiny", blocks=3, width=16, heads=2))
    path = export_onnx(model, tmp_path / "model.onnx", exporter=exporter, external_data=external)
    assert (tmp_path / "model.onnx.data").exists() == external
    plan_dir = tmp_path / "plan"
    budgets = [f"--memory={tier}=64KiB" for tier in ("device", "edge", "cloud")]
    code = main(["plan", str(path), "-o", str(plan_dir), *LENGTHS, *budgets])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "bit for bit over 8 greedy steps" in out
    plan = load_plan(plan_dir)
    assert len(plan.state_pairs) == 6 and plan.decoder is not None
    assert len(plan.segments) >= 2  # no tier holds all three blocks' caches at 128 tokens
    prompt = list(b"def main():")
    # Bit for bit where ONNX Runtime fuses nothing across a cut ("basic" and below; at
    # "extended" a LayerNorm or Gelu fusion that a cut breaks may move the last bits).
    split = _generate(plan_dir, prompt, "basic")
    whole = reference_generate(path, prompt, 12, context=128, optimization="basic")
    assert split.tokens == whole.tokens
    assert [a.tobytes() for a in split.logits] == [b.tobytes() for b in whole.logits]
    # A plan of one segment runs as the model does at "extended" too: its segment declares
    # no inner shapes the model does not, so ONNX Runtime fuses its nodes alike.
    assert main(["plan", str(path), "-o", str(tmp_path / "one"), *LENGTHS]) == 0
    assert len(load_plan(tmp_path / "one").segments) == 1
    alone = _generate(tmp_path / "one", prompt, "extended")
    whole = reference_generate(path, prompt, 12, context=128, optimization="extended")
    assert [a.tobytes() for a in alone.logits] == [b.tobytes() for b in whole.logits]
