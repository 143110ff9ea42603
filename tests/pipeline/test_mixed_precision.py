"""Mixed precision to a fidelity target (quark_onnx.pipeline.mixed_precision): the search
promotes the tensor whose quantization ruins the output, and only when the target is missed;
the manual list; the record the readiness checker reads; the rebuild from the list."""

from __future__ import annotations

import json
import math

import numpy as np
import onnx
import pytest
from conftest import OUTLIER, outlier_channel_model, run_ort
from onnx import TensorProto as T

from quark_onnx import ArrayDataReader, Config, ModelQuantizer, get_default_config
from quark_onnx.errors import ConfigError
from quark_onnx.npu.placement import PROMOTIONS_KEY
from quark_onnx.npu.readiness import check


def _samples(n: int = 64, seed: int = 1) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [{"x": rng.uniform(-1, 1, size=(1, 1, 8, 8)).astype(np.float32)} for _ in range(n)]


def _quantizer(preset: str = "XINT8", **extra) -> ModelQuantizer:
    config = get_default_config(preset)
    config.include_cle = False  # CLE would move the outlier channel's scale into the weights
    config.extra_options.update(extra)
    return ModelQuantizer(Config(global_quant_config=config))


def _sqnr(model: onnx.ModelProto, quantized, samples) -> float:
    f = np.concatenate([run_ort(model, s)[0] for s in samples]).astype(np.float64)
    q = np.concatenate([run_ort(quantized, s)[0] for s in samples]).astype(np.float64)
    return 10 * math.log10(np.sum(f**2) / np.sum((f - q) ** 2))


def test_a_missed_target_promotes_the_tensor_that_costs_it(tmp_path):
    model, test = outlier_channel_model(), _samples(32, seed=9)
    plain = _quantizer(FidelityRepair=False)
    base = plain.quantize_model(model, tmp_path / "plain.onnx", ArrayDataReader(_samples()))
    searched = _quantizer(FidelityRepair=False, FidelityTarget="sqnr=25", MixedPrecisionBudget=0.5)
    mixed = searched.quantize_model(model, tmp_path / "mixed.onnx", ArrayDataReader(_samples()))
    record = searched.report.mixed_precision
    assert record["met"] is True and searched.report.faithful is True
    assert [p["tensor"] for p in record["promoted"]] == [OUTLIER]
    # relu2 is fused into conv2: it moves with it
    island = ["conv1", "conv2", "relu2"]
    assert record["promoted"][0]["nodes"] == island
    assert record["islands"] == 1 and record["transitions"] == 2  # r0 in, r2 out
    # measured on inputs neither run saw
    assert _sqnr(model, base, test) < 20.0 < 25.0 < _sqnr(model, mixed, test)
    # the written model: conv1/conv2 float, the record, and ready for its target
    dequantized = {o for n in mixed.graph.node if n.op_type == "DequantizeLinear" for o in n.output}
    float_convs = {
        n.name for n in mixed.graph.node if n.op_type == "Conv" and n.input[1] not in dequantized
    }
    assert float_convs == {"conv1", "conv2"}
    meta = {p.key: p.value for p in mixed.metadata_props}
    assert json.loads(meta[PROMOTIONS_KEY])["tensors"] == {OUTLIER: island}
    result = check(mixed)
    assert result.ready and {f.node for f in result.expected} <= set(island)
    # without the record the checker reports the float nodes again
    del mixed.metadata_props[:]
    assert {f.node for f in check(mixed).errors} == {f.node for f in result.expected}
    assert {"conv1", "conv2"} <= {f.node for f in result.expected}
    # the recipe's settings rebuild it without searching, byte for byte
    again = ModelQuantizer(Config(global_quant_config=searched.config_in_force))
    again.quantize_model(model, tmp_path / "rebuilt.onnx", ArrayDataReader(_samples()))
    assert not again.report.mixed_precision
    assert (tmp_path / "rebuilt.onnx").read_bytes() == (tmp_path / "mixed.onnx").read_bytes()


def test_a_target_already_met_changes_nothing(tmp_path):
    """Without the outlier channel the model meets a 20 dB target: no search, the same bytes."""
    model = outlier_channel_model(outlier=1.0)
    plain = _quantizer()
    plain.quantize_model(model, tmp_path / "plain.onnx", ArrayDataReader(_samples()))
    target = _quantizer(FidelityTarget="sqnr=20")
    target.quantize_model(model, tmp_path / "target.onnx", ArrayDataReader(_samples()))
    assert target.report.faithful and not target.report.mixed_precision
    assert not target.report.repairs and not plain.report.repairs
    assert (tmp_path / "target.onnx").read_bytes() == (tmp_path / "plain.onnx").read_bytes()


def test_manual_list_int16_in_a8w8_and_unknown_names(tmp_path):
    model = outlier_channel_model()
    quantizer = _quantizer("A8W8", MixedPrecisionTensors=[OUTLIER])
    out = quantizer.quantize_model(model, tmp_path / "q.onnx", ArrayDataReader(_samples()))
    inits = {i.name: i for i in out.graph.initializer}
    types = {
        n.input[0]: inits[n.input[2]].data_type
        for n in out.graph.node
        if n.op_type == "QuantizeLinear" and len(n.input) > 2 and n.input[2] in inits
    }
    assert types[OUTLIER] == T.INT16 and types["r0"] == T.INT8
    meta = {p.key: p.value for p in out.metadata_props}
    assert json.loads(meta[PROMOTIONS_KEY]) == {"precision": "int16", "tensors": {OUTLIER: []}}
    with pytest.raises(
        ConfigError, match=r"MixedPrecisionTensors: tensor 't1x' is not in the graph.*closest: 't1'"
    ):
        _quantizer(MixedPrecisionTensors=["t1x"]).quantize_model(
            model, None, ArrayDataReader(_samples())
        )
