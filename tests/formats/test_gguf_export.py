"""GGUF export of weight-only tensors: read back with gguf's own reader and dequantizer.

Oracle: ``quark_onnx.params.qparams.dequantize`` (the ONNX DequantizeLinear formula, itself checked
against onnxruntime here). The read-back values must be equal where every block's scale (and
``-scale·zero_point`` for Q4_1) is a float16 value, and within
``2^-11·s·(|q - z| + |z_m|) + 2^-22·|x|`` otherwise.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import pytest
from conftest import run_ort
from onnx import TensorProto, helper, numpy_helper

from quark_onnx.config.enums import QuantType
from quark_onnx.errors import ModelLoadError, ModelSaveError, QuantizationError
from quark_onnx.formats.gguf_export import export_gguf
from quark_onnx.params import qparams

K, N, M = 256, 96, 32  # x (1, K) @ W1 (K, N) -> (1, N) @ W2 (N, M) + B -> (1, M)


@pytest.fixture
def gguf():
    return pytest.importorskip("gguf")


def _params(w, qtype, *, symmetric, axis, scales="float32"):
    """MinMax g32 parameters with float32 scales, or scales rounded to ``float16`` (Q8_0 and
    Q4_0 exact; Q4_1's ``-d·z`` may need 11 + 4 bits) or to 7 significant bits (``"7bit"``:
    ``d·z`` fits float16's 11 bits, so Q4_1 is exact too)."""
    p = qparams.weight_params(w, qtype, symmetric=symmetric, axis=axis, block_size=32)
    if scales != "float32":
        if scales == "float16":
            scale = p.scale.astype(np.float16).astype(np.float32)
        else:
            mantissa, exponent = np.frexp(p.scale)
            scale = np.ldexp(np.round(mantissa * 128) / 128, exponent).astype(np.float32)
        assert np.array_equal(scale.astype(np.float16).astype(np.float32), scale)
        p = qparams.QuantParams(
            qtype=p.qtype,
            scale=scale,
            zero_point=p.zero_point,
            axis=p.axis,
            block_size=p.block_size,
            symmetric=p.symmetric,
        )
    return p


def _dq(name, codes, p, nodes, inits):
    """``name_quantized`` (codes) -> DequantizeLinear(axis, block_size) -> ``name_dq``."""
    inits += [
        numpy_helper.from_array(codes, f"{name}_quantized"),
        numpy_helper.from_array(p.scale, f"{name}_scale"),
        numpy_helper.from_array(p.zero_point, f"{name}_zero_point"),
    ]
    nodes.append(
        helper.make_node(
            "DequantizeLinear",
            [f"{name}_quantized", f"{name}_scale", f"{name}_zero_point"],
            [f"{name}_dq"],
            name=f"{name}_DequantizeLinear",
            axis=p.axis,
            block_size=p.block_size,
        )
    )


def _model(nodes, inputs, outputs, inits, opset=21):
    graph = helper.make_graph(nodes, "gguf_test", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 10
    onnx.checker.check_model(model)
    return model


def weight_only_model(*, scales: str, int8_axis: int = 0, seed: int = 0):
    """uint4 asymmetric g32 MatMul weight W1, int8 symmetric g32 weight W2, float bias B, and an
    int64 Reshape shape; the DequantizeLinear outputs are graph outputs too (for onnxruntime)."""
    rng = np.random.default_rng(seed)
    w1 = rng.normal(0.1, 0.05, (K, N)).astype(np.float32)  # asymmetric range
    w2 = rng.normal(0.0, 0.2, (N, M)).astype(np.float32)
    p1 = _params(w1, QuantType.QUInt4, symmetric=False, axis=0, scales=scales)
    p2 = _params(w2, QuantType.QInt8, symmetric=True, axis=int8_axis, scales=scales)
    q1, q2 = qparams.quantize(w1, p1), qparams.quantize(w2, p2)
    nodes, inits = [], []
    _dq("W1", q1, p1, nodes, inits)
    _dq("W2", q2, p2, nodes, inits)
    inits += [
        numpy_helper.from_array(rng.normal(size=M).astype(np.float32), "B"),
        numpy_helper.from_array(np.array([1, M], dtype=np.int64), "shape"),
    ]
    nodes += [
        helper.make_node("MatMul", ["x", "W1_dq"], ["h"]),
        helper.make_node("MatMul", ["h", "W2_dq"], ["h2"]),
        helper.make_node("Add", ["h2", "B"], ["h3"]),
        helper.make_node("Reshape", ["h3", "shape"], ["y"]),
    ]
    model = _model(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, K])],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, M]),
            helper.make_tensor_value_info("W1_dq", TensorProto.FLOAT, [K, N]),
            helper.make_tensor_value_info("W2_dq", TensorProto.FLOAT, [N, M]),
        ],
        inits,
    )
    return model, {"W1": (q1, p1), "W2": (q2, p2)}


