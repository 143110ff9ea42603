"""What second-order rounding fits a layer to (``FastFinetune.Target``): the statistics of each
target against a numpy oracle (layer_statistics' module doc)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from quark_onnx.accuracy.adaround import AdaRoundSettings, gptq_rounding
from quark_onnx.accuracy.layer_statistics import TARGETS, _Geometry, _statistics, im2col
from quark_onnx.errors import ConfigError


def _layer(op: str, **attrs) -> SimpleNamespace:
    node = ir.serde.deserialize_node(onnx.helper.make_node(op, ["x", "w"], ["y"], **attrs))
    return SimpleNamespace(op_type=op, node=node)


CONV = {"group": 2, "kernel_shape": [3, 3], "pads": [1, 1, 1, 1], "strides": [1, 1]}


def _conv_case(rng: np.random.Generator, n: int = 3):
    w = rng.normal(size=(4, 3, 3, 3))  # 4 outputs, 2 groups of 3 inputs
    b = rng.normal(size=4)
    xs = [rng.normal(size=(1, 6, 7, 7)) for _ in range(n)]
    geo = _Geometry(2, (3, 3), (1, 1), (1, 1), (1, 1, 1, 1))
    return w, b, xs, geo


def _conv_out(w: np.ndarray, b: np.ndarray, x: np.ndarray, geo: _Geometry) -> np.ndarray:
    cols = im2col(x, geo)  # (g, K, P)
    y = np.matmul(w.reshape(2, 2, -1), cols).reshape(4, *x.shape[2:])
    return (y + b.reshape(4, 1, 1))[None]


def test_weights_target_is_the_gram_times_the_float_weights():
    """``"weights"``: ``C = G W^T`` and the constant ``tr(W G W^T)``, whatever the float output
    (here unrelated noise); ``G`` is the float target's."""
    rng = np.random.default_rng(3)
    w, b, xs, geo = _conv_case(rng)
    ts = [rng.normal(size=(1, 4, 7, 7)) for _ in xs]
    layer = _layer("Conv", **CONV)
    _, gram, cross, const, _ = _statistics(layer, w, b, xs, ts, target="weights")
    cols = np.concatenate([im2col(x, geo) for x in xs], axis=2)
    g_oracle = np.matmul(cols, np.swapaxes(cols, 1, 2))
    w_oracle = w.reshape(2, 2, -1)
    np.testing.assert_allclose(gram, g_oracle, rtol=1e-12)
    np.testing.assert_allclose(cross, np.matmul(g_oracle, np.swapaxes(w_oracle, 1, 2)), rtol=1e-10)
    assert const == pytest.approx(float(np.sum((np.matmul(w_oracle, cols)) ** 2)), rel=1e-10)
    _, gram_f, cross_f, _, _ = _statistics(layer, w, b, xs, ts, target="float")
    np.testing.assert_array_equal(gram, gram_f)
    assert not np.allclose(cross, cross_f)


def test_every_target_gives_the_same_statistics_and_rounding_on_noise_free_inputs():
    """Quantized input equal to the float input and ``T = W X + b``: the three targets are one
    quadratic loss, and second-order rounding picks the same codes."""
    rng = np.random.default_rng(4)
    w, b, xs, geo = _conv_case(rng)
    ts = [_conv_out(w, b, x, geo) for x in xs]
    layer = _layer("Conv", **CONV)
    got = {t: _statistics(layer, w, b, xs, ts, target=t) for t in TARGETS}
    ref = got["float"]
    for target in ("weights", "debiased"):
        _, gram, cross, const, _ = got[target]
        np.testing.assert_allclose(gram, ref[1], rtol=1e-12)
        np.testing.assert_allclose(cross, ref[2], rtol=1e-8, atol=1e-9)
        assert const == pytest.approx(ref[3], rel=1e-8)
    codes = {t: gptq_rounding(s[0], 3, s[1], s[2], s[3]).codes for t, s in got.items()}
    assert np.array_equal(codes["weights"], codes["float"])
    assert np.array_equal(codes["debiased"], codes["float"])


def _gemm_case(rng: np.random.Generator, noise: float, offset: float = 0.0):
    """A 6x8 Gemm (bias 0.5) whose quantized input is ``(I + A) x`` (inputs and their error
    shifted by ``offset`` and ``0.3 offset``) plus independent noise;
    returns the float weights, inputs, targets and each target's fitted weights (``C = G V*^T``
    for the weights and debiased targets, ``V*^T = G^-1 C`` for the float one)."""
    w = rng.normal(size=(6, 8))
    a = 0.2 * rng.normal(size=(8, 8))
    xs = [rng.normal(size=(256, 8)) + offset for _ in range(16)]
    xq = [x @ (np.eye(8) + a).T + 0.3 * offset + noise * rng.normal(size=x.shape) for x in xs]
    ts = [x @ w.T + 0.5 for x in xs]
    layer = _layer("Gemm", transB=1)
    fits = {}
    for target in TARGETS:
        _, gram, cross, _, _ = _statistics(layer, w, np.full(6, 0.5), xq, ts, target=target)
        fits[target] = np.linalg.solve(gram, cross)[0].T
    return w, np.concatenate(xq), np.concatenate(ts) - 0.5, fits


def _slopes(v: np.ndarray, xq: np.ndarray, t: np.ndarray) -> np.ndarray:
    """Per output channel: centred cov(fitted, target) / var(target)."""
    y = xq @ v.T
    yc, tc = y - y.mean(0), t - t.mean(0)
    return np.sum(yc * tc, 0) / np.sum(tc * tc, 0)


def test_weights_target_fits_the_float_weights_and_float_target_undoes_a_linear_error():
    """Noise-free ``Xq = (I + A) X``: the weights target is ``W`` whatever the input error;
    the float target's least-squares fit undoes it (slope 1 per channel, up to the ridge)."""
    w, xq, t, fits = _gemm_case(np.random.default_rng(5), noise=0.0)
    np.testing.assert_allclose(fits["weights"], w, atol=1e-8)
    np.testing.assert_allclose(_slopes(fits["float"], xq, t), 1.0, atol=1e-3)


def test_debiased_target_has_slope_one_where_the_float_target_shrinks():
    """Independent input noise of the signal's size: the float target's fitted output regressed
    on the float output has slopes well below 1 (attenuation); the debiased target's are 1 on
    the fitted data, channel by channel (the ridge does not change that: the gain is computed
    on the ridge fit)."""
    _, xq, t, fits = _gemm_case(np.random.default_rng(6), noise=1.0, offset=1.0)
    assert np.all(_slopes(fits["float"], xq, t) < 0.85)
    np.testing.assert_allclose(_slopes(fits["debiased"], xq, t), 1.0, rtol=1e-9)


def test_target_setting_is_validated():
    assert AdaRoundSettings.from_options({"Target": "debiased"}).Target == "debiased"
    assert AdaRoundSettings().Target == "float"
    with pytest.raises(ConfigError, match="Target='floats' is not one of 'float'"):
        AdaRoundSettings.from_options({"Target": "floats"})
