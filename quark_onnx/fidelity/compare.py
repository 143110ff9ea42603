"""Float model vs quantized model on data: per-output and per-layer error, top-1 agreement.

:func:`compare_models` runs both models on the same feeds and accumulates, in constant memory
(float64 running sums, nothing kept per sample), for every compared tensor pair ``f`` (float) and
``q`` (quantized)::

    SQNR   = 10 * log10( sum(f^2) / sum((f - q)^2) )          [dB; +inf when q == f exactly,
                                                              -inf when f == 0 but q != 0]
    cosine = sum(f * q) / sqrt(sum(f^2) * sum(q^2))           [1 when both are all zeros,
                                                              0 when only one is]
    max_abs_error = max |f - q|

The sums run over every element of every sample, so the SQNR is the ratio of total signal energy
to total noise energy (not a mean of per-sample ratios).

Agreement (graph outputs only), chosen by the output's shape ``[N, d1, d2, ...]``:

* a *score vector* (one axis after the batch axis with more than one element: ``[N, C]``,
  ``[N, C, 1, 1]``; a rank-1 output is one row): the **top-1 agreement**, the fraction of rows
  whose ``argmax`` is the same in both models (ties: the first index, numpy's rule);
* a *dense* output (rank >= 4 with at least two channels on axis 1 and more than one position:
  ``[N, C, H, W]``, segmentation maps): the **argmax agreement**, the fraction of positions
  ``(n, h, w)`` whose ``argmax`` over the channel axis 1 is the same in both models;
* anything else (boxes ``[N, 8400, 85]``, embeddings, one value per row): none (``None``); SQNR
  and cosine still describe it.

SQNR with infinite or NaN values: an infinite noise energy (an output went to infinity in one
model only) gives ``-inf`` dB; NaN anywhere gives NaN (written ``"nan"`` in JSON).

Which tensors are compared (the QDQ form of ``notes/qdq_format.md``):

* graph outputs, matched by name (the quantized model keeps the float output names); when the
  names differ and both models have as many outputs, they are matched by position;
* per layer: every activation ``DequantizeLinear`` of the quantized model, i.e. one whose input is
  produced by a ``QuantizeLinear``. Its float counterpart is the ``QuantizeLinear``'s input ``T``
  (``T_QuantizeLinear_Input`` for a graph output is read as ``T``), looked up by name among the
  float model's graph inputs and node outputs. A quantized tensor without a float counterpart
  (renamed by a preparation pass) or with another shape is listed in
  :attr:`ComparisonResult.unmatched` and not compared. Weights and biases (DequantizeLinear of a
  constant) are not compared: preparation passes such as BatchNormalization folding change them,
  so their float counterparts are not the quantized tensors' references.

Feeds: each feed is a ``{input name: array}`` mapping given to both models. When a model declares
a fixed first dimension smaller than the feed's (a quantized model with its batch fixed to 1), the
feed is split into chunks of that size along axis 0.

Both sessions run on the CPU provider; the quantized model's with graph optimisations disabled, so
its arithmetic is the QDQ float simulation of the ONNX specification (no kernel fusion), the float
model's with them enabled (faster; fusions change its outputs by float rounding only).
"""

from __future__ import annotations

import logging
import math
import os
import tempfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from quark_onnx.errors import CalibrationError, ModelLoadError, QuarkOnnxError
from quark_onnx.model_files.files import private_temp_folder

logger = logging.getLogger(__name__)

_PROTOBUF_LIMIT = 2**31 - 1
_Q_INPUT_SUFFIX = "_QuantizeLinear_Input"
_DQ_OUTPUT_SUFFIX = "_DequantizeLinear_Output"


# ------------------------------------------------------------------------------------------------
# Results
# ------------------------------------------------------------------------------------------------


def json_float(value: float) -> float | str:
    """JSON has no infinities or NaN: written as the strings ``"inf"``, ``"-inf"``, ``"nan"``."""
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return value


