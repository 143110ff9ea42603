"""CrossLayerEqualization: float outputs preserved, ranges equalized, and where it must not fire."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from conftest import make_model, run_ort, shared_path
from onnx import TensorProto, helper

from quark_onnx.config.enums import PowerOfTwoMethod
from quark_onnx.errors import ConfigError
from quark_onnx.graph.channels import (
    channel_range_spread,
    channel_statistics,
    input_channel_ranges,
    output_channel_ranges,
)
from quark_onnx.graph.ir import RANGE_MAX_KEY
from quark_onnx.params import pof2
from quark_onnx.passes import CrossLayerEqualization

RTOL = 1e-4  # max |new - old| / max |old| over the model's outputs


# --------------------------------------------------------------------------- tiny-graph builders


def _rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def _spread_weight(rng, shape, spread: float = 100.0) -> np.ndarray:
    """Random conv weight whose output channels have ranges ``spread`` times apart."""
    w = rng.standard_normal(shape).astype(np.float32)
    factors = np.logspace(0, np.log10(spread), shape[0])
    rng.shuffle(factors)
    return (w * factors.reshape(-1, *([1] * (len(shape) - 1)))).astype(np.float32)


def _conv(name, x, w, b, y, group=1, k=3):
    inputs = [x, w] if b is None else [x, w, b]
    return helper.make_node(
        "Conv",
        inputs,
        [y],
        name=name,
        kernel_shape=[k, k],
        pads=[k // 2] * 4,
        strides=[1, 1],
        dilations=[1, 1],
        group=group,
    )


def _io(c_in: int, c_out: int, hw: int = 8):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, c_in, hw, hw])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, c_out, hw, hw])
    return x, y


def _feeds(model: onnx.ModelProto, seed: int = 1) -> dict[str, np.ndarray]:
    shape = [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    return {"x": _rng(seed).standard_normal(shape).astype(np.float32)}


def _apply(
    model: onnx.ModelProto, **options
) -> tuple[onnx.ModelProto, CrossLayerEqualization, bool]:
    ir_model = ir.from_proto(model)
    options.setdefault("gate", False)  # these tests check the equalization itself
    cle = CrossLayerEqualization(**options)
    result = cle(ir_model)
    out = ir.to_proto(result.model)
    onnx.checker.check_model(out)
    return out, cle, result.modified


def _assert_same_outputs(a: onnx.ModelProto, b: onnx.ModelProto, feeds=None) -> None:
    feeds = feeds or _feeds(a)
    for ref, got in zip(run_ort(a, feeds), run_ort(b, feeds), strict=True):
        rel = np.abs(got - ref).max() / np.abs(ref).max()
        assert rel <= RTOL, rel


def _weights(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}


def _node_weight(model: onnx.ModelProto, node_name: str, index: int = 1) -> np.ndarray:
    node = next(n for n in model.graph.node if n.name == node_name)
    return _weights(model)[node.input[index]]


def _conv_act_conv(act_nodes, c=6, seed=0, group2=1, c_out=5, bias=True, extra=None):
    """x -> Conv A (c ch) -> act_nodes (reading 'a', writing 'h') -> Conv B -> y."""
    rng = _rng(seed)
    inits = {
        **(extra or {}),
        "wa": _spread_weight(rng, (c, 3, 3, 3)),
        "wb": rng.standard_normal((c_out, c // group2, 3, 3)).astype(np.float32),
        "bb": rng.standard_normal(c_out).astype(np.float32),
    }
    if bias:
        inits["ba"] = (rng.standard_normal(c) * 0.1).astype(np.float32)
    nodes = [_conv("A", "x", "wa", "ba" if bias else None, "a")]
    nodes += act_nodes
    nodes.append(_conv("B", "h" if act_nodes else "a", "wb", "bb", "y", group=group2))
    x, y = _io(3, c_out)
    return make_model(nodes, [x], [y], inits)


def _relu():
    return [helper.make_node("Relu", ["a"], ["h"], name="act")]


# --------------------------------------------------------------------------- it fires, exactly


def test_conv_relu_conv_preserves_outputs_and_equalizes_ranges():
    model = _conv_act_conv(_relu())
    out, cle, modified = _apply(model, steps=1, scale_append_bias=False)
    assert modified
    _assert_same_outputs(model, out)
    assert [(p.first, p.second, p.through) for p in cle.report.pairs] == [("A", "B", ("Relu",))]
    assert cle.report.iterations == 1
    # one equalization of a single pair makes both sides' channel ranges sqrt(r1 * r2)
    wa0, wb0 = _node_weight(model, "A"), _node_weight(model, "B")
    wa1, wb1 = _node_weight(out, "A"), _node_weight(out, "B")
    r1, r2 = output_channel_ranges(wa0), input_channel_ranges(wb0, 1)
    np.testing.assert_allclose(output_channel_ranges(wa1), np.sqrt(r1 * r2), rtol=1e-6)
    np.testing.assert_allclose(input_channel_ranges(wb1, 1), np.sqrt(r1 * r2), rtol=1e-6)
    # the bias of A follows its channel: b1_i / s_i with s_i = sqrt(r1_i / r2_i)
    np.testing.assert_allclose(
        _node_weight(out, "A", 2), _node_weight(model, "A", 2) / np.sqrt(r1 / r2), rtol=1e-6
    )
    assert channel_range_spread(wa1) < channel_range_spread(wa0)
    spread = {s.node: s for s in cle.report.spreads}
    assert spread["A"].after < spread["A"].before
    # names and initializers are rewritten in place, nothing is added
    assert sorted(_weights(out)) == sorted(_weights(model))


def test_scale_append_bias_uses_bias_in_first_range():
    model = _conv_act_conv(_relu())
    ba = _weights(model)["ba"].copy()
    ba[0] = 1e3  # a bias larger than any weight of channel 0
    model.graph.initializer[[t.name for t in model.graph.initializer].index("ba")].CopyFrom(
        onnx.numpy_helper.from_array(ba, "ba")
    )
    out, _, _ = _apply(model, steps=1, scale_append_bias=True)
    _assert_same_outputs(model, out)
    r1 = np.maximum(output_channel_ranges(_node_weight(model, "A")), np.abs(ba))
    r2 = input_channel_ranges(_node_weight(model, "B"), 1)
    np.testing.assert_allclose(_node_weight(out, "A", 2), ba / np.sqrt(r1 / r2), rtol=1e-6)


def test_conv_leaky_relu_conv():
    act = [helper.make_node("LeakyRelu", ["a"], ["h"], name="act", alpha=0.1)]
    model = _conv_act_conv(act)
    out, cle, modified = _apply(model, steps=-1)
    assert modified and len(cle.report.pairs) == 1
    _assert_same_outputs(model, out)


@pytest.mark.parametrize(
    "act",
    [
        pytest.param([], id="no-activation"),
        pytest.param(
            [
                helper.make_node("Relu", ["a"], ["r"]),
                helper.make_node(
                    "MaxPool", ["r"], ["h"], kernel_shape=[2, 2], strides=[1, 1], pads=[0, 0, 1, 1]
                ),
            ],
            id="relu-maxpool",
        ),
        pytest.param(
            [helper.make_node("Clip", ["a", "zero", ""], ["h"])],
            id="clip-0-inf",
        ),
        pytest.param(
            [helper.make_node("PRelu", ["a", "slope"], ["h"])],
            id="prelu",
        ),
        pytest.param(
            [helper.make_node("PRelu", ["a", "negslope"], ["h"])],
            id="prelu-negative-slopes",
        ),
    ],
)
def test_other_homogeneous_paths(act):
    extra = {
        "zero": np.array(0.0, np.float32),
        "slope": np.linspace(0.05, 0.3, 6, dtype=np.float32).reshape(6, 1, 1),
        "negslope": np.linspace(-1.5, 0.5, 6, dtype=np.float32).reshape(6, 1, 1),
    }
    model = _conv_act_conv(act, extra=extra)
    out, cle, modified = _apply(model, steps=2)
    assert modified and len(cle.report.pairs) == 1
    _assert_same_outputs(model, out)


def test_grouped_second_conv():
    model = _conv_act_conv(_relu(), c=6, group2=2, c_out=4)
    out, _, modified = _apply(model, steps=1, scale_append_bias=False)
    assert modified
    _assert_same_outputs(model, out)
    r1 = output_channel_ranges(_node_weight(model, "A"))
    r2 = input_channel_ranges(_node_weight(model, "B"), 2)
    np.testing.assert_allclose(
        input_channel_ranges(_node_weight(out, "B"), 2), np.sqrt(r1 * r2), rtol=1e-6
    )


def _conv_dw_conv() -> onnx.ModelProto:
    """Conv(3->8) -> Relu -> depthwise Conv(8, group 8) -> Relu -> Conv(8->4), MobileNet-like."""
    rng = _rng(3)
    inits = {
        "w0": _spread_weight(rng, (8, 3, 3, 3), 30.0),
        "b0": (rng.standard_normal(8) * 0.1).astype(np.float32),
        "w1": _spread_weight(rng, (8, 1, 3, 3), 100.0),
        "b1": (rng.standard_normal(8) * 0.1).astype(np.float32),
        "w2": _spread_weight(rng, (4, 8, 1, 1), 10.0),
        "b2": rng.standard_normal(4).astype(np.float32),
    }
    nodes = [
        _conv("c0", "x", "w0", "b0", "a0"),
        helper.make_node("Relu", ["a0"], ["h0"], name="r0"),
        _conv("dw", "h0", "w1", "b1", "a1", group=8),
        helper.make_node("Relu", ["a1"], ["h1"], name="r1"),
        _conv("c2", "h1", "w2", "b2", "y", k=1),
    ]
    x, y = _io(3, 4)
    return make_model(nodes, [x], [y], inits)


def test_conv_dw_conv_chain_converges_jointly():
    model = _conv_dw_conv()
    out, cle, modified = _apply(model, steps=-1, threshold=1e-9, scale_append_bias=False)
    assert modified
    _assert_same_outputs(model, out)
    report = cle.report
    assert [(p.first, p.second) for p in report.pairs] == [("c0", "dw"), ("dw", "c2")]
    assert report.converged and 1 < report.iterations < 500
    assert report.last_change < 1e-9
    # at the fixed point every channel boundary is balanced
    w0, w1, w2 = (_node_weight(out, n) for n in ("c0", "dw", "c2"))
    np.testing.assert_allclose(output_channel_ranges(w0), input_channel_ranges(w1, 8), rtol=1e-5)
    np.testing.assert_allclose(output_channel_ranges(w1), input_channel_ranges(w2, 1), rtol=1e-5)
    spread = {s.node: s for s in report.spreads}
    assert spread["dw"].after < spread["dw"].before / 5


def _conv_chain(length: int = 10, channels: int = 8) -> onnx.ModelProto:
    """``length`` 3x3 Conv -> Relu layers and a 1x1 Conv, every layer with spread ranges."""
    rng = _rng(5)
    inits: dict[str, np.ndarray] = {}
    nodes = []
    value = "x"
    for k in range(length):
        inits[f"w{k}"] = _spread_weight(rng, (channels, 3 if k == 0 else channels, 3, 3), 30.0)
        inits[f"b{k}"] = (rng.standard_normal(channels) * 0.1).astype(np.float32)
        nodes.append(_conv(f"c{k}", value, f"w{k}", f"b{k}", f"a{k}"))
        nodes.append(helper.make_node("Relu", [f"a{k}"], [f"h{k}"], name=f"r{k}"))
        value = f"h{k}"
    inits["wl"] = _spread_weight(rng, (4, channels, 1, 1), 10.0)
    inits["bl"] = np.zeros(4, np.float32)
    nodes.append(_conv("cl", value, "wl", "bl", "y", k=1))
    x, y = _io(3, 4)
    return make_model(nodes, [x], [y], inits)


def test_over_relaxed_sweeps_reach_the_plain_sweeps_fixed_point(monkeypatch):
    import sys

    cle_module = sys.modules[CrossLayerEqualization.__module__]
    # the sweeps alone, without the balanced point solved for first
    monkeypatch.setattr(cle_module, "balance", lambda *args: 0)
    model = _conv_chain()
    options = dict(steps=-1, threshold=1e-9, scale_append_bias=False)
    relaxed, cle_relaxed, _ = _apply(model, **options)
    monkeypatch.setattr(cle_module, "over_relaxation", lambda length: 1.0)
    plain, cle_plain, _ = _apply(model, **options)
    _assert_same_outputs(model, relaxed)
    for k in range(10):
        np.testing.assert_allclose(
            _node_weight(relaxed, f"c{k}"), _node_weight(plain, f"c{k}"), rtol=1e-5, atol=1e-7
        )
    # measured: 165 plain sweeps, 37 over-relaxed (to 1e-6); fewer is what it is for
    assert cle_relaxed.report.iterations < cle_plain.report.iterations / 2


def _chain_of_4x4(length: int, seed: int = 0) -> onnx.ModelProto:
    """``length`` 1x1 Convs on 4 channels with orthogonal weights and small biases (the
    scaling benchmark's chain): every boundary's balance depends on the whole chain."""
    rng = _rng(seed)
    inits: dict[str, np.ndarray] = {}
    nodes = []
    for k in range(length):
        w = np.linalg.qr(rng.standard_normal((4, 4)))[0][:, :, None, None]
        inits[f"w{k}"] = w.astype(np.float32)
        inits[f"b{k}"] = (rng.standard_normal(4) * 0.1).astype(np.float32)
        source = "x" if k == 0 else f"a{k - 1}"
        out = "y" if k == length - 1 else f"a{k}"
        nodes.append(_conv(f"c{k}", source, f"w{k}", f"b{k}", out, k=1))
    x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 4, 5, 5])
    y = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 4, 5, 5])
    return make_model(nodes, [x], [y], inits)


@pytest.mark.parametrize("bias", [False, True])
def test_solved_balance_is_the_sweeps_fixed_point(monkeypatch, bias):
    import sys

    cle_module = sys.modules[CrossLayerEqualization.__module__]
    monkeypatch.setattr(cle_module, "SWEEPS_BEFORE_SOLVE", 3)
    model = _chain_of_4x4(40)
    options = dict(steps=-1, threshold=1e-10, scale_append_bias=bias)
    solved, cle_solved, _ = _apply(model, **options)
    monkeypatch.setattr(cle_module, "balance", lambda *args: 0)
    swept, cle_swept, _ = _apply(model, **options)
    _assert_same_outputs(model, solved)
    assert cle_solved.report.converged and cle_swept.report.converged
    for k in range(40):
        np.testing.assert_allclose(
            _node_weight(solved, f"c{k}"), _node_weight(swept, f"c{k}"), rtol=1e-5, atol=1e-7
        )
    # the chain's sweeps alone take dozens of steps; solved after 3, one more confirms the point
    assert cle_swept.report.iterations > 20
    assert cle_solved.report.iterations == 4


def test_balance_waits_for_the_sweep_budget(monkeypatch):
    import sys

    cle_module = sys.modules[CrossLayerEqualization.__module__]
    calls = []
    monkeypatch.setattr(cle_module, "balance", lambda *args: calls.append(1) or 0)
    model = _chain_of_4x4(40)
    _, cle, _ = _apply(model, steps=-1, threshold=1e-10)
    assert cle.report.iterations > cle_module.SWEEPS_BEFORE_SOLVE and len(calls) == 1
    _, cle, _ = _apply(_chain_of_4x4(3), steps=-1, threshold=1e-4)
    assert cle.report.iterations < cle_module.SWEEPS_BEFORE_SOLVE and not calls[1:]


def test_balance_is_not_solved_for_fixed_steps_or_step_gates(monkeypatch):
    import sys

    def refuse(*args):
        raise AssertionError("balance solved outside the adaptive ungated sweeps")

    cle_module = sys.modules[CrossLayerEqualization.__module__]
    monkeypatch.setattr(cle_module, "balance", refuse)
    monkeypatch.setattr(cle_module, "SWEEPS_BEFORE_SOLVE", 0)
    model = _chain_of_4x4(6)
    _, cle, _ = _apply(model, steps=3, threshold=0.0)
    assert cle.report.iterations == 3
    _, cle, _ = _apply(model, steps=-1, threshold=1e-4, gate="sum")
    assert cle.report.iterations >= 1


def test_over_relaxation_factor():
    from quark_onnx.passes.cross_layer_equalization import over_relaxation

    assert over_relaxation(1) == pytest.approx(2 / (1 + np.sin(np.pi / 2)))  # 1.0: one step
    assert 1.5 < over_relaxation(10) < over_relaxation(20) < 2.0


def test_single_step_is_not_converged_on_chain():
    _, cle, _ = _apply(_conv_dw_conv(), steps=1)
    assert cle.report.iterations == 1 and not cle.report.converged


def test_max_scale_bounds_cumulative_factor():
    model = _conv_dw_conv()
    out, _, _ = _apply(model, steps=-1, max_scale=2.0)
    _assert_same_outputs(model, out)
    ratio = output_channel_ranges(_node_weight(model, "c0")) / output_channel_ranges(
        _node_weight(out, "c0")
    )
    assert ratio.max() <= 2.0 * (1 + 1e-6) and ratio.min() >= 0.5 * (1 - 1e-6)
    assert np.isclose(ratio.max(), 2.0) or np.isclose(ratio.min(), 0.5)  # the bound was active


def test_pairs_filter_selects_one_pair():
    model = _conv_dw_conv()
    out, cle, modified = _apply(model, steps=1, pairs=[("dw", "c2")])
    assert modified
    assert [(p.first, p.second) for p in cle.report.pairs] == [("dw", "c2")]
    np.testing.assert_array_equal(_node_weight(out, "c0"), _node_weight(model, "c0"))
    _assert_same_outputs(model, out)


def test_pairs_filter_unknown_pair_is_reported():
    _, cle, modified = _apply(_conv_dw_conv(), pairs=[("c0", "c2")])
    assert not modified
    assert any("not eligible" in s.reason for s in cle.report.skipped)


def test_shared_weight_is_copied_not_changed_for_others():
    """The second conv's weight is also read by another Conv: that one must keep the old values."""
    model = _conv_act_conv(_relu(), c=6, c_out=6)
    model.graph.node.append(_conv("other", "x2", "wb", None, "y2"))
    model.graph.input.append(helper.make_tensor_value_info("x2", TensorProto.FLOAT, [2, 6, 8, 8]))
    model.graph.output.append(helper.make_tensor_value_info("y2", TensorProto.FLOAT, [2, 6, 8, 8]))
    out, _, modified = _apply(model, steps=1)
    assert modified
    feeds = {**_feeds(model), "x2": _rng(5).standard_normal((2, 6, 8, 8)).astype(np.float32)}
    _assert_same_outputs(model, out, feeds)
    np.testing.assert_array_equal(_node_weight(out, "other"), _weights(model)["wb"])
    assert next(n for n in out.graph.node if n.name == "B").input[1] != "wb"


def test_weights_from_constant_nodes():
    model = _conv_act_conv(_relu())
    inits = {t.name: t for t in model.graph.initializer}
    constants = [
        helper.make_node("Constant", [], [name], value=inits[name]) for name in ("wa", "wb")
    ]
    del model.graph.initializer[:]
    model.graph.initializer.extend(t for n, t in inits.items() if n not in ("wa", "wb"))
    for i, node in enumerate(constants):
        model.graph.node.insert(i, node)
    onnx.checker.check_model(model)
    out, _, modified = _apply(model, steps=1)
    assert modified
    _assert_same_outputs(model, out)
    assert not any(n.op_type == "Constant" for n in out.graph.node)  # orphans removed


# --------------------------------------------------------------------------- it must not fire


def _unchanged(model: onnx.ModelProto, **options):
    out, cle, modified = _apply(model, **options)
    assert not modified
    assert not cle.report.pairs
    for name, array in _weights(model).items():
        np.testing.assert_array_equal(_weights(out)[name], array)
    return cle.report


def test_relu6_blocks_the_pair():
    clip = helper.make_node("Clip", ["a", "zero", "six"], ["h"], name="relu6")
    extra = {"zero": np.array(0.0, np.float32), "six": np.array(6.0, np.float32)}
    model = _conv_act_conv([clip], extra=extra)
    report = _unchanged(model, steps=-1)
    assert any("ReplaceClip6Relu" in s.reason for s in report.skipped if s.first == "A")


def test_second_reader_that_is_not_a_conv_blocks_the_pair():
    model = _conv_act_conv(_relu())
    model.graph.node.append(helper.make_node("Identity", ["h"], ["h_copy"]))
    model.graph.output.append(
        helper.make_tensor_value_info("h_copy", TensorProto.FLOAT, [2, 6, 8, 8])
    )
    report = _unchanged(model, steps=-1)
    assert any("graph output" in s.reason for s in report.skipped if s.first == "A")
    model = _conv_act_conv(_relu())
    model.graph.node.append(helper.make_node("Sigmoid", ["h"], ["h_sig"]))
    model.graph.output.append(
        helper.make_tensor_value_info("h_sig", TensorProto.FLOAT, [2, 6, 8, 8])
    )
    report = _unchanged(model, steps=-1)
    assert any("Sigmoid" in s.reason for s in report.skipped if s.first == "A")


def _fire_module(seed: int = 0) -> onnx.ModelProto:
    """SqueezeNet's shape: squeeze S -> Relu -> {expand E1 (1x1), expand E3 (3x3)} -> Relu each
    -> Concat -> MaxPool -> conv N; channels rescaled by 1/100..100 through every boundary."""
    rng = _rng(seed)
    inits = {
        "ws": _spread_weight(rng, (6, 3, 1, 1)),
        "bs": (rng.standard_normal(6) * 0.1).astype(np.float32),
        "w1": _spread_weight(rng, (4, 6, 1, 1)),
        "w3": _spread_weight(rng, (5, 6, 3, 3)),
        "b3": (rng.standard_normal(5) * 0.1).astype(np.float32),
        "wn": rng.standard_normal((3, 9, 1, 1)).astype(np.float32),
    }
    nodes = [
        _conv("S", "x", "ws", "bs", "s", k=1),
        helper.make_node("Relu", ["s"], ["sr"]),
        _conv("E1", "sr", "w1", None, "e1", k=1),
        _conv("E3", "sr", "w3", "b3", "e3", k=3),
        helper.make_node("Relu", ["e1"], ["e1r"]),
        helper.make_node("Relu", ["e3"], ["e3r"]),
        helper.make_node("Concat", ["e1r", "e3r"], ["cat"], axis=1),
        helper.make_node("MaxPool", ["cat"], ["mp"], kernel_shape=[2, 2], strides=[2, 2]),
        _conv("N", "mp", "wn", None, "y", k=1),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 8, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3, 4, 4])
    return onnx.shape_inference.infer_shapes(make_model(nodes, [x], [y], inits))


