"""The calibration result: plain per-tensor statistics that can be saved, loaded and queried.

A :class:`CalibrationResult` maps tensor names to observers (see
:mod:`quark_onnx.calibration.observers`) and answers the questions the quantizer asks: a range for
a float-scale method, a power-of-two position for NonOverflow/MinMSE, ``max |x|``. Saved as JSON
(scalars readable; histogram arrays as base64 little-endian bytes, only nonzero buckets), it lets a
second quantization with other options skip running the model. It records the identity of the
model it was made for (:func:`model_hash`) and refuses to load for another model.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import onnx

from quark_onnx.calibration.buckets import signed_limits
from quark_onnx.calibration.observers import (
    HistogramObserver,
    MinMaxObserver,
    Observer,
    observer_from_dict,
)
from quark_onnx.config.enums import CalibrationMethod, PowerOfTwoMethod, QuantType
from quark_onnx.config.options import ExtraOptions, did_you_mean
from quark_onnx.errors import CalibrationError
from quark_onnx.model_files.files import atomic_write_bytes, read_regular_file

#: Version 2: histograms hold exact integer offset statistics (version 1 held float sums).
FORMAT = "quark_onnx.calibration/2"
#: Largest saved result read: a few KB per calibrated tensor (histograms hold only nonzero
#: buckets), so even 20k tensors stay below; anything bigger is refused unread.
MAX_RESULT_BYTES = 256 << 20


def model_hash(model: onnx.ModelProto) -> str:
    """SHA-256 of what determines the model's tensors: structure and initializer values.

    Covers the opset imports, the graph inputs and outputs (names and types), every node in order
    (op type, domain, input and output names, attributes) and every initializer (name, type, dims,
    bytes). Node names, doc strings, metadata and inferred ``value_info`` are left out: they do not
    change any value. Initializers stored outside the model and not loaded are identified by their
    external-data location, offset and length.
    """
    h = hashlib.sha256()

    def put(*parts: Any) -> None:
        for part in parts:
            data = part if isinstance(part, bytes) else str(part).encode()
            h.update(len(data).to_bytes(8, "little"))
            h.update(data)

    for imp in sorted(model.opset_import, key=lambda o: o.domain):
        put("opset", imp.domain, imp.version)
    graph = model.graph
    for kind, values in (("input", graph.input), ("output", graph.output)):
        for vi in values:
            put(kind, vi.name, vi.type.SerializeToString(deterministic=True))
    for node in graph.node:
        put("node", node.op_type, node.domain, len(node.input), *node.input)
        put(len(node.output), *node.output)
        for attr in node.attribute:
            put(attr.SerializeToString(deterministic=True))
    for init in graph.initializer:
        put("init", init.name, init.data_type, *init.dims)
        if init.data_location == onnx.TensorProto.EXTERNAL:
            put(*(f"{e.key}={e.value}" for e in init.external_data))
        elif init.HasField("raw_data"):
            put(init.raw_data)
        elif init.data_type == onnx.TensorProto.STRING:
            put(*init.string_data)  # bytes as stored: not necessarily UTF-8 text
        else:
            put(onnx.numpy_helper.to_array(init).tobytes())
    for sparse in graph.sparse_initializer:
        put("sparse", sparse.SerializeToString(deterministic=True))
    return h.hexdigest()


def _zero_error(p: int) -> float:
    """The error curve of an all-zero tensor: every position represents it exactly."""
    return 0.0


class CalibrationResult:
    """Per-tensor observers plus the identity of the model and how they were collected."""

    def __init__(
        self,
        model_hash: str,
        method: str,
        num_samples: int,
        observers: dict[str, Observer],
    ) -> None:
        self.model_hash = model_hash
        self.method = method
        self.num_samples = num_samples
        self.observers = dict(observers)

    def __repr__(self) -> str:
        return (
            f"CalibrationResult(method={self.method!r}, num_samples={self.num_samples}, "
            f"tensors={len(self.observers)}, model_hash={self.model_hash[:12]!r})"
        )

    def names(self) -> list[str]:
        return list(self.observers)

    def observer(self, name: str) -> Observer:
        try:
            return self.observers[name]
        except KeyError:
            hint = did_you_mean(name, self.observers)
            raise CalibrationError(
                f"tensor {name!r} was not calibrated{hint} ({len(self.observers)} tensors were)"
            ) from None

    def _histogram(self, name: str, what: str) -> HistogramObserver:
        obs = self.observer(name)
        if not isinstance(obs, HistogramObserver):
            raise CalibrationError(
                f"tensor {name!r}: {what} needs a histogram, but this result was collected with "
                f"{self.method} (min/max only); calibrate again with {what}"
            )
        return obs

    def absmax(self, name: str) -> float:
        """``max |x|`` over the finite values seen."""
        return float(self.observer(name).absmax)

    def position(
        self, name: str, *, method: PowerOfTwoMethod, qtype: QuantType = QuantType.QInt8
    ) -> int:
        """Power-of-two position ``p`` (scale ``2^-p``) of tensor ``name`` for ``qtype``.

        NonOverflow: :func:`quark_onnx.params.pof2.nonoverflow_position` of the observed ``[min,
        max]`` (rounding-aware; the negative side may use code -128). MinMSE: the exact histogram
        search (:func:`~quark_onnx.calibration.histogram_search.minmse_position_from_histogram`),
        equal to :func:`quark_onnx.params.pof2.minmse_position` of all calibration values for 8-bit
        types. A tensor that was all zeros gets :data:`quark_onnx.params.pof2.ZERO_POSITION`.
        """
        method = PowerOfTwoMethod.coerce(method)
        qtype = QuantType.coerce(qtype)
        if method is PowerOfTwoMethod.NonOverflow:
            return self.observer(name).nonoverflow_position(qtype)
        return self._histogram(name, "MinMSE").minmse_position(qtype)

    def error_function(
        self, name: str, qtype: QuantType = QuantType.QInt8
    ) -> Callable[[int], float] | None:
        """``p -> MSE`` of tensor ``name`` at position ``p`` over all calibration values (memoised).

        The value is the exact quantization SSE computed from the histogram
        (:func:`~quark_onnx.calibration.histogram_search.histogram_sse`: exact for 8-bit types,
        ``p <= 132``) divided by the number of values: a mean per element, the same currency as
        :func:`quark_onnx.params.pof2.error_function` for weights, so the NPU constraint solver can
        compare moves of activations and weights (see that function for why per-element MSE,
        not SSE, is the right cost).

        Returns ``None`` when the tensor was calibrated with min/max only (NonOverflow, MinMax):
        its error at a position is not known. Exception: a tensor whose values were all zero (or
        none finite) gets the constant 0 curve, exact with any statistics, so the solver moves it
        for free instead of its neighbours.
        """
        qtype = QuantType.coerce(qtype)
        obs = self.observer(name)
        count = obs.count
        if count == 0 or (obs.min == 0.0 and obs.max == 0.0):
            return _zero_error
        if not isinstance(obs, HistogramObserver):
            return None

        @functools.cache
        def cost(p: int) -> float:
            return float(obs.sse([int(p)], qtype)[0]) / count

        return cost

    def range(
        self, name: str, *, method: CalibrationMethod, options: ExtraOptions
    ) -> tuple[float, float]:
        """Float range ``(lo, hi)`` of tensor ``name`` by ``method``.

        The range is symmetric (``(-t, t)``) when ``options.ActivationSymmetric``. MinMax gives
        the observed extremes (their moving average with ``CalibMovingAverage``); Percentile keeps
        ``options.Percentile`` % of the values; Entropy and MSE search a threshold ``t`` on
        ``options.NumBins`` linear bins of ``|x|`` (for an asymmetric range, ``t`` is intersected
        with the observed ``[min, max]``).
        """
        if isinstance(method, PowerOfTwoMethod):
            raise CalibrationError(
                f"{method} gives power-of-two positions: use CalibrationResult.position()"
            )
        method = CalibrationMethod.coerce(method)
        symmetric = options.ActivationSymmetric
        obs = self.observer(name)
        if method is CalibrationMethod.MinMax:
            if options.CalibMovingAverage:
                if not isinstance(obs, MinMaxObserver) or obs.moving_average is None:
                    raise CalibrationError(
                        f"tensor {name!r}: CalibMovingAverage needs min/max collected with "
                        "CalibMovingAverage=True; calibrate again"
                    )
                if obs.moving_average != options.CalibMovingAverageConstant:
                    raise CalibrationError(
                        f"tensor {name!r}: the moving average was collected with constant "
                        f"{obs.moving_average}, not {options.CalibMovingAverageConstant}; "
                        "calibrate again"
                    )
                lo, hi = obs.range(moving_average=True)
            else:
                lo, hi = (obs.min, obs.max) if obs.min <= obs.max else (0.0, 0.0)
            if symmetric:
                a = max(abs(lo), abs(hi))
                return -a, a
            return float(lo), float(hi)
        if method is CalibrationMethod.Percentile:
            return self._histogram(name, "Percentile").percentile_range(
                options.Percentile, symmetric
            )
        if method in (CalibrationMethod.Entropy, CalibrationMethod.MSE):
            hist = self._histogram(name, method.name)
            if method is CalibrationMethod.Entropy:
                t = hist.entropy_threshold(options.NumBins)
            else:
                t = hist.mse_threshold(options.NumBins, signed_limits(QuantType.QInt8)[1])
            if symmetric:
                return -t, t
            if hist.min > hist.max:
                return 0.0, 0.0
            return max(hist.min, -t), min(hist.max, t)
        raise CalibrationError(
            f"calibration method {method} is not supported; use MinMax, Percentile, Entropy or "
            "MSE (or a PowerOfTwoMethod)"
        )

    # --- persistence ----------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "model_hash": self.model_hash,
            "method": self.method,
            "num_samples": self.num_samples,
            "tensors": {name: obs.to_dict() for name, obs in self.observers.items()},
        }

    def save(self, path: str | os.PathLike) -> None:
        """Write the result as JSON, atomically (a temporary file renamed into place)."""
        data = json.dumps(self.to_dict(), allow_nan=False, separators=(",", ":")).encode()
        try:
            atomic_write_bytes(path, data)
        except OSError as exc:
            raise CalibrationError(
                f"{path}: cannot write the calibration result ({exc.strerror or exc})"
            ) from exc

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "calibration result") -> CalibrationResult:
        if isinstance(d, dict) and d.get("format") == "quark_onnx.calibration/1":
            raise CalibrationError(
                f"{source}: this calibration result was saved in an older format (float bucket "
                "sums, without the statistics the exact MinMSE error needs); calibrate again"
            )
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            found = d.get("format") if isinstance(d, dict) else type(d).__name__
            raise CalibrationError(
                f"{source}: not a quark_onnx calibration result (format {found!r}, "
                f"expected {FORMAT!r})"
            )
        try:
            observers = {name: observer_from_dict(o) for name, o in d["tensors"].items()}
            return cls(d["model_hash"], d["method"], int(d["num_samples"]), observers)
        except (KeyError, TypeError, ValueError) as exc:
            raise CalibrationError(f"{source}: malformed calibration result ({exc!r})") from exc

    @classmethod
    def load(cls, path: str | os.PathLike, model: onnx.ModelProto) -> CalibrationResult:
        """Read a saved result, refusing one made for a model other than ``model``."""
        p = Path(path)
        if not p.exists():
            raise CalibrationError(f"{p}: calibration result not found")
        data = read_regular_file(
            p, limit=MAX_RESULT_BYTES, what="calibration result", error=CalibrationError
        )

        def non_finite(token: str) -> float:
            # save() writes with allow_nan=False: a NaN or infinity here was put by hand, and
            # would surface later as a range no position covers, naming no file
            raise CalibrationError(
                f"{p}: holds {token}, which a saved calibration result never does (it was "
                "edited or written by another program); calibrate again"
            )

        try:
            d = json.loads(data, parse_constant=non_finite)
        except (ValueError, RecursionError) as exc:
            # (RecursionError: nested deeper than the JSON parser's recursion limit)
            raise CalibrationError(
                f"{p}: cannot read the calibration result ({type(exc).__name__}: {str(exc)[:200]})"
            ) from exc
        result = cls.from_dict(d, str(p))
        expected = model_hash(model)
        if result.model_hash != expected:
            raise CalibrationError(
                f"{p}: this calibration result was made for another model (model hash "
                f"{result.model_hash[:12]}..., this model {expected[:12]}...); calibrate this "
                "model again, or quantize the model the result was made for"
            )
        return result
