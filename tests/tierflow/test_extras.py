"""Planning commands in a runtime-only install say which extra to install, in one line.

A runtime-only install (``pip install tierflow``) has no onnx, torch or scikit-learn. The
commands run in a subprocess whose import system refuses those modules, as such an
install would, and must print one line naming the extra: no traceback.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

try:  # the standard library from 3.11
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    import tomli as tomllib

from tierflow.errors import MissingExtraError
from tierflow.extras import EXTRA_OF_MODULE, import_extra, missing_extra

# Makes the listed top-level modules unimportable, the way a runtime-only install has them.
BLOCKER = """
import sys
from importlib.abc import MetaPathFinder

BLOCKED = {"onnx", "onnxscript", "torch", "sklearn", "matplotlib"}

class Blocker(MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, Blocker())
from tierflow.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.integration
@pytest.mark.parametrize(
    ("argv", "extra"),
    [
        (["plan", "model.onnx", "-o", "plan"], "plan"),
        (["profile", "model.onnx", "-o", "profile.json"], "plan"),
        (["exits", "add", "model.onnx", "--data", "calib.npz", "-o", "out.onnx"], "train"),
        (["demo"], "train"),
    ],
)
def test_planning_commands_name_the_extra(tmp_path: Path, argv: list[str], extra: str) -> None:
    model = tmp_path / "model.onnx"
    model.write_bytes(b"not read: the command stops at its first import")
    (tmp_path / "calib.npz").write_bytes(b"")
    done = subprocess.run(
        [sys.executable, "-c", BLOCKER, *argv],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    command = " ".join(argv[:2] if argv[0] == "exits" else argv[:1])
    assert lines[0].startswith(f"tierflow {command}: error: ")
    assert f"pip install 'tierflow[{extra}]'" in lines[0]


@pytest.mark.integration
def test_serve_help_needs_no_extra() -> None:
    """The runtime commands still work with the extras blocked."""
    done = subprocess.run(
        [sys.executable, "-c", BLOCKER, "serve", "edge", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "--upstream" in done.stdout


def test_missing_extra_names_the_extra() -> None:
    error = missing_extra(ModuleNotFoundError("No module named 'onnx.helper'", name="onnx.helper"))
    assert isinstance(error, MissingExtraError)
    assert (error.module, error.extra) == ("onnx", "plan")
    assert missing_extra(ModuleNotFoundError("x", name="no_such_thing")) is None
    # Every extra an error names is one pyproject.toml declares (pip would refuse another).
    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    declared = tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]
    assert set(EXTRA_OF_MODULE.values()) <= set(declared)


def test_import_extra_raises_a_typed_error() -> None:
    with pytest.raises(MissingExtraError, match=r"the widget needs .*pip install"):
        EXTRA_OF_MODULE["tierflow_no_such_module"] = "plan"
        try:
            import_extra("tierflow_no_such_module", "the widget")
        finally:
            del EXTRA_OF_MODULE["tierflow_no_such_module"]
    assert import_extra("json", "parsing").dumps([]) == "[]"


#: The distributions that install the ``cv2`` module (each writes the same files).
_CV2 = {"opencv-python", "opencv-python-headless", "opencv-contrib-python"}


def _cv2_packages(requirement: str, extras: dict[str, list[str]], seen: set[str]) -> set[str]:
    """The cv2 distributions ``requirement`` brings: itself, or through its own
    requirements as installed here (their metadata), or through tierflow's extras."""
    from importlib import metadata

    from packaging.requirements import Requirement

    parsed = Requirement(requirement)
    name = parsed.name.lower().replace("_", "-")
    if name == "tierflow":
        return set().union(
            *(_cv2_packages(r, extras, seen) for e in parsed.extras for r in extras[e])
        )
    if name in _CV2:
        return {name}
    if name in seen:
        return set()
    seen.add(name)
    try:
        needs = metadata.requires(name) or []
    except metadata.PackageNotFoundError:
        return set()
    found = set()
    for need in needs:
        if "extra ==" not in need:
            found |= _cv2_packages(need.split(";")[0], extras, seen)
    return found


ROOT = Path(__file__).resolve().parents[2]
HEADLESS = "opencv-python-headless"


def test_no_extra_installs_opencv_python_only_the_headless_cv2() -> None:
    """``all`` had camera's opencv-python-headless and, through models' rapid-* packages,
    opencv-python: both write cv2, and whichever came last won each file (issue 30, 14).
    Now no extra brings any cv2 but the headless one, not through any requirement's own
    requirements (as installed here), and ``all`` and ``dev`` bring it."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert extras["camera"] == [f"{HEADLESS}>=4.8"]  # a device: no GUI libraries
    for extra, requirements in extras.items():
        found = set().union(*(_cv2_packages(r, extras, set()) for r in requirements))
        assert found <= {HEADLESS}, f"the {extra} extra installs {sorted(found)}"
        if extra in ("all", "dev"):
            assert found == {HEADLESS}, extra


def test_the_packages_that_would_bring_opencv_python_are_installed_without_requirements() -> None:
    """The rapid-* wheels (tierflow.zoo.real reads their ONNX files) require opencv-python:
    pyproject.toml lists them under ``[tool.tierflow] no-deps``, which scripts/test installs
    with ``--no-deps``, as zoo.real's messages say; every other ``pip install`` of the
    README's two commands installs tierflow's own extras, checked above."""
    from packaging.requirements import Requirement

    from tierflow.zoo import real

    pins = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["tierflow"]["no-deps"]
    pinned = {Requirement(pin).name: str(Requirement(pin).specifier) for pin in pins}
    for package, command in real.INSTALL.items():
        name = package.replace("_", "-")
        assert command == f"pip install --no-deps '{name}{pinned[name]}'"
    for script in ("scripts/test", "scripts/demo", ".ci/run"):
        for line in (ROOT / script).read_text().splitlines():
            words = line.split()
            if "pip" in words and "install" in words[words.index("pip") :]:
                given = [w for w in words[words.index("install") + 1 :] if not w.startswith("-")]
                own = all(w.strip("'\"").startswith(".[") for w in given)
                no_deps = "--no-deps" in words
                assert own or no_deps or given == ["pip"], f"{script}: {line.strip()}"
    test = (ROOT / "scripts/test").read_text()
    assert '["tool"]["tierflow"]["no-deps"]' in test
    assert 'pip install -q --no-deps --no-compile "${no_deps[@]}"' in test
