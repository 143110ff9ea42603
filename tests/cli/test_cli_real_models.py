"""The ``quark-onnx`` console script on the real models of ../shared (subprocess)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from cli_helpers import run_cli
from conftest import shared_path
from image_reference import resize_axis
from onnx import TensorProto, helper

from quark_onnx.calibration.image_graph import (
    EXTENSIONS_DOMAIN,
    decoder_channel_order,
    make_preprocess_session,
)

pytestmark = [pytest.mark.real_model, pytest.mark.slow]

SQUEEZENET_SPEC = "resize=256,crop=224,mean=104;117;123,order=BGR"


def _run_cli(*args: object, cwd: Path):
    """The console script with room for real models (twice the default timeout)."""
    return run_cli(*args, cwd=cwd, timeout=1200)


def test_batch_of_real_models_with_a_corrupt_file(tmp_path):
    digits = shared_path("models", "digits_cnn.onnx")
    squeezenet = shared_path("models", "squeezenet1.1.onnx")
    corrupt = tmp_path / "broken.onnx"
    corrupt.write_bytes(squeezenet.read_bytes()[:5000])  # a truncated download
    out = tmp_path / "out"
    result = _run_cli(
        "quantize", digits, squeezenet, corrupt, "-o", out, "--random-calib", "8",
        "--jobs", "2", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 1
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(f"error: {corrupt}: ")
    assert "Traceback" not in result.stderr
    for name in ("digits_cnn", "squeezenet1.1"):
        assert (out / f"{name}.onnx").is_file()
        report = json.loads((out / f"{name}.report.json").read_text())
        assert report["calibration"]["samples"] == 8
        assert report["check"]["ready"] is True
        assert (out / f"{name}.report.txt").is_file()
        assert json.loads((out / f"{name}.compare.json").read_text())["samples"] == 8
    assert sorted(p.name for p in out.glob("*.onnx")) == ["digits_cnn.onnx", "squeezenet1.1.onnx"]
    rows = {line.split()[0]: line.split() for line in result.stdout.splitlines()[2:5]}
    assert rows["digits_cnn"][1] == rows["squeezenet1.1"][1] == "ok"
    assert rows["broken"][1] == "failed"

    ready = _run_cli("check", out / "squeezenet1.1.onnx", out / "digits_cnn.onnx", cwd=tmp_path)
    assert ready.returncode == 0, ready.stdout
    not_ready = _run_cli("check", squeezenet, cwd=tmp_path)
    assert not_ready.returncode == 1
    lines = not_ready.stdout.splitlines()
    assert lines[0].startswith(f"{squeezenet}: NOT Vitis AI ready")
    reasons = {line.split()[1].rstrip(":") for line in lines[1:]}
    assert {"not_quantized", "conv_default_attributes"} <= reasons


def _decode(data: bytes) -> np.ndarray:
    """H x W x 3 uint8 RGB pixels, decoded by onnxruntime-extensions' DecodeImage."""
    node = helper.make_node(
        "DecodeImage", ["b"], ["rgb"], domain=EXTENSIONS_DOMAIN, color_space="rgb"
    )
    graph = helper.make_graph(
        [node],
        "decode",
        [helper.make_tensor_value_info("b", TensorProto.UINT8, ["n"])],
        [helper.make_tensor_value_info("rgb", TensorProto.UINT8, None)],
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(EXTENSIONS_DOMAIN, 1)],
    )
    model.ir_version = 8
    (pixels,) = make_preprocess_session(model).run(None, {"b": np.frombuffer(data, np.uint8)})
    if pixels.shape[-1] == 1:
        pixels = np.repeat(pixels, 3, axis=-1)
    return pixels if decoder_channel_order() == "RGB" else pixels[:, :, ::-1]


