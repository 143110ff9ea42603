"""MatMulNBits export: the layout decodes to the DequantizeLinear form's weights exactly, and
onnxruntime's outputs agree with that form within float rounding."""

from __future__ import annotations

import collections

import ml_dtypes
import numpy as np
import onnx
import pytest
from encoder_fixtures import SMALL, build_encoder, encoder_inputs, session
from onnx import numpy_helper

from quark_onnx import Config, ModelQuantizer, QuantType, export_matmul_nbits, get_default_config
from quark_onnx.errors import QuantizationError
from quark_onnx.passes.matmul_nbits import nbits_layout


def unpack(b: np.ndarray, scales: np.ndarray, zps: np.ndarray, k: int, block: int) -> np.ndarray:
    """Numpy decoder of MatMulNBits' layout: the float weight [K, N] it stands for."""
    n, blocks, _ = b.shape
    codes = np.stack([b & 0x0F, b >> 4], axis=-1).reshape(n, blocks * block)[:, :k]
    zp = np.stack([zps & 0x0F, zps >> 4], axis=-1).reshape(n, -1)[:, :blocks]
    s = scales.reshape(n, blocks)
    w = (codes.astype(np.float32) - np.repeat(zp, block, axis=1)[:, :k]) * np.repeat(
        s, block, axis=1
    )[:, :k]
    return w.T


@pytest.mark.parametrize("signed", [False, True])
@pytest.mark.parametrize("k", [64, 80])  # 80: a short last block
def test_layout_decodes_to_the_dequantized_weight(signed, k):
    rng = np.random.default_rng(k)
    n, block = 12, 32
    blocks = -(-k // block)
    dtype = ml_dtypes.int4 if signed else ml_dtypes.uint4
    lo, hi = (-8, 8) if signed else (0, 16)
    codes = rng.integers(lo, hi, (k, n)).astype(dtype)
    scale = rng.uniform(0.01, 0.1, (blocks, n)).astype(np.float32)
    zero = None if signed else rng.integers(0, 16, (blocks, n)).astype(dtype)
    b, s, z = nbits_layout(codes, scale, zero, block)
    assert b.shape == (n, blocks, block // 2) and b.dtype == np.uint8
    assert s.shape == (n * blocks,) and z.shape == (n * -(-blocks // 2),)
    zf = np.zeros((blocks, n), np.float32) if zero is None else zero.astype(np.float32)
    expected = (codes.astype(np.float32) - np.repeat(zf, block, axis=0)[:k]) * np.repeat(
        scale, block, axis=0
    )[:k]
    np.testing.assert_array_equal(unpack(b, s, z, k, block), expected)


@pytest.fixture(scope="module")
def encoder():
    return build_encoder(SMALL, seed=7), encoder_inputs(8, 3, SMALL)


@pytest.mark.parametrize("weight_type", [QuantType.QUInt4, QuantType.QInt4])
def test_export_matches_the_dequantize_linear_form(encoder, weight_type, tmp_path):
    model, feeds = encoder
    qc = get_default_config("UINT4_WEIGHT_ONLY_G32")
    qc.weight_type = weight_type
    if weight_type is QuantType.QInt4:
        qc.extra_options["WeightSymmetric"] = True
    dq_path = tmp_path / "dq.onnx"
    ModelQuantizer(Config(global_quant_config=qc)).quantize_model(model, dq_path)
    nbits = export_matmul_nbits(dq_path, tmp_path / "nbits.onnx")
    ops = collections.Counter(n.op_type for n in nbits.graph.node)
    assert ops["MatMulNBits"] == 6 * SMALL.layers and "DequantizeLinear" not in ops
    assert (tmp_path / "nbits.onnx").stat().st_size < dq_path.stat().st_size
    (ref,) = session(dq_path).run(None, feeds)
    (got,) = session(tmp_path / "nbits.onnx").run(None, feeds)
    # float rounding only: a few float32 ulps of the largest hidden value, after 4 layers
    assert np.max(np.abs(got - ref)) <= 64 * np.finfo(np.float32).eps * np.max(np.abs(ref))
    # nothing else changed: same inputs, outputs and non-weight nodes
    dq = onnx.load(dq_path)
    assert [o.name for o in nbits.graph.output] == [o.name for o in dq.graph.output]
    inits = {i.name: numpy_helper.to_array(i) for i in nbits.graph.initializer}
    attrs = {
        a.name: a.i
        for a in next(n for n in nbits.graph.node if n.op_type == "MatMulNBits").attribute
    }
    assert attrs == {"K": SMALL.hidden, "N": SMALL.hidden, "bits": 4, "block_size": 32}
    assert all(v.dtype != ml_dtypes.uint4 for v in inits.values())


def test_export_refuses_a_model_without_four_bit_layers(encoder, tmp_path):
    model, _ = encoder
    quantized = ModelQuantizer(
        Config(global_quant_config=get_default_config("INT8_DYNAMIC"))
    ).quantize_model(model)
    with pytest.raises(QuantizationError, match="UINT4_WEIGHT_ONLY_G32"):
        export_matmul_nbits(quantized, tmp_path / "x.onnx")
    assert not (tmp_path / "x.onnx").exists()
