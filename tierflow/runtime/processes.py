"""Starting and stopping ``tierflow serve`` as a child process (the demo, tests, benchmarks).

A server prints one line, ``tierflow TIER serving plan ID on HOST:PORT``, once its model
is loaded and its health service reports SERVING (``tierflow.runtime.server``), so waiting for
that line is waiting for the health service, without a gRPC client of its own. The wait
has a real deadline: stdout is read with ``select``, never a ``readline`` that could
block forever on a server that hangs before printing. stderr goes to a log file (or a
temporary one) whose last lines explain a server that did not start.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import IO

from tierflow.errors import TransportError

#: Seconds a server gets to load its model and print where it serves.
START_TIMEOUT_S = 60.0
#: Seconds a server gets to exit after SIGTERM before it is killed.
STOP_TIMEOUT_S = 10.0


class ServeProcess:
    """``tierflow serve TIER --plan PLAN_DIR --listen LISTEN ARGS...`` in a child process.

    Construction returns once the server serves (``address`` is where), or raises a
    :class:`TransportError` with the end of its log. ``plan_dir`` or ``listen`` None
    leaves that flag out (a ``--config`` file in ``args`` may give it). ``python`` is the
    interpreter command to run (another venv's, for instance); ``log`` the file its
    stderr goes to.
    Use as a context manager (stopped gracefully on the way out) or call :meth:`stop`.
    """

    def __init__(
        self,
        tier: str,
        plan_dir: str | Path | None,
        *args: str,
        listen: str | None = "127.0.0.1:0",
        log: str | Path | None = None,
        timeout: float = START_TIMEOUT_S,
        python: Sequence[str] = (sys.executable,),
        cwd: str | Path | None = None,
    ) -> None:
        self.tier = tier
        self.command = [*python, "-m", "tierflow.cli", "serve", tier]
        if plan_dir is not None:
            self.command += ["--plan", str(plan_dir)]
        if listen is not None:
            self.command += ["--listen", listen]
        self.command += args
        self.log_path = Path(log) if log is not None else None
        # Held open for the child's lifetime, closed by stop() or kill().
        if self.log_path is not None:
            self._log: IO[bytes] = open(self.log_path, "wb")  # noqa: SIM115
        else:
            self._log = tempfile.TemporaryFile()  # noqa: SIM115
        self._pending = b""
        self._closed_stdout = False
        self.process = subprocess.Popen(
            self.command,
            stdout=subprocess.PIPE,
            stderr=self._log,
            cwd=cwd,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
        )
        line = self.read_line(timeout)
        if " serving plan " not in line:
            reason = self._failure(timeout, line)
            self.kill()
            raise TransportError(f"tierflow serve {tier} did not start: {reason}")
        self.address = line.rsplit(" on ", 1)[1].strip()

    @property
    def pid(self) -> int:
        return self.process.pid

    def read_line(self, timeout: float) -> str:
        """The next line the server printed (stripped); "" if none came within ``timeout``."""
        assert self.process.stdout is not None
        descriptor = self.process.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._pending:
            left = deadline - time.monotonic()
            if left <= 0:
                return ""
            ready, _, _ = select.select([descriptor], [], [], left)
            if not ready:
                return ""
            chunk = os.read(descriptor, 4096)
            if not chunk:  # the process closed stdout: it is exiting
                self._closed_stdout = True
                line, self._pending = self._pending, b""
                return line.decode(errors="replace").strip()
            self._pending += chunk
        line, _, self._pending = self._pending.partition(b"\n")
        return line.decode(errors="replace").strip()

    def log_tail(self, lines: int = 20) -> str:
        """The last ``lines`` lines the server wrote to stderr."""
        if self.log_path is None and self._log.closed:
            return ""
        if not self._log.closed:
            self._log.flush()
        if self.log_path is not None:
            text = self.log_path.read_text(errors="replace")
        else:
            self._log.seek(0)
            text = self._log.read().decode(errors="replace")
        return "\n".join(text.strip().splitlines()[-lines:])

    def _failure(self, timeout: float, line: str) -> str:
        status = self.process.poll()
        if status is None and self._closed_stdout:
            with contextlib.suppress(subprocess.TimeoutExpired):
                status = self.process.wait(STOP_TIMEOUT_S)
        if status is None:
            what = f"no address within {timeout:g} s"
        else:
            what = f"it exited with status {status}"
        if line:
            what += f" (it printed {line!r})"
        tail = self.log_tail(5)
        where = f" (log: {self.log_path})" if self.log_path is not None else ""
        return f"{what}; its log ends:\n{tail}{where}" if tail else what + where

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> int:
        """SIGTERM, as a service manager stops it; SIGKILL after ``timeout`` s. The status."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
        status = self.process.wait()
        self._close()
        return status

    def kill(self) -> None:
        """SIGKILL now (a crash, or a test's cleanup)."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self._close()

    def _close(self) -> None:
        if self.process.stdout is not None:
            self.process.stdout.close()
        self._log.close()

    def __enter__(self) -> ServeProcess:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()
