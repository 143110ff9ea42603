"""Is a model ready for the Vitis AI / Ryzen AI NPU (XINT8)? If not, every reason why.

:func:`check` reads any ONNX model (a path or a ``ModelProto``; it is never modified) and returns a
:class:`CheckResult` holding one :class:`Finding` per problem. An empty list means "Vitis AI
ready". Each finding names the node or tensor, the values, the allowed range and the fix.

What is checked (rule ids in brackets):

* Quantization parameters of every QuantizeLinear/DequantizeLinear: the scale is a constant,
  a single value [per_axis_scale] and an exact power of two ``2**-p`` [non_pof2_scale]; the zero
  point is 0 for int8 and int32 (bias), 128 for uint8 activations [nonzero_zero_point]; the
  quantized type is int8 / uint8 (activations) or int32 (bias only) [quant_dtype].
* The NPU shift rules of :mod:`quark_onnx.npu_rules`, computed from the positions ``p`` of the
  Q/DQ scales around each node [shift_cut, shift_bias, shift_read, shift_write, mul_shift,
  hard_sigmoid, shared_scale]. Positions are read in the QDQ form quark_onnx writes:

  - input position: the DequantizeLinear producing the input, looked up through data-movement ops
    that carry their input's position (Reshape, Flatten, Transpose, Squeeze, Unsqueeze, Resize,
    Identity) and through the shared-scale single-input ops (MaxPool, AveragePool,
    GlobalAveragePool, Pad, Slice) when their output is not requantized;
  - output position: the QuantizeLinear reading the output; when there is none and the only
    consumer is an activation fused into the producer (Relu/Clip/LeakyRelu/PRelu after
    Conv/Gemm/MatMul/Add/pool), or the average-pool / HardSigmoid ``Mul`` of the DPU simulation,
    the position is read after that consumer.

  The shared-scale rule also covers the position-carrying data-movement ops when their output is
  requantized: the QDQ form keeps their input's position on the output.

  A rule whose positions cannot all be read is not evaluated (a missing Q/DQ is reported on its
  own, and a non-power-of-two scale has no position).
* Ops: op types outside the NPU's XINT8 list run on the CPU [unsupported_op]; a model without any
  Q/DQ gets one [not_quantized] finding; in a quantized model, supported float nodes with no Q/DQ
  on any side are [not_quantized] and nodes quantized on one side only are [missing_qdq].
* Model structure: symbolic/unknown dims of graph inputs [dynamic_shape]; batch > 1
  [batch_size]; Loop/If/Scan [control_flow]; fewer than two Conv nodes [too_few_conv]; Conv nodes
  missing any of kernel_shape, strides, pads, dilations, group [conv_default_attributes] (the
  Vitis AI EP aborts session creation on them; same test as ``onnxsim.check_vitisai_support``).
"""

from __future__ import annotations

import collections
import logging
import math
import os
import sys
import types
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir

from quark_onnx import npu_rules as rules
from quark_onnx.model_io import load_model, to_ir
from quark_onnx.passes._graph import constant_array, single_consumer

logger = logging.getLogger(__name__)

_STANDARD_DOMAINS = ("", "ai.onnx")
_QDQ_DOMAINS = ("", "ai.onnx", "com.microsoft")
_FLOAT_TYPES = frozenset(
    {ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16, ir.DataType.DOUBLE}
)
_CONTROL_FLOW = frozenset({"Loop", "If", "Scan"})
_CONV_ATTRIBUTES = ("kernel_shape", "strides", "pads", "dilations", "group")
#: Single-input ops whose output keeps the input's position when it is not requantized.
_PASS_THROUGH = rules.SCALE_PASSING_OPS | (rules.SHARED_SCALE_OPS - {"Concat"})
#: Producers whose output position is read after a following ``Mul`` (DPU simulation).
_MUL_FUSING = frozenset({"AveragePool", "GlobalAveragePool", "HardSigmoid"})
#: Inputs that are weights or bias: a float constant there means the op was left unquantized.
_WEIGHT_INPUTS = {
    "Conv": (1, 2),
    "ConvTranspose": (1, 2),
    "Gemm": (1, 2),
    "MatMul": (0, 1),
    "Add": (0, 1),
    "Sub": (0, 1),
    "Mul": (0, 1),
}
_BIAS_INPUT = {"Conv": 2, "ConvTranspose": 2, "Gemm": 2}
#: Fix hints for ops that fall back to the CPU.
_OP_HINTS = {
    "Split": "convert it to Slice nodes (option ConvertSplitToSlice)",
    "Sigmoid": "it runs on the CPU between the NPU parts",
    "HardSigmoid": "it runs on the CPU between the NPU parts",
    "PRelu": "a PRelu with one slope value can be replaced by LeakyRelu",
    "Gather": "fold constant-index Gathers with onnxsim; otherwise it runs on the CPU",
    "ConvTranspose": "it runs on the CPU in XINT8 (A8W8/A16W8 presets support it)",
    "LSTM": "the Vitis AI EP was measured to crash on LSTM; keep it on the CPU provider",
    "Dropout": "an inference Dropout is an identity: remove it (onnxsim does)",
    "Sum": "a two-input Sum is an Add: rewrite it as Add",
}


