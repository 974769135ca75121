"""A real trained streaming model (Silero VAD, from its PyPI package) planned with its state."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tierflow.cli.main import main
from tierflow.greedy import initial_state
from tierflow.onnxrt.inference import open_session
from tierflow.plan import load_plan
from tierflow.zoo import real_stateful

pytest.importorskip("silero_vad", reason="silero-vad is not installed (a dev dependency)")


@pytest.mark.slow
@pytest.mark.parametrize("variant", sorted(real_stateful.VARIANTS))
def test_silero_vad_plans_with_its_lstm_state_on_one_tier(
    tmp_path: Path, capsys: Any, variant: str
) -> None:
    model = real_stateful.vad_path(variant)
    sample = real_stateful.chunks(6)
    np.savez(tmp_path / "in.npz", **sample)
    plan_dir = tmp_path / "plan"
    code = main(["plan", str(model), "-o", str(plan_dir), "--sample", str(tmp_path / "in.npz"),
                 "--memory", "device=1MiB"])  # fmt: skip
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "state state -> stateN stays on the" in out
    plan = load_plan(plan_dir)
    assert plan.state_pairs == (("state", "stateN"),)
    assert "state" not in plan.inputs and plan.outputs == ("output",)
    assert len([s for s in plan.segments if s.state]) == 1
    assert plan.segments[0].tier != "device" or len(plan.segments) == 2  # 1 MiB: not all
    # The segments, each chunk's state fed back on the tier that owns it, answer a stream
    # of chunks as the whole model does with its state fed back.
    whole = open_session(model, threads=1, optimization="disabled")
    parts = [(s, open_session(plan_dir / s.file, threads=1, optimization="disabled"))
             for s in plan.segments]  # fmt: skip
    (pair,) = plan.states
    state_whole = state_split = initial_state(pair)
    for i in range(6):
        request = {"input": sample["input"][i], "sr": np.asarray(sample["sr"][i])}
        expected, state_whole = whole.run(["output", "stateN"], {**request, "state": state_whole})
        available = dict(request)
        for spec, session in parts:
            names = [o.name for o in session.get_outputs()]
            feeds = {n: state_split if n == "state" else available[n] for n in spec.inputs}
            made = dict(zip(names, session.run(names, feeds), strict=True))
            state_split = made.get("stateN", state_split)
            available.update({n: made[n] for n in spec.sent_outputs})
        assert available["output"].tobytes() == expected.tobytes()
    assert state_whole.tobytes() == state_split.tobytes()
    assert np.abs(state_whole).max() > 0  # the state did change from chunk to chunk