def test_several_conv_readers_and_concat_are_equalized_jointly():
    model = _fire_module()
    out, cle, modified = _apply(model, steps=-1)
    assert modified and cle.report.converged
    _assert_same_outputs(model, out)
    pairs = {(p.first, p.second, p.through) for p in cle.report.pairs}
    assert pairs == {
        ("S", "E3, E1", ("Relu",)),
        ("E1", "N", ("Relu", "Concat", "MaxPool")),
        ("E3", "N", ("Relu", "Concat", "MaxPool")),
    } or pairs == {
        ("S", "E1, E3", ("Relu",)),
        ("E1", "N", ("Relu", "Concat", "MaxPool")),
        ("E3", "N", ("Relu", "Concat", "MaxPool")),
    }
    # one sweep of S's boundary: S's ranges against the larger of E1's and E3's reads
    for name in ("S", "E1", "E3"):
        assert channel_range_spread(_node_weight(out, name)) < channel_range_spread(
            _node_weight(model, name)
        )


def test_intermediate_graph_output_blocks_the_pair():
    model = _conv_act_conv(_relu())
    model.graph.output.append(helper.make_tensor_value_info("a", TensorProto.FLOAT, [2, 6, 8, 8]))
    _unchanged(model)


def test_non_constant_weight_blocks_the_pair():
    model = _conv_act_conv(_relu())
    wb = next(t for t in model.graph.initializer if t.name == "wb")
    model.graph.input.append(helper.make_tensor_value_info("wb", TensorProto.FLOAT, list(wb.dims)))
    model.graph.initializer.remove(wb)
    report = _unchanged(model)
    assert any("'wb'" in s.reason and "constant" in s.reason for s in report.skipped)


