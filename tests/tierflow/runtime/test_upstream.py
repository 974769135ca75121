"""The connection to the next tier, made one way for the device and the edge."""

from __future__ import annotations

import pytest

from tierflow.link.spec import LinkSpec
from tierflow.options import RuntimeOptions
from tierflow.runtime.upstream import connect, segment_source

# A real channel, whose close waits for its threads.
pytestmark = pytest.mark.integration


@pytest.mark.parametrize(
    ("me", "peer", "link"), [("device", "edge", "device-edge"), ("edge", "cloud", "edge-cloud")]
)
def test_a_tier_connects_to_the_next_over_the_link_between_them(
    me: str, peer: str, link: str
) -> None:
    spec = LinkSpec.parse("10mbps")
    options = RuntimeOptions(links={link: spec}, max_message_bytes=5 << 20)
    stream = connect("127.0.0.1:1", me=me, peer=peer, options=options)  # nothing listens
    try:
        assert (stream.me, stream.peer, stream.address) == (me, peer, "127.0.0.1:1")
        assert stream.shaper is not None
        assert stream.shaper.name == link and stream.shaper.spec == spec
        assert stream.max_message_bytes == 5 << 20
        source = segment_source(stream)
        assert source.peer == peer
    finally:
        stream.close()
