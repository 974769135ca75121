"""``tierflow device`` and ``tierflow.device.Device``: frames through device, edge and cloud.

The CNN fixture reads 3 x 8 x 8 images. Frames are PNG and JPEG files of other sizes, so
every one is resized; each result must equal the unsplit model's output on the same
preprocessed input, bit for bit, and the preprocessing must be the declared one.
"""

from __future__ import annotations

import importlib.util
import io
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tierflow.cli.main import main
from tierflow.codec.base import ImageNorm
from tierflow.device import Device
from tierflow.device.client import DeviceClient
from tierflow.device.preprocess import Preprocess, plan_preprocess, read_image
from tierflow.device.sources import stdin_frames
from tierflow.errors import InputError, UsageError
from tierflow.plan import load_plan, save_plan

Image = pytest.importorskip("PIL.Image")


def _pictures(folder: Path, count: int, seed: int = 0) -> list[Path]:
    """``count`` random pictures of assorted sizes, PNG and JPEG alternately."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    paths = []
    for i in range(count):
        size = (8, 8) if i == 0 else (int(rng.integers(5, 30)), int(rng.integers(5, 30)))
        pixels = rng.integers(0, 256, (*size, 3), dtype=np.uint8)
        path = folder / f"frame{seed:02d}{i:03d}.{'png' if i % 2 == 0 else 'jpg'}"
        Image.fromarray(pixels).save(path)
        paths.append(path)
    return paths


def _expected(split: Any, preprocess: Preprocess, path: Path) -> np.ndarray:
    return split.reference({"x": preprocess(read_image(path))})["y"]


def test_preprocessing_is_the_declared_one(rt: Any, tmp_path: Path) -> None:
    split = rt.cnn(tmp_path / "plan")
    preprocess = plan_preprocess(load_plan(split.plan_dir), split.plan_dir, "imagenet")
    assert (preprocess.name, preprocess.height, preprocess.width) == ("x", 8, 8)
    pixels = np.random.default_rng(3).integers(0, 256, (8, 8, 3), dtype=np.uint8)
    mean = np.array([0.485, 0.456, 0.406], np.float32)
    std = np.array([0.229, 0.224, 0.225], np.float32)
    by_hand = ((pixels.astype(np.float32) / np.float32(255) - mean) / std).transpose(2, 0, 1)
    np.testing.assert_array_equal(preprocess(pixels), by_hand[np.newaxis])
    # another size is resized first (bilinear), grey is made RGB
    assert preprocess(np.zeros((20, 13), np.uint8)).shape == (1, 3, 8, 8)
    with pytest.raises(InputError, match="8-bit image"):
        preprocess(pixels.astype(np.float32))


def test_plan_normalisation_wins_over_the_default(rt: Any, tmp_path: Path) -> None:
    split = rt.cnn(tmp_path / "plan")
    plan = load_plan(split.plan_dir)
    norm = ImageNorm(mean=(0.5, 0.5, 0.5), std=(0.25, 0.25, 0.25), layout="NCHW")
    save_plan(replace(plan, images={"x": norm}), split.plan_dir)
    assert plan_preprocess(load_plan(split.plan_dir), split.plan_dir).norm == norm
    assert plan_preprocess(load_plan(split.plan_dir), split.plan_dir, "unit").norm.mean == (
        0.0,
        0.0,
        0.0,
    )
    with pytest.raises(UsageError, match="malformed --image-norm"):
        plan_preprocess(plan, split.plan_dir, "mean=1")


@pytest.mark.integration
def test_device_command_from_a_folder_is_bit_exact(rt: Any, tmp_path: Path) -> None:
    split = rt.cnn(tmp_path / "plan")
    paths = _pictures(tmp_path / "frames", 6)
    (tmp_path / "frames" / "notes.txt").write_text("not an image")
    (tmp_path / "frames" / "broken.png").write_bytes(b"not a png")
    results = tmp_path / "r.jsonl"
    with rt.tiers(split.plan_dir) as (edge, _, _):
        status = main(
            [
                "device",
                "--plan",
                str(split.plan_dir),
                "--edge",
                edge,
                "--source",
                str(tmp_path / "frames"),
                "--results",
                str(results),
                "--image-norm",
                "imagenet",
                "--window",
                "3",
            ]
        )
    lines = [json.loads(line) for line in results.read_text().splitlines()]
    assert status == 1  # the broken file failed, alone
    assert [line["source"] for line in lines] == sorted([p.name for p in paths] + ["broken.png"])
    assert [line["id"] for line in lines] == list(range(len(lines)))
    broken = next(line for line in lines if line["source"] == "broken.png")
    assert broken["error"]["type"] == "InputError"
    preprocess = plan_preprocess(load_plan(split.plan_dir), split.plan_dir, "imagenet")
    for line in lines:
        if line["source"] == "broken.png":
            continue
        assert line["error"] is None and line["answered_by"] == "cloud"
        got = np.array(line["outputs"]["y"], np.float32)
        np.testing.assert_array_equal(
            got, _expected(split, preprocess, tmp_path / "frames" / line["source"])
        )


@pytest.mark.integration
def test_device_watch_takes_new_files_and_stops_on_sigterm(rt: Any, tmp_path: Path) -> None:
    """A config file, --watch, metrics scraped while it runs, SIGTERM ends it cleanly."""
    prometheus = pytest.importorskip("prometheus_client.parser")
    split = rt.cnn(tmp_path / "plan")
    folder = tmp_path / "frames"
    first = _pictures(folder, 1, seed=1)
    results = tmp_path / "r.jsonl"
    with rt.tiers(split.plan_dir) as (edge, _, _):
        config = tmp_path / "device.toml"
        config.write_text(
            f'plan = "{split.plan_dir}"\nedge = "{edge}"\nsource = "{folder}"\n'
            'watch = true\npoll = "50ms"\nmetrics-port = 0\n'
        )
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tierflow.cli",
                "device",
                "--config",
                str(config),
                "--results",
                str(results),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            assert process.stderr is not None
            said = process.stderr.readline()
            assert "metrics on http://" in said, said + process.communicate()[1]
            url = said.split(" on ")[1].strip()
            _wait_for_lines(results, 1, process)
            added = _pictures(tmp_path / "later", 1, seed=2)[0]
            os.replace(added, folder / added.name)
            _wait_for_lines(results, 2, process)
            with urllib.request.urlopen(url, timeout=10) as response:
                scraped = response.read().decode()
            process.send_signal(signal.SIGTERM)
            _, stderr = process.communicate(timeout=20)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
    assert process.returncode == 0, stderr
    assert "stopped; 2 results, 0 failed" in stderr
    lines = [json.loads(line) for line in results.read_text().splitlines()]
    assert [line["source"] for line in lines] == [first[0].name, added.name]
    preprocess = plan_preprocess(load_plan(split.plan_dir), split.plan_dir)
    got = np.array(lines[1]["outputs"]["y"], np.float32)
    np.testing.assert_array_equal(got, _expected(split, preprocess, folder / added.name))
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in prometheus.text_string_to_metric_families(scraped)
        for sample in family.samples
    }
    ok = (("answered_by", "cloud"), ("outcome", "ok"), ("tier", "device"))
    assert samples[("tierflow_requests_total", ok)] == 2
    assert samples[("tierflow_request_seconds_count", (("tier", "device"),))] == 2
    sent = samples[
        ("tierflow_link_bytes_total", (("direction", "request"), ("link", "device-edge")))
    ]
    assert sent > 0


def _wait_for_lines(path: Path, count: int, process: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if path.exists() and len(path.read_text().splitlines()) >= count:
            return
        assert process.poll() is None, process.communicate()[1]
        time.sleep(0.05)
    raise AssertionError(f"{path} did not reach {count} lines")


@pytest.mark.integration
def test_device_api_infer_and_stream(rt: Any, tmp_path: Path) -> None:
    split = rt.cnn(tmp_path / "plan")
    paths = _pictures(tmp_path / "frames", 4, seed=4)
    broken = tmp_path / "frames" / "broken.jpg"
    broken.write_bytes(b"\xff\xd8 not really")
    with (
        rt.tiers(split.plan_dir) as (edge, _, _),
        Device(DeviceClient(split.plan_dir, edge)) as device,
    ):
        preprocess = device.preprocess
        pixels = read_image(paths[1])
        one = device.infer(pixels)
        np.testing.assert_array_equal(one.outputs["y"], _expected(split, preprocess, paths[1]))
        frames: list[Any] = [paths[0], broken, pixels, {"x": preprocess(pixels)}, str(paths[3])]
        results = list(device.stream(frames))
        stdin = io.BytesIO()
        np.save(stdin, pixels)
        np.save(stdin, preprocess(read_image(paths[2])))
        stdin.seek(0)
        piped = [result for _, result in device.pairs(stdin_frames(stdin))]
    assert [r.ok for r in results] == [True, False, True, True, True]
    assert isinstance(results[1].error, InputError)
    expected = [_expected(split, preprocess, p) for p in (paths[0], paths[1], paths[1], paths[3])]
    for result, want in zip([r for r in results if r.ok], expected, strict=True):
        np.testing.assert_array_equal(result.outputs["y"], want)
    np.testing.assert_array_equal(piped[0].outputs["y"], expected[1])
    np.testing.assert_array_equal(piped[1].outputs["y"], _expected(split, preprocess, paths[2]))
    with pytest.raises(InputError, match="cannot read image"):
        device.infer(broken)


@pytest.mark.integration
def test_device_command_reads_npy_arrays_on_stdin(
    rt: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    split = rt.cnn(tmp_path / "plan")
    picture = np.random.default_rng(5).integers(0, 256, (11, 9, 3), dtype=np.uint8)
    tensor = split.sample(6)[0]["x"]
    piped = io.BytesIO()
    np.save(piped, picture)  # a picture: preprocessed
    np.save(piped, tensor)  # the model input: as is
    piped.seek(0)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(piped))
    results = tmp_path / "r.jsonl"
    with rt.tiers(split.plan_dir) as (edge, _, _):
        argv = ["device", "--plan", str(split.plan_dir), "--edge", edge, "--source", "-"]
        assert main([*argv, "--results", str(results)]) == 0
    lines = [json.loads(line) for line in results.read_text().splitlines()]
    assert [line["source"] for line in lines] == [0, 1]
    preprocess = plan_preprocess(load_plan(split.plan_dir), split.plan_dir)
    want = [split.reference({"x": preprocess(picture)})["y"], split.reference({"x": tensor})["y"]]
    for line, expected in zip(lines, want, strict=True):
        np.testing.assert_array_equal(np.array(line["outputs"]["y"], np.float32), expected)


@pytest.mark.integration
def test_device_command_says_what_is_wrong_in_one_line(
    rt: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    split = rt.cnn(tmp_path / "plan")
    argv = ["device", "--plan", str(split.plan_dir), "--edge", "127.0.0.1:1"]
    assert main([*argv, "--source", str(tmp_path / "nowhere")]) == 2
    assert "is neither a folder, a camera" in capsys.readouterr().err
    assert main([*argv, "--source", "-", "--watch"]) == 2
    assert "--watch watches a folder" in capsys.readouterr().err
    if importlib.util.find_spec("cv2") is None:
        assert main([*argv, "--source", "/dev/video9"]) == 2
        err = capsys.readouterr().err
        assert "pip install 'tierflow[camera]'" in err and "Traceback" not in err
