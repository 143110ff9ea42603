"""Is a model ready for the Vitis AI / Ryzen AI NPU (XINT8)? If not, every reason why.

:func:`check` reads any ONNX model (a path or a ``ModelProto``; it is never modified) and returns a
:class:`CheckResult` holding one :class:`Finding` per problem. An empty list means "Vitis AI
ready". Each finding names the node or tensor, the values, the allowed range and the fix.

What is checked (rule ids in brackets):

* Quantization parameters of every QuantizeLinear/DequantizeLinear: the scale is a constant,
  a single value [per_axis_scale] and an exact power of two ``2**-p`` [non_pof2_scale]; the zero
  point is 0 for int8 and int32 (bias), 128 for uint8 activations [nonzero_zero_point]; the
  quantized type is int8 / uint8 (activations) or int32 (bias only) [quant_dtype].
* The NPU position rules of :mod:`quark_onnx.npu.rules` [shift_cut, shift_bias, shift_read,
  shift_write, mul_shift, hard_sigmoid, shared_scale]: for each node whose row in
  :mod:`quark_onnx.npu.ops` lists them, a :class:`~quark_onnx.npu.rules.Site` is built from the
  positions ``p`` of the Q/DQ scales around it and the rules evaluate it (the solver evaluates the
  same rules on its own positions). Positions are read in the QDQ form quark_onnx writes:

  - input position: the DequantizeLinear producing the input, looked up through the single-input
    ops that carry their input's position (rows with ``share`` pass, and the average pools) when
    their output is not requantized;
  - output position: the QuantizeLinear reading the output; when there is none and the only
    consumer is an activation fused into the producer (a row with ``fuse_option`` after a
    ``fusable_producer``), or the ``Mul`` of the DPU simulation after a ``dpu_scale_mul`` row,
    the position is read after that consumer. That ``Mul`` is part of its producer on the NPU:
    no ``mul_shift`` of its own.

  The shared-scale rule also covers the position-carrying data-movement ops when their output is
  requantized: the QDQ form keeps their input's position on the output.

  A rule whose positions cannot all be read is not evaluated (a missing Q/DQ is reported on its
  own, and a non-power-of-two scale has no position).
* Ops: op types whose row is not placed on the NPU run on the CPU [unsupported_op] (a
  ``Placement.FUSED`` row, PRelu, is on the NPU when fused into its producer); a model without any
  Q/DQ gets one [not_quantized] finding; in a quantized model, supported float nodes with no Q/DQ
  on any side are [not_quantized] and nodes quantized on one side only are [missing_qdq]
  (a constant in a slot the row quantizes, e.g. a weight, counts as a side). Not counted as NPU
  nodes: the CPU partition after the last NPU layer (float nodes, not layers, from which no
  QuantizeLinear is reachable: a detector's decode tail) and shape arithmetic
  (:mod:`quark_onnx.npu.placement`).
* Mixed precision: the nodes a model's promotion record names (kept float around a promoted
  tensor, :mod:`quark_onnx.npu.placement`) run on the CPU on purpose: their placement findings
  and the NPU arithmetic rules (:data:`ISLAND_RULES`) go to :attr:`CheckResult.expected`.
* Model structure: symbolic/unknown dims of graph inputs [dynamic_shape]; batch > 1
  [batch_size]; Loop/If/Scan [control_flow]; fewer than two Conv nodes [too_few_conv]; Conv nodes
  missing any of kernel_shape, strides, pads, dilations, group [conv_default_attributes] (the
  Vitis AI EP aborts session creation on them; same test as ``onnxsim.check_vitisai_support``);
  Conv kernels (depthwise included) with a side above
  :data:`~quark_onnx.npu.rules.MAX_CONV_KERNEL_SIDE` [conv_kernel_size].
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir

from quark_onnx.graph.ir import constant_array, single_consumer
from quark_onnx.graph.shape_arithmetic import shape_values
from quark_onnx.model_files.load import load_model, to_ir
from quark_onnx.npu import ops as npu_ops
from quark_onnx.npu import rules
from quark_onnx.npu.findings import CheckResult, Finding, node_label
from quark_onnx.npu.placement import (
    cpu_side_arithmetic,
    cpu_tail_nodes,
    layer_norm_members,
    read_promotions,
)
from quark_onnx.npu.rules import Pos, Site
from quark_onnx.npu.structure import model_findings

logger = logging.getLogger(__name__)

_STANDARD_DOMAINS = ("", "ai.onnx")
_QDQ_DOMAINS = ("", "ai.onnx", "com.microsoft")
_FLOAT_TYPES = frozenset(
    {ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16, ir.DataType.DOUBLE}
)


def _row(node: ir.Node) -> npu_ops.OpSpec | None:
    """The node's row in the NPU op table (read at each use: the table is the one source)."""
    return npu_ops.spec(node.op_type) if node.domain in _STANDARD_DOMAINS else None


