"""What the benchmark suites share: the emulated tiers, the model suite, test plans, reports.

Nothing here is a suite: each module is a library that suites import
(``from benchmarks.lib import emulation``), never run on its own, except
:mod:`benchmarks.lib.grpc_relay`, which :mod:`benchmarks.transport` starts as a process.
"""

from __future__ import annotations

from pathlib import Path

#: The one folder every suite writes its committed results into: JSON, plots and reports.
RESULTS = Path(__file__).resolve().parents[1] / "results"
