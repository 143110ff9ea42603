"""What a user notices: counts in the right number, no colour codes from Ray in a log file, a Ray
worker's failure that says why, and a YOLOv8-style export with int64 shape arithmetic."""

from __future__ import annotations

import io
import json
import sys

import numpy as np
import onnx
import pytest
from cli_helpers import run_cli
from detectors.yolov8_like import build_yolov8_like, synthetic_images

from quark_onnx.cli import ray_runner
from quark_onnx.cli.batch import count
from quark_onnx.cli.jobs import Job, failed_outcome
from quark_onnx.cli.settings import QuantizeSettings


def test_counts_in_the_right_number():
    assert [count(1, "model"), count(2, "model"), count(0, "model")] == [
        "1 model",
        "2 models",
        "0 models",
    ]
    assert [count(1, "process"), count(2, "process")] == ["1 process", "2 processes"]


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_ray_colour_codes_are_dropped_where_the_stream_is_not_a_terminal(monkeypatch):
    log, terminal = io.StringIO(), _Terminal()
    monkeypatch.setattr(sys, "stdout", log)
    monkeypatch.setattr(sys, "stderr", terminal)
    line = "\x1b[36m(_quantize_task pid=1)\x1b[0m WARNING: a: \x1b[32m[repeated 2x]\x1b[0m\n"
    with ray_runner._plain_streams():
        print(line, end="")
        print(line, end="", file=sys.stderr)
    assert (sys.stdout, sys.stderr) == (log, terminal)  # restored
    assert log.getvalue() == "(_quantize_task pid=1) WARNING: a: [repeated 2x]\n"
    assert terminal.getvalue() == line  # a terminal shows the colours


def _job(tmp_path) -> Job:
    return Job(0, str(tmp_path / "m.onnx"), "m", str(tmp_path), QuantizeSettings())


def test_a_worker_on_another_quark_onnx_says_so(tmp_path, monkeypatch):
    failure = "KeyError: 'XINT8' (internal error; rerun with --debug for the traceback)"
    monkeypatch.setattr(ray_runner, "_run_task", lambda job, cwd: failed_outcome(job, failure))
    ours = ray_runner._package_folder()
    outcome = ray_runner._quantize_task(_job(tmp_path), str(tmp_path), "/elsewhere/quark_onnx")
    assert outcome.message == (
        f"the Ray worker imported quark_onnx from {ours}, not the driver's "
        f"/elsewhere/quark_onnx (a quark_onnx folder in the working folder {tmp_path} comes "
        "first on the worker's path): run from another folder, or install this checkout with "
        f"pip install -e; the worker's error: {failure}"
    )
    # must not fire: the same package, the worker's own message
    same = ray_runner._quantize_task(_job(tmp_path), str(tmp_path), ours)
    assert same.message == failure


@pytest.mark.slow
def test_an_unsimplified_yolov8_export_with_int64_shape_arithmetic_quantizes(tmp_path):
    model = build_yolov8_like(size=64, num_classes=4, width=4, unsimplified=True)
    shapes = [n for n in model.graph.node if n.op_type == "Shape"]
    assert shapes  # the int64 shape tensors of an export without onnxsim
    onnx.save(model, tmp_path / "y8.onnx")
    np.savez(tmp_path / "calib.npz", images=synthetic_images(24, 64, 1))
    result = run_cli("quantize", "y8.onnx", "-o", "out", "--calib", "calib.npz", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp_path / "out" / "y8.report.json").read_text())
    assert report["check"]["ready"] is True
    assert "1 of 1 model quantized" in result.stdout
