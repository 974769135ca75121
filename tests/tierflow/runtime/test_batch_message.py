"""A batch in one message ([Note: a batch in one message]): what a batched request may
carry, its members' replies sent as one in order, their steps sharing one call, and
a batch's members that go on sent as one request and answered each."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import pytest

from tierflow.codec.spec import CodecSpec
from tierflow.errors import CodecError, InputError
from tierflow.rpc import tier_pb2
from tierflow.runtime.batch_message import (
    MAX_MEMBERS,
    Deposit,
    MemberReplies,
    check_members,
    combine,
    member_rows,
    send_together,
)
from tierflow.runtime.batching import Departure, Pending, StepBatcher, departure_seat
from tierflow.runtime.pipeline import Onward
from tierflow.transport.wire import put_tensors


def batch(*members: tier_pb2.Request) -> tier_pb2.Request:
    request = tier_pb2.Request(id="b", plan_id="p", segment=1)
    request.members.extend(members)
    return request


def member(i: int, session: str = "", **fields: object) -> tier_pb2.Request:
    given: dict[str, object] = {"plan_id": "p", "segment": 1, **fields}
    return tier_pb2.Request(id=f"m{i}", session=session or f"s{i}", **given)


def test_a_batch_of_the_plans_steps_passes() -> None:
    check_members(batch(member(0), member(1), member(2)))
    # The same session id on behalf of two owners is two sessions.
    check_members(batch(member(0, "s"), member(1, "s", on_behalf_of="other")))


@pytest.mark.parametrize(
    "request_, why",
    [
        (batch(member(0), member(1, plan_id="q")), "is of plan q"),
        (batch(member(0), member(1, segment=2)), "at segment 2"),
        (batch(member(0), batch(member(1))), "is a batch itself"),
        (batch(member(0), member(0)), "repeats in one batch"),
        (batch(member(0, "s"), member(1, "s")), "has two steps in one batch"),
        (batch(*[member(i) for i in range(MAX_MEMBERS + 1)]), f"at most {MAX_MEMBERS}"),
    ],
)
def test_anything_else_is_refused_whole(request_: tier_pb2.Request, why: str) -> None:
    with pytest.raises(InputError, match=why):
        check_members(request_)


def test_a_batch_carries_nothing_of_its_own() -> None:
    request = batch(member(0))
    request.session = "mine"
    with pytest.raises(InputError, match=r"carries its members .* only"):
        check_members(request)


def test_member_replies_go_down_as_one_in_order_once_all_came() -> None:
    sent: list[tier_pb2.Reply] = []
    replies = MemberReplies(batch(member(0), member(1), member(2)), sent.append)
    replies.put(2, tier_pb2.Reply(answered_by="cloud"))
    replies.put(0, tier_pb2.Reply(answered_by="edge"))
    replies.put(0, tier_pb2.Reply(answered_by="twice"))  # dropped
    assert sent == []
    replies.put(1, tier_pb2.Reply(error=tier_pb2.Error(message="bad")))
    assert len(sent) == 1
    answer = sent[0]
    assert answer.id == "b" and answer.plan_id == "p"
    assert [r.id for r in answer.members] == ["m0", "m1", "m2"]
    assert [r.answered_by for r in answer.members] == ["edge", "", "cloud"]
    assert answer.members[1].error.message == "bad"


def double(feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {"y": feeds["x"] * 2}


def counting() -> tuple[list[int], Callable[[Mapping[str, np.ndarray]], dict[str, np.ndarray]]]:
    """A step function that doubles ``x``, and the rows of each call it made; a row of
    -1 fails its call."""
    calls: list[int] = []

    def run(feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        calls.append(int(feeds["x"].shape[0]))
        if (feeds["x"] < 0).any():
            raise ValueError("a bad tensor")
        return double(feeds)

    return calls, run


def steps(batcher: StepBatcher, *values: float) -> list[Pending]:
    return [
        Pending(batcher, {"x": np.full((1, 2), v, dtype=np.float32)}, member=f"s{i}")
        for i, v in enumerate(values)
    ]


def test_a_batched_requests_steps_share_one_call_from_one_thread() -> None:
    calls, run = counting()
    batcher = StepBatcher(run, name="test", max_batch=8)
    results = batcher.run_all(steps(batcher, 0, 1, 2, 3))
    assert calls == [4]
    for seat, result in enumerate(results):
        assert isinstance(result, dict) and result["y"].tolist() == [[2.0 * seat] * 2]


def test_a_batched_requests_failing_step_fails_alone() -> None:
    calls, run = counting()
    batcher = StepBatcher(run, name="test", max_batch=8)
    results = batcher.run_all(steps(batcher, 0, -1, 2))
    assert calls == [3, 1, 1, 1]  # the batch, then each step alone
    assert isinstance(results[1], ValueError)
    assert isinstance(results[0], dict) and isinstance(results[2], dict)


def test_steps_that_came_alone_go_on_without_those_of_a_batched_request() -> None:
    """A call with a step that came alone and the steps of a batched request: the lone
    step's departure is its own (the batched request's steps go on with their request),
    so it leaves at once, waiting for no one."""
    calls, run = counting()
    running, release = threading.Event(), threading.Event()

    def held(feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        if not calls:
            running.set()
            release.wait(30)
        return run(feeds)

    batcher = StepBatcher(held, name="test", max_batch=8)
    first = threading.Thread(target=batcher.run, args=({"x": np.ones((1, 2), np.float32)},))
    first.start()  # the batcher is busy with it
    assert running.wait(30)
    seats: list[object] = []

    def alone() -> None:
        batcher.run({"x": np.ones((1, 2), np.float32)}, member="alone")
        seats.append(departure_seat())

    def queued(count: int) -> bool:
        with batcher._cond:
            return batcher._cond.wait_for(lambda: len(batcher._queue) >= count, 30)

    lone = threading.Thread(target=alone)
    lone.start()
    assert queued(1)
    together = threading.Thread(target=batcher.run_all, args=(steps(batcher, 5, 6),))
    together.start()
    assert queued(3)
    release.set()
    for thread in (first, lone, together):
        thread.join(30)
    assert calls == [1, 3]
    (seat,) = seats
    assert isinstance(seat, tuple)
    departure, index = seat
    assert departure.deposit(index, "mine") == ["mine"]


class AnsweringForwarder:
    """A next tier that answers a batched request at once with ``answer(request)``."""

    def __init__(self, answer: Callable[[tier_pb2.Request], tier_pb2.Reply]) -> None:
        self.answer = answer
        self.sent: list[tier_pb2.Request] = []

    def forward(
        self,
        pipeline: Any,
        index: int,
        onward: Onward,
        request_id: str,
        timing: tier_pb2.TierTiming,
        send: Callable[[tier_pb2.Reply], None],
    ) -> tier_pb2.Reply | None:
        self.sent.append(onward.request)
        reply = self.answer(onward.request)
        reply.links.add(link="edge-cloud", bytes=onward.nbytes, send_ms=2.0)
        send(reply)
        return None


def deposits(count: int, got: dict[str, tier_pb2.Reply]) -> list[Deposit]:
    out = []
    for i in range(count):
        request = tier_pb2.Request(plan_id="p", segment=2, session=f"s{i}", deadline_unix_s=5.0 + i)
        out.append(
            Deposit(
                None,  # type: ignore[arg-type]  # only passed on to the forwarder
                0,
                Onward(request, 100 + i),
                f"r{i}",
                tier_pb2.TierTiming(tier="edge", compute_ms=float(i)),
                lambda reply, i=i: got.__setitem__(f"r{i}", reply),
            )
        )
    return out


def test_members_that_go_on_are_sent_as_one_request_and_answered_each() -> None:
    def answer(request: tier_pb2.Request) -> tier_pb2.Reply:
        reply = tier_pb2.Reply(id=request.id, plan_id="p")
        for member in request.members:
            reply.members.add(id=member.id, answered_by="cloud", exit=member.session)
        return reply

    forwarder = AnsweringForwarder(answer)
    got: dict[str, tier_pb2.Reply] = {}
    send_together(forwarder, "edge", deposits(3, got))
    (sent,) = forwarder.sent
    assert [m.session for m in sent.members] == ["s0", "s1", "s2"]
    assert [m.id for m in sent.members] == ["0", "1", "2"]
    assert sent.segment == 2 and sent.deadline_unix_s == 7.0  # the latest member's
    for i in range(3):
        reply = got[f"r{i}"]
        assert reply.id == f"r{i}" and reply.exit == f"s{i}"  # its own answer
        assert [t.compute_ms for t in reply.timings] == [float(i)]
        assert [(s.bytes, s.send_ms) for s in reply.links] == [(100 + i, 2.0)]


@pytest.mark.parametrize(
    "answer, code",
    [
        (
            lambda r: tier_pb2.Reply(error=tier_pb2.Error(code=tier_pb2.UPSTREAM_UNAVAILABLE)),
            "UPSTREAM_UNAVAILABLE",
        ),
        (lambda r: tier_pb2.Reply(members=[tier_pb2.Reply()]), "UNAVAILABLE"),  # 1 of 2
    ],
)
def test_a_failed_batch_answers_every_member(
    answer: Callable[[tier_pb2.Request], tier_pb2.Reply], code: str
) -> None:
    got: dict[str, tier_pb2.Reply] = {}
    send_together(AnsweringForwarder(answer), "edge", deposits(2, got))
    assert sorted(got) == ["r0", "r1"]
    assert {tier_pb2.ErrorCode.Name(r.error.code) for r in got.values()} == {code}


def test_a_lone_member_goes_as_before() -> None:
    forwarder = AnsweringForwarder(lambda r: tier_pb2.Reply(answered_by="cloud"))
    got: dict[str, tier_pb2.Reply] = {}
    send_together(forwarder, "edge", deposits(1, got))
    assert not forwarder.sent[0].members and forwarder.sent[0].session == "s0"
    assert got["r0"].answered_by == "cloud"


def test_a_departure_hands_every_deposit_to_the_last_to_settle() -> None:
    departure = Departure(3)
    assert departure.deposit(1, "b") is None
    assert departure.settle(0) is None
    assert departure.settle(0) is None  # settled already
    assert departure.deposit(2, "c") == ["b", "c"]
    assert departure.settle(2) is None


# A batch's members' tensors, stacked ([Note: a batch's tensors stacked]).


def onward(i: int, arrays: dict[str, np.ndarray] | None, codec: str = "raw") -> Onward:
    request = tier_pb2.Request(plan_id="p", segment=2, session=f"s{i}")
    return Onward(request, 0, arrays=arrays, codec=CodecSpec.parse(codec))


def rows(i: int, width: int = 3) -> dict[str, np.ndarray]:
    return {
        "h": np.arange(width, dtype=np.float32)[None] / (i + 3),
        "ids": np.array([[i]], dtype=np.int64),
    }


def test_members_go_on_stacked_and_come_back_apart_bit_for_bit() -> None:
    onwards = [onward(i, rows(i)) for i in range(3)]
    combined = combine(onwards)
    check_members(combined)
    assert not any(m.tensors for m in combined.members)
    assert {t.name: list(t.shape) for t in combined.tensors} == {"h": [3, 3], "ids": [3, 1]}
    assert sum(o.nbytes for o in onwards) == sum(len(t.data) for t in combined.tensors)
    assert all(o.arrays is None for o in onwards)
    back = member_rows(combined, max_tensor_bytes=1 << 20, tensors=2)
    for i, got in enumerate(back):
        for name, value in rows(i).items():
            assert got[name].dtype == value.dtype
            assert got[name].tobytes() == value.tobytes()


@pytest.mark.parametrize(
    "onwards",
    [
        [onward(i, rows(i), "int8") for i in range(2)],  # lossy: each member its own scale
        [onward(0, rows(0)), onward(1, rows(1, width=4))],  # shapes differ
        [onward(0, rows(0)), onward(1, None)],  # encoded already
        [onward(i, {"h": np.zeros((2, 3), np.float32)}) for i in range(2)],  # two rows each
        [onward(0, rows(0))],  # alone
    ],
)
def test_members_that_do_not_stack_carry_their_own(onwards: list[Onward]) -> None:
    own = [len(o.arrays or {}) for o in onwards]
    combined = combine(onwards)
    assert not combined.tensors
    assert [len(m.tensors) for m in combined.members] == own


def stacked(count: int, rows_: int) -> tier_pb2.Request:
    request = batch(*[member(i) for i in range(count)])
    put_tensors(request.tensors, {"h": np.zeros((rows_, 3), np.float32)}, CodecSpec.parse("raw"))
    return request


@pytest.mark.parametrize(
    "request_, tensors, error, why",
    [
        (stacked(2, 3), 1, InputError, "one row a member"),
        (stacked(2, 2), 2, InputError, "the tier expects 2"),
    ],
)
def test_stacked_tensors_of_the_wrong_shape_or_count_are_refused_whole(
    request_: tier_pb2.Request, tensors: int, error: type[Exception], why: str
) -> None:
    with pytest.raises(error, match=why):
        member_rows(request_, max_tensor_bytes=1 << 20, tensors=tensors)


def test_a_stacked_batch_whose_member_carries_tensors_is_refused() -> None:
    request = stacked(2, 2)
    put_tensors(request.members[1].tensors, rows(1), CodecSpec.parse("raw"))
    with pytest.raises(InputError, match="carries tensors of its own"):
        check_members(request)


def test_stacked_rows_are_each_no_larger_than_a_members_limit() -> None:
    with pytest.raises(CodecError):
        member_rows(stacked(2, 2), max_tensor_bytes=8, tensors=1)  # 12 bytes a row
