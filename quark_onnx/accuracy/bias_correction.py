"""Empirical bias correction: remove the mean output shift quantization leaves in each layer.

For every quantized Conv/ConvTranspose/Gemm with a bias, in graph order, on the kept calibration
samples:

* ``y_q``: the layer's output in the quantized model, computed from the quantized model's actual
  inputs (the already-corrected quantized prefix) with its int8 weights and bias;
* ``y_f``: the same tensor in the float model (float inputs, float weights);
* per output channel ``c``: ``delta_c = mean(y_f - y_q)`` over samples and spatial positions;
* the bias becomes ``b'_c = b_c + delta_c`` and is requantized at its *unchanged* position
  ``p_b``: ``q'_c = clip(round_half_even(b'_c * 2^p_b), qmin, qmax)`` (int8, or int32 with
  ``Int32Bias``). Positions do not move, so every NPU rule (shift_bias included) still holds.

Because ``y_q`` is measured on the quantized model's inputs, the correction also absorbs the mean
error arriving from earlier layers ("empirical" rather than analytic bias correction). The
layer's output is then updated in the replay (``y_q + (q'_c - q_c) 2^-p_b``) so later layers see
the corrected prefix; the whole walk runs every node once (:class:`~.layerwise.Replay`).

Saturation: a corrected bias that leaves the int8 range at ``p_b`` is clipped, and counted in the
report. A layer without a bias is skipped and reported: adding one would need a new position
inside the shift_bias window, which the constraint solver, not this stage, chooses.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir

from quark_onnx.accuracy.layerwise import (
    Layer,
    Replay,
    find_layers,
    ir_model_to_proto,
    set_codes,
    tensor_names,
)
from quark_onnx.options import ExtraOptions
from quark_onnx.plan import QuantPlan
from quark_onnx.progress import Progress

logger = logging.getLogger(__name__)


def channel_mean(values: Sequence[np.ndarray], axis: int = 1) -> np.ndarray:
    """Mean over every axis but ``axis`` and over all arrays (float64), one value per channel."""
    total: np.ndarray | None = None
    count = 0
    for v in values:
        moved = np.moveaxis(np.asarray(v, dtype=np.float64), axis, 0)
        flat = moved.reshape(moved.shape[0], -1)
        s = flat.sum(axis=1)
        total = s if total is None else total + s
        count += flat.shape[1]
    if total is None:
        raise ValueError("no values")
    return total / max(count, 1)


def requantize_bias(codes: np.ndarray, position: int, delta: np.ndarray) -> tuple[np.ndarray, int]:
    """Codes of ``codes * 2^-p + delta`` at position ``p`` (round half to even, saturating).

    Returns the new codes (same dtype) and how many of them saturated (the wanted value lay
    outside the integer range and was clipped).
    """
    info = np.iinfo(codes.dtype)
    wanted = np.rint(
        codes.astype(np.float64) + delta.astype(np.float64) * math.ldexp(1.0, position)
    )
    saturated = int(np.count_nonzero((wanted < info.min) | (wanted > info.max)))
    return np.clip(wanted, info.min, info.max).astype(codes.dtype), saturated


def _followed_by_relu(layer: Layer) -> bool:
    uses = layer.node.outputs[0].uses()
    if len(uses) != 1:
        return False
    nxt = uses[0].node
    if nxt.op_type in ("QuantizeLinear",) and nxt.outputs:
        dq_uses = nxt.outputs[0].uses()
        if len(dq_uses) != 1 or not dq_uses[0].node.outputs:
            return False
        after = dq_uses[0].node.outputs[0].uses()
        if len(after) != 1:
            return False
        nxt = after[0].node
    return nxt.op_type == "Relu"


def _shift(layer: Layer, yf: Sequence[np.ndarray], yq: Sequence[np.ndarray]) -> np.ndarray:
    """Per-channel mean of ``y_f - y_q``; before a Relu only where either output is positive
    (the error a Relu removes needs no correction)."""
    if not _followed_by_relu(layer):
        return channel_mean([f - q for f, q in zip(yf, yq, strict=True)])
    num = den = None
    for f, q in zip(yf, yq, strict=True):
        f64 = np.moveaxis(np.asarray(f, np.float64), 1, 0).reshape(f.shape[1], -1)
        q64 = np.moveaxis(np.asarray(q, np.float64), 1, 0).reshape(q.shape[1], -1)
        active = (f64 > 0) | (q64 > 0)
        n = np.sum((f64 - q64) * active, axis=1)
        d = np.sum(active, axis=1)
        num = n if num is None else num + n
        den = d if den is None else den + d
    assert num is not None and den is not None
    return num / np.maximum(den, 1)


def _held_out_shift(layer: Layer, yf: Sequence[np.ndarray], yq: Sequence[np.ndarray]) -> np.ndarray:
    """The per-channel shift over all samples, kept only for channels where it generalises.

    The shift is estimated on the first half of the samples and checked on the second half: a
    channel is corrected only when subtracting the first half's estimate brings the second half's
    mean error closer to zero. A mean shift that is noise (it differs between halves more than it
    is large) is left alone, so the correction cannot add error on data it has not seen. With
    fewer than four samples there is nothing to hold out and every channel is corrected.
    """
    delta = _shift(layer, yf, yq)
    half = len(yq) // 2
    if half < 2:
        return delta
    fit = _shift(layer, yf[:half], yq[:half])
    check = _shift(layer, yf[half:], yq[half:])
    return np.where(np.abs(check - fit) < np.abs(check), delta, 0.0)


def _bias_step(layer: Layer) -> np.ndarray:
    assert layer.bias_position is not None
    return np.float64(math.ldexp(1.0, -layer.bias_position))


def correct_bias(
    prepared: onnx.ModelProto,
    model: ir.Model,
    samples: Sequence[dict[str, np.ndarray]],
    plan: QuantPlan,
    positions: dict[str, int],
    options: ExtraOptions,
) -> dict[str, Any]:
    """Correct the quantized biases of ``model`` in place (module doc); returns a JSON summary.

    Args:
        prepared: the float model after the float passes (same tensor names).
        model: the quantized model (QDQ inserted); its ``<bias>_quantized`` codes are rewritten.
        samples: calibration feeds (up to ``options.AccuracySamples``).
        plan, positions: the quantization plan and solved positions (positions are not changed).
        options: the extra options.
    """
    start = time.perf_counter()
    summary: dict[str, Any] = {"layers": 0, "changed_channels": 0, "saturated": 0}
    if not samples:
        logger.warning("bias correction skipped: no calibration samples were kept")
        summary["skipped_reason"] = "no calibration samples kept (AccuracySamples = 0?)"
        return summary
    layers, skipped = find_layers(model, tensor_names(prepared))
    quant = Replay(ir_model_to_proto(model), samples, "bias correction (quantized model)")
    flt = Replay(prepared, samples, "bias correction (float model)")
    per_layer: list[dict[str, Any]] = []
    with Progress(len(layers), desc="bias correction", unit="layers", logger=logger) as progress:
        for layer in layers:
            progress.update()
            if layer.bias is None or layer.bias_position is None:
                skipped.append(
                    {
                        "node": layer.name,
                        "reason": "no bias (adding one needs a shift_bias position)",
                    }
                )
                continue
            (yq,) = quant.get([layer.output])
            (yf,) = flt.get([layer.float_output])
            delta = _held_out_shift(layer, yf, yq)
            codes = layer.bias_codes
            assert codes is not None
            if delta.shape != codes.shape:
                skipped.append({"node": layer.name, "reason": "bias and output channels differ"})
                continue
            new_codes, saturated = requantize_bias(codes, layer.bias_position, delta)
            applied = (new_codes.astype(np.float64) - codes) * _bias_step(layer)
            changed = int(np.count_nonzero(new_codes != codes))
            per_layer.append(
                {
                    "node": layer.name,
                    "mean_shift_before": float(np.mean(np.abs(delta))),
                    "mean_shift_after": float(np.mean(np.abs(delta - applied))),
                    "changed_channels": changed,
                    "saturated": saturated,
                }
            )
            summary["layers"] += 1
            summary["changed_channels"] += changed
            summary["saturated"] += saturated
            if saturated:
                logger.info(
                    "bias correction: %s: %d bias value(s) saturate at position %d",
                    layer.name,
                    saturated,
                    layer.bias_position,
                )
            if not changed:
                continue
            set_codes(layer.bias, new_codes)
            quant.set_initializer(layer.bias.name or "", new_codes)
            shape = [1] * yq[0].ndim
            shape[1] = -1
            step = applied.reshape(shape).astype(np.float32)
            quant.patch(layer.output, [y + step for y in yq])
    summary["per_layer"] = per_layer
    summary["skipped"] = skipped
    summary["samples"] = len(samples)
    summary["segment_runs"] = quant.runs + flt.runs
    summary["seconds"] = round(time.perf_counter() - start, 3)
    logger.info(
        "bias correction: %d layer(s), %d channel(s) changed, %d saturated, %d skipped",
        summary["layers"],
        summary["changed_channels"],
        summary["saturated"],
        len(skipped),
    )
    return summary
