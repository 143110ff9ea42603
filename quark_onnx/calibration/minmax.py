"""The running min/max observer (:class:`MinMaxObserver`): ``MinMax`` ranges and the
``NonOverflow`` position, in memory that does not grow with the number of samples, mergeable
(see :mod:`quark_onnx.calibration.observers`, which holds the histogram observer as well).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from quark_onnx.config.enums import QuantType
from quark_onnx.errors import CalibrationError
from quark_onnx.params import pof2


class MinMaxObserver:
    """Running min/max of the finite values (and their moving average over batches).

    With ``moving_average=c`` each :meth:`update` is one batch and ``ema = ema + c * (batch -
    ema)`` (starting from the first batch), as onnxruntime's MinMax calibrator does; that average
    depends on batch order, so such observers cannot be merged.
    """

    kind = "minmax"

    def __init__(self, moving_average: float | None = None) -> None:
        self.min = math.inf
        self.max = -math.inf
        self.count = 0
        self.nonfinite = 0
        self.batches = 0
        self.moving_average = moving_average
        self.ema_min = math.nan
        self.ema_max = math.nan

    @property
    def absmax(self) -> float:
        """``max |x|`` over the finite values seen (0.0 when none)."""
        if self.count == 0:
            return 0.0
        return max(abs(self.min), abs(self.max))

    def update(self, x: np.ndarray) -> None:
        """Fold one batch (any shape, any real dtype) into the statistics."""
        x = np.asarray(x)
        if x.size == 0:
            return
        lo, hi = x.min(), x.max()  # numpy min/max propagate NaN
        dropped = 0
        if not (np.isfinite(lo) and np.isfinite(hi)):
            finite = x[np.isfinite(x)]
            dropped = int(x.size - finite.size)
            if finite.size == 0:
                self.nonfinite += dropped
                return
            lo, hi = finite.min(), finite.max()
        self.update_stats(float(lo), float(hi), int(x.size - dropped), dropped)

    def update_stats(self, lo: float, hi: float, count: int, nonfinite: int = 0) -> None:
        """Fold a batch given by its finite min, max and count (in-graph reductions)."""
        self.nonfinite += nonfinite
        if count == 0:
            return
        self.min = min(self.min, lo)
        self.max = max(self.max, hi)
        self.count += count
        if self.moving_average is not None:
            c = self.moving_average
            if self.batches == 0:
                self.ema_min, self.ema_max = lo, hi
            else:
                self.ema_min += c * (lo - self.ema_min)
                self.ema_max += c * (hi - self.ema_max)
        self.batches += 1

    def range(self, moving_average: bool = False) -> tuple[float, float]:
        if self.count == 0:
            return 0.0, 0.0
        if moving_average:
            if self.moving_average is None:
                raise CalibrationError(
                    "the moving average of min/max was not collected: calibrate again with "
                    "CalibMovingAverage=True"
                )
            return self.ema_min, self.ema_max
        return self.min, self.max

    def nonoverflow_position(self, qtype: QuantType = QuantType.QInt8) -> int:
        """:func:`quark_onnx.params.pof2.nonoverflow_position` of the observed ``[min, max]``."""
        if self.count == 0:
            return pof2.ZERO_POSITION
        return pof2.nonoverflow_position(self.min, self.max, QuantType.coerce(qtype))

    def merge(self, other: MinMaxObserver) -> MinMaxObserver:
        """The observer of the union of both data sets."""
        if self.moving_average is not None or other.moving_average is not None:
            raise CalibrationError(
                "moving-average min/max depends on batch order and cannot be merged"
            )
        out = MinMaxObserver()
        out.min = min(self.min, other.min)
        out.max = max(self.max, other.max)
        out.count = self.count + other.count
        out.nonfinite = self.nonfinite + other.nonfinite
        out.batches = self.batches + other.batches
        return out

    def relu(self) -> MinMaxObserver:
        """The observer of ``max(x, 0)`` for the data of this one."""
        out = MinMaxObserver()
        out.count, out.nonfinite, out.batches = self.count, self.nonfinite, self.batches
        if self.count:
            out.min, out.max = max(self.min, 0.0), max(self.max, 0.0)
        return out

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "kind": self.kind,
            "min": self.min if self.count else None,
            "max": self.max if self.count else None,
            "count": self.count,
            "nonfinite": self.nonfinite,
            "batches": self.batches,
        }
        if self.moving_average is not None:
            d.update(moving_average=self.moving_average, ema_min=self.ema_min, ema_max=self.ema_max)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MinMaxObserver:
        out = cls(d.get("moving_average"))
        out.count, out.nonfinite, out.batches = int(d["count"]), int(d["nonfinite"]), d["batches"]
        if out.count:
            out.min, out.max = float(d["min"]), float(d["max"])
        if out.moving_average is not None:
            out.ema_min, out.ema_max = float(d["ema_min"]), float(d["ema_max"])
        return out
