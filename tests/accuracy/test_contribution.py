"""The gated measurement of each activation's share of the output error
(quark_onnx.accuracy.contribution): exact with every gate closed, and the outlier tensor first."""

from __future__ import annotations

import numpy as np
from conftest import OUTLIER, outlier_channel_model, run_ort

from quark_onnx import ArrayDataReader, Config, ModelQuantizer, get_default_config
from quark_onnx.accuracy.contribution import activation_contributions, activation_pairs
from quark_onnx.model_files.load import to_ir


def test_gates_closed_are_the_quantized_model_and_the_outlier_ranks_first(tmp_path):
    model = outlier_channel_model()
    config = get_default_config("XINT8")
    config.include_cle = False
    rng = np.random.default_rng(1)
    data = rng.uniform(-1, 1, size=(64, 1, 8, 8)).astype(np.float32)
    quantized = ModelQuantizer(Config(global_quant_config=config)).quantize_model(
        model, None, ArrayDataReader([{"x": x[None]} for x in data])
    )
    samples = [{"x": x[None]} for x in rng.uniform(-1, 1, size=(6, 1, 8, 8)).astype(np.float32)]
    reference = [{"y": run_ort(model, s)[0]} for s in samples]
    error, shares = activation_contributions(to_ir(quantized), samples, reference)
    # oracle: the written model's own error, noise over signal
    q = np.concatenate([run_ort(quantized, s)[0] for s in samples]).astype(np.float64)
    f = np.concatenate([r["y"] for r in reference]).astype(np.float64)
    assert np.isclose(error, np.sum((q - f) ** 2) / np.sum(f**2), rtol=1e-4)
    assert set(shares) == set(activation_pairs(quantized))
    assert max(shares, key=shares.get) == OUTLIER and shares[OUTLIER] > 0.1