#: Rules that do not stop a model from compiling for the NPU: the op runs on the CPU between NPU
#: partitions (it costs speed, not correctness). Reported as warnings; every other rule is an
#: error and makes the model not ready.
ADVISORY_RULES = frozenset({"unsupported_op"})


@dataclass(frozen=True)
class Finding:
    """One reason a model is not Vitis AI-ready (or, for advisory rules, runs partly on the CPU).

    Attributes:
        rule: short id (``"shift_cut"``, ``"non_pof2_scale"``, ``"unsupported_op"`` ...).
        node: the node's name, or the tensor's name for tensor findings; None for the model.
        message: names the node/tensor, the values, the allowed range and the fix.
    """

    rule: str
    node: str | None
    message: str

    @property
    def severity(self) -> str:
        """``"warning"`` for :data:`ADVISORY_RULES`, else ``"error"``."""
        return "warning" if self.rule in ADVISORY_RULES else "error"

    def to_dict(self) -> dict[str, Any]:
        return {
            "rule": self.rule,
            "severity": self.severity,
            "node": self.node,
            "message": self.message,
        }


@dataclass
class CheckResult:
    """Every :class:`Finding` of one model; ready when none of them is an error."""

    findings: list[Finding] = field(default_factory=list)
    model: str | None = None

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "error"]

    @property
    def warnings(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "warning"]

    @property
    def ready(self) -> bool:
        return not self.errors

    def by_rule(self, rule: str) -> list[Finding]:
        """The findings of one rule id."""
        return [f for f in self.findings if f.rule == rule]

    def rules(self) -> set[str]:
        """The distinct rule ids found."""
        return {f.rule for f in self.findings}

    def summary(self) -> str:
        """``Vitis AI ready`` or ``NOT Vitis AI ready``, then one line per finding, errors first."""
        head = (
            "Vitis AI ready" if self.ready else f"NOT Vitis AI ready ({len(self.errors)} error(s))"
        )
        if self.warnings:
            head += f", {len(self.warnings)} warning(s)"
        lines = [head]
        lines += [f"  error {f.rule}: {f.message}" for f in self.errors]
        lines += [f"  warning {f.rule}: {f.message}" for f in self.warnings]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able: ``ready``, ``model``, ``counts`` per rule and the ``findings``."""
        counts = collections.Counter(f.rule for f in self.findings)
        return {
            "ready": self.ready,
            "model": self.model,
            "counts": dict(sorted(counts.items())),
            "findings": [f.to_dict() for f in self.findings],
        }


def check(model: str | os.PathLike | onnx.ModelProto) -> CheckResult:
    """List every reason ``model`` is not ready for the Vitis AI EP in XINT8 (see module doc).

    Args:
        model: a path to an ONNX file or a ``ModelProto`` (not modified).

    Raises:
        ModelLoadError: the path is not a readable, valid ONNX model.
    """
    if isinstance(model, onnx.ModelProto):
        proto, label = model, model.graph.name or "model"
    else:
        proto, label = load_model(model, upgrade_opset=False), str(model)
    try:
        proto = onnx.shape_inference.infer_shapes(proto)
    except Exception as exc:  # shape inference is only used to know tensor types
        logger.debug("%s: shape inference failed (%s); checking without inferred types", label, exc)
    graph = to_ir(proto).graph
    findings = _Checker(graph, label).run()
    logger.info("%s: %d finding(s)", label, len(findings))
    return CheckResult(findings=findings, model=label)


@dataclass(frozen=True)
class _Pos:
    """Where a position comes from: the tensor it quantizes and p (None: no power-of-two p)."""

    tensor: str
    pos: int | None


def _label(node: ir.Node) -> str:
    if node.name:
        return node.name
    out = node.outputs[0].name if node.outputs else None
    return out or f"<unnamed {node.op_type}>"


def _is_q(node: ir.Node) -> bool:
    return node.op_type == "QuantizeLinear" and node.domain in _QDQ_DOMAINS


def _is_dq(node: ir.Node) -> bool:
    return node.op_type == "DequantizeLinear" and node.domain in _QDQ_DOMAINS


def _is_constant(value: ir.Value) -> bool:
    if value.const_value is not None:
        return True
    producer = value.producer()
    return producer is not None and producer.op_type == "Constant"


def _is_floatish(value: ir.Value) -> bool:
    """Float, or of unknown type (treated as float)."""
    return value.dtype is None or value.dtype in _FLOAT_TYPES


def _clamp(value: int, bounds: tuple[int, int]) -> int:
    return min(max(value, bounds[0]), bounds[1])


def _fmt_list(values: Iterable[Any], limit: int = 8) -> str:
    items = [str(v) for v in values]
    if len(items) > limit:
        return ", ".join(items[:limit]) + f", ... ({len(items)} values)"
    return ", ".join(items)


class _Checker:
    """One pass over one graph; indices (Q/DQ parameters, positions) are built once."""

    def __init__(self, graph: ir.Graph, label: str) -> None:
        self.graph = graph
        self.label = label
        self.nodes = list(graph)
        self.findings: list[Finding] = []
        self.qdq_pos: dict[int, _Pos] = {}  # id(Q or DQ node) -> its position
        self.has_qdq = any(_is_q(n) or _is_dq(n) for n in self.nodes)

    def add(self, rule: str, node: str | None, message: str) -> None:
        self.findings.append(Finding(rule, node, message))

    def run(self) -> list[Finding]:
        self._model_level()
        self._qdq_parameters()
        self._ops()
        self._shift_rules()
        return self.findings

    # ---------------------------------------------------------------- model level
    def _model_level(self) -> None:
        if not self.has_qdq:
            computing = sum(1 for n in self.nodes if n.op_type not in ("Constant",))
            self.add(
                "not_quantized",
                None,
                f"model {self.label!r} is not quantized: it has no QuantizeLinear/"
                f"DequantizeLinear nodes, so its {computing} float nodes would run on the CPU; "
                "quantize it with the XINT8 configuration (quark_onnx.ModelQuantizer with "
                "get_default_config('XINT8'))",
            )
        for value in self.graph.inputs:
            if value.is_initializer():
                continue
            shape = value.shape
            if shape is None:
                self.add(
                    "dynamic_shape",
                    value.name,
                    f"graph input {value.name!r} has no shape; the NPU compiles static shapes "
                    "only: give the input a fixed shape (batch 1)",
                )
                continue
            dims = list(shape.dims)
            loose = [i for i, d in enumerate(dims) if not isinstance(d, int)]
            if loose:
                shown = ["?" if getattr(d, "value", d) is None else str(d) for d in dims]
                self.add(
                    "dynamic_shape",
                    value.name,
                    f"graph input {value.name!r} has shape [{', '.join(shown)}] with symbolic or "
                    f"unknown dims at axes {loose}; the NPU compiles static shapes only: "
                    f"quantize with the FixShapes option (--set FixShapes='{value.name}:[1,...]' "
                    "with batch 1, or --fix-shapes-from-calib to take the calibration data's "
                    "shape)",
                )
            if len(dims) >= 2 and isinstance(dims[0], int) and dims[0] > 1:
                self.add(
                    "batch_size",
                    value.name,
                    f"graph input {value.name!r} has batch size {dims[0]} (shape "
                    f"{[d if isinstance(d, int) else str(d) for d in dims]}); the NPU runs batch "
                    "1 only: export the model with batch 1",
                )
        conv_count = 0
        for node in ir.traversal.RecursiveGraphIterator(self.graph):
            if node.op_type in _CONTROL_FLOW and node.domain in _STANDARD_DOMAINS:
                self.add(
                    "control_flow",
                    _label(node),
                    f"{node.op_type} node {_label(node)!r}: control flow (Loop/If/Scan) is not "
                    "compiled for the NPU (an If with data-dependent shapes aborts Vitis AI EP "
                    "session creation); unroll or fold it, or split the model at that node",
                )
            if node.op_type == "Conv" and node.domain in _STANDARD_DOMAINS:
                conv_count += 1
        if conv_count < rules.MIN_CONV_NODES:
            self.add(
                "too_few_conv",
                None,
                f"model {self.label!r} has {conv_count} Conv node(s); the Vitis AI EP compiles a "
                f"model for the NPU only with at least {rules.MIN_CONV_NODES} Conv nodes "
                "(XLNX_MINIMUM_NUM_OF_CONV), otherwise everything runs on the CPU",
            )
        for node in self.nodes:
            if node.op_type != "Conv" or node.domain not in _STANDARD_DOMAINS:
                continue
            if len(node.inputs) < 2:
                continue
            missing = [a for a in _CONV_ATTRIBUTES if a not in node.attributes]
            if missing:
                self.add(
                    "conv_default_attributes",
                    _label(node),
                    f"Conv {_label(node)!r} relies on ONNX defaults for {', '.join(missing)}; the "
                    "Vitis AI EP aborts session creation on such a Conv: write all of "
                    "kernel_shape, strides, pads, dilations, group explicitly (pass "
                    "MakeConvAttributesExplicit, or onnxsim.legalize_for_vitisai)",
                )

    # ---------------------------------------------------------------- Q/DQ parameters
    def _tensor_of(self, node: ir.Node) -> str:
        """The float tensor a Q/DQ quantizes: Q's input, or the Q input before a DQ."""
        source = node.inputs[0]
        if source is None:
            return _label(node)
        if _is_dq(node):
            producer = source.producer()
            if producer is not None and _is_q(producer) and producer.inputs[0] is not None:
                return producer.inputs[0].name or source.name or _label(node)
        return source.name or _label(node)

    def _qdq_parameters(self) -> None:
        seen: dict[tuple[str | None, str | None], _Pos] = {}
        for node in self.nodes:
            if not (_is_q(node) or _is_dq(node)):
                continue
            scale = node.inputs[1] if len(node.inputs) > 1 else None
            zero_point = node.inputs[2] if len(node.inputs) > 2 else None
            key = (
                scale.name if scale is not None else None,
                zero_point.name if zero_point is not None else None,
            )
            tensor = self._tensor_of(node)
            if key in seen and key[0]:
                self.qdq_pos[id(node)] = _Pos(tensor, seen[key].pos)
                continue
            pos = self._check_scale(node, tensor, scale)
            self._check_zero_point(node, tensor, zero_point)
            seen[key] = self.qdq_pos[id(node)] = _Pos(tensor, pos)

    def _check_scale(self, node: ir.Node, tensor: str, scale: ir.Value | None) -> int | None:
        array = constant_array(scale)
        scale_name = scale.name if scale is not None else "<missing>"
        if array is None:
            self.add(
                "non_pof2_scale",
                tensor,
                f"tensor {tensor!r}: the scale {scale_name!r} of {node.op_type} "
                f"{_label(node)!r} is not a constant, so it cannot be a fixed power of two; "
                "store scales as initializers",
            )
            return None
        values = np.asarray(array, dtype=np.float64).reshape(-1)
        if values.size != 1 or "block_size" in node.attributes:
            axis = node.attributes["axis"].value if "axis" in node.attributes else 1
            self.add(
                "per_axis_scale",
                tensor,
                f"tensor {tensor!r}: {node.op_type} {_label(node)!r} has a per-axis scale "
                f"{scale_name!r} of {values.size} values (axis {axis}); the NPU takes one scale "
                "per tensor: quantize per tensor (per_channel=False)",
            )
            distinct = np.unique(values)
            if distinct.size != 1:
                return None
            values = distinct
        value = float(values[0])
        pos = rules.position_of_scale(value)
        if pos is None:
            hint = ""
            if math.isfinite(value) and value > 0:
                near = round(-math.log2(value))
                hint = f" (nearest power of two: 2^-{near} = {rules.scale_of_position(near)!r})"
            self.add(
                "non_pof2_scale",
                tensor,
                f"tensor {tensor!r}: scale {scale_name!r} = {value!r} is not an exact power of "
                f"two{hint}; XINT8 needs scales 2^-p: quantize with the XINT8 preset "
                "(power-of-two scales)",
            )
        return pos

    def _check_zero_point(self, node: ir.Node, tensor: str, zero_point: ir.Value | None) -> None:
        array = constant_array(zero_point) if zero_point is not None else None
        dtype = self._quantized_dtype(node, zero_point)
        if dtype is None:
            return
        is_weight = _is_dq(node) and node.inputs[0] is not None and _is_constant(node.inputs[0])
        if dtype == ir.DataType.INT32:
            if not self._feeds_bias(node):
                self.add(
                    "quant_dtype",
                    tensor,
                    f"tensor {tensor!r} is quantized to int32 by {_label(node)!r}; XINT8 uses "
                    "int32 only for Conv/Gemm bias: quantize it to int8",
                )
            expected = 0
        elif dtype == ir.DataType.INT8:
            expected = 0
        elif dtype == ir.DataType.UINT8 and not is_weight:
            expected = 128
        else:
            what = "weights are int8" if dtype == ir.DataType.UINT8 else "int8/uint8 only"
            self.add(
                "quant_dtype",
                tensor,
                f"tensor {tensor!r} is quantized to {dtype.name.lower()} by "
                f"{_label(node)!r}; XINT8 needs int8 (activations may be uint8 with zero point "
                f"128; {what}): use the XINT8 preset's types",
            )
            return
        if array is None:
            if zero_point is not None and not _is_constant(zero_point):
                self.add(
                    "nonzero_zero_point",
                    tensor,
                    f"tensor {tensor!r}: zero point {zero_point.name!r} of {_label(node)!r} is "
                    f"not a constant; XINT8 needs a constant {expected}",
                )
                return
            values = np.zeros(1, dtype=np.int64)  # absent zero point means 0
        else:
            values = np.asarray(array).astype(np.int64).reshape(-1)
        bad = sorted({int(v) for v in values if int(v) != expected})
        if bad:
            zp_name = zero_point.name if zero_point is not None else "<absent, i.e. 0>"
            self.add(
                "nonzero_zero_point",
                tensor,
                f"tensor {tensor!r}: zero point {zp_name!r} = {_fmt_list(bad)} "
                f"({dtype.name.lower()}); XINT8 is symmetric: zero point must be {expected} "
                f"for {dtype.name.lower()}{' (uint8 activations use 128)' if expected else ''}: "
                "quantize symmetrically (ActivationSymmetric/WeightSymmetric)",
            )

    def _quantized_dtype(self, node: ir.Node, zero_point: ir.Value | None) -> ir.DataType | None:
        if zero_point is not None and zero_point.dtype is not None:
            return zero_point.dtype
        if _is_dq(node):
            source = node.inputs[0]
            return source.dtype if source is not None else None
        if "output_dtype" in node.attributes and node.attributes["output_dtype"].value:
            return ir.DataType(node.attributes["output_dtype"].value)
        if node.outputs and node.outputs[0].dtype is not None:
            return node.outputs[0].dtype
        return ir.DataType.UINT8  # QuantizeLinear's default

    def _feeds_bias(self, node: ir.Node) -> bool:
        uses = list(node.outputs[0].uses()) if node.outputs else []
        return bool(uses) and all(_BIAS_INPUT.get(use.node.op_type) == use.idx for use in uses)

    # ---------------------------------------------------------------- positions
    def input_pos(self, value: ir.Value | None) -> _Pos | None:
        """Position of a node input: its DequantizeLinear, through position-carrying ops."""
        while value is not None:
            producer = value.producer()
            if producer is None:
                return None
            if _is_dq(producer):
                return self.qdq_pos.get(id(producer))
            if producer.op_type in _PASS_THROUGH and producer.inputs:
                value = producer.inputs[0]
                continue
            return None
        return None

    def output_pos(self, node: ir.Node, value: ir.Value | None = None) -> _Pos | None:
        """Position of a node output: its QuantizeLinear, or after a fused consumer."""
        value = value if value is not None else (node.outputs[0] if node.outputs else None)
        if value is None:
            return None
        for use in value.uses():
            if _is_q(use.node) and use.idx == 0:
                return self.qdq_pos.get(id(use.node))
        consumer = single_consumer(value)
        if consumer is None or not consumer.outputs:
            return None
        fused = (
            node.op_type in rules.FUSING_PRODUCERS and consumer.op_type in rules.FUSED_ACTIVATIONS
        ) or (node.op_type in _MUL_FUSING and consumer.op_type == "Mul")
        return self.output_pos(consumer) if fused else None

    def _fused_input(self, node: ir.Node, value: ir.Value) -> bool:
        """``value`` is the un-requantized link of a fused producer -> ``node`` pair."""
        producer = value.producer()
        if producer is None or single_consumer(value) is not node:
            return False
        return (
            node.op_type in rules.FUSED_ACTIVATIONS and producer.op_type in rules.FUSING_PRODUCERS
        ) or (node.op_type == "Mul" and producer.op_type in _MUL_FUSING)

    # ---------------------------------------------------------------- ops
    def _ops(self) -> None:
        for node in self.nodes:
            if _is_q(node) or _is_dq(node):
                continue
            label = _label(node)
            if node.domain not in _STANDARD_DOMAINS or node.op_type not in rules.XINT8_OPS:
                if self._computes_on_tensors(node):
                    op = (
                        node.op_type
                        if node.domain in _STANDARD_DOMAINS
                        else (f"{node.domain}::{node.op_type}")
                    )
                    hint = _OP_HINTS.get(node.op_type, "it runs on the CPU")
                    self.add(
                        "unsupported_op",
                        label,
                        f"{op} node {label!r}: {op} is not an XINT8 op of the NPU (Ryzen AI "
                        f"supported operators), so the graph is split there; {hint}",
                    )
                continue
            if self.has_qdq:
                self._quantization_coverage(node, label)

    def _computes_on_tensors(self, node: ir.Node) -> bool:
        values = [v for v in (*node.inputs, *node.outputs) if v is not None]
        return any(_is_floatish(v) and not _is_constant(v) for v in values)

    def _activation_inputs(self, node: ir.Node) -> list[ir.Value]:
        return [v for v in node.inputs if v is not None and _is_floatish(v) and not _is_constant(v)]

    def _quantization_coverage(self, node: ir.Node, label: str) -> None:
        if node.op_type in ("Constant", "ConstantOfShape", "Range", "Shape"):
            return
        inputs = self._activation_inputs(node)
        if not inputs:
            return
        sourced = [v for v in inputs if self.input_pos(v) is not None]
        fused = [v for v in inputs if v not in sourced and self._fused_input(node, v)]
        unsourced = [v for v in inputs if v not in sourced and v not in fused]
        float_outputs = [
            v for v in node.outputs if _is_floatish(v) and (v.is_graph_output() or list(v.uses()))
        ]
        carries = node.op_type in _PASS_THROUGH
        unquantized_out = [
            v for v in float_outputs if not carries and self.output_pos(node, v) is None
        ]
        quantized_in = bool(sourced) or (bool(fused) and self._fused_chain(node))
        quantized_out = len(unquantized_out) < len(float_outputs)
        if not quantized_in and not quantized_out:
            self.add(
                "not_quantized",
                label,
                f"{node.op_type} node {label!r} is float with no QuantizeLinear/DequantizeLinear "
                "around it, so it runs on the CPU; quantize it (check that the op is not "
                "excluded by nodes_to_exclude / op_types_to_quantize)",
            )
            return
        missing = [f"input {v.name!r}" for v in unsourced]
        missing += [f"output {v.name!r}" for v in unquantized_out]
        weights = _WEIGHT_INPUTS.get(node.op_type, ())
        for i in weights:
            value = node.inputs[i] if i < len(node.inputs) else None
            if (
                value is not None
                and _is_floatish(value)
                and _is_constant(value)
                and self.input_pos(value) is None
            ):
                missing.append(f"constant input {i} {value.name!r}")
        if missing:
            self.add(
                "missing_qdq",
                label,
                f"{node.op_type} node {label!r} is quantized on one side only: no Q/DQ on "
                f"{_fmt_list(missing)}; the NPU needs every input and output of a quantized "
                "node in int8: add the missing QuantizeLinear/DequantizeLinear",
            )

    def _fused_chain(self, node: ir.Node) -> bool:
        """A fused activation or DPU Mul whose producer side is quantized."""
        for value in node.inputs:
            if value is not None and self._fused_input(node, value):
                producer = value.producer()
                if producer is not None and any(
                    self.input_pos(v) is not None for v in producer.inputs if v is not None
                ):
                    return True
        return False

    # ---------------------------------------------------------------- shift rules
    def _shift_rules(self) -> None:
        for node in self.nodes:
            op = node.op_type
            if node.domain not in _STANDARD_DOMAINS:
                continue
            if op in rules.SHIFT_CUT_OPS:
                self._conv_rules(node)
            elif op in ("Add", "Sub"):
                self._add_rules(node)
            elif op == "Mul":
                self._mul_rule(node)
            elif op == "HardSigmoid":
                self._hard_sigmoid_rule(node)
            if op == "Concat":
                self._shared(node, [self.input_pos(v) for v in node.inputs if v is not None])
            elif (op in rules.SHARED_SCALE_OPS or op in rules.SCALE_PASSING_OPS) and node.inputs:
                self._shared(node, [self.input_pos(node.inputs[0])])

    @staticmethod
    def _known(*positions: _Pos | None) -> bool:
        return all(p is not None and p.pos is not None for p in positions)

    def _before_leaky_relu(self, node: ir.Node) -> bool:
        """The output feeds a LeakyRelu directly (fused) or through one Q/DQ pair."""
        value = node.outputs[0]
        for use in value.uses():
            consumer = use.node
            if consumer.op_type == "LeakyRelu":
                return True
            if _is_q(consumer):
                for q_use in consumer.outputs[0].uses():
                    if _is_dq(q_use.node) and any(
                        u.node.op_type == "LeakyRelu" for u in q_use.node.outputs[0].uses()
                    ):
                        return True
        return False

    def _conv_rules(self, node: ir.Node) -> None:
        if len(node.inputs) < 2:
            return
        x, w = self.input_pos(node.inputs[0]), self.input_pos(node.inputs[1])
        out = self.output_pos(node)
        if not self._known(x, w, out):
            return
        label, op = _label(node), node.op_type
        sc = rules.shift_cut(w.pos, x.pos, out.pos)
        if not rules.in_range(sc, rules.SHIFT_CUT_RANGE):
            lo, hi = rules.SHIFT_CUT_RANGE
            target = _clamp(sc, rules.SHIFT_CUT_RANGE)
            self.add(
                "shift_cut",
                label,
                f"{op} {label!r}: shift_cut = p_w + p_in - p_out = {w.pos} + {x.pos} - "
                f"{out.pos} = {sc} is outside {lo}..{hi} (weight {w.tensor!r}, input "
                f"{x.tensor!r}, output {out.tensor!r}); set the weight position to "
                f"{target + out.pos - x.pos} (or move the output position) so shift_cut = "
                f"{target}",
            )
        bias = node.inputs[2] if len(node.inputs) > 2 else None
        b = self.input_pos(bias) if bias is not None else None
        if not self._known(b):
            return
        sb = rules.shift_bias(w.pos, x.pos, b.pos)
        leaky = self._before_leaky_relu(node)
        bounds = rules.shift_bias_range(sc, leaky)
        if not rules.in_range(sb, bounds):
            target = _clamp(sb, bounds)
            self.add(
                "shift_bias",
                label,
                f"{op} {label!r}: shift_bias = p_w + p_in - p_bias = {w.pos} + {x.pos} - "
                f"{b.pos} = {sb} is outside {bounds[0]}..{bounds[1]} (shift_cut {sc}"
                f"{', before LeakyRelu' if leaky else ''}; bias {b.tensor!r}); set the bias "
                f"position to {w.pos + x.pos - target}",
            )

    def _add_rules(self, node: ir.Node) -> None:
        ins = [self.input_pos(v) for v in node.inputs if v is not None]
        if len(ins) < 2 or not self._known(*ins):
            return
        label, op = _label(node), node.op_type
        positions = [p.pos for p in ins]
        shown = ", ".join(f"{p.tensor!r}: {p.pos}" for p in ins)
        sr = rules.shift_read(positions)
        if sr > rules.SHIFT_READ_MAX:
            self.add(
                "shift_read",
                label,
                f"{op} {label!r}: shift_read = max p_in - min p_in = {max(positions)} - "
                f"{min(positions)} = {sr} > {rules.SHIFT_READ_MAX} (inputs {shown}); lower the "
                f"largest input position to {min(positions) + rules.SHIFT_READ_MAX}",
            )
        if op != "Add":
            return
        out = self.output_pos(node)
        if not self._known(out):
            return
        sw = rules.shift_write(positions, out.pos)
        if not rules.in_range(sw, rules.SHIFT_WRITE_RANGE):
            lo, hi = rules.SHIFT_WRITE_RANGE
            target = _clamp(sw, rules.SHIFT_WRITE_RANGE)
            self.add(
                "shift_write",
                label,
                f"Add {label!r}: shift_write = min p_in - p_out = {min(positions)} - {out.pos} "
                f"= {sw} is outside {lo}..{hi} (inputs {shown}; output {out.tensor!r}); set "
                f"the output position to {min(positions) - target}",
            )

    def _mul_rule(self, node: ir.Node) -> None:
        ins = [self.input_pos(v) for v in node.inputs if v is not None]
        out = self.output_pos(node)
        if not ins or not self._known(*ins, out):
            return
        label = _label(node)
        positions = [p.pos for p in ins]
        shift = rules.mul_shift(positions, out.pos)
        if not rules.in_range(shift, rules.MUL_SHIFT_RANGE):
            lo, hi = rules.MUL_SHIFT_RANGE
            target = _clamp(shift, rules.MUL_SHIFT_RANGE)
            shown = ", ".join(f"{p.tensor!r}: {p.pos}" for p in ins)
            self.add(
                "mul_shift",
                label,
                f"Mul {label!r}: sum p_in - p_out = {sum(positions)} - {out.pos} = {shift} is "
                f"outside {lo}..{hi} (inputs {shown}; output {out.tensor!r}); set the output "
                f"position to {sum(positions) - target}",
            )

    def _hard_sigmoid_rule(self, node: ir.Node) -> None:
        x = self.input_pos(node.inputs[0]) if node.inputs else None
        out = self.output_pos(node)
        if not self._known(x, out):
            return
        problems = rules.hard_sigmoid_violations(x.pos, out.pos)
        if problems:
            label = _label(node)
            lo, hi = rules.HARD_SIGMOID_INPUT_RANGE
            self.add(
                "hard_sigmoid",
                label,
                f"HardSigmoid {label!r} (input {x.tensor!r} p_in = {x.pos}, output "
                f"{out.tensor!r} p_out = {out.pos}): {'; '.join(problems)}; the NPU needs p_in "
                f"in {lo}..{hi}, p_out >= {rules.HARD_SIGMOID_OUTPUT_MIN} and 14 + p_in - p_out "
                "> 0",
            )

    def _shared(self, node: ir.Node, ins: Sequence[_Pos | None]) -> None:
        out = self.output_pos(node)
        group = [p for p in (*ins, out) if p is not None and p.pos is not None]
        if len(group) < 2 or len({p.pos for p in group}) == 1:
            return
        label = _label(node)
        shown = ", ".join(f"{p.tensor!r}: {p.pos}" for p in group)
        what = "all inputs and the output" if node.op_type == "Concat" else "input and output"
        self.add(
            "shared_scale",
            label,
            f"{node.op_type} {label!r}: {what} must share one position, found {shown}; give "
            f"them all the same position (e.g. the smallest, {min(p.pos for p in group)})",
        )


class _CallableModule(types.ModuleType):
    """``quark_onnx.check(model)`` must work even after ``import quark_onnx.check``.

    Importing the submodule makes the package attribute ``quark_onnx.check`` this module (the
    import system sets it), shadowing the lazily exported function of the same name; calling the
    module forwards to :func:`check`.
    """

    def __call__(self, model: str | os.PathLike | onnx.ModelProto) -> CheckResult:
        return check(model)


sys.modules[__name__].__class__ = _CallableModule
