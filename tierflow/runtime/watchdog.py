"""The tier's watchdog over its open streams: a reply its reader does not take, a stream
gone idle.

:class:`StreamWatchdog` is one thread a tier starts with its first stream. Each quarter of
``reply_timeout`` (at most 0.25 s) it cancels the streams whose reply has waited longer
than ``reply_timeout`` for its reader ([Note: slow readers] in
tierflow/runtime/replies.py), and those with nothing in flight that sent nothing for
``stream_idle_s`` ([Note: stream admission] in tierflow/runtime/admission.py). The
:class:`~tierflow.runtime.service.TierService` hands it each stream's replies and reader
(:func:`~tierflow.runtime.streams.serve_stream`) and each probe; a stopping tier reads the
streams it watches to know that every reply was written (:meth:`Tier.drain
<tierflow.runtime.tier.Tier.drain>`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Protocol

import grpc

from tierflow.options import RuntimeOptions
from tierflow.runtime.admission import peer_host
from tierflow.runtime.replies import StreamReplies
from tierflow.transport.peer_warnings import WARNINGS

logger = logging.getLogger(__name__)


class Watched(Protocol):
    """A stream the watchdog closes once it is idle ([Note: stream admission])."""

    context: grpc.ServicerContext
    on_finish: Callable[[], None] | None

    def idle_for(self, now: float) -> float:
        """Seconds the stream has had nothing in flight and sent nothing (0: busy)."""


class StreamWatchdog:
    """Watches ``tier``'s streams until ``closed`` is set.

    ``lock`` guards what it watches; the tier's own (:attr:`Tier.lock
    <tierflow.runtime.tier.Tier.lock>`), so that a stopping tier reads the streams and its
    requests in flight at one moment.
    """

    def __init__(
        self,
        tier: str,
        options: RuntimeOptions,
        lock: threading.Lock,
        closed: threading.Event,
    ) -> None:
        self.tier = tier
        self.options = options
        self.lock = lock
        self.closed = closed
        #: Streams whose reply writes are watched for a slow reader.
        self.streams: set[StreamReplies] = set()
        #: Streams (and probes) watched for idleness.
        self.readers: set[Watched] = set()
        self._thread: threading.Thread | None = None

    def watch(self, replies: StreamReplies) -> None:
        """Watch this stream's writes."""
        with self.lock:
            self.streams.add(replies)
            self._start()

    def unwatch(self, replies: StreamReplies) -> None:
        with self.lock:
            self.streams.discard(replies)

    def track(self, reader: Watched) -> None:
        """Close ``reader``'s stream once it is idle (``--stream-idle``)."""
        with self.lock:
            self.readers.add(reader)
            self._start()
        reader.on_finish = lambda: self.untrack(reader)

    def untrack(self, reader: Watched) -> None:
        with self.lock:
            self.readers.discard(reader)

    def _start(self) -> None:
        """Start :meth:`_run` on first use; call with ``lock`` held."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name=f"{self.tier}-watchdog", daemon=True
            )
            self._thread.start()

    def _run(self) -> None:
        """Cancel each stream whose reply waited longer than ``reply_timeout`` to be read,
        and each idle one.

        See [Note: slow readers]; the cancel makes the waiting write return.
        """
        limit = self.options.reply_timeout
        while not self.closed.wait(min(limit / 4, 0.25)):
            now = time.monotonic()
            self._close_idle(now)
            with self.lock:
                streams = list(self.streams)
            for replies in streams:
                started = replies.write_started
                if started is None or now - started <= limit or replies.cancelled:
                    continue
                replies.cancelled = True
                peer = replies.context.peer()
                WARNINGS.warn(  # [Note: warnings about a peer]
                    logger,
                    self.tier,
                    "slow_reader",
                    peer_host(peer),
                    "[%s] stream from %s cancelled: a reply waited %.1f s for it to read "
                    "(--reply-timeout)",
                    self.tier,
                    peer,
                    now - started,
                )
                replies.context.cancel()

    def _close_idle(self, now: float) -> None:
        """Cancel the streams with nothing in flight that sent nothing for ``stream_idle_s``
        ([Note: stream admission] in tierflow/runtime/admission.py)."""
        limit = self.options.stream_idle_s
        with self.lock:
            idle = [r for r in self.readers if r.idle_for(now) > limit]
            for reader in idle:
                self.readers.discard(reader)
        for reader in idle:
            logger.info(
                "[%s] stream from %s closed: idle for %.0f s (--stream-idle)",
                self.tier,
                reader.context.peer(),
                reader.idle_for(now),
            )
            reader.context.cancel()
