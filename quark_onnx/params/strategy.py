"""Quantization parameters for a plan: the float-scale strategies (static, weight-only, dynamic).

:func:`compute_params` turns a :class:`~quark_onnx.plan.types.QuantPlan`, the calibration result
(None when nothing needs data) and the model's constants into an ordered mapping tensor name ->
:class:`~quark_onnx.params.qparams.QuantParams`, which
:class:`~quark_onnx.passes.insert_qdq.InsertQDQ` writes. The power-of-two XINT8 flow does not come
here: it chooses positions, solves the NPU constraints and writes ``InsertQDQ(plan, positions)``
(see :mod:`quark_onnx.pipeline.quantizer`).

Per planned tensor, in plan order:

* static activation: the calibrated range ``[lo, hi] = result.range(name, method)`` (MinMax,
  Percentile, Entropy or MSE; capped at the ``range_max`` a folded Clip left), then
  :func:`~quark_onnx.params.qparams.from_range`:

  - symmetric integer: ``scale = max(|lo|, |hi|) / (qmax - z)``, ``z`` = 0 (signed) or
    ``2^(bits-1)`` (unsigned);
  - asymmetric integer: ``scale = (hi - lo) / (qmax - qmin)``, ``zero_point = round(qmin - lo /
    scale)`` over the range widened to include 0;
  - float8 e4m3fn: ``scale = max(|lo|, |hi|) / 448``;

* float16/bfloat16 tensor (activation, weight or bias): a Cast pair, no scale, no data needed;
* dynamic activation: ``QuantParams(dynamic=True)``; the graph computes the scale at run time
  (:func:`~quark_onnx.params.qparams.dynamic_params` is its reference);
* weight: MinMax of its values (:func:`~quark_onnx.params.qparams.weight_params`) at the planned
  granularity (per tensor, per channel ``axis``, or per group ``axis``/``block_size``), with its
  integer codes (``codes = quantize(W)``), so the mapping alone describes the quantized model;
* bias: with ``Int32Bias`` and both the layer's input scale ``s_in`` (a static, per-tensor
  activation) and weight scale ``s_w`` (per tensor or per channel) known: int32, ``scale = s_in *
  s_w`` (float32 product; per channel when ``s_w`` is), zero point 0, so the bias is added at the
  accumulator's scale. Otherwise, with ``Int32Bias`` the bias stays float (its input scale is not
  known ahead of time: dynamic or Cast-pair input, per-group weight); without it the bias is
  quantized like a weight, to its own per-tensor scale in the plan's bias type (int8 by default).

Weight-only and dynamic plans hold no static activation, so :func:`needs_calibration` is False
for them and no calibration data (reader) is required.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx_ir as ir

from quark_onnx.config.enums import CalibrationMethod, PowerOfTwoMethod, QuantType
from quark_onnx.config.options import ExtraOptions
from quark_onnx.config.quantization import QuantizationConfig
from quark_onnx.errors import QuantizationError
from quark_onnx.params import qparams
from quark_onnx.params.qparams import CAST_TYPES, QuantParams
from quark_onnx.plan import masks
from quark_onnx.plan.types import QuantPlan, TensorKind, TensorSpec

logger = logging.getLogger(__name__)


def is_calibrated(spec: TensorSpec) -> bool:
    """The tensor's scale comes from calibration data: a static activation with a scale."""
    return spec.kind is TensorKind.ACTIVATION and not spec.dynamic and spec.qtype not in CAST_TYPES


def calibrated_names(plan: QuantPlan) -> list[str]:
    """The activations whose ranges must be calibrated, in plan order."""
    return [name for name, spec in plan.tensors.items() if is_calibrated(spec)]


def needs_calibration(plan: QuantPlan) -> bool:
    """Whether quantizing ``plan`` needs calibration data (some static activation has a scale).

    Power-of-two plans always calibrate their activations (the XINT8 flow).
    """
    if any(spec.power_of_two for spec in plan.tensors.values()):
        return bool(plan.activation_names())
    return bool(calibrated_names(plan))


