"""A session's requests at a tier, one at a time and in the order they were read.

Each request of a session continues the state the one before left ([Note: session state
on a tier] in tierflow/state/store.py), so a tier that reads a stream's requests and runs
them side by side ([Note: a stream's requests run at once] in tierflow/runtime/streams.py)
still runs one session's requests in order, and an edge passes them on in that order. The
stream readers and a batch message's members (tierflow/runtime/batch_message.py) share one
:class:`SessionOrder` per tier.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Hashable

logger = logging.getLogger(__name__)


class SessionOrder:
    """Runs each session's requests one at a time, in the order they were read.

    A request of a session that has one running waits in the session's queue, and the
    thread running the one before takes it along ([Note: a stream's requests run at
    once]). Requests of other sessions, and those of no session, do not wait for it.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting: dict[Hashable, deque[Callable[[], None]]] = {}

    def run(self, session: Hashable, work: Callable[[], None]) -> None:
        """Run ``work`` for ``session`` (its key: the owner's names and the session id)."""
        if self.enter(session, work):
            self.drain(session, work)

    def enter(self, session: Hashable, work: Callable[[], None]) -> bool:
        """Take ``work``'s place in ``session``'s order: True when nothing of the session is
        running or waiting, so the caller runs it with :meth:`drain`; False when it waits,
        to be taken along by the thread running the one before.

        A reader enters a request before it hands the reading on: the stream's next request
        of the same session, read on another thread, could otherwise take its place first.
        """
        with self._lock:
            queue = self._waiting.get(session)
            if queue is not None:
                queue.append(work)
                return False
            self._waiting[session] = deque()
            return True

    def drain(self, session: Hashable, work: Callable[[], None]) -> None:
        """Run ``work``, which :meth:`enter` let run, then every request of ``session``
        that waited behind it."""
        while True:
            try:
                work()
            except Exception:  # a bug: the session's later requests must still run
                logger.exception("a request of session %s failed", session)
            with self._lock:
                queue = self._waiting[session]
                if not queue:
                    del self._waiting[session]
                    return
                work = queue.popleft()
