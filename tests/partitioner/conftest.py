"""Shared fixtures of the partitioner tests."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tierflow.codec.base import CodecStats
from tierflow.partitioner.profile import CutProfile, MachineInfo, Profile, UnitProfile

# codec -> (ratio, encode s/MB, decode s/MB)
DEFAULT_CODECS: Mapping[str, tuple[float, float, float]] = {
    "raw": (1.0, 0.0, 0.0),
    "zstd": (2.0, 0.01, 0.005),
    "int8+zstd": (6.0, 0.004, 0.001),
}

MakeProfile = Callable[..., Profile]


def make_profile(
    unit_s: Sequence[float],
    cut_bytes: Sequence[int],
    *,
    overhead_s: float = 0.0,
    weights: Sequence[int] | None = None,
    peaks: Sequence[int] | None = None,
    codecs: Mapping[str, tuple[float, float, float]] = DEFAULT_CODECS,
    slowdown: float = 1.0,
    sha256: str = "0" * 64,
) -> Profile:
    """A hand-made profile: ``len(unit_s)`` units, ``len(unit_s) + 1`` cuts."""
    assert len(cut_bytes) == len(unit_s) + 1
    machine = MachineInfo("test", "cpu", 1, 1, slowdown, slowdown != 1.0, "0")
    cuts = tuple(
        CutProfile(
            index=i,
            position=i,
            tensors=(f"t{i}",),
            nbytes=int(nbytes),
            codecs={
                name: CodecStats(name, ratio, enc, dec, 0.0)
                for name, (ratio, enc, dec) in codecs.items()
            },
        )
        for i, nbytes in enumerate(cut_bytes)
    )
    units = tuple(
        UnitProfile(
            index=i,
            compute_s=float(s),
            weight_bytes=int(weights[i]) if weights else 0,
            peak_activation_bytes=int(peaks[i]) if peaks else 0,
        )
        for i, s in enumerate(unit_s)
    )
    return Profile(machine, "model.onnx", sha256, cuts, units, overhead_s)


@pytest.fixture
def profile_factory() -> MakeProfile:
    return make_profile


# --- exported zoo models (graph analysis and splitting tests) ----------------------------

# name -> zoo builder keyword arguments for tiny versions (export + analysis in ~1 s).
TINY_MODELS: Mapping[str, Mapping[str, object]] = {
    "chain_cnn": {"size": 16, "width": 0.0625},
    "resnet18": {"size": 32, "width": 0.125, "num_classes": 10},
    "mobilenet_v2": {
        "size": 32,
        "width": 0.25,
        "num_classes": 10,
        "settings": ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 2, 2)),
    },
    "transformer_encoder": {"seq": 8, "dim": 16, "heads": 2, "layers": 2, "vocab": 50},
}


class ZooExports:
    """Exports each (model, exporter, external data) once per test session, on demand."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._paths: dict[tuple[str, bool, bool], Path] = {}
        self._modules: dict[str, tuple[Any, tuple[Any, ...]]] = {}

    def module(self, name: str) -> tuple[Any, tuple[Any, ...]]:
        """The torch module and example inputs of a tiny zoo model."""
        from tierflow.zoo import models

        if name not in self._modules:
            self._modules[name] = getattr(models, name)(**TINY_MODELS[name])
        return self._modules[name]

    def path(self, name: str, *, dynamo: bool = True, external: bool = False) -> Path:
        from tierflow.zoo import models

        key = (name, dynamo, external)
        if key not in self._paths:
            module, example = self.module(name)
            tag = f"{name}-{'dynamo' if dynamo else 'legacy'}{'-ext' if external else ''}"
            self._paths[key] = models.export_onnx(
                module,
                example,
                self.directory / tag / "model.onnx",
                dynamo=dynamo,
                external_data=external,
                # Symbolic batch exercises the shape folding (legacy writes Shape chains).
                dynamic_batch=name == "transformer_encoder",
            )
        return self._paths[key]


@pytest.fixture(scope="session")
def zoo_exports(tmp_path_factory: pytest.TempPathFactory) -> ZooExports:
    return ZooExports(tmp_path_factory.mktemp("zoo"))


def write_mlp(path: Path, dims: Sequence[int], *, batch: int = 1, scale: float = 1.0) -> Path:
    """Save an MLP of Gemm+Relu layers, ``dims[0] -> dims[1] -> ...``, at ``path``.

    Its weights are seed-0 normals times ``scale``; its input is ``x`` and its output the
    last layer's ``h{n}``.
    """
    rng = np.random.default_rng(0)
    layers = len(dims) - 1
    weights = [
        numpy_helper.from_array(
            (rng.standard_normal((dims[i + 1], dims[i])) * scale).astype(np.float32), f"w{i}"
        )
        for i in range(layers)
    ]
    nodes, source = [], "x"
    for i in range(layers):
        nodes += [
            helper.make_node("Gemm", [source, f"w{i}"], [f"g{i}"], transB=1),
            helper.make_node("Relu", [f"g{i}"], [f"h{i}"]),
        ]
        source = f"h{i}"
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, dims[0]])],
        [helper.make_tensor_value_info(source, TensorProto.FLOAT, [batch, dims[-1]])],
        weights,
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path
