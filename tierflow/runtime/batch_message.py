"""A batch of steps in one message: a request whose members run as one batch at the tier.

[Note: a batch in one message]
A tier that runs a batch of decode steps ([Note: the step batcher] in
tierflow/runtime/batching.py) whose members all go on to the next tier can send them up as
one ``Request`` whose ``members`` are the steps' own requests (tier.proto), instead of one
request each that the next tier would gather again from its queue, the first of them
likely run alone because it found the tier idle. The tier that receives it
(:meth:`TierService.run_members <tierflow.runtime.service.TierService.run_members>`):

1. refuses the whole message with one typed error if it is not a batch of this plan's
   steps (:func:`check_members`): at most :data:`MAX_MEMBERS` members, each of the
   message's plan and segment, none a batch itself, no id and no session twice, and
   nothing else carried by the message itself;
2. takes each member through the tier as the request it is, on a thread of its own: its
   own decoding, checks, deadline, session order and state, and its own typed error when
   it fails, which fails no other member; the members' steps reach the batcher as one
   :class:`~tierflow.runtime.batching.Convoy`, and the batch waits (at most
   ``CONVOY_WAIT_S``) until each member's step has arrived or will not, so they share one
   call however the tier's threads are scheduled;
3. answers with one ``Reply`` whose ``members`` are the members' replies, in order, once
   each has its answer (:class:`MemberReplies`), from this tier or from the tiers after
   it.

The receiving side is all of it so far: the tiers still send a batch's steps up one
request each (what each member goes on with is encoded on its own thread), so an edge
receiving a batch sends its members to the cloud one by one, and the device and the edge
do not yet gather a batch's onward requests into one message.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from tierflow.errors import InputError
from tierflow.rpc import tier_pb2

#: Members one message may carry.
MAX_MEMBERS = 256


def check_members(request: tier_pb2.Request) -> None:
    """Raise an :class:`InputError` unless ``request`` is a batch of its plan's steps
    (step 1 of [Note: a batch in one message])."""
    members = request.members
    if len(members) > MAX_MEMBERS:
        raise InputError(f"a batch carries at most {MAX_MEMBERS} members, this one {len(members)}")
    if request.tensors or request.session or request.initial_state:
        raise InputError(
            "a batched request carries its members only: no tensors, session or state of its own"
        )
    ids: set[str] = set()
    sessions: set[tuple[str, str]] = set()
    for i, member in enumerate(members):
        if member.members:
            raise InputError(f"member {i} of a batch is a batch itself")
        if member.plan_id != request.plan_id or member.segment != request.segment:
            raise InputError(
                f"member {i} of a batch of plan {request.plan_id} at segment "
                f"{request.segment} is of plan {member.plan_id} at segment {member.segment}"
            )
        if member.id in ids:
            raise InputError(f"member id {member.id!r} repeats in one batch")
        ids.add(member.id)
        if member.session:
            session = (member.on_behalf_of, member.session)
            if session in sessions:
                raise InputError(f"session {member.session!r} has two steps in one batch")
            sessions.add(session)


class MemberReplies:
    """The members' replies, sent down as one ``Reply`` once each has come (step 3 of
    [Note: a batch in one message]). Thread-safe; a member's second reply is dropped."""

    def __init__(self, request: tier_pb2.Request, send: Callable[[tier_pb2.Reply], None]) -> None:
        self._request_id = request.id
        self._plan_id = request.plan_id
        self._ids = [member.id for member in request.members]
        self._replies: list[tier_pb2.Reply | None] = [None] * len(self._ids)
        self._left = len(self._ids)
        self._lock = threading.Lock()
        self._send = send

    def put(self, seat: int, reply: tier_pb2.Reply) -> None:
        """Member ``seat``'s reply; the last one sends them all."""
        reply.id = self._ids[seat]
        with self._lock:
            if self._replies[seat] is not None:
                return
            self._replies[seat] = reply
            self._left -= 1
            if self._left:
                return
        answer = tier_pb2.Reply(id=self._request_id, plan_id=self._plan_id)
        answer.members.extend(r for r in self._replies if r is not None)
        self._send(answer)
