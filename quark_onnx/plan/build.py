"""The quantization plan: what gets quantized, how, and which positions are tied together.

:func:`build_plan` walks the top-level graph once (in node order, so the plan is deterministic)
and asks the per-op :mod:`~quark_onnx.npu.policy` registry what each node needs. The result,
:class:`QuantPlan`, is plain data that names tensors and nodes only; it never runs the model;
its fields are described in :mod:`quark_onnx.plan.types`.

The strategy (:class:`~quark_onnx.config.quantization.QuantStrategy`) decides what is planned:

* static: every quantizable node's inputs and outputs;
* weight-only (``WeightsOnly``): only the weights of the linear layers (Conv, ConvTranspose, Gemm,
  MatMul with a constant B); activations and biases stay float;
* dynamic (``use_dynamic_quant``): the linear layers with a constant weight: the weights, and
  their activation inputs as dynamic (``TensorSpec.dynamic``: scale computed at run time);
  outputs and biases stay float, and so do layers whose weight is computed (attention MatMuls);
* ``Gather`` on a constant 2-D table (axis 0), for weight types of 8 bits or more: the table
  per row (axis 0) with float scales, per tensor with a power-of-two scale in XINT8.

Granularity of a linear layer's weight (``per_channel``; ``WeightBlockSize`` for groups):
per channel along the output-channel axis (Conv 0, ConvTranspose 1, Gemm 0 with ``transB=1``
else 1, MatMul the last axis of B); per group along the input-channel (reduction) axis (Conv 1,
ConvTranspose 0, Gemm 1 with ``transB=1`` else 0, MatMul the second-last axis of B). Every other
constant is per tensor.

With float8 activations, Relu and Clip outputs are not requantized (onnxruntime's
ClipQuantFusion would remove the Relu before a float8 QuantizeLinear; a Relu output lies on its
input's float8 grid anyway).

With float scales an Erf-based Gelu (``x * 0.5 * (1 + Erf(x / sqrt 2))``, in any of the usual
arrangements) is treated like the Gelu op: quantized at its input and output only, its inner nodes
float.

Mask-like tensors (:mod:`quark_onnx.plan.masks`: an additive attention mask built from a fill such
as ``finfo.min``, and the scores it is added to) are never planned, and the nodes producing them
stay float; ``saturating`` lists them with the reason.

Shape arithmetic (:mod:`quark_onnx.graph.shape_arithmetic`: integer and boolean tensors, and float
tensors that only compute shapes, such as ``Shape -> Cast(float) -> Div -> Cast(int64)`` in an
unsimplified export) is never planned, in every flow; the nodes computing only such tensors stay
float with that reason.

Graph inputs read by quantized nodes are quantized; graph outputs produced by quantized nodes get a
Q/DQ pair whose DequantizeLinear keeps the output's name.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
from collections.abc import Iterable

import onnx_ir as ir

from quark_onnx.config.enums import PowerOfTwoMethod, QuantType
from quark_onnx.config.options import ExtraOptions
from quark_onnx.config.quantization import QuantizationConfig, QuantStrategy, quant_strategy
from quark_onnx.errors import ConfigError
from quark_onnx.graph.ir import RANGE_MAX_KEY, constant_array, is_standard, single_consumer
from quark_onnx.graph.patterns import erf_gelu, is_constant
from quark_onnx.graph.shape_arithmetic import shape_values
from quark_onnx.npu.findings import node_label as checked_label
from quark_onnx.npu.ops import OpSpec as OpPolicy
from quark_onnx.npu.ops import Share
from quark_onnx.npu.placement import cpu_side_arithmetic, layer_norm_members
from quark_onnx.npu.policy import policy_for
from quark_onnx.plan.masks import find_saturating
from quark_onnx.plan.types import (
    ACTIVATION_EQUALITY_OPS,
    Equality,
    FloatNode,
    FusedPair,
    PlannedNode,
    QuantPlan,
    TensorKind,
    TensorSpec,
)

logger = logging.getLogger(__name__)

__all__ = [
    "build_plan",
    "node_label",
    "replace_options",
]


_FLOAT_TYPES = frozenset({ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16})


def node_label(node: ir.Node, index: int) -> str:
    """A node's name, or ``<op_type>_<index>`` for an unnamed node (stable for a given graph)."""
    return node.name or f"{node.op_type}_{index}"