@dataclass(frozen=True)
class TensorComparison:
    """The error of one quantized tensor against its float counterpart, over all samples.

    Attributes:
        name: the float tensor's name.
        quantized_name: the quantized model's tensor compared with it (a DequantizeLinear
            output, or the graph output of the same name).
        sqnr_db: signal-to-quantization-noise ratio in dB (see the module docstring).
        cosine: cosine similarity of the flattened tensors.
        max_abs_error: largest absolute difference.
        elements: number of elements compared (all samples).
        top1_agreement: score-vector graph outputs only: the fraction of rows with equal argmax
            (None for other outputs and for intermediate tensors).
        rows: rows (top-1) or positions (argmax over channels) the agreement was computed over.
        argmax_agreement: dense graph outputs only (``[N, C, H, W]``): the fraction of positions
            whose argmax over the channel axis is equal.
    """

    name: str
    quantized_name: str
    sqnr_db: float
    cosine: float
    max_abs_error: float
    elements: int
    top1_agreement: float | None = None
    rows: int = 0
    argmax_agreement: float | None = None

    @property
    def agreement(self) -> float | None:
        """The agreement that fits the output: top-1 or argmax over channels (None: neither)."""
        return self.top1_agreement if self.top1_agreement is not None else self.argmax_agreement

    @property
    def agreement_kind(self) -> str | None:
        """``"top1"``, ``"argmax"`` or None (see :attr:`agreement`)."""
        if self.top1_agreement is not None:
            return "top1"
        return "argmax" if self.argmax_agreement is not None else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "quantized_name": self.quantized_name,
            "sqnr_db": json_float(self.sqnr_db),
            "cosine": self.cosine,
            "max_abs_error": self.max_abs_error,
            "elements": self.elements,
            "top1_agreement": self.top1_agreement,
            "argmax_agreement": self.argmax_agreement,
            "rows": self.rows,
        }


@dataclass
class ComparisonResult:
    """What :func:`compare_models` measured.

    Attributes:
        samples: feeds run through both models (after splitting to the models' batch size).
        outputs: one entry per graph output, in the float model's output order.
        layers: one entry per compared activation tensor, worst SQNR first (ties by name).
        unmatched: quantized activation tensors that could not be compared, with the reason.
    """

    samples: int
    outputs: list[TensorComparison] = field(default_factory=list)
    layers: list[TensorComparison] = field(default_factory=list)
    unmatched: list[str] = field(default_factory=list)

    @property
    def top1_agreement(self) -> float | None:
        """Top-1 agreement of the first output that has one (None if none has)."""
        for out in self.outputs:
            if out.top1_agreement is not None:
                return out.top1_agreement
        return None

    @property
    def argmax_agreement(self) -> float | None:
        """Argmax-over-channels agreement of the first dense output (None if none is dense)."""
        for out in self.outputs:
            if out.argmax_agreement is not None:
                return out.argmax_agreement
        return None

    def to_dict(self) -> dict[str, Any]:
        """JSON-able (infinite SQNRs as ``"inf"``/``"-inf"``)."""
        return {
            "samples": self.samples,
            "top1_agreement": self.top1_agreement,
            "argmax_agreement": self.argmax_agreement,
            "outputs": [o.to_dict() for o in self.outputs],
            "layers": [t.to_dict() for t in self.layers],
            "unmatched": list(self.unmatched),
        }

    def summary(self, worst: int = 10) -> str:
        """Human-readable lines: every output, then the ``worst`` layers (lowest SQNR)."""
        lines = [f"compared on {self.samples} sample(s)"]
        for out in self.outputs:
            top1 = ""
            if out.top1_agreement is not None:
                top1 = f", top-1 agreement {out.top1_agreement:.4f} ({out.rows} rows)"
            elif out.argmax_agreement is not None:
                top1 = (
                    f", argmax-over-channels agreement {out.argmax_agreement:.4f} "
                    f"({out.rows} positions)"
                )
            lines.append(
                f"output {out.name}: SQNR {out.sqnr_db:.2f} dB, cosine {out.cosine:.6f}, "
                f"max |error| {out.max_abs_error:.4g}{top1}"
            )
        if self.layers:
            shown = self.layers[:worst] if worst > 0 else self.layers
            lines.append(
                f"per-layer SQNR, worst {len(shown)} of {len(self.layers)} quantized tensors:"
            )
            width = max(len(t.name) for t in shown)
            for t in shown:
                lines.append(
                    f"  {t.name:<{width}}  {t.sqnr_db:8.2f} dB  cosine {t.cosine:.6f}  "
                    f"max |error| {t.max_abs_error:.4g}"
                )
        if self.unmatched:
            lines.append(f"not compared: {len(self.unmatched)} quantized tensor(s)")
        return "\n".join(lines)