def read_back(gguf, path: Path) -> dict[str, tuple[str, list[int], np.ndarray, list | None]]:
    """name -> (GGML type, GGUF dims, values in ONNX layout, stored axes) via gguf's reader."""
    reader = gguf.GGUFReader(path)
    axes = {}
    for key, fld in reader.fields.items():
        if key.startswith("quark_onnx.axes."):
            axes[key.removeprefix("quark_onnx.axes.")] = [int(fld.parts[i][0]) for i in fld.data]
    out = {}
    for t in reader.tensors:
        values = gguf.quants.dequantize(t.data, t.tensor_type)
        values = values.reshape(tuple(reversed([int(d) for d in t.shape])))
        if t.name in axes:
            values = np.transpose(values, np.argsort(axes[t.name]))
        out[t.name] = (t.tensor_type.name, [int(d) for d in t.shape], values, axes.get(t.name))
    return out


def stated_bound(q, p, m_zero_shift=0):
    s = qparams.broadcast_parameter(p.scale, q.shape, p.axis, p.block_size).astype(np.float64)
    z = qparams.broadcast_parameter(p.zero_point, q.shape, p.axis, p.block_size).astype(float)
    x = np.abs(qparams.dequantize(q, p).astype(np.float64))
    qf = q.astype(np.float64)
    return 2.0**-11 * s * (np.abs(qf - z) + np.abs(z + m_zero_shift)) + 2.0**-22 * x


def test_dequantize_reference_matches_onnxruntime():
    model, ref = weight_only_model(scales="float32")
    x = np.random.default_rng(1).normal(size=(1, K)).astype(np.float32)
    _, w1, w2 = run_ort(model, {"x": x})
    np.testing.assert_array_equal(w1, qparams.dequantize(*ref["W1"]))
    np.testing.assert_array_equal(w2, qparams.dequantize(*ref["W2"]))


def test_representable_scales_read_back_exactly(gguf, tmp_path):
    model, ref = weight_only_model(scales="7bit")
    out = tmp_path / "m.gguf"
    summary = export_gguf(model, out)
    back = read_back(gguf, out)
    assert summary["counts"] == {"Q4_1": 1, "Q8_0": 1, "F32": 1}
    assert summary["quantized"] == 2
    assert [w["name"] for w in summary["written"]] == ["W1", "W2", "B"]
    for name, qtype in (("W1", "Q4_1"), ("W2", "Q8_0")):
        gtype, dims, values, axes = back[name]
        q, p = ref[name]
        assert gtype == qtype
        # blocked along ONNX axis 0, so stored transposed: GGUF dims (innermost first) = ONNX shape
        assert axes == [1, 0]
        assert dims == list(q.shape)
        assert values.shape == q.shape
        np.testing.assert_array_equal(values, qparams.dequantize(q, p))
        info = next(w for w in summary["written"] if w["name"] == name)
        assert info["exact"] and info["max_abs_error"] == 0.0 and info["inexact_blocks"] == 0
        assert info["onnx_name"] == f"{name}_quantized" and info["onnx_shape"] == list(q.shape)
    b = numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == "B"))
    assert back["B"][0] == "F32" and back["B"][1] == [M]
    np.testing.assert_array_equal(back["B"][2], b)
    reasons = {s["name"]: s["reason"] for s in summary["skipped"]}
    assert set(reasons) == {"W1_scale", "W1_zero_point", "W2_scale", "W2_zero_point", "shape"}
    assert "Q4_1 blocks of 'W1'" in reasons["W1_scale"]
    assert "int64" in reasons["shape"]


