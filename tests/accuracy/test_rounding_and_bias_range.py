"""Second-order (GPTQ) rounding and bias positions moved by bias correction.

Oracles: a plain numpy OBQ loop (one column at a time, the inverse Hessian updated by removing
the quantized column), brute force over positions, and errors measured on held-out samples
the stages never saw.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import onnx
import pytest
from conftest import make_model
from onnx import TensorProto, helper
from test_accuracy_stages import _conv_chain, _outputs, _quantize, _samples

from quark_onnx.accuracy.adaround import GPTQ_BLOCK, AdaRoundSettings, adaround, gptq_rounding
from quark_onnx.accuracy.bias_correction import (
    best_bias_position,
    bias_window,
    channel_sums,
    correct_bias,
)
from quark_onnx.accuracy.layers import find_layers, set_codes
from quark_onnx.config.options import ExtraOptions
from quark_onnx.errors import ConfigError
from quark_onnx.model_files.load import to_proto
from quark_onnx.npu.readiness import check


def _obq_reference(w: np.ndarray, step: float, gram: np.ndarray, cross: np.ndarray) -> np.ndarray:
    """One group: start from ``W* = C^T G^-1``, quantize column j, spread its error with the
    inverse Hessian, then remove column j from the inverse (Frantar & Alistarh's OBQ update)."""
    h_inv = np.linalg.inv(gram)
    work = (h_inv @ cross).T.copy()
    codes = np.zeros_like(work)
    for j in range(work.shape[1]):
        q = np.clip(np.rint(work[:, j] / step), -128, 127)
        err = (work[:, j] - q * step) / h_inv[j, j]
        work[:, j + 1 :] -= np.outer(err, h_inv[j, j + 1 :])
        h_inv = h_inv - np.outer(h_inv[:, j], h_inv[j, :]) / h_inv[j, j]
        codes[:, j] = q
    return codes


def _correlated_layer(rng: np.random.Generator, groups: int = 1):
    w = rng.normal(0, 0.5, (groups, 8, 16))
    gram, cross = [], []
    for g in range(groups):
        z = rng.normal(0, 1, (4, 400))  # correlated inputs: what joint rounding can exploit
        x = rng.normal(0, 1, (16, 4)) @ z + 0.1 * rng.normal(0, 1, (16, 400))
        t = w[g] @ x
        gram.append(x @ x.T)
        cross.append(x @ t.T)
    return w, np.stack(gram), np.stack(cross)


def test_gptq_rounding_matches_the_obq_reference_and_beats_nearest():
    rng = np.random.default_rng(11)
    w, gram, cross = _correlated_layer(rng)
    res = gptq_rounding(w, 4, gram, cross)
    assert np.array_equal(res.codes[0], _obq_reference(w[0], 1 / 16, gram[0], cross[0]))
    assert res.accepted and res.loss_learned < 0.5 * res.loss_nearest
    assert res.codes.dtype == np.int8


def test_gptq_rounding_across_blocks_matches_the_obq_reference():
    """More columns than one lazy-update block (GPTQ_BLOCK): the same codes as the reference."""
    rng = np.random.default_rng(18)
    k = GPTQ_BLOCK * 2 + 44
    w = rng.normal(0, 0.5, (1, 12, k))
    x = rng.normal(0, 1, (k, 40)) @ rng.normal(0, 1, (40, 2000))
    x += 0.3 * rng.normal(0, 1, x.shape)
    gram, cross = (x @ x.T)[None], (x @ (w[0] @ x).T)[None]
    res = gptq_rounding(w, 4, gram, cross)
    assert np.array_equal(res.codes[0], _obq_reference(w[0], 1 / 16, gram[0], cross[0]))
    assert res.accepted


def test_gptq_rounding_batches_groups_exactly_as_one_at_a_time():
    rng = np.random.default_rng(12)
    w, gram, cross = _correlated_layer(rng, groups=3)
    res = gptq_rounding(w, 4, gram, cross)
    for g in range(3):
        alone = gptq_rounding(w[g : g + 1], 4, gram[g : g + 1], cross[g : g + 1])
        assert np.array_equal(res.codes[g], alone.codes[0])


def test_gptq_rounding_keeps_nearest_when_it_is_not_better():
    """Uncorrelated unit inputs: the loss is the weights' own error, which nearest minimises."""
    w = np.array([[[0.30, -0.70, 0.12]]])
    gram = np.eye(3)[None] * 10
    cross = np.swapaxes(w, 1, 2) * 10
    res = gptq_rounding(w, 4, gram, cross)
    assert not res.accepted
    assert np.array_equal(res.codes, np.rint(w * 16).astype(np.int8))


def test_gptq_rounding_saturates_out_of_range_weights():
    w = np.array([[[10.0, -10.0, 0.3]]])  # at p=4: 160 and -160 are outside int8
    gram = np.eye(3)[None] + 0.5
    cross = np.swapaxes(w @ gram[0], 1, 2)
    res = gptq_rounding(w, 4, gram, cross)
    assert res.codes.min() >= -128 and res.codes.max() <= 127


def _pointwise_chain(rng: np.random.Generator, side: int = 6) -> onnx.ModelProto:
    """x (1,4,side,side) -> Conv 1x1 -> Relu -> Conv 1x1 -> y; weights off the int8 grid."""
    k = {"kernel_shape": [1, 1], "pads": [0, 0, 0, 0], "strides": [1, 1]}
    shape = [1, 4, side, side]
    return make_model(
        [
            helper.make_node("Conv", ["x", "w0", "b0"], ["c0"], name="conv0", **k),
            helper.make_node("Relu", ["c0"], ["r0"], name="relu0"),
            helper.make_node("Conv", ["r0", "w1", "b1"], ["y"], name="conv1", **k),
        ],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)],
        {
            "w0": rng.normal(0, 0.5, (4, 4, 1, 1)).astype(np.float32),
            "b0": rng.normal(0, 0.1, 4).astype(np.float32),
            "w1": rng.normal(0, 0.5, (4, 4, 1, 1)).astype(np.float32),
            "b1": rng.normal(0, 0.1, 4).astype(np.float32),
        },
    )


