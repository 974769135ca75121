"""Parsing and printing of the units users type: rates, durations and sizes.

Rates are bits per second (``20mbit``, ``1gbit``, ``500kbit``, ``100Mbps``; decimal
prefixes, as ``tc`` and link vendors use them), or bytes per second with a capital B
(``2.5MB/s`` is 20 Mbit/s, ``1MiB/s`` binary). Durations are seconds (``5ms``, ``1.5s``, ``200us``).
Sizes are bytes (``64MiB``, ``1.5GB``, ``512k``; ``KiB``/``MiB``/``GiB`` are binary,
``kB``/``MB``/``GB`` decimal, a bare ``k``/``m``/``g`` binary) and always carry a unit:
``64B`` is 64 bytes, and a bare ``64`` is refused (see [Note: sizes carry a unit]).
Every error quotes the text it refuses clipped (:func:`tierflow.errors.shown`).

[Note: sizes carry a unit]
Every size tierflow reads is large in practice (a tier's memory, a segment budget, the
largest tensor, a cache, a probe's payload), so a bare number is far more likely a
forgotten unit than a count of bytes: ``--memory device=64`` read as 64 bytes made the
planner put nothing on the device and say nothing. A size without a unit is therefore an
error that suggests the units, for every flag alike; ``B`` states bytes explicitly.
"""

from __future__ import annotations

import math
import re

from tierflow.errors import UsageError, shown

_NUMBER = r"(?P<num>[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(?P<unit>[A-Za-zµ/]*)"

# Rates: an optional decimal (k, M, G, T) or binary (Ki, Mi, Gi, Ti) prefix, then bits
# (bit, bit/s, bps, b/s: a lowercase b) or bytes (B/s, Bps, byte/s: a capital B).
_RATE_UNIT = re.compile(
    r"(?P<prefix>(?:[kKmMgGtT]i?)?)(?P<base>bits?(?:/s)?|bps|b/s|Bps|B/s|bytes?/s)"
)
_RATE_PREFIXES = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_RATE_EXAMPLES = "'20mbit', '1gbit', '500kbit', '100Mbps' or, in bytes, '2.5MB/s', '1MiB/s'"

_DURATION_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}

_SIZE_UNITS = {
    "b": 1,
    "k": 1024,
    "kib": 1024,
    "kb": 1000,
    "m": 1024**2,
    "mib": 1024**2,
    "mb": 1000**2,
    "g": 1024**3,
    "gib": 1024**3,
    "gb": 1000**3,
}


def _split(text: str, what: str, example: str) -> tuple[float, str]:
    """The number and the unit as typed (case kept: ``MB/s`` is bytes, ``Mb/s`` bits)."""
    match = re.fullmatch(_NUMBER, text.strip())
    if match is None:
        raise UsageError(
            f"malformed {what} {shown(text)}: expected a number and a unit, like {example}"
        )
    value = float(match["num"])
    if not math.isfinite(value):
        raise UsageError(f"malformed {what} {shown(text)}: the number is too large")
    return value, match["unit"]


def parse_rate(text: str) -> float:
    """Return a link rate in bits per second from text like ``20mbit`` or ``2.5MB/s``.

    A lowercase ``b`` is bits and a capital ``B`` bytes (``20MB/s`` is 160 Mbit/s);
    prefixes are decimal (``k``, ``M``, ``G``) or binary (``Ki``, ``Mi``, ``Gi``), in
    either case.
    """
    value, unit = _split(text, "rate", _RATE_EXAMPLES)
    match = _RATE_UNIT.fullmatch(unit)
    if match is None:
        hint = "; a rate needs '/s' when given in bytes, like 20MB/s" if unit[-1:] == "B" else ""
        raise UsageError(
            f"malformed rate {shown(text)}: unknown unit {shown(unit)}, expected bits per second "
            f"(kbit, mbit, gbit, Mbps) or bytes per second (kB/s, MB/s, MiB/s){hint}"
        )
    prefix = match["prefix"].lower()
    scale = (
        1024.0 ** ("kmgt".index(prefix[0]) + 1) if prefix.endswith("i") else _RATE_PREFIXES[prefix]
    )
    per_unit = 8.0 if match["base"].startswith(("B", "byte")) else 1.0
    rate = value * scale * per_unit
    if rate <= 0:
        raise UsageError(f"malformed rate {shown(text)}: a rate must be positive")
    return rate


