"""``-q``: errors only. Nothing on stdout (no results table), no status lines or warnings on
stderr; a failed model's error line stays."""

from __future__ import annotations

import onnx
from cli_helpers import tiny_cnn

from quark_onnx.cli import main


def _models(tmp_path):
    models = tmp_path / "models"
    models.mkdir()
    onnx.save(tiny_cnn(0), models / "good.onnx")
    (models / "broken.onnx").write_bytes(b"not a model")
    return models


def test_quiet_prints_only_the_failed_models_error(tmp_path, capfd):
    models = _models(tmp_path)
    args = ["quantize", str(models), "-o", str(tmp_path / "out"), "--random-calib", "2"]
    code = main([*args, "-q"])
    out, err = capfd.readouterr()
    assert code == 1
    assert (tmp_path / "out" / "good.onnx").is_file()
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "broken.onnx" in lines[0]


def test_without_quiet_the_table_and_status_lines_are_printed(tmp_path, capfd):
    models = _models(tmp_path)
    code = main(["quantize", str(models), "-o", str(tmp_path / "out"), "--random-calib", "2"])
    out, err = capfd.readouterr()
    assert code == 1
    assert "good" in out and "1 of 2 models quantized" in out
    assert "good: done in" in err and "error: " in err
