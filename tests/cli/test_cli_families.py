"""The CLI on small generated detectors, segmenters and OCR models (non-square, letterboxed,
fixed-height, dynamic-shape inputs): image-folder calibration with the documented specs, FixShapes
from the calibration data, summaries that fit each output, findings printed once.

Oracles: the calibration statistics of the model input (min, max, element count, saved with
``--save-calibration``) against the numpy reference of the pre-processing over the same images
(``image_reference.reference_general``); the agreement columns against onnxruntime runs of the float
and the quantized model.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import onnx
import pytest
from cli_helpers import run_cli
from conftest import make_model, run_ort
from image_reference import reference_general
from onnx import TensorProto, helper

from quark_onnx import ImageFolderDataReader, PreprocessSpec
from quark_onnx.calibration.image_graph import _png_rgb


def conv_net(dims: list, head: str, classes: int = 3, seed: int = 0) -> onnx.ModelProto:
    """x -> Conv 3x3/2 -> Relu -> Conv 3x3/2, then a head: ``dense`` (the [N, C, H/4, W/4] map,
    a segmenter), ``scores`` (GlobalAveragePool + Flatten: [N, C], a classifier) or ``boxes``
    ([1, H*W/16, C], a detector's rows of box values)."""
    rng = np.random.default_rng(seed)
    channels = dims[1] if isinstance(dims[1], int) else 3
    inits = {
        "w1": rng.normal(0, 0.3, (4, channels, 3, 3)).astype(np.float32),
        "b1": rng.normal(0, 0.1, 4).astype(np.float32),
        "w2": rng.normal(0, 0.3, (classes, 4, 3, 3)).astype(np.float32),
        "b2": rng.normal(0, 0.1, classes).astype(np.float32),
    }
    conv = {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1], "strides": [2, 2]}
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", **conv),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], name="conv2", **conv),
    ]
    if head == "dense":
        nodes[-1].output[0] = "y"
    elif head == "scores":
        nodes += [
            helper.make_node("GlobalAveragePool", ["c2"], ["g"], name="gap"),
            helper.make_node("Flatten", ["g"], ["y"], name="flatten"),
        ]
    else:
        inits["rows"] = np.array([1, classes, -1], np.int64)
        nodes += [
            helper.make_node("Reshape", ["c2", "rows"], ["flat"], name="reshape"),
            helper.make_node("Transpose", ["flat"], ["y"], name="transpose", perm=[0, 2, 1]),
        ]
    side = [(d + 3) // 4 if isinstance(d, int) else f"{d}4" for d in dims[2:]]  # ceil(ceil(d/2)/2)
    if head == "dense":
        out_dims = [dims[0], classes, *side]
    elif head == "scores":
        out_dims = [dims[0], classes]
    else:
        rows = side[0] * side[1] if all(isinstance(d, int) for d in side) else "rows"
        out_dims = [1, rows, classes]
    return make_model(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, dims)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, out_dims)],
        inits,
    )


def image_folder(path: Path, sizes: list[tuple[int, int]]) -> Path:
    path.mkdir()
    for i, (h, w) in enumerate(sizes):
        rgb = np.random.default_rng(i).integers(0, 256, (h, w, 3), dtype=np.uint8)
        (path / f"img{i}.png").write_bytes(_png_rgb(rgb))
    return path


# Image sizes: landscape, portrait, very wide (clamped by resize=height), square.
SIZES = [(50, 70), (90, 60), (20, 200), (64, 64), (41, 97)]

