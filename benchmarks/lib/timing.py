"""How the suites time what they run: the tiers' ONNX Runtime session, and CPU time.

Every suite that runs a model (or a piece of one) here opens it with :func:`session`, so it
runs the program the tiers run (``tierflow.onnxrt.inference.open_session``: one intra-op
thread and the 'extended' level unless told otherwise, [Note: optimization level and
exactness]), and times parts with :func:`cpu_ms`: the calling thread's CPU time, which other
jobs on a shared machine inflate far less than wall time (ONNX Runtime with one intra-op
thread, the image codecs and zstd all compute on that thread).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import onnxruntime as ort


def session(
    model: Any, *, threads: int = 1, optimization: str | None = None
) -> ort.InferenceSession:
    """The tiers' session of ``model`` (an onnx ``ModelProto``, or its serialized bytes).

    ``threads``: intra-op threads; ``optimization``: ONNX Runtime's level (default: the
    tiers' own, bit-exact 'extended').
    """
    from tierflow.onnxrt.inference import DEFAULT_OPTIMIZATION, open_session

    data = model if isinstance(model, bytes) else model.SerializeToString()
    return open_session(data, threads=threads, optimization=optimization or DEFAULT_OPTIMIZATION)


def cpu_ms(repeats: int, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, float]:
    """``fn(*args, **kwargs)`` and its median CPU time on this thread (ms) over ``repeats``."""
    times, result = [], None
    for _ in range(repeats):
        start = time.thread_time()
        result = fn(*args, **kwargs)
        times.append((time.thread_time() - start) * 1e3)
    return result, statistics.median(times)