def sqnr_db(signal: float, noise: float) -> float:
    """``10 log10(signal / noise)`` for energies that may be 0, infinite or NaN (never raises):
    +inf for no noise, -inf for no signal or an infinite noise, NaN when either is NaN or both
    are infinite."""
    if math.isnan(signal) or math.isnan(noise) or (math.isinf(signal) and math.isinf(noise)):
        return math.nan
    if noise == 0.0:
        return math.inf
    if signal == 0.0 or math.isinf(noise):
        return -math.inf
    ratio = signal / noise
    if ratio == 0.0:  # underflow
        return -math.inf
    return 10.0 * math.log10(ratio)


def agreement_kind(shape: Sequence[int]) -> str | None:
    """``"top1"`` for a score vector, ``"argmax"`` for a dense ``[N, C, H, W, ...]`` output,
    None otherwise (see the module docstring)."""
    if len(shape) <= 1:
        return "top1" if int(np.prod(shape)) >= 2 else None
    inner = [d for d in shape[1:] if d != 1]
    if len(inner) == 1:
        return "top1"
    if len(shape) >= 4 and shape[1] >= 2 and int(np.prod(shape[2:])) >= 2:
        return "argmax"
    return None


def ordered(array: np.ndarray) -> np.ndarray:
    """``array`` as values whose argmax and maximum are those of its float64 copy: a float
    array as it is (the cast to float64 is exact and keeps the order), any other converted."""
    array = np.asarray(array)
    return array if array.dtype.kind == "f" else array.astype(np.float64)


class ErrorAccumulator:
    """Running float64 sums of one tensor pair (constant memory)."""

    def __init__(self) -> None:
        self.signal = 0.0
        self.noise = 0.0
        self.dot = 0.0
        self.qenergy = 0.0
        self.max_abs = 0.0
        self.elements = 0
        self.agree = 0
        self.rows = 0
        self.kind: str | None = None

    def update(self, f: np.ndarray, q: np.ndarray, top1: bool) -> None:
        """Add one sample; ``top1``: a graph output, whose agreement (if any) is counted.

        Every float64 product is written into one buffer of the sample's size: the sums are
        those of ``np.sum(f64 * f64)`` etc. bit for bit (the same values, the same contiguous
        layout, so the same pairwise summation), without a float64 copy of ``f``, of ``q``
        and of their difference beside it (a 1x16x1000x1000 output: 128 MB instead of 512)."""
        f, q = np.asarray(f), np.asarray(q)
        buf = np.empty_like(f, dtype=np.float64)
        self.signal += float(np.sum(np.multiply(f, f, out=buf, dtype=np.float64)))
        self.dot += float(np.sum(np.multiply(f, q, out=buf, dtype=np.float64)))
        self.qenergy += float(np.sum(np.multiply(q, q, out=buf, dtype=np.float64)))
        diff = np.subtract(f, q, out=buf, dtype=np.float64)
        # |d| * |d| is d * d exactly: the absolute values serve the maximum and the noise
        np.abs(diff, out=diff)
        if diff.size:
            self.max_abs = max(self.max_abs, float(np.max(diff)))
        self.noise += float(np.sum(np.multiply(diff, diff, out=diff)))
        del buf, diff
        self.elements += int(f.size)
        kind = agreement_kind(f.shape) if top1 else None
        if kind is None:
            return
        f, q = ordered(f), ordered(q)
        if kind == "top1":
            rows = f.shape[0] if f.ndim >= 2 else 1
            fa = np.argmax(f.reshape(rows, -1), axis=1)
            qa = np.argmax(q.reshape(rows, -1), axis=1)
        else:
            fa = np.argmax(f, axis=1)
            qa = np.argmax(q, axis=1)
        self.kind = kind
        self.agree += int(np.sum(fa == qa))
        self.rows += int(fa.size)

    def result(self, name: str, quantized_name: str) -> TensorComparison:
        sqnr = sqnr_db(self.signal, self.noise)
        denom = math.sqrt(self.signal * self.qenergy)
        # An all-zero tensor is similar only to another all-zero tensor.
        cosine = 1.0 if self.signal == self.qenergy else 0.0
        if denom > 0.0:
            cosine = self.dot / denom
        return TensorComparison(
            name=name,
            quantized_name=quantized_name,
            sqnr_db=sqnr,
            cosine=cosine,
            max_abs_error=self.max_abs,
            elements=self.elements,
            top1_agreement=self.agree / self.rows if self.kind == "top1" and self.rows else None,
            argmax_agreement=(
                self.agree / self.rows if self.kind == "argmax" and self.rows else None
            ),
            rows=self.rows,
        )


