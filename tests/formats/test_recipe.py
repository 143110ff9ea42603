"""Recipes (JSON + safetensors): the safetensors reader/writer, save -> load byte identity,
refusal of tampered or mismatched recipes."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import pytest
from conftest import make_model, shared_path
from onnx import TensorProto, helper

from quark_onnx.config.presets import preset_names
from quark_onnx.config.quantization import Config, get_default_config
from quark_onnx.formats import safetensors_io as st
from quark_onnx.formats.recipe import load_recipe, read_recipe, save_recipe
from quark_onnx.formats.recipe_format import (
    PARAMS_FILE,
    RECIPE_FILE,
    RecipeError,
    config_from_json,
    config_to_json,
)
from quark_onnx.pipeline.quantizer import ModelQuantizer

F = TensorProto.FLOAT

# ------------------------------------------------------------------------------------------------
# safetensors
# ------------------------------------------------------------------------------------------------

ALL_TYPES = {
    "f32": np.arange(6, dtype=np.float32).reshape(2, 3) / 7,
    "f16": np.array([1.5, -2.25], dtype=np.float16),
    "bf16": np.array([1.0, -3.5, 0.0078125], dtype=ml_dtypes.bfloat16),
    "i8": np.array([[-128, 127]], dtype=np.int8),
    "u8": np.array([0, 255, 128], dtype=np.uint8),
    "i16": np.array([-32768, 5], dtype=np.int16),
    "u16": np.array([65535], dtype=np.uint16),
    "i32": np.array([-(2**31), 2**31 - 1], dtype=np.int32),
    "i64": np.array([2**40], dtype=np.int64),
    "f8": np.array([448, -0.5, 0.015625], dtype=ml_dtypes.float8_e4m3fn),
    "i4": np.array([[-8, 7], [0, -1]], dtype=ml_dtypes.int4),
    "u4": np.array([0, 15, 3], dtype=ml_dtypes.uint4),
    "scalar": np.array(0.125, dtype=np.float32),
    "empty": np.zeros((0, 4), dtype=np.int64),
}


def test_safetensors_round_trip_every_type():
    data = st.serialize(ALL_TYPES, {"note": "x"})
    tensors, meta = st.deserialize(data)
    assert meta == {"note": "x"}  # the int4/uint4 type records are consumed
    assert set(tensors) == set(ALL_TYPES)
    for name, array in ALL_TYPES.items():
        assert tensors[name].dtype == array.dtype, name
        assert tensors[name].shape == array.shape, name
        assert np.array_equal(tensors[name].astype(np.float64), array.astype(np.float64)), name


def test_safetensors_layout_is_aligned_and_header_padded():
    data = st.serialize(ALL_TYPES)
    (n,) = struct.unpack("<Q", data[:8])
    assert n % 8 == 0
    header = json.loads(data[8 : 8 + n])
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        itemsize = st.DTYPES[entry["dtype"]].itemsize
        assert entry["data_offsets"][0] % itemsize == 0, name


def test_safetensors_cross_check_with_reference_implementation():
    safetensors = pytest.importorskip("safetensors")
    from safetensors.numpy import save

    # our bytes read by the reference implementation
    for name, entry in safetensors.deserialize(st.serialize(ALL_TYPES)):
        array = ALL_TYPES[name]
        stored = array.astype(np.int8 if array.dtype == ml_dtypes.int4 else np.uint8)
        if array.dtype in (ml_dtypes.int4, ml_dtypes.uint4):
            assert bytes(entry["data"]) == stored.tobytes()
        else:
            assert bytes(entry["data"]) == np.ascontiguousarray(array).tobytes()
        assert list(entry["shape"]) == list(array.shape)
    # the reference implementation's bytes read by ours
    ref = {"a": np.arange(5, dtype=np.float32), "b": np.array([[1, 2]], dtype=np.int8)}
    tensors, meta = st.deserialize(save(ref, metadata={"k": "v"}))
    assert meta == {"k": "v"}
    for name, array in ref.items():
        assert np.array_equal(tensors[name], array) and tensors[name].dtype == array.dtype


def _file(header: dict, body: bytes) -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + body


def _f32(shape, offsets):
    return {"dtype": "F32", "shape": shape, "data_offsets": offsets}


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"\x01\x00", "too short"),
        (struct.pack("<Q", 10**9) + b"{}", "exceeds"),
        (struct.pack("<Q", 64) + b"{}", "runs past the end"),
        (struct.pack("<Q", 2) + b"[]", "not an object"),
        (struct.pack("<Q", 3) + b"{x}", "not UTF-8 JSON"),
        (_file({"w": {"dtype": "Q9", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4), "'w'"),
        (_file({"w": _f32([2], [0, 4])}, b"\0" * 4), "needs 8 byte(s)"),
        (_file({"w": _f32([1], [4, 8])}, b"\0" * 8), "gap"),
        (_file({"a": _f32([2], [0, 8]), "b": _f32([1], [4, 8])}, b"\0" * 8), "overlaps"),
        (_file({"w": _f32([1], [0, 4])}, b"\0" * 8), "cover 4 byte(s)"),
        (_file({"w": _f32([-1], [0, 4])}, b"\0" * 4), "non-negative"),
        # zero bytes, but dimensions numpy cannot hold
        (_file({"w": _f32([0, 10**20], [0, 0])}, b""), "'w': shape [0, 100000000000000000000]"),
        (_file({"w": _f32([0, 2**62, 2**62], [0, 0])}, b""), "cannot be an array"),
        (_file({"w": _f32([0] * 70, [0, 0])}, b""), "cannot be an array"),
        (_file({"w": {**_f32([1], [0, 4]), "extra": 1}}, b"\0" * 4), "exactly dtype"),
        (_file({"__metadata__": {"a": 1}}, b""), "strings to strings"),
        (
            _file(
                {
                    "__metadata__": {"dtype:w": "int4"},
                    "w": {"dtype": "I8", "shape": [1], "data_offsets": [0, 1]},
                },
                b"\x09",
            ),
            "[-8, 7]",
        ),
    ],
)
def test_safetensors_refuses_malformed_files(data, message):
    with pytest.raises(st.SafetensorsError) as err:
        st.deserialize(data, "bad.safetensors")
    assert message in str(err.value)
    assert "bad.safetensors" in str(err.value)


def test_safetensors_reads_a_zero_size_tensor_of_a_holdable_shape():
    """The must-not-fire case of the shape check."""
    tensors, _ = st.deserialize(_file({"w": _f32([0, 5], [0, 0])}, b""))
    assert tensors["w"].shape == (0, 5)


def test_safetensors_refuses_duplicate_keys_and_digest_mismatch(tmp_path):
    text = (
        b'{"w":{"dtype":"I8","shape":[1],"data_offsets":[0,1]},'
        b'"w":{"dtype":"I8","shape":[1],"data_offsets":[0,1]}}'
    )
    with pytest.raises(st.SafetensorsError, match="twice"):
        st.deserialize(struct.pack("<Q", len(text)) + text + b"\0")
    path = tmp_path / "p.safetensors"
    digest = st.save_file({"w": np.ones(3, np.float32)}, path)
    assert st.load_file(path, sha256=digest)[0]["w"].tolist() == [1, 1, 1]
    with pytest.raises(st.SafetensorsError, match="does not match"):
        st.load_file(path, sha256="0" * 64)


# ------------------------------------------------------------------------------------------------
# recipes on a tiny model
# ------------------------------------------------------------------------------------------------


def tiny_cnn() -> onnx.ModelProto:
    """x[1,3,8,8] -> Conv -> Relu -> Conv -> Add(x-skip conv) -> GlobalAveragePool -> Flatten
    -> Gemm."""
    rng = np.random.default_rng(3)
    inits = {
        "w1": rng.normal(0, 0.3, (8, 3, 3, 3)).astype(np.float32),
        "b1": rng.normal(0, 0.1, 8).astype(np.float32),
        "w2": rng.normal(0, 0.3, (8, 8, 3, 3)).astype(np.float32),
        "b2": rng.normal(0, 0.1, 8).astype(np.float32),
        "wg": rng.normal(0, 0.3, (8, 32)).astype(np.float32),
        "bg": rng.normal(0, 0.1, 32).astype(np.float32),
    }
    conv = {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1], "strides": [1, 1], "dilations": [1, 1]}
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", group=1, **conv),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], name="conv2", group=1, **conv),
        helper.make_node("Add", ["c2", "r1"], ["a"], name="add"),
        helper.make_node("GlobalAveragePool", ["a"], ["g"], name="gap"),
        helper.make_node("Flatten", ["g"], ["f"], name="flatten"),
        helper.make_node("Gemm", ["f", "wg", "bg"], ["y"], name="gemm"),
    ]
    return make_model(
        nodes,
        [helper.make_tensor_value_info("x", F, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("y", F, [1, 32])],
        inits,
    )


def _quantize(model: onnx.ModelProto, preset: str, samples: int = 4) -> onnx.ModelProto:
    qc = get_default_config(preset)
    x = np.random.default_rng(0).uniform(0, 1, (samples, 3, 8, 8)).astype(np.float32)

    class Reader:
        def __init__(self) -> None:
            self.it = iter([{"x": x[i : i + 1]} for i in range(samples)])

        def get_next(self):
            return next(self.it, None)

    return ModelQuantizer(Config(global_quant_config=qc)).quantize_model(model, None, Reader())


@pytest.fixture(scope="module")
def xint8(tmp_path_factory):
    """The tiny model, its XINT8 quantization and a saved recipe folder."""
    root = tmp_path_factory.mktemp("recipe")
    model = tiny_cnn()
    onnx.save(model, root / "float.onnx")
    quantized = _quantize(model, "XINT8")
    onnx.save(quantized, root / "q.onnx")
    save_recipe(root / "rec", quantized, "XINT8", root / "float.onnx")
    return root, model, quantized


def test_save_load_byte_identical_without_calibration(xint8):
    root, model, quantized = xint8
    rebuilt = load_recipe(root / "rec", root / "float.onnx", root / "rebuilt.onnx")
    assert rebuilt.SerializeToString() == quantized.SerializeToString()
    assert (root / "rebuilt.onnx").read_bytes() == quantized.SerializeToString(deterministic=True)
    recipe = read_recipe(root / "rec")
    assert recipe.preset == "XINT8"
    assert recipe.config is not None and recipe.config.include_bias_correction
    assert list(recipe.params)[:1] == ["x"]  # InsertQDQ's order: the input first
    assert all(p.codes is not None for n, p in recipe.params.items() if n.startswith(("w", "b")))
    # the float model as a proto gives the same result
    again = load_recipe(root / "rec", model)
    assert again.SerializeToString() == quantized.SerializeToString()


def test_recipe_captures_codes_not_requantization(tmp_path, xint8):
    """Codes decided after quantization (AdaRound, bias correction) are what the recipe keeps."""
    _, model, quantized = xint8
    edited = onnx.ModelProto()
    edited.CopyFrom(quantized)
    init = next(i for i in edited.graph.initializer if i.name == "w2_quantized")
    codes = onnx.numpy_helper.to_array(init).copy()
    codes.flat[0] = np.int8(codes.flat[0] + (1 if codes.flat[0] < 127 else -1))
    init.CopyFrom(onnx.numpy_helper.from_array(codes, init.name))
    save_recipe(tmp_path / "rec", edited, "XINT8", model)
    rebuilt = load_recipe(tmp_path / "rec", model)
    assert rebuilt.SerializeToString() == edited.SerializeToString()
    assert rebuilt.SerializeToString() != quantized.SerializeToString()


@pytest.mark.parametrize("preset", preset_names())
def test_every_preset_round_trips_byte_identically(tmp_path, preset):
    model = tiny_cnn()
    quantized = _quantize(model, preset)  # every preset quantizes the tiny model
    save_recipe(tmp_path / "rec", quantized, preset, model)
    rebuilt = load_recipe(tmp_path / "rec", model)
    assert rebuilt.SerializeToString() == quantized.SerializeToString()


def test_save_refuses_a_config_that_does_not_rebuild_the_model(tmp_path, xint8):
    _, _, quantized = xint8
    qc = get_default_config("XINT8")
    qc.extra_options["ConvertBNToConv"] = True
    qc.extra_options["FixDynamicBatch"] = 0  # the batch stays dynamic: another model
    wrong = tiny_cnn()
    wrong.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "N"
    with pytest.raises(RecipeError, match="would not reproduce"):
        save_recipe(tmp_path / "rec", quantized, qc, wrong)
    assert not (tmp_path / "rec" / RECIPE_FILE).exists()


def _copy_recipe(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for name in (RECIPE_FILE, PARAMS_FILE):
        (dst / name).write_bytes((src / name).read_bytes())
    return dst


def test_tampered_parameter_bytes_are_refused(tmp_path, xint8):
    root, model, _ = xint8
    rec = _copy_recipe(root / "rec", tmp_path / "rec")
    data = bytearray((rec / PARAMS_FILE).read_bytes())
    data[-1] ^= 0x01
    (rec / PARAMS_FILE).write_bytes(bytes(data))
    with pytest.raises(RecipeError) as err:
        load_recipe(rec, model)
    assert PARAMS_FILE in str(err.value) and "SHA-256" in str(err.value)


def test_edited_shapes_are_refused(tmp_path, xint8):
    root, model, _ = xint8
    rec = _copy_recipe(root / "rec", tmp_path / "rec")
    doc = json.loads((rec / RECIPE_FILE).read_text())
    entry = next(t for t in doc["tensors"] if t["name"] == "w2")
    entry["shape"] = [8, 8, 3, 2]
    (rec / RECIPE_FILE).write_text(json.dumps(doc))
    with pytest.raises(RecipeError) as err:
        load_recipe(rec, model)
    assert "'w2'" in str(err.value) and "shape" in str(err.value)


def test_edited_granularity_is_refused(tmp_path, xint8):
    root, model, _ = xint8
    rec = _copy_recipe(root / "rec", tmp_path / "rec")
    doc = json.loads((rec / RECIPE_FILE).read_text())
    next(t for t in doc["tensors"] if t["name"] == "w1")["axis"] = 0  # per-tensor scale
    (rec / RECIPE_FILE).write_text(json.dumps(doc))
    with pytest.raises(RecipeError, match="'w1'|w1: "):
        load_recipe(rec, model)


def test_recipe_for_another_model_is_refused(xint8):
    root, _, _ = xint8
    other = tiny_cnn()
    weights = onnx.numpy_helper.to_array(other.graph.initializer[0]) * 2
    other.graph.initializer[0].CopyFrom(onnx.numpy_helper.from_array(weights, "w1"))
    with pytest.raises(RecipeError) as err:
        load_recipe(root / "rec", other)
    assert "another float model" in str(err.value) and RECIPE_FILE in str(err.value)


def test_unreadable_or_foreign_recipes_are_refused(tmp_path, xint8):
    root, model, _ = xint8
    with pytest.raises(RecipeError, match="not a recipe folder"):
        load_recipe(tmp_path, model)
    rec = _copy_recipe(root / "rec", tmp_path / "rec")
    doc = json.loads((rec / RECIPE_FILE).read_text())
    (rec / RECIPE_FILE).write_text(json.dumps({**doc, "format_version": 99}))
    with pytest.raises(RecipeError, match="upgrade quark_onnx"):
        read_recipe(rec)
    (rec / RECIPE_FILE).write_text('{"format": "quark_onnx.formats.recipe", "format": 1}')
    with pytest.raises(RecipeError, match="twice"):
        read_recipe(rec)
    (rec / RECIPE_FILE).write_text(json.dumps(doc))
    (rec / PARAMS_FILE).unlink()
    with pytest.raises(RecipeError, match="missing"):
        read_recipe(rec)


def test_save_refuses_to_replace_an_existing_recipe(xint8):
    root, model, quantized = xint8
    from quark_onnx.errors import ModelSaveError

    with pytest.raises(ModelSaveError, match="exists"):
        save_recipe(root / "rec", quantized, "XINT8", model)


def test_config_json_round_trip_keeps_every_setting():
    qc = get_default_config("XINT8")
    qc.include_cle = True
    qc.extra_options["CLESteps"] = 3
    back = config_from_json(json.loads(json.dumps(config_to_json(qc))), "<test>")
    assert back.effective_settings() == qc.effective_settings()
    # the quantize report's spelling of enums ("PowerOfTwoMethod.MinMSE") is accepted too
    settings = qc.effective_settings()
    extra = settings.pop("extra_options")
    again = config_from_json({"settings": settings, "extra_options": extra}, "<report>")
    assert again.effective_settings() == qc.effective_settings()


# ------------------------------------------------------------------------------------------------
# the digits CNN
# ------------------------------------------------------------------------------------------------


@pytest.mark.real_model
@pytest.mark.parametrize("preset", ["XINT8", "A8W8"])
def test_digits_recipe_is_byte_identical(tmp_path, preset):
    model_path = shared_path("models", "digits_cnn.onnx")
    x = np.load(shared_path("models", "digits_calib.npz"))["x"][:16]
    if preset not in preset_names():
        pytest.skip(f"preset {preset} not available")
    qc = get_default_config(preset)
    quantizer = ModelQuantizer(Config(global_quant_config=qc))
    quantized = quantizer.quantize_model(model_path, tmp_path / "q.onnx", {"image": x})
    # XINT8 undoes Sigmoid -> HardSigmoid on this model (RevertCostlyPasses): the recipe records
    # the configuration in force
    undone = {p["name"] for p in quantizer.report.passes if p["reverted"]}
    assert undone == ({"ConvertSigmoidToHardSigmoid"} if preset == "XINT8" else set())
    if preset == "XINT8":
        assert quantizer.config_in_force.extra_options["ConvertSigmoidToHardSigmoid"] is False
        assert qc.extra_options["ConvertSigmoidToHardSigmoid"] is True  # the given one unchanged
    save_recipe(tmp_path / "rec", tmp_path / "q.onnx", quantizer.config_in_force, model_path)
    rebuilt = load_recipe(tmp_path / "rec", model_path, tmp_path / "rebuilt.onnx")
    assert rebuilt.SerializeToString() == quantized.SerializeToString()
    assert (tmp_path / "rebuilt.onnx").read_bytes() == (tmp_path / "q.onnx").read_bytes()


@pytest.mark.real_model
@pytest.mark.parametrize("preset", ["XINT8", "A8W8"])
def test_quantizer_params_are_what_the_model_holds(tmp_path, preset):
    """``ModelQuantizer.params`` are final (codes after bias correction included): equal to the
    parameters read back from the written model, and a recipe saved from them without reading
    the model is the same, file for file."""
    from quark_onnx.formats.importer import extract_params

    model_path = shared_path("models", "digits_cnn.onnx")
    x = np.load(shared_path("models", "digits_calib.npz"))["x"][:16]
    config = get_default_config(preset)
    # calibrated on all 16: held out, 12 calibrate one A8W8 activation to a zero point of 0,
    # which a model read back cannot tell from a symmetric one
    config.extra_options["FidelityHoldout"] = 0
    quantizer = ModelQuantizer(Config(global_quant_config=config))
    quantized = quantizer.quantize_model(model_path, tmp_path / "q.onnx", {"image": x})
    if preset == "XINT8":
        assert quantizer.report.bias_correction["changed_channels"] > 0  # codes were rewritten
    read = extract_params(quantized)
    assert list(quantizer.params) == list(read)
    for name, p in quantizer.params.items():
        q = read[name]
        assert (p.qtype, p.axis, p.block_size, p.dynamic) == (
            q.qtype,
            q.axis,
            q.block_size,
            q.dynamic,
        )
        for kind in ("scale", "zero_point", "codes"):
            a, b = getattr(p, kind), getattr(q, kind)
            assert (a is None) == (b is None), (name, kind)
            if a is not None:
                assert np.asarray(a).dtype == np.asarray(b).dtype, (name, kind)
                np.testing.assert_array_equal(a, b, err_msg=f"{name}.{kind}")
    config = quantizer.config_in_force
    save_recipe(tmp_path / "read", tmp_path / "q.onnx", config, model_path)
    save_recipe(tmp_path / "given", quantized, config, model_path, params=quantizer.params)
    for name in ("recipe.json", "params.safetensors"):
        assert (tmp_path / "given" / name).read_bytes() == (tmp_path / "read" / name).read_bytes()


def test_tampered_parameters_with_a_recomputed_checksum_are_refused(tmp_path, xint8):
    """A scale edited to a non-power-of-two value, the parameter file's sha256 recomputed in
    recipe.json: the rebuilt model is not the one recorded (quantized_model.sha256)."""
    import shutil

    root, _, _ = xint8
    rec = tmp_path / "rec"
    shutil.copytree(root / "rec", rec)
    arrays, meta = st.load_file(rec / PARAMS_FILE)
    key = next(k for k in arrays if k.endswith(".scale"))
    arrays[key] = (np.asarray(arrays[key]) * 1.5).astype(arrays[key].dtype)
    doc = json.loads((rec / RECIPE_FILE).read_text())
    doc["params"]["sha256"] = st.save_file(arrays, rec / PARAMS_FILE, meta)
    (rec / RECIPE_FILE).write_text(json.dumps(doc))
    before = {p.name: p.read_bytes() for p in rec.iterdir()}
    with pytest.raises(RecipeError, match="not the one the recipe records"):
        load_recipe(rec, root / "float.onnx", tmp_path / "out.onnx")
    assert not (tmp_path / "out.onnx").exists()
    assert {p.name: p.read_bytes() for p in rec.iterdir()} == before
    assert not list(tmp_path.rglob("*.partial"))


def test_a_failed_recipe_save_leaves_no_folder(tmp_path, xint8, monkeypatch):
    """A full disk while writing: neither the recipe folder nor its staging folder is left."""
    import errno

    from quark_onnx.formats import recipe_format

    root, _, quantized = xint8

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(recipe_format.safetensors_io, "save_file", full)
    with pytest.raises(OSError, match="No space"):
        save_recipe(tmp_path / "rec", quantized, "XINT8", root / "float.onnx")
    assert list(tmp_path.iterdir()) == []
