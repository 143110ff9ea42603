"""quark-onnx quantize and the fidelity guard: a warning by default, a failure with the flag."""

from __future__ import annotations

import json

import numpy as np
import onnx
from cli_helpers import run_cli
from conftest import make_model
from onnx import TensorProto, helper


def _unfaithful_model() -> onnx.ModelProto:
    """x -> Conv(2 channels, weights 1000 and 0.01) -> Clip(0, 6) -> Conv 1x1 -> y ~ x.

    The ReLU6 output's channels are 600 apart: one power-of-two int8 scale rounds the channel
    that carries the output to zero (output SQNR about 0 dB). Through a Relu, cross-layer
    equalization would repair it; ReLU6 is not positively homogeneous, so nothing can."""
    w1 = np.array([1000.0, 0.01], dtype=np.float32).reshape(2, 1, 1, 1)
    w2 = np.array([1e-5, 100.0], dtype=np.float32).reshape(1, 2, 1, 1)
    conv = {"kernel_shape": [1, 1], "pads": [0, 0, 0, 0], "strides": [1, 1], "dilations": [1, 1]}
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["c1"], name="conv1", group=1, **conv),
        helper.make_node("Clip", ["c1", "lo", "hi"], ["r1"], name="relu6"),
        helper.make_node("Conv", ["r1", "w2"], ["y"], name="conv2", group=1, **conv),
    ]
    return make_model(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1, 8, 8])],
        {"w1": w1, "w2": w2, "lo": np.float32(0.0), "hi": np.float32(6.0)},
    )


def test_unfaithful_model_warns_and_fails_with_require_fidelity(tmp_path):
    model = tmp_path / "spread.onnx"
    onnx.save(_unfaithful_model(), model)
    calib = tmp_path / "calib.npz"
    rng = np.random.default_rng(0)
    np.savez(calib, x=rng.uniform(0, 1, (16, 1, 8, 8)).astype(np.float32))

    out = tmp_path / "out"
    plain = run_cli("quantize", model, "-o", out, "--calib", calib, cwd=tmp_path)
    assert plain.returncode == 0, plain.stderr
    assert "does not follow the float model" in plain.stderr and "output 'y'" in plain.stderr
    report = json.loads((out / "spread.report.json").read_text())
    assert report["fidelity"]["faithful"] is False
    assert report["fidelity"]["worst_layers"]
    assert "faithful to the float model: NO" in (out / "spread.report.txt").read_text()

    strict = tmp_path / "strict"
    failed = run_cli(
        "quantize", model, "-o", strict, "--calib", calib, "--require-fidelity", cwd=tmp_path
    )
    assert failed.returncode == 1
    errors = [line for line in failed.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "does not follow the float model" in errors[0]
    assert "Traceback" not in failed.stderr
    assert not (strict / "spread.onnx").exists()
