"""EqualizeResidualStreams: bit-identical float outputs, the scales it must choose, and where it
must not fire."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from conftest import make_model, run_ort, shared_path
from onnx import TensorProto, helper

from quark_onnx.passes import EqualizeResidualStreams
from quark_onnx.passes import equalize_residual_streams as ers
from quark_onnx.passes.equalize_residual_streams import MAX_LOG2

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import make_stress_variants as msv

C = 8
SPREAD = np.exp2(np.arange(C, dtype=np.float32) * 8 / (C - 1))  # 1 ... 2^8


def _conv(name, x, w, b, y, k=1):
    inputs = [x, w] if b is None else [x, w, b]
    return helper.make_node("Conv", inputs, [y], name=name, kernel_shape=[k, k], pads=[k // 2] * 4)


def _weights(seed: int = 0, spread: np.ndarray = SPREAD) -> dict[str, np.ndarray]:
    """Stream writers whose channels range ``spread`` apart (1 ... 2^8), readers' columns the
    inverse."""
    rng = np.random.default_rng(seed)
    col = spread.reshape(1, -1, 1, 1)
    row = spread.reshape(-1, 1, 1, 1)
    return {
        "w0": rng.standard_normal((C, 3, 3, 3)).astype(np.float32) * row,
        "b0": (rng.standard_normal(C) * spread).astype(np.float32),
        "we1": rng.standard_normal((2 * C, C, 1, 1)).astype(np.float32) / col,
        "wp1": rng.standard_normal((C, 2 * C, 1, 1)).astype(np.float32) * row / 4,
        "bp1": (rng.standard_normal(C) * spread / 4).astype(np.float32),
        "we2": rng.standard_normal((2 * C, C, 1, 1)).astype(np.float32) / col,
        "wp2": rng.standard_normal((C, 2 * C, 1, 1)).astype(np.float32) * row / 4,
        "wout": rng.standard_normal((4, C, 1, 1)).astype(np.float32) / col,
    }


def _stream_model(
    *, relu_after_add: bool = False, extra: str = "", spread: np.ndarray = SPREAD
) -> onnx.ModelProto:
    """MobileNetV2's shape: conv0 writes the stream v0; two blocks (expand, Relu, project) add
    to it (v1, v2); a 1x1 Conv reads v2 (output y). ``relu_after_add``: a Relu after each Add,
    as in a ResNet. ``extra``: "output" (v1 also a graph output), "sigmoid" (a Sigmoid also
    reads v1), "input" (the stream starts at the graph input: x + conv(x))."""
    nodes = [_conv("conv0", "x", "w0", "b0", "v0", k=3)]
    current = "v0"
    for i in (1, 2):
        bias = "bp1" if i == 1 else None
        nodes += [
            _conv(f"expand{i}", current, f"we{i}", None, f"e{i}"),
            helper.make_node("Relu", [f"e{i}"], [f"r{i}"], name=f"relu{i}"),
            _conv(f"project{i}", f"r{i}", f"wp{i}", bias, f"p{i}"),
        ]
        if relu_after_add:
            nodes.append(helper.make_node("Add", [current, f"p{i}"], [f"s{i}"], name=f"add{i}"))
            nodes.append(helper.make_node("Relu", [f"s{i}"], [f"v{i}"], name=f"relu_add{i}"))
        else:
            nodes.append(helper.make_node("Add", [current, f"p{i}"], [f"v{i}"], name=f"add{i}"))
        current = f"v{i}"
    nodes.append(_conv("out", "v2", "wout", None, "y"))
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])]
    weights = _weights(spread=spread)
    x_channels = 3
    if extra == "output":
        outputs.append(helper.make_tensor_value_info("v1", TensorProto.FLOAT, [1, C, 8, 8]))
    elif extra == "sigmoid":
        nodes.append(helper.make_node("Sigmoid", ["v1"], ["g"], name="sig"))
        outputs.append(helper.make_tensor_value_info("g", TensorProto.FLOAT, [1, C, 8, 8]))
    elif extra == "input":
        nodes[0] = helper.make_node("Identity", ["x"], ["v0"], name="stem")
        weights.pop("w0"), weights.pop("b0")
        x_channels = C
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, x_channels, 8, 8])]
    return onnx.shape_inference.infer_shapes(make_model(nodes, inputs, outputs, weights))


def _samples(model: onnx.ModelProto, n: int = 3) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(11)
    shape = [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    return [{"x": rng.standard_normal(shape).astype(np.float32)} for _ in range(n)]


def _apply(model: onnx.ModelProto, samples) -> tuple[onnx.ModelProto, bool]:
    result = EqualizeResidualStreams(samples)(ir.from_proto(model))
    out = ir.to_proto(result.model)
    onnx.checker.check_model(out)
    return out, result.modified


def _inits(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer}


def _values(model: onnx.ModelProto, names: list[str], samples) -> list[np.ndarray]:
    """Per-channel max |x| of the named values over the samples (numpy reference)."""
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    del probe.graph.output[:]
    probe.graph.output.extend(
        helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in names
    )
    peaks = np.zeros((len(names), C))
    for feed in samples:
        for i, value in enumerate(run_ort(probe, feed)):
            peaks[i] = np.maximum(peaks[i], np.abs(value).max(axis=(0, 2, 3)))
    return peaks


def _expected_scales(model: onnx.ModelProto, stream: list[str], samples) -> np.ndarray:
    """s = 2^k, k = round(log2 sqrt(r1 / r2)) minus the median's, within +-MAX_LOG2; r1 the
    largest |x| per channel of the stream's values (the Adds' inputs and outputs), r2 the
    readers' largest weight per input channel."""
    w = _weights()
    r1 = _values(model, stream, samples).max(axis=0)
    r2 = np.max([np.abs(w[n]).max(axis=(0, 2, 3)) for n in ("we1", "we2", "wout")], axis=0)
    k = np.round(0.5 * np.log2(r1 / r2))
    return np.exp2(np.clip(k - np.round(np.median(k)), -MAX_LOG2, MAX_LOG2))


