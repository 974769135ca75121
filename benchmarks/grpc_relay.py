"""A bare gRPC relay: the edge's place in a chain of processes, without tierflow.

Run as ``python benchmarks/grpc_relay.py UPSTREAM``: prints its port, then serves until
its standard input closes. Each ``Probe`` stream it accepts gets its own stream to
UPSTREAM (any tier's ``Probe`` echo) on one long-lived channel; every message goes up as
it came and every reply comes back down the same way. That is the work any relaying
process does with gRPC's Python API (receive, a hand-over to the sending thread, send,
and the same for the reply), with no compute, codec or bookkeeping, so
``transport_bench`` can set a tierflow hop beside it. The process is tuned as tierflow's
are (``tierflow.tuning``).
"""

from __future__ import annotations

import queue
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

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
        up: queue.SimpleQueue[tier_pb2.ProbeMessage | None] = queue.SimpleQueue()

        def messages() -> Iterator[tier_pb2.ProbeMessage]:
            while (message := up.get()) is not None:
                yield message

        call = self.stub.Probe(messages())

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


Relay.Probe.experimental_non_blocking = True  # type: ignore[attr-defined]


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
