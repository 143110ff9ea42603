"""The cost of positions the NPU rules force, against a numpy model of power-of-two int8."""

from __future__ import annotations

import logging

import numpy as np
import onnx
import onnxruntime as ort
from conftest import box_and_score_model

from quark_onnx import ArrayDataReader, Config, ModelQuantizer, get_default_config
from quark_onnx.npu.costs import forced_position_costs
from quark_onnx.params.solver import Adjustment


def _fake_quant(x: np.ndarray, p: int) -> np.ndarray:
    s = 2.0**-p
    return np.clip(np.rint(x / s), -128, 127) * s


def _sqnr(x: np.ndarray, p: int) -> float:
    x = x.astype(np.float64)
    return float(10 * np.log10(np.mean(x * x) / np.mean((x - _fake_quant(x, p)) ** 2)))


def test_cost_is_the_own_sqnr_difference_of_the_two_positions():
    rng = np.random.default_rng(0)
    values = {"small": rng.random(4000) * 0.9, "big": rng.normal(0, 2.0, 4000)}
    errors = {
        k: (lambda p, v=v: float(np.mean((v - _fake_quant(v, p)) ** 2))) for k, v in values.items()
    }
    squares = {k: float(np.mean(v * v)) for k, v in values.items()}
    adjustments = [Adjustment("small", 7, 5, "shared_scale", "group")]
    entries = forced_position_costs(
        {"small": 7, "big": 5}, {"small": 5, "big": 5}, errors, squares, adjustments
    )
    assert [e["tensor"] for e in entries] == ["small"]  # "big" kept its position: no entry
    (e,) = entries
    assert e["rules"] == ["shared_scale"]
    assert (e["chosen_position"], e["solved_position"]) == (7, 5)
    assert e["sqnr_chosen_db"] == round(_sqnr(values["small"], 7), 2)
    assert e["sqnr_solved_db"] == round(_sqnr(values["small"], 5), 2)
    assert e["cost_db"] == round(_sqnr(values["small"], 7) - _sqnr(values["small"], 5), 2)
    # about 6.02 dB per bit for a uniform, unclipped tensor
    assert 11.0 < e["cost_db"] < 13.0


def _quantize(model: onnx.ModelProto, x: np.ndarray) -> ModelQuantizer:
    config = get_default_config("XINT8")
    config.extra_options["ConvertSigmoidToHardSigmoid"] = False
    # calibration reads every sample (the oracle's), and the shared position is what is measured
    config.extra_options.update(FidelityHoldout=0, SplitHeterogeneousJoins=False)
    quantizer = ModelQuantizer(Config(global_quant_config=config))
    quantizer.quantize_model(model, None, ArrayDataReader([{"x": s} for s in x]))
    return quantizer


def test_concat_of_differently_ranged_tensors_names_the_small_one_and_its_cost(caplog):
    model = box_and_score_model("Sigmoid")
    x = np.random.default_rng(4).normal(0, 1.0, (16, 1, 4, 4, 4)).astype(np.float32)
    with caplog.at_level(logging.WARNING, logger="quark_onnx.pipeline.quantizer"):
        quantizer = _quantize(model, x)
    warned = [r.getMessage() for r in caplog.records if "NPU rules cost" in r.getMessage()]
    assert len(warned) == 1 and "worst: tensor 'prob'" in warned[0]
    report = quantizer.report
    costs = {e["tensor"]: e for e in report.position_costs}
    assert "prob" in costs and "box" not in costs
    e = costs["prob"]
    assert e["solved_position"] == report.positions["y"] == report.positions["box"]
    assert e["chosen_position"] > e["solved_position"]
    # oracle: the float model's Sigmoid values on the calibration samples
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    probe.graph.output.append(onnx.helper.make_tensor_value_info("prob", 1, None))
    sess = ort.InferenceSession(probe.SerializeToString(), providers=["CPUExecutionProvider"])
    prob = np.concatenate([sess.run(["prob"], {"x": s})[0].ravel() for s in x])
    assert abs(e["sqnr_chosen_db"] - _sqnr(prob, e["chosen_position"])) < 0.01
    assert abs(e["sqnr_solved_db"] - _sqnr(prob, e["solved_position"])) < 0.01
    assert e["cost_db"] > 6.0
    assert "rule cost: tensor 'prob'" in report.summary()
    assert report.to_dict()["position_costs"][0]["tensor"] == "prob"


def test_no_cost_where_the_rules_move_nothing(caplog):
    """Both Concat inputs Sigmoid scores: one calibrated position fits both, nothing is moved."""
    model = box_and_score_model("Sigmoid")
    model.graph.node.insert(1, onnx.helper.make_node("Sigmoid", ["box"], ["box_p"], name="s0"))
    model.graph.node[-1].input[0] = "box_p"
    x = np.random.default_rng(4).normal(0, 1.0, (16, 1, 4, 4, 4)).astype(np.float32)
    with caplog.at_level(logging.WARNING, logger="quark_onnx.pipeline.quantizer"):
        report = _quantize(model, x).report
    assert not [r for r in caplog.records if "NPU rules cost" in r.getMessage()]
    assert report.positions["box_p"] == report.positions["prob"]
    assert [e for e in report.position_costs if e["tensor"] in ("box_p", "prob", "y")] == []
    assert "rule cost" not in report.summary()