def test_outputs_bit_identical_and_scales_exact():
    model = _stream_model()
    samples = _samples(model)
    out, modified = _apply(model, samples)
    assert modified
    for feed in _samples(model, 2):
        np.testing.assert_array_equal(run_ort(model, feed)[0], run_ort(out, feed)[0])
    s = _expected_scales(model, ["v0", "p1", "v1", "p2", "v2"], samples)
    assert s.min() < 1 < s.max()  # the case is not trivial
    w, new = _weights(), _inits(out)
    row, col = s.reshape(-1, 1, 1, 1).astype(np.float32), s.reshape(1, -1, 1, 1).astype(np.float32)
    np.testing.assert_array_equal(new["w0"], w["w0"] / row)
    np.testing.assert_array_equal(new["b0"], w["b0"] / s.astype(np.float32))
    np.testing.assert_array_equal(new["wp1"], w["wp1"] / row)
    np.testing.assert_array_equal(new["bp1"], w["bp1"] / s.astype(np.float32))
    np.testing.assert_array_equal(new["wp2"], w["wp2"] / row)
    for reader in ("we1", "we2", "wout"):
        np.testing.assert_array_equal(new[reader], w[reader] * col)
    # the stream's channel spread shrinks
    before = _values(model, ["v2"], samples)[0]
    after = _values(out, ["v2"], samples)[0]
    assert after.max() / after.min() < before.max() / before.min() / 4


def test_a_value_over_the_budget_is_sampled_at_a_fixed_count_of_positions(monkeypatch):
    monkeypatch.setattr(ers, "VALUE_BUDGET", 2 * C * 64)  # two whole 1 x C x 8 x 8 samples
    x = np.random.default_rng(5).standard_normal((1, C, 8, 8)).astype(np.float32)
    assert np.array_equal(ers._kept(x, 2, 0), x)  # within the budget: whole
    kept = ers._kept(x, 8, 3)  # 8 samples: 16 of the 64 positions of each
    assert kept.shape == (1, C, 1, 16)
    assert np.array_equal(kept, ers._kept(x, 8, 3))  # the same positions for the same sample
    flat = x.reshape(1, C, 64)
    where = [int(np.flatnonzero(flat[0, 0] == v)[0]) for v in kept[0, 0, 0]]
    assert len(set(where)) == 16 and where == sorted(where)
    np.testing.assert_array_equal(kept[..., 0, :], flat[..., where])  # every channel, same places


def test_sampled_values_keep_the_exact_ranges_and_the_same_scales(monkeypatch):
    """Over the budget only the noise prediction reads a sample of the positions: the scales
    come from every value's exact ``max |x|``, so this clear case comes out as it does whole."""
    model = _stream_model()
    samples = _samples(model)
    whole, modified = _apply(model, samples)
    assert modified
    monkeypatch.setattr(ers, "VALUE_BUDGET", 3 * C * 8)  # 8 of the 64 positions of each sample
    sampled, modified = _apply(model, samples)
    assert modified
    for name, array in _inits(whole).items():
        np.testing.assert_array_equal(_inits(sampled)[name], array)


def test_through_a_relu_after_each_add():
    model = _stream_model(relu_after_add=True)
    samples = _samples(model)
    out, modified = _apply(model, samples)
    assert modified
    for feed in samples:
        np.testing.assert_array_equal(run_ort(model, feed)[0], run_ort(out, feed)[0])
    # one stream: the projections, the Adds' sums and the Relus after them share the scales
    s = _expected_scales(model, ["v0", "p1", "s1", "v1", "p2", "s2", "v2"], samples)
    np.testing.assert_array_equal(
        _inits(out)["wout"], _weights()["wout"] * s.reshape(1, -1, 1, 1).astype(np.float32)
    )