# ------------------------------------------------------------------------------------------------
# Matching
# ------------------------------------------------------------------------------------------------


def match_quantized_tensors(
    float_model: onnx.ModelProto, quant_model: onnx.ModelProto
) -> tuple[dict[str, str], list[str]]:
    """Pair the quantized model's activation DequantizeLinear outputs with float tensor names.

    Returns:
        ``{quantized tensor: float tensor}`` in the quantized graph's node order, and the
        quantized tensors without a float counterpart (``"name: reason"``).
    """
    float_names = {i.name for i in float_model.graph.input}
    for node in float_model.graph.node:
        float_names.update(o for o in node.output if o)
    producers = {o: n for n in quant_model.graph.node for o in n.output if o}
    pairs: dict[str, str] = {}
    unmatched: list[str] = []
    for node in quant_model.graph.node:
        if node.op_type != "DequantizeLinear" or not node.input or not node.output:
            continue
        producer = producers.get(node.input[0])
        if producer is None or producer.op_type != "QuantizeLinear" or not producer.input:
            continue  # a weight or bias (constant input): not compared
        out = node.output[0]
        source = producer.input[0]
        candidates = [source]
        if source.endswith(_Q_INPUT_SUFFIX):
            candidates.append(source[: -len(_Q_INPUT_SUFFIX)])
        if out.endswith(_DQ_OUTPUT_SUFFIX):
            candidates.append(out[: -len(_DQ_OUTPUT_SUFFIX)])
        candidates.append(out)
        found = next((c for c in candidates if c in float_names), None)
        if found is None:
            unmatched.append(f"{out}: no float tensor named {candidates[0]!r}")
        elif out not in pairs:
            pairs[out] = found
    return pairs, unmatched


def _output_pairs(
    float_model: onnx.ModelProto, quant_model: onnx.ModelProto
) -> list[tuple[str, str]]:
    f_outs = [o.name for o in float_model.graph.output]
    q_outs = [o.name for o in quant_model.graph.output]
    if set(f_outs) <= set(q_outs):
        return [(n, n) for n in f_outs]
    if len(f_outs) == len(q_outs):
        logger.info("output names differ; outputs are matched by position")
        return list(zip(f_outs, q_outs, strict=True))
    missing = sorted(set(f_outs) - set(q_outs))
    raise QuarkOnnxError(
        f"the quantized model has no outputs named {missing} and {len(q_outs)} output(s) where "
        f"the float model has {len(f_outs)}: these are not the same network"
    )


# ------------------------------------------------------------------------------------------------
# Sessions
# ------------------------------------------------------------------------------------------------