def test_range_cap_metadata_blocks_the_pair():
    ir_model = ir.from_proto(_conv_act_conv(_relu()))
    relu = next(n for n in ir_model.graph if n.op_type == "Relu")
    relu.outputs[0].metadata_props[RANGE_MAX_KEY] = "6.0"
    cle = CrossLayerEqualization()
    assert not cle(ir_model).modified
    assert any("ConvertClipToRelu" in s.reason for s in cle.report.skipped)


def test_non_homogeneous_op_blocks_the_pair():
    _unchanged(_conv_act_conv([helper.make_node("Sigmoid", ["a"], ["h"])]))


def test_steps_zero_is_a_no_op():
    _, cle, modified = _apply(_conv_act_conv(_relu()), steps=0)
    assert not modified and cle.report.iterations == 0


@pytest.mark.parametrize(
    "options",
    [{"steps": -2}, {"steps": 1.5}, {"threshold": -1.0}, {"max_scale": 1.0}],
)
def test_bad_options_are_rejected(options):
    with pytest.raises(ConfigError, match="CrossLayerEqualization"):
        CrossLayerEqualization(**options)


# --------------------------------------------------------------------------- MobileNetV2


def _mobilenetv2_relu() -> onnx.ModelProto:
    """The real MobileNetV2 with every Clip(0, 6) replaced by Relu (ReplaceClip6Relu semantics)."""
    model = onnx.load(shared_path("models", "mobilenetv2_rebuilt.onnx"))
    inits = _weights(model)
    for node in model.graph.node:
        if node.op_type != "Clip":
            continue
        lo, hi = (float(inits[name]) for name in node.input[1:3])
        assert (lo, hi) == (0.0, 6.0)
        node.op_type = "Relu"
        del node.input[1:]
    return model


