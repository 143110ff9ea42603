"""Helpers shared by the command-line tests: run the console script, build the tiny CNN."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
from conftest import make_model
from onnx import TensorProto, helper


def run_cli(*args: object, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    """``python -m quark_onnx ARGS`` in ``cwd`` (a subprocess, as a user runs it)."""
    return subprocess.run(
        [sys.executable, "-m", "quark_onnx", *map(str, args)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def tiny_cnn(seed: int, *, relu2: bool = True) -> onnx.ModelProto:
    """x[1,3,8,8] -> Conv 3x3 -> Relu -> Conv 3x3 [-> Relu] -> GlobalAveragePool -> Flatten.

    The weights are drawn from ``numpy.random.default_rng(seed)``; ``relu2=False`` leaves out the
    second Relu. The output is ``y[1,6]``.
    """
    rng = np.random.default_rng(seed)
    inits = {
        "w1": rng.normal(0, 0.3, (4, 3, 3, 3)).astype(np.float32),
        "b1": rng.normal(0, 0.1, 4).astype(np.float32),
        "w2": rng.normal(0, 0.3, (6, 4, 3, 3)).astype(np.float32),
        "b2": rng.normal(0, 0.1, 6).astype(np.float32),
    }
    conv = {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1], "strides": [1, 1], "dilations": [1, 1]}
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", group=1, **conv),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], name="conv2", group=1, **conv),
    ]
    pooled = "c2"
    if relu2:
        nodes.append(helper.make_node("Relu", ["c2"], ["r2"], name="relu2"))
        pooled = "r2"
    nodes += [
        helper.make_node("GlobalAveragePool", [pooled], ["g"], name="gap"),
        helper.make_node("Flatten", ["g"], ["y"], name="flatten"),
    ]
    return make_model(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 6])],
        inits,
    )


def png_folder(folder: Path, count: int = 12) -> Path:
    """``count`` seeded random RGB PNGs of 10-21 x 12 pixels in a new ``folder``."""
    from quark_onnx.calibration.image_graph import _png_rgb

    folder.mkdir()
    for i in range(count):
        rgb = np.random.default_rng(i).integers(0, 256, (10 + i, 12, 3), dtype=np.uint8)
        (folder / f"img{i}.png").write_bytes(_png_rgb(rgb))
    return folder