def _carries_position(node: ir.Node) -> bool:
    row = _row(node)
    return row is not None and row.carries_position


def _fuses(producer: ir.Node, consumer: ir.Node) -> bool:
    """No Q/DQ between ``producer`` and ``consumer`` on the NPU: an activation fused into a
    fusable producer, or the DPU simulation's ``Mul`` after a ``dpu_scale_mul`` op."""
    p_row, c_row = _row(producer), _row(consumer)
    if p_row is None or c_row is None:
        return False
    return (p_row.fusable_producer and c_row.fuse_option is not None) or (
        p_row.dpu_scale_mul and consumer.op_type == "Mul"
    )


def check(
    model: str | os.PathLike | onnx.ModelProto, *, reverted_passes: Mapping[str, str] | None = None
) -> CheckResult:
    """List every reason ``model`` is not ready for the Vitis AI EP in XINT8 (see module doc).

    Args:
        model: a path to an ONNX file or a ``ModelProto`` (not modified).
        reverted_passes: the graph passes the run that wrote ``model`` measured and undid, each
            with why (:attr:`quark_onnx.pipeline.report.QuantizationReport.reverted_passes`): a
            finding whose fix is one of them says so instead of proposing it.

    Raises:
        ModelLoadError: the path is not a readable, valid ONNX model.
    """
    if isinstance(model, onnx.ModelProto):
        proto, label = model, model.graph.name or "model"
    else:
        proto, label = load_model(model, upgrade_opset=False), str(model)
    try:
        types = _inferred_types(onnx.shape_inference.infer_shapes(proto))
    except Exception as exc:  # shape inference is only used to know tensor types
        logger.debug("%s: shape inference failed (%s); checking without inferred types", label, exc)
        types = {}
    # the inferred copy is gone before the graph is built: only its element types are kept
    # (a 200,000-node model: ~250 MB less at once)
    graph = to_ir(proto).graph
    for node in ir.traversal.RecursiveGraphIterator(graph):
        for value in node.outputs:
            if value.dtype is None and value.name in types:
                value.dtype = ir.DataType(types[value.name])
    findings = _Checker(graph, label, reverted_passes or {}).run()
    # the nodes a mixed-precision model keeps float on purpose (npu.placement): intended
    islands = {n for nodes in read_promotions(proto_metadata(proto)).values() for n in nodes}
    expected = [f for f in findings if f.node in islands and f.rule in ISLAND_RULES]
    findings = [f for f in findings if not (f.node in islands and f.rule in ISLAND_RULES)]
    logger.info("%s: %d finding(s)", label, len(findings))
    return CheckResult(findings=findings, model=label, expected=expected)


#: The findings a node of a mixed-precision island has by running float on the CPU: intended when
#: the model's record names the node. Its placement (float, unquantized sides) and the NPU's
#: arithmetic rules (shifts, the HardSigmoid and shared-scale positions) do not apply to a node
#: the CPU runs; the rules on its Q/DQ tensors (power-of-two scales, zero points, types) and the
#: model's structure still do.
ISLAND_RULES = frozenset(
    {
        "not_quantized", "missing_qdq", "unsupported_op", "shift_cut", "shift_bias",
        "shift_read", "shift_write", "mul_shift", "hard_sigmoid", "shared_scale",
    }
)  # fmt: skip


def proto_metadata(proto: onnx.ModelProto) -> dict[str, str]:
    return {p.key: p.value for p in proto.metadata_props}


def _inferred_types(proto: onnx.ModelProto) -> dict[str, int]:
    """Element type of every value shape inference typed, in every graph of ``proto``."""
    types: dict[str, int] = {}
    graphs = [proto.graph]
    while graphs:
        g = graphs.pop()
        for vi in (*g.value_info, *g.output):
            if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type:
                types[vi.name] = vi.type.tensor_type.elem_type
        for node in g.node:
            for attr in node.attribute:
                graphs.extend([attr.g] if attr.type == onnx.AttributeProto.GRAPH else attr.graphs)
    return types


@dataclass(frozen=True)
class _Pos:
    """Where a position comes from: the tensor it quantizes and p (None: no power-of-two p)."""

    tensor: str
    pos: int | None


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


def _fmt_list(values: Iterable[Any], limit: int = 8) -> str:
    items = [str(v) for v in values]
    if len(items) > limit:
        return ", ".join(items[:limit]) + f", ... ({len(items)} values)"
    return ", ".join(items)