def _pof2_quantize(w: np.ndarray) -> np.ndarray:
    """Per-tensor int8 power-of-two quantize-dequantize at the NonOverflow position."""
    return pof2.fake_quant(w, pof2.weight_position(w, PowerOfTwoMethod.NonOverflow))


def _sqnr_db(w: np.ndarray) -> float:
    w = w.astype(np.float64)
    return float(10 * np.log10(np.sum(w**2) / np.sum((w - _pof2_quantize(w)) ** 2)))


@pytest.mark.real_model
def test_digits_cnn_after_bn_folding_keeps_outputs_and_accuracy():
    """The prepare passes a ReLU6 network needs before CLE, then CLE until converged."""
    from quark_onnx.passes import ConvertBNToConv, ReplaceClip6Relu

    model = ir.load(shared_path("models", "digits_cnn.onnx"))
    for prepare in (ConvertBNToConv(), ReplaceClip6Relu()):
        model = prepare(model).model
    for node in model.graph:  # the range caps ReplaceClip6Relu keeps would block every pair
        node.outputs[0].metadata_props.pop("quark_onnx.range_max", None)
    reference = ir.to_proto(model)
    out, cle, modified = _apply(reference, steps=-1)
    assert modified and cle.report.converged
    # expand -> dw -> project in 4 blocks, squeeze-excite fc1 -> fc2 in 2 (see GUIDE section 4),
    # and the two branches through the channel Concat into the last block (this model carries no
    # inferred shapes: the Concat's channel counts come from the branches' convs)
    assert len(cle.report.pairs) == 10
    data = np.load(shared_path("models", "digits_test.npz"))
    x, y = data["x"][:256].astype(np.float32), data["y"][:256]
    ref, got = run_ort(reference, {"image": x})[0], run_ort(out, {"image": x})[0]
    assert np.abs(got - ref).max() / np.abs(ref).max() <= RTOL
    assert np.mean(got.argmax(1) == y) == np.mean(ref.argmax(1) == y)


