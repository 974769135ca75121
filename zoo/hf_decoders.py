"""Decoders of real architectures, built from a ``transformers`` config and exported by optimum.

No trained decoder of a real architecture ships inside a package, and nothing here may
download weights, so :func:`export_decoder` builds one the way the Hugging Face hub's
models are defined (``Qwen2Config``, ``LlamaConfig``: the shapes are what matter to
planning, serving and memory) with random weights, and exports it the way users export a
hub model: optimum's ONNX exporter (``optimum-cli export onnx --task
text-generation-with-past``), giving ``model.onnx`` with ``input_ids``, ``attention_mask``,
``position_ids`` and ``past_key_values.N.key``/``.value`` in, ``logits`` and
``present.N.key``/``.value`` out ([Note: state pairs] in tierflow/state/pairs.py), and the
weights in ``model.onnx_data`` beside it once they pass 2 GB.

See [Note: the export toolchain].

[Note: the export toolchain]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
optimum's ONNX exporter (``optimum-onnx``, the last release 0.1.0) works with
``transformers`` before 4.58; the ``transformers`` the test environment already holds (5.x,
which ``sentence-transformers`` needs for tierflow.zoo.text) renamed the decoders'
``past_key_values`` argument, which the exporter passes. The two cannot share one
environment, so the export runs in a child process (``python -m tierflow.zoo.hf_decoders``)
that puts the exporter's own packages first on its path: those of the ``hf`` extra, which
scripts/test installs with ``pip install --no-deps --target .venv/hf-export`` (torch, numpy
and the rest come from the environment; ``--no-deps`` keeps a second torch out). A user
who installed ``tierflow[hf]`` in an environment of its own has no such directory and the
child uses the environment as it is. The child also bounds the export's memory to its own
lifetime: exporting a 0.5B model takes several GB that planning should not start with.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tierflow.errors import TierflowError

#: Where scripts/test installs the exporter's packages ([Note: the export toolchain]).
TOOLCHAIN_DIR = Path(sys.prefix) / "hf-export"
#: Overrides TOOLCHAIN_DIR (an empty value: use the environment as it is).
TOOLCHAIN_ENV = "TIERFLOW_HF_EXPORT_PATH"

ARCHITECTURES = ("qwen2", "llama")


class ExportError(TierflowError):
    """optimum could not export the decoder (the child's last line says why)."""


@dataclass(frozen=True)
class DecoderShape:
    """A decoder-only transformer's shapes, as a ``transformers`` config names them.

    ``intermediate`` is the MLP's width; ``tied`` shares the embedding with the output
    projection (Qwen2-0.5B does; optimum's export still writes the projection's weights
    apart unless ``accelerate`` is installed, as the hub's 0.5B exports have them).
    """

    arch: str = "qwen2"
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    vocab: int = 512
    intermediate: int = 128
    max_positions: int = 4096
    tied: bool = True

    def __post_init__(self) -> None:
        if self.arch not in ARCHITECTURES:
            raise ValueError(f"arch must be one of {ARCHITECTURES}, not {self.arch!r}")
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise ValueError(
                f"hidden {self.hidden} must divide by heads {self.heads}, "
                f"and heads by kv_heads {self.kv_heads}"
            )

    @property
    def parameters(self) -> int:
        """Parameters of the torch model (the tied projection counted once)."""
        head = self.hidden // self.heads
        kv = self.kv_heads * head
        attention = self.hidden * (self.hidden + 2 * kv) + self.hidden * self.hidden
        if self.arch == "qwen2":
            attention += self.hidden + 2 * kv  # q, k and v have biases
        block = attention + 3 * self.hidden * self.intermediate + 2 * self.hidden
        embedding = self.vocab * self.hidden
        return self.layers * block + embedding * (1 if self.tied else 2) + self.hidden

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DecoderShape:
        return cls(**data)


#: Qwen2-0.5B's shapes (494M parameters; 2.5 GB of fp32 weights as optimum exports them).
QWEN2_0_5B = DecoderShape(
    arch="qwen2",
    hidden=896,
    layers=24,
    heads=14,
    kv_heads=2,
    vocab=151936,
    intermediate=4864,
    max_positions=32768,
    tied=True,
)


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    toolchain = os.environ.get(TOOLCHAIN_ENV, str(TOOLCHAIN_DIR))
    if toolchain and Path(toolchain).is_dir():
        env["PYTHONPATH"] = os.pathsep.join(p for p in (toolchain, env.get("PYTHONPATH")) if p)
    # Nothing is fetched from the hub: the model is built from its config in the child.
    env["HF_HUB_OFFLINE"] = "1"
    env["TRANSFORMERS_OFFLINE"] = "1"
    env.setdefault("TRANSFORMERS_VERBOSITY", "error")
    return env


def export_decoder(
    shape: DecoderShape,
    out_dir: Path,
    *,
    with_past: bool = True,
    external_data: bool = False,
    seed: int = 0,
    timeout: float | None = None,
) -> Path:
    """Build a decoder of ``shape`` with random weights and export it with optimum.

    Returns ``out_dir/model.onnx``. ``with_past`` exports the KV cache as state pairs
    (``text-generation-with-past``), else the decoder reruns the whole sequence each step
    (``text-generation``). ``external_data`` keeps the weights in ``model.onnx_data`` even
    when they are under 2 GB (optimum's name for the file; past 2 GB it always does), so a
    small model takes the path a large one does. Raises :class:`ExportError` with the
    child's last line when the export fails.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    spec = {
        "shape": shape.to_dict(),
        "with_past": with_past,
        "external_data": external_data,
        "seed": seed,
    }
    try:
        done = subprocess.run(
            [sys.executable, "-m", "tierflow.zoo.hf_decoders", json.dumps(spec), str(out_dir)],
            env=_child_env(),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as exc:
        raise ExportError(f"exporting {shape.arch} took longer than {timeout} s") from exc
    if done.returncode != 0:
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        raise ExportError(
            f"optimum could not export {shape.arch} to {out_dir}: "
            f"{lines[-1] if lines else f'exit status {done.returncode}'}"
        )
    return out_dir / "model.onnx"


def _config(shape: DecoderShape) -> Any:
    import transformers

    config = transformers.Qwen2Config if shape.arch == "qwen2" else transformers.LlamaConfig
    return config(
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        vocab_size=shape.vocab,
        max_position_embeddings=shape.max_positions,
        tie_word_embeddings=shape.tied,
    )


def _export_in_this_process(spec: dict[str, Any], out_dir: Path) -> None:
    """The child's work: build the model from its config and run optimum's exporter."""
    import onnx
    import torch
    import transformers

    try:
        from optimum.exporters.onnx import onnx_export_from_model
    except ImportError as exc:
        raise SystemExit(
            f"the export needs optimum's ONNX exporter, which cannot be imported ({exc}): "
            "pip install 'tierflow[hf]' (optimum-onnx 0.1.0 needs transformers before 4.58)"
        ) from exc

    shape = DecoderShape.from_dict(spec["shape"])
    torch.manual_seed(int(spec["seed"]))
    model = transformers.AutoModelForCausalLM.from_config(_config(shape)).eval()
    task = "text-generation-with-past" if spec["with_past"] else "text-generation"
    onnx_export_from_model(model, output=out_dir, task=task, do_validation=False)
    del model
    path = out_dir / "model.onnx"
    if spec["external_data"] and not (out_dir / "model.onnx_data").exists():
        proto = onnx.load(path)
        onnx.save_model(
            proto,
            path,
            save_as_external_data=True,
            all_tensors_to_one_file=True,
            location="model.onnx_data",
            size_threshold=1024,
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Export one decoder (the child of export_decoder)")
    parser.add_argument("spec", help="JSON: shape, with_past, external_data, seed")
    parser.add_argument("out_dir", type=Path)
    args = parser.parse_args(argv)
    _export_in_this_process(json.loads(args.spec), args.out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
