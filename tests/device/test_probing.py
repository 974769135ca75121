"""The idle prober's schedule: while requests are answered without the link, it probes often.

See [Note: idle probes] in tierflow/device/probing.py; tests/edge/test_idle_probe.py runs
probes against a real edge.
"""

from __future__ import annotations

import time

import grpc
import pytest

from tierflow.device.probing import DEFAULT_DEMAND_S, IdleProber
from tierflow.errors import UsageError


def _attempts(prober: IdleProber) -> int:
    return prober.probes + prober.failures


@pytest.mark.integration
def test_a_device_answering_alone_probes_every_demand_interval() -> None:
    # Nothing listens on port 9: each probe fails at once, and counts as an attempt.
    with grpc.insecure_channel("127.0.0.1:9") as channel:
        prober = IdleProber(
            channel, busy=lambda: False, rate=lambda: 1e6, report=lambda *_: None, idle_s=1.0
        )
        assert prober.demand_s == DEFAULT_DEMAND_S < prober.idle_s
        prober.start()
        try:
            ends = time.monotonic() + 1.6
            while time.monotonic() < ends:  # a request answered alone every 50 ms
                prober.demand()
                time.sleep(0.05)
            answering = _attempts(prober)
            idle_from = time.monotonic()
            time.sleep(1.6)  # then nothing at all: back to idle_s, doubling
            idle = _attempts(prober) - answering
        finally:
            prober.close()
    # One at 1 s without demand; every 0.25 s with it: 1.6 s hold 4 or more.
    assert answering >= 4, answering
    assert idle <= 2, (idle, time.monotonic() - idle_from)


def test_the_demand_interval_is_never_longer_than_the_idle_time() -> None:
    with grpc.insecure_channel("127.0.0.1:9") as channel:
        prober = IdleProber(
            channel, busy=lambda: False, rate=lambda: 1e6, report=lambda *_: None, idle_s=0.1
        )
        assert prober.demand_s == 0.1
        with pytest.raises(UsageError):
            IdleProber(
                channel,
                busy=lambda: False,
                rate=lambda: 1e6,
                report=lambda *_: None,
                demand_s=0.0,
            )
