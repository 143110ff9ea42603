"""Model loading errors and atomic, input-preserving saving."""

from __future__ import annotations

import os

import numpy as np
import onnx
import pytest
from conftest import make_model, run_ort

from quark_onnx.errors import ModelLoadError, ModelSaveError, QuarkOnnxError, UnsafePathError
from quark_onnx.model_files.external import fits_in_protobuf
from quark_onnx.model_files.files import Terminated, atomic_write_bytes, sigterm_as_interrupt
from quark_onnx.model_files.load import load_model, validate_proto
from quark_onnx.model_files.save import save_model


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


# --- validation details ----------------------------------------------------------------------


def test_checker_message_is_one_line_naming_the_node(tmp_path):
    model = _tiny()
    model.graph.node[0].name = "act"
    model.graph.node[0].input[0] = "ghost"
    p = tmp_path / "bad.onnx"
    p.write_bytes(model.SerializeToString())
    with pytest.raises(ModelLoadError) as info:
        load_model(p)
    text = str(info.value)
    assert "\n" not in text and "act" in text and "ghost" in text and "bad.onnx" in text


def test_non_utf8_name_is_a_load_error(tmp_path):
    # fuzz finding: one flipped byte in a node name parsed, passed the checker and crashed
    # onnx_ir serialization with a SerdeError later on
    model = _tiny()
    model.graph.node[0].name = "relu"
    data = model.SerializeToString().replace(b"relu", b"\xffelu")
    p = tmp_path / "flipped.onnx"
    p.write_bytes(data)
    with pytest.raises(ModelLoadError, match=r"graph\.node\[0\]\.name .*not UTF-8"):
        load_model(p)


def test_validate_proto_checks_an_in_memory_model():
    model = _tiny()
    model.opset_import[0].version = 11
    assert validate_proto(model).opset_import[0].version == 13
    bad = _tiny()
    bad.graph.node[0].input[0] = "ghost"
    with pytest.raises(ModelLoadError, match="ghost"):
        validate_proto(bad, source="mine")
    assert validate_proto(_tiny()) is not None


def test_fits_in_protobuf_survives_upb_encode_errors(monkeypatch):
    from google.protobuf.message import EncodeError

    class Huge:
        def ByteSize(self):  # what upb does above 2 GB
            raise EncodeError("Failed to serialize proto")

    assert fits_in_protobuf(_tiny())
    assert not fits_in_protobuf(Huge())


# --- saving ----------------------------------------------------------------------------------


def _weighted() -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 64])
    y = onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 32])
    w = onnx.numpy_helper.from_array(rng.standard_normal((64, 32)).astype(np.float32), "w")
    # a tensor in a typed field (float_data), not raw_data
    b = onnx.helper.make_tensor("b", onnx.TensorProto.FLOAT, [32], rng.random(32).tolist())
    c = onnx.helper.make_node(
        "Constant",
        [],
        ["c"],
        value=onnx.numpy_helper.from_array(np.ones((16, 32), np.float32), "cv"),
    )
    nodes = [
        c,
        onnx.helper.make_node("MatMul", ["x", "w"], ["m"]),
        onnx.helper.make_node("Add", ["m", "b"], ["a"]),
        onnx.helper.make_node("Mul", ["a", "c"], ["y0"]),
        onnx.helper.make_node("ReduceMean", ["y0"], ["y"], axes=[0], keepdims=1),
    ]
    return make_model(nodes, [x], [y], [w, b], opset=13)


def test_external_save_round_trips_and_leaves_the_model_alone(tmp_path):
    model = _weighted()
    before = model.SerializeToString()
    out = save_model(model, tmp_path / "m.onnx", external_data=True)
    assert model.SerializeToString() == before  # the caller's model is not modified
    assert sorted(os.listdir(tmp_path)) == ["m.onnx", "m.onnx.data"]
    header = onnx.load(str(out), load_external_data=False)
    external = {
        t.name for t in header.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL
    }
    assert external == {"w"}  # b (128 bytes) stays inline
    const = header.graph.node[0].attribute[0].t
    assert const.data_location == onnx.TensorProto.EXTERNAL  # Constant tensors go out too
    offsets = [
        int(e.value)
        for t in (header.graph.initializer[0], const)
        for e in t.external_data
        if e.key == "offset"
    ]
    assert all(o % 4096 == 0 for o in offsets)
    loaded = load_model(out)
    for a, b in zip(loaded.graph.initializer, model.graph.initializer, strict=True):
        np.testing.assert_array_equal(onnx.numpy_helper.to_array(a), onnx.numpy_helper.to_array(b))
    feeds = {"x": np.random.default_rng(1).random((1, 64), dtype=np.float32)}
    np.testing.assert_array_equal(run_ort(loaded, feeds)[0], run_ort(model, feeds)[0])


