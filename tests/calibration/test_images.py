"""Image-folder calibration data: spec parsing, the ONNX pre-processing graph against a numpy
reference, the reader's checks, the guard in front of libjpeg, and the real ImageNet images.

The numpy reference (``reference_preprocess``) is written from the maths in the docstring of
``calibration.image_graph``: separable linear interpolation with half-pixel centres (coordinates in
float32, as onnxruntime computes them), clamped at the border, no antialiasing; centre crop at
``round_half_even((size - crop) / 2)``; channel reversal; ``(x * scale - mean) / std`` in float32.
Synthetic images are PNGs written here (lossless), so the reference starts from the exact pixels;
for the real JPEGs it starts from the pixels decoded by the same ``DecodeImage`` operator, so the
comparison isolates resize, crop and normalisation.
"""

from __future__ import annotations

import json
import logging
import re
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import make_model, shared_path
from image_reference import reference_general, reference_sizes, resize_axis
from onnx import TensorProto, helper

from quark_onnx.calibration.image_check import check_encoded_image
from quark_onnx.calibration.image_graph import (
    EXTENSIONS_DOMAIN,
    build_preprocess_graph,
    decoder_channel_order,
    make_preprocess_session,
)
from quark_onnx.calibration.image_reader import ImageFolderDataReader, list_image_files
from quark_onnx.calibration.image_spec import PreprocessSpec
from quark_onnx.errors import CalibrationError, ConfigError

SQUEEZENET_SPEC = "resize=256,crop=224,mean=104;117;123,std=1;1;1,scale=1,order=BGR,layout=NCHW"
MOBILENETV2_SPEC = (
    "resize=256,crop=224,scale=1/255,mean=0.485;0.456;0.406,std=0.229;0.224;0.225,"
    "order=RGB,layout=NCHW"
)

# ------------------------------------------------------------------------------------------------
# helpers: a PNG writer, a JPEG writer (onnxruntime-extensions' EncodeImage), a decoder, the
# numpy reference
# ------------------------------------------------------------------------------------------------


def png_bytes(rgb: np.ndarray, *, interlace: int = 0) -> bytes:
    """A minimal 8-bit PNG of ``rgb`` (H x W x 3 uint8 RGB, or H x W greyscale)."""
    height, width = rgb.shape[:2]
    color_type = 2 if rgb.ndim == 3 else 0
    raw = b"".join(b"\x00" + rgb[row].tobytes() for row in range(height))

    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = zlib.crc32(kind + body) & 0xFFFFFFFF
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", crc)

    header = struct.pack(">IIBBBBB", width, height, 8, color_type, 0, 0, interlace)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(raw))
        + chunk(b"IEND", b"")
    )


def _ext_model(node: onnx.NodeProto, in_type: int, out_shape: list) -> onnx.ModelProto:
    graph = helper.make_graph(
        [node],
        "codec",
        [helper.make_tensor_value_info("x", in_type, None)],
        [helper.make_tensor_value_info("y", TensorProto.UINT8, out_shape)],
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(EXTENSIONS_DOMAIN, 1)],
    )
    model.ir_version = 8
    return model


_SESSIONS: dict[str, object] = {}


def decode_rgb(data: bytes) -> np.ndarray:
    """H x W x 3 uint8 RGB pixels from the same DecodeImage operator, in a graph of its own.

    The operator is asked for RGB; a one-pixel probe tells whether this release honours that
    (0.15 does, 0.12 returns BGR), and greyscale (one channel) is repeated to three channels.
    """
    if "decode" not in _SESSIONS:
        node = helper.make_node(
            "DecodeImage", ["x"], ["y"], domain=EXTENSIONS_DOMAIN, color_space="rgb"
        )
        session = make_preprocess_session(_ext_model(node, TensorProto.UINT8, None))
        probe = png_bytes(np.array([[[200, 50, 10]]], np.uint8))
        pixel = session.run(None, {"x": np.frombuffer(probe, np.uint8)})[0].reshape(-1)
        _SESSIONS["decode"] = session
        _SESSIONS["reverse"] = pixel.tolist() == [10, 50, 200]
    out = _SESSIONS["decode"].run(None, {"x": np.frombuffer(data, np.uint8)})[0]
    if out.shape[-1] == 1:
        out = np.repeat(out, 3, axis=-1)
    return out[:, :, ::-1] if _SESSIONS["reverse"] else out


