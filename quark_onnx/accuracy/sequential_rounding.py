"""Second-order rounding inside bias correction's layer walk (:class:`SequentialRounding`).

The rounding itself, its loss, settings and held-out gate are :mod:`~quark_onnx.accuracy.adaround`'s
(module doc there, "With bias correction on"); this module streams each layer's statistics
through bias correction's replays and applies the kept codes before the layer's bias is
corrected (:mod:`~quark_onnx.accuracy.bias_correction`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx

from quark_onnx.accuracy.adaround import (
    GPTQ_COLUMNS,
    GPTQ_HELD_OUT_GROUPS,
    GPTQ_POSITIONS_PER_INPUT,
    AdaRoundSettings,
    _dequantized_bias,
    _float_weight_name,
    _quadratic_loss,
    _round,
)
from quark_onnx.accuracy.layer_statistics import _Statistics, _ungroup
from quark_onnx.accuracy.layers import Layer, held_out_split, set_codes
from quark_onnx.accuracy.replay import Replay


def _positions_per_sample(layer: Layer, batch: int) -> int | None:
    """Output positions (rows of the layer's statistics) one sample gives, from the layer's
    static output shape (a symbolic batch dimension is ``batch``); None when not known."""
    shape = layer.node.outputs[0].shape
    if shape is None or len(shape) < 2 or not all(isinstance(d, int) for d in shape[1:]):
        return None
    n = shape[0] if isinstance(shape[0], int) else batch
    return int(n) if layer.op_type == "Gemm" else int(n) * math.prod(int(d) for d in shape[2:])


class SequentialRounding:
    """Second-order rounding inside bias correction's layer walk (module doc).

    Called for a layer before its bias is corrected, this streams the layer's quantized input
    and float output once through bias correction's replays (:class:`~.layerwise.Replay`),
    accumulates ``G``/``C`` of the fitted half and of each held-out group (:class:`_Statistics`,
    at most :data:`GPTQ_POSITIONS_PER_INPUT` positions per input), rounds
    (:func:`gptq_rounding`) and applies the held-out gate (:func:`_round`, then per group).
    Kept codes are set in the graph and in the quantized replay before the layer's own segment
    is built, so bias correction then measures the mean error of the rounded weights, and later
    layers see both. A layer offering fewer
    positions than :data:`GPTQ_POSITIONS_PER_INPUT` per input (known from its static output
    shape) is not streamed at all.
    """

    def __init__(
        self, prepared: onnx.ModelProto, samples: Sequence[dict[str, np.ndarray]],
        settings: AdaRoundSettings,
    ):  # fmt: skip
        self.settings = settings
        first = next(iter(samples[0].values()), None) if samples else None
        self.batch = int(first.shape[0]) if first is not None and first.ndim else 1
        num_samples = len(samples)
        self.float_weights = {t.name: t for t in prepared.graph.initializer}
        fit, check = held_out_split(list(range(num_samples)))
        self.cut = len(fit)
        self.num_samples = num_samples
        self.gated = bool(check)
        self.per_layer: list[dict[str, Any]] = []
        self.skipped: list[dict[str, Any]] = []
        self.seconds = 0.0

    def __call__(self, layer: Layer, quant: Replay, flt: Replay) -> None:
        t0 = time.perf_counter()
        try:
            self._round_layer(layer, quant, flt)
        finally:
            self.seconds += time.perf_counter() - t0

    def _round_layer(self, layer: Layer, quant: Replay, flt: Replay) -> None:
        w_name = _float_weight_name(layer)
        if layer.weight_codes.dtype != np.int8 or w_name not in self.float_weights:
            self.skipped.append({"node": layer.name, "reason": "no float int8-quantized weight"})
            return
        w_float = onnx.numpy_helper.to_array(self.float_weights[w_name]).astype(np.float32)
        bias = _dequantized_bias(layer, w_float)
        target = self.settings.Target
        fit = _Statistics(layer, w_float, bias, GPTQ_COLUMNS, target)
        if not fit.supported:
            self.skipped.append({"node": layer.name, "reason": f"unsupported {layer.op_type} form"})
            return
        k = fit.wg.shape[2]
        wanted = GPTQ_POSITIONS_PER_INPUT * k
        per_sample = _positions_per_sample(layer, self.batch)
        if per_sample is not None and per_sample * self.cut < wanted:
            # known from the static shape: not even streamed
            self.skipped.append(
                {"node": layer.name, "reason": f"{per_sample * self.cut} positions for {k} inputs"}
            )
            return
        # the same positions whether the shape is static or not (rows depend on no shape pass)
        fit.columns = -(-wanted // self.cut)
        n_held = self.num_samples - self.cut
        groups = [
            _Statistics(layer, w_float, bias, fit.columns, target)
            for _ in range(min(GPTQ_HELD_OUT_GROUPS, n_held) if self.gated else 0)
        ]
        pairs = zip(flt.stream([layer.float_output]), quant.stream([layer.input]), strict=True)
        for (i, (t,)), (_, (x,)) in pairs:
            if i < self.cut or not groups:
                fit.add(x, t)
            else:
                groups[(i - self.cut) * len(groups) // n_held].add(x, t)
            del t, x
        parts = [g.result() for g in groups]
        held = None
        if parts and all(part is not None for part in parts):
            held = (
                parts[0][0],
                sum(part[1] for part in parts),
                sum(part[2] for part in parts),
                sum(part[3] for part in parts),
                parts[0][4],
            )
        stats = fit.result()
        if stats is None or (groups and held is None):
            self.skipped.append({"node": layer.name, "reason": f"unsupported {layer.op_type} form"})
            return
        if fit.available < wanted:
            self.skipped.append(
                {"node": layer.name, "reason": f"{fit.available} positions for {k} inputs"}
            )
            return
        result, held_out = _round(layer, stats, held, self.settings)
        if result.accepted and len(parts) > 1:
            # kept only where every held-out group gains, not just their sum
            step = math.ldexp(1.0, -layer.weight_position)
            nearest = np.clip(np.rint(stats[0] / step), -128, 127)
            if not all(
                _quadratic_loss(result.codes * step, p[1], p[2], p[3])
                < _quadratic_loss(nearest * step, p[1], p[2], p[3])
                for p in parts
            ):
                result.accepted = False
                result.codes = nearest.astype(np.int8)
        codes = _ungroup(result.codes, stats[4])
        changed = int(np.count_nonzero(codes != layer.weight_codes))
        if result.accepted and changed:
            set_codes(layer.weight, codes)
            quant.set_initializer(layer.weight.name or "", codes)
        self.per_layer.append(
            result.record(
                layer.name,
                changed,
                held_out,
                inputs=k,
                fitted_positions=fit.rows,
                seconds=round(result.seconds, 3),
            )
        )

    def summary(self) -> dict[str, Any]:
        """The stage's JSON summary, shaped as :func:`adaround`'s."""
        return {
            "layers": len(self.per_layer),
            "accepted": sum(int(r["accepted"]) for r in self.per_layer),
            "settings": self.settings.__dict__.copy(),
            "per_layer": self.per_layer,
            "skipped": self.skipped,
            "seconds": round(self.seconds, 3),
            "shared_walk": True,
        }
