"""ServeProcess: waits for the serving line with a real deadline, explains failures, stops.

Stand-in servers (``python -c``) make each case fast and exact; tests/edge/test_processes.py
runs real ``tierflow serve`` processes through the same helper.
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import pytest

from tierflow.errors import TransportError
from tierflow.runtime.processes import ServeProcess

pytestmark = pytest.mark.integration


def _stand_in(code: str) -> tuple[str, ...]:
    """An interpreter command running ``code`` instead of ``-m tierflow.cli serve ...``."""
    return (sys.executable, "-c", code)


def test_the_address_is_read_from_the_serving_line_and_later_lines_stay_readable(
    tmp_path: Path,
) -> None:
    code = (
        "import sys, time\n"
        "print('tierflow cloud serving plan p1 on 127.0.0.1:5071', flush=True)\n"
        "print('tierflow cloud metrics on http://127.0.0.1:9/metrics', flush=True)\n"
        "print('argv', *sys.argv[1:], file=sys.stderr, flush=True)\n"
        "time.sleep(60)\n"
    )
    server = ServeProcess(
        "cloud", tmp_path, "--workers", "2", log=tmp_path / "cloud.log", python=_stand_in(code)
    )
    try:
        assert server.address == "127.0.0.1:5071"
        assert server.read_line(5) == "tierflow cloud metrics on http://127.0.0.1:9/metrics"
        assert server.read_line(0.1) == ""  # nothing more: the deadline holds
    finally:
        status = server.stop()
    assert status == -signal.SIGTERM
    argv = f"argv -m tierflow.cli serve cloud --plan {tmp_path} --listen 127.0.0.1:0 --workers 2"
    assert (tmp_path / "cloud.log").read_text().strip() == argv


def test_a_server_that_never_prints_is_killed_at_the_deadline() -> None:
    started = time.monotonic()
    with pytest.raises(TransportError, match=r"did not start: no address within 0\.5 s"):
        ServeProcess("edge", "plan", timeout=0.5, python=_stand_in("import time; time.sleep(60)"))
    assert time.monotonic() - started < 10


def test_a_server_that_exits_says_why_from_its_log(tmp_path: Path) -> None:
    code = "import sys; print('error: no plan here', file=sys.stderr); sys.exit(2)"
    with pytest.raises(TransportError, match="exited with status 2") as failure:
        ServeProcess("edge", tmp_path, python=_stand_in(code))
    assert "error: no plan here" in str(failure.value)


def test_a_real_server_with_a_missing_plan_fails_with_its_error_line(tmp_path: Path) -> None:
    with pytest.raises(TransportError, match="exited with status 2") as failure:
        ServeProcess("cloud", tmp_path / "no-plan")
    assert "tierflow serve cloud: error:" in str(failure.value)
