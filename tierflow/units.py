"""Parsing and printing of the units users type: rates, durations and sizes.

Rates are bits per second (``20mbit``, ``1gbit``, ``500kbit``; decimal prefixes, as
``tc`` and link vendors use them). Durations are seconds (``5ms``, ``1.5s``, ``200us``).
Sizes are bytes (``64MiB``, ``1.5GB``, ``512k``; ``KiB``/``MiB``/``GiB`` are binary,
``kB``/``MB``/``GB`` decimal, a bare ``k``/``m``/``g`` binary).
"""

from __future__ import annotations

import math
import re

from tierflow.errors import UsageError

_NUMBER = r"(?P<num>[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(?P<unit>[A-Za-zµ/]*)"

_RATE_UNITS = {
    "bit": 1.0,
    "bps": 1.0,
    "b/s": 1.0,
    "kbit": 1e3,
    "kbps": 1e3,
    "kb/s": 1e3,
    "mbit": 1e6,
    "mbps": 1e6,
    "mb/s": 1e6,
    "gbit": 1e9,
    "gbps": 1e9,
    "gb/s": 1e9,
}

_DURATION_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}

_SIZE_UNITS = {
    "": 1,
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
    match = re.fullmatch(_NUMBER, text.strip())
    if match is None:
        raise UsageError(f"malformed {what} {text!r}: expected a number and a unit, like {example}")
    value = float(match["num"])
    if not math.isfinite(value):
        raise UsageError(f"malformed {what} {text!r}: the number is too large")
    return value, match["unit"].lower()


def parse_rate(text: str) -> float:
    """Return a link rate in bits per second from text like ``20mbit``."""
    value, unit = _split(text, "rate", "'20mbit', '1gbit' or '500kbit'")
    if unit not in _RATE_UNITS:
        raise UsageError(
            f"malformed rate {text!r}: unknown unit {unit!r}, expected one of kbit, mbit, gbit"
        )
    rate = value * _RATE_UNITS[unit]
    if rate <= 0:
        raise UsageError(f"malformed rate {text!r}: a rate must be positive")
    return rate


def parse_duration(text: str) -> float:
    """Return a duration in seconds from text like ``5ms``."""
    value, unit = _split(text, "duration", "'5ms', '0.2s' or '300us'")
    if unit not in _DURATION_UNITS:
        raise UsageError(
            f"malformed duration {text!r}: unknown unit {unit!r}, expected one of s, ms, us"
        )
    return value * _DURATION_UNITS[unit]


def parse_size(text: str) -> int:
    """Return a size in bytes from text like ``64MiB``."""
    value, unit = _split(text, "size", "'64MiB', '1GiB' or '512kB'")
    if unit not in _SIZE_UNITS:
        raise UsageError(
            f"malformed size {text!r}: unknown unit {unit!r}, "
            "expected one of KiB, MiB, GiB, kB, MB, GB"
        )
    size = int(value * _SIZE_UNITS[unit])
    if size <= 0:
        raise UsageError(f"malformed size {text!r}: a size must be positive")
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
            return f"{nbytes / scale:.3g}{unit}"
    return f"{int(nbytes)}B"