def jpeg_bytes(bgr: np.ndarray) -> bytes:
    """A baseline JPEG of ``bgr`` written by onnxruntime-extensions' EncodeImage."""
    if "encode" not in _SESSIONS:
        node = helper.make_node("EncodeImage", ["x"], ["y"], domain=EXTENSIONS_DOMAIN, format="jpg")
        _SESSIONS["encode"] = make_preprocess_session(_ext_model(node, TensorProto.UINT8, [None]))
    return _SESSIONS["encode"].run(None, {"x": bgr})[0].tobytes()


def reference_preprocess(rgb: np.ndarray, spec: PreprocessSpec) -> np.ndarray:
    x = rgb.astype(np.float32)
    if spec.resize:
        h, w = x.shape[:2]
        short = min(h, w)
        x = resize_axis(x, spec.resize * h // short, 0)
        x = resize_axis(x, spec.resize * w // short, 1)
    if spec.crop:
        h, w = x.shape[:2]
        top, left = round((h - spec.crop) / 2), round((w - spec.crop) / 2)  # half to even
        x = x[top : top + spec.crop, left : left + spec.crop]
    if spec.channel_order == "BGR":
        x = x[:, :, ::-1]
    x = x * np.float32(spec.scale)
    x = x - np.asarray(spec.mean, np.float32)
    x = x / np.asarray(spec.std, np.float32)
    if spec.layout == "NCHW":
        x = x.transpose(2, 0, 1)
    return np.ascontiguousarray(x[None], dtype=np.float32)


def run_graph(spec: PreprocessSpec, data: bytes) -> np.ndarray:
    session = make_preprocess_session(build_preprocess_graph(spec))
    return session.run(None, {"image_bytes": np.frombuffer(data, np.uint8)})[0]


def random_rgb(h: int, w: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def float_model(shape: list, name: str = "x", elem_type: int = TensorProto.FLOAT):
    return make_model(
        [helper.make_node("Identity", [name], ["y"])],
        [helper.make_tensor_value_info(name, elem_type, shape)],
        [helper.make_tensor_value_info("y", elem_type, shape)],
    )


# ------------------------------------------------------------------------------------------------
# PreprocessSpec
# ------------------------------------------------------------------------------------------------


def test_parse_model_specs():
    sq = PreprocessSpec.parse(SQUEEZENET_SPEC)
    assert sq == PreprocessSpec(
        resize=256, crop=224, mean=(104, 117, 123), scale=1.0, channel_order="BGR"
    )
    mb = PreprocessSpec.parse(MOBILENETV2_SPEC)
    assert mb.scale == pytest.approx(1 / 255)
    assert mb.mean == (0.485, 0.456, 0.406) and mb.std == (0.229, 0.224, 0.225)
    assert (mb.channel_order, mb.layout) == ("RGB", "NCHW")
    for spec in (sq, mb, PreprocessSpec()):
        assert PreprocessSpec.parse(spec.to_string()) == spec


def test_parse_defaults_broadcast_and_case():
    assert PreprocessSpec.parse("") == PreprocessSpec()
    spec = PreprocessSpec.parse(" Mean=0.5 , STD=2 , order=bgr, layout=nhwc ")
    assert spec.mean == (0.5, 0.5, 0.5) and spec.std == (2.0, 2.0, 2.0)
    assert spec.channel_order == "BGR" and spec.layout == "NHWC"
    assert PreprocessSpec(channel_order="bgr", layout="nhwc").channel_order == "BGR"


@pytest.mark.parametrize(
    ("text", "suggestion"),
    [
        ("crops=224", "'crop'"),
        ("ordr=BGR", "'order'"),
        ("meen=1", "'mean'"),
        ("brightness=2", None),
    ],
)
def test_parse_unknown_key_names_closest(text, suggestion):
    with pytest.raises(ConfigError, match="unknown preprocess spec key") as info:
        PreprocessSpec.parse(text)
    if suggestion:
        assert f"did you mean {suggestion}" in str(info.value)
    else:
        assert "did you mean" not in str(info.value)


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("resize=-1", "non-negative integer"),
        ("resize=2.5", "non-negative integer"),
        ("crop=abc", "N or HxW"),
        ("mean=1;2", "three"),
        ("std=1;0;1", "non-zero"),
        ("scale=0", "non-zero"),
        ("scale=1/0", "1/255"),
        ("scale=nan", "finite"),
        ("order=RGBA", "RGB, BGR"),
        ("layout=NCWH", "NCHW, NHWC"),
        ("resize=200,crop=224", "larger than resize"),
        ("resize", "key=value"),
        ("crop=224,crop=200", "twice"),
        ("order=BGR,channel_order=RGB", "twice"),
    ],
)
def test_parse_bad_values(text, fragment):
    with pytest.raises(ConfigError, match=fragment):
        PreprocessSpec.parse(text)


# ------------------------------------------------------------------------------------------------
# The graph against the numpy reference (lossless PNG: exact pixels)
# ------------------------------------------------------------------------------------------------


def test_channel_order_of_the_output():
    rgb = np.zeros((4, 6, 3), np.uint8)
    rgb[..., 0] = 200  # red
    rgb[..., 1] = 50
    rgb[..., 2] = 10
    data = png_bytes(rgb)
    np.testing.assert_array_equal(decode_rgb(data)[0, 0], [200, 50, 10])
    assert decoder_channel_order() in ("RGB", "BGR")
    as_rgb = run_graph(PreprocessSpec(resize=0, crop=0, channel_order="RGB"), data)
    as_bgr = run_graph(PreprocessSpec(resize=0, crop=0, channel_order="BGR"), data)
    np.testing.assert_array_equal(as_rgb[0, :, 0, 0], [200, 50, 10])
    np.testing.assert_array_equal(as_bgr[0, :, 0, 0], [10, 50, 200])
    # a graph built for a decoder of the other order swaps the channels (the probe matters)
    other = "BGR" if decoder_channel_order() == "RGB" else "RGB"
    graph = build_preprocess_graph(PreprocessSpec(0, 0, channel_order="RGB"), decoder_order=other)
    swapped = make_preprocess_session(graph).run(
        None, {"image_bytes": np.frombuffer(data, np.uint8)}
    )
    np.testing.assert_array_equal(swapped[0][0, :, 0, 0], [10, 50, 200])


def test_greyscale_png_becomes_three_equal_channels():
    grey = random_rgb(5, 7)[:, :, 0]
    out = run_graph(PreprocessSpec(resize=0, crop=0, layout="NHWC"), png_bytes(grey))
    np.testing.assert_array_equal(out[0], np.repeat(grey[:, :, None], 3, axis=2).astype(np.float32))


def test_identity_spec_is_exact_and_adds_no_arithmetic():
    rgb = random_rgb(9, 14)
    spec = PreprocessSpec(resize=0, crop=0, layout="NHWC")
    graph = build_preprocess_graph(spec)
    ops = {n.op_type for n in graph.graph.node}
    assert not ops & {"Resize", "Slice", "Mul", "Sub", "Div", "Transpose"}
    out = run_graph(spec, png_bytes(rgb))
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out[0], rgb.astype(np.float32))


