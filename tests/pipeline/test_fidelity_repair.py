"""The fidelity repair: an unfaithful XINT8 output is quantized again with the conservative
choices, and the best-measuring attempt is written; a faithful one is offered the refinement,
kept only where it measures better on every measure; WeightPositionMethod."""

from __future__ import annotations

import logging
import math

import numpy as np
import onnx
import pytest
from conftest import make_model, run_ort
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper

from quark_onnx import ArrayDataReader, Config, ModelQuantizer, get_default_config
from quark_onnx.config.enums import PowerOfTwoMethod
from quark_onnx.errors import ConfigError
from quark_onnx.fidelity.verdict import FidelityResult, OutputFidelity
from quark_onnx.params import pof2
from quark_onnx.pipeline.repair import candidates, dominates, score


def _model() -> onnx.ModelProto:
    """x -> Conv 3x3 (4 channels) -> Relu -> Conv 1x1 (2 channels) -> y, random weights."""
    rng = np.random.default_rng(3)
    nodes = [
        h.make_node("Conv", ["x", "w1", "b1"], ["c1"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
        h.make_node("Relu", ["c1"], ["r1"]),
        h.make_node("Conv", ["r1", "w2"], ["y"], kernel_shape=[1, 1]),
    ]
    return make_model(
        nodes,
        [h.make_tensor_value_info("x", T.FLOAT, [1, 1, 8, 8])],
        [h.make_tensor_value_info("y", T.FLOAT, [1, 2, 8, 8])],
        {
            "w1": rng.normal(0, 0.5, (4, 1, 3, 3)).astype(np.float32),
            "b1": rng.normal(0, 0.1, 4).astype(np.float32),
            "w2": rng.normal(0, 0.5, (2, 4, 1, 1)).astype(np.float32),
        },
    )


def _samples(n: int = 64) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(1)
    return [{"x": rng.uniform(-1, 1, size=(1, 1, 8, 8)).astype(np.float32)} for _ in range(n)]


def _held_out() -> list[dict[str, np.ndarray]]:
    """The verdict's samples of :func:`_samples`: every second one of the first 32."""
    return _samples()[1:32:2]


def _quantizer(**extra) -> ModelQuantizer:
    """XINT8 without CLE, so that the written weights are the model's own (the oracle's input)."""
    config = get_default_config("XINT8")
    config.include_cle = False
    config.extra_options.update(extra)
    return ModelQuantizer(Config(global_quant_config=config))


def _weight_positions(model: onnx.ModelProto) -> dict[str, int]:
    """Consumer weight input -> position, read from the written DequantizeLinear scales."""
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    out = {}
    for node in model.graph.node:
        if node.op_type == "DequantizeLinear" and node.input[0] in ("w1_quantized", "w2_quantized"):
            out[node.input[0]] = -int(math.log2(float(inits[node.input[1]])))
    return out


@pytest.fixture
def clipping_minmse(monkeypatch):
    """MinMSE weight positions made to clip: three positions above NonOverflow (each weight's
    range / 8), which breaks the output the way a clipped classifier head does."""

    def clipping(x, qtype=None):
        w = np.asarray(x, dtype=np.float64)
        return pof2.nonoverflow_position(float(w.min()), float(w.max())) + 3

    monkeypatch.setattr(pof2, "minmse_position", clipping)


def _sqnr(model: onnx.ModelProto, quantized: onnx.ModelProto, samples) -> float:
    f = np.concatenate([run_ort(model, s)[0] for s in samples]).astype(np.float64)
    q = np.concatenate([run_ort(quantized, s)[0] for s in samples]).astype(np.float64)
    return 10 * math.log10(np.sum(f**2) / np.sum((f - q) ** 2))


def test_clipped_weights_are_repaired_and_the_repair_is_written(tmp_path, clipping_minmse, caplog):
    model, out = _model(), tmp_path / "q.onnx"
    quantizer = _quantizer()
    with caplog.at_level(logging.WARNING):
        quantizer.quantize_model(model, out, ArrayDataReader(_samples()))
    report = quantizer.report
    assert report.fidelity["faithful"] is True
    first, rounded = report.repairs
    assert first["repair"] == "weights never clipped" and first["faithful"]
    assert first["settings"] == {"WeightPositionMethod": "NonOverflow"}
    # the first faithful attempt ends the conservative search; rounding is tried on top of it
    assert rounded["repair"] == "weights never clipped, second-order rounding"
    assert rounded["settings"]["WeightPositionMethod"] == "NonOverflow"
    # the better-measuring of the two is kept (both faithful, no score vector: cosine, SQNR)
    measure = [(r["outputs"][0]["cosine"], r["outputs"][0]["sqnr_db"]) for r in (first, rounded)]
    assert [r["kept"] for r in (first, rounded)] == [
        measure[0] >= measure[1],
        measure[1] > measure[0],
    ]
    assert report.fidelity["selection"]["outputs"][0]["sqnr_db"] == max(measure)[1]
    assert "fidelity repair: with weights never clipped" in caplog.text
    assert "does not follow the float model" not in caplog.text
    # the written model holds NonOverflow weight positions (the pof2 oracle) ...
    written = onnx.load(out)
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    expected = {
        f"{name}_quantized": pof2.weight_position(inits[name], PowerOfTwoMethod.NonOverflow)
        for name in ("w1", "w2")
    }
    assert _weight_positions(written) == expected
    # ... and is the model the verdict measured (same SQNR on the 16 held-out samples)
    assert report.fidelity["outputs"][0]["sqnr_db"] == pytest.approx(
        _sqnr(model, written, _held_out()), abs=1e-6
    )
    assert report.settings["extra_options"]["WeightPositionMethod"] == "NonOverflow"
    assert quantizer.config_in_force.extra_options["WeightPositionMethod"] == "NonOverflow"
    # the parameters the quantizer hands on (a recipe) are the written model's
    assert float(quantizer.params["w1"].scale) == 2.0 ** -expected["w1_quantized"]
    assert "repair tried: weights never clipped" in report.summary()


def test_without_repair_the_clipped_weights_stay_and_the_guard_warns(
    tmp_path, clipping_minmse, caplog
):
    model, out = _model(), tmp_path / "q.onnx"
    quantizer = _quantizer(FidelityRepair=False)
    with caplog.at_level(logging.WARNING):
        quantizer.quantize_model(model, out, ArrayDataReader(_samples()))
    assert quantizer.report.fidelity["faithful"] is False and quantizer.report.repairs == []
    assert "does not follow the float model" in caplog.text
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    clipped = pof2.weight_position(inits["w2"], PowerOfTwoMethod.NonOverflow) + 3
    assert _weight_positions(onnx.load(out))["w2_quantized"] == clipped


def test_require_fidelity_is_met_by_a_repaired_model(tmp_path, clipping_minmse):
    out = tmp_path / "q.onnx"
    _quantizer(RequireFidelity=True).quantize_model(_model(), out, ArrayDataReader(_samples()))
    assert out.exists()


def test_a_faithful_model_is_not_repaired(tmp_path):
    quantizer = _quantizer()  # the refinement is off by default
    quantizer.quantize_model(_model(), tmp_path / "q.onnx", ArrayDataReader(_samples()))
    assert quantizer.report.fidelity["faithful"] is True and quantizer.report.repairs == []


def test_a_faithful_model_is_offered_only_the_refinement(tmp_path):
    model, out = _model(), tmp_path / "q.onnx"
    quantizer = _quantizer(FidelityRefine=True)
    quantizer.quantize_model(model, out, ArrayDataReader(_samples()))
    report = quantizer.report
    assert report.fidelity["faithful"] is True
    (refined,) = report.repairs  # no conservative repair: only the refinement
    assert refined["repair"] == "debiased second-order rounding" and refined["refinement"]
    assert refined["settings"] == {
        "include_fast_ft": True,
        "FastFinetune": {"OptimAlgorithm": "gptq", "Target": "debiased"},
        # fitted after the guard's 16 samples, and recorded so that a recipe fits there too
        "AccuracySamplesSkip": 16,
    }
    # kept exactly when it measures at least as well on every measure and better on one
    new, first = refined["outputs"][0], _first_attempt(tmp_path)
    # every measure: SQNR, cosine and the dense output's argmax agreement (its part)
    keys = [("sqnr_db",), ("cosine",), ("parts", 0, "agreement")]
    pairs = [(_get(new, k), _get(first, k)) for k in keys]
    dominating = all(n >= f for n, f in pairs) and any(n > f for n, f in pairs)
    assert refined["kept"] is dominating
    chosen = report.fidelity["selection"]["outputs"][0]
    assert chosen["sqnr_db"] == (new if dominating else first)["sqnr_db"]
    # the written model is the one the verdict measured, on the held-out samples
    written = report.fidelity["outputs"][0]
    assert written["sqnr_db"] == pytest.approx(_sqnr(model, onnx.load(out), _held_out()))
    assert "refinement tried: debiased second-order rounding" in report.summary()


def _get(row: dict, keys: tuple) -> float:
    for key in keys:
        row = row[key]
    return row


def _first_attempt(tmp_path) -> dict:
    """The guard's measurement of the first attempt (the refinement off)."""
    quantizer = _quantizer(FidelityRefine=False)
    quantizer.quantize_model(_model(), tmp_path / "first.onnx", ArrayDataReader(_samples()))
    assert quantizer.report.repairs == []
    return quantizer.report.fidelity["selection"]["outputs"][0]


def test_a_refinement_that_measures_better_is_kept_and_written(tmp_path, monkeypatch):
    """Whatever the rounding does on this tiny model, a result that dominates is kept: the
    written model, the report's settings and the configuration in force are the refinement's."""
    import quark_onnx.pipeline.repair as fr

    monkeypatch.setattr(fr, "dominates", lambda result, first: True)
    quantizer = _quantizer(FidelityRefine=True)
    out = tmp_path / "q.onnx"
    quantizer.quantize_model(_model(), out, ArrayDataReader(_samples()))
    (refined,) = quantizer.report.repairs
    assert refined["kept"]
    assert quantizer.report.settings["include_fast_ft"] is True
    assert quantizer.config_in_force.include_fast_ft is True
    assert quantizer.config_in_force.extra_options["FastFinetune"]["Target"] == "debiased"
    chosen = quantizer.report.fidelity["selection"]["outputs"][0]["sqnr_db"]
    assert chosen == refined["outputs"][0]["sqnr_db"]
    written = quantizer.report.fidelity["outputs"][0]["sqnr_db"]
    assert written == pytest.approx(_sqnr(_model(), onnx.load(out), _held_out()))


def test_no_refinement_when_off_or_when_the_settings_already_round(tmp_path):
    quantizer = _quantizer(FidelityRefine=False)
    quantizer.quantize_model(_model(), tmp_path / "a.onnx", ArrayDataReader(_samples()))
    assert quantizer.report.repairs == []
    config = get_default_config("XINT8")
    config.include_cle = False
    config.include_fast_ft = True
    config.extra_options.update(FidelityRefine=True, FastFinetune={"OptimAlgorithm": "gptq"})
    quantizer = ModelQuantizer(Config(global_quant_config=config))
    quantizer.quantize_model(_model(), tmp_path / "b.onnx", ArrayDataReader(_samples()))
    assert quantizer.report.fidelity["faithful"] and quantizer.report.repairs == []


def test_weight_position_method_nonoverflow_never_clips(tmp_path):
    model = _model()
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    out = tmp_path / "q.onnx"
    _quantizer(WeightPositionMethod="NonOverflow").quantize_model(
        model, out, ArrayDataReader(_samples())
    )
    expected = {
        f"{n}_quantized": pof2.weight_position(inits[n], PowerOfTwoMethod.NonOverflow)
        for n in ("w1", "w2")
    }
    assert _weight_positions(onnx.load(out)) == expected


def test_weight_position_method_rejects_other_values():
    with pytest.raises(ConfigError, match="WeightPositionMethod='minmse2'.*did you mean 'MinMSE'"):
        _quantizer(WeightPositionMethod="minmse2")


def test_candidates_are_the_ones_that_change_something():
    def labels(**changes):
        config = get_default_config("XINT8")
        extra = {k: v for k, v in changes.items() if k[0].isupper()}
        for key, value in changes.items():
            if not key[0].isupper():
                setattr(config, key, value)
        config.extra_options.update(extra)
        return [c.label for c in candidates(config, config.validate())]

    assert labels() == [
        "weights never clipped",
        "no bias correction",
        "weights never clipped, no bias correction",
    ]
    assert labels(WeightPositionMethod="NonOverflow") == ["no bias correction"]
    assert labels(calibrate_method=PowerOfTwoMethod.NonOverflow) == ["no bias correction"]
    assert labels(include_bias_correction=False) == ["weights never clipped"]


def test_second_order_rounding_is_tried_last_on_the_best_settings(tmp_path):
    """No conservative repair reaches the (unreachable) threshold: one more attempt adds
    second-order rounding to the best of them; the best-measuring attempt is written."""
    model, out = _model(), tmp_path / "q.onnx"
    quantizer = _quantizer(FidelityMinSQNR=90.0)
    quantizer.quantize_model(model, out, ArrayDataReader(_samples()))
    repairs = quantizer.report.repairs
    conservative = [
        "weights never clipped",
        "no bias correction",
        "weights never clipped, no bias correction",
    ]
    assert [r["repair"] for r in repairs[:3]] == conservative and len(repairs) == 4
    # on top of the best-measuring conservative attempt (cosine, then SQNR: none is faithful
    # and the output is not a score vector), unless the first attempt measured better still
    measure = [(r["outputs"][0]["cosine"], r["outputs"][0]["sqnr_db"]) for r in repairs]
    best = conservative[max(range(3), key=lambda i: measure[i])]
    assert repairs[3]["repair"] in (f"{best}, second-order rounding", "second-order rounding")
    settings = repairs[3]["settings"]
    assert settings["include_fast_ft"] is True
    assert settings["FastFinetune"]["OptimAlgorithm"] == "gptq"
    # what is written measures at least as well as every attempt (the first one included when
    # no repair is kept), and it is the model the guard measured
    chosen = quantizer.report.fidelity["selection"]["outputs"][0]
    assert (chosen["cosine"], chosen["sqnr_db"]) >= max(measure)
    kept = [i for i, r in enumerate(repairs) if r["kept"]]
    assert len(kept) <= 1 and all(measure[i] == max(measure) for i in kept)
    written_sqnr = _sqnr(model, onnx.load(out), _held_out())
    written = quantizer.report.fidelity["outputs"][0]
    assert written["sqnr_db"] == pytest.approx(written_sqnr, abs=1e-6)


def test_no_rounding_attempt_when_the_settings_already_round(tmp_path):
    config = get_default_config("XINT8")
    config.include_cle = False
    config.include_fast_ft = True
    config.extra_options.update(FidelityMinSQNR=90.0, FastFinetune={"OptimAlgorithm": "gptq"})
    quantizer = ModelQuantizer(Config(global_quant_config=config))
    quantizer.quantize_model(_model(), tmp_path / "q.onnx", ArrayDataReader(_samples()))
    labels = [r["repair"] for r in quantizer.report.repairs]
    assert labels and not any("second-order" in label for label in labels)


def _result(*outputs: tuple[float, float, float | None, bool]) -> FidelityResult:
    """Outputs as (SQNR, cosine, top-1 agreement, faithful)."""
    return FidelityResult(
        samples=4,
        outputs=[
            OutputFidelity(f"o{i}", s, c, 0.0, a, 4 if a is not None else 0, ok)
            for i, (s, c, a, ok) in enumerate(outputs)
        ],
        min_sqnr_db=10.0,
        min_agreement=0.75,
    )


def test_score_orders_faithful_outputs_then_agreement_then_cosine_then_sqnr():
    assert score(_result((11.0, 0.9, None, True), (5.0, 0.8, None, False))) > score(
        _result((9.0, 0.9, None, False), (40.0, 1.0, None, False))
    )
    assert score(_result((9.0, 0.5, 0.7, False))) > score(_result((12.0, 0.9, 0.6, False)))
    # an output collapsed to zeros (0 dB, cosine 0) loses to a noisy one that keeps the pattern
    assert score(_result((-2.0, 0.5, None, False))) > score(_result((0.0, 0.0, None, False)))
    assert score(_result((9.0, 0.9, None, False))) > score(_result((8.0, 0.9, None, False)))
    assert score(_result((float("nan"), float("nan"), None, False))) == score(
        _result((-1e9, -1.0, None, False))
    )


def test_dominates_needs_every_measure_at_least_as_good_and_one_better():
    first = _result((12.0, 0.95, 0.9, True), (20.0, 0.99, None, True))
    assert dominates(_result((12.5, 0.95, 0.9, True), (20.0, 0.99, None, True)), first)
    assert not dominates(first, first)  # nothing better
    # better SQNR and cosine on one output, one image of agreement lost: not kept
    assert not dominates(_result((15.0, 0.97, 0.85, True), (20.0, 0.99, None, True)), first)
    # better everywhere but one output's SQNR
    assert not dominates(_result((15.0, 0.97, 0.95, True), (19.9, 0.995, None, True)), first)
    nan = float("nan")
    assert not dominates(_result((nan, 0.97, 0.95, True), (21.0, 0.995, None, True)), first)


def test_a_refinement_not_kept_leaves_the_written_bytes_as_without_it(tmp_path, monkeypatch):
    import quark_onnx.pipeline.repair as fr

    monkeypatch.setattr(fr, "dominates", lambda result, first: False)
    refined, plain = tmp_path / "refined.onnx", tmp_path / "plain.onnx"
    quantizer = _quantizer(FidelityRefine=True)
    quantizer.quantize_model(_model(), refined, ArrayDataReader(_samples()))
    assert [r["kept"] for r in quantizer.report.repairs] == [False]
    _quantizer(FidelityRefine=False).quantize_model(_model(), plain, ArrayDataReader(_samples()))
    assert refined.read_bytes() == plain.read_bytes()


def test_the_refinement_fits_on_samples_the_guard_does_not_measure(tmp_path, monkeypatch):
    """The refinement's accuracy stages see the kept samples after the 16 it is chosen on; with
    no sample left over it is not tried. 24 samples: 6 are held out for the verdict."""
    from quark_onnx.pipeline import quantizer as quantizer_module

    seen: list[int] = []
    original = quantizer_module.QuantizationRun.accuracy

    def counting(self, model, plan, params):
        seen.append(len(self.samples))
        return original(self, model, plan, params)

    monkeypatch.setattr(quantizer_module.QuantizationRun, "accuracy", counting)
    quantizer = _quantizer(FidelityRefine=True)  # AccuracySamples 32, FidelitySamples 16
    quantizer.quantize_model(_model(), tmp_path / "a.onnx", ArrayDataReader(_samples(24)))
    assert seen == [18, 2]  # the first attempt on all 18 calibrated, the refinement on the last 2
    seen.clear()
    quantizer = _quantizer(FidelityRefine=True, AccuracySamples=16)
    quantizer.quantize_model(_model(), tmp_path / "b.onnx", ArrayDataReader(_samples(24)))
    assert seen == [16] and quantizer.report.repairs == []
