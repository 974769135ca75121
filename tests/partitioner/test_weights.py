"""Weights in external data files stay there: checked, hashed, run and written where they lie."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tierflow.cli.main import main
from tierflow.errors import ModelError, PlanError
from tierflow.onnxrt.inference import open_session
from tierflow.partitioner import loading, weights
from tierflow.partitioner.graph import load_model
from tierflow.partitioner.loading import read_model
from tierflow.partitioner.split import split_model, verify_split, write_segments
from tierflow.partitioner.weights import check_graph, external_tensors, open_model_session


def _mlp(path: Path, *, in_constant: bool = False) -> Path:
    """x -> MatMul(w1) -> Relu -> MatMul(w2) -> Relu -> MatMul(w3), weights in model.onnx_data.

    ``in_constant`` keeps w2 in a Constant node (exporters externalise those too).
    """
    rng = np.random.default_rng(0)
    weights = [rng.standard_normal((64, 64)).astype(np.float32) for _ in range(3)]
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["a"]),
        helper.make_node("Relu", ["a"], ["ra"]),
        helper.make_node("MatMul", ["ra", "w2"], ["b"]),
        helper.make_node("Relu", ["b"], ["rb"]),
        helper.make_node("MatMul", ["rb", "w3"], ["y"]),
    ]
    initializers = [numpy_helper.from_array(w, f"w{i + 1}") for i, w in enumerate(weights)]
    if in_constant:
        nodes.insert(0, helper.make_node("Constant", [], ["w2"], value=initializers.pop(1)))
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64])],
        initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save_model(
        model,
        str(path),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location="model.onnx_data",
        size_threshold=0,
        convert_attribute=True,
    )
    return path


def test_the_graph_is_read_without_its_weights_and_hashed_with_them(tmp_path: Path) -> None:
    path = _mlp(tmp_path / "m" / "model.onnx")
    model, sha256 = read_model(path)
    tensors = list(external_tensors(model))
    assert len(tensors) == 3 and all(not t.raw_data for t in tensors)
    data = (tmp_path / "m" / "model.onnx_data").resolve()
    assert {e.value for t in tensors for e in t.external_data if e.key == "location"} == {str(data)}
    expected = hashlib.sha256(path.read_bytes())
    expected.update(b"\0model.onnx_data\0" + data.read_bytes())
    assert sha256 == expected.hexdigest()
    check_graph(model)  # the in-memory checker would look for the data in the working dir
    x = {"x": np.ones((1, 64), np.float32)}
    got = open_model_session(model, optimization="disabled").run(None, x)[0]
    want = open_session(path, optimization="disabled").run(None, x)[0]
    assert got.tobytes() == want.tobytes()


@pytest.mark.parametrize("in_constant", [False, True])
def test_segments_take_their_own_weights_beside_them(tmp_path: Path, in_constant: bool) -> None:
    path = _mlp(tmp_path / "m" / "model.onnx", in_constant=in_constant)
    graph = load_model(path)
    assert len(graph.cuts) >= 3
    segments = split_model(graph, [1, 2])
    assert verify_split(graph, segments).bitwise_equal
    plan_dir = tmp_path / "plan"
    write_segments(segments, plan_dir)
    source = (tmp_path / "m" / "model.onnx_data").stat().st_size
    written = 0
    for spec, _ in segments:
        data = plan_dir / (spec.file + ".data")
        assert data.is_file()
        written += data.stat().st_size
        onnx.checker.check_model(str(plan_dir / spec.file))  # the file-path form
        locations = {
            e.value
            for t in onnx.load(
                str(plan_dir / spec.file), load_external_data=False
            ).graph.initializer
            for e in t.external_data
            if e.key == "location"
        }
        assert locations <= {spec.file + ".data"}
    assert written >= source  # every weight went to one segment (aligned, so a little more)
    x = {"x": np.full((1, 64), 0.5, np.float32)}
    whole = open_session(path, optimization="disabled").run(None, x)[0]
    feeds = dict(x)
    for spec, _ in segments:
        session = open_session(plan_dir / spec.file, optimization="disabled")
        names = [o.name for o in session.get_outputs()]
        feeds.update(
            zip(names, session.run(names, {n: feeds[n] for n in spec.inputs}), strict=True)
        )
    assert feeds["y"].tobytes() == whole.tobytes()


def test_a_missing_or_truncated_weights_file_is_one_line(tmp_path: Path) -> None:
    path = _mlp(tmp_path / "m" / "model.onnx")
    data = tmp_path / "m" / "model.onnx_data"
    whole = data.read_bytes()
    data.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(ModelError, match=r"'model.onnx_data' is truncated: 24576 bytes") as err:
        load_model(path)
    assert "\n" not in str(err.value)
    data.unlink()
    with pytest.raises(ModelError, match=r"external data file 'model.onnx_data'.*cannot be read"):
        load_model(path)


def test_planning_what_this_machine_cannot_hold_is_refused_before_any_work(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _mlp(tmp_path / "m" / "model.onnx")
    data = (tmp_path / "m" / "model.onnx_data").stat().st_size
    assert weights.model_weight_bytes(path) == path.stat().st_size + data
    monkeypatch.setattr(weights, "available_memory", lambda: 256 << 20)
    code = main(["plan", str(path), "-o", str(tmp_path / "plan")])
    _, err = capsys.readouterr()
    assert code != 0 and not (tmp_path / "plan").exists()
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "needs about" in err and "256MiB available" in err


def test_the_memory_check_counts_weights_inside_the_file_as_well(tmp_path: Path) -> None:
    # A model with its weights inside: the file is the weights (reading it holds its bytes
    # and the parsed message at once before they are spilled, which the 2x covers).
    inline = tmp_path / "inline.onnx"
    onnx.save_model(onnx.load(str(_mlp(tmp_path / "m" / "model.onnx"))), str(inline))
    size = inline.stat().st_size
    assert weights.model_weight_bytes(inline) == size
    needed = int(size * weights.PLANNING_MEMORY_PER_WEIGHT_BYTE) + weights.PLANNING_MEMORY_BASE
    weights.check_planning_memory(inline, needed)
    with pytest.raises(PlanError, match=r"needs about .* \(its weights are 48\.\dKiB\)"):
        weights.check_planning_memory(inline, needed - 1)


def test_a_large_model_with_weights_inside_plans_with_them_on_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _mlp(tmp_path / "m" / "model.onnx")
    inline = tmp_path / "inline.onnx"
    onnx.save_model(onnx.load(str(path)), str(inline))  # the weights inside the file
    monkeypatch.setattr(loading, "SPILL_BYTES", 1024)  # "large": this one is 48 KiB
    model, sha256 = read_model(inline)
    assert sha256 == hashlib.sha256(inline.read_bytes()).hexdigest()
    assert len(list(external_tensors(model))) == 3 and model.ByteSize() < 4096
    graph = load_model(inline)
    segments = split_model(graph, [1, 2])
    assert verify_split(graph, segments).bitwise_equal
    write_segments(segments, tmp_path / "plan")
    assert sorted(p.name for p in (tmp_path / "plan").iterdir()) == [
        "00-device.onnx",
        "00-device.onnx.data",
        "01-edge.onnx",
        "01-edge.onnx.data",
        "02-cloud.onnx",
        "02-cloud.onnx.data",
    ]