class _Checker:
    """One pass over one graph; indices (Q/DQ parameters, positions) are built once."""

    def __init__(self, graph: ir.Graph, label: str, reverted_passes: Mapping[str, str]) -> None:
        self.graph = graph
        self.label = label
        self.reverted_passes = reverted_passes
        self.nodes = list(graph)
        self.findings: list[Finding] = []
        self.qdq_pos: dict[int, _Pos] = {}  # id(Q or DQ node) -> its position
        self.has_qdq = any(_is_q(n) or _is_dq(n) for n in self.nodes)
        self.layer_norm = layer_norm_members(graph)  # checked as one LayerNormalization
        self.cpu_side = {id(n) for n in self.nodes if cpu_side_arithmetic(n)}  # npu.placement
        # the CPU partition after the last NPU layer, and shape arithmetic (npu.placement)
        self.cpu_tail = cpu_tail_nodes(graph)
        self.shapes = shape_values(graph)

    def add(
        self,
        rule: str,
        node: str | None,
        message: str,
        op_type: str | None = None,
        detail: str | None = None,
    ) -> None:
        self.findings.append(Finding(rule, node, message, op_type, detail))

    def run(self) -> list[Finding]:
        self.findings += model_findings(self.graph, self.label, self.nodes, self.has_qdq)
        self._qdq_parameters()
        self._ops()
        self._shift_rules()
        return self.findings

    # ---------------------------------------------------------------- model level
    # ---------------------------------------------------------------- Q/DQ parameters
    def _tensor_of(self, node: ir.Node) -> str:
        """The float tensor a Q/DQ quantizes: Q's input, or the Q input before a DQ."""
        source = node.inputs[0]
        if source is None:
            return node_label(node)
        if _is_dq(node):
            producer = source.producer()
            if producer is not None and _is_q(producer) and producer.inputs[0] is not None:
                return producer.inputs[0].name or source.name or node_label(node)
        return source.name or node_label(node)

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
                f"{node_label(node)!r} is not a constant, so it cannot be a fixed power of two; "
                "store scales as initializers",
            )
            return None
        values = np.asarray(array, dtype=np.float64).reshape(-1)
        if values.size != 1 or "block_size" in node.attributes:
            axis = node.attributes["axis"].value if "axis" in node.attributes else 1
            self.add(
                "per_axis_scale",
                tensor,
                f"tensor {tensor!r}: {node.op_type} {node_label(node)!r} has a per-axis scale "
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
                    f"tensor {tensor!r} is quantized to int32 by {node_label(node)!r}; XINT8 uses "
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
                f"{node_label(node)!r}; XINT8 needs int8 (activations may be uint8 with zero point "
                f"128; {what}): use the XINT8 preset's types",
            )
            return
        if array is None:
            if zero_point is not None and not _is_constant(zero_point):
                self.add(
                    "nonzero_zero_point",
                    tensor,
                    f"tensor {tensor!r}: zero point {zero_point.name!r} of {node_label(node)!r} is "
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
        return bool(uses) and all(
            (row := _row(use.node)) is not None and row.bias_input == use.idx for use in uses
        )

    # ---------------------------------------------------------------- positions
    def input_pos(self, value: ir.Value | None) -> _Pos | None:
        """Position of a node input: its DequantizeLinear, through position-carrying ops."""
        while value is not None:
            producer = value.producer()
            if producer is None:
                return None
            if _is_dq(producer):
                return self.qdq_pos.get(id(producer))
            if _carries_position(producer) and producer.inputs:
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
        return self.output_pos(consumer) if _fuses(node, consumer) else None

    def _fused_input(self, node: ir.Node, value: ir.Value) -> bool:
        """``value`` is the un-requantized link of a fused producer -> ``node`` pair."""
        producer = value.producer()
        if producer is None or single_consumer(value) is not node:
            return False
        return _fuses(producer, node)

    # ---------------------------------------------------------------- ops
    def _ops(self) -> None:
        for node in self.nodes:
            # a decomposed LayerNorm is one LayerNormalization: float inside, its input's and
            # output's Q/DQ are its neighbours' (npu.placement)
            if _is_q(node) or _is_dq(node) or id(node) in self.layer_norm:
                continue
            if id(node) in self.cpu_tail:
                continue  # the CPU partition after the last NPU layer (npu.placement)
            label = node_label(node)
            if not self._on_npu(node):
                # constant arithmetic on the CPU side: its readers' findings name the split
                if self._computes_on_tensors(node) and id(node) not in self.cpu_side:
                    op = (
                        node.op_type
                        if node.domain in _STANDARD_DOMAINS
                        else (f"{node.domain}::{node.op_type}")
                    )
                    detail = (
                        f"{op} is not an XINT8 op of the NPU (Ryzen AI supported operators), so "
                        f"the graph is split there; {self._cpu_hint(node)}"
                    )
                    self.add("unsupported_op", label, f"{op} node {label!r}: {detail}", op, detail)
                continue
            if node.outputs and all(id(v) in self.shapes for v in node.outputs):
                continue  # shape arithmetic: never quantized
            if self.has_qdq:
                self._quantization_coverage(node, label)

    def _cpu_hint(self, node: ir.Node) -> str:
        """What to do about a node on the CPU; not the pass its row proposes when the run
        measured that pass and undid it."""
        row = _row(node)
        fix = row.cpu_fix_pass if row else None
        if fix is not None and fix in self.reverted_passes:
            return (
                f"it stays on the CPU: {fix} was measured on this model and undone "
                f"({self.reverted_passes[fix]})"
            )
        return (row.cpu_hint if row else None) or npu_ops.DEFAULT_CPU_HINT

    def _on_npu(self, node: ir.Node) -> bool:
        """The op's row places it on the NPU (a FUSED row: when fused into its producer), unless
        it is float constant arithmetic read only by CPU ops (:mod:`quark_onnx.npu.placement`)."""
        row = _row(node)
        if row is None or row.placement is npu_ops.Placement.CPU:
            return False
        if row.placement is npu_ops.Placement.FUSED:
            return self._fused_chain(node)
        return id(node) not in self.cpu_side

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
        carries = _carries_position(node)
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
                node.op_type,
                "float with no QuantizeLinear/DequantizeLinear around them, so they run on the "
                "CPU; quantize them (check that the op is not excluded by nodes_to_exclude / "
                "op_types_to_quantize)",
            )
            return
        missing = [f"input {v.name!r}" for v in unsourced]
        missing += [f"output {v.name!r}" for v in unquantized_out]
        row = _row(node)
        xint8 = row is not None and row.quantized and not row.float_scale_only
        weights = row.quantized_slots(len(node.inputs)) if xint8 else ()
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

    # ---------------------------------------------------------------- position rules
    def _shift_rules(self) -> None:
        for node in self.nodes:
            row = _row(node)
            if row is None:
                continue
            if row.shift_rules:
                site = self._site(node, row)
                if site is not None:
                    for violation in rules.evaluate(site):
                        self.add(violation.rule, violation.node, violation.message)
            if row.share is not npu_ops.Share.NONE and node.inputs:
                members = node.inputs if row.activation_inputs is None else node.inputs[:1]
                self._shared(node, [self.input_pos(v) for v in members if v is not None])

    @staticmethod
    def _known(position: _Pos | None) -> Pos | None:
        if position is None or position.pos is None:
            return None
        return Pos(position.tensor, position.pos)

    def _site(self, node: ir.Node, row: npu_ops.OpSpec) -> Site | None:
        """The positions around ``node`` by role; None when an input position cannot be read."""
        if "shift_cut" in row.shift_rules:  # a layer: data input, weight, bias
            if len(node.inputs) < 2:
                return None
            bias = node.inputs[2] if len(node.inputs) > 2 else None
            x = self._known(self.input_pos(node.inputs[0]))
            if x is None:
                return None
            return Site(
                node=node_label(node),
                op_type=node.op_type,
                inputs=(x,),
                output=self._known(self.output_pos(node)),
                weight=self._known(self.input_pos(node.inputs[1])),
                bias=self._known(self.input_pos(bias)) if bias is not None else None,
                before_leaky_relu=self._before_leaky_relu(node),
            )
        values = [v for v in node.inputs if v is not None]
        if any(self._fused_input(node, v) for v in values):
            return None  # the DPU Mul after a pool/HardSigmoid: part of its producer
        ins = [self._known(self.input_pos(v)) for v in values]
        if not ins or any(p is None for p in ins):
            return None
        return Site(
            node=node_label(node),
            op_type=node.op_type,
            inputs=tuple(p for p in ins if p is not None),
            output=self._known(self.output_pos(node)),
        )

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

    def _shared(self, node: ir.Node, ins: Sequence[_Pos | None]) -> None:
        known = [self._known(p) for p in ins]
        out = self._known(self.output_pos(node))
        group = [p for p in known if p is not None]
        site = Site(node_label(node), node.op_type, inputs=tuple(group), output=out)
        violation = rules.RULES["shared_scale"].evaluate(site)
        if violation is not None:
            self.add(violation.rule, violation.node, violation.message)
