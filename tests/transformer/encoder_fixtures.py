"""Shared helpers of the transformer tests: a small BERT-like encoder and how to score it."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from bert_like import (
    EncoderShape,
    build_encoder,
    cosines,
    encoder_inputs,
    mean_pooled,
    with_outliers,
)

#: Small enough to quantize in about a second, still >= 4 layers and a >= 30k-row embedding.
SMALL = EncoderShape(layers=4, hidden=64, heads=2, ffn=128, vocab=30522, seq=32)


def session(model: onnx.ModelProto | str, optimize: bool = False) -> ort.InferenceSession:
    options = ort.SessionOptions()
    if not optimize:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3
    data = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    return ort.InferenceSession(data, options, providers=["CPUExecutionProvider"])


def hidden_states(model: onnx.ModelProto | str, feeds: dict[str, np.ndarray]) -> np.ndarray:
    """The last hidden state, one sample per run (XINT8 fixes the batch to 1)."""
    s = session(model)
    n = len(next(iter(feeds.values())))
    return np.concatenate(
        [s.run(None, {k: v[i : i + 1] for k, v in feeds.items()})[0] for i in range(n)]
    )


def embedding_cosines(
    reference: onnx.ModelProto | str, model: onnx.ModelProto | str, feeds: dict[str, np.ndarray]
) -> np.ndarray:
    """Per-sentence cosine of the mean-pooled embeddings of ``model`` against ``reference``."""
    mask = feeds["attention_mask"]
    ref = mean_pooled(hidden_states(reference, feeds), mask)
    return cosines(ref, mean_pooled(hidden_states(model, feeds), mask))


__all__ = [
    "SMALL",
    "build_encoder",
    "embedding_cosines",
    "encoder_inputs",
    "hidden_states",
    "session",
    "with_outliers",
]
