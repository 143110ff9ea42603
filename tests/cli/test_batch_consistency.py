"""A batch without a manifest calibrates every model on one source: a model that seems to need
another pre-processing is named in a warning (quark_onnx.cli.consistency)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from cli_helpers import png_folder, run_cli, tiny_cnn

SPEC = "resize=stretch,size=8,scale=1/255"


def _classifier(seed: int, logit_scale: float) -> onnx.ModelProto:
    """The tiny CNN with its scores scaled: a classifier trained for inputs 1/logit_scale
    larger than the batch's gives near-chance scores on them (ReLU and pooling are linear in
    the scale)."""
    model = tiny_cnn(seed)
    for init in model.graph.initializer:
        if init.name in ("w2", "b2"):
            array = onnx.numpy_helper.to_array(init) * np.float32(logit_scale)
            init.CopyFrom(onnx.numpy_helper.from_array(array, init.name))
    return model


def _batch(tmp_path: Path, models: dict[str, onnx.ModelProto]):
    folder = tmp_path / "models"
    folder.mkdir()
    for name, model in models.items():
        onnx.save(model, folder / f"{name}.onnx")
    images = png_folder(tmp_path / "images")
    return run_cli(
        "quantize", folder, "-o", tmp_path / "out", "--calib", images, "--preprocess", SPEC,
        cwd=tmp_path,
    )  # fmt: skip


def _warnings(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "give each model its own" in line]


def test_a_classifier_whose_confidence_collapses_is_named(tmp_path):
    result = _batch(
        tmp_path, {"a": _classifier(0, 40.0), "b": _classifier(1, 0.05), "c": _classifier(2, 40.0)}
    )
    assert result.returncode == 0, result.stderr
    (warning,) = _warnings(result.stderr)
    assert warning.startswith("WARNING: quark_onnx.cli: b: the float model is out of distribution")


def test_classifiers_that_all_fit_are_not_named(tmp_path):
    result = _batch(tmp_path, {n: _classifier(i, 40.0) for i, n in enumerate("abc")})
    assert result.returncode == 0, result.stderr
    assert _warnings(result.stderr) == []


def test_a_model_declaring_another_pixel_range_is_named(tmp_path):
    models = {n: _classifier(i, 40.0) for i, n in enumerate("abc")}
    for name, value in (
        ("a", "Normalized_0_1"),
        ("b", "NominalRange_0_255"),
        ("c", "Normalized_0_1"),
    ):
        onnx.helper.set_model_props(models[name], {"Image.NominalPixelRange": value})
    result = _batch(tmp_path, models)
    assert result.returncode == 0, result.stderr
    (warning,) = _warnings(result.stderr)
    assert warning.startswith(
        "WARNING: quark_onnx.cli: b: its input declares Image.NominalPixelRange "
        "NominalRange_0_255 where the batch's other models declare Normalized_0_1"
    )
