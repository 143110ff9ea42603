"""benchmarks/bench_unseen.py: the task measures against float (text pixel F1, greedy CTC strings,
per-step and argmax agreement) on hand-made outputs with known answers."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_unseen as bu


def _steps(labels: list[int], classes: int = 5) -> np.ndarray:
    """A [1, T, classes] softmax-like output whose per-step argmax is ``labels``."""
    out = np.full((1, len(labels), classes), 0.01, dtype=np.float32)
    out[0, np.arange(len(labels)), labels] = 0.9
    return out


def test_ctc_drops_repeats_and_blank():
    assert bu._ctc(_steps([0, 3, 3, 0, 3, 1, 1, 0])) == (3, 3, 1)
    assert bu._ctc(_steps([0, 0, 0])) == ()


def test_recognizer_measures():
    ref = [_steps([0, 2, 2, 0, 4]), _steps([1, 1, 0, 3, 0])]
    # the first decodes the same (a repeat moved), the second loses its last character
    out = [_steps([0, 2, 0, 0, 4]), _steps([1, 1, 0, 0, 0])]
    got = bu.task_measures("rec", ref, out)
    assert got["strings_equal"] == pytest.approx(0.5)
    assert got["step_agreement"] == pytest.approx((4 / 5 + 4 / 5) / 2)


def test_detector_text_pixel_f1():
    ref = [np.array([[[[0.9, 0.8, 0.1, 0.0]]]], dtype=np.float32)]  # 2 text pixels
    out = [np.array([[[[0.9, 0.2, 0.7, 0.0]]]], dtype=np.float32)]  # 1 kept, 1 new
    got = bu.task_measures("det", ref, out)
    assert got["text_pixel_f1"] == pytest.approx(2 * 1 / (2 + 2))
    assert (got["float_text_pixels"], got["quant_text_pixels"]) == (2, 2)


def test_classifier_agreement_and_sqnr():
    ref = [np.array([[0.1, 0.9]], dtype=np.float32), np.array([[0.8, 0.2]], dtype=np.float32)]
    out = [np.array([[0.3, 0.7]], dtype=np.float32), np.array([[0.4, 0.6]], dtype=np.float32)]
    assert bu.task_measures("cls", ref, out) == {"agreement": 0.5}
    r = np.concatenate([x.ravel() for x in ref]).astype(np.float64)
    o = np.concatenate([x.ravel() for x in out]).astype(np.float64)
    expected = 10 * np.log10(np.sum(r**2) / np.sum((r - o) ** 2))
    assert bu._sqnr(ref, out) == pytest.approx(expected)
    assert bu._sqnr(ref, ref) == float("inf")


def test_yolox_detector_measure_reads_the_input_size_from_the_output_rows():
    # 416 x 416: 52^2 + 26^2 + 13^2 = 3549 rows; stride-32 cell x 4, y 5 of the 13 x 13 grid
    def raw(cell: int) -> np.ndarray:
        out = np.zeros((1, 3549, 6), np.float32)
        out[..., 2:4] = -5.0
        out[0, cell] = (0.0, 0.0, np.log(2.0), np.log(2.0), 0.9, 0.9)
        return out

    cell = 2704 + 676 + 13 * 5 + 4
    got = bu.task_measures("yolox", [raw(cell)], [raw(cell)])
    assert got["float_boxes"] == 1 and got["matched"] == 1
    # the next cell is 32 px away at stride 32: a 64 px box keeps IoU 1/3 < 0.5
    assert bu.task_measures("yolox", [raw(cell)], [raw(cell + 1)])["matched"] == 0


def test_layout_measure_reads_the_score_maps_only():
    # two strides: score maps (10 classes) and box distributions (32 bins), which are ignored
    scores = [np.zeros((1, 4, 10), np.float32), np.zeros((1, 2, 10), np.float32)]
    boxes = [np.full((1, 4, 32), 0.9, np.float32), np.full((1, 2, 32), 0.9, np.float32)]
    ref = [s.copy() for s in scores] + boxes
    out = [s.copy() for s in scores] + [np.zeros_like(b) for b in boxes]
    ref[0][0, 1, 3] = ref[1][0, 0, 0] = 0.9  # two float cells above 0.5
    out[0][0, 1, 3] = 0.8  # one kept
    out[1][0, 1, 2] = 0.7  # one new
    got = bu.task_measures("layout", ref, out)
    assert got["score_cell_f1"] == pytest.approx(2 * 1 / (2 + 2))
    # the SQNR is the worst output's: the second score map (0.9 lost, 0.7 new) measures
    # 10 log10(0.81 / 1.30), below the zeroed box maps' 0 dB
    assert bu._sqnr(ref, out, "layout") == pytest.approx(10 * np.log10(0.81 / 1.30), abs=1e-4)
