"""The detection measure against hand-computed oracles: IoU, NMS, decoding and matching."""

from __future__ import annotations

import numpy as np
import pytest

from detectors.detections import box_iou, decode_yolov8, kept_detections, nms


def dets(boxes, scores, classes):
    return (np.asarray(boxes, float).reshape(-1, 4), np.asarray(scores, float),
            np.asarray(classes, int))  # fmt: skip


def test_iou_hand_computed():
    a = [[0, 0, 10, 10]]
    b = [[5, 0, 15, 10], [0, 0, 10, 10], [20, 20, 30, 30], [0, 0, 5, 5]]
    # overlaps 50 of 150; identical; disjoint; inside (25 of 100)
    np.testing.assert_allclose(box_iou(a, b), [[50 / 150, 1.0, 0.0, 0.25]])
    assert box_iou(a, np.zeros((0, 4))).shape == (1, 0)
    assert box_iou([[1, 1, 1, 1]], [[1, 1, 1, 1]])[0, 0] == 0.0  # empty union, no NaN


def test_nms_suppresses_same_class_overlaps_only():
    boxes = np.array(
        [
            [0, 0, 10, 10],  # 0: best
            [1, 0, 11, 10],  # 1: IoU 90/110 = 0.82 with 0, same class -> suppressed
            [1, 0, 11, 10],  # 2: same box, other class -> kept
            [5, 0, 15, 10],  # 3: IoU 1/3 with 0 (< 0.45) -> kept
            [3, 0, 13, 10],  # 4: IoU 70/130 = 0.54 with 0 -> suppressed
        ],
        float,
    )
    scores = np.array([0.9, 0.8, 0.7, 0.6, 0.5])
    classes = np.array([1, 1, 2, 1, 1])
    assert nms(boxes, scores, classes, 0.45).tolist() == [0, 2, 3]


def test_suppressed_box_suppresses_nothing():
    # B is dropped by A (IoU 70/130); C overlaps B as much but A only at 40/160: C is kept
    boxes = np.array([[0, 0, 10, 10], [3, 0, 13, 10], [6, 0, 16, 10]], float)
    assert nms(boxes, np.array([0.9, 0.8, 0.7]), np.array([0, 0, 0])).tolist() == [0, 2]


def test_nms_threshold_is_strict():
    boxes = np.array([[0, 0, 10, 10], [5, 0, 15, 10]], float)  # IoU exactly 1/3
    assert nms(boxes, np.array([0.9, 0.8]), np.array([0, 0]), 1 / 3).tolist() == [0, 1]


def test_decode_threshold_argmax_and_xyxy():
    # 2 images, 3 classes, 3 anchors; rows cx, cy, w, h, then class scores
    out = np.zeros((2, 7, 3), np.float32)
    out[0, :4, 0] = [50, 40, 20, 10]
    out[0, 4:, 0] = [0.1, 0.9, 0.3]  # class 1, score 0.9
    out[0, :4, 1] = [50, 40, 20, 10]
    out[0, 4:, 1] = [0.8, 0.0, 0.0]  # class 0: same box, other class, kept
    out[0, :4, 2] = [10, 10, 4, 4]
    out[0, 4:, 2] = [0.2, 0.24, 0.1]  # below 0.25: dropped
    out[1, :4, 0] = [0, 0, 2, 2]
    out[1, 4:, 0] = [0.0, 0.0, 0.25]  # exactly the threshold: kept
    (b0, s0, c0), (b1, s1, c1) = decode_yolov8(out)
    np.testing.assert_allclose(b0, [[40, 35, 60, 45], [40, 35, 60, 45]])
    np.testing.assert_allclose(s0, [0.9, 0.8], rtol=1e-6)
    assert c0.tolist() == [1, 0]
    np.testing.assert_allclose(b1, [[-1, -1, 1, 1]])
    assert c1.tolist() == [2] and s1[0] == pytest.approx(0.25)


def test_decode_rejects_other_layouts():
    with pytest.raises(ValueError):
        decode_yolov8(np.zeros((1, 3, 84)))


def test_kept_detections_matching():
    f = [
        dets([[0, 0, 10, 10], [20, 20, 30, 30], [40, 40, 50, 50]], [0.9, 0.8, 0.7], [0, 0, 1]),
        dets([[0, 0, 10, 10]], [0.5], [3]),
    ]
    q = [
        dets(
            [
                [0, 0, 10, 11],  # IoU 100/110 with float 0 -> match
                [20, 20, 30, 30],  # identical to float 1 but class 1 -> no match
                [44, 40, 54, 50],  # IoU 60/140 = 0.43 with float 2 -> below 0.5
            ],
            [0.9, 0.8, 0.7],
            [0, 1, 1],
        ),
        dets([[0, 0, 10, 10]], [0.4], [3]),
    ]
    assert kept_detections(f, q) == (2, 4)
    assert kept_detections(f, q, iou=0.4) == (3, 4)
    assert kept_detections(f, f) == (4, 4)


def test_kept_detections_is_one_to_one():
    # two float boxes, one quantized box overlapping both: only the higher-scored float one wins
    f = [dets([[0, 0, 10, 10], [1, 0, 11, 10]], [0.6, 0.9], [0, 0])]
    q = [dets([[0, 0, 10, 10]], [0.7], [0])]
    assert kept_detections(f, q) == (1, 2)
    empty = [dets(np.zeros((0, 4)), [], [])]
    assert kept_detections(f, empty) == (0, 2)
    assert kept_detections(empty, q) == (0, 0)
    with pytest.raises(ValueError):
        kept_detections(f, f + f)
