"""Plan sets in plan.json: format 2 round trips, a format-1 plan still loads, errors name it."""

from __future__ import annotations

import copy
import hashlib
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from tierflow.errors import PlanError
from tierflow.link.spec import LinkSpec
from tierflow.plan import (
    PLAN_SET_FORMAT,
    Plan,
    PlanSet,
    SegmentSpec,
    load_plan,
    load_plan_set,
    save_plan,
    save_plan_set,
)


def _plan(files: tuple[str, ...], tiers: tuple[str, ...], rate: float) -> Plan:
    names = ["x", "h", "y"]
    return Plan(
        model_file="m.onnx",
        model_sha256="a" * 64,
        inputs=("x",),
        outputs=("y",),
        segments=tuple(
            SegmentSpec(tier, file, (names[i],), (names[i + 1],))
            for i, (tier, file) in enumerate(zip(tiers, files, strict=True))
        ),
        links={"device-edge": LinkSpec(rate, 0.01), "edge-cloud": LinkSpec(1e9, 0.03)},
    )


def _set() -> PlanSet:
    slow = _plan(("seg-1.onnx", "seg-2.onnx"), ("device", "device"), 1e6)
    fast = _plan(("seg-1.onnx", "seg-2.onnx"), ("device", "cloud"), 100e6)
    point = {"device-edge": LinkSpec(1e6, 0.01), "edge-cloud": LinkSpec(1e9, 0.03)}
    other = {"device-edge": LinkSpec(100e6, 0.01), "edge-cloud": LinkSpec(1e9, 0.03)}
    return PlanSet((slow, fast), ((point,), (other,)), default=1)


def _write(directory: Path, plans: PlanSet) -> Path:
    directory.mkdir()
    for name in ("seg-1.onnx", "seg-2.onnx"):
        (directory / name).write_bytes(b"onnx")
    save_plan_set(plans, directory)
    return directory


def test_a_plan_set_round_trips_and_loads_its_default_plan(tmp_path: Path) -> None:
    plans = _set()
    data = json.loads(json.dumps(plans.to_dict()))
    assert data["format"] == PLAN_SET_FORMAT == "tierflow.plan/2"
    assert PlanSet.from_dict(data) == plans
    directory = _write(tmp_path / "set", plans)
    assert load_plan_set(directory) == plans
    # Tiers that serve one plan get the default one; the two plans share segment files.
    assert load_plan(directory) == plans.plans[1]
    assert plans.plans[0].plan_id != plans.plans[1].plan_id


def test_a_plan_id_is_computed_once_and_stays_out_of_equality() -> None:
    # Every tier looks each request's plan up by id: an id hashed again on every access
    # cost 45 us per plan and request (found by python -m benchmarks.transport --against).
    plans = _set()
    first = plans.plans[0]
    assert first.plan_id is first.plan_id  # kept, not hashed again
    again = PlanSet.from_dict(json.loads(json.dumps(plans.to_dict()))).plans[0]
    assert again == first and again.plan_id == first.plan_id
    changed = replace(first, codec={"device-edge": "zstd"})
    assert changed != first and changed.plan_id != first.plan_id


def test_a_single_plan_loads_as_a_set_of_one(tmp_path: Path) -> None:
    plan = _plan(("seg-1.onnx", "seg-2.onnx"), ("device", "edge"), 20e6)
    (tmp_path / "seg-1.onnx").write_bytes(b"onnx")
    (tmp_path / "seg-2.onnx").write_bytes(b"onnx")
    save_plan(plan, tmp_path)
    plans = load_plan_set(tmp_path)
    assert plans.plans == (plan,) and plans.regions == ((),) and plans.default_plan == plan
    assert load_plan(tmp_path) == plan


def _broken(change: Any) -> dict[str, Any]:
    data = copy.deepcopy(_set().to_dict())
    change(data)
    return data


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (_broken(lambda d: d.update(format="tierflow.plan/3")), "unsupported plan format"),
        (_broken(lambda d: d.update(plans=[])), "holds no plans"),
        (_broken(lambda d: d.update(plans={})), "'plans' must be a list"),
        (_broken(lambda d: d.update(default=2)), "default plan 2"),
        (_broken(lambda d: d["plans"][1].update(model={"sha256": "b" * 64})), "different models"),
        (_broken(lambda d: d["plans"].append(d["plans"][0])), "appears twice"),
        (_broken(lambda d: d["plans"][0].update(regions={})), "regions must be a list"),
        (_broken(lambda d: d["plans"][0]["regions"][0].update(wifi={})), "unknown link"),
        (
            _broken(lambda d: d["plans"][0]["regions"][0].update({"edge-cloud": {"rate_bps": 0}})),
            "plan 0 regions",
        ),
        (_broken(lambda d: d["plans"][0]["segments"][0].update(tier="phone")), "segment tier"),
    ],
)
def test_a_malformed_plan_set_is_a_plan_error(data: Any, message: str) -> None:
    with pytest.raises(PlanError, match=message):
        PlanSet.from_dict(data)


def test_a_missing_segment_of_any_plan_fails_the_load(tmp_path: Path) -> None:
    plans = _set()
    directory = _write(tmp_path / "set", plans)
    (directory / "seg-2.onnx").unlink()
    with pytest.raises(PlanError, match=r"seg-2\.onnx, which is missing"):
        load_plan_set(directory)


def test_a_plan_json_without_segment_digests_loads_and_keeps_its_id(tmp_path: Path) -> None:
    plan = _plan(("seg-1.onnx", "seg-2.onnx"), ("device", "cloud"), 1e6)
    for name in ("seg-1.onnx", "seg-2.onnx"):
        (tmp_path / name).write_bytes(name.encode())
    (tmp_path / "plan.json").write_text(json.dumps(plan.to_dict()))  # as tierflow wrote it before
    old = load_plan(tmp_path)
    assert all(s.sha256 is None and s.size is None for s in old.segments)
    save_plan(old, tmp_path)
    new = load_plan(tmp_path)
    for spec in new.segments:
        assert spec.sha256 == hashlib.sha256(spec.file.encode()).hexdigest()
        assert spec.size == len(spec.file)
    assert new.plan_id == old.plan_id and new == old  # a file's digest is not its identity


@pytest.mark.parametrize(
    ("entry", "match"),
    [
        ({"sha256": "ABC"}, "64 lowercase hex"),
        ({"bytes": -1}, "whole number"),
        ({"bytes": True}, "whole number"),
    ],
)
def test_a_malformed_segment_digest_is_refused(entry: dict[str, Any], match: str) -> None:
    data = _plan(("seg-1.onnx", "seg-2.onnx"), ("device", "cloud"), 1e6).to_dict()
    data["segments"][0].update(entry)
    with pytest.raises(PlanError, match=match):
        Plan.from_dict(data)
