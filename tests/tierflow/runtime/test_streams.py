"""A stream's reader keeps each session's requests in the order they were read
([Note: a stream's requests run at once] in tierflow/runtime/streams.py).

The pool threads a real stream hands its reading to are stood in for by a pool that runs
each task at once: what happens to a session's next request is then fixed, not a race.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from tierflow.rpc import tier_pb2
from tierflow.runtime.session_order import SessionOrder
from tierflow.runtime.streams import StreamReader


class _InlineHost:
    """The part of a tier a :class:`StreamReader` uses, with a pool that runs each task at
    once on the calling thread: the reading handed on so runs before the reader goes on,
    the order a loaded machine can give two pool threads."""

    name = "cloud"
    plan_id = "p"
    metrics = None
    down_link = "edge-cloud"

    def __init__(self) -> None:
        self.plans = type("Plans", (), {"plans": [type("Plan", (), {"plan_id": "p"})()]})()
        self.order = SessionOrder()
        self.pool = self
        self.running = contextlib.nullcontext()
        self.handled: list[str] = []

    def submit(self, task: Callable[[], None]) -> bool:
        task()
        return True

    def admit_request(self) -> None:
        return None

    def hold(self, request: tier_pb2.Request, caller: str) -> Callable[[], None]:
        return lambda: None

    def answered(self) -> None:
        pass

    def handle(self, request: tier_pb2.Request, *_: object) -> tier_pb2.Reply:
        self.handled.append(request.id)
        return tier_pb2.Reply(id=request.id, plan_id="p")


def test_a_sessions_next_request_read_on_another_thread_runs_after_the_one_read_before() -> None:
    """Each request takes its place in its session's order before the reading is handed
    on: a fresh-clone CI run at load 5-9 once ran a session's second step before its first
    (that step then found no state, and the device replayed the session)."""
    host = _InlineHost()
    replies: list[str] = []
    requests = [tier_pb2.Request(id=f"r{n}", plan_id="p", session="s") for n in range(3)]
    sink = type("Sink", (), {"put": lambda self, reply, size: replies.append(reply.id)})()
    reader = StreamReader(host, iter(requests), None, sink, lambda: None)  # type: ignore[arg-type]
    reader.read()
    assert host.handled == ["r0", "r1", "r2"]
    assert sorted(replies) == ["r0", "r1", "r2"]
