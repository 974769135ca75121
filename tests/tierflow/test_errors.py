"""How a tier reads another tier's failure: the classifiers in tierflow/errors.py."""

from __future__ import annotations

import pytest

from tierflow.errors import (
    GONE_CODES,
    DeadlineError,
    InputError,
    RemoteError,
    TransportError,
    is_gone,
    is_missing,
    is_state_lost,
    is_upstream_gone,
)


@pytest.mark.parametrize("code", ["UNAVAILABLE", "UPSTREAM_UNAVAILABLE"])
def test_a_tier_that_says_a_tier_is_gone_is_gone_and_missing(code: str) -> None:
    error = RemoteError("gone", code=code, tier="edge")
    assert code in GONE_CODES
    assert is_gone(error) and is_missing(error)
    assert not is_state_lost(error)
    assert is_upstream_gone(error) == (code == "UPSTREAM_UNAVAILABLE")


@pytest.mark.parametrize(
    "code", ["STATE_LOST", "INVALID_INPUT", "DEADLINE_EXCEEDED", "", "INTERNAL"]
)
def test_other_remote_codes_are_not_a_tier_gone(code: str) -> None:
    error = RemoteError("no", code=code)
    assert not (is_gone(error) or is_missing(error) or is_upstream_gone(error))
    assert is_state_lost(error) == (code == "STATE_LOST")


def test_a_tier_not_reached_is_missing_but_did_not_say_it_is_gone() -> None:
    unreachable = TransportError("connection refused")
    assert is_missing(unreachable) and not is_gone(unreachable)
    # Late is not missing, and neither is a bad request or no error at all.
    for error in (DeadlineError("late"), InputError("bad"), None):
        assert not (is_missing(error) or is_gone(error) or is_state_lost(error))
