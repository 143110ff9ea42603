"""benchmarks/bench_fidelity.py: pre-processing, detection decoding and option sets."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import make_model, run_ort
from onnx import TensorProto, helper

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_fidelity as bf


@pytest.mark.parametrize(("h", "w", "oh", "ow"), [(17, 23, 40, 9), (50, 30, 48, 144), (5, 5, 5, 5)])
def test_resize_matches_onnx_half_pixel_linear(h, w, oh, ow):
    img = np.random.default_rng(0).uniform(0, 255, (h, w, 3)).astype(np.float32)
    model = make_model(
        [
            helper.make_node(
                "Resize", ["x", "", "", "sizes"], ["y"], mode="linear",
                coordinate_transformation_mode="half_pixel",
            )
        ],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [h, w, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [oh, ow, 3])],
        {"sizes": np.array([oh, ow, 3], np.int64)},
        opset=18,
    )  # fmt: skip
    (ref,) = run_ort(model, {"x": img})
    np.testing.assert_allclose(bf.resize_bilinear(img, oh, ow), ref, rtol=0, atol=1e-3)


def test_letterbox_top_left_bgr_pad_114():
    rgb = np.zeros((100, 50, 3), np.uint8)
    rgb[...] = (10, 20, 30)
    x = bf.letterbox(rgb)
    assert x.shape == (3, 192, 192) and x.dtype == np.float32
    bgr = np.broadcast_to(np.array([30, 20, 10], np.float32)[:, None, None], (3, 192, 96))
    np.testing.assert_allclose(x[:, :, :96], bgr, atol=1e-4)
    assert np.all(x[:, :, 96:] == 114.0)


def test_ocr_crop_band_normalised_and_right_padded():
    rgb = np.full((90, 120, 3), 255, np.uint8)
    rgb[..., 2] = 0  # blue 0 -> first (B) channel -1 after (x/255 - 0.5)/0.5
    x = bf.ocr_crop(rgb)
    assert x.shape == (3, 48, 192)
    # band height 120 / 3 = 40 -> width ceil(48 * 120 / 40) = 144, then zeros to 192
    np.testing.assert_allclose(x[0, :, :144], -1.0, atol=1e-5)
    np.testing.assert_allclose(x[1:, :, :144], 1.0, atol=1e-5)
    assert np.all(x[:, :, 144:] == 0.0)


def _raw(cells: dict[int, tuple[float, float, float, float, float, float]]) -> np.ndarray:
    out = np.zeros((756, 6), np.float32)
    out[:, 2:4] = -5.0
    for idx, values in cells.items():
        out[idx] = values
    return out


def test_decode_detections_grid_threshold_and_nms():
    # stride 8 grid is 24 x 24: cell 24 * 3 + 5 is x = 5, y = 3.
    out = _raw(
        {
            24 * 3 + 5: (0.5, 0.25, np.log(4.0), np.log(2.0), 0.9, 1.0),  # kept
            24 * 3 + 6: (-0.5, 0.25, np.log(4.0), np.log(2.0), 0.8, 1.0),  # same box: NMS
            576 + 12 * 2 + 1: (0.0, 0.0, 0.0, 0.0, 0.5, 0.59),  # 0.295 < 0.3: dropped
            576 + 144 + 6 * 5 + 4: (0.0, 0.0, 0.0, 0.0, 0.6, 0.6),  # stride 32, x 4 y 5
        }
    )
    boxes = bf.decode_detections(out)
    assert len(boxes) == 2
    cx, cy, w, h = (5.5) * 8, 3.25 * 8, 4 * 8, 2 * 8
    np.testing.assert_allclose(boxes[0], [cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2, 0.9])
    np.testing.assert_allclose(boxes[1], [128 - 16, 160 - 16, 128 + 16, 160 + 16, 0.36])


def test_detection_match_counts():
    box = {24 * 3 + 5: (0.5, 0.25, np.log(4.0), np.log(2.0), 0.9, 1.0)}
    f = np.stack([_raw(box), _raw({})])
    assert bf.detection_match(f, f)["match_rate"] == 1.0
    moved = {24 * 3 + 9: (0.5, 0.25, np.log(4.0), np.log(2.0), 0.9, 1.0)}  # 32 px right
    result = bf.detection_match(f, np.stack([_raw(moved), _raw({})]))
    assert result == {
        "float_boxes": 1,
        "float_images_with_boxes": 1,
        "quant_boxes": 1,
        "matched": 0,
        "match_rate": 0.0,
    }


def test_output_fidelity_sqnr_and_cosine():
    f = np.array([[3.0, 4.0], [1.0, 0.0]])
    q = np.array([[3.0, 4.0], [0.0, 1.0]])
    r = bf.output_fidelity(f, q)
    assert r["sqnr_db"] == round(10 * np.log10(26.0 / 2.0), 2)
    assert r["cosine"] == 0.5 and r["nan_inf"] is False
    assert bf.output_fidelity(f, np.array([[np.nan, 0], [0, 0]]))["nan_inf"] is True
    zero = bf.output_fidelity(f, np.zeros_like(f))  # an all-zero output is not faithful
    assert zero["cosine"] == 0.0 and zero["sqnr_db"] == 0.0
    assert bf.output_fidelity(np.zeros((1, 2)), np.zeros((1, 2)))["cosine"] == 1.0


def test_configs_and_technique_discovery():
    from quark_onnx.config.enums import QuantType

    seed = bf.make_config("seed")
    assert seed.optimize_model is False and seed.activation_type == QuantType.QInt8
    for key, value in bf.SEED_EXTRA_OPTIONS.items():
        assert seed.extra_options[key] == value
    assert seed.extra_options["UseRandomData"] is True  # the snippet as written
    real = bf.make_config("seed_real")
    assert real.extra_options["UseRandomData"] is False
    assert {k: v for k, v in real.extra_options.items() if k != "UseRandomData"} == {
        k: v for k, v in seed.extra_options.items() if k != "UseRandomData"
    }
    offs = bf.preset_techniques()
    preset = bf.make_config("preset")
    assert preset.include_bias_correction and "include_bias_correction" in offs
    options = preset.validate()
    assert all(getattr(options, k) is True for k in offs if k[0].isupper())
    assert not any(k.startswith(("Align", "Adjust")) or k in bf.FORMAT_OPTIONS for k in offs)
    for name, off in offs.items():
        qc = bf.make_config("preset", off)
        value = getattr(qc, name) if not name[0].isupper() else qc.extra_options[name]
        assert value is False