def test_float32_scales_within_stated_bound(gguf, tmp_path):
    model, ref = weight_only_model(scales="float32")
    out = tmp_path / "m.gguf"
    summary = export_gguf(model, out)
    back = read_back(gguf, out)
    for name in ("W1", "W2"):
        q, p = ref[name]
        expected = qparams.dequantize(q, p).astype(np.float64)
        diff = np.abs(back[name][2].astype(np.float64) - expected)
        info = next(w for w in summary["written"] if w["name"] == name)
        # float32 MinMax scales are (almost) never float16 values: the error is real ...
        assert diff.max() > 0 and not info["exact"] and info["inexact_blocks"] > 0
        assert info["max_abs_error"] == pytest.approx(diff.max(), rel=0, abs=0)
        # ... and bounded as documented
        assert np.all(diff <= stated_bound(q, p)), name
        assert info["max_abs_error"] <= info["bound"] <= stated_bound(q, p).max()
        steps = diff / qparams.broadcast_parameter(p.scale, q.shape, p.axis, p.block_size)
        limit = 30 * 2.0**-11 if name == "W1" else 128 * 2.0**-11
        assert steps.max() <= limit * (1 + 1e-6)
        assert info["max_step_error"] == pytest.approx(steps.max(), rel=1e-6)


def test_float16_scales_exact_for_q8_0_and_bounded_for_q4_1(gguf, tmp_path):
    """Q8_0 stores only d: a float16 scale is enough. Q4_1 also stores m = fp16(-d·z), which
    needs up to 15 significant bits: it rounds in some blocks, within the bound."""
    model, ref = weight_only_model(scales="float16")
    out = tmp_path / "m.gguf"
    summary = export_gguf(model, out)
    back = read_back(gguf, out)
    info = {w["name"]: w for w in summary["written"]}
    np.testing.assert_array_equal(back["W2"][2], qparams.dequantize(*ref["W2"]))
    assert info["W2"]["exact"]
    q, p = ref["W1"]
    diff = np.abs(back["W1"][2].astype(np.float64) - qparams.dequantize(q, p))
    assert not info["W1"]["exact"] and info["W1"]["inexact_blocks"] > 0
    assert np.all(diff <= stated_bound(q, p))


def test_require_exact_refuses_non_fp16_scales(gguf, tmp_path):
    model, _ = weight_only_model(scales="float32")
    out = tmp_path / "m.gguf"
    with pytest.raises(QuantizationError, match=r"W1_quantized.*float16"):
        export_gguf(model, out, require_exact=True)
    assert list(tmp_path.iterdir()) == []  # nothing written, no temporary file left
    exact, _ = weight_only_model(scales="7bit")
    assert export_gguf(exact, out, require_exact=True)["quantized"] == 2


def test_block_axis_last_is_written_without_transpose(gguf, tmp_path):
    # an embedding-like table (V, D) blocked along D (the last ONNX axis), int4 symmetric -> Q4_0
    rng = np.random.default_rng(2)
    table = rng.normal(size=(5, 64)).astype(np.float32)
    p = _params(table, QuantType.QInt4, symmetric=True, axis=1, scales="float16")
    q = qparams.quantize(table, p)
    nodes, inits = [], []
    _dq("E", q, p, nodes, inits)
    nodes.append(helper.make_node("Gather", ["E_dq", "ids"], ["y"], axis=0))
    model = _model(
        nodes,
        [helper.make_tensor_value_info("ids", TensorProto.INT64, [3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 64])],
        inits,
    )
    out = tmp_path / "e.gguf"
    summary = export_gguf(model, out)
    gtype, dims, values, axes = read_back(gguf, out)["E"]
    assert (gtype, dims, axes) == ("Q4_0", [64, 5], None)  # GGUF order: ONNX shape reversed
    np.testing.assert_array_equal(values, qparams.dequantize(q, p))
    assert summary["written"][0]["exact"]


