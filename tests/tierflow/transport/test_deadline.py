"""One deadline type: parsed once from ``--deadline``, one default, one bound, at the wire."""

from __future__ import annotations

import math

import pytest

from tierflow.cli.main import build_parser, main
from tierflow.errors import InputError, UsageError
from tierflow.transport import wire
from tierflow.transport.deadline import (
    DEFAULT_DEADLINE,
    DEFAULT_DEADLINE_S,
    MAX_DEADLINE_S,
    Deadline,
    check_deadline,
)


def test_a_deadline_is_checked_when_made() -> None:
    assert Deadline() == DEFAULT_DEADLINE == Deadline(DEFAULT_DEADLINE_S) == Deadline(30.0)
    assert Deadline.parse("500ms") == Deadline(0.5) and str(Deadline(0.5)) == "500ms"
    assert Deadline.parse(str(DEFAULT_DEADLINE)) == DEFAULT_DEADLINE
    assert Deadline(MAX_DEADLINE_S).seconds == 24 * 3600
    for seconds in (0.0, -1.0, math.nan, math.inf, MAX_DEADLINE_S + 1):
        with pytest.raises(UsageError, match="a deadline must be positive and at most 24 h"):
            Deadline(seconds)
    with pytest.raises(UsageError, match="malformed duration 'soon'"):
        Deadline.parse("soon")
    assert Deadline.of(2) == Deadline(2.0) and Deadline.of(Deadline(3.0)) == Deadline(3.0)


def test_the_wire_carries_when_it_expires_and_tiers_check_it_against_the_same_bound() -> None:
    deadline = Deadline(5.0)
    assert deadline.expires_unix_s(1000.0) == 1005.0
    assert deadline.expires_monotonic(7.0) == 12.0
    assert check_deadline(0.0, 1000.0) is None  # none given
    assert check_deadline(999.0, 1000.0) == 999.0  # past: the tier's DeadlineError, not malformed
    assert check_deadline(1000.0 + MAX_DEADLINE_S, 1000.0) == 1000.0 + MAX_DEADLINE_S
    for hostile in (math.nan, math.inf, -1.0, 1e300, 1000.0 + MAX_DEADLINE_S + 1):
        with pytest.raises(InputError):
            check_deadline(hostile, 1000.0)
    assert wire.check_deadline is check_deadline  # where requests enter a tier


def test_run_and_device_take_a_typed_deadline_with_the_one_default(
    capsys: pytest.CaptureFixture[str],
) -> None:
    parser = build_parser()
    run = parser.parse_args(["run", "--plan", "p", "--input", "i"])
    device = parser.parse_args(["device", "--plan", "p", "--source", "-", "--deadline", "2s"])
    assert run.deadline == DEFAULT_DEADLINE and device.deadline == Deadline(2.0)
    generate = parser.parse_args(["generate", "--plan", "p", "--prompt-ids", "1"])
    assert generate.deadline == DEFAULT_DEADLINE
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    assert "(default: 30s)" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("value", ["0s", "25h", "-1s", "fast"])
def test_a_bad_deadline_is_one_line(capsys: pytest.CaptureFixture[str], value: str) -> None:
    assert main(["run", "--plan", "p", "--input", "i", f"--deadline={value}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tierflow run: error: ") and err.count("\n") == 1
    assert "Traceback" not in err