def constant_values(model: ir.Model) -> dict[str, ir.Value]:
    """Name -> value of every initializer and Constant-node output (no data is copied)."""
    values = dict(model.graph.initializers)
    for node in model.graph:
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
            values.update((out.name, out) for out in node.outputs)
    return values


def constant_data(constants: Mapping[str, ir.Value], name: str) -> np.ndarray:
    """The data of the planned weight or bias ``name``, refusing non-finite values."""
    from quark_onnx.graph.ir import constant_array

    array = constant_array(constants.get(name))
    if array is None:
        raise QuantizationError(f"weight {name!r} is not a constant; it cannot be quantized")
    if array.dtype.kind == "f" and not np.all(np.isfinite(array)):
        bad = int(np.size(array) - np.count_nonzero(np.isfinite(array)))
        raise QuantizationError(
            f"weight {name!r} holds {bad} NaN/Inf value(s); fix the float model (or exclude "
            "the node with nodes_to_exclude) before quantizing"
        )
    return array


def activation_params(
    spec: TensorSpec, result: Any, method: CalibrationMethod, options: ExtraOptions
) -> QuantParams:
    """Parameters of a planned activation (static from ``result``'s range, dynamic, or Cast)."""
    if spec.qtype in CAST_TYPES:
        return QuantParams(qtype=spec.qtype)
    if spec.dynamic:
        return QuantParams(qtype=spec.qtype, dynamic=True, symmetric=spec.symmetric)
    if result is None:
        raise QuantizationError(
            f"activation {spec.name!r} is quantized statically but no calibration result was "
            "given; pass a calibration_data_reader (or UseRandomData=True)"
        )
    lo, hi = result.range(spec.name, method=method, options=options)
    masks.check_range(spec.name, lo, hi)
    if spec.range_max is not None:
        hi = min(hi, spec.range_max)
        lo = max(lo, -spec.range_max) if spec.symmetric else min(lo, hi)
    return qparams.from_range(lo, hi, spec.qtype, symmetric=spec.symmetric)


def weight_params(spec: TensorSpec, w: np.ndarray, scale_bits: int = 0) -> QuantParams:
    """MinMax parameters of a constant at its planned granularity, with its codes
    (``scale_bits``: the ``WeightScaleBits`` option)."""
    if spec.qtype in CAST_TYPES:
        params = QuantParams(qtype=spec.qtype)
    else:
        params = qparams.weight_params(
            w,
            spec.qtype,
            symmetric=spec.symmetric,
            axis=spec.axis,
            block_size=spec.block_size,
            scale_bits=scale_bits,
        )
    return _with_codes(params, w)


def _with_codes(params: QuantParams, w: np.ndarray) -> QuantParams:
    return dataclasses.replace(params, codes=qparams.quantize(w, params))


def accumulator_bias_params(
    b: np.ndarray, s_in: QuantParams, s_w: QuantParams
) -> QuantParams | None:
    """int32 bias at ``s_in * s_w`` when both scales fit a bias of ``b``'s shape, else None.

    ``s_in`` must be per tensor with an integer type or float8 (a scale, not a Cast); ``s_w``
    per tensor, or per channel with one scale per bias element.
    """
    if s_in.scale is None or s_in.axis is not None or s_w.scale is None:
        return None
    if s_w.block_size is not None:
        return None
    product = np.float32(s_in.scale) * s_w.scale.astype(np.float32)
    if s_w.axis is None:
        scale, axis = np.asarray(product, dtype=np.float32).reshape(()), None
    elif b.ndim == 1 and product.shape == b.shape:
        scale, axis = product.astype(np.float32), 0
    else:
        return None
    if not np.all(np.isfinite(scale)) or np.any(scale <= 0):
        return None
    params = QuantParams(
        qtype=QuantType.QInt32,
        scale=scale,
        zero_point=np.zeros(scale.shape, dtype=np.int32),
        axis=axis,
    )
    return _with_codes(params, b)