def _tied_samples(rng: np.random.Generator, n: int, sign: float, side: int = 6) -> list[dict]:
    """Input channel 1 = ``sign`` x channel 0: rounding may trade one's error for the other's."""
    out = []
    for _ in range(n):
        x = rng.normal(0, 1, (1, 4, side, side))
        x[:, 1] = sign * x[:, 0] + 0.01 * rng.normal(0, 1, (1, side, side))
        out.append({"x": x.astype(np.float32)})
    return out


@pytest.mark.parametrize("held_out_sign, kept", [(1.0, True), (-1.0, False)])
def test_gptq_is_kept_only_where_it_helps_held_out_samples(held_out_sign, kept):
    """Fitted on samples whose first two inputs are equal, second-order rounding moves the
    first's rounding error onto the second. On held-out samples where they are opposite that
    doubles the error instead of cancelling it: the layer must stay rounded to nearest."""
    rng = np.random.default_rng(13)
    proto = _pointwise_chain(rng)
    fit = _tied_samples(rng, 8, 1.0)
    held = _tied_samples(rng, 8, held_out_sign)
    prepared, model, plan, positions, _ = _quantize(proto, fit + held)
    nearest = find_layers(model)[0][0].weight_codes.copy()
    options = ExtraOptions(FastFinetune={"OptimAlgorithm": "gptq"})
    summary = adaround(prepared, model, fit + held, plan, positions, options)
    first = summary["per_layer"][0]
    assert first["node"] == "conv0" and first["loss_learned"] < first["loss_nearest"]
    assert first["accepted"] is kept
    assert (first["held_out_loss_learned"] < first["held_out_loss_nearest"]) is kept
    codes = find_layers(model)[0][0].weight_codes
    assert np.array_equal(codes, nearest) is not kept


def test_optim_algorithm_is_validated():
    assert AdaRoundSettings.from_options({"OptimAlgorithm": "gptq"}).OptimAlgorithm == "gptq"
    with pytest.raises(ConfigError, match="OptimAlgorithm.*'adaround', 'gptq'"):
        AdaRoundSettings.from_options({"OptimAlgorithm": "obq"})


# --- bias positions ------------------------------------------------------------------------------


def test_best_bias_position_is_the_least_squared_error_in_the_window():
    rng = np.random.default_rng(14)
    target = rng.normal(0, 0.3, 16)
    target[0] = 3.0  # needs a coarse position to fit int8

    def error(p: int) -> float:
        q = np.clip(np.rint(target * 2.0**p), -128, 127) * 2.0**-p
        return float(np.sum((target - q) ** 2))

    for window in [(-3, 12), (7, 12), (0, 4)]:
        brute = min(range(window[0], window[1] + 1), key=lambda p: (error(p), -p))
        assert best_bias_position(target, 12, window, np.dtype(np.int8)) == brute
    # a tie keeps the current position: an all-zero target is exact everywhere
    assert best_bias_position(np.zeros(4), 6, (2, 9), np.dtype(np.int8)) == 6


