"""What the device does when the edge or the cloud is gone: which plan answers instead.

[Note: device fallback]
A plan set (``plan --adaptive``) may hold a plan that runs the whole model on the device.
While the edge is known to be down, for every request whose stream to the edge broke (a
``TransportError``, not a deadline) and for every request the edge refused UNAVAILABLE
(it is stopping), the device runs that plan on the request's inputs and answers itself,
marked ``fallback`` in its result, with ``fallback_reason``. Its sessions are opened on
the first fallback, so a device that never loses the edge never pays their memory. Each
request still tries the edge first unless it is known to be down, so answers come from
the edge again as soon as it is back (the channel reconnects by itself, see [Note:
retries and failing fast] in tierflow/transport/stream_client.py). Without a device-only
plan, a request whose device segment has an early exit is answered from that exit's
scores instead.

[Note: losing a tier]
When the cloud is gone, the edge answers what it can ([Note: answering without the next
tier] in tierflow/runtime/pipeline.py): from its early exit, marked ``fallback`` with the
reason, or with an ``UPSTREAM_UNAVAILABLE`` error. The device takes either as news that
the cloud is missing. The request that met the error is finished with a plan of the set
that does not need the cloud: run here if it is the device-only plan, else sent again on
it through the edge (a device+edge plan); the answer is marked ``fallback``, with
``fallback_reason``. Until the cloud is back the device picks its plans among those that
do not need it (the one closest to the link estimates, with a plan set that has regions;
else the first in the set), names the switch in ``switch`` and marks those answers
``fallback`` too; a set without such a plan keeps its plans (the edge's exits answer, or
requests fail with the typed error). One request every ``retry_s`` seconds tries the plan
the device would use with every tier; the first answer the cloud gives again ends the
fallback (a failed try is still answered once, as above).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable

from tierflow.errors import is_upstream_gone
from tierflow.plan import Plan, PlanSet
from tierflow.rpc import tier_pb2
from tierflow.transport.wire import error_from_proto

logger = logging.getLogger(__name__)

#: While the cloud is missing, one request in this many seconds tries it again.
DEFAULT_RETRY_S = 1.0


def runs_on_device_only(plan: Plan) -> bool:
    return all(segment.tier == "device" for segment in plan.segments)


def needs_cloud(plan: Plan) -> bool:
    return any(segment.tier == "cloud" for segment in plan.segments)


def device_only(plans: Iterable[Plan]) -> Plan | None:
    """The first plan that runs every segment on the device, if any."""
    return next((plan for plan in plans if runs_on_device_only(plan)), None)


class MissingTiers:
    """Whether the cloud is missing, and which plans answer meanwhile ([Note: losing a tier]).

    ``closest(candidates)`` picks among plan indices by the link estimates (the switching
    selector's distances), or None to take the first. Thread-safe.
    """

    def __init__(
        self,
        plans: PlanSet,
        retry_s: float = DEFAULT_RETRY_S,
        closest: Callable[[list[int]], int] | None = None,
    ) -> None:
        self.plans = plans
        self.retry_s = retry_s
        self._closest = closest
        #: The plans that run without the cloud.
        self.cloud_free = [i for i, p in enumerate(plans.plans) if not needs_cloud(p)]
        #: The plan that runs without the edge ([Note: device fallback]).
        self.device_only_index = next(
            (i for i, p in enumerate(plans.plans) if runs_on_device_only(p)), None
        )
        self.cloud_missing: str | None = None  # why, while the cloud is missing
        self._retry_at = 0.0
        self._last_index = plans.default
        self._lock = threading.Lock()

    def cloud_free_plan(self) -> int:
        """The plan to use without the cloud; there is one."""
        if self._closest is None:
            return self.cloud_free[0]
        return self._closest(self.cloud_free)

    def adjust(self, index: int, reason: str | None) -> tuple[int, str | None, str | None]:
        """The plan the selector chose (``index``, and why it switched), adjusted for a
        missing cloud: the plan to use, why it changed (if it did), and why it avoids a
        tier (if it does: its answer is then a fallback)."""
        with self._lock:
            missing = self.cloud_missing
            trial = missing is not None and time.monotonic() >= self._retry_at
            if trial:
                self._retry_at = time.monotonic() + self.retry_s
        if trial:
            return index, None, None  # tries the cloud again: not a switch
        avoided = None
        if missing is not None and index not in self.cloud_free:
            index, avoided = self.cloud_free_plan(), missing
            reason = None  # the selector's reason names a plan not taken
        if index != self._last_index and reason is None:
            plan_id = self.plans.plans[index].plan_id
            if missing is not None:
                reason = f"{missing}: plan {plan_id} does not need the cloud"
            else:
                reason = f"the cloud answers again: back to plan {plan_id}"
            logger.info("[device] switching plans: %s", reason)
        self._last_index = index
        return index, reason, avoided

    def lose_cloud(self, why: str) -> None:
        """The cloud is missing; a no-op without a plan to avoid it."""
        if not self.cloud_free:
            return
        with self._lock:
            if self.cloud_missing is not None:
                return
            self.cloud_missing = why
            self._retry_at = time.monotonic() + self.retry_s
        logger.warning("[device] %s; using plans that do not need it", why)

    def track(self, reply: tier_pb2.Reply) -> None:
        """Whether ``reply`` says the cloud is missing, or answers from it again."""
        if reply.fallback:
            self.lose_cloud(f"{reply.answered_by}: {reply.fallback}")
        elif reply.HasField("error"):
            error = error_from_proto(reply.error)
            if is_upstream_gone(error):
                self.lose_cloud(str(error))
        elif reply.answered_by == "cloud" and self.cloud_missing is not None:
            with self._lock:
                self.cloud_missing = None
            logger.info("[device] the cloud answers again")
