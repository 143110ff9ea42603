"""External data: locations that leave the model's folder are refused; outputs stay inside theirs.

Refused on load (``UnsafePathError``, naming the model, the tensor and the location): absolute
paths, ``..`` that climbs out, a symbolic link to a file outside, a symbolic link to a folder
outside. Accepted: a file in a subfolder and a symbolic link that stays inside. Missing or short
data files are a ``ModelLoadError``. Every check runs before a byte of data is read.
"""

from __future__ import annotations

import os

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from fuzz_models import conv_chain, quantizer

from quark_onnx import model_files
from quark_onnx.errors import ModelLoadError, ModelSaveError, UnsafePathError
from quark_onnx.model_files.load import load_model
from quark_onnx.model_files.save import save_model, written_files

WEIGHT = "w0"


def _external_model(folder, location: str, data_dir=None) -> tuple:
    """conv_chain whose weight ``w0`` lives at ``location`` (written under ``data_dir``)."""
    model = conv_chain()
    tensor = next(t for t in model.graph.initializer if t.name == WEIGHT)
    data = tensor.raw_data
    tensor.ClearField("raw_data")
    tensor.data_location = onnx.TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", "0"), ("length", str(len(data)))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "m.onnx"
    path.write_bytes(model.SerializeToString())
    target = (data_dir or folder) / os.path.basename(location)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(data)
    return path, data


def _refused(path, tmp_path, match: str) -> UnsafePathError:
    out = tmp_path / "out.onnx"
    with pytest.raises(UnsafePathError, match=match) as info:
        quantizer().quantize_model(path, out)
    assert not out.exists()
    assert WEIGHT in str(info.value) and str(path) in str(info.value)
    return info.value


def test_absolute_location_is_refused(tmp_path):
    secret = tmp_path / "elsewhere" / "w.bin"
    path, _ = _external_model(tmp_path / "model", str(secret), data_dir=secret.parent)
    _refused(path, tmp_path, "only paths relative")


def test_dotdot_location_is_refused(tmp_path):
    path, _ = _external_model(tmp_path / "model", "../w.bin", data_dir=tmp_path)
    _refused(path, tmp_path, "escapes the model's folder")


def test_symlink_file_pointing_outside_is_refused(tmp_path):
    outside = tmp_path / "outside"
    path, data = _external_model(tmp_path / "model", "w.bin")
    outside.mkdir()
    (outside / "w.bin").write_bytes(data)
    (tmp_path / "model" / "w.bin").unlink()
    (tmp_path / "model" / "w.bin").symlink_to(outside / "w.bin")
    err = _refused(path, tmp_path, "escapes the model's folder through a symbolic link")
    assert "outside" in str(err)


def test_symlinked_folder_pointing_outside_is_refused(tmp_path):
    outside = tmp_path / "outside"
    path, _ = _external_model(tmp_path / "model", "weights/w.bin", data_dir=outside)
    (tmp_path / "model" / "weights").symlink_to(outside, target_is_directory=True)
    _refused(path, tmp_path, "symbolic link")


def test_locations_inside_the_folder_are_accepted(tmp_path):
    path, data = _external_model(tmp_path / "a", "sub/w.bin", data_dir=tmp_path / "a" / "sub")
    weight = next(t for t in load_model(path).graph.initializer if t.name == WEIGHT)
    assert weight.raw_data == data and not weight.external_data
    assert weight.data_location == onnx.TensorProto.DEFAULT


def test_symlink_inside_the_folder_is_refused_with_the_fix(tmp_path):
    # the ONNX checker refuses linked data files; say so clearly instead of its message
    path, data = _external_model(tmp_path / "b", "w.bin")
    (tmp_path / "b" / "real.bin").write_bytes(data)
    (tmp_path / "b" / "w.bin").unlink()
    (tmp_path / "b" / "w.bin").symlink_to(tmp_path / "b" / "real.bin")
    _refused(path, tmp_path, "copy the file itself")


def test_missing_and_short_data_files(tmp_path):
    path, data = _external_model(tmp_path / "m1", "w.bin")
    (tmp_path / "m1" / "w.bin").unlink()
    with pytest.raises(ModelLoadError, match="'w.bin' is missing"):
        load_model(path)
    path, data = _external_model(tmp_path / "m2", "w.bin")
    (tmp_path / "m2" / "w.bin").write_bytes(data[:-4])
    with pytest.raises(ModelLoadError, match="truncated"):
        load_model(path)