def _as_proto(model: str | os.PathLike | onnx.ModelProto) -> onnx.ModelProto:
    if isinstance(model, onnx.ModelProto):
        return model
    from quark_onnx.model_files.load import load_model

    return load_model(model, upgrade_opset=False)


def _elem_types(model: onnx.ModelProto) -> dict[str, int]:
    try:
        inferred = (
            onnx.shape_inference.infer_shapes(model)
            if model.ByteSize() < _PROTOBUF_LIMIT
            else model
        )
    except Exception as exc:  # only used to type the extra outputs
        logger.debug("shape inference failed (%s); extra outputs typed float", exc)
        inferred = model
    g = inferred.graph
    types: dict[str, int] = {}
    for vi in list(g.input) + list(g.value_info) + list(g.output):
        if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type:
            types[vi.name] = vi.type.tensor_type.elem_type
    return types


class _Session:
    """One onnxruntime session over a copy of ``model`` that also returns ``extra`` tensors."""

    def __init__(
        self, model: onnx.ModelProto, extra: Sequence[str], label: str, optimize: bool = False
    ) -> None:
        from quark_onnx.runtime import sessions

        copy = onnx.ModelProto()
        copy.CopyFrom(model)
        existing = {o.name for o in copy.graph.output}
        types = _elem_types(model) if extra else {}
        for name in extra:
            if name not in existing:
                elem = types.get(name, onnx.TensorProto.FLOAT)
                copy.graph.output.append(onnx.helper.make_tensor_value_info(name, elem, None))
        self.names = [o.name for o in copy.graph.output]
        self.label = label
        # The quantized model unoptimised: its arithmetic is then the QDQ simulation of the ONNX
        # specification (no int8 kernel fusion). The float model optimised: fusions move its
        # outputs by float rounding only, and it runs 2-3x faster (MobileNetV2).
        # No arena: an arena keeps the buffers of its largest run until the session ends, and the
        # two sessions live together, so large activations (512x896 maps) would be held twice
        # (benchmarks/results/segmenter_memory.txt).
        so = sessions.session_options(optimize="all" if optimize else "none", arena=False)
        self._tmp: tempfile.TemporaryDirectory | None = None
        try:
            if copy.ByteSize() < _PROTOBUF_LIMIT:
                self.session = sessions.create_session(copy, so, purpose="compare")
            else:
                self._tmp = private_temp_folder("compare")
                path = Path(self._tmp.name) / "model.onnx"
                onnx.save_model(
                    copy, str(path), save_as_external_data=True, location="model.onnx.data"
                )
                self.session = sessions.create_session(path, so, purpose="compare")
        except Exception as exc:
            self.close()
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise ModelLoadError(f"{label}: onnxruntime cannot load the model: {first}") from exc
        self.inputs = {i.name: i.shape for i in self.session.get_inputs()}

    def fixed_batch(self) -> int | None:
        """The smallest fixed first dimension among the inputs (None: all dynamic)."""
        sizes = [s[0] for s in self.inputs.values() if s and isinstance(s[0], int) and s[0] > 0]
        return min(sizes) if sizes else None

    def run(self, feed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        try:
            values = self.session.run(None, {k: feed[k] for k in self.inputs})
        except KeyError as exc:
            raise CalibrationError(
                f"{self.label}: the feed has no input {exc.args[0]!r} "
                f"(feed: {sorted(feed)}; model inputs: {sorted(self.inputs)})"
            ) from None
        except Exception as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise CalibrationError(f"{self.label}: onnxruntime failed on a feed: {first}") from exc
        return dict(zip(self.names, values, strict=True))

    def close(self) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


def _split(feed: Mapping[str, np.ndarray], batch: int | None) -> Iterator[dict[str, np.ndarray]]:
    arrays = {k: np.asarray(v) for k, v in feed.items()}
    rows = {v.shape[0] for v in arrays.values() if v.ndim}
    if batch is None or len(rows) != 1:
        yield arrays
        return
    (n,) = rows
    if n <= batch:
        yield arrays
        return
    for start in range(0, n, batch):
        yield {k: (v[start : start + batch] if v.ndim else v) for k, v in arrays.items()}


# ------------------------------------------------------------------------------------------------
# The comparison
# ------------------------------------------------------------------------------------------------


def compare_models(
    float_model: str | os.PathLike | onnx.ModelProto,
    quant_model: str | os.PathLike | onnx.ModelProto,
    feeds: Iterable[Mapping[str, np.ndarray]],
    *,
    layers: bool = True,
) -> ComparisonResult:
    """Run both models on ``feeds`` and measure how far the quantized one is from the float one.

    Args:
        float_model: the float model (path or ``ModelProto``; not modified).
        quant_model: its quantized version in the QDQ form (path or ``ModelProto``).
        feeds: ``{input name: array}`` mappings (any iterable, read once: a generator of samples
            or a calibration reader wrapped in ``iter(reader.get_next, None)``).
        layers: also compare every quantized activation tensor (per-layer SQNR, worst first).

    Returns:
        A :class:`ComparisonResult` (metrics defined in the module docstring).

    Raises:
        ModelLoadError: a model cannot be read or loaded by onnxruntime.
        CalibrationError: a feed does not fit the models, or there are no feeds.
        QuarkOnnxError: the two models' outputs do not correspond.
    """
    fproto = _as_proto(float_model)
    qproto = _as_proto(quant_model)
    flabel = str(float_model) if not isinstance(float_model, onnx.ModelProto) else "float model"
    qlabel = str(quant_model) if not isinstance(quant_model, onnx.ModelProto) else "quantized model"
    outputs = _output_pairs(fproto, qproto)
    pairs, unmatched = match_quantized_tensors(fproto, qproto) if layers else ({}, [])
    float_inputs = {i.name for i in fproto.graph.input}
    float_extra = sorted({f for f in pairs.values() if f not in float_inputs})
    fsession = _Session(fproto, float_extra, flabel, optimize=True)
    try:
        qsession = _Session(qproto, list(pairs), qlabel)
    except BaseException:
        fsession.close()
        raise
    try:
        batch = min(
            (b for b in (fsession.fixed_batch(), qsession.fixed_batch()) if b), default=None
        )
        out_acc = {pair: ErrorAccumulator() for pair in outputs}
        layer_acc = {q: ErrorAccumulator() for q in pairs}
        skipped: dict[str, str] = {}
        samples = 0
        for feed in feeds:
            for chunk in _split(feed, batch):
                fvals = fsession.run(chunk)
                qvals = qsession.run(chunk)
                samples += 1
                for (fname, qname), acc in out_acc.items():
                    fv, qv = fvals[fname], qvals[qname]
                    if fv.shape != qv.shape:
                        raise QuarkOnnxError(
                            f"output {fname!r}: shape {fv.shape} in the float model but "
                            f"{qv.shape} in the quantized model ({qname!r})"
                        )
                    acc.update(fv, qv, top1=True)
                for qname, acc in layer_acc.items():
                    if qname in skipped:
                        continue
                    fname = pairs[qname]
                    fv = chunk[fname] if fname in float_inputs else fvals[fname]
                    qv = qvals[qname]
                    if fv.shape != qv.shape:
                        skipped[qname] = (
                            f"{qname}: shape {qv.shape} differs from float {fname!r} {fv.shape}"
                        )
                        continue
                    acc.update(fv, qv, top1=False)
        if samples == 0:
            raise CalibrationError("compare_models: no feeds were given (the data is empty)")
    finally:
        fsession.close()
        qsession.close()
    result_outputs = [acc.result(f, q) for (f, q), acc in out_acc.items()]
    result_layers = [acc.result(pairs[q], q) for q, acc in layer_acc.items() if q not in skipped]
    result_layers.sort(key=lambda t: (t.sqnr_db, t.name))
    return ComparisonResult(
        samples=samples,
        outputs=result_outputs,
        layers=result_layers,
        unmatched=unmatched + list(skipped.values()),
    )
