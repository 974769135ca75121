"""What the device gets back for a request: a :class:`Result`, waited for on a :class:`Ticket`.

A :class:`Ticket` is a request on its way; its :meth:`~Ticket.result` is the request's one
:class:`Result` (outputs or a typed error, with every tier's timings and every link's
figures), given by the deadline at the latest ([Note: one reply per request] in
tierflow/transport/stream_client.py).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tierflow.codec.base import DEFAULT_MAX_TENSOR_BYTES
from tierflow.errors import DeadlineError, TierflowError
from tierflow.link.spec import LINKS, TIERS
from tierflow.rpc import tier_pb2
from tierflow.runtime.pipeline import Answered, Down
from tierflow.transport.deadline import DEFAULT_DEADLINE_S
from tierflow.transport.stream_client import Sent
from tierflow.transport.wire import decode_tensors, error_from_proto

#: The way down for a request the device sent up: :meth:`Pipeline.came_down` with its plan
#: and what it sent, given the reply (or why none came) and the outputs decoded from it.
CameDown = Callable[[tier_pb2.Reply | BaseException, Mapping[str, np.ndarray] | None], Down]


@dataclass(frozen=True)
class Result:
    """One request's outcome, as the device saw it.

    ``outputs`` are the model outputs, or, when an early exit answered, that exit's class
    scores under the exit's name. ``bytes`` and ``rate_bps`` are per link, as measured by
    the sender of the request's features on that link (0 where nothing crossed; the rate
    is over the transfer time only, see [Note: honest link figures]).
    ``ms`` holds each tier's compute + codec time, ``queue`` (all waiting: at each
    receiver before its work started, and at each sender behind earlier messages),
    ``total`` (wall time on the device) and ``network`` (total minus the tiers and the
    waiting: transfers, propagation, gRPC and the way back).
    ``error`` is set, and ``outputs`` empty, when the request failed. ``timings`` splits
    each tier's time into ``compute_ms``, ``codec_ms`` and ``queue_ms``; ``links`` each
    link's into ``queue_ms`` (at its sender) and ``transfer_ms``. ``fallback`` marks an
    answer given without a tier the request's plan needed, and ``fallback_reason`` says
    which tier was missing and how the answer came instead ([Note: device fallback],
    [Note: losing a tier]). ``plan`` is the id of the plan the request ran on;
    ``switch`` says why the device changed plans at this request (None if it did not).
    """

    id: str
    outputs: dict[str, np.ndarray] = field(default_factory=dict)
    answered_by: str | None = None
    exit: str | None = None
    cache_hit: bool = False
    bytes: dict[str, int] = field(default_factory=dict)
    rate_bps: dict[str, float] = field(default_factory=dict)
    ms: dict[str, float] = field(default_factory=dict)
    error: TierflowError | None = None
    timings: dict[str, dict[str, float]] = field(default_factory=dict)
    links: dict[str, dict[str, float]] = field(default_factory=dict)
    fallback: bool = False
    plan: str | None = None
    switch: str | None = None
    fallback_reason: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def unwrap(self) -> Result:
        """Return self, or raise the request's error."""
        if self.error is not None:
            raise self.error
        return self

    def to_dict(self) -> dict[str, Any]:
        """The report line of this request (``R.jsonl``); outputs are not included."""
        error = None
        if self.error is not None:
            error = {
                "type": type(self.error).__name__,
                "code": getattr(self.error, "code", None),
                "tier": getattr(self.error, "tier", None),
                "message": str(self.error),
            }
        return {
            "id": self.id,
            "answered_by": self.answered_by,
            "exit": self.exit,
            "cache_hit": self.cache_hit,
            "bytes": dict(self.bytes),
            "rate_bps": dict(self.rate_bps),
            "ms": dict(self.ms),
            "error": error,
            "timings": {tier: dict(parts) for tier, parts in self.timings.items()},
            "links": {link: dict(parts) for link, parts in self.links.items()},
            "fallback": self.fallback,
            "fallback_reason": self.fallback_reason,
            "plan": self.plan,
            "switch": self.switch,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Result:
        """A report line read back (outputs are not in reports; errors become TierflowError)."""
        error = data.get("error")
        return cls(
            id=str(data["id"]),
            answered_by=data.get("answered_by"),
            exit=data.get("exit"),
            cache_hit=bool(data.get("cache_hit", False)),
            bytes={str(k): int(v) for k, v in (data.get("bytes") or {}).items()},
            rate_bps={str(k): float(v) for k, v in (data.get("rate_bps") or {}).items()},
            ms={str(k): float(v) for k, v in (data.get("ms") or {}).items()},
            error=TierflowError(error["message"]) if error else None,
            timings={
                str(tier): {str(k): float(v) for k, v in parts.items()}
                for tier, parts in (data.get("timings") or {}).items()
            },
            links={
                str(link): {str(k): float(v) for k, v in parts.items()}
                for link, parts in (data.get("links") or {}).items()
            },
            fallback=bool(data.get("fallback", False)),
            plan=data.get("plan"),
            switch=data.get("switch"),
            fallback_reason=data.get("fallback_reason"),
        )


class Ticket:
    """A request on its way: :meth:`result` waits for its :class:`Result`."""

    def __init__(
        self,
        request_id: str,
        started: float,
        device_ms: float,
        *,
        compute_ms: float = 0.0,
        sent: Sent | None = None,
        result: Result | None = None,
        timeout: float = DEFAULT_DEADLINE_S,
        max_tensor_bytes: int = DEFAULT_MAX_TENSOR_BYTES,
        came_down: CameDown | None = None,
        fallback: Callable[[TierflowError, Answered | None], Result | None] | None = None,
    ) -> None:
        self.id = request_id
        self.plan: str | None = None  # the plan it runs on, set by DeviceClient.submit
        self.switch: str | None = None
        #: Why the plan was one that avoids a missing tier ([Note: losing a tier]).
        self.avoided: str | None = None
        self._came_down = came_down
        self._fallback = fallback
        self._started = started
        self._device_ms = device_ms
        self._compute_ms = compute_ms
        self._sent = sent
        self._result = result
        self._timeout = timeout
        self._max_tensor_bytes = max_tensor_bytes
        self._arrived: float | None = None
        if sent is not None:
            # When the reply came, not when the caller got round to asking for it.
            sent.future.add_done_callback(self._mark_arrival)

    def _mark_arrival(self, future: Future[tier_pb2.Reply]) -> None:
        self._arrived = time.perf_counter()

    def done(self) -> bool:
        return self._result is not None or (self._sent is not None and self._sent.future.done())

    def result(self) -> Result:
        """Wait for the reply (the stream client resolves it by the deadline at the latest)."""
        if self._result is None:
            self._result = self._finish()
        if self.plan is not None:  # a fallback answer already names the device-only plan
            plan = self._result.plan or self.plan
            if (self._result.plan, self._result.switch) != (plan, self.switch):
                self._result = dataclasses.replace(self._result, plan=plan, switch=self.switch)
        result = self._result
        if self.avoided is not None and result.ok and not (result.fallback or result.cache_hit):
            reason = f"{self.avoided}; answered with plan {self.plan}"
            self._result = dataclasses.replace(self._result, fallback=True, fallback_reason=reason)
        return self._result

    def _finish(self) -> Result:
        """The device's end of the way down ([Note: one request path]): the reply's figures
        and outputs, or the request answered without a missing tier, or its error."""
        assert self._sent is not None
        got: tier_pb2.Reply | TierflowError
        try:
            got = self._sent.future.result(timeout=self._timeout + 5.0)
        except TierflowError as exc:
            got = exc
        except TimeoutError:
            got = DeadlineError("no reply within the deadline")
        # Read once the request is done: a request sent again has a new transfer.
        stat = self._sent.transfer.stat("device-edge")
        bytes_ = {link: 0 for link in LINKS}
        rates = {link: 0.0 for link in LINKS}
        links = {link: {"queue_ms": 0.0, "transfer_ms": 0.0} for link in LINKS}
        add_link(stat, bytes_, rates, links)
        if isinstance(got, TierflowError):
            return self._without_outputs(got, bytes_, rates, links)
        reply = got
        ended = self._arrived or time.perf_counter()
        ms = {tier: 0.0 for tier in TIERS}
        ms["device"] = self._device_ms
        ms["queue"] = stat.queue_ms
        timings: dict[str, dict[str, float]] = {}
        for timing in reply.timings:
            if timing.tier in ms:
                ms[timing.tier] += timing.compute_ms + timing.codec_ms
                ms["queue"] += timing.queue_ms
                timings[timing.tier] = {
                    "compute_ms": timing.compute_ms,
                    "codec_ms": timing.codec_ms,
                    "queue_ms": timing.queue_ms,
                }
        for link in reply.links:
            if link.link in bytes_:
                add_link(link, bytes_, rates, links)
                ms["queue"] += link.queue_ms
        if reply.HasField("error"):
            return self._without_outputs(reply, bytes_, rates, links)
        start = time.perf_counter()
        try:
            outputs = decode_tensors(reply.outputs, max_bytes=self._max_tensor_bytes)
        except TierflowError as exc:
            return self._failed(exc, bytes_, rates, links)
        decode_ms = (time.perf_counter() - start) * 1e3
        ms["device"] += decode_ms
        timings["device"] = {
            "compute_ms": self._compute_ms,
            "codec_ms": self._device_ms - self._compute_ms + decode_ms,
            "queue_ms": 0.0,
        }
        ms["total"] = (ended - self._started) * 1e3 + (time.perf_counter() - start) * 1e3
        busy = sum(ms[tier] for tier in TIERS) + ms["queue"]
        ms["network"] = max(ms["total"] - busy, 0.0)
        if self._came_down is not None:  # after the figures: filling the cache is not its time
            self._came_down(reply, outputs)
        return Result(
            self.id,
            outputs,
            reply.answered_by or None,
            reply.exit or None,
            reply.cache_hit,
            bytes_,
            rates,
            ms,
            timings=timings,
            links=links,
            fallback=bool(reply.fallback),
            fallback_reason=reply.fallback or None,
            plan=self.plan,
            switch=self.switch,
        )

    def _without_outputs(
        self,
        got: tier_pb2.Reply | TierflowError,
        bytes_: dict[str, int],
        rates: dict[str, float],
        links: dict[str, dict[str, float]],
    ) -> Result:
        """No outputs came: the request answered without the next tier if it is gone
        ([Note: device fallback], [Note: losing a tier]), else its error."""
        down = self._came_down(got, None) if self._came_down is not None else None
        if down is not None and down.gone is not None and self._fallback is not None:
            answer = self._fallback(down.gone, down.answered)
            if answer is not None:
                return answer
        error = got if isinstance(got, TierflowError) else error_from_proto(got.error)
        return self._failed(error, bytes_, rates, links)

    def _failed(
        self,
        error: TierflowError,
        bytes_: dict[str, int],
        rates: dict[str, float],
        links: dict[str, dict[str, float]],
    ) -> Result:
        total = ((self._arrived or time.perf_counter()) - self._started) * 1e3
        ms = local_ms(total, device=self._device_ms)
        return Result(self.id, bytes=bytes_, rate_bps=rates, ms=ms, error=error, links=links)


def local_ms(total: float, *, device: float, network: float = 0.0) -> dict[str, float]:
    """A request's timing figures (``Result.ms``) when no other tier worked on it.

    Of ``total`` ms, ``device`` were the device's work and ``network`` waiting for a tier
    that did not answer; no other tier and no queue took any.
    """
    return {
        "device": device,
        "edge": 0.0,
        "cloud": 0.0,
        "total": total,
        "queue": 0.0,
        "network": network,
    }


def add_link(
    stat: tier_pb2.LinkStat,
    bytes_: dict[str, int],
    rates: dict[str, float],
    links: dict[str, dict[str, float]],
) -> None:
    """Record one link's figures for a request ([Note: honest link figures])."""
    bytes_[stat.link] += stat.bytes
    rates[stat.link] = stat.rate_bps
    links[stat.link] = {"queue_ms": stat.queue_ms, "transfer_ms": stat.send_ms}
