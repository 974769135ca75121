"""The fast-test guard (tests/layers.py) on a fresh machine."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parent.parent


def test_a_fast_test_may_draw_with_matplotlib() -> None:
    """Drawing is fast work; building matplotlib's font cache is the environment's, not
    this test's (tests/conftest.py warms it before the guard is installed)."""
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots()
    axes.set_title("text needs a font")
    figure.canvas.draw()
    plt.close(figure)


@pytest.mark.integration
def test_the_fast_layer_passes_with_no_matplotlib_cache(tmp_path: Path) -> None:
    """The test above, run as on a fresh machine: an empty HOME and ``MPLCONFIGDIR``."""
    pytest.importorskip("matplotlib")
    home = tmp_path / "home"
    home.mkdir()
    config = tmp_path / "mpl"
    config.mkdir()
    environment = {**os.environ, "HOME": str(home), "MPLCONFIGDIR": str(config)}
    environment.pop("XDG_CACHE_HOME", None)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-n",
            "0",
            "-p",
            "no:cacheprovider",
            f"{Path(__file__).relative_to(_ROOT)}::test_a_fast_test_may_draw_with_matplotlib",
        ],
        cwd=_ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert any(config.iterdir()), "matplotlib built no font cache: the run was not fresh"
