"""A plan's cloud and edge served as users serve them: ``tierflow serve``, one process each.

:func:`served` starts ``tierflow serve cloud`` and ``tierflow serve edge`` on free ports of
127.0.0.1 (:class:`~tierflow.runtime.processes.ServeProcess`), each with its Prometheus
metrics (``--metrics-port 0``), and stops both on the way out, whatever happened inside:
no suite leaves a tier process behind. What a suite reads of them is what an operator
reads: the step batchers' calls by size from the metrics endpoint
(``tierflow_batch_calls_total`` and the seconds they took, :func:`batch_calls`) and each
process's peak resident memory (:func:`peak_rss`).
"""

from __future__ import annotations

import contextlib
import os
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from tierflow.runtime.processes import ServeProcess

#: Seconds a tier gets to load its segment (a 0.95 GB decoder on a loaded machine).
START_TIMEOUT_S = 180.0


@dataclass(frozen=True)
class Tier:
    """One served tier: its process id and where its metrics are."""

    pid: int
    metrics: str


@dataclass(frozen=True)
class ServedTiers:
    """The edge's address (where devices connect) and the two tiers, by name."""

    edge: str
    tiers: dict[str, Tier]


@contextlib.contextmanager
def served(plan_dir: Path, flags: Sequence[str], logs: Path) -> Iterator[ServedTiers]:
    """The cloud and the edge of ``plan_dir``, each ``tierflow serve TIER --plan plan_dir
    FLAGS --metrics-port 0`` in its own process, its stderr in ``logs/TIER.log``."""
    logs.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        tiers: dict[str, Tier] = {}
        upstream: list[str] = []
        for name in ("cloud", "edge"):
            process = stack.enter_context(
                ServeProcess(
                    name,
                    plan_dir,
                    *flags,
                    "--metrics-port",
                    "0",
                    *upstream,
                    log=logs / f"{name}.log",
                    timeout=START_TIMEOUT_S,
                )
            )
            tiers[name] = Tier(process.pid, _metrics_url(process))
            upstream = ["--upstream", process.address]
        yield ServedTiers(process.address, tiers)


def _metrics_url(process: ServeProcess) -> str:
    """The second line ``tierflow serve`` prints: ``... metrics on http://HOST:PORT/metrics``."""
    line = process.read_line(30)
    if " metrics on http://" not in line:
        raise RuntimeError(f"tierflow serve {process.tier} said no metrics address: {line!r}")
    return line.rsplit(" on ", 1)[1].strip()


def batch_calls(url: str) -> tuple[dict[int, int], dict[int, float]]:
    """The tier's step batcher calls so far and the seconds they took, scraped from its
    metrics endpoint at ``url`` (:func:`batch_sizes`, :func:`batch_seconds`)."""
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return batch_sizes(text), batch_seconds(text)


def batch_sizes(exposition: str) -> dict[int, int]:
    """The calls by the steps each ran, from a tier's metrics text
    (``tierflow_batch_calls_total{size=...}``; empty when it batches nothing)."""
    return {size: int(value) for size, value in _by_size(exposition, "calls").items()}


def batch_seconds(exposition: str) -> dict[int, float]:
    """The seconds those calls took, by the steps each ran
    (``tierflow_batch_call_seconds_total{size=...}``)."""
    return _by_size(exposition, "call_seconds")


def _by_size(exposition: str, what: str) -> dict[int, float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {
        int(sample.labels["size"]): sample.value
        for family in text_string_to_metric_families(exposition)
        for sample in family.samples
        if sample.name == f"tierflow_batch_{what}_total"
    }


def cpu_seconds(pid: int | str = "self") -> float:
    """A process's CPU time so far, every thread's, user and system, in seconds (/proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def peak_rss(pid: int | str = "self") -> int:
    """A process's peak resident memory so far in bytes (VmHWM; 0 if /proc has none)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0
