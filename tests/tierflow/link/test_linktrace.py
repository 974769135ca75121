"""Link traces: parsing with errors that name the line, and a shaper that follows the steps."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tierflow.errors import UsageError
from tierflow.link.emulation import LinkEmulation, LinkShaper, ShapedQueue, resolve_links
from tierflow.link.spec import LinkOption, LinkSpec
from tierflow.link.trace import LinkTrace, TraceStep, load_trace, parse_trace, step_trace
from tierflow.plan import Plan, SegmentSpec

MB = 1_000_000


def test_a_trace_file_reads_steps_with_units_header_and_comments() -> None:
    text = (
        "seconds,rate,rtt\n# down and up\n0,20mbit,10ms\n\n3, 2MB/s , 30ms # slow\n5.5,1gbit,0ms\n"
    )
    trace = parse_trace(text, "up.csv")
    assert [step.start_s for step in trace.steps] == [0.0, 3.0, 5.5]
    assert trace.at(0) == LinkSpec(20e6, 0.01)
    assert trace.at(2.999) == LinkSpec(20e6, 0.01)
    assert trace.at(3) == LinkSpec(16e6, 0.03)
    assert trace.at(100) == LinkSpec(1e9, 0.0)
    assert parse_trace(trace.to_csv()) == LinkTrace(trace.steps, source="trace")


def test_a_trace_written_to_csv_reads_back_exactly_and_briefly() -> None:
    odd = LinkTrace(
        (
            TraceStep(0.0, LinkSpec(2e6, 0.03)),
            TraceStep(1.23456789, LinkSpec(65462999.999999993, 0.03)),
        )
    )
    text = odd.to_csv()
    assert text.splitlines()[1] == "0,2e+06bit,30ms"
    assert parse_trace(text).steps == odd.steps


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("0,20mbit,10ms\n2,5mbit\n", "up.csv line 2: expected SECONDS,RATE,RTT"),
        ("0,20mbit,10ms\nsoon,5mbit,1ms\n", "up.csv line 2: expected a time in seconds"),
        ("0,20mbit,10ms\n\n1,fast,1ms\n", "up.csv line 3: malformed rate 'fast'"),
        ("0,20mbit,10ms\n1,20MB,1ms\n", "up.csv line 2: malformed rate '20MB'"),
        ("0,20mbit,10\n", "up.csv line 1: malformed duration '10'"),
        ("0,20mbit,10ms\n4,1mbit,1ms\n2,1mbit,1ms\n", "up.csv line 3: steps must be in increasing"),
        ("0,20mbit,10ms\n0,1mbit,1ms\n", "up.csv line 2: steps must be in increasing"),
        ("-1,20mbit,10ms\n", "up.csv line 1: a step's time must be finite"),
        ("1,20mbit,10ms\n", "up.csv: the first step must start at 0 s, got 1 s"),
        ("# nothing\n", "up.csv: a link trace needs at least one"),
        ("0,0mbit,1ms\n", "up.csv line 1: malformed rate '0mbit'"),
    ],
)
def test_a_malformed_trace_is_a_usage_error_naming_the_line(text: str, message: str) -> None:
    with pytest.raises(UsageError, match=message.replace("(", r"\(")):
        parse_trace(text, "up.csv")


def test_an_unreadable_trace_file_is_a_usage_error(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="cannot read link trace"):
        load_trace(tmp_path / "missing.csv")


def test_a_message_spanning_a_step_goes_at_each_steps_rate() -> None:
    trace = step_trace([(0.0, LinkSpec(8e6)), (1.0, LinkSpec(1e6)), (2.0, LinkSpec(4e6))])
    assert trace.serialised(0.0, MB // 2) == pytest.approx(0.5)  # 4 Mbit at 8 Mbit/s
    # 0.5 s at 8 Mbit/s carries 4 Mbit, the next second 1 Mbit, the rest at 4 Mbit/s.
    assert trace.serialised(0.5, MB) == pytest.approx(2.0 + 3e6 / 4e6)
    assert trace.serialised(5.0, MB) == pytest.approx(7.0)
    assert LinkTrace.constant(LinkSpec(8e6)).serialised(3.0, MB) == pytest.approx(4.0)


@pytest.mark.integration
def test_a_shaper_on_a_trace_slows_down_when_the_rate_steps_down() -> None:
    # 100 kB take 8 ms at 100 Mbit/s and 0.4 s at 2 Mbit/s (plus 10 ms propagation).
    trace = step_trace([(0.0, LinkSpec(100e6, 0.0)), (0.3, LinkSpec(2e6, 0.02))])
    queue: ShapedQueue[int] = ShapedQueue(LinkShaper("device-edge", trace))
    started = time.monotonic()
    fast = queue.put(0, 100_000)
    time.sleep(max(0.3 - (time.monotonic() - started), 0.0) + 0.01)
    slow = queue.put(1, 100_000)
    queue.close()
    arrived = {item: time.monotonic() for item in queue.drain()}
    assert fast.stat("device-edge").rate_bps == pytest.approx(100e6, rel=0.01)
    assert slow.stat("device-edge").rate_bps == pytest.approx(2e6, rel=0.01)
    assert fast.arrives is not None and slow.arrives is not None and slow.left is not None
    assert slow.arrives - slow.left == pytest.approx(0.01)
    # Generous bounds: the machine may be loaded, but no shaping would take ~0 s.
    assert 0.4 <= arrived[1] - slow.queued < 1.5


def _plan() -> Plan:
    return Plan(
        model_file="m.onnx",
        model_sha256="0" * 64,
        inputs=("x",),
        outputs=("y",),
        segments=(SegmentSpec("device", "a.onnx", ("x",), ("y",)),),
        links={"device-edge": LinkSpec(20e6, 0.01), "edge-cloud": LinkSpec(1e9, 0.02)},
    )


def test_resolve_links_with_a_trace_shapes_every_link_but_the_pinned(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text("0,1mbit,5ms\n2,3mbit,5ms\n")
    traced = LinkEmulation.parse(f"trace={path}")
    links = resolve_links(_plan().links, traced)
    assert links["device-edge"] == links["edge-cloud"] == load_trace(path)
    pinned = resolve_links(_plan().links, traced, [LinkOption.parse("edge-cloud=100mbit")])
    assert pinned["edge-cloud"] == LinkSpec(100e6, 0.02)
    assert isinstance(pinned["device-edge"], LinkTrace)
    for mode in ("trace", "trace=", "plan=x.csv", "replay=x.csv"):
        with pytest.raises(UsageError, match=r"expected off, plan or trace=FILE\.csv"):
            LinkEmulation.parse(mode)
    path.write_text("0,1mbit,5ms\n2,3mbit\n")
    with pytest.raises(UsageError, match="line 2"):
        resolve_links(_plan().links, traced)
