"""qparams: the numpy reference arithmetic, checked against exact arithmetic."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from quark_onnx.config.enums import QuantType
from quark_onnx.params import qparams


def test_int32_codes_saturate_instead_of_wrapping() -> None:
    p = qparams.from_position(20, QuantType.QInt32)
    codes = qparams.quantize(np.array([1e6, -1e6, 1.5], np.float32), p)
    assert codes.tolist() == [2**31 - 1, -(2**31), round(1.5 * 2**20)]


@pytest.mark.parametrize("bits", [3, 7, 11])
def test_round_scale_up_keeps_bits_and_never_shrinks(bits: int) -> None:
    rng = np.random.default_rng(0)
    scale = np.exp(rng.uniform(-12, 3, size=4000))
    rounded = qparams.round_scale_up(scale, bits)
    assert np.all(rounded >= scale) and np.all(rounded < scale * (1 + 2.0 ** (1 - bits)))
    mantissa, _ = np.frexp(rounded)  # rounded = mantissa * 2^e, mantissa in [0.5, 1)
    assert np.all(mantissa * 2**bits == np.round(mantissa * 2**bits))
    assert qparams.round_scale_up(np.array([0.25, 0.0]), bits).tolist() == [0.25, 0.0]


def test_seven_bit_scales_and_their_products_with_4_bit_zero_points_are_float16_values() -> None:
    rng = np.random.default_rng(1)
    scale = qparams.round_scale_up(np.exp(rng.uniform(-9, 2, size=2000)), 7).astype(np.float32)
    for z in range(16):
        product = scale * np.float32(z)
        assert np.array_equal(product.astype(np.float16).astype(np.float32), product)


def test_rounded_asymmetric_uint4_groups_still_cover_their_range() -> None:
    rng = np.random.default_rng(2)
    w = rng.standard_normal((64, 96)).astype(np.float32)
    exact = qparams.weight_params(w, QuantType.QUInt4, symmetric=False, axis=0, block_size=32)
    rounded = qparams.weight_params(
        w, QuantType.QUInt4, symmetric=False, axis=0, block_size=32, scale_bits=7
    )
    assert np.all(rounded.scale >= exact.scale)
    err_exact = np.abs(qparams.fake_quant(w, exact) - w)
    err_rounded = np.abs(qparams.fake_quant(w, rounded) - w)
    step = qparams.broadcast_parameter(rounded.scale, w.shape, 0, 32)
    # every weight is within one step (half a step plus the zero point's rounding)
    assert np.all(err_rounded <= step * (1 + 1e-6))
    assert err_rounded.mean() <= err_exact.mean() * 1.05


def test_float8_saturates_at_448() -> None:
    p = qparams.QuantParams(
        QuantType.QFLOAT8E4M3FN,
        scale=np.array(1.0, np.float32),
        zero_point=np.array(0, ml_dtypes.float8_e4m3fn),
    )
    codes = qparams.quantize(np.array([1e6, -1e6, 3.0], np.float32), p)
    assert codes.astype(np.float32).tolist() == [448.0, -448.0, 3.0]


def test_uint4_weight_only_preset_exports_to_gguf_exactly() -> None:
    pytest.importorskip("gguf")
    from quark_onnx import Config, ModelQuantizer, get_default_config
    from quark_onnx.formats.gguf_export import export_gguf
    from tests.strategies.transformer_block import build_block

    qc = get_default_config("UINT4_WEIGHT_ONLY_G32")
    qc.optimize_model = False
    quantized = ModelQuantizer(Config(global_quant_config=qc)).quantize_model(build_block())
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        summary = export_gguf(quantized, Path(tmp) / "block.gguf", require_exact=True)
    assert summary["quantized"] >= 2
    assert all(entry.get("exact", True) for entry in summary["written"])
