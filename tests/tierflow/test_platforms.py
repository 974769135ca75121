"""The runtime-only install resolves to wheels on 64-bit ARM Linux (a Raspberry Pi, a Jetson).

pip resolves the project's runtime dependencies for ``manylinux_2_28_aarch64`` (glibc 2.28,
what onnxruntime >= 1.17 needs there) on Python 3.10 and 3.11, binary wheels only, without
downloading them (``--dry-run --report``), as a user gets them (the newest that fit); and the
floors pyproject.toml names have such wheels (the index's JSON page of each project).
Skipped when the index cannot be reached. The two resolutions run at once: about 10 s on
an idle machine. The install itself, under emulation, is
``scripts/arm64-check`` (not in the test suite).
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.tags import Tag, compatible_tags, cpython_tags
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
# A glibc 2.28 system accepts every manylinux tag up to 2.28; pip wants them all named.
PLATFORMS = [f"manylinux_2_{minor}_aarch64" for minor in range(28, 16, -1)] + [
    "manylinux2014_aarch64"
]
PYTHONS = ("3.10", "3.11")
UNREACHABLE = (
    "NewConnectionError",
    "Max retries exceeded",
    "Temporary failure in name resolution",
    "Network is unreachable",
    "Could not fetch URL",
    "ConnectTimeout",
    "ReadTimeout",
)


def runtime_requirements(python: str) -> list[Requirement]:
    """The runtime dependencies that apply on ``python`` for aarch64 Linux."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    environment = default_environment()
    environment.update(
        python_version=python,
        python_full_version=f"{python}.0",
        platform_machine="aarch64",
        sys_platform="linux",
        platform_system="Linux",
    )
    requirements = [Requirement(text) for text in project["dependencies"]]
    return [r for r in requirements if r.marker is None or r.marker.evaluate(environment)]


def floor(requirement: Requirement) -> str:
    """The ``X`` of the ``>=X`` in ``requirement``."""
    floors = [s.version for s in requirement.specifier if s.operator in (">=", "==")]
    assert floors, f"{requirement} names no floor"
    return floors[0]


def aarch64_tags(python: str) -> set[Tag]:
    """The wheel tags CPython ``python`` accepts on glibc 2.28 aarch64 Linux."""
    version = tuple(int(part) for part in python.split("."))
    abi = f"cp{python.replace('.', '')}"
    return set(cpython_tags(version, [abi], PLATFORMS)) | set(
        compatible_tags(version, abi, PLATFORMS)
    )


def resolve(python: str, requirements: list[str], report: Path) -> subprocess.Popen[str]:
    """pip resolving ``requirements`` for aarch64 on ``python``, wheels only, no download."""
    command = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--dry-run",
        "--quiet",
        "--ignore-installed",
        "--only-binary=:all:",
        "--python-version",
        python,
        "--implementation",
        "cp",
        "--abi",
        f"cp{python.replace('.', '')}",
        *(arg for platform in PLATFORMS for arg in ("--platform", platform)),
        "--target",
        str(report.parent / "target"),
        "--report",
        str(report),
        "--timeout",
        "15",
        "--retries",
        "1",
        *requirements,
    ]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@functools.cache
def project_files(name: str) -> tuple[str, ...]:
    """File names of every release, from the index's JSON project page (PEP 691)."""
    request = urllib.request.Request(
        f"https://pypi.org/simple/{canonicalize_name(name)}/",
        headers={"Accept": "application/vnd.pypi.simple.v1+json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return tuple(item["filename"] for item in json.load(response)["files"])
    except urllib.error.HTTPError as exc:
        pytest.skip(f"the package index answered {exc}")
    except OSError as exc:
        pytest.skip(f"the package index cannot be reached: {exc}")


def release_files(name: str, version: str) -> list[str]:
    """Wheel file names of one release."""
    wanted = Version(version)
    return [
        file
        for file in project_files(name)
        if file.endswith(".whl") and parse_wheel_filename(file)[1] == wanted
    ]


@pytest.mark.integration
@pytest.mark.network
def test_runtime_install_resolves_for_aarch64(tmp_path: Path) -> None:
    """What a user gets with ``pip install tierflow`` on aarch64, on 3.10 and 3.11."""
    jobs = {}
    for python in PYTHONS:
        requirements = runtime_requirements(python)
        names = {r.name for r in requirements}
        assert {"onnxruntime", "numpy", "grpcio", "protobuf", "zstandard"} <= names
        assert ("tomli" in names) == (python == "3.10")
        # Markers are evaluated here, for the target: pip would evaluate them for this Python.
        wanted = [f"{r.name}{r.specifier}" for r in requirements]
        report = tmp_path / f"report-{python}.json"
        jobs[python] = resolve(python, wanted, report), requirements, report
    outputs = {}
    for python, (process, _, _) in jobs.items():
        try:
            outputs[python] = (process.communicate(timeout=180)[0], process.returncode)
        except subprocess.TimeoutExpired:
            for other, _, _ in jobs.values():
                other.kill()
                other.communicate()
            pytest.skip("the package index did not answer within 180 s")
    for python, (output, code) in outputs.items():
        if code != 0 and any(marker in output for marker in UNREACHABLE):
            pytest.skip(f"the package index cannot be reached: {output.strip()[-300:]}")
        assert code == 0, f"Python {python}: the runtime does not resolve for aarch64:\n{output}"
        _, requirements, report = jobs[python]
        installed = {
            canonicalize_name(item["metadata"]["name"]): item["download_info"]["url"]
            for item in json.loads(report.read_text())["install"]
        }
        for requirement in requirements:
            url = installed[canonicalize_name(requirement.name)]
            tags = parse_wheel_filename(url.rsplit("/", 1)[-1])[3]
            assert tags & aarch64_tags(python), f"{url} does not fit aarch64 on {python}"


@pytest.mark.network
@pytest.mark.parametrize("python", PYTHONS)
def test_dependency_floors_have_aarch64_wheels(python: str) -> None:
    """Every runtime dependency has an aarch64 wheel for ``python`` at its floor."""
    wanted = aarch64_tags(python)
    for requirement in runtime_requirements(python):
        version = floor(requirement)
        wheels = release_files(requirement.name, version)
        fitting = [name for name in wheels if parse_wheel_filename(name)[3] & wanted]
        assert fitting, (
            f"{requirement.name} {version} (the floor in pyproject.toml) has no wheel for "
            f"Python {python} on manylinux_2_28_aarch64; its wheels: {wheels}"
        )
