"""JSON for machines: what ``--json``, ``--report`` and ``--results`` write.

Python's ``json`` writes a float that is not finite as ``NaN`` or ``Infinity``, which is
not JSON: most parsers refuse the whole line (``run --json`` once printed
``"cloud": Infinity`` from a tier's reply). The figures a tier reports are checked where
they arrive ([Note: figures in a reply] in tierflow/transport/wire.py); this is the last
guard, for whatever else is not finite (a model's NaN output, a rate over no time): such a
number is written as ``null``.
"""

from __future__ import annotations

import json
import math
from typing import Any


def dumps(data: Any, **options: Any) -> str:
    """``json.dumps(data)``, with every float that is not finite written as ``null``."""
    try:
        return json.dumps(data, allow_nan=False, **options)
    except ValueError:  # a NaN or an infinity somewhere: the slow way, once
        return json.dumps(_finite(data), allow_nan=False, **options)


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(item) for item in value]
    return value
