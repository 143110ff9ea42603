"""CLE's noise-minimising channel scales (passes/cle_noise_scales.py): float outputs preserved,
less predicted noise than the equalized point, the same weights for any per-channel rescaling,
and nothing done where the component gate leaves a model alone."""

from __future__ import annotations

import math

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from conftest import make_model, run_ort
from onnx import TensorProto, helper

import quark_onnx.passes.cross_layer_equalization as cle_module
from quark_onnx.passes import CrossLayerEqualization
from quark_onnx.passes.cle_noise_scales import expected_noise
from quark_onnx.passes.cross_layer_equalization import (
    CLEReport,
    channel_statistics,
    propagated_noise,
)


def _pair_model(factors: np.ndarray, seed: int = 6) -> onnx.ModelProto:
    """x -> Conv A (3x3, 8 ch, bias) -> Relu -> Conv B (3x3) -> y, channel ``i`` of A
    multiplied by ``factors[i]`` and B's reading of it divided by it (float-exact)."""
    rng = np.random.default_rng(seed)
    wa = rng.standard_normal((8, 3, 3, 3)) * np.logspace(0, 1, 8).reshape(-1, 1, 1, 1)
    ba = rng.standard_normal(8) * 0.1
    wb = rng.standard_normal((5, 8, 3, 3))
    inits = {
        "wa": (wa * factors.reshape(-1, 1, 1, 1)).astype(np.float32),
        "ba": (ba * factors).astype(np.float32),
        "wb": (wb / factors.reshape(1, -1, 1, 1)).astype(np.float32),
        "bb": rng.standard_normal(5).astype(np.float32),
    }
    conv = {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1]}
    nodes = [
        helper.make_node("Conv", ["x", "wa", "ba"], ["a"], name="A", **conv),
        helper.make_node("Relu", ["a"], ["h"], name="act"),
        helper.make_node("Conv", ["h", "wb", "bb"], ["y"], name="B", **conv),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 8, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 5, 8, 8])
    return make_model(nodes, [x], [y], inits)


def _feeds(seed: int = 3) -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(seed).standard_normal((2, 3, 8, 8)).astype(np.float32)}


def _stress(seed: int) -> np.ndarray:
    return np.exp(np.random.default_rng(seed).uniform(np.log(1e-2), np.log(1e2), 8))


def _run(model: onnx.ModelProto) -> tuple[onnx.ModelProto, CrossLayerEqualization]:
    cle = CrossLayerEqualization(steps=-1, threshold=1e-9, gate="component", sample_feeds=_feeds())
    out = ir.to_proto(cle(ir.from_proto(model)).model)
    onnx.checker.check_model(out)
    return out, cle


def _weight(model: onnx.ModelProto, node: str, index: int = 1) -> np.ndarray:
    name = next(n for n in model.graph.node if n.name == node).input[index]
    return next(onnx.numpy_helper.to_array(t) for t in model.graph.initializer if t.name == name)


def _max_rel(a: onnx.ModelProto, b: onnx.ModelProto) -> float:
    feeds = _feeds(seed=7)
    ref, got = run_ort(a, feeds)[0].astype(np.float64), run_ort(b, feeds)[0]
    return float(np.abs(got - ref).max() / np.abs(ref).max())


def test_refined_scales_keep_the_float_outputs_and_predict_less_noise(monkeypatch):
    """A rescaled pair (factors 1/100..100): the gate keeps the equalized group, and the
    refinement moves it to scales whose predicted noise is below the equalized point's; the
    float outputs stay within 1e-5 (float32 rounding of the rescaled weights only)."""
    model = _pair_model(_stress(17))
    out, cle = _run(model)
    (choice,) = cle.report.components
    assert choice.kept
    assert _max_rel(model, out) <= 1e-5

    monkeypatch.setattr(cle_module, "refine_component", lambda comp, stats, noise, b, w: b)
    equalized, plain = _run(model)
    (plain_choice,) = plain.report.components
    assert plain_choice.kept
    assert choice.noise_after < plain_choice.noise_after
    assert not np.allclose(_weight(out, "A"), _weight(equalized, "A"))
    # the refinement only rescales channels: A's rows and B's columns by reciprocal factors
    ratio_a = _weight(equalized, "A").reshape(8, -1)[:, 0] / _weight(out, "A").reshape(8, -1)[:, 0]
    ratio_b = _weight(out, "B")[0, :, 0, 0] / _weight(equalized, "B")[0, :, 0, 0]
    np.testing.assert_allclose(ratio_a, ratio_b, rtol=1e-5)


def test_refined_scales_do_not_depend_on_a_per_channel_rescaling():
    """Two different random rescalings of the same pair end on the same weights: the
    refinement starts from the equalized point and uses only rescaling-invariant quantities."""
    one, _ = _run(_pair_model(_stress(17)))
    two, _ = _run(_pair_model(_stress(29)))
    for node in ("A", "B"):
        np.testing.assert_allclose(_weight(one, node), _weight(two, node), rtol=1e-4, atol=1e-6)


def test_no_refinement_where_the_gate_leaves_the_model_alone(monkeypatch):
    """The unrescaled pair: equalizing predicts less than half the noise nowhere, so the
    model keeps its weights bit for bit and the refinement is never asked."""
    calls = []

    def spy(comp, stats, noise, before, weight_noise):
        calls.append(comp)
        return before

    monkeypatch.setattr(cle_module, "refine_component", spy)
    model = _pair_model(np.ones(8))
    out, cle = _run(model)
    (choice,) = cle.report.components
    assert not choice.kept
    assert calls == []
    for node in ("A", "B"):
        np.testing.assert_array_equal(_weight(out, node), _weight(model, node))


def test_expected_noise_is_exact_weight_noise_plus_grid_averaged_activation_noise():
    """numpy oracle: both weights' power-of-two noise at the readers plus the activation's
    ``(peak / 127)^2 * E[4^u] / 12 * sum rho_c reads_c / sum E[y_c^2] reads_c``, with
    ``E[4^u] = 3 / ln 4`` the mean of the squared power-of-two step over where the grid falls
    (checked by quadrature)."""
    model = ir.from_proto(_pair_model(_stress(5)))
    pass_ = CrossLayerEqualization(steps=-1, gate="component")
    (pair,) = pass_._find_pairs(model.graph, CLEReport())
    stats = channel_statistics(model, _feeds(), ["h"])
    got = expected_noise([pair], stats, propagated_noise)

    w1, w2 = pair.first.weight, pair.reader_layers[0].weight
    weights = sum(propagated_noise(w1, [(w2, 1, np.arange(8))]))
    stat = stats["h"]
    reads = np.square(w2).sum(axis=(0, 2, 3))
    u = (np.arange(100_000) + 0.5) / 100_000
    assert np.mean(4.0**u) == pytest.approx(3.0 / math.log(4.0), rel=1e-8)
    step2 = (stat.max_abs.max() / 127.0) ** 2 * 3.0 / math.log(4.0)
    act = step2 / 12.0 * np.sum(stat.nonzero * reads) / np.sum(stat.mean_square * reads)
    assert got == pytest.approx(weights + act, rel=1e-12)
