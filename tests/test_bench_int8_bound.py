"""benchmarks/bench_int8_bound.py and bench_fidelity.run_all: the counterfactual models run as
their Q/DQ arithmetic specifies."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from conftest import conv_relu_conv_model, run_ort

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_error_sources as es
import bench_fidelity as bf
import bench_int8_bound as ib

from quark_onnx import Config, ModelQuantizer, get_default_config


def _quantized(x: np.ndarray) -> onnx.ModelProto:
    qc = get_default_config("XINT8")
    qc.include_bias_correction = False
    return ModelQuantizer(Config(global_quant_config=qc)).quantize_model(
        conv_relu_conv_model(), None, {"x": x}
    )


def test_zero_extra_bits_is_the_quantized_model_and_one_bit_halves_the_step():
    x = np.random.default_rng(1).standard_normal((4, 3, 8, 8)).astype(np.float32)
    quantized = _quantized(x)
    feeds = {"x": x[:1]}
    np.testing.assert_array_equal(
        run_ort(ib.finer_activations(quantized, 0), feeds)[0], run_ort(quantized, feeds)[0]
    )
    finer = ib.finer_activations(quantized, 1)
    # the graph input's pair: numpy at 9 bits over the same range [-128 s, 127 s]
    (scale,) = [s for name, s in es.activation_pairs(quantized) if name == "x"]
    producer = {n.input[0]: n for n in quantized.graph.node if n.op_type == "QuantizeLinear"}
    q_out = producer["x"].output[0]
    (dq,) = [
        n for n in quantized.graph.node if n.op_type == "DequantizeLinear" and n.input[0] == q_out
    ]
    finer.graph.output.append(onnx.helper.make_value_info(dq.output[0], onnx.TypeProto()))
    got = run_ort(finer, feeds)[-1]
    want = np.clip(np.rint(x[:1] * 2 / scale), -256, 254) * (scale / 2)
    np.testing.assert_array_equal(got, want.astype(np.float32))
    coarse = np.clip(np.rint(x[:1] / scale), -128, 127) * scale
    assert not np.array_equal(got, coarse.astype(np.float32))


def test_run_all_keeps_float_weights_between_quantized_activations_float():
    """onnxruntime's optimiser quantizes the float weights of a DQ -> Conv -> Q unit itself; the
    benchmark's runner must not let it (the ``activations only`` split)."""
    x = np.random.default_rng(1).standard_normal((4, 3, 8, 8)).astype(np.float32)
    activations_only = es.float_constants(_quantized(x), conv_relu_conv_model())
    want = np.stack([run_ort(activations_only, {"x": x[i : i + 1]})[0][0] for i in range(4)])
    got = next(iter(bf.run_all(activations_only, x).values()))
    np.testing.assert_array_equal(got.reshape(want.shape), want)
    # what the runner avoids: the optimised session computes something else on this model
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(
        activations_only.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    optimised = np.stack([session.run(None, {"x": x[i : i + 1]})[0][0] for i in range(4)])
    assert not np.array_equal(optimised, want)
