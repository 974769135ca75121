"""A batch of steps in one message: a request whose members run as one batch at the tier.

[Note: a batch in one message]
A tier that runs a batch of decode steps ([Note: the step batcher] in
tierflow/runtime/batching.py) whose members all go on to the next tier can send them up as
one ``Request`` whose ``members`` are the steps' own requests (tier.proto), instead of one
request each that the next tier would gather again from its queue, the first of them
likely run alone because it found the tier idle. The tier that receives it
(:meth:`Tier.run_members <tierflow.runtime.tier.Tier.run_members>`):

1. refuses the whole message with one typed error if it is not a batch of this plan's
   steps (:func:`check_members`): at most :data:`MAX_MEMBERS` members, each of the
   message's plan and segment, none a batch itself, no id and no session twice, and
   nothing else carried by the message itself;
2. takes its members through the tier together, on the one thread the request runs on
   (:meth:`Tier.run_members <tierflow.runtime.tier.Tier.run_members>`). Each member is
   still the request it is: its own decoding, checks, deadline, session order and state,
   and its own typed error when it fails, which fails no other member. Each member's way
   up is a generator (:data:`~tierflow.runtime.pipeline.Climb`) that stops where its step
   goes to the batcher; the thread takes every member that far, hands their steps to the
   batcher at once (:meth:`StepBatcher.run_all
   <tierflow.runtime.batching.StepBatcher.run_all>`), so they share one call with any
   steps queued beside them, and takes each member on from there with its own outputs
   (or its own error). The members that go on to the next tier leave as one request
   (:func:`send_together`), as they came; a tier that runs none of the plan's segments
   (an edge of a cloud-only plan) so passes the message on whole;
3. answers with one ``Reply`` whose ``members`` are the members' replies, in order, once
   each has its answer (:class:`MemberReplies`), from this tier or from the tiers after
   it.

A member whose session has a request still running here (its session's order, [Note: a
stream's requests run at once] in tierflow/runtime/streams.py) waits for it, and then runs
alone. Before, each member ran on a thread of its own and the batch waited for them all
to reach the batcher: one wake-up per member per tier each way, and each thread's decode,
state and encode contending for the GIL with the rest. Measured with 8 lockstep sessions
on a split plan (``benchmarks/batching.py``'s model), the time from a batched message's
arrival to its call went from 4.9 to 3.3 ms at the edge and from 5.0 to 3.2 ms at the
cloud, and from the call's end to the message leaving, from 3.3 to 1.7 and from 2.3 to
1.1 ms.

The sending side, for a batch the tier's batcher formed of steps that came one by one (a
server tier's steps from several devices, or a device's sessions'): each step's thread
takes its own step on after the call, leaving its onward tensors unencoded, as a batched
request's members do (:func:`~tierflow.runtime.batching.departs_together`; one that goes
alone after all is encoded as it is sent); the call's
:class:`~tierflow.runtime.batching.Departure` collects them, each step settling its seat
once (depositing its onward request, or going no further: answered here, or failed; the
tier settles a seat left unsettled whatever happened, so none is waited for in vain), and
the thread that settles the last seat sends what was deposited (:func:`send_together`):
one request whose members are the deposits, in seat order (one deposit goes alone, as
before). Steps of a batched request that share the call are not seated: they go on with
their own request. The next tier's one reply is scattered back (``scatter``): each
member's reply to its own request, with this tier's timing of it and its share of the
link's figures (its own bytes, the message's transfer time); an error for the whole
message (the next tier gone, say) answers every member. Nothing waits: a member that goes
on returns, its reply to come later. A device serving several local sessions does the same
with its batch calls' steps (device/batched_send.py): each caller gets its ticket at once,
resolved from the edge's one reply. So sessions that step together on a device stay
together on every tier, and no tier runs the first of them alone for having found itself
idle.

[Note: a batch's tensors stacked]
The members of a batch that go on together are steps of one call: each carries one row
of the same tensors (a session's step is one sequence). They then leave with their
tensors stacked, one tensor each in the message itself (``Request.tensors``, a member's
row at its seat on axis 0), and the members carry none (:func:`combine`). The tier that
receives them decodes each tensor once (:func:`member_rows`) and gives each member its
rows, checked as a request's own tensors are, once for them all (every member's rows are
slices of the same tensors: ``Tier._rows``); a member that goes on alone
(its session busy here) takes its rows as its own tensors. Member by member, each of the
four step tensors of a member was a header to check and a payload to decode at every
tier, and a tensor to encode at every sender: at 8 members, 32 tensors a message where
there are now 4. Measured on ``benchmarks/batching.py``'s split plan (16 lockstep
sessions, three pairs of runs, 2026-12-07): 83.8 against 87.8 ms a round; at 8 sessions
62.0 against 60.4, no difference the machine resolved that hour. A batch of steps that
came one by one stacks its tensors too (until 2026-12-07 each step's thread encoded its
own): 16 sessions a thread each on one device, split, ``--batch-delay 20ms``, three pairs
of runs in turn: 12.5, 13.0 and 13.7 ms a round outside the tiers' calls against 13.3,
14.6 and 13.7, rounds of 70.0, 71.1 and 72.7 ms against 71.4, 73.7 and 72.5.

What the receiver reads is what each member would have carried: the stack is only made of
tensors still to encode (:attr:`Onward.arrays <tierflow.runtime.pipeline.Onward.arrays>`:
a member's climb, ``together``, leaves them so) with one bit-exact codec, one row each,
of the same names, dtypes and shapes (:func:`stackable`). A quantiser's scales would be
the batch's rather than each member's, so a lossy link's members carry their own; so do
members of different lengths (a first step of each of several prompts). Stacked tensors
are checked before anything is decoded, as a request's are: as many as the tier's
segments need, no name twice, one row a member, each no larger than a member's limit
times the members; a message that breaks these is refused whole.

A device with none of the plan's segments still has a step batcher whose call runs
nothing (``TierRunner._batcher`` in tierflow/runtime/segment_runner.py): with
``--batch-delay``, its sessions' steps meet there as on any tier and go up as one message.
Without that, a cloud-only plan's steps crossed both links one message each, and the cloud
gathered them again from its queue (8 lockstep sessions: 8 messages up and 8 down on each
link a round, where one each now does).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from tierflow.codec.base import decode
from tierflow.errors import CodecError, InputError, TransportError
from tierflow.rpc import tier_pb2
from tierflow.runtime.batching import stack
from tierflow.runtime.pipeline import Onward, Pipeline, encode_onward
from tierflow.runtime.replies import Send
from tierflow.transport.wire import error_to_proto, put_tensors, received

logger = logging.getLogger(__name__)

#: Members one message may carry.
MAX_MEMBERS = 256


def check_members(request: tier_pb2.Request) -> None:
    """Raise an :class:`InputError` unless ``request`` is a batch of its plan's steps
    (step 1 of [Note: a batch in one message])."""
    members = request.members
    if len(members) > MAX_MEMBERS:
        raise InputError(f"a batch carries at most {MAX_MEMBERS} members, this one {len(members)}")
    if request.session or request.initial_state:
        raise InputError(
            "a batched request carries its members (and their tensors, stacked) only: no "
            "session or state of its own"
        )
    stacked = bool(request.tensors)
    ids: set[str] = set()
    sessions: set[tuple[str, str]] = set()
    for i, member in enumerate(members):
        if member.members:
            raise InputError(f"member {i} of a batch is a batch itself")
        if stacked and member.tensors:
            raise InputError(
                f"member {i} of a batch whose tensors are stacked carries tensors of its own"
            )
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


class Forwarder(Protocol):
    """What sends a request on to the next tier (the tier's own
    :class:`~tierflow.runtime.tier.Forwarder` adds opening and closing the way there)."""

    def forward(
        self,
        pipeline: Pipeline,
        index: int,
        onward: Onward,
        request_id: str,
        timing: tier_pb2.TierTiming,
        send: Send,
    ) -> tier_pb2.Reply | None:
        """Send ``onward`` up; its reply comes to ``send`` later (None), or the reply now."""


@dataclass(frozen=True)
class Deposit:
    """What one member of a batch call goes on with: the arguments of
    :meth:`Forwarder.forward`."""

    pipeline: Pipeline
    index: int
    onward: Onward
    request_id: str
    timing: tier_pb2.TierTiming
    send: Send


def send_together(forwarder: Forwarder, tier: str, deposits: Sequence[Deposit]) -> None:
    """Send the members of one batch call that go on as one request ([Note: a batch in one
    message]); their replies go to each member's ``send``."""
    if not deposits:
        return
    before = [d.onward.codec_s for d in deposits]
    if len(deposits) == 1:
        encode_onward(deposits[0].onward)
    else:
        combined = combine([d.onward for d in deposits])
    for deposit, was in zip(deposits, before, strict=True):  # its share of the encoding
        deposit.timing.codec_ms += (deposit.onward.codec_s - was) * 1e3
    if len(deposits) == 1:
        alone = deposits[0]
        reply = forwarder.forward(
            alone.pipeline, alone.index, alone.onward, alone.request_id, alone.timing, alone.send
        )
        if reply is not None:
            alone.send(reply)
        return
    first = deposits[0]
    combined.id = f"batch-{first.request_id}"
    onward = Onward(combined, sum(d.onward.nbytes for d in deposits))

    def scatter(reply: tier_pb2.Reply) -> None:
        _scatter(reply, deposits, tier)

    timing = tier_pb2.TierTiming(tier=tier)  # the members' own timings go with their replies
    try:
        reply = forwarder.forward(first.pipeline, first.index, onward, combined.id, timing, scatter)
    except Exception as exc:  # a bug: every member still gets its one reply
        logger.exception("[%s] sending a batch of %d steps on failed", tier, len(deposits))
        reply = tier_pb2.Reply(plan_id=combined.plan_id, error=error_to_proto(exc, tier))
    if reply is not None:
        scatter(reply)


