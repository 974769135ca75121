"""``tierflow plan -o``: checked before any work, and a re-plan replaces the old plan whole."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tierflow.cli.main import main
from tierflow.errors import UsageError
from tierflow.partitioner.split import check_plan_dir, remove_old_plan
from tierflow.plan import load_plan

from .conftest import write_mlp


@pytest.fixture(scope="module")
def model(tmp_path_factory: Any) -> Path:
    """A four-layer MLP: small enough to plan in seconds."""
    return write_mlp(tmp_path_factory.mktemp("model") / "mlp.onnx", [32] * 5)


def test_an_existing_file_as_plan_dir_fails_at_once_with_one_line(
    model: Path, tmp_path: Path, capsys: Any
) -> None:
    taken = tmp_path / "plan"
    taken.write_text("not a directory\n")
    code = main(["plan", str(model), "-o", str(taken)])
    out, err = capsys.readouterr()
    assert code == 2
    message = f"cannot write '{taken}': it is a file; expected a folder"
    assert err == f"tierflow plan: error: {message}\n"
    assert "profiling" not in out + err  # no work was done first
    code = main(["plan", str(model), "-o", str(taken / "inside")])
    assert code == 2 and f"'{taken}' is not a folder" in capsys.readouterr().err
    code = main(["profile", str(model), "-o", str(tmp_path)])
    assert code == 2 and "it is a folder; expected a file name" in capsys.readouterr().err


def test_replanning_leaves_exactly_the_new_plan(model: Path, tmp_path: Path, capsys: Any) -> None:
    plan_dir = tmp_path / "plan"
    plan_dir.mkdir()
    keep = plan_dir / "README.txt"
    keep.write_text("notes a user keeps beside the plan\n")
    # An older plan with three segments, one with external data, and a stray segment file.
    old = {
        "segments": [{"file": f"0{i}-{t}.onnx"} for i, t in enumerate(["device", "edge", "cloud"])]
    }
    (plan_dir / "plan.json").write_text(json.dumps(old))
    for name in (
        "00-device.onnx",
        "01-edge.onnx",
        "02-cloud.onnx",
        "02-cloud.onnx.data",
        "05-edge.onnx",
    ):
        (plan_dir / name).write_bytes(b"old")
    # A rate in bytes per second without an RTT: 160 Mbit/s, the default RTT kept and said.
    argv = ["plan", str(model), "-o", str(plan_dir), "--link", "device-edge=20MB/s"]
    argv += ["--slowdown", "device=1", "--slowdown", "edge=1", "--slowdown", "cloud=1"]
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "device-edge: 160mbit,10ms (no RTT given: kept the default 10ms)" in out
    plan = load_plan(plan_dir)
    assert plan.links["device-edge"].rate_bps == 160e6
    expected = {"plan.json", "README.txt", *(s.file for s in plan.segments)}
    assert {p.name for p in plan_dir.iterdir()} == expected
    assert all((plan_dir / s.file).read_bytes() != b"old" for s in plan.segments)
    assert keep.read_text().startswith("notes")


def test_remove_old_plan_touches_only_plan_files(tmp_path: Path) -> None:
    (tmp_path / "plan.json").write_text(json.dumps({"segments": [{"file": "mine.onnx"}]}))
    names = ("mine.onnx", "mine.onnx.data", "model.onnx", "00-phone.onnx", "10-edge.onnx")
    for name in (*names, "mine.onnx.part", "seg-0123456789ab.onnx.part"):  # fetches left
        (tmp_path / name).write_bytes(b"")
    removed = remove_old_plan(tmp_path)
    assert removed == [
        "10-edge.onnx",
        "mine.onnx",
        "mine.onnx.data",
        "mine.onnx.part",
        "plan.json",
        "seg-0123456789ab.onnx.part",
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["00-phone.onnx", "model.onnx"]
    assert remove_old_plan(tmp_path / "absent") == []
    with pytest.raises(UsageError):
        check_plan_dir(tmp_path / "model.onnx")