def _is_float(value: ir.Value) -> bool:
    dtype = value.dtype
    return dtype is None or dtype in _FLOAT_TYPES


def _range_cap(value: ir.Value) -> float | None:
    text = value.metadata_props.get(RANGE_MAX_KEY)
    if text is None:
        return None
    try:
        cap = float(text)
    except ValueError:
        logger.warning(
            "tensor %r: metadata %s=%r is not a number; ignored", value.name, RANGE_MAX_KEY, text
        )
        return None
    return cap


def _is_scalar_mul(node: ir.Node, value: ir.Value) -> bool:
    """``node`` is ``Mul(value, c)`` or ``Mul(c, value)`` with ``c`` a one-element constant."""
    if node.op_type != "Mul" or node.domain not in ("", "ai.onnx") or len(node.inputs) != 2:
        return False
    other = node.inputs[1] if node.inputs[0] is value else node.inputs[0]
    if other is None or other is value or not is_constant(other):
        return False
    array = constant_array(other)
    return array is not None and array.size == 1


def _fuses(consumer: ir.Node, value: ir.Value, policy: OpPolicy, opts: ExtraOptions) -> bool:
    """``consumer`` is an activation fused into ``value``'s producer by a RemoveQDQ* option."""
    if policy.fuse_option is None or not getattr(opts, policy.fuse_option):
        return False
    if not consumer.inputs or consumer.inputs[0] is not value:
        return False
    # a Clip is fused only with constant bounds (the NPU applies it at the output shift)
    return consumer.op_type != "Clip" or all(
        v is None or is_constant(v) for v in consumer.inputs[1:]
    )


def _float_reason(
    node: ir.Node, label: str, policy: OpPolicy | None, qconfig: QuantizationConfig
) -> str | None:
    if node.domain not in ("", "ai.onnx"):
        return f"custom domain {node.domain!r}"
    if policy is None:
        return f"no quantization policy for op type {node.op_type}"
    if label in qconfig.nodes_to_exclude or (node.name and node.name in qconfig.nodes_to_exclude):
        return "excluded by nodes_to_exclude"
    if qconfig.op_types_to_quantize and node.op_type not in qconfig.op_types_to_quantize:
        return "op type not in op_types_to_quantize"
    if qconfig.nodes_to_quantize and label not in qconfig.nodes_to_quantize:
        return "not in nodes_to_quantize"
    return None


def _subgraph_nodes(graph: ir.Graph) -> Iterable[ir.Node]:
    for node in graph:
        for attr in node.attributes.values():
            if attr.type == ir.AttributeType.GRAPH:
                yield from ir.traversal.RecursiveGraphIterator(attr.value)
            elif attr.type == ir.AttributeType.GRAPHS:
                for g in attr.value:
                    yield from ir.traversal.RecursiveGraphIterator(g)


#: The policy of the last node of an Erf-based Gelu: nothing read is quantized, the output is.
_GELU_TAIL = OpPolicy(activation_inputs=())


def _weight_granularity(
    node: ir.Node, value: ir.Value, per_channel: bool, block_size: int | None
) -> tuple[int | None, int | None]:
    """(axis, block_size) of a linear layer's weight (see the module docstring)."""
    if not per_channel:
        return None, None
    if value.shape is not None and value.shape.is_static():
        rank = len(value.shape)
    else:
        array = constant_array(value)
        rank = array.ndim if array is not None else 0
    if rank < 2:
        return None, None
    op = node.op_type
    if op == "Conv":
        channel, reduce = 0, 1
    elif op == "ConvTranspose":
        channel, reduce = 1, 0
    elif op == "Gemm":
        trans_b = node.attributes.get_int("transB", 0)
        channel, reduce = (0, 1) if trans_b else (1, 0)
    elif op == "MatMul":
        channel, reduce = rank - 1, rank - 2
    else:
        return None, None
    return (reduce, block_size) if block_size else (channel, None)


