"""MigrateActivationOutliers: bit-identical float outputs, the rescaled gains, weights and
restoring Mul, and where it must not fire."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from conftest import make_model, run_ort
from onnx import TensorProto, helper

from quark_onnx import get_default_config
from quark_onnx.config.options import resolve_extra_options
from quark_onnx.errors import ConfigError
from quark_onnx.passes import MigrateActivationOutliers
from quark_onnx.passes._channel_scaling import power_of_two_scales
from quark_onnx.passes.migrate_activation_outliers import recorded_scales
from quark_onnx.pipeline.prepare import prepare_passes

H, S = 16, 6
OUTLIERS = [3, 11]
GAIN = 64.0  # the outlier channels' LayerNorm gain; the MatMul's rows are divided by it


def _model(
    *, producer: str = "norm", reader: str = "residual", gemm: bool = False
) -> onnx.ModelProto:
    """``x [1, S, H]`` -> LayerNormalization ``y`` (gain GAIN on OUTLIERS) -> MatMul ``m`` (rows
    of OUTLIERS divided by GAIN). ``reader``: "residual" (``out = m + y``), "none"
    (``out = m``), "relu" (``out = m + Relu(y)``). ``producer="mul"``: ``y`` is ``x`` times the
    gains (no LayerNorm). ``gemm``: also ``g = Gemm(Reshape(y, [-1, H]), B, transB=1)``."""
    rng = np.random.default_rng(0)
    gain = (1 + 0.1 * rng.standard_normal(H)).astype(np.float32)
    gain[OUTLIERS] = GAIN
    w = (0.2 * rng.standard_normal((H, H))).astype(np.float32)
    w[OUTLIERS] /= GAIN
    b = (0.2 * rng.standard_normal((H, H))).astype(np.float32)
    b[:, OUTLIERS] /= GAIN
    inits = {
        "gain": gain,
        "beta": (0.1 * rng.standard_normal(H)).astype(np.float32),
        "w": w,
        "b": b,
        "flat": np.array([-1, H], dtype=np.int64),
    }
    if producer == "norm":
        nodes = [helper.make_node("LayerNormalization", ["x", "gain", "beta"], ["y"], name="ln")]
    else:
        nodes = [helper.make_node("Mul", ["x", "gain"], ["y"], name="scale")]
    nodes.append(helper.make_node("MatMul", ["y", "w"], ["m"], name="mm"))
    if reader == "residual":
        nodes.append(helper.make_node("Add", ["m", "y"], ["out"], name="residual"))
    elif reader == "relu":
        nodes.append(helper.make_node("Relu", ["y"], ["r"], name="relu"))
        nodes.append(helper.make_node("Add", ["m", "r"], ["out"], name="add"))
    else:
        nodes.append(helper.make_node("Identity", ["m"], ["out"], name="id"))
    outputs = [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, S, H])]
    if gemm:
        nodes.append(helper.make_node("Reshape", ["y", "flat"], ["y2"], name="flatten"))
        nodes.append(helper.make_node("Gemm", ["y2", "b"], ["g"], name="gemm", transB=1))
        outputs.append(helper.make_tensor_value_info("g", TensorProto.FLOAT, [S, H]))
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, S, H])
    return make_model(nodes, [x], outputs, inits)


def _samples(n: int = 4, seed: int = 1) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [{"x": rng.standard_normal((1, S, H)).astype(np.float32)} for _ in range(n)]


def _run(model: onnx.ModelProto, **kwargs) -> tuple[MigrateActivationOutliers, onnx.ModelProto]:
    pass_ = MigrateActivationOutliers(_samples(), **kwargs)
    ir_model = ir.from_proto(model)
    result = pass_(ir_model)
    return pass_, ir.to_proto(result.model) if result.modified else model


def _init(model: onnx.ModelProto, node_name: str, index: int) -> np.ndarray:
    node = next(n for n in model.graph.node if n.name == node_name)
    name = node.input[index]
    return next(onnx.numpy_helper.to_array(t) for t in model.graph.initializer if t.name == name)


def test_post_ln_block_is_rescaled_exactly():
    model = _model(gemm=True)
    pass_, after = _run(model)
    assert pass_.report == [("ln", 2, 2, 1)]  # two channels, MatMul and Gemm, one residual Add
    gain, new_gain = _init(model, "ln", 1), _init(after, "ln", 1)
    s = gain / new_gain
    assert set(np.flatnonzero(s != 1.0)) == set(OUTLIERS)
    assert np.all(s[OUTLIERS] > 1) and np.all(np.log2(s) == np.round(np.log2(s)))
    # alpha 0.5: max|y_j| / s_j = max|W_j| * s_j within the power-of-two rounding (a factor 2)
    np.testing.assert_array_equal(_init(after, "ln", 2) * s, _init(model, "ln", 2))
    np.testing.assert_array_equal(_init(after, "mm", 1), _init(model, "mm", 1) * s[:, None])
    np.testing.assert_array_equal(_init(after, "gemm", 1), _init(model, "gemm", 1) * s[None, :])
    residual = next(n for n in after.graph.node if n.name == "residual")
    restore = next(n for n in after.graph.node if n.output[0] in residual.input)
    assert restore.op_type == "Mul" and restore.input[0] == "y"
    feeds = _samples(3, seed=7)
    for feed in feeds:  # held-out inputs: the same bits
        for a, b in zip(run_ort(model, feed), run_ort(after, feed), strict=True):
            np.testing.assert_array_equal(a, b)


def test_layer_norm_read_only_by_linear_layers_is_folded_without_mul():
    model = _model(reader="none")
    pass_, after = _run(model, restore=False)
    ((name, _, linears, adds),) = pass_.report
    assert (name, linears, adds) == ("ln", 1, 0)
    assert set(OUTLIERS) <= set(np.flatnonzero(_init(after, "ln", 1) != _init(model, "ln", 1)))
    assert not any(n.op_type == "Mul" for n in after.graph.node)
    feed = _samples(1, seed=9)[0]
    np.testing.assert_array_equal(run_ort(model, feed)[0], run_ort(after, feed)[0])


def test_alpha_is_the_share_of_the_activation_range_moved():
    r1 = np.array([1.0, 1.0, 1.0, 64.0])  # one channel 64x wider, weights alike
    r2 = np.ones(4)
    expected = {0.0: 1.0, 0.5: 8.0, 1.0: 64.0}  # s = r1^alpha: none, half (in log2), all of it
    for alpha, s in expected.items():
        np.testing.assert_array_equal(power_of_two_scales(r1, r2, 12, alpha=alpha), [1, 1, 1, s])


@pytest.mark.parametrize(
    "case, kwargs",
    [
        ("no LayerNorm producer", dict(producer="mul")),  # nothing to fold the division into
        ("a non-linear reader", dict(reader="relu")),  # Relu would need the value restored
        ("no float Mul on the target", dict(restore=False)),  # residual Add, NPU config
        ("no samples", dict(samples=False)),
        # ordinary gains: the per-tensor range would not halve (the power-of-two rounding still
        # moves some channels by 2x, which buys nothing)
        ("no outlier channels", dict(flat=True)),
    ],
)
def test_must_not_fire(case, kwargs):
    restore = kwargs.pop("restore", True)
    samples = _samples() if kwargs.pop("samples", True) else []
    flat = kwargs.pop("flat", False)
    model = _model(**kwargs)
    if flat:  # ordinary gains and weights: every channel within the power-of-two rounding
        rng = np.random.default_rng(3)
        for init in model.graph.initializer:
            if init.name == "gain":
                init.CopyFrom(onnx.numpy_helper.from_array(np.ones(H, np.float32), "gain"))
            if init.name == "w":
                w = rng.choice([-0.3, 0.3], size=(H, H)).astype(np.float32)
                init.CopyFrom(onnx.numpy_helper.from_array(w, "w"))
    pass_ = MigrateActivationOutliers(samples, restore=restore)
    assert not pass_(ir.from_proto(model)).modified, case
    assert pass_.report == []


def test_pipeline_switch_alpha_and_npu_configs():
    for preset, restore in (("A8W8", True), ("XINT8", False)):
        qconfig = get_default_config(preset)
        options = resolve_extra_options({"MigrateActivationOutliers": True, "SmoothAlpha": 0.8})
        (pass_,) = [
            p
            for p in prepare_passes(qconfig, options, range_samples=_samples())
            if isinstance(p, MigrateActivationOutliers)
        ]
        assert (pass_.alpha, pass_.restore, len(pass_.sample_feeds)) == (0.8, restore, 4)
    off = resolve_extra_options({})
    qconfig = get_default_config("A16W8")
    assert not any(isinstance(p, MigrateActivationOutliers) for p in prepare_passes(qconfig, off))
    with pytest.raises(ConfigError, match="SmoothAlpha"):
        resolve_extra_options({"SmoothAlpha": 1.5})


def test_recorded_scales_rebuild_the_same_model_without_data():
    model = _model(gemm=True)
    _, measured = _run(model)
    recorded = recorded_scales(measured)
    s = _init(model, "ln", 1) / _init(measured, "ln", 1)
    assert recorded == {"ln": [int(k) for k in np.log2(s)]}
    rebuilt = MigrateActivationOutliers([], scales=recorded)(ir.from_proto(model)).model
    assert ir.to_proto(rebuilt).SerializeToString() == measured.SerializeToString()
    assert recorded_scales(model) == {}


def test_given_scales_for_an_unknown_layer_norm_are_named(caplog):
    pass_ = MigrateActivationOutliers([], scales={"nope": [0] * H})
    with caplog.at_level("WARNING"):
        assert not pass_(ir.from_proto(_model())).modified
    assert "'nope'" in caplog.text
