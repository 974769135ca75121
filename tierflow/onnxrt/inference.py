"""Opening ONNX Runtime sessions: the one place that does, with the tiers' settings.

Every session tierflow opens (a tier's segments, the split check, profiling, shape
measurement, early-exit heads, reading IN.npz, the model zoo) comes from
:func:`open_session`, so they all run the same program the tiers run and every load
failure is a :class:`~tierflow.errors.ModelError` naming what could not be loaded.

[Note: optimization level and exactness]
At ONNX Runtime's highest level ("all") the unsplit model gets fusions that span what
are cut boundaries in a plan (a Conv, the residual Add and the Relu become one NCHWc
convolution), so a split model can differ from the unsplit one in the last bit (about
1e-7 relative). At "extended" and below no fusion depends on where the graph was cut and
a split reproduces the unsplit model bit for bit (measured on ResNet-18 and MobileNetV2,
10 of 10 cut pairs each; at "all" 1 of 10 on ResNet-18). tierflow promises bit-exact
answers with lossless codecs, so "extended" is the default everywhere (runtimes,
profiling, benchmarks); "all" is 2-3.4 times faster on those convnets and can be chosen
with ``--optimization all`` where the last bit does not matter. The intra-op thread
count must match too: ORT's last bits change with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import onnxruntime as ort

from tierflow.errors import ModelError, UsageError
from tierflow.onnxrt.providers import CPU

#: ONNX Runtime graph optimization levels by name ([Note: optimization level and exactness]).
OPTIMIZATION_LEVELS: dict[str, ort.GraphOptimizationLevel] = {
    "disabled": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}
DEFAULT_OPTIMIZATION = "extended"


def check_optimization(optimization: str) -> None:
    """Raise a :class:`UsageError` unless ``optimization`` names a level."""
    if optimization not in OPTIMIZATION_LEVELS:
        raise UsageError(
            f"unknown optimization level {optimization!r}: expected one of "
            f"{', '.join(OPTIMIZATION_LEVELS)}"
        )


def session_options(threads: int, optimization: str = DEFAULT_OPTIMIZATION) -> ort.SessionOptions:
    """Session options for a tier: ``threads`` intra-op threads that never spin.

    Spinning threads burn a core while idle; three tiers on one machine (or a device
    on battery) cannot afford that. ``threads`` 0 lets ONNX Runtime choose (one per
    core). ``optimization`` is one of ``OPTIMIZATION_LEVELS``.
    """
    check_optimization(optimization)
    options = ort.SessionOptions()
    options.graph_optimization_level = OPTIMIZATION_LEVELS[optimization]
    options.intra_op_num_threads = max(0, threads)
    options.inter_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.add_session_config_entry("session.inter_op.allow_spinning", "0")
    # Fatal only: ONNX Runtime writes a coloured "[E:onnxruntime...]" line to stderr for
    # every failed run. A failure reaches tierflow as an exception, which the caller
    # translates and logs once (SegmentRunner.run); a client's bad step must not
    # write lines to a tier's stderr that no log setting controls.
    options.log_severity_level = 4
    return options


def open_session(
    model: str | Path | bytes,
    *,
    threads: int = 1,
    optimization: str = DEFAULT_OPTIMIZATION,
    providers: Sequence[str] = (CPU,),
    what: str | None = None,
    weights_folder: str | None = None,
) -> ort.InferenceSession:
    """An ONNX Runtime session on ``model`` (a file, or a serialised ModelProto).

    ``weights_folder``: where a serialised model's external data files lie (their
    locations are relative to it); a file's lie beside it.

    Options as :func:`session_options` makes them; ``providers`` are ONNX Runtime's
    execution providers in order of preference (``tierflow.onnxrt.providers``). Any failure to
    load becomes a :class:`ModelError` that names ``what`` (by default the file, or "the
    model").
    """
    source = model if isinstance(model, bytes) else str(model)
    options = session_options(threads, optimization)
    if weights_folder is not None:
        options.add_session_config_entry(
            "session.model_external_initializers_file_folder_path", weights_folder
        )
    try:
        return ort.InferenceSession(source, options, providers=list(providers))
    except Exception as exc:  # onnxruntime raises its own pybind exception types
        name = what or ("the model" if isinstance(model, bytes) else str(model))
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelError(f"cannot load {name}: {reason}") from exc
