"""Settings the runtime commands apply for low latency: GIL hand-overs, large buffers, the
garbage collector, and (when asked) CPUs kept from sleeping.

``tierflow serve``, ``tierflow run`` and the demo (its device) call :func:`tune_for_latency`; a
library user decides for their own process. Each setting is explained below.
``tierflow serve --cpus-awake`` also holds :func:`cpus_awake`, a setting of the whole
machine ([Note: CPUs that sleep between steps]).

[Note: GIL switch interval]
A request crosses several threads in each process (gRPC's, the stream reader, a worker,
the reply writer). When a woken thread finds the GIL held by a thread still running
Python, it waits up to the interpreter's switch interval (5 ms by default) before the
GIL is handed over; on a busy machine that wait showed up on almost every hop (median
end-to-end 9 ms instead of 2 ms for 100 KB features over three local processes).

A process that drives several sessions at once, a thread each (a device serving local
sessions whose steps it batches: [Note: the step batcher] in tierflow/runtime/batching.py),
is the other way round. When a round's answers come, every session's thread wakes at once
and each runs a few hundred microseconds of Python; at 0.2 ms they take the GIL from each
other over and over, and every hand-over forced that way costs two thread switches. 16
lockstep sessions of a tiny decoder (the batching benchmark's Qwen2 shape with hidden 128,
so a round is all overhead; 2026-12-06, runs in pairs) cost the device process 18.7-19.1
ms of CPU a round at 0.2 ms against 14.4-15.9 at 1 ms on the split plan, and 9.7-10.0
against 7.8-7.9 cloud-only; rounds were up to 1.5 ms shorter (the full decoder's 80 ms
rounds moved less than the machine's noise), and the tiers' CPU did not move with their
own interval. So ``tune_for_latency(sessions=N)`` keeps 1 ms for N above one.
A tier keeps 0.2 ms: at 1 ms its hops took 4% longer for 1 MB features, and no longer for
100 KB (``benchmarks.transport``'s :func:`against`, the tiers at 1 ms against 0.2 ms,
side by side).

[Note: keeping freed buffers]
Every request allocates a few buffers the size of its features: the serialised message,
gRPC's copy of it, the received bytes, the decoded tensor. glibc's malloc serves large
blocks from fresh ``mmap`` pages, and once several freed ones sit at the top of its heap
it trims them off; either way the next request faults in, zeroes and charges new pages
for every buffer. ``perf`` on a gRPC stream of 1 MB messages between two processes put
the page faults at about 14% of all CPU time, next to 25% for the copies themselves.
Raising the mmap and trim thresholds lets freed buffers be reused: that stream went from
0.80 to 0.37 ms per message (median of 4 runs each, side by side), and one-at-a-time
round trips of 1 MB from 0.80 to 0.71 ms. What a process holds at its peak it then
keeps instead of returning it; peak memory is unchanged. On a C library without
``mallopt`` (musl, macOS) nothing is changed.

[Note: garbage collection between steps]
Python's cyclic garbage collector runs when allocations outnumber deallocations by 700
(its youngest generation), and every tenth and hundredth time it also walks the older
generations: the oldest holds every object the process has made to last, its imported
modules' functions, classes and dicts among them. Walking that took 12 ms each time on the
edge and on the device of ``benchmarks/batching.py``'s split plan, about once in 60
rounds of 8 lockstep sessions: 0.2 ms a round each on average, and a stall in one round
(measured 2026-12-07 with ``gc.callbacks``, 60 rounds of 55 ms). :func:`tune_for_latency`
collects once and then freezes what is there (``gc.freeze``): the objects made by then,
mostly the imports, are never walked again, and never freed, which they would not be
anyway. After it, the device's one such walk in 60 rounds took 2 ms. The youngest
generation is left as it is: at 20,000 instead of 700, at 16 sessions, the device's
collector ran 2 times in 60 rounds instead of 39 (and 3 of the next generation), and
took 0.24 ms a round against 0.22 (what a step makes lasts a round or two).

[Note: CPUs that sleep between steps]
A tier waits for its next message between its steps, and a CPU with nothing to run goes to
sleep (a C-state; on a virtual machine, the virtual CPU halts and the host may run something
else). Waking it takes time, and an ONNX Runtime call wakes its pool's threads many times:
the tiers' threads never spin (tierflow/onnxrt/inference.py), so each operator's parallel
work is handed over through the kernel. A call that follows an idle spell runs slower than
the same call back to back. Measured on this project's 2-core virtual machine (a KVM guest,
``haltpoll`` idle driver), 2026-12-06:

* bare ONNX Runtime, the batching benchmark's split decoder in three processes passing a
  byte round a ring of pipes, 16 rows: the three calls took 62-88 ms a round back to back
  (the machine's speed moved that much within the hour) and 99-114 ms with each call after
  20 ms asleep; in one pair of runs, 80 ms with the CPUs kept awake against 114 ms not;
* served (``benchmarks/batching.py``'s tiers, 16 lockstep sessions, runs in pairs): cloud-only,
  the sessions made 195 and 178 tokens/s with the CPUs kept awake against 154 and 155
  not; split, 160 tokens/s against 153 in one pair.

:func:`cpus_awake` asks the kernel, through its CPU latency setting (PM QoS,
``/dev/cpu_dma_latency``: 0 µs while the file is held open), to keep every CPU out of any
sleep state it cannot leave at once, as tuned's ``latency-performance`` profile does. It is
a setting of the whole machine, held while the block runs: an idle CPU polls instead of
sleeping, which costs power (and, on a virtual machine, the host's CPU time). So it is
asked for (``tierflow serve --cpus-awake``), never on by default, and not for a device on
battery. Writing the file needs root (or the file's permission); where it is missing or
refused, nothing changes and a warning says why.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import os
import struct
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

logger = logging.getLogger(__name__)

#: See [Note: GIL switch interval].
SWITCH_INTERVAL_S = 2e-4
#: ... for a process that drives several sessions at once, a thread each.
SESSIONS_SWITCH_INTERVAL_S = 1e-3
#: Blocks below this size come from the heap, not from fresh mmap pages
#: ([Note: keeping freed buffers]).
MMAP_THRESHOLD_BYTES = 64 * 1024 * 1024
#: Free memory at the top of a heap is returned to the system only beyond this size.
TRIM_THRESHOLD_BYTES = 256 * 1024 * 1024
# glibc's mallopt parameter numbers (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
#: The kernel's CPU latency setting ([Note: CPUs that sleep between steps]).
CPU_LATENCY_FILE = Path("/dev/cpu_dma_latency")


def tune_for_latency(sessions: int = 1) -> None:
    """Shorten the GIL switch interval (less so where this process drives several
    ``sessions`` at once, a thread each), keep freed buffers for reuse, and leave the
    objects made so far out of garbage collection, for this process ([Note: GIL switch
    interval], [Note: garbage collection between steps])."""
    sys.setswitchinterval(SWITCH_INTERVAL_S if sessions <= 1 else SESSIONS_SWITCH_INTERVAL_S)
    keep_freed_buffers()
    gc.collect()
    gc.freeze()


def keep_freed_buffers() -> bool:
    """Raise glibc's mmap and trim thresholds ([Note: keeping freed buffers]).

    Returns whether the C library took the settings (False where it has no ``mallopt``).
    """
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (AttributeError, OSError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    done = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
    done = bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)) and done
    if not done:
        logger.debug("the C library refused the malloc thresholds; keeping its defaults")
    return done


@contextmanager
def cpus_awake(asked: bool = True, *, path: Path = CPU_LATENCY_FILE) -> Iterator[bool]:
    """Keep every CPU of the machine from sleeping while the block runs, if ``asked``
    ([Note: CPUs that sleep between steps]); yields whether they are kept awake (False
    where not asked, and with a warning where ``path`` is missing or may not be written)."""
    if not asked:
        yield False
        return
    try:
        held = os.open(path, os.O_WRONLY)
    except OSError as exc:
        logger.warning("cannot keep the CPUs awake: %s (%s)", exc.strerror, path)
        yield False
        return
    try:
        os.write(held, struct.pack("=i", 0))  # a 32-bit latency in µs
        yield True
    finally:
        os.close(held)