@pytest.mark.parametrize(
    "text",
    [
        "resize=20,crop=16,order=RGB",  # shrink, landscape
        "resize=64,crop=0,order=BGR",  # enlarge, no crop
        "resize=0,crop=30,order=RGB",  # crop only
        MOBILENETV2_SPEC.replace("256", "24").replace("224", "22"),
        "resize=33,crop=31,mean=104;117;123,order=BGR,layout=NHWC",
        "resize=37,crop=0,scale=0.5,mean=3,std=7;8;9",  # short side unchanged
    ],
)
@pytest.mark.parametrize("size", [(37, 53), (53, 37)])
def test_graph_matches_numpy_reference(text, size):
    spec = PreprocessSpec.parse(text)
    rgb = random_rgb(*size, seed=sum(size))
    out = run_graph(spec, png_bytes(rgb))
    ref = reference_preprocess(rgb, spec)
    assert out.shape == ref.shape
    np.testing.assert_allclose(out, ref, rtol=0, atol=1e-3)
    if spec.crop:
        side = out.shape[2] if spec.layout == "NCHW" else out.shape[1]
        assert side == spec.crop


@pytest.mark.parametrize(
    ("size", "resize", "expected"),
    [((30, 45), 20, (20, 30)), ((45, 30), 20, (30, 20)), ((7, 10), 5, (5, 7)), ((9, 9), 4, (4, 4))],
)
def test_resize_short_side_and_truncated_long_side(size, resize, expected):
    out = run_graph(PreprocessSpec(resize=resize, crop=0), png_bytes(random_rgb(*size)))
    assert out.shape[2:] == expected


def test_centre_crop_rounds_half_to_even():
    rgb = random_rgb(8, 11)
    out = run_graph(PreprocessSpec(resize=0, crop=4, layout="NHWC"), png_bytes(rgb))
    # (8-4)/2 = 2 and (11-4)/2 = 3.5 -> 4 (floor would give 3)
    np.testing.assert_array_equal(out[0], rgb[2:6, 4:8].astype(np.float32))