def parse_duration(text: str) -> float:
    """Return a duration in seconds from text like ``5ms``."""
    value, unit = _split(text, "duration", "'5ms', '0.2s' or '300us'")
    unit = unit.lower()
    if unit not in _DURATION_UNITS:
        raise UsageError(
            f"malformed duration {shown(text)}: unknown unit {shown(unit)}, "
            "expected one of s, ms, us"
        )
    return value * _DURATION_UNITS[unit]


def parse_seconds(text: str) -> float:
    """A duration option's value in seconds: ``500ms``, ``2s``, ``300us``, or a bare
    number of seconds (``10``), never negative.

    [Note: durations on the command line]
    Every option that takes a time (``--grace``, ``--deadline``, ``--reply-timeout``,
    ``--stream-idle``, ``--state-idle``, ``--retry``, ``--idle-probe``, ``--poll``,
    ``profile --time-budget``) reads it here, so they all take the same forms: a number
    with a unit, or a bare number meaning seconds, the unit these options are spoken of
    in. (``--grace 10s`` was refused while ``--stream-idle 60`` was refused for lacking a
    unit.) A link's round trip inside ``--link`` is no option of its own and keeps its
    unit: ``20mbit,4`` would be ambiguous between the rate's and the RTT's scale.
    """
    stripped = text.strip()
    try:
        seconds = float(stripped)
    except ValueError:
        seconds = parse_duration(stripped)
    else:
        if not math.isfinite(seconds):
            raise UsageError(f"malformed duration {shown(text)}: the number is too large")
    if seconds < 0:
        raise UsageError(f"a duration cannot be negative, got {shown(text)}")
    return seconds


def positive_seconds(text: str) -> float:
    """:func:`parse_seconds`, above zero ([Note: durations on the command line])."""
    seconds = parse_seconds(text)
    if not seconds > 0:
        raise UsageError(f"expected a positive duration like '500ms', '2s' or 2, got {shown(text)}")
    return seconds


def parse_slowdown(text: str) -> float:
    """How many times slower than this machine a tier runs: ``8`` or ``8x``, above 0.

    One form for every ``--slowdown`` (``serve``, ``run``, ``profile``, and ``plan
    --slowdown TIER=X`` for each tier's part).
    """
    stripped = text.strip()
    number = stripped[:-1] if stripped[-1:] in ("x", "X") else stripped
    try:
        factor = float(number)
    except ValueError:
        raise UsageError(
            f"malformed slowdown {shown(text)}: expected how many times slower, like 8 or 8x"
        ) from None
    if not 0 < factor < math.inf:
        raise UsageError(f"malformed slowdown {shown(text)}: a slowdown must be positive")
    return factor


def parse_size(text: str) -> int:
    """Return a size in bytes from text like ``64MiB``; the unit is required.

    A bare number is refused ([Note: sizes carry a unit]); ``64B`` is 64 bytes.
    """
    value, unit = _split(text, "size", "'64MiB', '1GiB' or '512kB'")
    if not unit:
        raise UsageError(
            f"a size needs a unit: {shown(text)} would be {value:g} bytes; write "
            f"'{value:g}MiB' (or '{value:g}KiB', '{value:g}GiB'), or '{value:g}B' if bytes "
            "are meant"
        )
    unit = unit.lower()
    if unit not in _SIZE_UNITS:
        raise UsageError(
            f"malformed size {shown(text)}: unknown unit {shown(unit)}, "
            "expected one of B, KiB, MiB, GiB, kB, MB, GB"
        )
    size = int(value * _SIZE_UNITS[unit])
    if size <= 0:
        raise UsageError(f"malformed size {shown(text)}: a size must be positive")
    return size


def format_rate(bits_per_second: float) -> str:
    """Print a rate the way :func:`parse_rate` reads it back."""
    for unit, scale in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if bits_per_second >= scale:
            return f"{bits_per_second / scale:.4g}{unit}"
    return f"{bits_per_second:.4g}bit"


def format_duration(seconds: float) -> str:
    """Print a duration the way :func:`parse_duration` reads it back."""
    if seconds >= 1:
        return f"{seconds:.4g}s"
    if seconds >= 1e-3 or seconds == 0:
        return f"{seconds * 1e3:.4g}ms"
    return f"{seconds * 1e6:.4g}us"


def format_size(nbytes: float) -> str:
    """Print a byte count with a binary unit, for tables."""
    for unit, scale in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(nbytes) >= scale:
            # Three significant digits, and whole units from 100 up: 1010MiB, not 1.01e+03MiB.
            value = nbytes / scale
            return f"{value:.0f}{unit}" if abs(value) >= 100 else f"{value:.3g}{unit}"
    return f"{int(nbytes)}B"
