"""The fidelity guard: the quantized model's outputs against the float model's, on the first
calibration samples.

The reference is the model the user gave, before any pass (:func:`reference_outputs`), so the
cost of the numerics-changing passes counts. :func:`guard_fidelity` warns (or, with
``RequireFidelity``, raises) when an output is not faithful, naming the tensors whose SQNR drops
the most (:func:`worst_layers`, the per-layer error analysis).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx

from quark_onnx.config.enums import QuantType
from quark_onnx.config.options import ExtraOptions
from quark_onnx.errors import ConfigError, FidelityError
from quark_onnx.model_files import external

if TYPE_CHECKING:
    import onnx_ir as ir

    from quark_onnx.fidelity.verdict import FidelityResult
    from quark_onnx.pipeline.report import QuantizationReport

# the quantizer's stages report through the quantizer's logger
logger = logging.getLogger("quark_onnx.pipeline.quantizer")

__all__ = ["guard_fidelity", "materialize", "measure", "reference_outputs", "worst_layers"]


def reference_outputs(
    source: str, model: ir.Model, samples: list[dict[str, np.ndarray]], options: ExtraOptions
) -> list[dict[str, np.ndarray]] | None:
    """The loaded model's outputs on ``samples`` (None: no samples, guard off, or onnxruntime
    cannot run them; calibration then reports a bad feed by name)."""
    if not samples or not options.FidelityCheck:
        return None
    from quark_onnx.pipeline.prepare import run_model

    try:
        return run_model(model, samples)
    except Exception as exc:  # onnxruntime raises its own exception types
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        logger.warning("%s: fidelity not measured: the model does not run: %s", source, first)
        return None


def guard_fidelity(
    report: QuantizationReport,
    source: str,
    model: Any,
    samples: list[dict[str, np.ndarray]],
    reference: list[dict[str, np.ndarray]],
    stages: tuple[onnx.ModelProto, Any, Path | None],
    options: ExtraOptions,
    repair: Callable[[FidelityResult], tuple[Any, FidelityResult]] | None = None,
) -> Any:
    """Measure every output against the original float model; warn (or raise) if unfaithful.

    The reference is the model the user gave, before any pass: the cost of the
    numerics-changing passes counts. When an output is not faithful, ``repair`` (when given)
    may replace the model (:mod:`quark_onnx.pipeline.repair`), then the per-layer error analysis
    of the model kept (the tensors whose SQNR drops the most) names where it is lost. Returns the
    model kept.
    """
    result = measure(report, source, model, samples, reference, options)
    if result is None:
        return model
    if repair is not None:  # a repair when not faithful, else a refinement (fidelity_repair)
        model, result = repair(result)
    if not result.faithful:
        result.worst_layers = worst_layers(report, samples, model, *stages)
    report.fidelity = result.to_dict()
    if result.faithful:
        logger.info("%s: faithful on %d sample(s): %s", source, result.samples, result.describe())
        return model
    message = result.message(source)
    if _activation_bits(report) == 8:
        # measured: a seal text detector (activations with max/RMS near 40 in ~60 blocks, each
        # losing a little) 0.3 dB in XINT8, 9.1 dB with A16W8 (benchmarks/results/unseen.md)
        message += (
            "; where many layers each lose a little, 8-bit activations are the limit: "
            "16-bit activations (preset A16W8) keep more"
        )
    if options.RequireFidelity:
        raise FidelityError(message + " (RequireFidelity is set: no model was written)")
    logger.warning(message)
    return model


def _activation_bits(report: QuantizationReport) -> int | None:
    """Bits of the activation type in the report's settings (``"QuantType.QInt8"``), or None."""
    name = str(report.settings.get("activation_type", "")).rpartition(".")[2]
    try:
        return QuantType.coerce(name).bits
    except ConfigError:
        return None


def measure(
    report: QuantizationReport,
    source: str,
    model: Any,
    samples: list[dict[str, np.ndarray]],
    reference: list[dict[str, np.ndarray]],
    options: ExtraOptions,
) -> FidelityResult | None:
    """Every output of ``model`` against ``reference`` on ``samples`` (None, recorded in the
    report, when the model does not run)."""
    from quark_onnx.fidelity import verdict
    from quark_onnx.pipeline.prepare import run_model

    try:
        quantized = run_model(model, samples)
    except Exception as exc:  # onnxruntime raises its own exception types
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        logger.warning("%s: fidelity not measured: %s", source, first)
        report.fidelity = {"faithful": None, "error": first}
        return None
    return verdict.FidelityResult(
        samples=len(samples),
        outputs=verdict.compare_runs(
            reference,
            quantized,
            min_sqnr_db=options.FidelityMinSQNR,
            min_agreement=options.FidelityMinAgreement,
        ),
        min_sqnr_db=options.FidelityMinSQNR,
        min_agreement=options.FidelityMinAgreement,
    )


def worst_layers(
    report: QuantizationReport,
    samples: list[dict[str, np.ndarray]],
    model: Any,
    prepared: onnx.ModelProto,
    plan: Any,
    external_dir: Path | None,
    count: int = 3,
) -> list[dict[str, Any]]:
    """The ``count`` quantized tensors whose SQNR drops the most (layer error analysis)."""
    from quark_onnx.errors import QuarkOnnxError

    errors = report.layer_errors
    if not errors:
        from quark_onnx.accuracy.error_analysis import layer_errors

        materialize(prepared, external_dir)
        try:
            errors = layer_errors(prepared, model, samples, plan)
        except QuarkOnnxError as exc:
            logger.info("per-layer error analysis failed: %s", exc)
            return []
    ranked = sorted(errors, key=lambda e: -e["drop_db"])[:count]
    return [{k: e[k] for k in ("tensor", "node", "op_type", "sqnr_db", "drop_db")} for e in ranked]


def materialize(prepared: onnx.ModelProto, external_dir: Path | None) -> None:
    """Read external weights into ``prepared`` (no-op without external data): the layer replays
    of AdaRound, bias correction and error analysis run onnxruntime on model bytes. Called after
    the positions stage, whose weight error curves are gone by then, to keep the peak low."""
    if external_dir is not None:
        external.materialize(prepared, external_dir)
