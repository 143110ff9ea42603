"""Model loading errors and atomic, input-preserving saving."""

from __future__ import annotations

import os

import numpy as np
import onnx
import pytest
from conftest import make_model

from quark_onnx.errors import ModelLoadError, ModelSaveError, QuarkOnnxError, UnsafePathError
from quark_onnx.model_io import load_model, save_model


def _tiny() -> onnx.ModelProto:
    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 4])
    y = onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 4])
    return make_model([onnx.helper.make_node("Relu", ["x"], ["y"])], [x], [y])


def test_missing_file(tmp_path):
    with pytest.raises(ModelLoadError, match="no such file") as info:
        load_model(tmp_path / "nope.onnx")
    assert "nope.onnx" in str(info.value)
    assert isinstance(info.value, QuarkOnnxError)


def test_not_onnx(tmp_path):
    p = tmp_path / "text.onnx"
    p.write_text("this is not a model\n" * 20)
    with pytest.raises(ModelLoadError, match="text.onnx"):
        load_model(p)


def test_truncated(tmp_path):
    data = _tiny().SerializeToString()
    p = tmp_path / "cut.onnx"
    p.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="cut.onnx"):
        load_model(p)
    assert sorted(os.listdir(tmp_path)) == ["cut.onnx"]  # nothing written


def test_empty(tmp_path):
    p = tmp_path / "empty.onnx"
    p.write_bytes(b"")
    with pytest.raises(ModelLoadError, match="empty"):
        load_model(p)


def test_old_opset_is_upgraded(tmp_path):
    model = _tiny()
    model.opset_import[0].version = 11
    p = tmp_path / "old.onnx"
    p.write_bytes(model.SerializeToString())
    assert load_model(p).opset_import[0].version == 13


def test_save_refuses_input_path_and_is_atomic(tmp_path):
    p = tmp_path / "m.onnx"
    p.write_bytes(_tiny().SerializeToString())
    before = p.read_bytes()
    with pytest.raises(ModelSaveError, match="input model"):
        save_model(_tiny(), p, input_path=p)
    assert p.read_bytes() == before
    out = save_model(_tiny(), tmp_path / "out.onnx", input_path=p)
    assert load_model(out).graph.node[0].op_type == "Relu"
    assert sorted(os.listdir(tmp_path)) == ["m.onnx", "out.onnx"]  # no temporary left


def test_external_data_escaping_folder_is_refused(tmp_path):
    model = _tiny()
    w = onnx.numpy_helper.from_array(np.ones(4, np.float32), "w")
    w.data_location = onnx.TensorProto.EXTERNAL
    w.ClearField("raw_data")
    for k, v in (("location", "../secret.bin"), ("offset", "0"), ("length", "16")):
        entry = w.external_data.add()
        entry.key, entry.value = k, v
    model.graph.initializer.append(w)
    sub = tmp_path / "sub"
    sub.mkdir()
    (tmp_path / "secret.bin").write_bytes(np.ones(4, np.float32).tobytes())
    p = sub / "m.onnx"
    p.write_bytes(model.SerializeToString())
    with pytest.raises(UnsafePathError, match="escapes"):
        load_model(p)
