"""The generated gRPC stubs match the proto, and the runtime core imports without torch/onnx."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
PROTO = "proto/tierflow/rpc/tier.proto"
STUBS = ("tier_pb2.py", "tier_pb2.pyi", "tier_pb2_grpc.py")


def test_proto_header_names_the_command_this_test_runs() -> None:
    header = (ROOT / PROTO).read_text()
    assert "python -m grpc_tools.protoc -Iproto --python_out=. --pyi_out=. --grpc_python_out=." in (
        header.replace("\\\n//      ", "")
    )


@pytest.mark.integration
@pytest.mark.parametrize("stub", STUBS)
def test_committed_stubs_equal_freshly_generated_ones(tmp_path: Path, stub: str) -> None:
    pytest.importorskip("grpc_tools", reason="grpcio-tools (the dev extra) generates the stubs")
    command = [
        sys.executable,
        "-m",
        "grpc_tools.protoc",
        "-Iproto",
        f"--python_out={tmp_path}",
        f"--pyi_out={tmp_path}",
        f"--grpc_python_out={tmp_path}",
        PROTO,
    ]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    generated = (tmp_path / "tierflow" / "rpc" / stub).read_bytes()
    committed = (ROOT / "tierflow" / "rpc" / stub).read_bytes()
    assert generated == committed, (
        f"tierflow/rpc/{stub} differs from what {PROTO} generates; regenerate it with the "
        "command in the proto's header comment"
    )


@pytest.mark.integration
def test_runtime_tiers_import_without_torch_or_onnx() -> None:
    """Device and edge install on a Pi or a Jetson: nothing they import may need torch/onnx."""
    code = (
        "import json, sys\n"
        "import tierflow.codec.base, tierflow.transport.wire, tierflow.plan\n"
        "import tierflow.link.spec, tierflow.units\n"
        "import tierflow.rpc.tier_pb2_grpc\n"
        "import tierflow.device.client, tierflow.runtime.server, tierflow.edge.forwarding\n"
        "import tierflow.edge.commands, tierflow.cloud.commands\n"
        "import tierflow.edge.probe, tierflow.cache.config, tierflow.cache.approx\n"
        "import tierflow.cli.main\n"
        "tierflow.cli.main.build_parser()\n"
        "heavy_roots = ('torch', 'onnx', 'sklearn', 'scipy', 'matplotlib')\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in heavy_roots)\n"
        "print(json.dumps(heavy))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == []
