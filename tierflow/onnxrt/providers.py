"""ONNX Runtime execution providers: which hardware runs a tier's segments.

``--providers`` takes short names in order of preference (``cuda,cpu``,
``tensorrt,cuda,cpu``, ``coreml``), full ONNX Runtime names
(``CUDAExecutionProvider``), or ``auto``: every provider the installed onnxruntime
offers, in its own order of preference (a GPU build lists TensorRT and CUDA before the
CPU). A provider the installed onnxruntime does not offer is a
:class:`~tierflow.errors.ProviderError` that names the ones it does, when the option is
read, before any model loads. ONNX Runtime itself runs the nodes a provider cannot on
the CPU, so ``cuda`` alone works; ``cuda,cpu`` says so explicitly.

Profiles record the providers they were measured with, so the planner sees a Jetson's
GPU as a faster tier than its CPU (different profiles), and the plan table shows them.
Bit-exactness across tiers is promised on the CPU provider only: GPU kernels round
differently (see [Note: optimization level and exactness] for the CPU conditions).
"""

from __future__ import annotations

from collections.abc import Sequence

import onnxruntime as ort

from tierflow.errors import ProviderError

CPU = "CPUExecutionProvider"
DEFAULT_PROVIDERS = "cpu"

#: Short names -> ONNX Runtime's names.
ALIASES: dict[str, str] = {
    "cpu": CPU,
    "cuda": "CUDAExecutionProvider",
    "tensorrt": "TensorrtExecutionProvider",
    "trt": "TensorrtExecutionProvider",
    "coreml": "CoreMLExecutionProvider",
    "openvino": "OpenVINOExecutionProvider",
    "dml": "DmlExecutionProvider",
    "directml": "DmlExecutionProvider",
    "rocm": "ROCMExecutionProvider",
    "migraphx": "MIGraphXExecutionProvider",
    "qnn": "QNNExecutionProvider",
    "nnapi": "NnapiExecutionProvider",
    "xnnpack": "XnnpackExecutionProvider",
    "dnnl": "DnnlExecutionProvider",
    "acl": "ACLExecutionProvider",
    "armnn": "ArmNNExecutionProvider",
    "cann": "CANNExecutionProvider",
    "webgpu": "WebGpuExecutionProvider",
}
# Offered by every build but not a place to run a model's nodes (it calls remote endpoints).
_NOT_LOCAL = {"AzureExecutionProvider"}


def short_name(provider: str) -> str:
    """``CUDAExecutionProvider`` -> ``cuda`` (the first alias), for tables and logs."""
    for alias, name in ALIASES.items():
        if name == provider:
            return alias
    return provider.removesuffix("ExecutionProvider").lower()


def describe(providers: Sequence[str]) -> str:
    """``("CUDAExecutionProvider", "CPUExecutionProvider")`` -> ``"cuda,cpu"``."""
    return ",".join(short_name(p) for p in providers)


def available() -> tuple[str, ...]:
    """The providers the installed onnxruntime can run nodes on, most preferred first."""
    return tuple(p for p in ort.get_available_providers() if p not in _NOT_LOCAL)


def parse_providers(text: str) -> tuple[str, ...]:
    """``"cuda,cpu"`` or ``"auto"`` -> ONNX Runtime's provider names, checked to exist."""
    offered = available()
    if text.strip().lower() == "auto":
        return offered
    names = [part.strip() for part in text.split(",") if part.strip()]
    if not names:
        raise ProviderError("--providers is empty: expected a list like cuda,cpu or auto")
    providers: list[str] = []
    for name in names:
        provider = ALIASES.get(name.lower(), name)
        if provider not in ort.get_all_providers():
            raise ProviderError(
                f"unknown execution provider {name!r}: expected names like "
                f"{', '.join(sorted(set(ALIASES) - {'trt', 'directml'}))}, or auto"
            )
        if provider not in offered:
            raise ProviderError(
                f"execution provider {name!r} ({provider}) is not available in this "
                f"onnxruntime {ort.__version__}; available: {describe(offered)}"
            )
        if provider not in providers:
            providers.append(provider)
    return tuple(providers)
