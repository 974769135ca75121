"""The fast test layer's guard: a test not marked ``integration`` may not start a process
or a server, sleep, or train or export a model.

``pytest -m "not integration"`` is what a developer runs on every change (the README's
"Two commands"; docs/testing.md), so it must stay fast and deterministic: pure functions
and in-process fakes, no real processes, servers, Redis, namespaces or trained models. A
test that does one of those things belongs to the integration layer. This guard makes
that rule checked rather than remembered. While a fast test sets up and runs, it records
every process started
(``subprocess``, ``os.fork``/``posix_spawn``/``system``, ``multiprocessing``), every gRPC
server created, every listening socket, every ``time.sleep`` on the test's own threads,
every torch backward pass or export, and a first import of torch; then it fails the test
with what it saw and how to mark it.

What it records happens anyway (a recorded process still starts), so the failure comes
after the test body, never half-way through its cleanup. Higher-scoped fixtures set up by
an earlier integration test are not seen again; ``pytest -m "not integration"`` sees them
all. Teardown is not checked: stopping something is not starting it.
"""

from __future__ import annotations

import importlib
import multiprocessing.process
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import grpc.aio
import pytest

_MARK = "integration"
_TAG = "_tierflow_fast_test"


class _Recorder:
    """What the fast test now running has done that a fast test may not."""

    def __init__(self) -> None:
        self.test: str | None = None
        self.seen: list[str] = []

    def note(self, what: str) -> None:
        if self.test is not None:
            self.seen.append(what)

    def note_sleep(self, seconds: object) -> None:
        # Only the test's own threads: a thread an earlier integration test left running
        # (a server draining, say) is not this test's doing.
        thread = threading.current_thread()
        if thread is threading.main_thread() or getattr(thread, _TAG, None) == self.test:
            self.note(f"slept {seconds!r} s")


_RECORDER = _Recorder()


def _wrap(owner: Any, name: str, describe: Callable[..., str]) -> None:
    original = getattr(owner, name)

    def recording(*args: Any, **kwargs: Any) -> Any:
        _RECORDER.note(describe(*args, **kwargs))
        return original(*args, **kwargs)

    recording.__wrapped__ = original  # type: ignore[attr-defined]
    setattr(recording, _TAG, True)
    setattr(owner, name, recording)


def _command(args: Any) -> str:
    words = [str(a) for a in args] if isinstance(args, (list, tuple)) else str(args).split()
    shown = " ".join(w if len(w) <= 40 else w[:37] + "..." for w in words[:3])
    return shown.replace("\n", " ") + (" ..." if len(words) > 3 else "")


def _watch_torch() -> None:
    """Record training (a backward pass) and exporting, once torch has been imported.

    Called as each fast test starts: torch is imported by whoever needs it (test modules
    often at collection), and this guard never imports it itself.
    """
    torch = sys.modules.get("torch")
    if torch is None or getattr(torch.Tensor.backward, _TAG, False):
        return
    _wrap(torch.Tensor, "backward", lambda *a, **k: "trained a model (a backward pass)")
    for module in ("torch.onnx", "torch.export"):
        _wrap(
            importlib.import_module(module), "export", lambda *a, _m=module, **k: f"ran {_m}.export"
        )


def install() -> None:
    """Put the recording wrappers in place, once per run (they cost nothing when idle)."""
    if getattr(time.sleep, _TAG, False):
        return
    _wrap(subprocess.Popen, "__init__", lambda _self, args, *a, **k: f"ran {_command(args)}")
    for name in ("fork", "system", "posix_spawn", "posix_spawnp"):
        if hasattr(os, name):
            _wrap(os, name, lambda *a, _n=name, **k: f"called os.{_n}")
    _wrap(multiprocessing.process.BaseProcess, "start", lambda *a, **k: "started a process")
    _wrap(grpc, "server", lambda *a, **k: "created a gRPC server")
    _wrap(grpc.aio, "server", lambda *a, **k: "created a gRPC server")
    _wrap(socket.socket, "listen", lambda s, *a, **k: f"listened on {s.getsockname()}")

    sleep = time.sleep

    def recording_sleep(seconds: float) -> None:
        _RECORDER.note_sleep(seconds)
        sleep(seconds)

    recording_sleep.__wrapped__ = sleep  # type: ignore[attr-defined]
    setattr(recording_sleep, _TAG, True)
    time.sleep = recording_sleep

    start = threading.Thread.start

    def tagging_start(self: threading.Thread) -> None:
        if _RECORDER.test is not None:
            setattr(self, _TAG, _RECORDER.test)
        start(self)

    threading.Thread.start = tagging_start  # type: ignore[method-assign]


def guarded(item: pytest.Item, phase: str) -> Iterator[None]:
    """Record what a fast test's ``phase`` does; fail it if that is not fast work."""
    if item.get_closest_marker(_MARK) is not None:
        yield
        return
    _watch_torch()
    had_torch = "torch" in sys.modules
    _RECORDER.test, _RECORDER.seen = item.nodeid, []
    try:
        yield
    finally:
        _RECORDER.test = None
    seen = list(dict.fromkeys(_RECORDER.seen))
    if not had_torch and "torch" in sys.modules:
        seen.append("imported torch")
    if seen:
        pytest.fail(
            f"a fast test may not start processes or servers, sleep, or import or run torch; "
            f"during {phase} this one {'; '.join(seen[:5])}"
            f"{f' (and {len(seen) - 5} more)' if len(seen) > 5 else ''}. Make it fast "
            f"(a fake clock, a synthetic profile, an in-process fake), or mark it "
            f"@pytest.mark.{_MARK}.",
            pytrace=False,
        )
