"""mypy sees the tier folders as the tierflow modules they are installed as.

setuptools maps ``device/`` to ``tierflow.device`` and so on; mypy cannot follow that
mapping, so ``pyproject.toml`` points ``mypy_path`` at ``.ci/namespace``, whose
``tierflow/`` holds one relative link per tier folder (a namespace portion that mypy
merges with the core). These tests keep the links, the mapping and the checked packages
in step, and make sure no global ignore turns an unresolved ``tierflow`` import into a
silent ``Any`` again.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent


def _config() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _tier_folders(config: dict[str, Any]) -> dict[str, str]:
    """``{"device": "device", ...}``: the folders mapped directly under ``tierflow``."""
    mapping: dict[str, str] = config["tool"]["setuptools"]["package-dir"]
    tiers = {}
    for package, folder in mapping.items():
        parent, _, name = package.rpartition(".")
        if parent == "tierflow":
            tiers[name] = folder
        elif parent:  # a subpackage: the link to its parent's folder must already hold it
            assert folder == f"{mapping[parent]}/{name}", (package, folder)
    return tiers


def test_every_tier_folder_is_linked_into_the_namespace_mypy_reads() -> None:
    config = _config()
    tiers = _tier_folders(config)
    namespace = ROOT / config["tool"]["mypy"]["mypy_path"] / "tierflow"
    links = {path.name: path for path in namespace.iterdir()}
    assert set(links) == set(tiers)
    for name, link in links.items():
        assert link.is_symlink(), link
        assert not os.path.isabs(os.readlink(link)), "links must work from any clone"
        assert link.resolve() == (ROOT / tiers[name]).resolve()
    assert set(tiers) == {"device", "edge", "cloud", "partitioner", "demos", "zoo"}


def test_mypy_checks_every_tier_and_ignores_only_named_third_party_modules() -> None:
    config = _config()
    mypy = config["tool"]["mypy"]
    assert "ignore_missing_imports" not in mypy
    tiers = _tier_folders(config)
    assert set(mypy["packages"]) == {"tierflow", *(f"tierflow.{name}" for name in tiers)}
    overrides = mypy.get("overrides", [])
    assert overrides, "third-party modules without types need a per-module override"
    for override in overrides:
        modules = override["module"]
        modules = [modules] if isinstance(modules, str) else modules
        assert all(m.split(".")[0] not in {"tierflow", "*"} for m in modules), modules
