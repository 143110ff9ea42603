"""compare_models: exact numpy oracles for SQNR, cosine, max error, top-1 and the name matching."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from conftest import make_model
from onnx import TensorProto, helper

from quark_onnx.errors import CalibrationError
from quark_onnx.fidelity.compare import (
    agreement_kind,
    compare_models,
    match_quantized_tensors,
    sqnr_db,
)

F = TensorProto.FLOAT
S_X, S_R, S_Y = 2.0**-4, 2.0**-3, 2.0**-2


def vi(name, shape):
    return helper.make_tensor_value_info(name, F, shape)


def float_model(batch="N"):
    """Y = Relu(X) * 2."""
    return make_model(
        [
            helper.make_node("Relu", ["X"], ["R"], name="relu"),
            helper.make_node("Mul", ["R", "c"], ["Y"], name="mul"),
        ],
        [vi("X", [batch, 5])],
        [vi("Y", [batch, 5])],
        {"c": np.array(2.0, np.float32)},
    )


def qdq(t, scale, out=None):
    """QuantizeLinear/DequantizeLinear nodes and initializers of activation ``t`` (QDQ form)."""
    out = out or f"{t}_DequantizeLinear_Output"
    nodes = [
        helper.make_node(
            "QuantizeLinear", [t, f"{t}_scale", f"{t}_zp"], [f"{t}_QuantizeLinear_Output"]
        ),
        helper.make_node(
            "DequantizeLinear", [f"{t}_QuantizeLinear_Output", f"{t}_scale", f"{t}_zp"], [out]
        ),
    ]
    inits = {f"{t}_scale": np.array(scale, np.float32), f"{t}_zp": np.array(0, np.int8)}
    return nodes, inits


def quant_model(batch="N", r_name="R"):
    """The QDQ form of :func:`float_model`; the Mul constant is an int8 weight (value 2)."""
    (x_qdq, x_init), (r_qdq, r_init) = qdq("X", S_X), qdq(r_name, S_R)
    y_qdq, y_init = qdq("Y_QuantizeLinear_Input", S_Y, out="Y")
    nodes = [
        *x_qdq,
        helper.make_node("Relu", ["X_DequantizeLinear_Output"], [r_name], name="relu"),
        *r_qdq,
        helper.make_node(
            "DequantizeLinear", ["c_quantized", "c_scale", "c_zp"], ["c_DequantizeLinear_Output"]
        ),
        helper.make_node(
            "Mul",
            [f"{r_name}_DequantizeLinear_Output", "c_DequantizeLinear_Output"],
            ["Y_QuantizeLinear_Input"],
            name="mul",
        ),
        *y_qdq,
    ]
    inits = {
        **x_init,
        **r_init,
        **y_init,
        "c_quantized": np.array(64, np.int8),
        "c_scale": np.array(2.0**-5, np.float32),
        "c_zp": np.array(0, np.int8),
    }
    return make_model(nodes, [vi("X", [batch, 5])], [vi("Y", [batch, 5])], inits)


def q(x, s):
    return (np.clip(np.round(x / np.float32(s)), -128, 127) * np.float32(s)).astype(np.float32)


def sqnr(f, qv):
    f, qv = np.float64(f), np.float64(qv)
    return 10 * math.log10(np.sum(f * f) / np.sum((f - qv) ** 2))


def cosine(f, qv):
    f, qv = np.float64(f), np.float64(qv)
    return float(np.sum(f * qv) / math.sqrt(np.sum(f * f) * np.sum(qv * qv)))


@pytest.fixture
def feeds():
    rng = np.random.default_rng(0)
    data = [{"X": rng.normal(0, 3, size=(2, 5)).astype(np.float32)} for _ in range(3)]
    # 1.0 and 1.02 quantize to the same value: the quantized argmax falls on the first of the tie
    data[0]["X"][0] = [1.0, 1.02, -1.0, -1.0, -1.0]
    return data


def oracle(x):
    xq = q(x, S_X)
    rq = q(np.maximum(xq, 0), S_R)
    yq = q(rq * np.float32(2), S_Y)
    return {"X": (x, xq), "R": (np.maximum(x, 0), rq), "Y": (np.maximum(x, 0) * 2, yq)}


def test_metrics_match_the_numpy_oracle(feeds):
    result = compare_models(float_model(), quant_model(), feeds)
    x = np.concatenate([f["X"] for f in feeds])
    ref = oracle(x)
    assert result.samples == 3
    by_name = {t.name: t for t in result.layers}
    assert set(by_name) == {"X", "R", "Y"}  # the weight c is not compared
    assert by_name["R"].quantized_name == "R_DequantizeLinear_Output"
    assert by_name["Y"].quantized_name == "Y"
    for name, (f, qv) in ref.items():
        t = by_name[name]
        assert t.sqnr_db == pytest.approx(sqnr(f, qv), rel=1e-9)
        assert t.cosine == pytest.approx(cosine(f, qv), rel=1e-9)
        assert t.max_abs_error == pytest.approx(float(np.max(np.abs(f - qv))), rel=1e-6)
        assert t.elements == f.size
    assert [t.sqnr_db for t in result.layers] == sorted(t.sqnr_db for t in result.layers)
    (out,) = result.outputs
    f, qv = ref["Y"]
    assert out.sqnr_db == pytest.approx(sqnr(f, qv), rel=1e-9)
    expected_top1 = float(np.mean(np.argmax(f, 1) == np.argmax(qv, 1)))
    assert out.top1_agreement == expected_top1 == result.top1_agreement == 5 / 6
    assert out.rows == 6
    assert result.unmatched == []


def test_feeds_are_split_to_a_fixed_batch(feeds):
    """The quantized model takes batch 1; a 2-row feed runs as two samples, same numbers."""
    split = compare_models(float_model(), quant_model(batch=1), feeds)
    whole = compare_models(float_model(), quant_model(), feeds)
    assert split.samples == 6
    for a, b in zip(split.layers, whole.layers, strict=True):
        assert a.name == b.name
        assert a.sqnr_db == pytest.approx(b.sqnr_db, rel=1e-12)


def test_identical_models_have_infinite_sqnr_and_no_layers(feeds):
    model = float_model()
    result = compare_models(model, model, feeds)
    (out,) = result.outputs
    assert out.sqnr_db == math.inf and out.cosine == 1.0 and out.max_abs_error == 0.0
    assert out.top1_agreement == 1.0
    assert result.layers == []  # no QuantizeLinear/DequantizeLinear: nothing per layer
    data = json.loads(json.dumps(result.to_dict()))
    assert data["outputs"][0]["sqnr_db"] == "inf"


def test_renamed_tensor_is_listed_unmatched_not_compared(feeds):
    pairs, unmatched = match_quantized_tensors(float_model(), quant_model(r_name="R2"))
    assert "R2_DequantizeLinear_Output" not in pairs
    assert unmatched == ["R2_DequantizeLinear_Output: no float tensor named 'R2'"]
    result = compare_models(float_model(), quant_model(r_name="R2"), feeds)
    assert {t.name for t in result.layers} == {"X", "Y"}


def test_layers_off_and_empty_feeds(feeds):
    result = compare_models(float_model(), quant_model(), feeds, layers=False)
    assert result.layers == [] and len(result.outputs) == 1
    with pytest.raises(CalibrationError, match="no feeds"):
        compare_models(float_model(), quant_model(), [])


def test_summary_lists_worst_first(feeds):
    result = compare_models(float_model(), quant_model(), feeds)
    text = result.summary(worst=2)
    assert "worst 2 of 3" in text
    worst = result.layers[0].name
    assert text.index(f"  {worst}") < text.index(f"  {result.layers[1].name}")


# ------------------------------------------------------------------------------------------------
# Which agreement fits an output; infinite and NaN energies
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("shape", "kind"),
    [
        ((4,), "top1"),
        ((2, 10), "top1"),
        ((2, 10, 1, 1), "top1"),
        ((1, 1, 7), "top1"),
        ((1, 3, 8, 8), "argmax"),
        ((2, 19, 4, 1), "argmax"),
        ((1, 1, 8, 8), None),  # one channel: a probability map, nothing to take the argmax of
        ((1, 8400, 85), None),  # detector rows
        ((2, 1), None),
        ((), None),
    ],
)
def test_agreement_kind_by_shape(shape, kind):
    assert agreement_kind(shape) == kind


def identity_pair(shape, noise):
    """An Identity float model and a "quantized" one that adds the constant ``noise``."""
    f = make_model([helper.make_node("Identity", ["X"], ["Y"])], [vi("X", shape)], [vi("Y", shape)])
    q = make_model(
        [helper.make_node("Add", ["X", "n"], ["Y"])], [vi("X", shape)], [vi("Y", shape)],
        {"n": noise.astype(np.float32)},
    )  # fmt: skip
    return f, q


def test_dense_output_gets_argmax_over_channels_not_top1():
    rng = np.random.default_rng(3)
    shape = [2, 4, 3, 5]
    noise = rng.normal(0, 0.4, shape).astype(np.float32)
    f, q = identity_pair(shape, noise)
    feeds = [{"X": rng.normal(0, 1, shape).astype(np.float32)} for _ in range(3)]
    result = compare_models(f, q, feeds)
    (out,) = result.outputs
    x = np.concatenate([feed["X"] for feed in feeds])
    expected = float(np.mean(x.argmax(1) == (x + np.concatenate([noise] * 3)).argmax(1)))
    assert out.top1_agreement is None and result.top1_agreement is None
    assert out.argmax_agreement == expected == result.argmax_agreement
    assert (out.agreement, out.agreement_kind) == (expected, "argmax")
    assert out.rows == 3 * 2 * 3 * 5  # positions, not samples
    assert 0.5 < expected < 1.0  # the noise flips some positions and not all
    assert "argmax-over-channels agreement" in result.summary()
    assert json.loads(json.dumps(result.to_dict()))["outputs"][0]["argmax_agreement"] == expected


@pytest.mark.parametrize(
    ("signal", "noise", "expected"),
    [
        (1.0, 0.0, math.inf),
        (0.0, 1.0, -math.inf),
        (1.0, math.inf, -math.inf),
        (math.inf, 1.0, math.inf),
        (1e-300, 1e300, -math.inf),  # the ratio underflows
        (100.0, 1.0, 20.0),
    ],
)
def test_sqnr_of_zero_and_infinite_energies(signal, noise, expected):
    assert sqnr_db(signal, noise) == expected


@pytest.mark.parametrize(
    ("signal", "noise"), [(math.nan, 1.0), (1.0, math.nan), (math.inf, math.inf)]
)
def test_sqnr_of_nan_energies_is_nan(signal, noise):
    assert math.isnan(sqnr_db(signal, noise))


def test_an_output_gone_infinite_has_minus_infinite_sqnr_not_an_error():
    shape = [1, 4]
    noise = np.array([[0.0, np.inf, 0.0, 0.0]], np.float32)
    f, q = identity_pair(shape, noise)
    result = compare_models(f, q, [{"X": np.ones(shape, np.float32)}])
    (out,) = result.outputs
    assert out.sqnr_db == -math.inf
    assert json.loads(json.dumps(result.to_dict()))["outputs"][0]["sqnr_db"] == "-inf"


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--random", "1000000000"], "--random 1000000000: expected a number from 1 to 10000"),
        (["--random", "0"], "--random 0: expected a number from 1 to 10000"),
        (["--random", "1", "--worst", "-1"], "--worst -1: expected a number from 0 (0: all)"),
        (["--random", "1", "--limit", "0"], "--limit 0: expected a number from 1"),
    ],
)
def test_count_options_are_bounded(tmp_path, capsys, flags, words):
    import onnx

    from quark_onnx.cli import main

    path = tmp_path / "f.onnx"
    onnx.save(float_model(batch=1), path)
    before = path.read_bytes()
    assert main(["compare", str(path), str(path), *flags]) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err
    assert path.read_bytes() == before and sorted(tmp_path.iterdir()) == [path]


def test_count_options_at_their_bounds_are_accepted(tmp_path, capsys):
    """Must not fire: --worst 0 (all) and --random at 1 run."""
    import onnx

    from quark_onnx.cli import main

    path = tmp_path / "f.onnx"
    onnx.save(float_model(batch=1), path)
    assert main(["compare", str(path), str(path), "--random", "1", "--worst", "0"]) == 0