def test_bias_window_is_the_shift_bias_rule():
    rng = np.random.default_rng(15)
    _, _, plan, positions, _ = _quantize(_conv_chain(rng), _samples(rng, 4))
    node = next(n for n in plan.nodes if n.name == "conv0")
    low, high = bias_window(node, positions)
    acc = positions[node.weight] + positions[node.inputs[0]]
    shift_cut = acc - positions[node.output]
    assert low == acc - 15
    assert high == acc - min(0, -(24 - (8 + shift_cut)))


def _tiny_bias_chain(rng: np.random.Generator) -> onnx.ModelProto:
    """Biases of 0.002: their int8 position is fine (2^-15), far too narrow for the mean shift
    that per-tensor weights with one wide channel leave."""
    proto = _conv_chain(rng, n=2)
    for init in proto.graph.initializer:
        if init.name.startswith("b"):
            value = (np.full(4, 0.002) * [1, -1, 1, -1]).astype(np.float32)
            init.CopyFrom(onnx.numpy_helper.from_array(value, init.name))
    return proto


@pytest.mark.parametrize("adjust", [True, False])
def test_bias_correction_moves_a_saturating_bias_inside_its_shift_bias_window(adjust):
    rng = np.random.default_rng(2)
    proto = _tiny_bias_chain(rng)
    calib = _samples(rng, 16, offset=0.5)
    held = _samples(rng, 16, offset=0.5)
    prepared, model, plan, positions, options = _quantize(proto, calib)
    options = dataclasses.replace(options, AdjustShiftBias=adjust, BiasCorrectionMovePositions=True)
    before = {n.name: bias_window(n, positions) for n in plan.nodes if n.bias}
    original = {layer.name: layer.bias_position for layer in find_layers(model)[0]}

    def mean_error(quant_proto) -> float:
        d = [_outputs(prepared, s, ["c0"])[0] - _outputs(quant_proto, s, ["c0"])[0] for s in held]
        return float(np.mean(np.abs(np.mean(np.stack(d), axis=(0, 1, 3, 4)))))

    error_before = mean_error(to_proto(model))
    summary = correct_bias(prepared, model, calib, plan, positions, options)
    after = to_proto(model)
    layers = find_layers(model)[0]
    if not adjust:  # the bias position is not ours to move: the correction saturates
        assert summary["moved_bias_positions"] == {} and summary["saturated"] > 0
        assert {layer.name: layer.bias_position for layer in layers} == original
        assert mean_error(after) > 0.5 * error_before
        return
    assert summary["moved_bias_positions"] and summary["saturated"] == 0
    for layer in layers:
        node = next(n for n in plan.nodes if n.name == layer.name)
        low, high = before[layer.name]
        assert low <= layer.bias_position <= high  # shift_bias still holds
        # the graph's bias scale and the solved positions agree
        assert positions[node.bias] == layer.bias_position
        dq = layer.bias.uses()[0].node
        assert dq.inputs[1].const_value.numpy().item() == math.ldexp(1.0, -layer.bias_position)
    assert mean_error(after) < 0.5 * error_before
    assert check(after).ready, check(after).summary()


@pytest.mark.parametrize("bounds", [None, (0.0, math.inf), (0.0, 6.0)])
def test_channel_sums_count_only_errors_the_activation_keeps(bounds):
    rng = np.random.default_rng(16)
    f = rng.normal(3, 4, (2, 3, 5, 5)).astype(np.float32)
    q = (f + rng.normal(0.2, 0.5, f.shape)).astype(np.float32)
    num, den = channel_sums(f, q, bounds)
    for c in range(3):
        fc, qc = f[:, c].ravel().astype(np.float64), q[:, c].ravel().astype(np.float64)
        if bounds is None:
            keep = np.ones(fc.size, bool)
        else:  # the error survives the activation unless both sides are cut off the same way
            lo, hi = bounds
            keep = ~(((fc <= lo) & (qc <= lo)) | ((fc >= hi) & (qc >= hi)))
        assert den[c] == np.count_nonzero(keep)
        assert num[c] == pytest.approx(np.sum((fc - qc)[keep]), rel=1e-5)


def _with_activation(proto: onnx.ModelProto, op: str) -> onnx.ModelProto:
    """``_conv_chain`` with its first Relu replaced by ``op`` (Clip(0, 6) or Sigmoid)."""
    out = onnx.ModelProto()
    out.CopyFrom(proto)
    node = next(n for n in out.graph.node if n.name == "relu0")
    if op == "Clip":
        out.graph.initializer.extend(
            [
                onnx.numpy_helper.from_array(np.array(0.0, np.float32), "lo"),
                onnx.numpy_helper.from_array(np.array(6.0, np.float32), "hi"),
            ]
        )
        node.CopyFrom(helper.make_node("Clip", [node.input[0], "lo", "hi"], node.output, "clip0"))
    else:
        node.CopyFrom(helper.make_node(op, [node.input[0]], node.output, name="act0"))
    return out