def bias_params(
    spec: TensorSpec,
    b: np.ndarray,
    plan: QuantPlan,
    params: Mapping[str, QuantParams],
    options: ExtraOptions,
) -> QuantParams | None:
    """Parameters of a planned bias (see the module docstring), or None: it stays float."""
    if spec.qtype in CAST_TYPES:
        return _with_codes(QuantParams(qtype=spec.qtype), b)
    if options.Int32Bias:
        source, weight = plan.bias_sources.get(spec.name, (None, None))
        s_in = params.get(source) if source is not None else None
        s_w = params.get(weight) if weight is not None else None
        if s_in is not None and s_w is not None:
            result = accumulator_bias_params(b, s_in, s_w)
            if result is not None:
                codes = result.codes if result.codes is not None else np.zeros(0, np.int32)
                info = np.iinfo(np.int32)
                saturated = int(np.count_nonzero((codes == info.min) | (codes == info.max)))
                if saturated:
                    logger.warning(
                        "bias %s: %d value(s) saturate int32 at scale s_in * s_w",
                        spec.name,
                        saturated,
                    )
                return result
        logger.info(
            "bias %s stays float: Int32Bias needs a static per-tensor input scale and a "
            "per-tensor or per-channel weight scale",
            spec.name,
        )
        return None
    qtype = spec.qtype if spec.qtype is not QuantType.QInt32 else QuantType.QInt8
    own = qparams.weight_params(b, qtype, symmetric=True)
    return _with_codes(own, b)


def compute_params(
    plan: QuantPlan,
    result: Any,
    model: ir.Model,
    qconfig: QuantizationConfig,
    options: ExtraOptions | None = None,
) -> dict[str, QuantParams]:
    """Quantization parameters for every tensor of a float-scale ``plan``, in plan order.

    Args:
        plan: from :func:`quark_onnx.plan.build.build_plan` on ``model`` (not power-of-two).
        result: the :class:`~quark_onnx.calibration.CalibrationResult` of
            :func:`calibrated_names`; None when :func:`needs_calibration` is False.
        model: the prepared float model (the weights are read from it).
        qconfig: its ``calibrate_method`` picks the activation range estimator.
        options: the resolved extra options (default: the plan's).

    Returns:
        Ordered mapping for ``InsertQDQ(params)``. A bias that cannot be quantized as
        configured is left out (it stays float). Weights and biases carry their codes.

    Raises:
        QuantizationError: a power-of-two plan, a static activation without a calibration
            result, or a weight with NaN/Inf values.
    """
    opts = options if options is not None else plan.options
    method = qconfig.calibrate_method
    if any(spec.power_of_two for spec in plan.tensors.values()) or isinstance(
        method, PowerOfTwoMethod
    ):
        raise QuantizationError(
            "compute_params handles float scales; power-of-two (XINT8) plans get positions "
            "from the NPU constraint solver"
        )
    constants = constant_values(model)
    params: dict[str, QuantParams] = {}
    # activations and weights first: a bias needs its layer's input and weight scales
    for name, spec in plan.tensors.items():
        if spec.kind is TensorKind.ACTIVATION:
            params[name] = activation_params(spec, result, method, opts)
        elif spec.kind is TensorKind.WEIGHT:
            params[name] = weight_params(spec, constant_data(constants, name), opts.WeightScaleBits)
    biases: dict[str, QuantParams] = {}
    for name, spec in plan.tensors.items():
        if spec.kind is TensorKind.BIAS:
            bias = bias_params(spec, constant_data(constants, name), plan, params, opts)
            if bias is not None:
                biases[name] = bias
    ordered = {name: params.get(name, biases.get(name)) for name in plan.tensors}
    return {name: p for name, p in ordered.items() if p is not None}