def combine(onwards: Sequence[Onward]) -> tier_pb2.Request:
    """One request whose members are ``onwards``' requests, in order ([Note: a batch in one
    message]), and whose tensors are theirs stacked, when they can be ([Note: a batch's
    tensors stacked]); else each member carries its own. Each onward's ``nbytes`` and
    ``codec_s`` then count its share of the encoding."""
    first = onwards[0].request
    combined = tier_pb2.Request(plan_id=first.plan_id, segment=first.segment)
    deadlines = [o.request.deadline_unix_s for o in onwards]
    combined.deadline_unix_s = max(deadlines) if all(deadlines) else 0.0
    rows = stackable(onwards)
    for onward in onwards:
        if rows is None:
            encode_onward(onward)
        member = combined.members.add()
        member.CopyFrom(onward.request)
        member.id = str(len(combined.members) - 1)
    if rows is not None:
        start = time.perf_counter()
        codec = onwards[0].codec
        assert codec is not None
        nbytes = put_tensors(combined.tensors, stack(rows), codec)
        share = (time.perf_counter() - start) / len(onwards)
        for onward in onwards:
            onward.nbytes, onward.arrays = nbytes // len(onwards), None
            onward.codec_s += share
    return combined


def stackable(onwards: Sequence[Onward]) -> list[dict[str, np.ndarray]] | None:
    """The members' tensors, to stack ([Note: a batch's tensors stacked]): when there are
    two members or more, each still to encode with one bit-exact codec, and each carries
    one row of the same tensors (names, dtypes, shapes); else None."""
    first = onwards[0]
    if len(onwards) < 2 or first.arrays is None or first.codec is None:
        return None
    if not first.codec.bit_exact:  # a quantiser's scales would be the batch's, not each's
        return None
    codec = str(first.codec)
    layout = {name: (a.dtype, a.shape) for name, a in first.arrays.items()}
    if any(shape[:1] != (1,) for _, shape in layout.values()):
        return None
    rows = []
    for onward in onwards:
        arrays = onward.arrays
        if arrays is None or onward.codec is None or str(onward.codec) != codec:
            return None
        if len(arrays) != len(layout) or any(
            layout.get(name) != (a.dtype, a.shape) for name, a in arrays.items()
        ):
            return None
        rows.append({name: arrays[name] for name in layout})
    return rows