def test_typed_field_tensor_goes_external(tmp_path, monkeypatch):
    from quark_onnx import model_files

    monkeypatch.setattr(model_files.save, "EXTERNAL_THRESHOLD", 64)
    model = _weighted()
    save_model(model, tmp_path / "m.onnx", external_data=True)
    header = onnx.load(str(tmp_path / "m.onnx"), load_external_data=False)
    b = next(t for t in header.graph.initializer if t.name == "b")
    assert b.data_location == onnx.TensorProto.EXTERNAL and not b.float_data
    loaded = load_model(tmp_path / "m.onnx")
    np.testing.assert_array_equal(
        onnx.numpy_helper.to_array(next(t for t in loaded.graph.initializer if t.name == "b")),
        onnx.numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == "b")),
    )


def test_failed_rename_keeps_the_old_output_whole(tmp_path, monkeypatch):

    out = tmp_path / "m.onnx"
    save_model(_weighted(), out, external_data=True)
    old = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    real_replace = os.replace

    def failing(src, dst):
        if os.fspath(dst) == os.fspath(out):
            raise OSError(28, "No space left on device")
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", failing)
    changed = _weighted()
    changed.graph.initializer[0].raw_data = bytes(len(changed.graph.initializer[0].raw_data))
    with pytest.raises(ModelSaveError, match="No space left"):
        save_model(changed, out, external_data=True)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == old  # nothing else left


def test_exception_mid_write_leaves_no_temporary(tmp_path, monkeypatch):

    def boom(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "fsync", boom)
    with pytest.raises(KeyboardInterrupt):
        save_model(_tiny(), tmp_path / "a.onnx")
    with pytest.raises(KeyboardInterrupt):
        save_model(_weighted(), tmp_path / "b.onnx", external_data=True)
    assert os.listdir(tmp_path) == []


def test_partial_names_are_reserved(tmp_path):
    with pytest.raises(ModelSaveError, match="reserved"):
        save_model(_tiny(), tmp_path / "x.onnx.partial")


def test_sigterm_as_interrupt_raises_and_restores():
    import signal

    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    with pytest.raises(Terminated), sigterm_as_interrupt():
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(1000):  # the handler runs between bytecodes
            pass
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    assert issubclass(Terminated, KeyboardInterrupt)


@pytest.mark.parametrize("signame", ["SIGTERM", "SIGINT"])
def test_a_stop_signal_masked_by_c_code_still_leaves_as_the_interrupt(signame):
    """numpy reports a KeyboardInterrupt raised while it converts a shape as a TypeError (seen
    when a test interrupted the quantizer); after a stop signal the block still ends as the
    interrupt, chained to what C code made of it."""
    import signal

    signum = getattr(signal, signame)

    class Shape:  # a sequence whose conversion runs Python code, where the signal lands
        def __len__(self):
            return 1

        def __getitem__(self, i):
            if i:
                raise IndexError
            os.kill(os.getpid(), signum)
            for _ in range(1000):  # the handler runs between bytecodes
                pass
            return 4

    wanted = Terminated if signame == "SIGTERM" else KeyboardInterrupt
    with pytest.raises(wanted) as info, sigterm_as_interrupt():
        np.zeros(4).reshape(Shape())
    assert isinstance(info.value.__cause__, TypeError)  # numpy's, without the handling
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_an_error_without_a_signal_leaves_the_block_as_itself():
    with pytest.raises(ValueError, match="no signal"), sigterm_as_interrupt():
        raise ValueError("no signal")


def test_written_files_get_the_usual_mode_not_a_private_one(tmp_path) -> None:
    """Atomic writes go through mkstemp (mode 0600); the renamed output must get the mode a
    plainly created file would have (0666 less the umask)."""
    import os

    mask = os.umask(0o022)
    try:
        target = tmp_path / "out.bin"
        atomic_write_bytes(target, b"data")
        assert target.stat().st_mode & 0o777 == 0o644
    finally:
        os.umask(mask)


def test_signature_proto_holds_the_inputs_a_feed_provides_and_nothing_else():
    import onnx_ir as ir

    from quark_onnx.calibration.readers import input_specs
    from quark_onnx.model_files.load import signature_proto

    graph = onnx.helper.make_graph(
        [
            onnx.helper.make_node("Add", ["x", "c"], ["t"]),
            onnx.helper.make_node("Mul", ["t", "s"], ["y"]),
        ],
        "g",
        [
            onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", 3]),
            onnx.helper.make_tensor_value_info("s", onnx.TensorProto.INT8, [1]),
            # an initializer listed as an input (IR < 4 style): not something a feed provides
            onnx.helper.make_tensor_value_info("c", onnx.TensorProto.FLOAT, [3]),
        ],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["N", 3])],
        [onnx.numpy_helper.from_array(np.ones(3, np.float32), "c")],
    )
    full = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])
    signature = signature_proto(ir.serde.deserialize_model(full))
    assert input_specs(signature) == input_specs(full)
    assert [i.name for i in signature.graph.input] == ["x", "s"]
    assert not signature.graph.node and not signature.graph.initializer
    assert [(o.domain, o.version) for o in signature.opset_import] == [("", 17)]
