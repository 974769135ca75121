"""torch's exporters say nothing about torchvision through the zoo, and nothing else is hidden."""

from __future__ import annotations

import importlib.util
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from tierflow.zoo.exporting import REGISTRATION_LOGGER, quiet_onnx_export

pytest.importorskip("torch")

_EXPORT = """
import sys
from tierflow.zoo.models import chain_cnn, export_onnx
module, example = chain_cnn(size=16, width=0.0625)
export_onnx(module, example, sys.argv[1], dynamo=True)
"""


@pytest.mark.integration
def test_a_dynamo_export_prints_no_torchvision_notice(tmp_path: Path) -> None:
    """The exporter builds its op table (and logs the notice) once per process: a fresh one."""
    if importlib.util.find_spec("torchvision") is not None:
        pytest.skip("torchvision is installed: the exporter has nothing to say about it")
    path = tmp_path / "chain.onnx"
    done = subprocess.run(
        [sys.executable, "-c", _EXPORT, str(path)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert path.stat().st_size > 0
    assert "torchvision is not installed" not in done.stderr, done.stderr
    assert "Traceback" not in done.stderr, done.stderr


def test_only_the_torchvision_notice_is_dropped(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger(REGISTRATION_LOGGER)
    with caplog.at_level(logging.WARNING, logger=REGISTRATION_LOGGER):
        with quiet_onnx_export():
            logger.warning("torchvision is not installed. Skipping %s", "torchvision::nms")
            logger.warning("'%s' does not have a 'default' overload", "aten::odd")
        logger.warning("torchvision is not installed. Skipping %s", "torchvision::roi_align")
    assert [r.getMessage() for r in caplog.records] == [
        "'aten::odd' does not have a 'default' overload",
        "torchvision is not installed. Skipping torchvision::roi_align",  # outside the export
    ]
