"""Machine output is JSON every parser reads: no NaN or Infinity tokens."""

from __future__ import annotations

import json

from tierflow.cli.json_output import dumps


def test_floats_that_are_not_finite_are_written_as_null() -> None:
    data = {"ms": {"cloud": float("inf"), "edge": 1.5}, "rates": [float("nan"), -float("inf")]}
    text = dumps(data)
    assert "Infinity" not in text and "NaN" not in text
    assert json.loads(text) == {"ms": {"cloud": None, "edge": 1.5}, "rates": [None, None]}


def test_finite_data_is_written_as_json_dumps_writes_it() -> None:
    data = {"id": 3, "bytes": {"device-edge": 4096}, "ok": True, "error": None, "t": (1.0, 2)}
    assert dumps(data, indent=2) == json.dumps(data, indent=2)