def test_int4_with_zero_point_is_q4_1(gguf, tmp_path):
    rng = np.random.default_rng(3)
    w = rng.normal(0.3, 0.1, (32, 8)).astype(np.float32)
    p = _params(w, QuantType.QInt4, symmetric=False, axis=0, scales="float32")
    assert np.any(p.zero_point.astype(int) != 0)
    q = qparams.quantize(w, p)
    nodes, inits = [], []
    _dq("W", q, p, nodes, inits)
    nodes.append(helper.make_node("MatMul", ["x", "W_dq"], ["y"]))
    model = _model(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 32])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8])],
        inits,
    )
    out = tmp_path / "w.gguf"
    summary = export_gguf(model, out)
    gtype, _, values, _ = read_back(gguf, out)["W"]
    assert gtype == "Q4_1" and summary["written"][0]["ggml_type"] == "Q4_1"
    diff = np.abs(values.astype(np.float64) - qparams.dequantize(q, p))
    assert np.all(diff <= stated_bound(q, p, m_zero_shift=8))


def test_unsupported_granularities_are_skipped_with_reasons(gguf, tmp_path):
    rng = np.random.default_rng(4)
    nodes, inits, outputs = [], [], []
    cases = {
        # per-channel int8 (the common onnxruntime weight form)
        "PC": (rng.normal(size=(64, 8)), QuantType.QInt8, True, 1, None),
        # block size 16 does not fill a GGML block
        "B16": (rng.normal(size=(64, 8)), QuantType.QUInt4, False, 0, 16),
        # axis of 40 elements: a short last group
        "S40": (rng.normal(size=(40, 8)), QuantType.QUInt4, False, 0, 32),
        # asymmetric int8 has a zero point Q8_0 cannot hold
        "A8": (rng.normal(0.5, 0.1, size=(64, 8)), QuantType.QInt8, False, 0, 32),
        # uint8 has no GGML block type here
        "U8": (rng.normal(size=(64, 8)), QuantType.QUInt8, False, 0, 32),
    }
    for name, (w, qtype, sym, axis, block) in cases.items():
        w = w.astype(np.float32)
        p = qparams.weight_params(w, qtype, symmetric=sym, axis=axis, block_size=block)
        _dq(name, qparams.quantize(w, p), p, nodes, inits)
        outputs.append(helper.make_tensor_value_info(f"{name}_dq", TensorProto.FLOAT, w.shape))
    # one float tensor, so that the file is written and the skip reasons can be read back
    inits.append(numpy_helper.from_array(np.ones(4, np.float32), "F"))
    nodes.append(helper.make_node("Identity", ["F"], ["F_out"]))
    outputs.append(helper.make_tensor_value_info("F_out", TensorProto.FLOAT, [4]))
    out = tmp_path / "s.gguf"
    summary = export_gguf(_model(nodes, [], outputs, inits), out)
    assert summary["quantized"] == 0 and [w["name"] for w in summary["written"]] == ["F"]
    reasons = {s["name"]: s["reason"] for s in summary["skipped"]}
    assert "channel" in reasons["PC_quantized"]
    assert "block size 16" in reasons["B16_quantized"]
    assert "40 elements" in reasons["S40_quantized"]
    assert "zero point" in reasons["A8_quantized"]
    assert "uint8" in reasons["U8_quantized"]
    assert "not a weight" in reasons["PC_scale"]
    assert [t.name for t in gguf.GGUFReader(out).tensors] == ["F"]


