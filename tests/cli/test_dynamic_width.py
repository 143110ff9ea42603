"""A text recognizer with a dynamic width: a spec whose width follows each image leaves it
dynamic (not ready) and the warning names the spec of one width that makes it static and ready."""

from __future__ import annotations

import json
import re

import numpy as np
import onnx
from cli_helpers import png_folder, run_cli
from conftest import make_model
from onnx import TensorProto, helper

from quark_onnx.calibration.image_spec import PreprocessSpec

#: The docs' recognizer spec before issue 38: height 32, the width free (rounded to 8).
FREE = "resize=height,size=32,multiple=8,scale=1/255,mean=0.5,std=0.5,order=BGR"


def _recognizer() -> onnx.ModelProto:
    """x[1, 3, 32, W] -> Conv 3x3 -> Relu -> Conv 3x3 -> y[1, 4, 32, W] (W dynamic)."""
    rng = np.random.default_rng(0)
    conv = {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1], "strides": [1, 1], "dilations": [1, 1]}
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", group=1, **conv),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("Conv", ["r1", "w2", "b2"], ["y"], name="conv2", group=1, **conv),
    ]
    inits = {
        "w1": rng.normal(0, 0.3, (8, 3, 3, 3)).astype(np.float32),
        "b1": rng.normal(0, 0.1, 8).astype(np.float32),
        "w2": rng.normal(0, 0.3, (4, 8, 3, 3)).astype(np.float32),
        "b2": rng.normal(0, 0.1, 4).astype(np.float32),
    }
    return make_model(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 32, "W"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 32, "W"])],
        inits,
    )


def _dims(path) -> list:
    dims = onnx.load(path).graph.input[0].type.tensor_type.shape.dim
    return [d.dim_value if d.HasField("dim_value") else d.dim_param for d in dims]


def test_a_free_width_spec_names_the_fixed_width_one_that_makes_it_ready(tmp_path):
    model = tmp_path / "rec.onnx"
    onnx.save(_recognizer(), model)
    images = png_folder(tmp_path / "images")
    args = ("quantize", model, "--calib", images, "--compare-samples", "0")

    free = run_cli(*args, "-o", tmp_path / "free", "--preprocess", FREE, cwd=tmp_path)
    assert free.returncode == 0, free.stderr
    report = json.loads((tmp_path / "free" / "rec.report.json").read_text())
    assert report["check"]["ready"] is False and _dims(tmp_path / "free" / "rec.onnx")[3] == "W"
    (dynamic,) = [f for f in report["check"]["findings"] if f["rule"] == "dynamic_shape"]
    # the default is not offered as the fix
    assert "--fix-shapes-from-calib" not in dynamic["message"]
    assert "resize=height,size=32x320" in dynamic["message"]
    proposed = re.search(r"--preprocess '([^']+)' \(each image padded", free.stderr)
    assert proposed, free.stderr
    assert PreprocessSpec.parse(proposed.group(1)) == PreprocessSpec.parse(
        "resize=height,size=32x320,scale=1/255,mean=0.5,std=0.5,order=BGR"
    )

    fixed = run_cli(*args, "-o", tmp_path / "fixed", "--preprocess", proposed.group(1),
                    cwd=tmp_path)  # fmt: skip
    assert fixed.returncode == 0, fixed.stderr
    assert "stays dynamic" not in fixed.stderr
    report = json.loads((tmp_path / "fixed" / "rec.report.json").read_text())
    assert report["check"]["ready"] is True, report["check"]["findings"]
    assert _dims(tmp_path / "fixed" / "rec.onnx") == [1, 3, 32, 320]


def test_a_spec_of_one_size_has_no_variant_and_others_none_known():
    assert PreprocessSpec.parse("resize=height,size=48x192").static_variant() is None
    assert PreprocessSpec.parse("resize=256").static_variant() is None  # nothing to propose
    assert PreprocessSpec.parse("resize=height,size=48").static_variant() == PreprocessSpec.parse(
        "resize=height,size=48x320"
    )