def test_a_conv_that_reads_and_writes_the_stream():
    """v1 = v0 + conv(v0): the conv's columns are multiplied and its rows divided."""
    w = _weights()
    rng = np.random.default_rng(3)
    w["wq"] = rng.standard_normal((C, C, 1, 1)).astype(np.float32) * SPREAD.reshape(-1, 1, 1, 1)
    w["wq"] /= SPREAD.reshape(1, -1, 1, 1)
    nodes = [
        _conv("conv0", "x", "w0", "b0", "v0", k=3),
        _conv("both", "v0", "wq", None, "q"),
        helper.make_node("Add", ["v0", "q"], ["v1"], name="add"),
        _conv("out", "v1", "wout", None, "y"),
    ]
    model = onnx.shape_inference.infer_shapes(
        make_model(
            nodes,
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])],
            {k: w[k] for k in ("w0", "b0", "wq", "wout")},
        )
    )
    samples = _samples(model)
    out, modified = _apply(model, samples)
    assert modified
    for feed in samples:
        np.testing.assert_array_equal(run_ort(model, feed)[0], run_ort(out, feed)[0])
    r1 = _values(model, ["v0", "q", "v1"], samples).max(axis=0)
    r2 = np.max([np.abs(w[n]).max(axis=(0, 2, 3)) for n in ("wq", "wout")], axis=0)
    k = np.round(0.5 * np.log2(r1 / r2))
    s = np.exp2(np.clip(k - np.round(np.median(k)), -MAX_LOG2, MAX_LOG2)).astype(np.float32)
    assert s.min() < 1 < s.max()
    expected = w["wq"] * s.reshape(1, -1, 1, 1) / s.reshape(-1, 1, 1, 1)
    np.testing.assert_array_equal(_inits(out)["wq"], expected)


@pytest.mark.parametrize("extra", ["output", "sigmoid", "input"])
def test_does_not_fire_on_a_stream_it_cannot_rescale(extra):
    model = _stream_model(extra=extra)
    out, modified = _apply(model, _samples(model))
    assert not modified
    assert _inits(out).keys() == _inits(model).keys()
    for name, array in _inits(model).items():
        np.testing.assert_array_equal(_inits(out)[name], array)


def test_the_gate_leaves_a_nearly_balanced_stream_alone():
    """Channels within 2x of each other: the balancing rule still proposes scales (some 1/2,
    some 2), but they only move values across power-of-two grid points and the predicted noise
    does not halve, so nothing changes."""
    model = _stream_model(spread=np.linspace(1.0, 2.0, C).astype(np.float32))
    samples = _samples(model)
    w = _weights(spread=np.linspace(1.0, 2.0, C).astype(np.float32))
    r1 = _values(model, ["v0", "p1", "v1", "p2", "v2"], samples).max(axis=0)
    r2 = np.max([np.abs(w[n]).max(axis=(0, 2, 3)) for n in ("we1", "we2", "wout")], axis=0)
    k = np.round(0.5 * np.log2(r1 / r2))
    assert np.any(k - np.round(np.median(k)) != 0)  # scales were proposed
    out, modified = _apply(model, samples)
    assert not modified
    for name, array in _inits(model).items():
        np.testing.assert_array_equal(_inits(out)[name], array)


def test_does_not_fire_without_samples_or_on_a_bias_add():
    model = _stream_model()
    assert not _apply(model, None)[1]
    bias_add = make_model(
        [
            _conv("conv0", "x", "w0", "b0", "v0", k=3),
            helper.make_node("Add", ["v0", "k"], ["v1"], name="add"),
            _conv("out", "v1", "wout", None, "y"),
        ],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])],
        {**{k: _weights()[k] for k in ("w0", "b0", "wout")}, "k": np.ones((1, C, 1, 1), "f")},
    )
    assert not _apply(bias_add, _samples(bias_add))[1]


@pytest.mark.real_model
def test_mobilenetv2_rescaled_streams_are_restored_and_the_original_left_alone():
    """MobileNetV2 with its five residual streams rescaled 1/100 ... 100 per channel (the
    stress variant): every stream is equalized, bit-identically; on the original the gate
    predicts less than half the noise nowhere and nothing changes."""
    path = shared_path("models", "mobilenetv2_rebuilt.onnx")
    original = onnx.shape_inference.infer_shapes(onnx.load(str(path)))
    variant = onnx.ModelProto()
    variant.CopyFrom(original)
    assert msv.rescale_streams(variant, np.random.default_rng(0)) == {"rescaled_streams": 5}
    rng = np.random.default_rng(0)
    samples = [{"input": rng.standard_normal((1, 3, 224, 224)).astype(np.float32)}]
    pass_ = EqualizeResidualStreams(samples)
    result = pass_(ir.from_proto(variant))
    assert result.modified
    assert sorted(c for _, c, _, _ in pass_.report) == [24, 32, 64, 96, 160]
    out = ir.to_proto(result.model)
    np.testing.assert_array_equal(run_ort(variant, samples[0])[0], run_ort(out, samples[0])[0])
    assert not EqualizeResidualStreams(samples)(ir.from_proto(original)).modified