def test_output_external_data_stays_in_the_output_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(model_files.save, "EXTERNAL_THRESHOLD", 64)  # the tiny weights go out too
    src, _ = _external_model(tmp_path / "in", "w.bin")
    outdir = tmp_path / "out"
    outdir.mkdir()
    save_model(load_model(src), outdir / "q.onnx", input_path=src, external_data=True)
    files = written_files(outdir / "q.onnx")
    assert [f.name for f in files] == ["q.onnx", "q.onnx.data"]
    assert all(f.parent == outdir for f in files)
    proto = onnx.load(str(outdir / "q.onnx"), load_external_data=False)
    locations = {
        e.value for t in proto.graph.initializer for e in t.external_data if e.key == "location"
    }
    assert locations == {"q.onnx.data"}  # a bare name, never a path
    assert sorted(os.listdir(outdir)) == ["q.onnx", "q.onnx.data"]


def test_saving_unread_external_references_is_refused(tmp_path):
    # a model whose tensors still point at files would make the output refer outside its folder
    src, _ = _external_model(tmp_path / "in", "w.bin")
    unread = onnx.load(str(src), load_external_data=False)
    with pytest.raises(ModelSaveError, match="w0"):
        save_model(unread, tmp_path / "out.onnx")
    assert not (tmp_path / "out.onnx").exists()


def test_output_data_never_replaces_the_input_data(tmp_path):
    # input m.onnx keeps its weights in q.onnx.data: an output q.onnx beside it would replace them
    folder = tmp_path / "m"
    src, data = _external_model(folder, "q.onnx.data")
    with pytest.raises(ModelSaveError, match="external data"):
        save_model(load_model(src), folder / "q.onnx", input_path=src, external_data=True)
    assert (folder / "q.onnx.data").read_bytes() == data
    assert np.array_equal(
        onnx.numpy_helper.to_array(load_model(src).graph.initializer[0]),
        onnx.numpy_helper.to_array(conv_chain().graph.initializer[0]),
    )


def _gather_matmul_opset17(folder) -> tuple:
    """ids -> Gather(table 300x64) -> MatMul(w 64x512) -> y, opset 17, both tensors (above the
    size kept in memory on load) in ``m.onnx.data``; uint4 weight-only needs opset 21."""
    rng = np.random.default_rng(4)
    table = rng.standard_normal((300, 64)).astype(np.float32)
    weight = rng.standard_normal((64, 512)).astype(np.float32)
    graph = onnx.helper.make_graph(
        [
            onnx.helper.make_node("Gather", ["table", "ids"], ["e"], name="gather"),
            onnx.helper.make_node("MatMul", ["e", "w"], ["y"], name="mm"),
        ],
        "g",
        [onnx.helper.make_tensor_value_info("ids", onnx.TensorProto.INT64, [1, 4])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 4, 512])],
        [onnx.numpy_helper.from_array(table, "table"), onnx.numpy_helper.from_array(weight, "w")],
    )
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])
    model.ir_version = 8
    folder.mkdir()
    path = folder / "m.onnx"
    onnx.save(model, path, save_as_external_data=True, location="m.onnx.data", size_threshold=0)
    return path, table


def test_opset_conversion_finds_external_data_from_any_working_directory(tmp_path, monkeypatch):
    from quark_onnx import Config, ModelQuantizer, get_default_config

    src, table = _gather_matmul_opset17(tmp_path / "model")
    before = {p.name: p.read_bytes() for p in src.parent.iterdir()}
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # the data file is not beside the working directory
    out = tmp_path / "out" / "q.onnx"
    out.parent.mkdir()
    qconfig = get_default_config("UINT4_WEIGHT_ONLY_G32")
    ModelQuantizer(Config(global_quant_config=qconfig)).quantize_model(str(src), str(out))
    quantized = onnx.load(str(out))
    assert {o.domain: o.version for o in quantized.opset_import}[""] == 21
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in quantized.graph.initializer}
    assert np.array_equal(inits["table"], table)  # the float table kept, bytes unchanged
    assert "w" not in inits and "w_quantized" in inits  # the external weight was quantized
    assert [i.name for i in quantized.graph.input] == ["ids"]  # no weight became an input
    ids = np.array([[0, 7, 299, 7]], np.int64)
    (y,) = ort.InferenceSession(str(out)).run(None, {"ids": ids})
    assert y.shape == (1, 4, 512) and np.array_equal(y[0, 1], y[0, 3])
    assert {p.name: p.read_bytes() for p in src.parent.iterdir()} == before
    assert os.listdir(elsewhere) == []