#: (family, model input, head, spec, agreement column) -- docs/preprocessing.md's worked specs.
FAMILIES = [
    (
        "face_detector",
        [1, 3, 240, 320],
        "boxes",
        "resize=stretch,size=240x320,mean=127,std=128",
        "-",
    ),
    ("yolox", [1, 3, 64, 64], "boxes", "letterbox,size=64,pad=114,order=BGR", "-"),
    (
        "segmenter",
        [1, 3, 48, 84],
        "dense",
        "resize=short,size=48x84,scale=1/255,mean=0.485;0.456;0.406,std=0.229;0.224;0.225",
        "pixels",
    ),
    (
        "ocr_direction",
        [1, 3, 48, 192],
        "scores",
        "resize=height,size=48x192,scale=1/255,mean=0.5,std=0.5,order=BGR",
        "top-1",
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize(("family", "dims", "head", "spec", "column"), FAMILIES)
def test_image_folder_calibration_per_family(tmp_path, family, dims, head, spec, column):
    images = image_folder(tmp_path / "images", SIZES)
    model = tmp_path / f"{family}.onnx"
    onnx.save(conv_net(dims, head), model)
    out = tmp_path / "out"
    result = run_cli(
        "quantize", model, "-o", out, "--calib", images, "--preprocess", spec,
        "--save-calibration", "--compare-samples", "3",
        # calibration reads every image (its statistics are the oracle's): no held-out verdict
        "--set", "FidelityHoldout=0", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = json.loads((out / f"{family}.report.json").read_text())
    assert report["calibration"]["samples"] == len(SIZES)
    assert report["check"]["ready"] is True

    # the model input's calibration statistics are those of the numpy reference
    parsed = PreprocessSpec.parse(spec)
    ref = [reference_general(_decoded(images / f"img{i}.png"), parsed) for i in range(len(SIZES))]
    assert all(r.shape == tuple(dims) for r in ref)
    stats = json.loads((out / f"{family}.calibration.json").read_text())["tensors"]["x"]
    span = max(1.0, max(float(np.abs(r).max()) for r in ref))
    assert stats["min"] == pytest.approx(min(float(r.min()) for r in ref), abs=1e-5 * span)
    assert stats["max"] == pytest.approx(max(float(r.max()) for r in ref), abs=1e-5 * span)
    assert stats["count"] == sum(r.size for r in ref)

    # the summary shows the verdict's number for the output (report.json, rounded)
    from quark_onnx.pipeline.report import fidelity_parts, part_number

    row = next(line for line in result.stdout.splitlines() if line.startswith(family))
    (part, *_) = fidelity_parts(report["fidelity"])
    assert row.endswith(f"{part['part']}: {part_number(part)}")
    # the comparison's agreement fits the output; its value is the onnxruntime oracle's
    comparison = json.loads((out / f"{family}.compare.json").read_text())
    (output,) = comparison["outputs"]
    reader = ImageFolderDataReader(images, model, parsed, limit=3)
    float_model, quant_model = onnx.load(model), onnx.load(out / f"{family}.onnx")
    pairs = [(run_ort(float_model, f)[0], run_ort(quant_model, f)[0]) for f in reader]
    if column == "-":
        assert output["top1_agreement"] is None and output["argmax_agreement"] is None
    else:
        axis = 1
        agree = np.concatenate([(f.argmax(axis) == q.argmax(axis)).ravel() for f, q in pairs])
        key = "top1_agreement" if column == "top-1" else "argmax_agreement"
        assert output[key] == pytest.approx(float(agree.mean()), abs=1e-12)
    f_all = np.concatenate([f.ravel() for f, _ in pairs]).astype(np.float64)
    q_all = np.concatenate([q.ravel() for _, q in pairs]).astype(np.float64)
    cosine = f_all @ q_all / np.sqrt((f_all @ f_all) * (q_all @ q_all))
    assert output["cosine"] == pytest.approx(cosine, rel=1e-6)


def _decoded(path: Path) -> np.ndarray:
    """The RGB pixels of one of the PNGs written by image_folder (lossless: the same array)."""
    i = int(path.stem[3:])
    h, w = SIZES[i]
    return np.random.default_rng(i).integers(0, 256, (h, w, 3), dtype=np.uint8)


def test_a_spec_that_does_not_fit_proposes_one_that_does(tmp_path):
    images = image_folder(tmp_path / "images", SIZES[:2])
    model = tmp_path / "face.onnx"
    onnx.save(conv_net([1, 3, 240, 320], "boxes"), model)
    spec = "resize=256,crop=224,mean=127,std=128"
    result = run_cli(
        "quantize", model, "-o", tmp_path / "out", "--calib", images, "--preprocess", spec,
        "--compare-samples", "0", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 1
    (error,) = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert "crop/layout" not in error
    proposal = re.search(r"a spec that fits: --preprocess '([^']*)'", error).group(1)
    assert PreprocessSpec.parse(proposal).mean == (127.0,) * 3  # the normalisation is kept
    again = run_cli(
        "quantize", model, "-o", tmp_path / "out", "--calib", images, "--preprocess", proposal,
        "--compare-samples", "0", cwd=tmp_path,
    )  # fmt: skip
    assert again.returncode == 0, again.stderr


# ------------------------------------------------------------------------------------------------
# Dynamic shapes: FixShapes from the calibration data
# ------------------------------------------------------------------------------------------------


@pytest.fixture
def dynamic(tmp_path) -> tuple[Path, Path]:
    model = tmp_path / "dyn.onnx"
    onnx.save(conv_net(["N", 3, "H", "W"], "scores"), model)
    calib = tmp_path / "calib.npz"
    rng = np.random.default_rng(1)
    np.savez(calib, x=rng.uniform(0, 1, (6, 3, 64, 96)).astype(np.float32))
    return model, calib


def _input_dims(path: Path) -> list:
    (value,) = onnx.load(path).graph.input
    dims = value.type.tensor_type.shape.dim
    return [d.dim_value if d.HasField("dim_value") else d.dim_param for d in dims]


@pytest.mark.slow
def test_dynamic_model_is_written_static_by_default_under_xint8(tmp_path, dynamic):
    model, calib = dynamic
    out = tmp_path / "out"
    result = run_cli("quantize", model, "-o", out, "--calib", calib, "--require-ready",
                     cwd=tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert _input_dims(out / "dyn.onnx") == [1, 3, 64, 96]
    report = json.loads((out / "dyn.report.json").read_text())
    assert report["check"]["ready"] is True
    (note,) = report["notes"]
    assert "FixShapes='x:[1,3,64,96]'" in note and "default for NPU presets" in note
    assert f"note: {note}" in (out / "dyn.report.txt").read_text()
    # the quantized static model computes what the float dynamic one does on that shape
    feed = {"x": np.load(calib)["x"][:1]}
    f, q = run_ort(onnx.load(model), feed)[0], run_ort(onnx.load(out / "dyn.onnx"), feed)[0]
    assert f.shape == q.shape == (1, 3)


@pytest.mark.slow
def test_dynamic_model_kept_dynamic_is_not_ready_and_says_how_to_fix(tmp_path, dynamic):
    model, calib = dynamic
    out = tmp_path / "out"
    args = ("quantize", model, "-o", out, "--calib", calib, "--no-fix-shapes-from-calib")
    result = run_cli(*args, "--compare-samples", "0", cwd=tmp_path)
    assert result.returncode == 0  # written and reported, not a failure without --require-ready
    assert _input_dims(out / "dyn.onnx") == [1, 3, "H", "W"]  # XINT8's FixDynamicBatch only
    report = json.loads((out / "dyn.report.json").read_text())
    assert report["check"]["ready"] is False and report["notes"] == []
    findings = report["check"]["findings"]
    dynamic_findings = [f for f in findings if f["rule"] == "dynamic_shape"]
    assert dynamic_findings and "FixShapes" in dynamic_findings[0]["message"]
    assert "onnxsim" not in dynamic_findings[0]["message"]
    text = (out / "dyn.report.txt").read_text()
    for f in findings:  # each finding printed once
        assert text.count(f"{f['rule']}: {f['message']}") == 1
    strict = run_cli(*args, "--compare-samples", "0", "--overwrite", "--require-ready",
                     cwd=tmp_path)  # fmt: skip
    assert strict.returncode == 1


@pytest.mark.slow
def test_non_npu_preset_offers_the_shape_and_fixes_it_when_asked(tmp_path, dynamic):
    model, calib = dynamic
    base = ("quantize", model, "--calib", calib, "--config", "A8W8", "--compare-samples", "0")
    offered = run_cli(*base, "-o", tmp_path / "a", cwd=tmp_path)
    assert offered.returncode == 0, offered.stderr
    assert "--fix-shapes-from-calib" in offered.stderr and "x:[1,3,64,96]" in offered.stderr
    assert _input_dims(tmp_path / "a" / "dyn.onnx")[0] == "N"
    asked = run_cli(*base, "-o", tmp_path / "b", "--fix-shapes-from-calib", cwd=tmp_path)
    assert asked.returncode == 0, asked.stderr
    assert _input_dims(tmp_path / "b" / "dyn.onnx") == [1, 3, 64, 96]
    (note,) = json.loads((tmp_path / "b" / "dyn.report.json").read_text())["notes"]
    assert "(--fix-shapes-from-calib)" in note