def member_rows(
    request: tier_pb2.Request, max_tensor_bytes: int, tensors: int
) -> list[dict[str, np.ndarray]]:
    """Each member's rows of a batch's stacked tensors, in member order, decoded once
    ([Note: a batch's tensors stacked]). The headers are checked before anything is
    decoded: ``tensors`` of them at most (what the tier's segments need), no name twice,
    each one row a member, each no larger than ``max_tensor_bytes`` a member. The rows
    are then checked as a request's tensors are (their dtypes and shapes,
    :meth:`Pipeline.check_rows <tierflow.runtime.pipeline.Pipeline.check_rows>`)."""
    count = len(request.members)
    if len(request.tensors) != tensors:
        raise InputError(
            f"a batch's stacked tensors are {len(request.tensors)}, the tier expects {tensors}"
        )
    encoded = [received(t, max_bytes=max_tensor_bytes * count) for t in request.tensors]
    names = {t.name for t, _ in encoded}
    if len(names) != len(encoded):
        raise CodecError(f"tensor names repeat in one batch: {sorted(names)}")
    for tensor, _ in encoded:
        if tensor.shape[:1] != (count,):
            raise InputError(
                f"stacked tensor {tensor.name!r} of a batch of {count} members has shape "
                f"{list(tensor.shape)}: expected one row a member on axis 0"
            )
    whole = {t.name: decode(t, checked=c, writable=False) for t, c in encoded}
    return [{name: value[i : i + 1] for name, value in whole.items()} for i in range(count)]


def _scatter(reply: tier_pb2.Reply, deposits: Sequence[Deposit], tier: str) -> None:
    """The next tier's one reply to a batch, as each member's own ([Note: a batch in one
    message])."""
    members = list(reply.members)
    if not reply.HasField("error") and len(members) != len(deposits):
        wrong = TransportError(
            f"the next tier answered a batch of {len(deposits)} steps with {len(members)} replies"
        )
        reply = tier_pb2.Reply(plan_id=reply.plan_id, error=error_to_proto(wrong, tier))
    if reply.HasField("error"):
        members = []
        for _ in deposits:
            each = tier_pb2.Reply(plan_id=reply.plan_id, fallback=reply.fallback)
            each.error.CopyFrom(reply.error)
            members.append(each)
    for deposit, answer in zip(deposits, members, strict=True):
        answer.id = deposit.request_id
        answer.timings.append(deposit.timing)
        for link in reply.links:  # the message's transfer, this member's bytes
            share = answer.links.add()
            share.CopyFrom(link)
            share.bytes = deposit.onward.nbytes
        deposit.send(answer)
