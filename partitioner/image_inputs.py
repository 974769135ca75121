"""Image inputs: model inputs that are normalised 8-bit images, and sending them as images.

A camera app uploads its frame as JPEG; ``tierflow plan --image-input NAME`` lets a plan
do the same: where the model inputs cross a link (the device runs nothing; an edge that
runs nothing either forwards them to the cloud as they came), input NAME may travel as
``jpeg:Q``, ``webp:Q`` or ``png`` ([Note: image codecs] in :mod:`tierflow.codec.image`;
[Note: image inputs] in :mod:`tierflow.plan`). The planner measures each image codec's
size and speed on the sample's images (:func:`measure_image_codecs`, [Note: image codec
figures]) and, like any lossy codec, its fidelity end to end; ``png`` is exact only for
a tensor that really is normalised 8-bit pixels, so under the ``exact`` budget it is a
candidate only when it reproduces every sample request bit for bit
(:func:`png_is_exact`).

The normalisation comes from ``--image-norm NAME=SPEC``, read by
:func:`tierflow.image_norm.parse_norm` (shared with ``tierflow device``): a preset
(``unit``: x = pixel / 255; ``imagenet``: torchvision's mean and std over pixel / 255;
``symmetric``: x = pixel / 127.5 - 1) or
``mean=M[,M,M];std=S[,S,S][;scale=255][;layout=NCHW|NHWC]``. Without ``--image-norm``
an image input is ``unit``; the layout, when not given, is NCHW if dimension 1 holds 1
or 3 channels, else NHWC if the last one does.

[Note: image codec figures]
Neighbouring JPEG qualities differ by a kilobyte or so and by a few percent of encode
time, and the device's encode counts ten times over (an emulated device 10x slower), so
the planner's choice among them rests on small differences. Figures from one request
are at the mercy of that request (a flat page compresses alike at every quality) and
of the moment: timed on the wall clock, a busy spell on a shared machine once made
every JPEG upload of a CNN predict slower than an ``int4+zstd`` upload (176.8 ms) that
the planner then chose, while those JPEG uploads measured 144-155 ms. So each codec is
measured on up to ``IMAGE_SAMPLE_LIMIT`` sample requests spread over the sample, after
one untimed call, and the figures are medians over them: bytes, and encode and decode
time as this thread's CPU time (what ONNX Runtime's one-thread segments are timed in too,
:func:`~tierflow.partitioner.profile.compute_clock`), which other jobs cannot inflate.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from tierflow.codec.base import (
    DEFAULT_MAX_TENSOR_BYTES,
    CodecSpec,
    CodecStats,
    EncodedTensor,
    ImageNorm,
    decode,
    decoded_nbytes,
    encode,
)
from tierflow.errors import CodecError, UsageError
from tierflow.image_norm import NormSpec

#: The image codecs ``--codec auto`` adds for image inputs: JPEG's quality sweep, WebP, PNG.
#: The sweep goes down to quality 5: what an app tuned for a slow link uploads, and on
#: a robust task (page orientation) quality 10 is as faithful as quality 90
#: (benchmarks/results/RATE_FIDELITY.md); the benchmarks' lowest JPEG baseline is quality 5.
IMAGE_CANDIDATES: tuple[str, ...] = (
    "jpeg:5",
    "jpeg:10",
    "jpeg:20",
    "jpeg:30",
    "jpeg:40",
    "jpeg:50",
    "jpeg:60",
    "jpeg:70",
    "jpeg:80",
    "jpeg:90",
    "jpeg:95",
    "webp:50",
    "webp:75",
    "webp:90",
    "png",
)

#: How many sample requests the image codecs are measured on (spread over the sample).
IMAGE_SAMPLE_LIMIT = 16

# Codec times are the calling thread's CPU time: Pillow, zstd (no worker threads) and
# numpy all compute on it. See [Note: image codec figures].
_clock = time.thread_time


def resolve_images(
    inputs: Sequence[Any], names: Sequence[str], norms: Mapping[str, NormSpec]
) -> dict[str, ImageNorm]:
    """The normalisation of each image input, checked against the model's inputs.

    ``inputs`` are the model's input infos (name, shape, dtype); an image input must be a
    4-D float tensor with 1 or 3 channels where its layout puts them.
    """
    by_name = {info.name: info for info in inputs}
    strangers = [n for n in list(names) + list(norms) if n not in by_name]
    if strangers:
        raise UsageError(
            f"--image-input/--image-norm name {strangers[0]!r}, which is not an input of the "
            f"model; its inputs are {', '.join(by_name)}"
        )
    loose = [n for n in norms if n not in names]
    if loose:
        raise UsageError(f"--image-norm {loose[0]}=... needs --image-input {loose[0]}")
    images: dict[str, ImageNorm] = {}
    for name in names:
        info, spec = by_name[name], norms.get(name, NormSpec())
        shape = tuple(info.shape)
        if len(shape) != 4 or np.dtype(info.dtype).kind != "f":
            raise UsageError(
                f"--image-input {name}: an image input is a 4-D float tensor, the model's is "
                f"{info.dtype}{list(shape)}"
            )
        images[name] = spec.resolve(shape, f"--image-input {name}")
    return images


def crossed_with(
    tensors: Mapping[str, np.ndarray], codec: str, images: Mapping[str, ImageNorm]
) -> dict[str, np.ndarray]:
    """What a receiver decodes after ``tensors`` crossed a link with ``codec``.

    As the runtime does ([Note: image inputs] in :mod:`tierflow.plan`): with an image
    codec the image inputs travel as images and everything else raw.
    """
    spec = CodecSpec.parse(codec)
    plain = spec.lossless_part() if spec.image else spec
    crossed: dict[str, np.ndarray] = {}
    for name, array in tensors.items():
        norm = images.get(name) if spec.image else None
        encoded = encode(name, array, spec, image=norm) if norm else encode(name, array, plain)
        limit = max(decoded_nbytes(encoded), DEFAULT_MAX_TENSOR_BYTES)
        crossed[name] = decode(encoded, max_bytes=limit)
    return crossed


def measured_requests(count: int, limit: int = IMAGE_SAMPLE_LIMIT) -> list[int]:
    """Which of ``count`` sample requests the image codecs are measured on: all of them up
    to ``limit``, else ``limit`` spread evenly over the sample (a sample may come sorted)."""
    if count <= limit:
        return list(range(count))
    return sorted({round(float(i)) for i in np.linspace(0, count - 1, limit)})


def measure_image_codecs(
    requests: Sequence[Mapping[str, np.ndarray]],
    images: Mapping[str, ImageNorm],
    codecs: Sequence[str],
    *,
    limit: int = IMAGE_SAMPLE_LIMIT,
) -> dict[str, CodecStats]:
    """Ratio, speed and error of each image codec on the tensors where the inputs cross.

    ``requests`` hold the tensors of cut 0, one mapping per sample request: the image
    inputs go as images, the rest raw, as on the wire. See [Note: image codec figures].
    """
    chosen = [requests[i] for i in measured_requests(len(requests), limit)]
    if not chosen:
        raise UsageError("cannot measure image codecs on no requests")
    raw = [sum(np.asarray(a).nbytes for a in r.values()) for r in chosen]
    mb = max(statistics.median(raw), 1) / 1e6
    result: dict[str, CodecStats] = {}
    for codec in codecs:
        spec = CodecSpec.parse(codec)
        _encoded(chosen[0], spec, images)  # warm-up: a codec's first call pays its set-up
        encode_times, decode_times, sent = [], [], []
        error = 0.0
        for request in chosen:
            start = _clock()
            tensors = _encoded(request, spec, images)
            encode_times.append(_clock() - start)
            start = _clock()
            decoded = [
                decode(t, max_bytes=max(decoded_nbytes(t), DEFAULT_MAX_TENSOR_BYTES))
                for t in tensors
            ]
            decode_times.append(_clock() - start)
            sent.append(sum(t.nbytes for t in tensors))
            error = max(
                error,
                *(
                    float(np.max(np.abs(np.asarray(a, np.float64) - d))) if np.size(a) else 0.0
                    for a, d in zip(request.values(), decoded, strict=True)
                ),
            )
        result[codec] = CodecStats(
            codec=codec,
            ratio=max(statistics.median(raw), 1) / max(statistics.median(sent), 1),
            encode_s_per_mb=statistics.median(encode_times) / mb,
            decode_s_per_mb=statistics.median(decode_times) / mb,
            max_abs_error=error,
        )
    return result


def _encoded(
    request: Mapping[str, np.ndarray], spec: CodecSpec, images: Mapping[str, ImageNorm]
) -> list[EncodedTensor]:
    """One request's tensors as they go on the wire: image inputs as images, the rest
    with the codec's lossless part."""
    plain = spec.lossless_part()
    return [
        encode(n, a, spec, image=images[n]) if n in images else encode(n, a, plain)
        for n, a in request.items()
    ]


def png_is_exact(
    requests: Sequence[Mapping[str, np.ndarray]], images: Mapping[str, ImageNorm]
) -> bool:
    """Whether ``png`` gives back every image input of every request bit for bit."""
    for request in requests:
        for name, norm in images.items():
            array = np.asarray(request[name])
            try:
                encoded = encode(name, array, "png", image=norm)
                back = decode(encoded, max_bytes=max(decoded_nbytes(encoded), 1))
            except CodecError:
                return False
            if back.dtype != array.dtype or back.tobytes() != array.tobytes():
                return False
    return True


def outside_pixels(array: np.ndarray, norm: ImageNorm) -> float:
    """Share of ``array``'s values that ``norm`` maps outside the pixel range 0..255."""
    shape = [1, 1, 1, 1]
    shape[norm.axis] = norm.channels
    mean = np.array(norm.mean).reshape(shape)
    std = np.array(norm.std).reshape(shape)
    pixels = (np.asarray(array, np.float64) * std + mean) * norm.scale
    return float(np.mean((pixels < -0.5) | (pixels > 255.5))) if pixels.size else 0.0