def build_plan(
    model: ir.Model, qconfig: QuantizationConfig, options: ExtraOptions | None = None
) -> QuantPlan:
    """Decide, per tensor of ``model``'s top-level graph, how it is quantized.

    Args:
        model: the prepared float model (shapes inferred; DPU simulation already applied).
        qconfig: activation/weight types, node and op-type selections, ``enable_npu_cnn``,
            the strategy (``use_dynamic_quant``, extra option ``WeightsOnly``).
        options: the resolved extra options (default: ``qconfig.resolved_options()``).
    """
    planner = _Planner(model, qconfig, options)
    planner.choose_policies()
    planner.promote()
    planner.find_fused_pairs()
    for node in planner.nodes:
        planner.plan_node(node)
    return planner.result()


class _Planner:
    """The state of one :func:`build_plan` walk: the settings, then, in node order, each node's
    policy (or why it stays float), the fused pairs, and the tensors and nodes planned."""

    def __init__(
        self, model: ir.Model, qconfig: QuantizationConfig, options: ExtraOptions | None
    ) -> None:
        opts = options if options is not None else qconfig.resolved_options()
        self.qconfig = qconfig
        self.opts = opts
        self.graph = graph = model.graph
        self.power_of_two = qconfig.enable_npu_cnn or isinstance(
            qconfig.calibrate_method, PowerOfTwoMethod
        )
        self.strategy = quant_strategy(qconfig, opts)
        self.static = self.strategy is QuantStrategy.STATIC
        self.per_channel = bool(qconfig.per_channel) and not qconfig.enable_npu_cnn
        self.block_size = opts.WeightBlockSize or None
        self.bias_type = QuantType.QInt32 if opts.Int32Bias else QuantType.QInt8
        if qconfig.weight_type in (QuantType.QFloat16, QuantType.QBFloat16):
            self.bias_type = qconfig.weight_type  # Cast types: the bias is stored like the weights

        self.nodes = nodes = list(graph)
        self.labels = {id(n): node_label(n, i) for i, n in enumerate(nodes)}

        # Erf-based Gelu (float scales, static): inner nodes float, the last node quantizes its
        # output
        self.gelu_inner: set[int] = set()
        self.gelu_tail: dict[int, ir.Value] = {}
        if self.static and not self.power_of_two:
            for node in nodes:
                if is_standard(node, "Erf"):
                    match = erf_gelu(node)
                    if match is not None:
                        x, inner, tail = match
                        self.gelu_inner.update(id(n) for n in inner)
                        self.gelu_tail[id(tail)] = x

        # integer/boolean tensors and float tensors that only compute shapes: never quantized,
        # their nodes float (quark_onnx.graph.shape_arithmetic)
        self.shapes = shape_values(graph)
        # masks and other fill-dominated tensors never set a scale (quark_onnx.plan.masks)
        self.saturating = find_saturating(graph)
        self.layer_norm = layer_norm_members(graph) if self.power_of_two else set()
        self.policies: dict[int, OpPolicy] = {}
        self.float_nodes: list[FloatNode] = []
        self.fused_by_value: dict[int, FusedPair] = {}
        self.fused_act_output: dict[int, ir.Value] = {}
        self.tensors: dict[str, TensorSpec] = {}
        self.range_caps: dict[str, float] = {}
        self.bias_sources: dict[str, tuple[str | None, str]] = {}
        # float8: no QuantizeLinear right after Relu/Clip (onnxruntime's ClipQuantFusion drops
        # the Relu/Clip before a float8 QuantizeLinear, or fails, as if float8 saturated at
        # zero). Relu keeps its input's float8 grid exactly, so its output needs no
        # requantization.
        self.unquantized: set[int] = set()
        if self.static and qconfig.activation_type is QuantType.QFLOAT8E4M3FN:
            self.unquantized = {
                id(node.outputs[0])
                for node in nodes
                if (is_standard(node, "Relu") or is_standard(node, "Clip")) and node.outputs
            }
        self.planned: list[PlannedNode] = []
        self.planned_by_output: dict[int, PlannedNode] = {}
        self.equalities: list[Equality] = []
        #: activation tensors promoted (MixedPrecisionTensors): float islands on the CPU in a
        #: power-of-two plan, 16-bit activations in a float-scale one
        self.promoted: set[str] = set(opts.MixedPrecisionTensors)
        self.promoted_nodes: dict[str, tuple[str, ...]] = {}

    def _stays_float(self, node: ir.Node, policy: OpPolicy | None) -> str | None:
        """Why ``node`` stays float, or None when it is quantized."""
        if node.outputs and all(id(v) in self.shapes for v in node.outputs):
            return "shape arithmetic: its outputs are integers or only compute shapes"
        reason = _float_reason(node, self.labels[id(node)], policy, self.qconfig)
        if reason is None and node.outputs and node.outputs[0].name in self.saturating:
            why = self.saturating[node.outputs[0].name]
            reason = f"its output is mask-like ({why}); masks stay float"
        if reason is None and id(node) in self.gelu_inner:
            reason = "inside an Erf-based Gelu (quantized at its input and output)"
        if reason is None and id(node) in self.layer_norm:
            reason = "inside a LayerNorm written op by op (float, like the LayerNormalization op)"
        if reason is None and self.qconfig.enable_npu_cnn and cpu_side_arithmetic(node):
            reason = "constant arithmetic read only by CPU ops: it runs on the CPU with them"
        if reason is None and policy is not None and policy.embedding:
            reason = _embedding_float_reason(node, self.qconfig)
        if (
            reason is None
            and not self.static
            and policy is not None
            and not (policy.linear or policy.embedding)
        ):
            reason = (
                f"{self.strategy.value} quantization: only Conv/ConvTranspose/Gemm/MatMul layers "
                "and Gather tables"
            )
        if (
            reason is None
            and self.strategy is QuantStrategy.DYNAMIC
            and policy is not None
            and policy.linear
            and not _has_constant_weight(node, policy)
        ):
            # two run-time operands (attention): no integer kernel takes them, and a float
            # MatMul between run-time Q/DQ pairs is slower than the float MatMul alone
            reason = "dynamic quantization: a layer without a constant weight stays float"
        return reason

    def choose_policies(self) -> None:
        """Each node's policy, or the reason it stays float."""
        for node in self.nodes:
            if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
                continue  # data, not computation: read as weights by the nodes that use it
            policy = policy_for(node.op_type, node.domain, power_of_two=self.power_of_two)
            reason = self._stays_float(node, policy)
            if reason is None and policy is not None:
                self.policies[id(node)] = _GELU_TAIL if id(node) in self.gelu_tail else policy
            else:
                self.float_nodes.append(
                    FloatNode(self.labels[id(node)], node.op_type, reason or "")
                )
        for node in _subgraph_nodes(self.graph):
            self.float_nodes.append(
                FloatNode(node.name or node.op_type, node.op_type, "inside a subgraph")
            )

    def promote(self) -> None:
        """Apply ``MixedPrecisionTensors``: check every name against the graph, then, in a
        power-of-two plan, keep each promoted tensor's producer and readers float.

        Vitis AI's XINT8 compiler takes int8 only, so a tensor kept off the int8 grid is a float
        tensor between CPU nodes: its producer (with the layer its activation is fused into, whose
        pre-activation would otherwise stay int8) and every reader run float, and the tensors
        around the island are quantized where NPU nodes read or write them. Float-scale plans keep
        the nodes and give the tensor a 16-bit type instead (:meth:`register`)."""
        if not self.promoted:
            return
        values = {
            v.name: v
            for node in self.nodes
            for v in (*node.inputs, *node.outputs)
            if v is not None and v.name
        }
        for name in sorted(self.promoted):
            value = values.get(name)
            if value is None or not _is_float(value) or is_constant(value):
                activations = [n for n, v in values.items() if _is_float(v) and not is_constant(v)]
                close = difflib.get_close_matches(name, activations, n=3)
                hint = f"; closest: {', '.join(map(repr, close))}" if close else ""
                what = "is not a float activation" if value is not None else "is not in the graph"
                raise ConfigError(
                    f"MixedPrecisionTensors: tensor {name!r} {what} (names are those of the "
                    f"prepared model, as in the report's plan){hint}"
                )
            if value.is_graph_input() and not list(value.uses()):
                continue
            if not self.static:
                raise ConfigError(
                    f"MixedPrecisionTensors: {self.strategy.value} quantization has no static "
                    f"activation to promote ({name!r}); use a static preset (XINT8, A8W8, U8S8)"
                )
        if not self.power_of_two:
            self.promoted_nodes = {name: () for name in sorted(self.promoted)}
            return
        # a fused pair (a layer and its activation, a pool and the DPU's scale Mul) moves as one:
        # the tensor between them was never calibrated, so it cannot take a position of its own
        self.find_fused_pairs()
        by_label = {self.labels[id(n)]: n for n in self.nodes}
        partner: dict[int, ir.Node] = {}
        for pair in self.fused_by_value.values():
            producer, activation = by_label[pair.producer], by_label[pair.activation]
            partner[id(producer)], partner[id(activation)] = activation, producer
        self.fused_by_value, self.fused_act_output = {}, {}
        island: dict[int, tuple[ir.Node, str]] = {}
        for name in sorted(self.promoted):
            value = values[name]
            members: list[tuple[ir.Node, str]] = []
            producer = value.producer()
            if producer is not None:
                members.append((producer, f"writes promoted tensor {name!r}"))
            members += [(use.node, f"reads promoted tensor {name!r}") for use in value.uses()]
            members += [
                (partner[id(node)], f"fused with a node around promoted {name!r}")
                for node, _ in list(members)
                if id(node) in partner
            ]
            for node, why in members:
                if id(node) in self.policies:  # the others are float already, for their reason
                    island.setdefault(id(node), (node, why))
            # named as the readiness checker names nodes: it reads them back from the model
            self.promoted_nodes[name] = tuple(sorted({checked_label(n) for n, _ in members}))
        for node in self.nodes:
            if id(node) in island and id(node) in self.policies:
                del self.policies[id(node)]
                self.float_nodes.append(
                    FloatNode(
                        self.labels[id(node)],
                        node.op_type,
                        f"{PROMOTED_REASON}: {island[id(node)][1]} (float on the CPU)",
                    )
                )

    def find_fused_pairs(self) -> None:
        """Fused producer -> activation pairs (decided before any tensor is registered)."""
        for node in self.nodes if self.static else ():
            policy = self.policies.get(id(node))
            if policy is None or not node.outputs:
                continue
            out = node.outputs[0]
            consumer = single_consumer(out)
            if consumer is None or id(consumer) not in self.policies or not consumer.outputs:
                continue
            if self.power_of_two and policy.dpu_scale_mul and _is_scalar_mul(consumer, out):
                pass  # the hardware factor is part of the pool/HardSigmoid: no pair between them
            elif not (
                policy.fusable_producer
                and _fuses(consumer, out, self.policies[id(consumer)], self.opts)
            ):
                continue
            self.fused_by_value[id(out)] = FusedPair(
                producer=self.labels[id(node)],
                activation=self.labels[id(consumer)],
                activation_op=consumer.op_type,
                tensor=out.name or "",
                output=consumer.outputs[0].name or "",
            )
            self.fused_act_output[id(out)] = consumer.outputs[0]

    def register(
        self,
        value: ir.Value,
        kind: TensorKind,
        qtype: QuantType,
        *,
        axis: int | None = None,
        block: int | None = None,
    ) -> str | None:
        """Plan ``value`` (once; a tensor used as two kinds keeps the first); its name, or None
        when it is not quantized (not float, fused away, float8 after Relu/Clip, mask-like)."""
        name = value.name
        if not name or not _is_float(value) or id(value) in self.fused_by_value:
            return None
        if id(value) in self.shapes:
            return None
        if id(value) in self.unquantized or name in self.saturating:
            return None
        existing = self.tensors.get(name)
        if existing is not None:
            if existing.kind is not kind:
                logger.warning(
                    "tensor %r is used as %s and %s; it is quantized as %s",
                    name,
                    existing.kind.value,
                    kind.value,
                    existing.kind.value,
                )
            return name
        cap = _range_cap(value) if kind is TensorKind.ACTIVATION else None
        if cap is not None:
            self.range_caps[name] = cap
        opts, power_of_two = self.opts, self.power_of_two
        if kind is TensorKind.ACTIVATION and name in self.promoted:
            qtype = PROMOTED_TYPES.get(qtype, qtype)
        self.tensors[name] = TensorSpec(
            name=name,
            kind=kind,
            qtype=qtype,
            symmetric=(
                opts.ActivationSymmetric if kind is TensorKind.ACTIVATION else opts.WeightSymmetric
            ),
            per_channel=axis is not None
            if not power_of_two
            else self.per_channel and kind is TensorKind.WEIGHT,
            power_of_two=power_of_two,
            range_max=cap,
            is_graph_input=value.is_graph_input(),
            is_graph_output=value.is_graph_output(),
            axis=axis,
            block_size=block if axis is not None else None,
            dynamic=kind is TensorKind.ACTIVATION and self.strategy is QuantStrategy.DYNAMIC,
        )
        return name

    def _plan_inputs(
        self, node: ir.Node, policy: OpPolicy, label: str
    ) -> tuple[list[str | None], str | None, str | None]:
        """The tensor planned at each input slot of ``node``, its weight and its bias."""
        qconfig, opts, static = self.qconfig, self.opts, self.static
        slots: list[str | None] = [None] * len(node.inputs)
        weight = bias = None
        matmul_bias = (
            _matmul_bias_slot(node, self.planned_by_output)
            if static and not self.power_of_two
            else None
        )
        if id(node) in self.gelu_tail:
            self.register(self.gelu_tail[id(node)], TensorKind.ACTIVATION, qconfig.activation_type)
        for slot in policy.quantized_slots(len(node.inputs)):
            value = node.inputs[slot]
            if value is None:
                continue
            if matmul_bias is not None and slot == matmul_bias[0]:
                if opts.QuantizeBias:
                    layer = matmul_bias[1]
                    slots[slot] = bias = self.register(value, TensorKind.BIAS, self.bias_type)
                    if bias is not None and layer.weight is not None:
                        self.bias_sources[bias] = (layer.inputs[0], layer.weight)
                continue
            if slot == policy.bias_input:
                if not static or not opts.QuantizeBias:
                    continue
                if not is_constant(value) or weight is None:
                    logger.info(
                        "node %s: bias %r left float (bias and weight must both be constant)",
                        label,
                        value.name,
                    )
                    continue
                slots[slot] = bias = self.register(value, TensorKind.BIAS, self.bias_type)
                if bias is not None:
                    self.bias_sources[bias] = (slots[0] if slots else None, weight)
            elif is_constant(value):
                is_layer_weight = (policy.linear or policy.embedding) and (
                    slot == policy.weight_input
                )
                if not static and not is_layer_weight:
                    continue
                if policy.embedding:
                    axis, block = 0, None  # one scale per row of the table
                elif is_layer_weight and not self.power_of_two:
                    axis, block = _weight_granularity(
                        node, value, self.per_channel, self.block_size
                    )
                else:
                    axis, block = None, None
                slots[slot] = self.register(
                    value, TensorKind.WEIGHT, qconfig.weight_type, axis=axis, block=block
                )
                if slot == policy.weight_input:
                    weight = slots[slot]
            elif self.strategy is not QuantStrategy.WEIGHT_ONLY:
                slots[slot] = self.register(value, TensorKind.ACTIVATION, qconfig.activation_type)
        return slots, weight, bias

    def plan_node(self, node: ir.Node) -> None:
        """Plan ``node``'s inputs and output, and the position equalities it imposes."""
        policy = self.policies.get(id(node))
        if policy is None:
            return
        label = self.labels[id(node)]
        slots, weight, bias = self._plan_inputs(node, policy, label)
        output = fused_tensor = fused_op = None
        readers: tuple[str, ...] = ()
        if node.outputs:
            out = node.outputs[0]
            readers = tuple(sorted({use.node.op_type for use in out.uses()}))
            if id(out) in self.fused_by_value:
                fused_tensor = out.name
                fused_op = self.fused_by_value[id(out)].activation_op
                act_out = self.fused_act_output[id(out)]
                output = act_out.name if _is_float(act_out) else None
            elif self.static and policy.quantize_output:
                output = self.register(out, TensorKind.ACTIVATION, self.qconfig.activation_type)
        if not self.static and not any(slots):
            return  # weight-only: a layer whose weight is not a constant (attention MatMul)
        planned_node = PlannedNode(
            name=label,
            op_type=node.op_type,
            inputs=tuple(slots),
            output=output,
            weight=weight,
            bias=bias,
            fused_tensor=fused_tensor,
            fused_op=fused_op,
            readers=readers,
        )
        self.planned.append(planned_node)
        if node.outputs:
            self.planned_by_output[id(node.outputs[0])] = planned_node
        if policy.share is not Share.NONE and output is not None:
            if policy.share is Share.PASS:
                members = [slots[0]] if slots and slots[0] is not None else []
            else:
                members = [t for t in slots if t is not None]
            if members:
                self.equalities.append(
                    Equality(label, node.op_type, (*members, output), policy.align_option)
                )
        elif (
            self.power_of_two
            and node.op_type in ACTIVATION_EQUALITY_OPS
            and output is not None
            and slots
            and slots[0] is not None
            and single_consumer(node.inputs[0]) is node
        ):
            # A Q/DQ kept between a layer and its Relu/Clip (RemoveQDQConv* off): one position on
            # both sides is exact (the activation maps grid values to grid values), while a
            # position chosen for the pre-activation alone spends range on values it discards.
            self.equalities.append(Equality(label, node.op_type, (slots[0], output), None))

    def result(self) -> QuantPlan:
        plan = QuantPlan(
            tensors=self.tensors,
            nodes=self.planned,
            float_nodes=self.float_nodes,
            equalities=self.equalities,
            fused=list(self.fused_by_value.values()),
            range_caps=self.range_caps,
            options=self.opts,
            strategy=self.strategy,
            bias_sources=self.bias_sources,
            saturating=self.saturating,
            promoted=self.promoted_nodes,
        )
        for fnode in self.float_nodes:
            logger.info("node %s (%s) stays float: %s", fnode.name, fnode.op_type, fnode.reason)
        logger.debug("quantization plan: %s", plan.summary())
        return plan


