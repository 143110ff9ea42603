"""benchmarks/bench_error_sources.py: the graph variants that split weight and activation loss."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
from conftest import conv_relu_conv_model, run_ort

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_error_sources as es

from quark_onnx import Config, ModelQuantizer, get_default_config


def test_variants_remove_exactly_what_they_say():
    model = conv_relu_conv_model()
    x = np.random.default_rng(1).standard_normal((4, 1, 3, 8, 8)).astype(np.float32)
    qc = get_default_config("XINT8")
    qc.include_bias_correction = False  # the float weights below are then the quantized ones'
    quantized = ModelQuantizer(Config(global_quant_config=qc)).quantize_model(
        model, None, {"x": x.reshape(4, 3, 8, 8)}
    )
    feeds = {"x": x[0]}
    (ref,) = run_ort(model, feeds)
    (q,) = run_ort(quantized, feeds)
    assert not np.array_equal(q, ref)
    # both removed: the float model, exactly (the prepared model here is the float model)
    both = es.float_constants(es.float_activations(quantized), model)
    np.testing.assert_array_equal(run_ort(both, feeds)[0], ref)
    # activations float: the float graph with the dequantized weights and bias
    weights_only = es.float_activations(quantized)
    assert not any(n.op_type == "QuantizeLinear" for n in weights_only.graph.node)
    deq = onnx.ModelProto()
    deq.CopyFrom(model)
    init = {i.name: i for i in quantized.graph.initializer}
    for t in deq.graph.initializer:
        codes = onnx.numpy_helper.to_array(init[f"{t.name}_quantized"]).astype(np.float32)
        scale = onnx.numpy_helper.to_array(init[f"{t.name}_scale"])
        t.CopyFrom(onnx.numpy_helper.from_array((codes * scale).astype(np.float32), t.name))
    np.testing.assert_array_equal(run_ort(weights_only, feeds)[0], run_ort(deq, feeds)[0])
    # one group float: only those pairs go
    partial = es.float_activations(quantized, lambda name: name == "r1")
    kept = [n.input[0] for n in partial.graph.node if n.op_type == "QuantizeLinear"]
    assert "r1" not in kept and "x" in kept


def test_own_sqnr_of_the_input_is_numpy_fake_quantization():
    """The graph input reaches its QuantizeLinear unchanged: its own SQNR is the numpy model's
    ``clip(rint(x / s), -128, 127) * s`` over the same images; every activation is listed once."""
    model = conv_relu_conv_model()
    x = np.random.default_rng(1).standard_normal((4, 3, 8, 8)).astype(np.float32)
    quantized = ModelQuantizer(Config(global_quant_config=get_default_config("XINT8")))
    quantized = quantized.quantize_model(model, None, {"x": x})
    pairs = es.activation_pairs(quantized)
    names = [name for name, _ in pairs]
    assert len(names) == len(set(names)) == 3 and {"x", "r1"} <= set(names)  # and the output
    own = es.own_sqnr(quantized, x, pairs)
    scale = dict(pairs)["x"]
    xd = x.astype(np.float64)
    q = np.clip(np.rint(xd / scale), -128, 127) * scale
    expected = 10 * np.log10(np.sum(xd**2) / np.sum((xd - q) ** 2))
    assert abs(own["x"] - expected) < 1e-9
