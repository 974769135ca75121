"""A decoder plan's estimate in the units ``generate`` measures, for the suites that compare.

``benchmarks.decoder_cost`` and ``benchmarks.big_model`` set ``plan.json``'s
``estimate.decoder`` beside what generations through the served tiers measured.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tierflow.link.spec import LINKS
from tierflow.partitioner.decoder_cost import bytes_per_token


def predicted(plan_dir: Path, prompt_tokens: int, max_tokens: int) -> dict[str, Any]:
    """The plan's estimate, with bytes per token as ``generate --json`` counts them over
    ``max_tokens`` ([Note: bytes per token] in :mod:`tierflow.partitioner.decoder_cost`)."""
    estimate = json.loads((plan_dir / "plan.json").read_text())["estimate"]["decoder"]
    prefill, step = estimate["prefill"], estimate["step"]
    per_token = bytes_per_token(
        {link: prefill["links"][link]["bytes"] for link in LINKS},
        {link: step["links"][link]["bytes"] for link in LINKS},
        max_tokens,
    )
    return {
        "ttft_ms": estimate["ttft_s"] * 1e3,
        "ms_per_token": estimate["per_token_s"] * 1e3,
        "bytes_per_token": per_token,
        "prefill_ms": {t: v * 1e3 for t, v in prefill["compute_s"].items()},
        "step_ms": {t: v * 1e3 for t, v in step["compute_s"].items()},
    }