@pytest.fixture(scope="module")
def mobilenet_cle():
    model = _mobilenetv2_relu()
    out, cle, modified = _apply(model, steps=-1)
    assert modified
    return model, out, cle


@pytest.mark.real_model
def test_mobilenetv2_outputs_preserved(mobilenet_cle):
    model, out, cle = mobilenet_cle
    feeds = {"input": _rng(7).standard_normal((2, 3, 224, 224)).astype(np.float32)}
    ref, got = run_ort(model, feeds)[0], run_ort(out, feeds)[0]
    assert np.abs(got - ref).max() / np.abs(ref).max() <= RTOL
    np.testing.assert_array_equal(got.argmax(1), ref.argmax(1))
    # 17 inverted-residual blocks: expand -> dw -> project, plus stem conv -> dw -> project and
    # project -> expand where no residual Add reads the project output
    assert len(cle.report.pairs) == 36
    assert cle.report.converged


@pytest.mark.real_model
def test_mobilenetv2_relu6_pairs_skipped_without_replacement():
    model = onnx.load(shared_path("models", "mobilenetv2_rebuilt.onnx"))
    _, cle, _ = _apply(model, steps=1)
    # only the linear project -> expand joins remain (no ReLU6 between them)
    assert all(p.through == () for p in cle.report.pairs)
    assert sum("ReplaceClip6Relu" in s.reason for s in cle.report.skipped) == 35


@pytest.mark.real_model
def test_mobilenetv2_depthwise_per_tensor_error_drops(mobilenet_cle):
    model, out, _ = mobilenet_cle
    before, after = [], []
    for node in model.graph.node:
        if node.op_type != "Conv" or next(a.i for a in node.attribute if a.name == "group") == 1:
            continue
        before.append(_sqnr_db(_node_weight(model, node.name)))
        after.append(_sqnr_db(_node_weight(out, node.name)))
    assert len(before) == 17
    before, after = np.array(before), np.array(after)
    # measured (steps=-1): mean SQNR of the 17 depthwise weights 32.2 -> 38.1 dB, 16 of 17 better
    assert after.mean() > before.mean() + 4.5
    assert (after > before).sum() >= 15


# --- gate --------------------------------------------------------------------------------------


def _gate_pair(w1: np.ndarray, w2: np.ndarray) -> onnx.ModelProto:
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["a"], name="c1", kernel_shape=[1, 1]),
        helper.make_node("Relu", ["a"], ["h"], name="r"),
        helper.make_node("Conv", ["h", "w2"], ["y"], name="c2", kernel_shape=[1, 1]),
    ]
    return make_model(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, w1.shape[1], 4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, w2.shape[0], 4, 4])],
        {"w1": w1, "w2": w2},
    )


def test_gate_applies_a_scaling_that_lowers_pof2_weight_noise():
    """Conv 1's channel 0 is 64x wider than the others and conv 2 reads it 64x more weakly (as
    after folding a BatchNorm): the per-tensor grid crushes the narrow channels of both."""
    rng = _rng(11)
    w1 = rng.normal(0, 1, (4, 4, 1, 1)).astype(np.float32)
    w1[0] *= 64
    w2 = rng.normal(0, 1, (4, 4, 1, 1)).astype(np.float32)
    w2[:, 0] *= 1 / 64
    model = _gate_pair(w1, w2)
    from quark_onnx.passes._cle_noise import pof2_noise_ratio

    out, cle, modified = _apply(model, gate=True)
    assert modified and not cle.report.rejected
    new = {t.name: onnx.numpy_helper.to_array(t) for t in out.graph.initializer}
    assert pof2_noise_ratio(new["w1"]) + pof2_noise_ratio(new["w2"]) < pof2_noise_ratio(
        w1
    ) + pof2_noise_ratio(w2)
    _assert_same_outputs(model, out)


def test_gate_refuses_a_scaling_that_raises_pof2_weight_noise():
    """Both convs hold exact int8 codes at one power-of-two scale (no rounding noise at all);
    equalizing would move them off their grids, so the pair must stay as it is."""
    rng = _rng(12)
    w1 = (rng.integers(-127, 128, (4, 4, 1, 1)) / 128).astype(np.float32)
    w1[0] = rng.integers(-15, 16, (4, 1, 1)) / 128  # ranges differ: a change is proposed
    w2 = (rng.integers(-127, 128, (4, 4, 1, 1)) / 16).astype(np.float32)
    model = _gate_pair(w1, w2)
    _, cle, modified = _apply(model, gate=True)
    assert not modified and cle.report.rejected == ["c1 -> c2"]
    _, _, changed = _apply(model, gate=False)
    assert changed  # without the gate the pair is rescaled