#: The reason a promoted tensor's nodes stay float (what the readiness check and the report
#: recognise as a mixed-precision island).
PROMOTED_REASON = "mixed precision"

#: What a promoted activation becomes in a float-scale plan: the 16-bit type of its sign
#: (Ryzen AI's A16W8 tensors in an A8W8 model). Wider or float types stay as they are.
PROMOTED_TYPES = {QuantType.QInt8: QuantType.QInt16, QuantType.QUInt8: QuantType.QUInt16}


def _has_constant_weight(node: ir.Node, policy: OpPolicy) -> bool:
    slot = policy.weight_input
    if slot is None or slot >= len(node.inputs) or node.inputs[slot] is None:
        return False
    return is_constant(node.inputs[slot])


def _embedding_float_reason(node: ir.Node, qconfig: QuantizationConfig) -> str | None:
    """Why a Gather's table stays float, or None: it is quantized per row."""
    table = node.inputs[0] if node.inputs else None
    if table is None or not is_constant(table):
        return "Gather on a computed tensor (only constant tables are quantized)"
    if node.attributes.get_int("axis", 0) != 0:
        return "Gather along an axis other than 0 (tables are quantized per row)"
    if table.shape is None or len(table.shape) != 2:
        return "Gather table is not 2-D"
    if qconfig.weight_type in (QuantType.QInt4, QuantType.QUInt4):
        return "4-bit weight type: embedding tables stay float"
    return None


