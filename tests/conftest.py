"""Shared fixtures: the ../shared folder, tiny-graph builders, an onnxruntime runner."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"


def shared_path(*parts: str) -> Path:
    """A path in ../shared; the test is skipped when that folder is not beside the repo."""
    path = SHARED.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"{path} not available")
    return path


@pytest.fixture
def shared() -> Path:
    if not SHARED.exists():
        pytest.skip("../shared not available")
    return SHARED


def make_model(nodes, inputs, outputs, initializers=(), opset: int = 17) -> onnx.ModelProto:
    """A checked ModelProto from onnx.helper pieces (initializers may be name -> ndarray)."""
    if isinstance(initializers, dict):
        initializers = [
            onnx.numpy_helper.from_array(np.asarray(v), k) for k, v in initializers.items()
        ]
    graph = onnx.helper.make_graph(
        list(nodes), "test", list(inputs), list(outputs), list(initializers)
    )
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", opset)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def run_ort(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """All outputs of ``model`` on ``feeds`` with graph optimizations off (exact reference)."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3
    session = ort.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    return session.run(None, feeds)
