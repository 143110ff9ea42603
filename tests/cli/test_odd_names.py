"""File names the file system holds as bytes that are not UTF-8 (``m\\xff.onnx``): quantized,
reported and exported like any other; the reports write the name as the console prints it."""

from __future__ import annotations

import json
import os

import onnx
import pytest
from cli_helpers import tiny_cnn

from quark_onnx.cli import main

ODD = os.fsdecode(b"\xff")  # the surrogate escape Python gives the byte


@pytest.fixture
def odd_folder(tmp_path):
    try:
        (tmp_path / f"probe{ODD}").touch()
    except (UnicodeEncodeError, OSError):
        pytest.skip("the file system takes UTF-8 names only")
    (tmp_path / f"probe{ODD}").unlink()
    return tmp_path


def test_a_non_utf8_model_and_output_name_is_quantized_and_reported(odd_folder, capfd):
    model = odd_folder / f"m{ODD}.onnx"
    onnx.save(tiny_cnn(0), model)
    before = model.read_bytes()
    out = odd_folder / f"out{ODD}"
    argv = ["quantize", str(model), "-o", str(out), "--random-calib", "2", "--report-html"]
    code = main([*argv, "--save-calibration"])
    err = capfd.readouterr().err
    assert code == 0, err
    assert "internal error" not in err
    name = f"m{ODD}"
    assert (out / f"{name}.onnx").is_file()
    text = (out / f"{name}.report.txt").read_bytes().decode("utf-8")  # valid UTF-8
    assert "m\\udcff.onnx" in text
    report = json.loads((out / f"{name}.report.json").read_text("utf-8"))
    assert report["model"] == str(model)  # the JSON escape reads back as the same name
    (out / f"{name}.report.html").read_bytes().decode("utf-8")
    recipe = odd_folder / f"rec{ODD}"
    code = main(
        ["export", str(out / f"{name}.onnx"), "-o", str(recipe), "--format", "recipe",
         "--float-model", str(model)]
    )  # fmt: skip
    assert code == 0, capfd.readouterr().err
    assert model.read_bytes() == before
