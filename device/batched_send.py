"""A device's batch of steps sent up to the edge as one message.

A device serving several local sessions runs their steps as one call (the step batcher,
``tierflow.runtime.batching``); the steps that go on to the edge leave as one request whose
members are theirs ([Note: a batch in one message] in tierflow/runtime/batch_message.py),
so the edge runs them as one call too instead of gathering them again. Each step's caller
gets its own :class:`~tierflow.device.results.Ticket` at once, on a :class:`Sent` of its
own (:func:`member_sent`); the thread that settles the batch's last seat sends the
message (:func:`send_up`), and the edge's one reply resolves each member's ticket with its
own reply and its share of the link's figures (its own bytes, the message's transfer).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

from tierflow.errors import TierflowError, TransportError
from tierflow.link.emulation import Transfer
from tierflow.rpc import tier_pb2
from tierflow.runtime.batch_message import combine
from tierflow.runtime.pipeline import Onward, encode_onward
from tierflow.runtime.upstream import Upstream
from tierflow.transport.stream_client import Sent
from tierflow.transport.wire import error_to_proto


@dataclass(frozen=True)
class DeviceDeposit:
    """One member of a device's batch call that goes on: its onward request, the member's
    own :class:`Sent` (resolved from the batch's reply) and its deadline (monotonic)."""

    onward: Onward
    sent: Sent
    deadline: float | None


def member_sent(onward: Onward) -> Sent:
    """A member's own :class:`Sent`: its reply comes when its batch's does."""
    future: Future[tier_pb2.Reply] = Future()
    return Sent(future, Transfer(onward.nbytes, time.monotonic()), wire_id="")


def send_up(
    upstream: Upstream, deposits: Sequence[DeviceDeposit], on_sent: Callable[[Sent], None]
) -> None:
    """Send the members of one batch call as one request (one alone as it is); each
    member's reply goes to its own :class:`Sent`. ``on_sent`` sees what was sent."""
    if not deposits:
        return
    deadlines = [d.deadline for d in deposits]
    deadline = None if None in deadlines else max(d for d in deadlines if d is not None)
    if len(deposits) == 1:
        request = encode_onward(deposits[0].onward).request
    else:
        request = combine([d.onward for d in deposits])
    nbytes = sum(d.onward.nbytes for d in deposits)
    try:
        sent = upstream.submit(request, deadline=deadline, nbytes=nbytes)
    except TierflowError as exc:
        for deposit in deposits:
            deposit.sent.future.set_exception(exc)
        return
    on_sent(sent)
    sent.future.add_done_callback(lambda _: _scatter(sent, deposits))


def _scatter(sent: Sent, deposits: Sequence[DeviceDeposit]) -> None:
    """The edge's reply to a batch (or to one member sent alone), as each member's own."""
    try:
        reply = sent.future.result()
    except BaseException as exc:
        error = exc if isinstance(exc, TierflowError) else TransportError(str(exc))
        for deposit in deposits:
            deposit.sent.transfer = _share(sent.transfer, deposit)
            deposit.sent.future.set_exception(error)
        return
    if len(deposits) == 1:
        answers = [reply]
    elif reply.HasField("error") or len(reply.members) != len(deposits):
        if not reply.HasField("error"):
            wrong = TransportError(
                f"the edge answered a batch of {len(deposits)} steps with "
                f"{len(reply.members)} replies"
            )
            reply = tier_pb2.Reply(plan_id=reply.plan_id, error=error_to_proto(wrong, "device"))
        answers = []
        for _ in deposits:
            each = tier_pb2.Reply(plan_id=reply.plan_id, fallback=reply.fallback)
            each.error.CopyFrom(reply.error)
            each.timings.extend(reply.timings)
            answers.append(each)
    else:
        answers = list(reply.members)
    for deposit, answer in zip(deposits, answers, strict=True):
        deposit.sent.transfer = _share(sent.transfer, deposit)
        deposit.sent.future.set_result(answer)


def _share(transfer: Transfer, deposit: DeviceDeposit) -> Transfer:
    """The message's transfer, with this member's bytes."""
    return dataclasses.replace(transfer, nbytes=deposit.onward.nbytes)