# ------------------------------------------------------------------------------------------------
# The reader
# ------------------------------------------------------------------------------------------------


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    (tmp_path / "b.PNG").write_bytes(png_bytes(random_rgb(12, 10, 1)))
    (tmp_path / "a.png").write_bytes(png_bytes(random_rgb(10, 12, 2)))
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.jpeg").write_bytes(jpeg_bytes(random_rgb(16, 16, 3)))
    (tmp_path / ".hidden.png").write_bytes(b"not an image")
    (tmp_path / "labels.txt").write_text("a.png 0\n")
    return tmp_path


def test_reader_order_limit_rewind(folder):
    spec = PreprocessSpec(resize=8, crop=8)
    reader = ImageFolderDataReader(folder, float_model([1, 3, 8, 8]), spec)
    assert [p.relative_to(folder).as_posix() for p in reader.files] == [
        "a.png",
        "b.PNG",
        "sub/c.jpeg",
    ]
    first = [reader.get_next() for _ in range(4)]
    assert first[3] is None
    assert all(set(item) == {"x"} and item["x"].shape == (1, 3, 8, 8) for item in first[:3])
    reference = reference_preprocess(random_rgb(10, 12, 2), spec)
    np.testing.assert_allclose(first[0]["x"], reference, rtol=0, atol=1e-3)
    reader.rewind()
    np.testing.assert_array_equal(reader.get_next()["x"], first[0]["x"])
    assert len(list(reader)) == 3
    limited = ImageFolderDataReader(folder, float_model([1, 3, 8, 8]), spec, limit=2)
    assert len(limited) == 2 and [p.name for p in limited.files] == ["a.png", "b.PNG"]
    flat = ImageFolderDataReader(folder, float_model([1, 3, 8, 8]), spec, recursive=False)
    assert [p.name for p in flat.files] == ["a.png", "b.PNG"]
    assert list_image_files(folder, ["JPEG"]) == [folder / "sub" / "c.jpeg"]


def test_reader_accepts_symbolic_batch_and_nhwc(folder, tmp_path):
    spec = PreprocessSpec(resize=8, crop=8, layout="NHWC")
    path = tmp_path / "m.onnx"
    onnx.save(float_model(["batch", 8, 8, 3]), path)
    reader = ImageFolderDataReader(folder, path, spec)
    assert reader.get_next()["x"].shape == (1, 8, 8, 3)


@pytest.mark.parametrize(
    ("shape", "spec", "fragments"),
    [
        ([1, 3, 224, 224], PreprocessSpec(resize=8, crop=8), ["[1, 3, 224, 224]", "[1, 3, 8, 8]"]),
        ([1, 8, 8, 3], PreprocessSpec(resize=8, crop=8), ["[1, 8, 8, 3]", "[1, 3, 8, 8]"]),
        ([2, 3, 8, 8], PreprocessSpec(resize=8, crop=8), ["[2, 3, 8, 8]"]),
        ([1, 192], PreprocessSpec(resize=8, crop=8), ["[1, 192]", "rank"]),
    ],
)
def test_reader_rejects_model_shape(folder, shape, spec, fragments):
    with pytest.raises(CalibrationError, match="model input 'x'") as info:
        ImageFolderDataReader(folder, float_model(shape), spec)
    for fragment in fragments:
        assert fragment in str(info.value)


def test_reader_checks_each_image_when_size_is_open(folder):
    reader = ImageFolderDataReader(folder, float_model([1, 3, 10, 12]), PreprocessSpec(0, 0))
    assert reader.get_next()["x"].shape == (1, 3, 10, 12)  # a.png is 10 x 12
    with pytest.raises(CalibrationError, match=r"b\.PNG.*\[1, 3, 12, 10\].*\[1, 3, 10, 12\]"):
        reader.get_next()


def test_reader_reports_image_smaller_than_crop(tmp_path):
    (tmp_path / "small.png").write_bytes(png_bytes(random_rgb(5, 6)))
    reader = ImageFolderDataReader(tmp_path, float_model([1, 3, 8, 8]), PreprocessSpec(0, 8))
    with pytest.raises(CalibrationError, match=r"small\.png.*smaller than the crop"):
        reader.get_next()


