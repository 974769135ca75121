"""``benchmarks/lib``'s shared pieces: a time's cell, the load record, cuts, sessions."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
from onnx import TensorProto, helper

from benchmarks.lib import report, splits, timing


def test_a_time_cell_has_one_decimal_then_whole_thousands_and_a_dash_for_none() -> None:
    assert report.ms(12.345) == "12.3"
    assert report.ms(1234.5) == "1,234" and report.ms(0) == "0.0"
    assert report.ms(None) == "–" and report.ms(math.nan) == "–"


def test_the_load_record_is_written_one_way_and_read_whatever_it_holds() -> None:
    start = report.load_average()
    assert len(start) == 3 and all(load >= 0 and round(load, 2) == load for load in start)
    span = report.load_span([1.25, 2.0, 3.0])
    assert span["start"] == [1.25, 2.0, 3.0] and len(span["end"]) == 3
    words = report.load_words({"start": [1.44], "end": [2.06, 1.0, 1.0]})
    assert words == "1-minute load average 1.4 at the start and 2.1 at the end"
    # Older results hold one end only, or nothing.
    assert report.load_words({"end": [16.2]}) == "1-minute load average 16.2 at the end"
    assert report.load_words(None) == "" and report.load_words({}) == ""


def test_shrinking_cuts_are_the_first_then_each_smaller_than_every_earlier_one() -> None:
    sizes = [100, 80, 120, 60, 60, 70, 50, 999]  # cut 0 is the input, the last the output
    graph = SimpleNamespace(cuts=[SimpleNamespace(index=i, nbytes=n) for i, n in enumerate(sizes)])
    assert splits.shrinking_cuts(graph) == [1, 3, 6]
    # A first cut smaller than the input sets the bar for the later ones.
    sizes = [100, 40, 60, 30, 999]
    graph = SimpleNamespace(cuts=[SimpleNamespace(index=i, nbytes=n) for i, n in enumerate(sizes)])
    assert splits.shrinking_cuts(graph) == [1, 3]


def test_a_session_of_an_in_memory_model_runs_as_the_tiers_open_it() -> None:
    node = helper.make_node("Relu", ["x"], ["y"])
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])
    model = helper.make_model(helper.make_graph([node], "g", [x], [y]))
    feeds = {"x": np.array([-1.0, 2.0], np.float32)}
    for given in (model, model.SerializeToString()):
        session = timing.session(given)
        options = session.get_session_options()
        assert options.intra_op_num_threads == 1
        np.testing.assert_array_equal(session.run(None, feeds)[0], [0.0, 2.0])
    fast = timing.session(model, threads=2, optimization="all")
    assert fast.get_session_options().intra_op_num_threads == 2
    result, spent = timing.cpu_ms(3, sum, [1, 2])
    assert result == 3 and spent >= 0.0
