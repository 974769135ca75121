"""``tierflow profile`` and ``tierflow plan`` end to end, and their one-line errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tierflow.cli.main import main
from tierflow.plan import load_plan

from .conftest import write_mlp

pytestmark = pytest.mark.integration


def _run(capsys: Any, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def model(zoo_exports: Any) -> Path:
    return Path(zoo_exports.path("resnet18", dynamo=False))


@pytest.fixture(scope="module")
def device_profile(model: Path, tmp_path_factory: Any) -> Path:
    path = tmp_path_factory.mktemp("profiles") / "device.json"
    assert (
        main(["profile", str(model), "-o", str(path), "--slowdown", "4", "--time-budget", "1"]) == 0
    )
    return path


def test_profile_then_plan_end_to_end(
    capsys: Any, model: Path, device_profile: Path, tmp_path: Path
) -> None:
    profile = json.loads(device_profile.read_text())
    assert profile["format"] == "tierflow.profile/1"
    assert profile["machine"]["slowdown"] == 4.0 and profile["machine"]["emulated"] is True

    plan_dir = tmp_path / "plan"
    code, out, err = _run(
        capsys,
        "plan",
        str(model),
        "-o",
        str(plan_dir),
        "--profile",
        f"device={device_profile}",
        "--link",
        "device-edge=20mbit,10ms",
        "--link",
        "edge-cloud=200mbit,30ms",
        "--memory",
        "device=64MiB",
    )
    assert code == 0, err
    assert "verified: split reproduces the model bit-for-bit on 1 input" in out
    assert "device-only" in out and "cloud-only" in out and "edge-only" in out
    assert "device ms (cpu)" in out  # what each tier's profile was measured on
    assert "edge: no profile given, profiled on this machine" in out
    plan = load_plan(plan_dir)
    assert plan.estimate["latency_s"] > 0
    assert all((plan_dir / s.file).is_file() for s in plan.segments)


def test_plan_json_and_probe_link_files(
    capsys: Any, model: Path, device_profile: Path, tmp_path: Path
) -> None:
    probe = tmp_path / "probe.json"
    probe.write_text(json.dumps({"link": "device-edge", "rate_bps": 1e6, "rtt_s": 0.05}))
    code, out, err = _run(
        capsys,
        "plan",
        str(model),
        "-o",
        str(tmp_path / "plan"),
        "--profile",
        f"device={device_profile}",
        "--profile",
        f"edge={device_profile}",
        "--profile",
        f"cloud={device_profile}",
        "--link",
        str(probe),
        "--codec",
        "zstd",
        "--json",
        "--no-verify",
    )
    assert code == 0, err
    report = json.loads(out)
    assert report["ranked"] and report["verified"] is None
    plan = load_plan(tmp_path / "plan")
    assert plan.links["device-edge"].rate_bps == 1e6 and plan.links["device-edge"].rtt_s == 0.05
    assert set(plan.codec.values()) <= {"zstd", "raw"}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--memory", "phone=1MiB"], "unknown tier 'phone'"),
        (["--link", "wifi=1mbit"], "unknown link 'wifi'"),
        (["--link", "device-edge=fast"], "malformed rate 'fast'"),
        (["--link", "device-edge=1mbit,soon"], "malformed duration 'soon'"),
        (["--memory", "device=lots"], "malformed size 'lots'"),
        (["--profile", "device"], "malformed --profile"),
        (["--codec", "gzip"], "malformed codec 'gzip'"),
        (["--link", "nowhere.json"], "link file nowhere.json does not exist"),
    ],
)
def test_bad_options_fail_with_one_line(
    capsys: Any, model: Path, tmp_path: Path, args: list[str], message: str
) -> None:
    code, _, err = _run(capsys, "plan", str(model), "-o", str(tmp_path / "p"), *args)
    assert code == 2
    assert err.startswith("tierflow plan: error: ") and message in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_bad_models_fail_with_one_line(capsys: Any, model: Path, tmp_path: Path) -> None:
    text = tmp_path / "notes.onnx"
    text.write_text("this is not a model\n")
    truncated = tmp_path / "truncated.onnx"
    truncated.write_bytes(model.read_bytes()[: model.stat().st_size // 2])
    for path in (text, truncated, tmp_path / "missing.onnx"):
        code, _, err = _run(capsys, "profile", str(path), "-o", str(tmp_path / "p.json"))
        assert code == 2, err
        assert err.startswith("tierflow profile: error: ") and str(path.name) in err
        assert err.count("\n") == 1 and "Traceback" not in err


def test_a_budget_nothing_fits_and_a_foreign_profile(
    capsys: Any, model: Path, device_profile: Path, zoo_exports: Any, tmp_path: Path
) -> None:
    args = [
        "--profile",
        f"device={device_profile}",
        "--profile",
        f"edge={device_profile}",
        "--profile",
        f"cloud={device_profile}",
    ]
    code, _, err = _run(
        capsys,
        "plan",
        str(model),
        "-o",
        str(tmp_path / "p"),
        *args,
        "--memory",
        "device=1KiB",
        "--memory",
        "edge=1KiB",
        "--memory",
        "cloud=1KiB",
    )
    assert code == 2
    assert "no plan fits the memory budgets (device 1KiB, edge 1KiB, cloud 1KiB)" in err
    assert "the smallest need is" in err and err.count("\n") == 1

    other = zoo_exports.path("chain_cnn", dynamo=False)
    code, _, err = _run(capsys, "plan", str(other), "-o", str(tmp_path / "q"), *args)
    assert code == 2
    assert "was made for another model" in err and "chain_cnn" in err and err.count("\n") == 1


def test_a_file_that_is_no_npz_archive_is_one_error_line(capsys: Any, tmp_path: Path) -> None:
    """plan --sample, profile --sample, run --input and exits add --data share the reader."""
    model = write_mlp(tmp_path / "mlp.onnx", [8, 4])
    single, text = tmp_path / "in.npy", tmp_path / "in.txt"
    np.save(single, np.zeros((3, 1, 8), np.float32))
    text.write_text("x = [0, 0, 0]\n")
    plan_dir = tmp_path / "plan"
    code, _, err = _run(capsys, "plan", str(model), "-o", str(plan_dir))
    assert code == 0, err
    commands = {
        "plan": ["plan", str(model), "-o", str(tmp_path / "p2"), "--sample"],
        "profile": ["profile", str(model), "-o", str(tmp_path / "d.json"), "--sample"],
        "run": ["run", "--plan", str(plan_dir), "--output", str(tmp_path / "o.npz"), "--input"],
        "exits": ["exits", "add", str(model), "-o", str(tmp_path / "e.onnx"), "--data"],
    }
    for name, argv in commands.items():
        for path, wording in ((single, "is a .npy file"), (text, "is not an .npz archive")):
            code, _, err = _run(capsys, *argv, str(path))
            assert code == 2, (name, err)
            assert wording in err and str(path) in err, (name, err)
            assert err.count("\n") == 1 and "Traceback" not in err, (name, err)
