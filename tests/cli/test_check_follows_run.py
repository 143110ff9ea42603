"""quark-onnx check on a model quantize wrote: what its run undid is not proposed again."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from cli_helpers import run_cli

DIGITS = Path(__file__).resolve().parents[2] / "examples" / "digits"
ADVICE = "ConvertSigmoidToHardSigmoid replaces it"


@pytest.mark.slow
def test_check_reads_the_run_beside_the_model(tmp_path):
    # the README's quick start: quantize the digits example, then check what it wrote
    out = tmp_path / "out"
    done = run_cli("quantize", DIGITS / "digits_cnn.onnx", "-o", out, "--calib",
                   DIGITS / "calib.npz", cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr
    checked = run_cli("check", out / "digits_cnn.onnx", cwd=tmp_path)
    assert checked.returncode == 0, checked.stdout
    assert ADVICE not in checked.stdout
    assert "ConvertSigmoidToHardSigmoid was measured on this model and undone" in checked.stdout
    # must not fire: the same model without its run's report is told what would move it
    shutil.copy(out / "digits_cnn.onnx", tmp_path / "alone.onnx")
    alone = run_cli("check", tmp_path / "alone.onnx", cwd=tmp_path)
    assert ADVICE in alone.stdout