def test_gate_refuses_a_scaling_that_trades_one_layers_precision_for_the_others():
    """Conv 2 holds exact int8 codes (no rounding noise); conv 1's channels are 64x apart, so
    equalizing lowers the pair's summed noise but puts conv 2 off its grid: refused."""
    from quark_onnx.passes._cle_noise import pof2_noise_ratio

    rng = _rng(0)
    w1 = rng.normal(0, 1, (8, 8, 1, 1)).astype(np.float32)
    w1[0] *= 16
    w2 = (rng.integers(-127, 128, (8, 8, 1, 1)) / 16).astype(np.float32)
    model = _gate_pair(w1, w2)
    # the proposal: s = sqrt(r1 / r2) per channel (no bias to read here), and its damped steps
    s = np.sqrt(output_channel_ranges(w1) / input_channel_ranges(w2, 1))
    new1, new2 = w1 / s.reshape(-1, 1, 1, 1), w2 * s.reshape(1, -1, 1, 1)
    assert pof2_noise_ratio(new1) + pof2_noise_ratio(new2) < pof2_noise_ratio(w1)  # sum lower
    for power in (1.0, 0.5, 0.25):  # but conv 2 gets worse at every step
        assert pof2_noise_ratio(w2 * s.reshape(1, -1, 1, 1) ** power) > pof2_noise_ratio(w2)
    assert pof2_noise_ratio(w2) == 0.0
    _, cle, modified = _apply(model, gate="per_layer")
    assert not modified and cle.report.rejected == ["c1 -> c2"]
    # the default gate judges the pair's total noise at conv 2's output instead
    from quark_onnx.passes._cle_noise import propagated_noise

    before = sum(propagated_noise(w1, [(w2, 1, np.arange(8))]))
    lowers = any(
        sum(
            propagated_noise(
                w1 / (s**p).reshape(-1, 1, 1, 1),
                [(w2 * (s**p).reshape(1, -1, 1, 1), 1, np.arange(8))],
            )
        )
        < before
        for p in (1.0, 0.5, 0.25)
    )
    _, _, modified = _apply(model, gate=True)
    assert modified == lowers


def test_bad_gate_is_rejected():
    with pytest.raises(ConfigError, match="gate"):
        CrossLayerEqualization(gate="both")


def _with_negligible_channel(side: str) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """Conv A -> Relu -> Conv B whose channel 0 is ~0: A's weights 1e-7 of the widest with a
    large bias read by wide weights (``side = 'first'``, a constant channel), or B's weights
    reading it 1e-7 of the widest (``'second'``)."""
    model = _conv_act_conv(_relu())
    w = _weights(model)
    wa, wb, ba = w["wa"].copy(), w["wb"].copy(), w["ba"].copy()
    if side == "first":
        wa[0] = wa[0] / np.abs(wa[0]).max() * np.abs(wa).max() * 1e-7
        ba[0] = 5.0  # a constant channel: scale_append_bias must not make it a partner
        wb[:, 0] *= 100
    else:
        wb[:, 0] = wb[:, 0] / np.abs(wb[:, 0]).max() * np.abs(wb).max() * 1e-7
    for t in model.graph.initializer:
        if t.name in ("wa", "wb", "ba"):
            t.CopyFrom(onnx.numpy_helper.from_array({"wa": wa, "wb": wb, "ba": ba}[t.name], t.name))
    return model, {"wa": wa, "wb": wb, "ba": ba}


def test_constant_channel_read_by_wide_weights_is_never_a_partner():
    """A constant channel (~0 weights, large bias, wide readers) keeps s = 1 on both sides: its
    normalised range product is above 1, so no scaling puts it inside both layers' ranges."""
    model, w = _with_negligible_channel("first")
    out, _, modified = _apply(model, steps=1)
    assert modified
    _assert_same_outputs(model, out)
    np.testing.assert_array_equal(_node_weight(out, "A")[0], w["wa"][0])
    np.testing.assert_array_equal(_node_weight(out, "B")[:, 0], w["wb"][:, 0])
    np.testing.assert_array_equal(_node_weight(out, "A", 2)[0], w["ba"][0])
    assert np.any(_node_weight(out, "A")[1:] != w["wa"][1:])  # the rest is equalized


def test_channel_read_by_negligible_weights_is_placed_inside_both_ranges():
    """A channel its reader ignores (weights 1e-7) is not balanced with it, but placed where
    both its normalised ranges are equal and below the live channels' median (at the end
    point: the medians move while the live channels are equalized)."""
    model, _ = _with_negligible_channel("second")
    out, _, modified = _apply(model, steps=-1, threshold=1e-9)
    assert modified
    _assert_same_outputs(model, out)
    wa, wb = _node_weight(out, "A"), _node_weight(out, "B")
    r1 = np.maximum(output_channel_ranges(wa), np.abs(_node_weight(out, "A", 2)))
    r2 = input_channel_ranges(wb, 1)
    n1, n2 = r1[0] / np.median(r1[1:]), r2[0] / np.median(r2[1:])
    np.testing.assert_allclose(n1, n2, rtol=1e-3)
    assert n1 < 1e-2
    # the live channels are balanced as usual
    np.testing.assert_allclose(r1[1:], r2[1:], rtol=1e-6)


@pytest.mark.parametrize("seed", [0, 1])
def test_equalized_weights_do_not_depend_on_a_rescaling_of_the_channels(seed):
    """The same network with its channels rescaled (a ~0 channel included) equalizes to the same
    weights: the end point depends on the function, not on the input's scaling."""
    model, _ = _with_negligible_channel("second")
    w = _weights(model)
    factors = np.exp(_rng(seed + 10).uniform(np.log(1e-2), np.log(1e2), w["wa"].shape[0]))
    scaled = onnx.ModelProto()
    scaled.CopyFrom(model)
    new = {
        "wa": (w["wa"] * factors[:, None, None, None]).astype(np.float32),
        "ba": (w["ba"] * factors).astype(np.float32),
        "wb": (w["wb"] / factors[None, :, None, None]).astype(np.float32),
    }
    for t in scaled.graph.initializer:
        if t.name in new:
            t.CopyFrom(onnx.numpy_helper.from_array(new[t.name], t.name))
    # no bound on the cumulative factor: the ~0 channel's own factor (~5e3) times the rescaling
    # (up to 1e2) would pass the default 1e4
    options = dict(steps=-1, threshold=1e-9, max_scale=None)
    out_a, _, _ = _apply(model, **options)
    out_b, _, _ = _apply(scaled, **options)
    _assert_same_outputs(model, out_b)
    for node, index in (("A", 1), ("A", 2), ("B", 1)):
        np.testing.assert_allclose(
            _node_weight(out_b, node, index),
            _node_weight(out_a, node, index),
            rtol=1e-4,
            atol=1e-6 * float(np.abs(_node_weight(out_a, node, index)).max()),
        )


def test_propagated_noise_counts_channels_the_grid_rounds_away():
    """Channel 0 of conv 1 is 1000x narrower than the rest and conv 2 reads it 1000x harder:
    the per-tensor grid zeroes it. Its energy share is ~1e-7, so ||E||^2 / ||W||^2 hardly
    sees it; weighted by what conv 2 makes of it, it dominates."""
    from quark_onnx.passes._cle_noise import pof2_noise_ratio, propagated_noise

    rng = _rng(14)
    w1 = rng.normal(0, 1, (8, 8, 1, 1))
    w1[0] *= 1e-3
    w2 = rng.normal(0, 1, (8, 8, 1, 1))
    w2[:, 0] *= 1e3
    n1, _ = propagated_noise(w1, [(w2, 1, np.arange(8))])
    # channel 0 carries ~1/8 of what conv 2 sees and is lost: N1 >= 1/8, the energy ratio ~1e-4
    assert n1 > 0.125 and pof2_noise_ratio(w1) < n1 / 1000
    # the rescaling that undoes it leaves the weighting unchanged and removes the noise
    s = np.ones(8)
    s[0] = 1e-3
    m1, m2 = propagated_noise(
        w1 / s.reshape(-1, 1, 1, 1), [(w2 * s.reshape(1, -1, 1, 1), 1, np.arange(8))]
    )
    assert m1 < n1 / 100 and m2 < 1e-3