def _matmul_bias_slot(
    node: ir.Node, planned_by_output: dict[int, PlannedNode]
) -> tuple[int, PlannedNode] | None:
    """``Add(MatMul(A, W), b)`` with constant ``W`` and a constant ``b`` of ``W``'s output width,
    the MatMul output read only by this Add: (slot of ``b``, the MatMul's planned node)."""
    if not is_standard(node, "Add") or len(node.inputs) != 2:
        return None
    for slot in (0, 1):
        value, other = node.inputs[slot], node.inputs[1 - slot]
        if value is None or other is None or not is_constant(value) or is_constant(other):
            continue
        producer = other.producer()
        layer = planned_by_output.get(id(other))
        if not is_standard(producer, "MatMul") or layer is None or layer.weight is None:
            continue
        if single_consumer(other) is not node:
            continue
        weight = producer.inputs[1]
        bias = constant_array(value)
        w_shape = weight.shape if weight is not None else None
        if bias is None or w_shape is None or not w_shape.is_static() or len(w_shape) < 2:
            continue
        width = int(w_shape[-1])
        if bias.size == width and bias.shape[-1:] == (width,):
            return slot, layer
    return None


def replace_options(plan: QuantPlan, **changes: object) -> QuantPlan:
    """A copy of ``plan`` whose stored options have ``changes`` applied (for re-solving)."""
    return dataclasses.replace(plan, options=dataclasses.replace(plan.options, **changes))
