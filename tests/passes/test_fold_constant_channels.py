"""FoldConstantChannels: constant channels folded exactly through each op path, and where not."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from conftest import make_model, run_ort, shared_path
from onnx import TensorProto, helper

from quark_onnx.errors import ConfigError
from quark_onnx.passes import FoldConstantChannels

RTOL = 1e-5  # max |new - old| / max |old| over the model's outputs
C = 6  # channels of the producer conv
CONST = (1, 4)  # channels made constant: 1 has a negative bias (dead after Relu), 4 positive


def _rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def _conv(name, x, w, b, y, group=1, k=3, pad=None):
    pad = k // 2 if pad is None else pad
    inputs = [x, w] if b is None else [x, w, b]
    return helper.make_node(
        "Conv",
        inputs,
        [y],
        name=name,
        kernel_shape=[k, k],
        pads=[pad] * 4,
        strides=[1, 1],
        dilations=[1, 1],
        group=group,
    )


def _producer(rng, scale: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """Conv A weight/bias with channels CONST at ``scale`` (0: exactly zero) times a unit draw."""
    wa = rng.standard_normal((C, 3, 3, 3)).astype(np.float32)
    ba = (rng.standard_normal(C) * 0.3).astype(np.float32)
    for c in CONST:
        wa[c] *= scale
    ba[CONST[0]] = -0.7
    ba[CONST[1]] = 0.9
    return wa, ba


def _consumer(rng, c_out=5, c_in=C, k=1, boost=100.0) -> np.ndarray:
    """Conv B weight whose columns reading CONST are ``boost`` times larger (never decayed)."""
    wb = rng.standard_normal((c_out, c_in, k, k)).astype(np.float32)
    for c in CONST:
        wb[:, c] *= boost
    return wb


def _out(name: str) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, ["n", "c", "h", "w"])


def _chain(act_nodes, scale=0.0, k=1, extra=None, hw=8, seed=0, boost=100.0):
    """x -> Conv A -> act_nodes ('a' -> 'h') -> Conv B (k x k) -> y."""
    rng = _rng(seed)
    wa, ba = _producer(rng, scale)
    inits = {**(extra or {}), "wa": wa, "ba": ba, "wb": _consumer(rng, k=k, boost=boost)}
    inits["bb"] = rng.standard_normal(5).astype(np.float32)
    nodes = [_conv("A", "x", "wa", "ba", "a"), *act_nodes]
    nodes.append(_conv("B", "h" if act_nodes else "a", "wb", "bb", "y", k=k))
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, hw, hw])
    y = _out("y")
    return make_model(nodes, [x], [y], inits)


def _feeds(model: onnx.ModelProto, seed: int = 1) -> dict[str, np.ndarray]:
    inp = model.graph.input[0]
    shape = [d.dim_value for d in inp.type.tensor_type.shape.dim]
    return {inp.name: _rng(seed).standard_normal(shape).astype(np.float32)}


def _apply(model: onnx.ModelProto, **options):
    ir_model = ir.from_proto(model)
    fold = FoldConstantChannels(**options)
    result = fold(ir_model)
    out = ir.to_proto(result.model)
    onnx.checker.check_model(out)
    return out, fold, result.modified


def _assert_same_outputs(a, b, feeds=None, rtol=RTOL) -> None:
    feeds = feeds or _feeds(a)
    for ref, got in zip(run_ort(a, feeds), run_ort(b, feeds), strict=True):
        rel = np.abs(got.astype(np.float64) - ref).max() / np.abs(ref).max()
        assert rel <= rtol, rel


def _weight(model: onnx.ModelProto, node_name: str, index: int = 1) -> np.ndarray:
    node = next(n for n in model.graph.node if n.name == node_name)
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    return inits[node.input[index]]


def _assert_folded(model, out, consumer="B", channels=CONST):
    wb = _weight(out, consumer)
    for c in channels:
        assert not np.any(wb[:, c]), f"column {c} of {consumer} not zeroed"
        assert not np.any(_weight(out, "A")[c]), f"channel {c} of A not zeroed"
    others = [c for c in range(wb.shape[1]) if c not in channels]
    np.testing.assert_array_equal(wb[:, others], _weight(model, consumer)[:, others])


# --------------------------------------------------------------------------- it fires, exactly


ACTS = {
    "relu": lambda: ([helper.make_node("Relu", ["a"], ["h"])], {}),
    "relu6": lambda: (
        [helper.make_node("Clip", ["a", "lo", "hi"], ["h"])],
        {"lo": np.float32(0), "hi": np.float32(6)},
    ),
    "leaky": lambda: ([helper.make_node("LeakyRelu", ["a"], ["h"], alpha=0.1)], {}),
    "prelu": lambda: (
        [helper.make_node("PRelu", ["a", "slope"], ["h"])],
        {"slope": np.linspace(-0.5, 0.5, C, dtype=np.float32).reshape(C, 1, 1)},
    ),
    "maxpool": lambda: (
        [
            helper.make_node("Relu", ["a"], ["r"]),
            helper.make_node(
                "MaxPool", ["r"], ["h"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], strides=[2, 2]
            ),
        ],
        {},
    ),
    "avgpool": lambda: (
        [
            helper.make_node(
                "AveragePool", ["a"], ["h"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]
            ),  # count_include_pad = 0: windows average copies of the constant
        ],
        {},
    ),
    "batchnorm": lambda: (
        [helper.make_node("BatchNormalization", ["a", "g", "be", "mu", "var"], ["h"])],
        {
            "g": np.linspace(0.5, 2, C, dtype=np.float32),
            "be": np.linspace(-1, 1, C, dtype=np.float32),
            "mu": np.linspace(-0.2, 0.3, C, dtype=np.float32),
            "var": np.linspace(0.5, 1.5, C, dtype=np.float32),
        },
    ),
}


@pytest.mark.parametrize("scale", [0.0, 1e-8], ids=["zero", "negligible"])
@pytest.mark.parametrize("act", sorted(ACTS))
def test_constant_channel_folded_through(act, scale):
    nodes, extra = ACTS[act]()
    model = _chain(nodes, scale=scale, extra=extra)
    out, fold, modified = _apply(model)
    assert modified
    _assert_same_outputs(model, out)
    _assert_folded(model, out)
    assert sorted(f.channel for f in fold.report.folded) == list(CONST)
    assert all(f.kind == ("negligible" if scale else "zero") for f in fold.report.folded)


def test_fold_arithmetic_is_the_constant_times_the_column_sum():
    nodes, _ = ACTS["relu"]()
    model = _chain(nodes)
    out, _, _ = _apply(model)
    wb, bb = _weight(model, "B"), _weight(model, "B", 2).astype(np.float64)
    # channel 1 is Relu(-0.7) = 0 (dead: nothing added), channel 4 is Relu(0.9) = 0.9
    expected = bb + np.float32(0.9) * wb[:, 4].reshape(5, -1).sum(axis=1, dtype=np.float64)
    np.testing.assert_allclose(_weight(out, "B", 2), expected, rtol=1e-6)


def test_consumer_without_bias_gets_one():
    nodes, _ = ACTS["relu"]()
    model = _chain(nodes)
    b_node = next(n for n in model.graph.node if n.name == "B")
    del b_node.input[2]
    out, _, modified = _apply(model)
    assert modified and len(next(n for n in out.graph.node if n.name == "B").input) == 3
    _assert_same_outputs(model, out)


def _dw_chain(pad: int, scale: float = 0.0):
    """x -> A -> Relu -> depthwise 3x3 (pad) -> Relu -> B 1x1 -> y."""
    rng = _rng(3)
    wa, ba = _producer(rng, scale)
    wd = rng.standard_normal((C, 1, 3, 3)).astype(np.float32)
    for c in CONST:
        wd[c] *= 100  # the depthwise layer's outliers read the constant channels
    inits = {
        "wa": wa,
        "ba": ba,
        "wd": wd,
        "bd": rng.standard_normal(C).astype(np.float32),
        "wb": _consumer(rng, boost=1.0),
        "bb": rng.standard_normal(5).astype(np.float32),
    }
    nodes = [
        _conv("A", "x", "wa", "ba", "a"),
        helper.make_node("Relu", ["a"], ["r"]),
        _conv("D", "r", "wd", "bd", "d", group=C, pad=pad),
        helper.make_node("Relu", ["d"], ["h"]),
        _conv("B", "h", "wb", "bb", "y", k=1),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 8, 8])
    y = _out("y")
    return make_model(nodes, [x], [y], inits)


@pytest.mark.parametrize("scale", [0.0, 1e-8], ids=["zero", "negligible"])
def test_through_unpadded_depthwise_both_channels(scale):
    model = _dw_chain(pad=0, scale=scale)
    out, _, modified = _apply(model)
    assert modified
    _assert_same_outputs(model, out)
    wd = _weight(out, "D")
    for c in CONST:  # the depthwise outliers are gone: their channel is a constant bias now
        assert not np.any(wd[c])
    _assert_folded(model, out)
    assert np.abs(wd).max() < 10


def test_padded_depthwise_folds_only_the_dead_channel():
    model = _dw_chain(pad=1)
    out, fold, modified = _apply(model)
    assert modified
    _assert_same_outputs(model, out)
    wd = _weight(out, "D")
    assert not np.any(wd[CONST[0]])  # dead (0): padding reads 0 too, exact
    np.testing.assert_array_equal(wd[CONST[1]], _weight(model, "D")[CONST[1]])  # 0.9: kept
    assert not np.any(_weight(out, "B")[:, CONST[0]])
    assert [f.channel for f in fold.report.folded] == [CONST[0]]
    assert f"A[{CONST[1]}]" in fold.report.kept


def test_negligible_channel_into_padded_depthwise_is_left_alone():
    model = _dw_chain(pad=1, scale=1e-8)
    out, _, _ = _apply(model)
    _assert_same_outputs(model, out)
    # the dead channel is folded (exact everywhere); the constant 0.9 one cannot be: kept whole
    assert np.any(_weight(out, "A")[CONST[1]])
    np.testing.assert_array_equal(_weight(out, "D")[CONST[1]], _weight(model, "D")[CONST[1]])


def test_global_pool_flatten_gemm():
    rng = _rng(5)
    wa, ba = _producer(rng)
    wg = rng.standard_normal((7, C)).astype(np.float32)
    wg[:, CONST[1]] *= 100
    inits = {"wa": wa, "ba": ba, "wg": wg, "bg": rng.standard_normal(7).astype(np.float32)}
    nodes = [
        _conv("A", "x", "wa", "ba", "a"),
        helper.make_node("Relu", ["a"], ["r"]),
        helper.make_node("GlobalAveragePool", ["r"], ["p"]),
        helper.make_node("Flatten", ["p"], ["f"], axis=1),
        helper.make_node("Gemm", ["f", "wg", "bg"], ["y"], name="G", transB=1, alpha=0.5),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 8, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", "k"])
    model = make_model(nodes, [x], [y], inits)
    out, _, modified = _apply(model)
    assert modified
    _assert_same_outputs(model, out)
    assert not np.any(_weight(out, "G")[:, list(CONST)])


def test_concat_moves_the_channel_to_its_offset():
    rng = _rng(6)
    wa, ba = _producer(rng)
    inits = {
        "wa": wa,
        "ba": ba,
        "wc": rng.standard_normal((4, 3, 3, 3)).astype(np.float32),
        "wb": rng.standard_normal((5, 4 + C, 1, 1)).astype(np.float32) * 3,
    }
    nodes = [
        _conv("A", "x", "wa", "ba", "a"),
        _conv("K", "x", "wc", None, "k"),
        helper.make_node("Concat", ["k", "a"], ["c"], axis=1),
        helper.make_node("Relu", ["c"], ["h"]),
        _conv("B", "h", "wb", None, "y", k=1),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 8, 8])
    y = _out("y")
    model = onnx.shape_inference.infer_shapes(make_model(nodes, [x], [y], inits))
    out, _, modified = _apply(model)
    assert modified
    _assert_same_outputs(model, out)
    wb = _weight(out, "B")
    assert not np.any(wb[:, [4 + c for c in CONST]])
    assert np.all(wb[:, :4] == _weight(model, "B")[:, :4])


# --------------------------------------------------------------------------- must not fire


def test_small_but_not_negligible_channel_is_kept():
    """Weights 1e-3 of the others, read by weights 1000x larger: it matters, m_c is not small."""
    nodes, _ = ACTS["relu"]()
    model = _chain(nodes, scale=1e-3)
    wb = _weight(model, "B").copy()
    wb[:, list(CONST)] *= 10  # 1000x the others in all
    init = next(t for t in model.graph.initializer if t.name == "wb")
    init.CopyFrom(onnx.numpy_helper.from_array(wb, "wb"))
    out, fold, modified = _apply(model)
    assert not modified and fold.report.folded == []
    assert out.graph.initializer == model.graph.initializer


def test_rescaled_channel_is_not_negligible():
    """A channel divided by 1e6 through Relu and its reader multiplied by 1e6 computes the same
    function: its max |w| ratio is 1e-6 but m_c (scale-free) is not small, so nothing folds."""
    rng = _rng(8)
    wa = rng.standard_normal((C, 3, 3, 3)).astype(np.float32)
    ba = rng.standard_normal(C).astype(np.float32)
    wb = rng.standard_normal((5, C, 1, 1)).astype(np.float32)
    wa[2] /= 1e6
    ba[2] /= 1e6
    wb[:, 2] *= 1e6
    inits = {"wa": wa, "ba": ba, "wb": wb}
    nodes = [
        _conv("A", "x", "wa", "ba", "a"),
        helper.make_node("Relu", ["a"], ["h"]),
        _conv("B", "h", "wb", None, "y", k=1),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 8, 8])
    y = _out("y")
    _, fold, modified = _apply(make_model(nodes, [x], [y], inits))
    assert not modified and fold.report.folded == []


def test_negligible_channel_that_is_a_graph_output_is_kept():
    nodes, _ = ACTS["relu"]()
    model = _chain(nodes, scale=1e-8)
    model.graph.output.append(_out("h"))
    _, fold, modified = _apply(model)
    assert not modified and fold.report.folded == []


@pytest.mark.parametrize("op", ["Add", "Concat"])
def test_consumer_that_is_not_a_layer(op):
    rng = _rng(9)
    wa, ba = _producer(rng)
    inits = {"wa": wa, "ba": ba}
    node = (
        helper.make_node("Add", ["h", "h"], ["y"])
        if op == "Add"
        else helper.make_node("Concat", ["h", "x2"], ["y"], axis=0)
    )
    nodes = [_conv("A", "x", "wa", "ba", "a"), helper.make_node("Relu", ["a"], ["h"]), node]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 8, 8])
    x2 = helper.make_tensor_value_info("x2", TensorProto.FLOAT, [2, C, 8, 8])
    y = _out("y")
    model = make_model(nodes, [x] if op == "Add" else [x, x2], [y], inits)
    _, fold, modified = _apply(model)
    assert not modified and fold.report.folded == []


def test_nonzero_constant_into_padded_conv_is_not_folded():
    nodes, _ = ACTS["relu"]()
    model = _chain(nodes, k=3)  # B is 3x3 with pads 1
    out, fold, modified = _apply(model)
    assert modified
    _assert_same_outputs(model, out)
    wb = _weight(out, "B")
    assert not np.any(wb[:, CONST[0]])  # the dead channel: exact even with padding
    np.testing.assert_array_equal(wb[:, CONST[1]], _weight(model, "B")[:, CONST[1]])
    assert [f.channel for f in fold.report.folded] == [CONST[0]]


def test_tolerance_zero_folds_only_exact_zero_channels():
    nodes, _ = ACTS["relu"]()
    _, _, modified = _apply(_chain(nodes, scale=1e-8), tolerance=0.0)
    assert not modified


def test_bad_tolerance_rejected():
    with pytest.raises(ConfigError, match="tolerance"):
        FoldConstantChannels(tolerance=2.0)


def test_second_run_changes_nothing():
    nodes, _ = ACTS["relu"]()
    out, _, _ = _apply(_chain(nodes, scale=1e-8))
    _, _, modified = _apply(out)
    assert not modified


# --------------------------------------------------------------------------- real models


@pytest.mark.real_model
@pytest.mark.parametrize(
    "name,input_name,scale,folded",
    [("mobilenetv2_rebuilt.onnx", "input", 1.0, 20), ("squeezenet1.1.onnx", "data_0", 50.0, 1)],
)
def test_real_model_float_outputs_unchanged(name, input_name, scale, folded):
    """Inputs at the models' pre-processed scale (normalised RGB; BGR 0-255 minus the mean)."""
    model = onnx.load(shared_path("models", name))
    feeds = {input_name: _rng(2).standard_normal((1, 3, 224, 224)).astype(np.float32) * scale}
    out, fold, _ = _apply(model)
    assert len(fold.report.folded) == folded
    _assert_same_outputs(model, out, feeds)


