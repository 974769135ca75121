"""A bare gRPC relay: the edge's place in a chain of processes, without tierflow.

Run as ``python -m benchmarks.lib.grpc_relay UPSTREAM``: prints its port, then serves until
its standard input closes. Each ``Probe`` or ``Infer`` stream it accepts gets its own
stream of the same method to UPSTREAM (any tier's ``Probe`` echo; a cloud's ``Infer``) on
one long-lived channel; every message goes up as it came and every reply comes back down
the same way. That is the work any relaying process does with gRPC's Python API
(receive, a hand-over to the sending thread, send, and the same for the reply), with no
compute, codec or bookkeeping, so ``benchmarks.transport`` can set a tierflow hop beside it,
and put it in the edge's place between a tierflow device and cloud. The process is tuned
as tierflow's are (``tierflow.tuning``).
"""

from __future__ import annotations

import queue
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc

from tierflow.rpc import tier_pb2, tier_pb2_grpc
from tierflow.transport.stream_client import channel_options
from tierflow.transport.wire import grpc_options
from tierflow.tuning import tune_for_latency


class Relay(tier_pb2_grpc.TierServicer):
    def __init__(self, upstream: str) -> None:
        self.stub = tier_pb2_grpc.TierStub(grpc.insecure_channel(upstream, channel_options()))

    def Probe(
        self,
        request_iterator: Iterator[tier_pb2.ProbeMessage],
        context: grpc.ServicerContext,
        send_response: Callable[[tier_pb2.ProbeMessage | None], None] | None = None,
    ) -> None:
        assert send_response is not None  # grpc passes it to non-blocking handlers
        relay(self.stub.Probe, request_iterator, send_response)

    def Infer(
        self,
        request_iterator: Iterator[tier_pb2.Request],
        context: grpc.ServicerContext,
        send_response: Callable[[tier_pb2.Reply | None], None] | None = None,
    ) -> None:
        assert send_response is not None
        relay(self.stub.Infer, request_iterator, send_response)


Relay.Probe.experimental_non_blocking = True  # type: ignore[attr-defined]
Relay.Infer.experimental_non_blocking = True  # type: ignore[attr-defined]


def relay(
    method: Callable[[Iterator[Any]], Iterator[Any]],
    request_iterator: Iterator[Any],
    send_response: Callable[[Any], None],
) -> None:
    """Relay one stream: its messages up through ``method``, the replies down as they come."""
    up: queue.SimpleQueue[Any] = queue.SimpleQueue()

    def messages() -> Iterator[Any]:
        while (message := up.get()) is not None:
            yield message

    call = method(messages())

    def replies() -> None:
        for reply in call:
            send_response(reply)

    reader = threading.Thread(target=replies, daemon=True)
    reader.start()
    for message in request_iterator:
        up.put(message)
    up.put(None)
    reader.join()
    send_response(None)


def main() -> int:
    tune_for_latency()
    server = grpc.server(ThreadPoolExecutor(max_workers=8), options=grpc_options())
    tier_pb2_grpc.add_TierServicer_to_server(Relay(sys.argv[1]), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(port, flush=True)
    sys.stdin.read()
    server.stop(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
