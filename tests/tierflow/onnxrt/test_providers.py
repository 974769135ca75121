"""``--providers``: names checked against the installed onnxruntime; CPU always, others if there."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from onnx import ModelProto, TensorProto, helper

from tierflow.cli.main import main
from tierflow.errors import ProviderError, UsageError
from tierflow.onnxrt.providers import CPU, available, describe, parse_providers
from tierflow.partitioner.profile import make_session


def test_cpu_and_auto() -> None:
    assert parse_providers("cpu") == (CPU,)
    assert parse_providers("CPUExecutionProvider") == (CPU,)
    assert parse_providers(" cpu , cpu ") == (CPU,)
    auto = parse_providers("auto")
    assert auto == available() and CPU in auto
    assert "AzureExecutionProvider" not in auto  # calls endpoints; runs no local nodes
    assert describe(("CUDAExecutionProvider", CPU)) == "cuda,cpu"


def test_unknown_and_unavailable_providers_are_typed_errors() -> None:
    with pytest.raises(ProviderError, match=r"unknown execution provider 'gpu9'.*cuda"):
        parse_providers("gpu9,cpu")
    with pytest.raises(ProviderError, match="empty"):
        parse_providers(" , ")
    missing = [a for a in ("cuda", "tensorrt", "coreml") if parse_ok(a) is None]
    for alias in missing:
        with pytest.raises(ProviderError, match=f"available: {describe(available())}$"):
            parse_providers(f"{alias},cpu")
    assert issubclass(ProviderError, UsageError)


def parse_ok(alias: str) -> tuple[str, ...] | None:
    try:
        return parse_providers(alias)
    except ProviderError:
        return None


def test_cli_names_what_is_available(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    unavailable = next((a for a in ("coreml", "cuda", "tensorrt") if parse_ok(a) is None), None)
    if unavailable is None:
        pytest.skip("this onnxruntime offers CoreML, CUDA and TensorRT")
    with pytest.raises(SystemExit) as exit_info:
        main(["profile", "m.onnx", "-o", str(tmp_path / "p.json"), "--providers", unavailable])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"execution provider '{unavailable}'" in err
    assert f"available: {describe(available())}" in err


def _tiny_model() -> ModelProto:
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "tiny",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


@pytest.mark.parametrize("alias", ["cpu", "cuda", "tensorrt", "coreml", "openvino", "dml"])
def test_each_offered_provider_runs_a_model(alias: str) -> None:
    providers = parse_ok(alias)
    if providers is None:
        pytest.skip(
            f"{alias} is not offered by onnxruntime {ort.__version__} here "
            f"(available: {describe(available())})"
        )
    session = make_session(_tiny_model(), 1, providers)
    assert session.get_providers()[0] == providers[0]
    x = np.array([[-1.0, 0.0, 2.0], [3.0, -4.0, 5.0]], dtype=np.float32)
    np.testing.assert_array_equal(session.run(["y"], {"x": x})[0], np.maximum(x, 0))


@pytest.mark.parametrize(
    "command", [["serve", "edge"], ["serve", "cloud"], ["run", "--input", "x"]]
)
def test_serve_and_run_take_providers(tmp_path: Path, command: list[str]) -> None:
    """The runtime commands carry --providers into RuntimeOptions, and on to every session."""
    from tierflow.cli.main import build_parser
    from tierflow.cli.runtime_arguments import runtime_options
    from tierflow.plan import Plan, SegmentSpec

    args = build_parser().parse_args([*command, "--plan", str(tmp_path), "--providers", "auto"])
    assert args.providers == available()
    plan = Plan(
        model_file="m.onnx",
        model_sha256="0" * 64,
        inputs=("x",),
        outputs=("y",),
        segments=(SegmentSpec("cloud", "s.onnx", ("x",), ("y",)),),
    )
    options = runtime_options(args, plan, server=command[0] == "serve")
    assert options.providers == available()


def test_a_segment_runs_on_the_providers_given(tmp_path: Path) -> None:
    from onnx import save

    from tierflow.options import RuntimeOptions
    from tierflow.runtime.segment_runner import SegmentRunner

    save(_tiny_model(), tmp_path / "m.onnx")
    runner = SegmentRunner(tmp_path / "m.onnx", RuntimeOptions(providers=parse_providers("auto")))
    assert runner.session.get_providers()[0] == available()[0]
    runner = SegmentRunner(tmp_path / "m.onnx", RuntimeOptions())
    assert runner.session.get_providers() == [CPU]
