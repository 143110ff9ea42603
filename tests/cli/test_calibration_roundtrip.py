"""``--save-calibration`` then ``--load-calibration`` without data works for every preset.

Several preparation passes decide on the first calibration samples (cross-layer equalization's
gate, FoldConstantChannels, the activation equalizations), and a saved result is for the
prepared model; the samples they measured are saved beside the result
(``NAME.calibration.npz``) so that a run without data prepares the same model.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from cli_helpers import tiny_cnn

from quark_onnx.cli import main
from quark_onnx.config.presets import preset_names
from quark_onnx.config.quantization import get_default_config


def _save_then_load(tmp_path: Path, preset: str) -> int:
    src = tmp_path / "m.onnx"
    onnx.save(tiny_cnn(0), src)
    data = tmp_path / "c.npz"
    np.savez(data, x=np.random.default_rng(0).normal(size=(4, 3, 8, 8)).astype(np.float32))
    first = ["quantize", str(src), "-o", str(tmp_path / "a"), "--preset", preset, "-q"]
    code = main([*first, "--calib", str(data), "--save-calibration", "--compare-samples", "0"])
    assert code == 0
    saved = tmp_path / "a" / "m.calibration.json"
    second = ["quantize", str(src), "-o", str(tmp_path / "b"), "--preset", preset, "-q"]
    return main([*second, "--load-calibration", str(saved), "--compare-samples", "0"])


@pytest.mark.parametrize(
    "preset", [p for p in preset_names() if get_default_config(p).needs_calibration_data()]
)
def test_round_trip_without_data(tmp_path, capsys, preset):
    assert _save_then_load(tmp_path, preset) == 0, capsys.readouterr().err
    assert (tmp_path / "a" / "m.calibration.npz").is_file()
    assert (tmp_path / "b" / "m.onnx").is_file()
    assert not list(tmp_path.rglob("*.partial"))


def test_without_the_saved_samples_the_mismatch_is_reported(tmp_path, capsys, monkeypatch):
    """Must not fire the other way: the same tiny CNN, the samples file removed, prepares
    another model (its CLE decides without data) and the load is refused with the reason."""
    from quark_onnx.cli import jobs

    real = jobs.save_preparation_samples
    monkeypatch.setattr(jobs, "save_preparation_samples", lambda *a, **k: False)
    code = _save_then_load(tmp_path, "XINT8")
    monkeypatch.setattr(jobs, "save_preparation_samples", real)
    assert code == 1
    err = capsys.readouterr().err
    assert "made for another model" in err and "Traceback" not in err
    assert not (tmp_path / "b" / "m.onnx").exists()