def test_reader_rejects_input_type_and_names(folder):
    spec = PreprocessSpec(resize=8, crop=8)
    with pytest.raises(CalibrationError, match="'x' is UINT8"):
        ImageFolderDataReader(folder, float_model([1, 3, 8, 8], elem_type=TensorProto.UINT8), spec)
    two = make_model(
        [helper.make_node("Add", ["image", "bias"], ["y"])],
        [
            helper.make_tensor_value_info("image", TensorProto.FLOAT, [1, 3, 8, 8]),
            helper.make_tensor_value_info("bias", TensorProto.FLOAT, [1, 3, 8, 8]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3, 8, 8])],
    )
    with pytest.raises(CalibrationError, match="has 2 inputs.*input_name"):
        ImageFolderDataReader(folder, two, spec)
    with pytest.raises(CalibrationError, match="no input 'imag'; did you mean 'image'"):
        ImageFolderDataReader(folder, two, spec, input_name="imag")
    reader = ImageFolderDataReader(folder, two, spec, input_name="image")
    assert set(reader.get_next()) == {"image"}


def test_reader_rejects_missing_or_empty_folder(tmp_path):
    model = float_model([1, 3, 8, 8])
    with pytest.raises(CalibrationError, match="does not exist"):
        ImageFolderDataReader(tmp_path / "nope", model, PreprocessSpec(8, 8))
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(CalibrationError, match="no image files"):
        ImageFolderDataReader(tmp_path, model, PreprocessSpec(8, 8))


def test_undecodable_file_raises_or_is_skipped(folder, caplog):
    (folder / "0_broken.jpg").write_bytes(b"<html>not found</html>")
    spec = PreprocessSpec(resize=8, crop=8)
    reader = ImageFolderDataReader(folder, float_model([1, 3, 8, 8]), spec)
    with pytest.raises(CalibrationError, match=r"0_broken\.jpg: cannot be decoded"):
        reader.get_next()
    skipping = ImageFolderDataReader(folder, float_model([1, 3, 8, 8]), spec, skip_undecodable=True)
    with caplog.at_level(logging.WARNING, logger="quark_onnx.calibration.image_reader"):
        items = list(skipping)
    assert len(items) == 3
    assert any("0_broken.jpg" in r.getMessage() for r in caplog.records)


def test_png_errors_from_the_decoder_name_the_file(tmp_path):
    (tmp_path / "cut.png").write_bytes(png_bytes(random_rgb(8, 8))[:60])
    reader = ImageFolderDataReader(tmp_path, float_model([1, 3, 8, 8]), PreprocessSpec(8, 8))
    with pytest.raises(CalibrationError, match=r"cut\.png: cannot be decoded"):
        reader.get_next()


# ------------------------------------------------------------------------------------------------
# The guard in front of libjpeg (which exits the process or hangs on bad input)
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def jpeg() -> bytes:
    return jpeg_bytes(random_rgb(24, 40, 5))


def test_valid_files_pass_the_guard(jpeg):
    assert check_encoded_image(jpeg) == "jpeg"
    assert check_encoded_image(png_bytes(random_rgb(3, 3))) == "png"
    assert check_encoded_image(jpeg + b"trailing bytes") == "jpeg"
    decoded = decode_rgb(jpeg)  # and the decoder agrees
    assert decoded.shape == (24, 40, 3)


def test_every_truncation_of_a_jpeg_is_rejected(jpeg):
    for cut in range(0, len(jpeg) - 1, 7):
        with pytest.raises(CalibrationError, match="cannot be decoded"):
            check_encoded_image(jpeg[:cut], f"cut{cut}")


def _segment_offset(data: bytes, marker: int) -> int:
    pos = 2
    while data[pos + 1] != marker:
        pos += 2 + int.from_bytes(data[pos + 2 : pos + 4], "big")
    return pos


# A frame header of 16 x 16 pixels with four components (CMYK).
_CMYK_SOF = b"\xff\xc0\x00\x14\x08\x00\x10\x00\x10\x04" + b"".join(
    bytes([i, 0x11, 0]) for i in range(1, 5)
)


def _set_byte(data: bytes, pos: int, value: int) -> bytes:
    return data[:pos] + bytes([value]) + data[pos + 1 :]


