"""A tier's session state in its metrics: by owner's name, never by token; its step
batchers' calls by size."""

from __future__ import annotations

import numpy as np
import pytest

from tierflow.runtime.batching import BatchStats
from tierflow.runtime.metrics import TierMetrics
from tierflow.state.spec import StateSpec
from tierflow.state.store import SESSION_OVERHEAD, SessionStates

prometheus = pytest.importorskip("prometheus_client")
parser = pytest.importorskip("prometheus_client.parser")

RNN = StateSpec("state", "stateN", "float32", (1, 8))


def test_state_bytes_and_sessions_are_shown_by_owner() -> None:
    states = SessionStates("cloud", budget=3 * (32 + 12 + SESSION_OVERHEAD))
    value = {"state": np.zeros((1, 8), np.float32)}
    for owner, name in (("token:alice", "s1"), ("token:alice", "s2"), ("token:bob", "s1")):
        states.commit(name, "p", 0, [RNN], value, owner=owner)
    states.commit("s3", "p", 0, [RNN], value, owner="token:bob")  # one over: alice's oldest
    metrics = TierMetrics("cloud", lambda: 0.0, states=lambda: states)
    text = prometheus.generate_latest(metrics.registry).decode()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in parser.text_string_to_metric_families(text)
        for s in family.samples
    }
    one = 32 + len("s1") + len("token:alice") + SESSION_OVERHEAD
    assert samples["tierflow_state_sessions", (("identity", "token:alice"), ("tier", "cloud"))] == 1
    assert samples["tierflow_state_bytes", (("identity", "token:bob"), ("tier", "cloud"))] == (
        2 * (one - 2)  # "token:bob" is two bytes shorter than "token:alice"
    )
    assert samples["tierflow_state_evictions_total", (("tier", "cloud"),)] == 1


def test_batch_calls_are_counted_by_size_over_every_plans_batcher() -> None:
    one = BatchStats(sizes={1: 5, 4: 2}, seconds={1: 0.5, 4: 0.25})
    two = BatchStats(sizes={4: 1, 16: 3}, seconds={4: 0.125, 16: 1.5})
    metrics = TierMetrics("cloud", lambda: 0.0, batches=lambda: [one, two])
    text = prometheus.generate_latest(metrics.registry).decode()

    def samples(name: str) -> dict[str, float]:
        return {
            s.labels["size"]: s.value
            for family in parser.text_string_to_metric_families(text)
            for s in family.samples
            if s.name == name
        }

    assert samples("tierflow_batch_calls_total") == {"1": 5, "4": 3, "16": 3}
    assert samples("tierflow_batch_call_seconds_total") == {"1": 0.5, "4": 0.375, "16": 1.5}