def test_float_model_writes_no_quantized_tensor(gguf, tmp_path):
    """Must not fire: a float model has no weight-only tensor; its floats are written as is."""
    rng = np.random.default_rng(5)
    w = rng.normal(size=(64, 32)).astype(np.float32)
    h = rng.normal(size=(32,)).astype(np.float16)
    bf = rng.normal(size=(32,)).astype(ml_dtypes.bfloat16)
    model = _model(
        [
            helper.make_node("MatMul", ["x", "W"], ["y0"]),
            helper.make_node("Cast", ["H"], ["h32"], to=TensorProto.FLOAT),
            helper.make_node("Cast", ["BF"], ["bf32"], to=TensorProto.FLOAT),
            helper.make_node("Add", ["y0", "h32"], ["y1"]),
            helper.make_node("Add", ["y1", "bf32"], ["y2"]),
            helper.make_node("Mul", ["y2", "S"], ["y"]),
        ],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 32])],
        [
            numpy_helper.from_array(w, "W"),
            numpy_helper.from_array(h, "H"),
            numpy_helper.from_array(bf, "BF"),
            numpy_helper.from_array(np.array(0.5, dtype=np.float32), "S"),
        ],
        opset=17,
    )
    out = tmp_path / "f.gguf"
    summary = export_gguf(model, out)
    assert summary["quantized"] == 0 and summary["skipped"] == []
    assert summary["counts"] == {"F32": 2, "F16": 1, "BF16": 1}
    back = read_back(gguf, out)
    assert back["W"][:2] == ("F32", [32, 64])  # GGUF order: the ONNX shape reversed
    np.testing.assert_array_equal(back["W"][2], w)
    assert back["H"][0] == "F16"
    np.testing.assert_array_equal(back["H"][2], h.astype(np.float32))
    assert back["BF"][0] == "BF16"
    np.testing.assert_array_equal(back["BF"][2], bf.astype(np.float32))
    assert back["S"][:2] == ("F32", [1])  # a 0-d tensor is written with shape [1]
    assert back["S"][2][0] == np.float32(0.5)
    with pytest.raises(QuantizationError, match="no tensor can be written to GGUF"):
        export_gguf(model, tmp_path / "none.gguf", include_float=False)
    assert not (tmp_path / "none.gguf").exists()


def test_path_input_bad_input_and_no_overwrite(gguf, tmp_path):
    model, _ = weight_only_model(scales="7bit")
    src = tmp_path / "model.onnx"
    onnx.save(model, src)
    summary = export_gguf(src, tmp_path / "model.gguf")
    assert summary["source"] == str(src) and summary["quantized"] == 2
    assert gguf.GGUFReader(tmp_path / "model.gguf").fields["general.name"].contents() == (
        "gguf_test"
    )
    before = src.read_bytes()
    with pytest.raises(ModelSaveError, match="input model"):
        export_gguf(src, src)
    assert src.read_bytes() == before
    bad = tmp_path / "notes.txt"
    bad.write_text("not a model\n")
    with pytest.raises(ModelLoadError, match="notes.txt"):
        export_gguf(bad, tmp_path / "bad.gguf")
    with pytest.raises(ModelLoadError, match="expected an onnx.ModelProto"):
        export_gguf(b"bytes", tmp_path / "bad.gguf")  # type: ignore[arg-type]
    assert not (tmp_path / "bad.gguf").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".partial")]


def test_same_model_same_bytes(gguf, tmp_path):
    model, _ = weight_only_model(scales="float32")
    export_gguf(model, tmp_path / "a.gguf")
    export_gguf(model, tmp_path / "b.gguf")
    assert (tmp_path / "a.gguf").read_bytes() == (tmp_path / "b.gguf").read_bytes()


def test_missing_gguf_names_the_extra(monkeypatch, tmp_path):
    model, _ = weight_only_model(scales="7bit")
    monkeypatch.setitem(sys.modules, "gguf", None)  # import gguf -> ImportError
    with pytest.raises(ModelSaveError, match=r"pip install 'quark_onnx\[gguf\]'"):
        export_gguf(model, tmp_path / "m.gguf")
    assert not (tmp_path / "m.gguf").exists()


def test_package_imports_without_gguf():
    code = (
        "import sys; sys.modules['gguf'] = None\n"
        "import quark_onnx, quark_onnx.formats.gguf_export\n"
        "assert 'gguf' not in [m for m in sys.modules if sys.modules[m] is not None]\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_uint4_codes_dtype_sanity():
    # the fixture model really holds uint4 and int8 codes (the two GGUF cases of the issue)
    _, ref = weight_only_model(scales="7bit")
    assert ref["W1"][0].dtype == np.dtype(ml_dtypes.uint4)
    assert ref["W2"][0].dtype == np.dtype(np.int8)
    assert np.any(ref["W1"][1].zero_point.astype(int) != 8)  # asymmetric zero points
