"""A batch in one message ([Note: a batch in one message]): what a batched request may
carry, its members' replies sent as one in order, and a convoy's steps sharing one call."""

from __future__ import annotations

import threading
from collections.abc import Mapping

import numpy as np
import pytest

from tierflow.errors import InputError
from tierflow.rpc import tier_pb2
from tierflow.runtime.batch_message import MAX_MEMBERS, MemberReplies, check_members
from tierflow.runtime.batching import Convoy, StepBatcher


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
    with pytest.raises(InputError, match="carries its members only"):
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


def convoy_run(size: int, arriving: list[int]) -> tuple[list[int], list[object]]:
    """``arriving`` members of a convoy of ``size`` run through a batcher, each on its own
    thread, the others settled without arriving; each call's rows and each result."""
    calls: list[int] = []

    def run(feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        calls.append(int(feeds["x"].shape[0]))
        return double(feeds)

    batcher = StepBatcher(run, name="test", max_batch=8, convoy_wait_s=30)
    convoy = Convoy(size)
    results: list[object] = [None] * size

    def go(seat: int) -> None:
        feeds = {"x": np.full((1, 2), seat, dtype=np.float32)}
        results[seat] = batcher.run(feeds, member=seat, convoy=(convoy, seat))

    threads = [threading.Thread(target=go, args=(seat,)) for seat in arriving]
    for thread in threads:
        thread.start()
    for seat in set(range(size)) - set(arriving):
        convoy.settle(seat)  # failed before the batcher, say
    for thread in threads:
        thread.join(30)
    return calls, results


def test_a_convoys_steps_share_one_call_however_they_arrive() -> None:
    calls, results = convoy_run(4, [0, 1, 2, 3])
    assert calls == [4]  # the first to arrive found the batcher idle, and waited for them
    for seat, result in enumerate(results):
        assert isinstance(result, dict) and result["y"].tolist() == [[2.0 * seat] * 2]


def test_a_convoy_member_that_will_not_arrive_holds_nothing_up() -> None:
    calls, results = convoy_run(4, [0, 2, 3])
    assert calls == [3]
    assert results[1] is None and all(isinstance(results[s], dict) for s in (0, 2, 3))


def test_a_convoy_settles_each_member_once_and_wakes_its_listeners() -> None:
    convoy = Convoy(2)
    woken: list[int] = []
    convoy.listen(lambda: woken.append(1))
    convoy.settle(0)
    convoy.settle(0)
    assert not convoy.complete() and woken == [1]
    convoy.settle(1)
    assert convoy.complete() and woken == [1, 1]