@pytest.mark.parametrize(
    "op, seed_options, bounds",
    [
        ("Relu", False, (0.0, math.inf)),
        ("Clip", False, (0.0, 6.0)),
        ("Clip", True, (0.0, 6.0)),  # a Q/DQ pair kept between the layer and its activation
        ("Sigmoid", False, None),
    ],
)
def test_activation_bounds_follow_the_layers_activation(op, seed_options, bounds):
    from quark_onnx.accuracy.bias_correction import _activation_bounds

    rng = np.random.default_rng(17)
    proto = _conv_chain(rng)
    if op != "Relu":
        proto = _with_activation(proto, op)
    extra = {"RemoveQDQConvClip": False, "RemoveQDQConvRelu": False} if seed_options else {}
    _, model, _, _, _ = _quantize(proto, _samples(rng, 4), **extra)
    layer = next(layer for layer in find_layers(model)[0] if layer.name == "conv0")
    reader = layer.node.outputs[0].uses()[0].node.op_type
    # a Sigmoid is not fused into the layer: its input is quantized like a kept pair's
    assert reader == ("QuantizeLinear" if seed_options or op == "Sigmoid" else op)
    assert _activation_bounds(layer) == bounds


# --- second-order rounding inside bias correction's walk ----------------------------------------


def _wide_pointwise_chain(rng: np.random.Generator) -> onnx.ModelProto:
    """144 positions per sample, so 8 fitted samples offer more than GPTQ_POSITIONS_PER_INPUT
    per input (K = 4)."""
    return _pointwise_chain(rng, side=12)


def _wide_tied_samples(rng: np.random.Generator, n: int, sign: float) -> list[dict]:
    return _tied_samples(rng, n, sign, side=12)


GPTQ = AdaRoundSettings(OptimAlgorithm="gptq")


@pytest.mark.parametrize("held_out_sign, kept", [(1.0, True), (-1.0, False)])
def test_rounding_in_the_bias_walk_is_kept_only_where_it_helps_held_out_samples(
    held_out_sign, kept
):
    """The held-out gate of the separate stage holds in the shared walk: fitted on equal first
    two inputs, judged on opposite ones, the first layer must stay rounded to nearest."""
    rng = np.random.default_rng(13)
    proto = _wide_pointwise_chain(rng)
    samples = _wide_tied_samples(rng, 8, 1.0) + _wide_tied_samples(rng, 8, held_out_sign)
    prepared, model, plan, positions, _ = _quantize(proto, samples)
    nearest = find_layers(model)[0][0].weight_codes.copy()
    summary = correct_bias(prepared, model, samples, plan, positions, ExtraOptions(), GPTQ)
    first = summary["rounding"]["per_layer"][0]
    assert first["node"] == "conv0" and first["loss_learned"] < first["loss_nearest"]
    assert abs(first["fitted_positions"] - 4 * 100) <= 40  # about 100 per input, not all 1152
    assert first["accepted"] is kept
    codes = find_layers(model)[0][0].weight_codes
    assert np.array_equal(codes, nearest) is not kept


def test_bias_is_corrected_for_the_rounded_weights():
    """Rounding then correcting in one walk gives the biases that correcting a model already
    holding the rounded weights gives: the correction measures the rounded layer, on the
    inputs its rounded predecessors produce. The weights stay int8 at their positions."""
    rng = np.random.default_rng(13)
    proto = _wide_pointwise_chain(rng)
    samples = _wide_tied_samples(rng, 16, 1.0)
    prepared, model, plan, positions, _ = _quantize(proto, samples)
    before = {lay.name: (lay.weight_position, lay.bias_position) for lay in find_layers(model)[0]}
    summary = correct_bias(prepared, model, samples, plan, positions, ExtraOptions(), GPTQ)
    assert summary["rounding"]["accepted"] >= 1
    layers = find_layers(model)[0]
    assert {lay.name: (lay.weight_position, lay.bias_position) for lay in layers} == before
    for lay in layers:
        assert lay.weight_codes.dtype == np.int8
    # the oracle: a fresh quantized model given the rounded weights, then plain bias correction
    prepared2, model2, plan2, positions2, _ = _quantize(proto, samples)
    for lay, lay2 in zip(layers, find_layers(model2)[0], strict=True):
        set_codes(lay2.weight, lay.weight_codes.copy())
    correct_bias(prepared2, model2, samples, plan2, positions2, ExtraOptions())
    for lay, lay2 in zip(layers, find_layers(model2)[0], strict=True):
        assert np.array_equal(lay.bias_codes, lay2.bias_codes), lay.name


