"""Which codecs the search may choose from, and their figures in every tier's profile.

:func:`codec_candidates` turns ``--codec`` and the fidelity budget into candidates
(pure). A profile made elsewhere, or one profiled without a candidate, lacks some
codec's figures: :func:`ensure_codecs` measures them on this machine's features, and
:func:`ensure_image_codecs` measures the image codecs on the sample's inputs, each
scaled by the profile's slowdown. Under the exact budget :func:`keep_png` keeps ``png``
only where the sample shows it bit-exact.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import replace

import numpy as np

from tierflow.codec.base import PLANNER_CODECS, CodecSpec, CodecStats, ImageNorm
from tierflow.errors import UsageError
from tierflow.partitioner.fidelity import FidelityBudget
from tierflow.partitioner.fidelity_probe import FidelityProbe
from tierflow.partitioner.graph import ModelGraph
from tierflow.partitioner.image_inputs import (
    IMAGE_CANDIDATES,
    measure_image_codecs,
    measured_requests,
    outside_pixels,
    png_is_exact,
)
from tierflow.partitioner.profile import Profile, capture_features, measure_cut_codecs, with_codecs


def codec_candidates(
    codec: str, fidelity: FidelityBudget | None = None, images: Collection[str] = ()
) -> tuple[str, ...]:
    """The codecs the search may choose from: the planner codecs for ``auto``, else one.

    With image inputs (their names in ``images``) ``auto`` adds the image codecs
    (:data:`~.image_inputs.IMAGE_CANDIDATES`). Under the ``exact`` budget (the default;
    ``None`` means any budget) only bit-exact codecs are candidates, and ``png``, which
    :func:`~.ranking.rank` keeps only where it reproduces the sample bit for bit: ``auto`` picks
    among ``raw`` and ``zstd`` (and ``png``), and naming a lossy codec is a usage error
    that asks for a budget.
    """
    if codec == "auto":
        candidates = PLANNER_CODECS + (IMAGE_CANDIDATES if images else ())
    else:
        spec = CodecSpec.parse(codec)
        if spec.image and not images:
            raise UsageError(
                f"codec {spec} sends image inputs as images: name them with --image-input"
            )
        candidates = (str(spec),)
    if fidelity is not None and fidelity.lossless_only:
        lossy = [c for c in candidates if not CodecSpec.parse(c).bit_exact and c != "png"]
        if codec != "auto" and lossy:
            raise UsageError(
                f"codec {lossy[0]} is lossy, and the fidelity budget is exact (the default): "
                "state one with --fidelity top1=P% or rel=E and --sample IN.npz, or use a "
                "lossless codec (raw, zstd, shuffle+zstd)"
            )
        candidates = tuple(c for c in candidates if c not in lossy)
    return candidates


def ensure_codecs(
    graph: ModelGraph, profiles: dict[str, Profile], codecs: Sequence[str]
) -> list[str]:
    """Measure codecs a profile lacks (like ``zstd:9``) on this machine's features.

    Such figures are this machine's, scaled by each profile's slowdown: an estimate for
    a profile made elsewhere, and the note says so. Image codecs are measured apart
    (:func:`ensure_image_codecs`).
    """
    lacking = sorted(
        {
            c
            for p in profiles.values()
            for c in codecs
            if (c not in p.codecs or _skipped_without_stand_in(p, c, codecs))
            and not CodecSpec.parse(c).image
        }
    )
    if not lacking:
        return []
    features = capture_features(graph)
    base = measure_cut_codecs(graph, features, lacking)
    for tier, profile in profiles.items():
        kept = replace(
            profile,
            cuts=tuple(
                replace(cut, codecs={k: v for k, v in cut.codecs.items() if k not in lacking})
                for cut in profile.cuts
            ),
        )
        profiles[tier] = with_codecs(kept, _scaled(base, profile.slowdown))
    return [f"codec {', '.join(lacking)}: not in the profiles, measured on this machine"]


def _skipped_without_stand_in(profile: Profile, codec: str, codecs: Sequence[str]) -> bool:
    """Whether ``profile`` skipped ``codec`` at some cut ([Note: codec pruning]) while the
    codec that stood in for it there is no candidate now (``--codec drop+zstd``, say)."""
    if not any(math.isinf(cut.codecs[codec].encode_s_per_mb) for cut in profile.cuts):
        return False
    spec = CodecSpec.parse(codec)
    stand_ins = {
        str(replace(spec, drop=False)),
        str(replace(spec, sparse=False)),
        str(replace(spec, drop=False, sparse=False)),
    } - {codec}
    return not stand_ins & set(codecs)


def ensure_image_codecs(
    graph: ModelGraph,
    profiles: dict[str, Profile],
    codecs: Sequence[str],
    images: Mapping[str, ImageNorm],
    requests: Sequence[Mapping[str, np.ndarray]],
) -> list[str]:
    """Measure the image codecs at cut 0 (the model inputs) on the sample's ``requests``.

    Medians over up to ``IMAGE_SAMPLE_LIMIT`` of them ([Note: image codec figures] in
    :mod:`.image_inputs`). They can carry nothing else: at the other cuts they are
    infinitely slow, so the search never puts them there. Scaled by each profile's
    slowdown, as :func:`ensure_codecs` does.
    """
    wanted = [c for c in codecs if CodecSpec.parse(c).image]
    if not wanted:
        return []
    crossing = graph.cuts[0].tensors
    chosen = [requests[i] for i in measured_requests(len(requests))]
    measured = measure_image_codecs(
        [{name: request[name] for name in crossing} for request in chosen], images, wanted
    )
    nowhere = {c: CodecStats(c, 1.0, math.inf, math.inf, math.inf) for c in wanted}
    base: list[dict[str, CodecStats]] = [measured] + [dict(nowhere) for _ in graph.cuts[1:]]
    for tier, profile in profiles.items():
        profiles[tier] = with_codecs(profile, _scaled(base, profile.slowdown))
    notes = []
    for name, norm in images.items():
        share = max(outside_pixels(request[name], norm) for request in chosen)
        if share > 0.01:
            notes.append(
                f"note: {100 * share:.0f}% of image input {name}'s values fall outside what "
                "its normalisation maps 0..255 to: check --image-norm"
            )
    return notes


def keep_png(
    codecs: tuple[str, ...],
    fidelity: FidelityBudget,
    images: Mapping[str, ImageNorm],
    probe: FidelityProbe | None,
) -> tuple[tuple[str, ...], list[str]]:
    """Under the exact budget, ``png`` stays a candidate only if the sample shows it exact."""
    if not fidelity.lossless_only or "png" not in codecs:
        return codecs, []
    if probe is not None and png_is_exact(probe.requests, images):
        return codecs, [
            f"png reproduces image input(s) {', '.join(images)} bit for bit on all "
            f"{len(probe.requests)} sample requests: an exact candidate"
        ]
    kept = tuple(c for c in codecs if c != "png")
    why = "no --sample to check it on" if probe is None else "it changes the sample's values"
    if not kept:
        raise UsageError(
            f"codec png is exact only for 8-bit pixels, and {why}: state a fidelity budget "
            "or choose a lossless codec"
        )
    return kept, [f"png left out under the exact budget: {why}"]


def _scaled(
    base: Sequence[Mapping[str, CodecStats]], slowdown: float
) -> list[dict[str, CodecStats]]:
    """Codec figures per cut with every time scaled by ``slowdown``."""
    return [{name: stats.slower(slowdown) for name, stats in cut.items()} for cut in base]
