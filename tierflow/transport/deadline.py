"""A request's deadline: one value from the device's ``--deadline`` to every tier's check.

See [Note: one deadline].

[Note: one deadline]
The device gives each request a time budget, :class:`Deadline` (``--deadline 5s``; the
default :data:`DEFAULT_DEADLINE` is 30 s), checked once when it is made: positive,
finite and at most :data:`MAX_DEADLINE_S`. On the wire a request carries the absolute
time it expires (``deadline_unix_s``, seconds since the epoch, :meth:`Deadline.expires_unix_s`),
so that every tier on the way knows how long is left whatever the time spent before it.
Where a request enters a tier, :func:`check_deadline` checks that time against the
same bound (a NaN, an infinity or 1e300 from a hostile peer would otherwise reach every
timer on the way; 24 h is generous for clocks that differ between machines). One bound,
one default, one type: the command line, the device client and the tiers share them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tierflow.errors import InputError, UsageError
from tierflow.units import format_duration, parse_seconds

#: Seconds a request may take when no ``--deadline`` is given.
DEFAULT_DEADLINE_S = 30.0
#: Longest deadline, as a budget on the device and as a time ahead on the wire (seconds).
MAX_DEADLINE_S = 24 * 3600.0


@dataclass(frozen=True)
class Deadline:
    """How long a request may take from when the device sends it (seconds); checked when made."""

    seconds: float = DEFAULT_DEADLINE_S

    def __post_init__(self) -> None:
        if not 0 < self.seconds <= MAX_DEADLINE_S:
            raise UsageError(
                f"a deadline must be positive and at most {MAX_DEADLINE_S / 3600:g} h, "
                f"got {self.seconds:g} s"
            )

    @classmethod
    def parse(cls, text: str) -> Deadline:
        """Read ``--deadline`` text like ``5s``, ``500ms`` or ``5`` (seconds; [Note:
        durations on the command line] in tierflow/units.py)."""
        return cls(parse_seconds(text))

    @classmethod
    def of(cls, value: Deadline | float) -> Deadline:
        """``value`` as a deadline: a :class:`Deadline` as it is, a number as seconds."""
        return value if isinstance(value, Deadline) else cls(float(value))

    def expires_unix_s(self, now_unix_s: float) -> float:
        """When a request sent at ``now_unix_s`` (``time.time()``) expires: the wire's field."""
        return now_unix_s + self.seconds

    def expires_monotonic(self, now: float) -> float:
        """When a request sent at ``now`` (``time.monotonic()``) expires, on that clock."""
        return now + self.seconds

    def __str__(self) -> str:
        return format_duration(self.seconds)


#: The deadline of a request sent without one.
DEFAULT_DEADLINE = Deadline()


def check_deadline(deadline_unix_s: float, now: float) -> float | None:
    """A request's deadline from the wire (seconds since the epoch; 0 means none).

    Raises :class:`InputError` unless it is finite and at most :data:`MAX_DEADLINE_S`
    after ``now`` ([Note: one deadline]). A deadline already past is returned as it is:
    the tier answers it with a ``DeadlineError``, not as malformed.
    """
    if deadline_unix_s == 0:
        return None
    if not math.isfinite(deadline_unix_s) or deadline_unix_s < 0:
        raise InputError(f"a deadline must be a finite time, found {deadline_unix_s!r}")
    if deadline_unix_s > now + MAX_DEADLINE_S:
        raise InputError(
            f"a deadline may be at most {MAX_DEADLINE_S:.0f} s ahead, found one "
            f"{deadline_unix_s - now:.3g} s ahead"
        )
    return deadline_unix_s