def test_rounding_skips_layers_with_too_few_positions():
    """6x6 outputs, 8 fitted samples: 288 positions for 4 inputs, below 100 per input: the
    layers stay rounded to nearest and the report says why."""
    rng = np.random.default_rng(13)
    proto = _pointwise_chain(rng)
    samples = _tied_samples(rng, 16, 1.0)
    prepared, model, plan, positions, _ = _quantize(proto, samples)
    nearest = [lay.weight_codes.copy() for lay in find_layers(model)[0]]
    summary = correct_bias(prepared, model, samples, plan, positions, ExtraOptions(), GPTQ)
    assert summary["rounding"]["layers"] == 0
    assert [s["reason"] for s in summary["rounding"]["skipped"]] == [
        "288 positions for 4 inputs"
    ] * 2
    for lay, codes in zip(find_layers(model)[0], nearest, strict=True):
        assert np.array_equal(lay.weight_codes, codes)


@pytest.mark.parametrize("target", ["float", "weights", "debiased"])
def test_xint8_rounds_inside_bias_correction(tmp_path, target):
    """XINT8 with second-order rounding, whatever its target: it runs in bias correction's walk
    (no separate stage, no second replay); the quantized model stays NPU-ready."""
    from quark_onnx import ArrayDataReader, Config, ModelQuantizer, get_default_config

    rng = np.random.default_rng(22)
    proto = _wide_pointwise_chain(rng)
    src, out = tmp_path / "m.onnx", tmp_path / "q.onnx"
    onnx.save(proto, src)
    samples = _wide_tied_samples(rng, 16, 1.0)
    qc = get_default_config("XINT8")
    qc.include_fast_ft = True
    qc.extra_options["FastFinetune"] = {"OptimAlgorithm": "gptq", "Target": target}
    quantizer = ModelQuantizer(Config(global_quant_config=qc))
    quantizer.quantize_model(str(src), str(out), ArrayDataReader(samples))
    report = quantizer.report
    assert "adaround" not in report.timings
    assert report.adaround["shared_walk"] and report.adaround["layers"] == 2
    assert report.adaround["settings"]["Target"] == target
    assert "rounding" not in report.bias_correction
    assert check(onnx.load(out)).ready


def test_rounding_in_the_bias_walk_needs_every_held_out_group_to_gain():
    """Held-out samples in two groups: the first (tied like the fitted ones) gains more than the
    second (a weak opposite tie) loses. The sum alone would keep the rounding; a gain one group
    alone carries is not taken to generalise, so the layer stays rounded to nearest."""
    rng = np.random.default_rng(13)
    proto = _wide_pointwise_chain(rng)
    fit = _wide_tied_samples(rng, 12, 1.0)
    samples = fit + _wide_tied_samples(rng, 6, 1.0) + _wide_tied_samples(rng, 6, -0.25)
    prepared, model, plan, positions, _ = _quantize(proto, samples)
    nearest = find_layers(model)[0][0].weight_codes.copy()
    summary = correct_bias(prepared, model, samples, plan, positions, ExtraOptions(), GPTQ)
    first = summary["rounding"]["per_layer"][0]
    assert first["node"] == "conv0"
    assert first["held_out_loss_learned"] < first["held_out_loss_nearest"]  # the sum gains
    assert first["accepted"] is False
    assert np.array_equal(find_layers(model)[0][0].weight_codes, nearest)


@pytest.mark.parametrize(
    "group, stride, dilation, pads", [(1, 1, 1, 1), (2, 2, 1, 0), (4, 1, 2, 2)]
)
def test_im2col_of_every_kth_position_is_those_columns_of_the_full_im2col(
    group, stride, dilation, pads
):
    """The statistics gather only the positions they keep: the same columns, exactly."""
    from quark_onnx.accuracy.layer_statistics import _Geometry, im2col

    x = np.random.default_rng(23).normal(size=(2, 4, 9, 7)).astype(np.float32)
    geo = _Geometry(group, (3, 3), (stride, stride), (dilation, dilation), (pads,) * 4)
    full = im2col(x, geo)
    g, k, np_ = full.shape
    per = full.reshape(g, k, 2, np_ // 2)
    for every in (2, 3, 5):
        want = per[:, :, :, ::every].reshape(g, k, -1)
        assert np.array_equal(im2col(x, geo, every), want)
