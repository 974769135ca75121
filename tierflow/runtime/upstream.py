"""The connection from a tier to the next tier up, set up one way for the device and the edge.

The device's stream to the edge and the edge's stream to the cloud are one kind of thing:
a long-lived :class:`StreamClient` shaped as the link between the two tiers, with this
tier's message-size limit and its TLS and token setting for the next tier
(:meth:`Security.upstream`), and the segment files this tier does not hold fetched over
the same channel ([Note: segments on demand] in tierflow/runtime/segment_store.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tierflow.link.emulation import LinkShaper
from tierflow.link.spec import upstream_link
from tierflow.runtime.segment_store import SegmentSource
from tierflow.transport.stream_client import StreamClient

if TYPE_CHECKING:
    from tierflow.options import RuntimeOptions


def connect(address: str, *, me: str, peer: str, options: RuntimeOptions) -> StreamClient:
    """The stream from tier ``me`` to the next tier, ``peer`` at ``address``.

    A next tier that is not up yet fails requests, not this call ([Note: retries and
    failing fast] in tierflow/transport/stream_client.py).
    """
    link = upstream_link(me)
    assert link is not None, f"the {me} has no next tier"
    return StreamClient(
        address,
        me=me,
        peer=peer,
        shaper=LinkShaper(link, options.links.get(link)),
        max_message_bytes=options.max_message_bytes,
        security=options.security.upstream(),
    )


def segment_source(stream: StreamClient) -> SegmentSource:
    """Where this tier fetches the segment files it lacks: the next tier, over ``stream``'s
    channel, failing fast while the stream knows that tier is down."""
    return SegmentSource(stream.channel, stream.peer, known_down=stream.known_down)