# --------------------------------------------------------------------------- clamped (samples)


def _dead_by_bias(bias: float) -> onnx.ModelProto:
    """Channel 1 of A: weights 1e-3 of the others (not negligible: B reads it 1000x harder) and
    ``bias``, then Relu; dead for every input with ||W_1||_1 * max|x| < -bias."""
    nodes, _ = ACTS["relu"]()
    model = _chain(nodes, scale=1e-3, boost=1000.0)
    ba = _weight(model, "A", 2).copy()
    ba[1] = bias
    init = next(t for t in model.graph.initializer if t.name == "ba")
    init.CopyFrom(onnx.numpy_helper.from_array(ba, "ba"))
    return model


def test_channel_clamped_dead_on_samples_is_folded():
    model = _dead_by_bias(-2.0)  # ||W_1||_1 * 10 * max|x| is about 0.7
    samples = _feeds(model, seed=4)
    _, fold, modified = _apply(model)  # data-free: not negligible, nothing to fold
    assert not modified
    out, fold, modified = _apply(model, sample_feeds=samples)
    assert modified
    assert [(f.channel, f.kind) for f in fold.report.folded] == [(1, "clamped")]
    assert not np.any(_weight(out, "A")[1]) and not np.any(_weight(out, "B")[:, 1])
    _assert_same_outputs(model, out, _feeds(model, seed=5))  # other inputs: still exact
    _assert_same_outputs(model, out, {"x": samples["x"] * 50})  # far beyond the samples too


