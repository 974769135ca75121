"""Tests for the core schema modules: tierflow.units, tierflow.link.spec and tierflow.plan."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierflow.codec.base import CodecSpec
from tierflow.errors import PlanError, UsageError, shown
from tierflow.link.spec import (
    LINKS,
    TIERS,
    LinkOption,
    LinkSpec,
    apply_links,
    check_link,
    check_tier,
    downstream_link,
    upstream_link,
)
from tierflow.plan import PLAN_FILE, PLAN_FORMAT, ExitSpec, Plan, SegmentSpec, load_plan, save_plan
from tierflow.units import (
    format_duration,
    format_rate,
    format_size,
    parse_duration,
    parse_rate,
    parse_size,
)

# --------------------------------------------------------------------------- units


@pytest.mark.parametrize(
    ("text", "bps"),
    [
        ("20mbit", 20e6),
        ("1gbit", 1e9),
        ("500kbit", 500e3),
        ("1.5 Mbps", 1.5e6),
        ("100bit", 100.0),
        ("2e3kbit", 2e6),
        (" 10mbit ", 10e6),
        # A capital B is bytes: 20 MB/s is 160 Mbit/s, not 20 (issue 13).
        ("20MB/s", 160e6),
        ("20MBps", 160e6),
        ("2.5kB/s", 20e3),
        ("1MiB/s", 8 * 2**20),
        ("1GiB/s", 8 * 2**30),
        ("20Mb/s", 20e6),
        ("20mb/s", 20e6),
        ("1Kibit", 1024.0),
    ],
)
def test_parse_rate(text: str, bps: float) -> None:
    assert parse_rate(text) == pytest.approx(bps)


@pytest.mark.parametrize(
    "text",
    ["", "fast", "20", "20mb", "20MB", "20MiB", "20 furlongs", "0mbit", "-5mbit", "1e400kbit"],
)
def test_parse_rate_refuses_malformed_text(text: str) -> None:
    with pytest.raises(UsageError, match="rate"):
        parse_rate(text)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("5ms", 5e-3), ("1.5s", 1.5), ("200us", 200e-6), ("5µs", 5e-6), ("0ms", 0.0), ("3ns", 3e-9)],
)
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["5", "5min", "ms", "-1ms", "5 hours"])
def test_parse_duration_refuses_malformed_text(text: str) -> None:
    with pytest.raises(UsageError, match="duration"):
        parse_duration(text)


@pytest.mark.parametrize(
    ("text", "nbytes"),
    [
        ("64MiB", 64 * 2**20),
        ("1GiB", 2**30),
        ("1.5GB", 1_500_000_000),
        ("512k", 512 * 1024),
        ("512kB", 512_000),
        ("100B", 100),
        ("100b", 100),
        ("2m", 2 * 2**20),
    ],
)
def test_parse_size(text: str, nbytes: int) -> None:
    assert parse_size(text) == nbytes


@pytest.mark.parametrize("text", ["0B", "0.1B", "64Mo", "big", "1e400", "1e400GiB"])
def test_parse_size_refuses_malformed_text(text: str) -> None:
    with pytest.raises(UsageError, match="size"):
        parse_size(text)


@pytest.mark.parametrize("text", ["64", "0", "1.5", " 100 "])
def test_a_size_without_a_unit_is_refused_with_the_units_to_write(text: str) -> None:
    """``--memory device=64`` was 64 bytes, and an edge-only plan.

    See [Note: sizes carry a unit] in ``tierflow.units``.
    """
    number = text.strip()
    with pytest.raises(UsageError, match="a size needs a unit") as caught:
        parse_size(text)
    assert f"'{number}MiB'" in str(caught.value) and f"'{number}B'" in str(caught.value)


def test_errors_quote_a_long_value_clipped() -> None:
    """A 10 KB value is quoted by its start and its length, on one short line."""
    junk = "x" * 10_000
    for parse in (parse_size, parse_rate, parse_duration):
        with pytest.raises(UsageError) as caught:
            parse(junk)
        message = str(caught.value)
        assert len(message) < 300 and "(10,000 characters)" in message and "\n" not in message
    assert shown("short") == "'short'"
    assert shown("y" * 61).startswith("'yyy") and shown("y" * 61).endswith("(61 characters)")


@settings(max_examples=200, deadline=None)
@given(st.floats(1.0, 1e12))
def test_formatted_rates_parse_back(bps: float) -> None:
    assert parse_rate(format_rate(bps)) == pytest.approx(bps, rel=1e-3)


@settings(max_examples=200, deadline=None)
@given(st.floats(0.0, 1e4) | st.floats(1e-9, 1e-3))
def test_formatted_durations_parse_back(seconds: float) -> None:
    assert parse_duration(format_duration(seconds)) == pytest.approx(seconds, rel=1e-3, abs=1e-12)


def test_format_size_uses_binary_units() -> None:
    assert format_size(512) == "512B"
    assert format_size(1536) == "1.5KiB"
    assert format_size(64 * 2**20) == "64MiB"
    assert format_size(3 * 2**30) == "3GiB"
    assert parse_size(format_size(64 * 2**20)) == 64 * 2**20
    # From 100 units up, whole units, never exponent notation (a decoder's 1.01e+03MiB).
    assert format_size(1010 * 2**20) == "1010MiB"
    assert format_size(1023.9 * 2**20) == "1024MiB"
    assert format_size(515.4 * 2**20) == "515MiB"


# --------------------------------------------------------------------------- links


def test_tier_and_link_names() -> None:
    assert TIERS == ("device", "edge", "cloud")
    assert LINKS == ("device-edge", "edge-cloud")
    assert check_tier("edge") == "edge"
    assert check_link("edge-cloud") == "edge-cloud"
    with pytest.raises(UsageError, match="device, edge, cloud"):
        check_tier("phone")
    with pytest.raises(UsageError, match="device-edge, edge-cloud"):
        check_link("device-cloud")


def test_each_tier_knows_the_links_it_sends_and_replies_on() -> None:
    assert [upstream_link(t) for t in TIERS] == ["device-edge", "edge-cloud", None]
    assert [downstream_link(t) for t in TIERS] == [None, "device-edge", "edge-cloud"]


def test_link_spec_parse_print_and_cost() -> None:
    link = LinkSpec.parse("20mbit,10ms")
    assert link == LinkSpec(20e6, 0.01)
    assert LinkSpec.parse(str(link)) == link
    assert LinkSpec.parse("1gbit") == LinkSpec(1e9, 0.0)
    # 2.5 MB at 20 Mbit/s is one second, plus half the round trip.
    assert link.transfer_s(2.5e6) == pytest.approx(1.005)
    assert link.transfer_s(0) == pytest.approx(0.005)
    assert LinkSpec.from_dict(link.to_dict()) == link


@pytest.mark.parametrize(
    "data",
    [{}, {"rate_bps": "fast"}, {"rate_bps": None}, {"rate_bps": 0}, {"rate_bps": 1, "rtt_s": -1}],
)
def test_link_spec_from_dict_refuses_malformed(data: dict[str, Any]) -> None:
    with pytest.raises(UsageError):
        LinkSpec.from_dict(data)


def test_link_spec_refuses_nan() -> None:
    with pytest.raises(UsageError, match="rate"):
        LinkSpec(float("nan"))
    with pytest.raises(UsageError, match="RTT"):
        LinkSpec(1e6, float("nan"))


def test_a_link_option_records_whether_an_rtt_was_given() -> None:
    given = LinkOption.parse("device-edge=20mbit,5ms")
    assert given == LinkOption("device-edge", 20e6, 0.005) and given.rtt_given
    assert given.spec() == LinkSpec(20e6, 0.005)
    rate_only = LinkOption.parse("device-edge=20MB/s")
    assert rate_only == LinkOption("device-edge", 160e6, None) and not rate_only.rtt_given
    # A rate alone keeps the link's RTT from the links given, not a silent 0 ms.
    defaults = {"device-edge": LinkSpec(1e6, 0.01), "edge-cloud": LinkSpec(1e9, 0.03)}
    assert rate_only.spec(defaults) == LinkSpec(160e6, 0.01)
    assert LinkOption.parse("edge-cloud=1gbit,0ms").spec(defaults).rtt_s == 0.0
    assert LinkOption.parse(" edge-cloud =1gbit").name == "edge-cloud"
    assert str(rate_only) == "device-edge=160mbit" and str(given) == "device-edge=20mbit,5ms"
    assert LinkOption.parse(str(given)) == given
    # Later values win, and a rate-only value keeps the RTT the link has by then.
    options = [LinkOption.parse("device-edge=1mbit,40ms"), LinkOption.parse("device-edge=2mbit")]
    assert apply_links(defaults, options)["device-edge"] == LinkSpec(2e6, 0.04)
    assert apply_links(defaults, options)["edge-cloud"] == defaults["edge-cloud"]
    for text in ("device-edge", "device-edge=", "=20mbit", "phone-edge=20mbit", "device-edge=,5ms"):
        with pytest.raises(UsageError):
            LinkOption.parse(text)
    with pytest.raises(UsageError, match="malformed --emulate-link 'x'"):
        LinkOption.parse("x", option="--emulate-link")


# --------------------------------------------------------------------------- plan


def plan_dict() -> dict[str, Any]:
    """A valid three-tier plan with an early exit on the edge."""
    return {
        "format": PLAN_FORMAT,
        "model": {"file": "net.onnx", "sha256": "ab" * 32},
        "inputs": ["image"],
        "outputs": ["logits"],
        "segments": [
            {"tier": "device", "file": "s0.onnx", "inputs": ["image"], "outputs": ["h1"]},
            {
                "tier": "edge",
                "file": "s1.onnx",
                "inputs": ["h1"],
                "outputs": ["h2", "exit1"],
                "exits": [{"name": "exit1", "threshold": 0.9, "calibration": {"accuracy": 0.97}}],
            },
            {"tier": "cloud", "file": "s2.onnx", "inputs": ["h2"], "outputs": ["logits"]},
        ],
        "links": {
            "device-edge": {"rate_bps": 20e6, "rtt_s": 0.01},
            "edge-cloud": {"rate_bps": 1e9, "rtt_s": 0.03},
        },
        "codec": {"device-edge": "int8+zstd", "edge-cloud": "zstd"},
        "estimate": {"latency_s": 0.05},
        "cuts": [4, 9],
    }


def test_plan_round_trips_through_dict_and_json() -> None:
    plan = Plan.from_dict(plan_dict())
    assert plan.segments[1].exits == (ExitSpec("exit1", 0.9, {"accuracy": 0.97}),)
    assert plan.links["device-edge"] == LinkSpec(20e6, 0.01)
    assert plan.cuts == (4, 9)
    assert plan.to_dict() == plan_dict()
    assert Plan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan


def test_plan_id_names_model_segments_and_codecs() -> None:
    plan = Plan.from_dict(plan_dict())
    assert len(plan.plan_id) == 16
    assert Plan.from_dict(plan_dict()).plan_id == plan.plan_id
    other_codec = plan_dict()
    other_codec["codec"]["device-edge"] = "raw"
    assert Plan.from_dict(other_codec).plan_id != plan.plan_id
    other_estimate = plan_dict()
    other_estimate["estimate"] = {"latency_s": 1.0}
    assert Plan.from_dict(other_estimate).plan_id == plan.plan_id


def test_link_codec_defaults_to_raw() -> None:
    plan = Plan.from_dict(plan_dict())
    assert plan.link_codec("device-edge") == CodecSpec.parse("int8+zstd")
    assert plan.link_codec("edge-cloud") == CodecSpec.parse("zstd")
    assert plan.link_codec(None).compress == "none"
    data = plan_dict()
    del data["codec"]["edge-cloud"]
    assert Plan.from_dict(data).link_codec("edge-cloud") == CodecSpec.parse("raw")


def test_segments_for_lists_a_tiers_work_in_order() -> None:
    data = plan_dict()
    data["segments"].insert(
        2, {"tier": "edge", "file": "s1b.onnx", "inputs": ["h2"], "outputs": ["h2b"]}
    )
    plan = Plan.from_dict(data)
    assert [i for i, _ in plan.segments_for("edge")] == [1, 2]
    assert [s.file for _, s in plan.segments_for("device")] == ["s0.onnx"]
    single = plan_dict()
    single["segments"] = [
        {"tier": "cloud", "file": "all.onnx", "inputs": ["image"], "outputs": ["logits"]}
    ]
    assert Plan.from_dict(single).segments_for("device") == []


def broken(path: str, value: Any) -> dict[str, Any]:
    """plan_dict() with the item at a '/'-separated path replaced (or deleted if value is ...)."""
    data = plan_dict()
    *parents, last = path.split("/")
    target: Any = data
    for parent in parents:
        target = target[int(parent)] if isinstance(target, list) else target[parent]
    key: Any = int(last) if isinstance(target, list) else last
    if value is ...:
        del target[key]
    else:
        target[key] = value
    return data


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ([], "JSON object"),
        (broken("format", "tierflow.plan/2"), "unsupported plan format"),
        (broken("model", "net.onnx"), "'model'"),
        (broken("segments", {}), "'segments' must be a list"),
        (broken("segments", []), "no segments"),
        (broken("segments/0/tier", "phone"), "segment tier"),
        (broken("segments/0/file", "../evil.onnx"), "plain file name"),
        (broken("segments/0/file", ".hidden"), "plain file name"),
        (broken("segments/1/file", "s0.onnx"), "distinct"),
        (broken("segments/0/inputs", "image"), "list of names"),
        (broken("segments/2/inputs", ["h9"]), "needs"),
        (broken("segments/2/outputs", ["other"]), "no segment yields"),
        (broken("segments/1/exits", "exit1"), "exits must be a list"),
        (broken("segments/1/exits/0/name", "h9"), "not among its outputs"),
        (broken("segments/1/exits/0/threshold", "high"), "numeric threshold"),
        (broken("segments/1/exits/0/calibration", [1, 2]), "calibration"),
        (broken("segments/1/exits/0", "exit1"), "an exit must be an object"),
        (broken("links", ["device-edge"]), "objects keyed by link name"),
        (broken("links/device-edge", {"rate_bps": -1}), "malformed plan links"),
        (broken("links/device-cloud", {"rate_bps": 1e6}), "unknown link"),
        (broken("codec/edge-device", "zstd"), "unknown link"),
        (broken("codec/edge-cloud", "lz4"), "codec of link edge-cloud"),
        (broken("codec/edge-cloud", "auto"), "codec of link edge-cloud"),
        (broken("estimate", [["latency_s", 1]]), "'estimate' must be an object"),
        (broken("cuts", [1.5]), "'cuts'"),
        (broken("inputs", ...), "list of names"),
    ],
)
def test_plan_from_dict_refuses_malformed_plans(data: Any, message: str) -> None:
    with pytest.raises(PlanError, match=message):
        Plan.from_dict(data)


def test_segments_must_run_device_then_edge_then_cloud() -> None:
    data = plan_dict()
    data["segments"][0]["tier"] = "cloud"
    with pytest.raises(PlanError, match="device, then edge, then cloud"):
        Plan.from_dict(data)


def test_absent_optional_fields_default_to_empty() -> None:
    data = plan_dict()
    for key in ("links", "codec", "estimate", "cuts"):
        del data[key]
    data["segments"][1]["exits"] = None
    plan = Plan.from_dict(data)
    assert plan.links == {} and plan.codec == {} and plan.cuts == ()
    assert plan.segments[1].exits == ()
    assert "exits" not in SegmentSpec.from_dict(data["segments"][1]).to_dict()


def json_values() -> st.SearchStrategy[Any]:
    scalars = (
        st.none()
        | st.booleans()
        | st.integers(-3, 3)
        | st.floats()
        | st.text(max_size=4)
        | st.sampled_from(["device", "edge", "cloud", "s0.onnx", "h1", "image", "edge-cloud"])
    )
    keys = st.sampled_from(["tier", "file", "inputs", "outputs", "exits", "name", "threshold"])
    return st.recursive(
        scalars,
        lambda inner: (
            st.lists(inner, max_size=3)
            | st.dictionaries(keys | st.text(max_size=3), inner, max_size=3)
        ),
        max_leaves=8,
    )


PATHS = [
    "format", "model", "model/sha256", "inputs", "outputs", "segments", "segments/0",
    "segments/1/exits", "segments/1/exits/0", "segments/1/exits/0/calibration",
    "segments/2/inputs", "links", "links/edge-cloud", "codec", "codec/device-edge",
    "estimate", "cuts",
]  # fmt: skip


@settings(max_examples=400, deadline=None)
@given(path=st.sampled_from(PATHS), value=json_values())
def test_any_malformed_plan_is_a_plan_error(path: str, value: Any) -> None:
    try:
        plan = Plan.from_dict(broken(path, value))
    except PlanError:
        return
    assert Plan.from_dict(copy.deepcopy(plan.to_dict())) == plan


def test_save_and_load_plan(tmp_path: Path) -> None:
    plan = Plan.from_dict(plan_dict())
    directory = tmp_path / "plan"
    path = save_plan(plan, directory)
    assert path == directory / PLAN_FILE
    for segment in plan.segments:
        (directory / segment.file).write_bytes(b"onnx")
    assert load_plan(directory) == plan
    assert load_plan(str(directory)) == plan
    (directory / "s1.onnx").unlink()
    with pytest.raises(PlanError, match=r"s1\.onnx, which is missing"):
        load_plan(directory)


def test_load_plan_reports_missing_and_unreadable_files(tmp_path: Path) -> None:
    with pytest.raises(PlanError, match="not found"):
        load_plan(tmp_path)
    (tmp_path / PLAN_FILE).write_text("{not json")
    with pytest.raises(PlanError, match="cannot read"):
        load_plan(tmp_path)
    (tmp_path / PLAN_FILE).write_bytes(b"\xff\xfe")
    with pytest.raises(PlanError, match="cannot read"):
        load_plan(tmp_path)


def test_load_plan_refuses_hostile_files(tmp_path: Path) -> None:
    plan = Plan.from_dict(plan_dict())
    directory = tmp_path / "plan"
    save_plan(plan, directory)
    for segment in plan.segments:
        (directory / segment.file).write_bytes(b"onnx")
    good = (directory / PLAN_FILE).read_text()

    (directory / PLAN_FILE).write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(PlanError, match="nested"):
        load_plan(directory)
    deep = plan.to_dict()
    deep["estimate"]["notes"] = json.loads("[" * 40 + "]" * 40)
    (directory / PLAN_FILE).write_text(json.dumps(deep))
    with pytest.raises(PlanError, match="deeper than"):
        load_plan(directory)
    for constant in ("NaN", "Infinity", "-Infinity"):
        (directory / PLAN_FILE).write_text(good.replace('"cuts": [', f'"x": {constant}, "cuts": ['))
        with pytest.raises(PlanError, match=constant):
            load_plan(directory)

    (directory / PLAN_FILE).write_text(good)
    outside = tmp_path / "elsewhere.onnx"
    outside.write_bytes(b"onnx")
    (directory / "s1.onnx").unlink()
    (directory / "s1.onnx").symlink_to(outside)
    with pytest.raises(PlanError, match="outside the plan directory"):
        load_plan(directory)
    (directory / "s1.onnx").unlink()
    (directory / "copy.onnx").write_bytes(b"onnx")
    (directory / "s1.onnx").symlink_to("copy.onnx")  # a link within the plan is fine
    assert load_plan(directory) == plan


@pytest.mark.parametrize("threshold", ["nan", "inf", -0.5])
def test_exit_thresholds_must_be_finite_and_not_negative(threshold: Any) -> None:
    with pytest.raises(PlanError, match="threshold"):
        ExitSpec.from_dict({"name": "e", "threshold": threshold})


def test_link_spec_refuses_infinity() -> None:
    with pytest.raises(UsageError, match="rate"):
        LinkSpec(float("inf"))
    with pytest.raises(UsageError, match="RTT"):
        LinkSpec(1e6, float("inf"))