def test_randomly_rescaled_pair_is_equalized_back_through_the_gate():
    """Per-channel factors log-uniform in 1/100..100 through a Relu (the stress benchmark's
    transform): CLE until converged, gate on, brings conv 1's channel range spread back."""
    model = _conv_act_conv(_relu(), c=8)
    w = _weights(model)
    spread0 = channel_range_spread(w["wa"])
    s = np.exp(_rng(15).uniform(np.log(1e-2), np.log(1e2), 8)).astype(np.float32)
    stressed = {
        "wa": w["wa"] * s.reshape(-1, 1, 1, 1),
        "ba": w["ba"] * s,
        "wb": w["wb"] / s.reshape(1, -1, 1, 1),
    }
    for t in model.graph.initializer:
        if t.name in stressed:
            t.CopyFrom(onnx.numpy_helper.from_array(stressed[t.name].astype(np.float32), t.name))
    assert channel_range_spread(stressed["wa"]) > 100 * spread0
    out, _, modified = _apply(model, steps=-1, gate=True)
    assert modified
    _assert_same_outputs(model, out)
    assert channel_range_spread(_node_weight(out, "A")) < 4 * spread0


def _assert_float_exact(a: onnx.ModelProto, b: onnx.ModelProto) -> None:
    """``max |b - a| / max |a| <= 1e-5`` over the outputs (float32 rounding of the rescaled
    weights only)."""
    feeds = _feeds(a)
    for ref, got in zip(run_ort(a, feeds), run_ort(b, feeds), strict=True):
        rel = np.abs(got.astype(np.float64) - ref).max() / np.abs(ref).max()
        assert rel <= 1e-5, rel


@pytest.mark.parametrize("act", ["relu", "leaky_relu", "prelu"])
def test_converged_cle_does_not_depend_on_a_per_channel_rescaling(act):
    """Channel factors from 1/100 to 100 through a positively homogeneous activation (the
    stress benchmark's transform): the rescaled channels' ranges are 1e4 apart, yet CLE run to
    convergence reaches the same weights as on the original pair, because the balanced point
    ``r1_i = r2_i`` absorbs any factor (a channel is ~0 only by the product ``r1_i * r2_i``,
    which the rescaling leaves alone)."""
    nodes = {
        "relu": _relu(),
        "leaky_relu": [helper.make_node("LeakyRelu", ["a"], ["h"], alpha=0.1)],
        "prelu": [helper.make_node("PRelu", ["a", "slope"], ["h"])],
    }[act]
    extra = {"slope": np.linspace(0.05, 0.3, 8, dtype=np.float32).reshape(8, 1, 1)}
    model = _conv_act_conv(nodes, c=8, extra=extra if act == "prelu" else None)
    w = _weights(model)
    factors = np.exp(_rng(16).uniform(np.log(1e-2), np.log(1e2), 8))
    # the extremes on the channel conv B reads hardest (1/100) and the widest of conv A (100):
    # each is then below 1e-4 of the widest channel of one layer, which a per-layer "~0" test
    # takes for dead, so neither would ever be equalized
    small = int(np.argmax(input_channel_ranges(w["wb"], 1)))
    big = int(np.argmax(np.where(np.arange(8) == small, 0, output_channel_ranges(w["wa"]))))
    factors[[small, big]] = [1e-2, 1e2]
    stressed = onnx.ModelProto()
    stressed.CopyFrom(model)
    new = {
        "wa": w["wa"] * factors.reshape(-1, 1, 1, 1),
        "ba": w["ba"] * factors,
        "wb": w["wb"] / factors.reshape(1, -1, 1, 1),
    }
    for t in stressed.graph.initializer:
        if t.name in new:
            t.CopyFrom(onnx.numpy_helper.from_array(new[t.name].astype(np.float32), t.name))
    _assert_float_exact(model, stressed)
    ref, _, _ = _apply(model, steps=-1)
    out, cle, modified = _apply(stressed, steps=-1)
    assert modified and cle.report.converged
    _assert_float_exact(model, out)
    for node, index in (("A", 1), ("A", 2), ("B", 1)):
        got, want = _node_weight(out, node, index), _node_weight(ref, node, index)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * np.abs(want).max())


# --- component gate ------------------------------------------------------------------------------


def test_activation_noise_is_the_power_of_two_step_over_the_signal():
    """Two channels, maxima 1 and 100, read with column energies 4 and 1: the step is the
    power of two holding 100 / 127 (1.0), the noise D^2/12 * sum rho_c reads_c over the signal
    sum E[y_c^2] reads_c; dividing channel 1 by 10 (and its reads by 1/100) makes the step
    2^-3 and leaves the signal alone."""
    from quark_onnx.graph.channels import ChannelStats
    from quark_onnx.passes._cle_noise import activation_noise

    stats = ChannelStats(np.array([1.0, 100.0]), np.array([0.25, 400.0]), np.array([0.5, 1.0]))
    reads = np.array([4.0, 1.0])
    assert activation_noise(stats, np.ones(2), reads) == pytest.approx(
        1.0 / 12 * (0.5 * 4 + 1.0) / (0.25 * 4 + 400.0)
    )
    scale = np.array([1.0, 10.0])
    assert activation_noise(stats, scale, reads * np.square(scale)) == pytest.approx(
        2.0**-6 / 12 * (0.5 * 4 + 100.0) / (0.25 * 4 + 400.0)
    )


def _stressed_pair(factors: np.ndarray) -> onnx.ModelProto:
    """Conv -> Relu -> Conv whose channels were multiplied by ``factors`` (float-exact)."""
    model = _conv_act_conv(_relu(), c=8)
    w = _weights(model)
    new = {
        "wa": w["wa"] * factors.reshape(-1, 1, 1, 1),
        "ba": w["ba"] * factors,
        "wb": w["wb"] / factors.reshape(1, -1, 1, 1),
    }
    for t in model.graph.initializer:
        if t.name in new:
            t.CopyFrom(onnx.numpy_helper.from_array(new[t.name].astype(np.float32), t.name))
    return model


