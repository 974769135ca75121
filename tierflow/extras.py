"""Optional dependencies: which extra brings which module, and the one line that says so.

The runtime tiers import only onnxruntime, numpy, grpcio, protobuf and zstandard. Anything
heavier belongs to an extra (``pip install 'tierflow[plan]'``) and is imported inside the
function that needs it, through :func:`import_extra`, or left to fail with
``ModuleNotFoundError``, which the CLI turns into the same one line with
:func:`missing_extra` (so a planning command in a runtime-only install says what to
install instead of printing a traceback).
"""

from __future__ import annotations

import importlib
from types import ModuleType

from tierflow.errors import MissingExtraError

#: Top-level module -> the extra (in pyproject.toml) that installs it.
EXTRA_OF_MODULE: dict[str, str] = {
    "onnx": "plan",
    "onnxscript": "train",
    "torch": "train",
    "sklearn": "train",
    "matplotlib": "bench",
    "redis": "redis",
    "prometheus_client": "metrics",
    "PIL": "image",
    "simplejpeg": "image",
    "cv2": "camera",
    "tokenizers": "tokenizer",
}


def install_hint(extra: str) -> str:
    return f"pip install 'tierflow[{extra}]'"


def missing_extra(exc: ModuleNotFoundError, extra: str | None = None) -> MissingExtraError | None:
    """The error to show for ``exc`` when an extra brings the module, else None.

    ``extra``, when given, is the extra the whole command needs (``demo`` needs ``train``
    even though onnx, from ``plan``, is the first module it misses).
    """
    top = (exc.name or "").partition(".")[0]
    if top not in EXTRA_OF_MODULE:
        return None
    extra = extra or EXTRA_OF_MODULE[top]
    return MissingExtraError(
        f"this needs {top}, which is not installed: {install_hint(extra)}",
        module=top,
        extra=extra,
    )


def import_extra(module: str, purpose: str) -> ModuleType:
    """Import ``module`` or raise a MissingExtraError naming ``purpose`` and the extra."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        error = missing_extra(exc)
        if error is None:
            raise
        raise MissingExtraError(
            f"{purpose} needs {error.module}, which is not installed: {install_hint(error.extra)}",
            module=error.module,
            extra=error.extra,
        ) from exc
