"""A numpy detection measure for YOLOv8-layout outputs: decode, class-aware NMS, kept detections.

Issue 34's acceptance counts the float model's detections (score >= 0.25, NMS at IoU 0.45) that
the quantized model keeps: a quantized detection of the same class overlapping at IoU >= 0.5,
matched one to one. Pure numpy, so tests and benchmarks share one definition:

* ``decode_yolov8(output)``: ``[N, 4 + nc, A]`` with pixel ``cx, cy, w, h`` rows then class
  scores -> per image ``(boxes_xyxy [k, 4], scores [k], classes [k])`` sorted by score;
  the class is the argmax over the score rows, the score its value (Ultralytics' decode);
* ``nms``: greedy class-aware non-maximum suppression (a box is dropped when a higher-scored box
  of the same class overlaps it at IoU > the threshold, as ``torchvision.ops.nms``);
* ``kept_detections(float_dets, quant_dets)``: ``(matched, total)`` summed over images.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

CONF = 0.25
NMS_IOU = 0.45
MATCH_IOU = 0.5
MAX_DET = 300

Detections = tuple[np.ndarray, np.ndarray, np.ndarray]  # boxes_xyxy [k, 4], scores, classes


def box_iou(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Pairwise IoU of ``x1, y1, x2, y2`` boxes: ``[len(a), len(b)]`` (0 for empty unions)."""
    a = np.asarray(a, np.float64).reshape(-1, 4)
    b = np.asarray(b, np.float64).reshape(-1, 4)
    lt = np.maximum(a[:, None, :2], b[None, :, :2])
    rb = np.minimum(a[:, None, 2:], b[None, :, 2:])
    inter = np.clip(rb - lt, 0, None).prod(axis=2)
    area_a = np.clip(a[:, 2:] - a[:, :2], 0, None).prod(axis=1)
    area_b = np.clip(b[:, 2:] - b[:, :2], 0, None).prod(axis=1)
    union = area_a[:, None] + area_b[None, :] - inter
    return np.divide(inter, union, out=np.zeros_like(inter), where=union > 0)


def nms(
    boxes: np.ndarray, scores: np.ndarray, classes: np.ndarray, iou: float = NMS_IOU
) -> np.ndarray:
    """Indices kept by greedy class-aware NMS, by descending score (stable on ties)."""
    order = np.argsort(-np.asarray(scores), kind="stable")
    overlaps = box_iou(boxes, boxes)
    keep: list[int] = []
    suppressed = np.zeros(len(order), bool)
    for i in order:
        if suppressed[i]:
            continue
        keep.append(int(i))
        suppressed |= (overlaps[i] > iou) & (classes == classes[i])
    return np.asarray(keep, np.int64)


def decode_yolov8(
    output: np.ndarray, conf: float = CONF, iou: float = NMS_IOU, max_det: int = MAX_DET
) -> list[Detections]:
    """Per image the detections of a ``[N, 4 + nc, A]`` output (score >= ``conf``, NMS ``iou``)."""
    output = np.asarray(output)
    if output.ndim != 3 or output.shape[1] < 5:
        raise ValueError(f"expected [N, 4 + nc, A], got {output.shape}")
    result = []
    for image in output:
        cxcywh, class_scores = image[:4].T, image[4:].T  # [A, 4], [A, nc]
        classes = class_scores.argmax(axis=1)
        scores = class_scores.max(axis=1)
        mask = scores >= conf
        c = cxcywh[mask].astype(np.float64)
        boxes = np.concatenate([c[:, :2] - c[:, 2:] / 2, c[:, :2] + c[:, 2:] / 2], axis=1)
        keep = nms(boxes, scores[mask], classes[mask], iou)[:max_det]
        result.append((boxes[keep], scores[mask][keep], classes[mask][keep]))
    return result


def kept_detections(
    float_dets: Sequence[Detections], quant_dets: Sequence[Detections], iou: float = MATCH_IOU
) -> tuple[int, int]:
    """``(matched, total)``: float detections with a same-class quantized one at IoU >= ``iou``.

    Greedy one-to-one matching per image: float detections by descending score each take the
    still-free quantized detection of their class with the highest IoU.
    """
    if len(float_dets) != len(quant_dets):
        raise ValueError(f"{len(float_dets)} float images, {len(quant_dets)} quantized")
    matched = total = 0
    for (fb, fs, fc), (qb, _, qc) in zip(float_dets, quant_dets, strict=True):
        total += len(fb)
        overlaps = box_iou(fb, qb)
        overlaps[np.asarray(fc)[:, None] != np.asarray(qc)[None, :]] = -1.0
        free = np.ones(len(qb), bool)
        for i in np.argsort(-np.asarray(fs), kind="stable"):
            candidates = np.where(free, overlaps[i], -1.0)
            if len(candidates) == 0:
                break
            j = int(candidates.argmax())
            if candidates[j] >= iou:
                matched += 1
                free[j] = False
    return matched, total