def squeezenet_input(path: Path) -> np.ndarray:
    """Short side 256, centre crop 224, BGR, minus (104, 117, 123), NCHW: in numpy."""
    x = _decode(path.read_bytes()).astype(np.float32)
    h, w = x.shape[:2]
    x = resize_axis(x, 256 * h // min(h, w), 0)
    x = resize_axis(x, 256 * w // min(h, w), 1)
    top, left = round((x.shape[0] - 224) / 2), round((x.shape[1] - 224) / 2)
    x = x[top : top + 224, left : left + 224, ::-1] - np.array([104, 117, 123], np.float32)
    return np.ascontiguousarray(x.transpose(2, 0, 1)[None], dtype=np.float32)


def test_image_folder_calibration_equals_the_same_arrays_from_npz(tmp_path):
    """``--calib DIR --preprocess SPEC`` and the same images pre-processed here in numpy, given
    as an .npz, calibrate to identical positions (first 32 images in sorted order)."""
    model = shared_path("models", "squeezenet1.1.onnx")
    folder = shared_path("data", "imagenet", "calib")
    count = 32
    files = sorted(p for p in folder.iterdir() if p.suffix.lower() in (".jpg", ".jpeg", ".png"))
    arrays = np.concatenate([squeezenet_input(p) for p in files[:count]])
    np.savez(tmp_path / "calib.npz", x=arrays)
    # Bias correction reads the samples themselves, which differ by up to 6e-5 between the two
    # pre-processings; off here, so that equal calibration results give byte-equal models.
    common = ["--calib-limit", count, "--compare-samples", "4"]
    common += ["--set", "include_bias_correction=false"]
    images = _run_cli(
        "quantize", model, "-o", tmp_path / "images", "--calib", folder, "--preprocess",
        SQUEEZENET_SPEC, *common, cwd=tmp_path,
    )  # fmt: skip
    assert images.returncode == 0, images.stderr
    npz = _run_cli(
        "quantize", model, "-o", tmp_path / "npz", "--calib", tmp_path / "calib.npz", *common,
        cwd=tmp_path,
    )  # fmt: skip
    assert npz.returncode == 0, npz.stderr
    a = json.loads((tmp_path / "images" / "squeezenet1.1.report.json").read_text())
    b = json.loads((tmp_path / "npz" / "squeezenet1.1.report.json").read_text())
    # 8 of the 32 held out for the verdict, the same ones from both sources
    assert a["calibration"]["samples"] == b["calibration"]["samples"] == count - 8
    # every activation, weight and bias of SqueezeNet has a position (95 with Conv->Relu fused)
    assert len(a["positions"]) > 90
    assert a["positions"] == b["positions"]
    qa = onnx.load(tmp_path / "images" / "squeezenet1.1.onnx")
    qb = onnx.load(tmp_path / "npz" / "squeezenet1.1.onnx")
    assert qa.SerializeToString(deterministic=True) == qb.SerializeToString(deterministic=True)
    for run in ("images", "npz"):
        comparison = json.loads((tmp_path / run / "squeezenet1.1.compare.json").read_text())
        assert comparison["samples"] == 4


def test_image_folder_must_fit_the_model_input(tmp_path):
    """A crop the model cannot take fails this model with one line naming the shapes."""
    model = shared_path("models", "squeezenet1.1.onnx")
    folder = shared_path("data", "imagenet", "calib")
    result = _run_cli(
        "quantize", model, "-o", tmp_path / "o", "--calib", folder, "--preprocess",
        "resize=256,crop=200", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 1
    (line,) = [x for x in result.stderr.splitlines() if x.startswith("error:")]
    assert line.startswith(f"error: {model}: ") and "224" in line and "200" in line


# ------------------------------------------------------------------------------------------------
# Peak memory; a real detector and a real dynamic-shape OCR model from images
# ------------------------------------------------------------------------------------------------

_MEASURE = """
import json, resource, sys
from quark_onnx.cli import main
code = main(sys.argv[2:])
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
report = json.load(open(sys.argv[1]))
print(json.dumps({"code": code, "maxrss": peak, "report": report["process_peak_rss_mb"]}))
"""


@pytest.mark.parametrize(
    ("model", "calib"),
    [
        (("models", "squeezenet1.1.onnx"), ["--preprocess", SQUEEZENET_SPEC]),
        (
            ("models", "mobilenetv2_rebuilt.onnx"),
            [
                "--preprocess",
                "resize=256,crop=224,scale=1/255,mean=0.485;0.456;0.406,std=0.229;0.224;0.225",
            ],
        ),
        (("models", "digits_cnn.onnx"), None),
    ],
)
def test_report_peak_memory_is_the_process_high_water_mark(tmp_path, model, calib):
    """The report's peak (after the last stage, the comparison) is the process's ``ru_maxrss``
    measured after the whole command, within 10 %."""
    import subprocess
    import sys

    path = shared_path(*model)
    if calib is None:
        data = ["--calib", shared_path("models", "digits_calib.npz")]
    else:
        data = ["--calib", shared_path("data", "imagenet", "calib"), *calib]
    out = tmp_path / "out"
    report = out / f"{path.stem}.report.json"
    done = subprocess.run(
        [sys.executable, "-c", _MEASURE, str(report), "quantize", str(path), "-o", str(out),
         "--calib-limit", "32", *map(str, data)],
        capture_output=True, text=True, cwd=tmp_path, timeout=1200,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    measured = json.loads(done.stdout.splitlines()[-1])
    assert measured["code"] == 0
    assert abs(measured["report"] - measured["maxrss"]) <= 0.10 * measured["maxrss"], measured


def test_real_yolox_person_detector_from_images(tmp_path):
    """The documented YOLOX spec on the real letterboxed detector (BGR 0-255, pad 114, 192x192):
    ready, and the summary shows no top-1 for its box rows."""
    model = shared_path("models", "person_detector_192.onnx")
    folder = shared_path("data", "imagenet", "calib")
    out = tmp_path / "out"
    result = _run_cli(
        "quantize", model, "-o", out, "--calib", folder, "--calib-limit", "16", "--preprocess",
        "letterbox,size=192,pad=114,order=BGR", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = json.loads((out / "person_detector_192.report.json").read_text())
    assert report["check"]["ready"] is True
    (output,) = json.loads((out / "person_detector_192.compare.json").read_text())["outputs"]
    assert output["top1_agreement"] is None and output["argmax_agreement"] is None
    # the summary shows the verdict's number of the first part (a box part: no top-1)
    from quark_onnx.pipeline.report import fidelity_parts, part_number

    first = fidelity_parts(report["fidelity"])[0]
    row = next(r for r in result.stdout.splitlines() if r.startswith("person_detector_192"))
    assert row.endswith(f"{first['part']}: {part_number(first)}") and "top-1" not in row


def test_real_dynamic_ocr_classifier_is_written_static_and_ready(tmp_path):
    """PaddleOCR's direction classifier has input x [N, 3, H, W] (dynamic); with the documented
    fixed-height spec it is calibrated on 1x3x48x192 and written static, ready, as stated."""
    model = shared_path("models", "ppocr_direction_cls.onnx")
    folder = shared_path("data", "imagenet", "calib")
    out = tmp_path / "out"
    result = _run_cli(
        "quantize", model, "-o", out, "--calib", folder, "--calib-limit", "16", "--preprocess",
        "resize=height,size=48x192,scale=1/255,mean=0.5,std=0.5,order=BGR", "--require-ready",
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    (value,) = onnx.load(out / "ppocr_direction_cls.onnx").graph.input
    assert [d.dim_value for d in value.type.tensor_type.shape.dim] == [1, 3, 48, 192]
    report = json.loads((out / "ppocr_direction_cls.report.json").read_text())
    assert report["check"]["ready"] is True
    assert any("FixShapes='x:[1,3,48,192]'" in note for note in report["notes"])
    row = next(r for r in result.stdout.splitlines() if r.startswith("ppocr_direction_cls"))
    assert "top-1" in row