@pytest.mark.parametrize(
    ("mutate", "fragment"),
    [
        (lambda d: d[:2] + b"\xff\xd8" + d[2:], "second start-of-image"),
        (lambda d: d[:2] + b"\xff\x6f\x00\x04ab" + d[2:], "unknown marker FF 6F"),
        (lambda d: d[:2] + b"\xff\xe1\x7f\xff" + d[2:], "has length 32767"),
        (lambda d: d.replace(b"\xff\xc0", b"\xff\xc9", 1), "arithmetic-coded"),
        (lambda d: d.replace(b"\xff\xc0", b"\xff\xc3", 1), "lossless"),
        (lambda d: _set_byte(d, _segment_offset(d, 0xC0) + 4, 12), "12-bit"),
        (lambda d: _set_byte(d, _segment_offset(d, 0xC0) + 9, 4), "frame header length"),
        (lambda d: d[:2] + _CMYK_SOF + d[2:], "CMYK"),
        (lambda d: d[: _segment_offset(d, 0xDA)] + b"\xff\xd9", "no frame or no scan"),
        (lambda d: d[:-2] + b"\x00\x00", "without an FF D9"),
        (lambda d: d[:-2] + b"\xff\x12\xff\xd9", "unknown marker FF 12"),
    ],
)
def test_malformed_jpeg_is_rejected(jpeg, mutate, fragment):
    with pytest.raises(CalibrationError, match=fragment):
        check_encoded_image(mutate(jpeg), "bad.jpg")


def test_interlaced_png_and_garbage_are_rejected():
    with pytest.raises(CalibrationError, match="interlaced"):
        check_encoded_image(png_bytes(random_rgb(4, 4), interlace=1))
    with pytest.raises(CalibrationError, match="neither a JPEG"):
        check_encoded_image(b"GIF89a....")