def test_component_gate_keeps_the_equalized_weights_where_they_predict_less_noise():
    """Randomly rescaled channels (1/100..100): with the activation between the convs measured
    on samples, equalizing predicts far less noise; the result is the converged equalization."""
    model = _stressed_pair(np.exp(_rng(17).uniform(np.log(1e-2), np.log(1e2), 8)))
    feeds = _feeds(model, seed=3)
    out, cle, modified = _apply(model, steps=-1, gate="component", sample_feeds=feeds)
    assert modified
    (choice,) = cle.report.components
    assert choice.kept and choice.noise_after < choice.noise_before / 10
    _assert_float_exact(model, out)
    ref, _, _ = _apply(model, steps=-1, gate=False)
    for node in ("A", "B"):
        np.testing.assert_array_equal(_node_weight(out, node), _node_weight(ref, node))


def test_component_gate_leaves_a_pair_alone_when_equalizing_predicts_more_noise():
    """Both convs hold exact int8 codes at one power-of-two scale: any rescaling only adds
    rounding noise, so the equalized weights are dropped and the model is left as it was."""
    rng = _rng(12)
    w1 = (rng.integers(-127, 128, (4, 4, 1, 1)) / 128).astype(np.float32)
    w1[0] = rng.integers(-15, 16, (4, 1, 1)) / 128
    w2 = (rng.integers(-127, 128, (4, 4, 1, 1)) / 16).astype(np.float32)
    model = _gate_pair(w1, w2)
    out, cle, modified = _apply(model, steps=-1, gate="component", sample_feeds=_feeds(model))
    assert not modified
    (choice,) = cle.report.components
    assert not choice.kept and choice.noise_after > choice.noise_before
    assert cle.report.rejected == ["c1 -> c2"]
    np.testing.assert_array_equal(_node_weight(out, "c1"), w1)
    np.testing.assert_array_equal(_node_weight(out, "c2"), w2)


def test_components_are_pairs_that_share_layers():
    """A -> B -> C (two pairs sharing B) is one component; a separate D -> E pair another."""
    from quark_onnx.passes._cle_solver import _components

    a, b, c, d, e = (object() for _ in range(5))

    class P:
        def __init__(self, first, readers):
            self.first, self.reader_layers = first, readers

    pairs = [P(a, [b]), P(d, [e]), P(b, [c])]
    groups = _components(pairs)
    assert [[pairs.index(p) for p in g] for g in groups] == [[0, 2], [1]]


def test_concat_channel_counts_come_from_the_producers_without_shapes():
    """A model with no recorded shapes (not run through shape inference): the Concat's input
    channel counts are read from the convs that produce them, so the pair is still found."""
    rng = _rng(21)
    inits = {
        "w1": rng.standard_normal((4, 3, 1, 1)).astype(np.float32),
        "w2": rng.standard_normal((6, 3, 1, 1)).astype(np.float32),
        "w3": rng.standard_normal((5, 10, 1, 1)).astype(np.float32),
    }
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["a"], name="A", kernel_shape=[1, 1]),
        helper.make_node("Relu", ["a"], ["ra"]),
        helper.make_node("Conv", ["x", "w2"], ["b"], name="B", kernel_shape=[1, 1]),
        helper.make_node("LeakyRelu", ["b"], ["rb"], alpha=0.1),
        helper.make_node("Concat", ["ra", "rb"], ["c"], axis=1),
        helper.make_node("Conv", ["c", "w3"], ["y"], name="C", kernel_shape=[1, 1]),
    ]
    x, y = _io(3, 5)
    model = make_model(nodes, [x], [y], inits)
    del model.graph.value_info[:]
    ir_model = ir.from_proto(model)
    for node in ir_model.graph:
        for value in node.outputs:
            value.shape = None
    cle = CrossLayerEqualization(steps=-1, gate=False)
    out = ir.to_proto(cle(ir_model).model)
    assert sorted((p.first, p.second) for p in cle.report.pairs) == [("A", "C"), ("B", "C")]
    _assert_float_exact(model, out)


def test_channel_statistics_over_several_feeds_equal_numpy_over_all_samples():
    model = _conv_act_conv(_relu())
    feeds = [_feeds(model, seed) for seed in (1, 2, 3)]
    stats = channel_statistics(ir.serde.deserialize_model(model), feeds, ["h", "y"])
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    probe.graph.output.append(onnx.ValueInfoProto(name="h"))
    for index, name in ((1, "h"), (0, "y")):
        values = np.concatenate([run_ort(probe, f)[index] for f in feeds]).astype(np.float64)
        flat = np.moveaxis(values, 1, 0).reshape(values.shape[1], -1)
        np.testing.assert_allclose(stats[name].max_abs, np.abs(flat).max(axis=1), rtol=1e-12)
        np.testing.assert_allclose(stats[name].mean_square, np.square(flat).mean(axis=1), rtol=1e-9)
        np.testing.assert_allclose(stats[name].nonzero, np.mean(flat != 0, axis=1), rtol=1e-12)
    assert np.any(stats["h"].nonzero < 1.0)  # the Relu's zeros are counted


def test_lazy_output_ranges_are_those_of_the_scaled_weight_peaks_bit_for_bit():
    """The row maxima divide by the row's pending scale after the max: the same floats as
    dividing every peak first (grouped and plain convs, scales far from 1)."""
    from quark_onnx.passes._cle_solver import _Layer

    rng = _rng(3)
    for shape, group in [((12, 4, 3, 3), 3), ((8, 8, 1, 1), 1), ((6, 1, 3, 3), 6)]:
        weight = rng.standard_normal(shape)
        layer = _Layer(node=None, weight=weight, bias=None, group=group, original=weight)
        layer.lazy_input_ranges()  # starts the pending scaling
        layer.out_scale = np.exp(rng.normal(scale=3, size=shape[0]))
        layer.in_scale = np.exp(rng.normal(scale=3, size=shape[1] * group))
        peaks = layer._current_peaks()  # the per-peak division
        np.testing.assert_array_equal(
            layer.lazy_output_ranges(), peaks.max(axis=2).reshape(-1), strict=True
        )


def test_propagated_noise_with_shared_errors_is_unchanged():
    """Rounding errors reused across pairs sharing a layer give the numbers computed afresh."""
    from quark_onnx.passes._cle_noise import propagated_noise

    rng = _rng(4)
    w1, w2, w3 = (rng.standard_normal(s) for s in [(8, 3, 3, 3), (6, 8, 1, 1), (4, 6, 3, 3)])
    errors: dict = {}
    shared = propagated_noise(w1, [(w2, 1, np.arange(8))], errors)
    shared += propagated_noise(w2, [(w3, 1, np.arange(6))], errors)
    assert len(errors) == 3  # w2 rounded once for both pairs
    fresh = propagated_noise(w1, [(w2, 1, np.arange(8))])
    fresh += propagated_noise(w2, [(w3, 1, np.arange(6))])
    assert shared == fresh