def test_channel_that_samples_cannot_prove_dead_is_kept():
    """Bias -0.05: the 1e-3 weights could lift it above 0 within 10x the samples' range."""
    model = _dead_by_bias(-0.05)
    _, fold, _ = _apply(model, sample_feeds=_feeds(model, seed=4))
    assert 1 not in [f.channel for f in fold.report.folded]


def test_bad_margin_rejected():
    with pytest.raises(ConfigError, match="margin"):
        FoldConstantChannels(margin=0.5)


@pytest.mark.real_model
def test_stress_dead_channels_of_squeezenet_are_folded_away():
    """The benchmark's dead/constant-channel stress variant of SqueezeNet (17 dead channels whose
    readers' weights are 100x the median): folding restores every layer's weight range."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import make_stress_variants as msv

    original = onnx.load(shared_path("models", "squeezenet1.1.onnx"))
    variant, changed = msv.make_variant(original, "deadconst", 0)
    assert changed["dead_channels"] == 17
    samples = {"data_0": _rng(3).standard_normal((1, 3, 224, 224)).astype(np.float32) * 50}
    out, _, modified = _apply(variant, sample_feeds=samples)
    assert modified
    feeds = {"data_0": _rng(4).standard_normal((1, 3, 224, 224)).astype(np.float32) * 50}
    _assert_same_outputs(variant, out, feeds)

    def ranges(model):
        inits = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
        return {
            n.output[0]: float(np.abs(inits[n.input[1]]).max())
            for n in model.graph.node
            if n.op_type == "Conv"
        }

    before, stressed, after = ranges(original), ranges(variant), ranges(out)
    assert any(stressed[k] > 10 * before[k] for k in before)  # the stress did blow ranges up
    for name, r in before.items():
        assert after[name] <= r * (1 + 1e-6), name


# --------------------------------------------------------------------------- quiet (samples)


def _no_activation_model(scale: float, boost: float = 1e4) -> onnx.ModelProto:
    """x -> A -> B 1x1, no activation between: A's channels CONST have weights ``scale`` times a
    unit draw and biases -2 and 2 (constant up to the weights: no activation clamps them), B
    reads them ``boost`` times harder. The other channels carry large biases (200) on small
    weights, as in a BatchNorm-folded projection layer, so the data-free bound, which ignores
    biases, cannot tell the CONST channels from them."""
    rng = _rng(7)
    wa = (rng.standard_normal((C, 3, 3, 3)) * 0.01).astype(np.float32)
    ba = (np.sign(rng.standard_normal(C)) * 200.0).astype(np.float32)
    for c in CONST:
        wa[c] = rng.standard_normal((3, 3, 3)) * scale
    ba[CONST[0]], ba[CONST[1]] = -2.0, 2.0
    wb = rng.standard_normal((5, C, 1, 1)).astype(np.float32)
    for c in CONST:
        wb[:, c] *= boost
    inits = {"wa": wa, "ba": ba, "wb": wb, "bb": rng.standard_normal(5).astype(np.float32)}
    nodes = [_conv("A", "x", "wa", "ba", "a"), _conv("B", "a", "wb", "bb", "y", k=1)]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 8, 8])
    return make_model(nodes, [x], [_out("y")], inits)


def test_quiet_constant_channel_without_activation_is_folded_with_samples():
    model = _no_activation_model(scale=1e-8)
    _, _, modified = _apply(model)  # data-free: B's 1e4 columns keep them above the tolerance
    assert not modified
    samples = _feeds(model, seed=4)
    out, fold, modified = _apply(model, sample_feeds=samples)
    assert modified
    assert [(f.channel, f.kind) for f in fold.report.folded] == [(c, "quiet") for c in CONST]
    _assert_folded(model, out)
    _assert_same_outputs(model, out, _feeds(model, seed=5))
    _assert_same_outputs(model, out, {"x": samples["x"] * 5})


def test_channel_that_varies_is_not_quiet():
    """Weights 1e-5: over 10x the samples' range the channel moves by ~1e-2, far more than 1e-4
    of its constant (2): a real, if small, channel."""
    model = _no_activation_model(scale=1e-5)
    out, fold, _ = _apply(model, sample_feeds=_feeds(model, seed=4))
    assert not fold.report.folded
    np.testing.assert_array_equal(_weight(out, "B"), _weight(model, "B"))


def test_input_floor_does_not_depend_on_a_rescaling_of_the_inputs():
    """The floor that stands in for an input channel the samples leave at 0 is set on the
    channel's contribution, so rescaling input channel i by a (and the layer's column by 1/a)
    rescales its floored range by exactly a; the bound sum_i ||W[c, i]|| X_i is unchanged."""
    from passes.fold_constant_channels import _floored_inputs

    rng = _rng(11)
    per_input = np.abs(rng.standard_normal((6, 5)))  # [C, cpg]: ||W[c, i]||_1
    x_max = np.array([3.0, 0.0, 1e-6, 2.0, 0.5])
    a = np.array([1.0, 1e-3, 1e2, 1e-2, 1.0])
    floored = _floored_inputs(x_max, per_input)
    rescaled = _floored_inputs(x_max * a, per_input / a)
    np.testing.assert_allclose(rescaled, floored * a, rtol=1e-12)
    np.testing.assert_allclose((per_input / a) @ rescaled, per_input @ floored, rtol=1e-12)
    assert floored[1] > 0 and floored[2] > x_max[2]  # the silent inputs still count
    np.testing.assert_array_equal(floored[[0, 3]], x_max[[0, 3]])  # the others as measured


def test_folded_channel_bias_is_zeroed_where_nothing_reads_it():
    """Folded into every reader, the constant no longer needs its bias (A's and the unpadded
    depthwise D's): zeroing them keeps a constant from setting those biases' ranges."""
    model = _dw_chain(pad=0)
    out, _, modified = _apply(model)
    assert modified
    _assert_same_outputs(model, out)
    ba, bd = _weight(out, "A", 2), _weight(out, "D", 2)
    assert not np.any(ba[list(CONST)]) and not np.any(bd[list(CONST)])
    others = [c for c in range(C) if c not in CONST]
    np.testing.assert_array_equal(ba[others], _weight(model, "A", 2)[others])
    np.testing.assert_array_equal(bd[others], _weight(model, "D", 2)[others])


def test_bias_of_a_channel_still_read_is_kept():
    """Padded depthwise: the constant 0.9 channel cannot be folded into it, so A keeps its bias
    (the dead one, folded everywhere, loses it)."""
    model = _dw_chain(pad=1)
    out, _, _ = _apply(model)
    _assert_same_outputs(model, out)
    ba = _weight(out, "A", 2)
    assert ba[CONST[1]] == _weight(model, "A", 2)[CONST[1]] and ba[CONST[0]] == 0.0