def test_truncated_jpeg_ends_in_an_error_not_an_exit(tmp_path, jpeg):
    """Run the reader in a child process: libjpeg without the guard would hang on this file."""
    (tmp_path / "cut.jpg").write_bytes(jpeg[: len(jpeg) // 2])
    (tmp_path / "model.onnx").write_bytes(float_model([1, 3, 8, 8]).SerializeToString())
    script = (
        "import sys, json\n"
        "from quark_onnx import ImageFolderDataReader, PreprocessSpec\n"
        "from quark_onnx.errors import CalibrationError\n"
        "r = ImageFolderDataReader(sys.argv[1], sys.argv[2], PreprocessSpec(8, 8))\n"
        "try:\n    r.get_next()\nexcept CalibrationError as e:\n    print(json.dumps(str(e)))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path), str(tmp_path / "model.onnx")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "cut.jpg: cannot be decoded: truncated JPEG" in json.loads(done.stdout)


# ------------------------------------------------------------------------------------------------
# Real models and ImageNet calibration images
# ------------------------------------------------------------------------------------------------

N_REAL = 10


def _real_inputs(model_file: str, spec_text: str):
    folder = shared_path("data", "imagenet", "calib")
    model = shared_path("models", model_file)
    spec = PreprocessSpec.parse(spec_text)
    reader = ImageFolderDataReader(folder, model, spec, limit=N_REAL)
    return reader, spec


@pytest.mark.real_model
@pytest.mark.parametrize(
    ("model_file", "spec_text"),
    [("squeezenet1.1.onnx", SQUEEZENET_SPEC), ("mobilenetv2_rebuilt.onnx", MOBILENETV2_SPEC)],
)
def test_real_images_match_numpy_reference(model_file, spec_text, record_property):
    reader, spec = _real_inputs(model_file, spec_text)
    reader.get_next()  # build the session outside the timing
    reader.rewind()
    worst = 0.0
    start = time.perf_counter()
    outputs = [reader.get_next()[reader.input_name] for _ in reader.files]
    per_image = (time.perf_counter() - start) / len(reader.files)
    assert reader.get_next() is None
    for path, out in zip(reader.files, outputs, strict=True):
        ref = reference_preprocess(decode_rgb(path.read_bytes()), spec)
        assert out.shape == ref.shape == (1, 3, 224, 224)
        worst = max(worst, float(np.abs(out - ref).max()))
    record_property("max_abs_vs_numpy", worst)
    record_property("seconds_per_image", per_image)
    print(f"\n{model_file}: max |graph - numpy| = {worst:.3g}; {per_image * 1e3:.1f} ms/image")
    assert worst <= 1e-3


@pytest.mark.real_model
def test_real_jpeg_decoder_against_pillow(record_property):
    """How far onnxruntime-extensions' JPEG decoder is from Pillow's (measured, stated)."""
    image_module = pytest.importorskip("PIL.Image")
    folder = shared_path("data", "imagenet", "calib")
    files = list_image_files(folder)[:N_REAL]
    pixel_max, pixel_mean = 0, 0.0
    input_max = {"squeezenet": 0.0, "mobilenetv2": 0.0}
    specs = {
        "squeezenet": PreprocessSpec.parse(SQUEEZENET_SPEC),
        "mobilenetv2": PreprocessSpec.parse(MOBILENETV2_SPEC),
    }
    for path in files:
        ours = decode_rgb(path.read_bytes())
        with image_module.open(path) as img:
            theirs = np.asarray(img.convert("RGB"))
        diff = np.abs(ours.astype(np.int16) - theirs.astype(np.int16))
        pixel_max = max(pixel_max, int(diff.max()))
        pixel_mean += float(diff.mean()) / len(files)
        for key, spec in specs.items():
            delta = np.abs(reference_preprocess(ours, spec) - reference_preprocess(theirs, spec))
            input_max[key] = max(input_max[key], float(delta.max()))
    record_property("decoder_max_abs_grey_levels", pixel_max)
    record_property("decoder_mean_abs_grey_levels", pixel_mean)
    record_property("input_max_abs", input_max)
    print(
        f"\nDecodeImage vs Pillow on {len(files)} JPEGs: max {pixel_max} grey levels, mean "
        f"{pixel_mean:.3f}; after pre-processing: max {input_max}"
    )
    assert pixel_mean < 1.0  # same libjpeg family: rounding-level differences only


@pytest.mark.real_model
def test_real_greyscale_jpeg(record_property):
    """A greyscale JPEG: one channel from the decoder, three equal channels in the output."""
    path = shared_path("data", "imagenet", "calib", "n03908714_pencil_sharpener.JPEG")
    spec = PreprocessSpec.parse(MOBILENETV2_SPEC)
    out = run_graph(spec, path.read_bytes())
    ref = reference_preprocess(decode_rgb(path.read_bytes()), spec)
    pixels = decode_rgb(path.read_bytes())
    assert (pixels[..., 0] == pixels[..., 2]).all()
    worst = float(np.abs(out - ref).max())
    record_property("max_abs_vs_numpy", worst)
    assert worst <= 1e-3


# ------------------------------------------------------------------------------------------------
# Resize modes, letterbox, fixed height, multiples, greyscale (against numpy and the pipelines'
# own Python size arithmetic)
# ------------------------------------------------------------------------------------------------


#: A worked spec per model family, as docs/preprocessing.md gives them (scaled down for speed).
FAMILY_SPECS = [
    # classifier (ImageNet): short side, centre crop
    "resize=40,crop=32,scale=1/255,mean=0.485;0.456;0.406,std=0.229;0.224;0.225",
    # non-square classifier/segmenter (road segmentation 512x896): cover, centre crop
    "resize=short,size=24x42,scale=1/255,mean=0.485;0.456;0.406,std=0.229;0.224;0.225",
    # face detector 240x320 (UltraFace): stretch, (x - 127) / 128
    "resize=stretch,size=24x32,mean=127,std=128",
    # YOLOX: letterbox, pad 114, top-left, BGR, no normalisation
    "letterbox,size=32x32,pad=114,order=BGR",
    "resize=fit,size=20x36,pad=-1,align=center,scale=1/255",
    # OCR direction classifier 48x192 / recognition 32xW: fixed height, keep ratio, pad right
    "resize=height,size=12x48,scale=1/255,mean=0.5,std=0.5,order=BGR",
    "resize=height,size=8,scale=1/255,mean=0.5,std=0.5",
    # OCR detection: long side, multiples of 32
    "resize=long,size=40,multiple=8,scale=1/255,mean=0.485;0.456;0.406,std=0.229;0.224;0.225",
    # greyscale, NHWC, non-square crop
    "grayscale,resize=short,size=13,multiple=4,scale=1/255,mean=0.5,std=0.25,layout=NHWC",
    "resize=0,crop=7x14,align=topleft,layout=NHWC",
]


@pytest.mark.parametrize("text", FAMILY_SPECS)
@pytest.mark.parametrize("size", [(37, 53), (53, 37), (8, 90), (24, 32)])
def test_modes_match_numpy_reference(text, size):
    spec = PreprocessSpec.parse(text)
    rgb = random_rgb(*size, seed=size[0] * size[1])
    out = run_graph(spec, png_bytes(rgb))
    ref = reference_general(rgb, spec)
    assert out.shape == ref.shape
    fixed = spec.output_shape()
    assert all(f is None or f == o for f, o in zip(fixed, out.shape, strict=True))
    # relative to the value range: 1e-5 of 255 for unnormalised specs
    span = max(1.0, float(np.abs(ref).max()))
    np.testing.assert_allclose(out, ref, rtol=0, atol=1e-5 * span)


@pytest.mark.parametrize(
    ("text", "size", "expected"),
    [
        ("letterbox,size=640", (480, 640), (480, 640)),
        ("letterbox,size=640", (427, 640), (427, 640)),
        ("letterbox,size=416x416", (375, 500), (312, 416)),  # int(375 * 0.832) = 312
        ("resize=height,size=48x192", (30, 100), (48, 160)),  # ceil(48 * 3.333...) = 160
        ("resize=height,size=48x192", (30, 500), (48, 192)),  # clamped to the width
        ("resize=height,size=32", (31, 97), (32, 101)),  # ceil(100.129...)
        ("resize=long,size=960,multiple=32", (720, 1280), (544, 960)),  # 540 -> 544
        ("resize=long,size=960,multiple=32", (100, 3000), (32, 960)),  # 32 at least
        ("resize=short,size=240x320", (480, 500), (307, 320)),  # round(480 * 0.64)
    ],
)
def test_resized_sizes_follow_the_pipelines_arithmetic(text, size, expected):
    spec = PreprocessSpec.parse(text)
    assert reference_sizes(*size, spec) == expected
    graph = build_preprocess_graph(spec)
    # expose the resized image's shape
    graph.graph.output.append(helper.make_tensor_value_info("resized", TensorProto.FLOAT, None))
    session = make_preprocess_session(graph)
    image = png_bytes(np.zeros((*size, 3), np.uint8))
    _, resized = session.run(None, {"image_bytes": np.frombuffer(image, np.uint8)})
    assert resized.shape[:2] == expected


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("size=240x320", "needs a resize mode"),
        ("resize=fit", "needs size="),
        ("resize=long,size=240x320", "give one length"),
        ("resize=stretchh,size=4", "did you mean 'stretch'"),
        ("letterbox,size=64,crop=32", "cannot be combined"),
        ("resize=stretch,size=64,pad=114", "padding modes only"),
        ("resize=fit,size=64,multiple=32", "already fixed"),
        ("resize=short,size=0x4", "N or HxW"),
        ("size=2x3x4,resize=fit", "N or HxW"),
        ("align=middle", "center or topleft"),
        ("gray=maybe", "true or false"),
        ("grayscale,mean=1;2;3", "one mean"),
    ],
)
def test_parse_bad_mode_combinations(text, fragment):
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        PreprocessSpec.parse(text)


def test_new_specs_read_back_and_keep_the_old_meaning():
    assert PreprocessSpec.parse("resize=stretch,size=240x320").crop == 0  # no implicit crop
    assert PreprocessSpec.parse("resize=256").crop == 224  # as before
    assert PreprocessSpec(resize=256, crop=224) == PreprocessSpec.parse("resize=256,crop=224")
    assert PreprocessSpec.parse("letterbox=false").resize == 256
    for text in FAMILY_SPECS:
        spec = PreprocessSpec.parse(text)
        assert PreprocessSpec.parse(spec.to_string()) == spec


def test_mismatch_error_proposes_a_spec_that_works(folder):
    model = float_model([1, 3, 24, 32])
    spec = PreprocessSpec.parse("resize=256,crop=224,scale=1/255,mean=0.5,std=0.5")
    with pytest.raises(CalibrationError, match="a spec that fits") as info:
        ImageFolderDataReader(folder, model, spec)
    message = str(info.value)
    assert "crop/layout" not in message
    proposals = re.findall(r"'(resize=[^']*)'", message.split("a spec that fits")[1])
    assert len(proposals) == 3
    for text in proposals:  # every proposal is accepted by the reader and gives the model shape
        reader = ImageFolderDataReader(folder, model, PreprocessSpec.parse(text))
        batch = reader.get_next()["x"]
        assert batch.shape == (1, 3, 24, 32)
        assert PreprocessSpec.parse(text).mean == spec.mean  # normalisation kept


@pytest.mark.parametrize(
    ("shape", "expected_mode"),
    [([1, 1, 12, 40], "short"), ([1, 12, 40, 1], "short"), (["n", 3, 8, "w"], "height")],
)
def test_proposals_for_grey_nhwc_and_dynamic_width(folder, shape, expected_mode):
    model = float_model(shape)
    with pytest.raises(CalibrationError, match="a spec that fits") as info:
        ImageFolderDataReader(folder, model, PreprocessSpec())
    text = re.findall(r"'(resize=[^']*)'", str(info.value).split("a spec that fits")[1])[0]
    spec = PreprocessSpec.parse(text)
    assert spec.mode == expected_mode
    out = ImageFolderDataReader(folder, model, spec).get_next()["x"]
    assert all(not isinstance(d, int) or d == o for d, o in zip(shape, out.shape, strict=True))
