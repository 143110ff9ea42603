"""The quantization plan: what gets quantized, how, and which positions are tied together.

:func:`build_plan` walks the top-level graph once (in node order, so the plan is deterministic)
and asks the per-op :mod:`~quark_onnx.policy` registry what each node needs. The result,
:class:`QuantPlan`, is plain data that names tensors and nodes only; it never runs the model:

* ``tensors``: name -> :class:`TensorSpec` (kind activation / weight / bias, quant type,
  symmetric, per-tensor, power-of-two or float scale, optional range cap);
* ``nodes``: the quantized nodes with, per input slot, the planned tensor read there and the tensor
  whose position is the node's output position (after a fused activation);
* ``equalities``: position equalities (Concat inputs+output, pools/Pad/Slice in = out, data
  movement in = out), each with the ``Align*`` option that switches it; :meth:`QuantPlan.groups`
  merges them with a union-find;
* ``fused``: producer/activation pairs with no Q/DQ between them (``RemoveQDQConv*`` options; and
  an average pool or HardSigmoid with the hardware-factor ``Mul`` of the DPU simulation after it);
* ``float_nodes``: every node left in float and why (no policy, excluded by ``nodes_to_exclude``,
  not in ``op_types_to_quantize``/``nodes_to_quantize``, custom domain, inside a subgraph);
* ``range_caps``: tensors whose range is capped by the value metadata ``quark_onnx.range_max``
  (a decimal string written by ConvertClipToRelu on a Relu output): their position is chosen from
  ``min(range, cap)``.

Graph inputs read by quantized nodes are quantized; graph outputs produced by quantized nodes get a
Q/DQ pair whose DequantizeLinear keeps the output's name.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

import onnx_ir as ir

from quark_onnx.config import QuantizationConfig
from quark_onnx.enums import PowerOfTwoMethod, QuantType
from quark_onnx.options import ExtraOptions
from quark_onnx.passes._graph import constant_array, single_consumer
from quark_onnx.policy import OpPolicy, Share, policy_for

logger = logging.getLogger(__name__)

#: Value metadata key holding a decimal upper bound of the tensor's range.
RANGE_MAX_KEY = "quark_onnx.range_max"

_FLOAT_TYPES = frozenset({ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16})


class TensorKind(enum.Enum):
    """Role of a quantized tensor."""

    ACTIVATION = "activation"
    WEIGHT = "weight"
    BIAS = "bias"


@dataclass(frozen=True)
class TensorSpec:
    """How one tensor is quantized.

    ``power_of_two``: the scale is ``2^-p`` (XINT8); otherwise a float scale. ``per_channel`` is
    always False under ``enable_npu_cnn`` (the NPU takes one scale per tensor).
    """

    name: str
    kind: TensorKind
    qtype: QuantType
    symmetric: bool = True
    per_channel: bool = False
    power_of_two: bool = True
    range_max: float | None = None
    is_graph_input: bool = False
    is_graph_output: bool = False


@dataclass(frozen=True)
class PlannedNode:
    """A quantized node.

    ``inputs[i]`` is the planned tensor read at input slot ``i`` (None: that slot stays float).
    ``output`` is the tensor whose position is this node's output position: the node's own output,
    or the fused activation's output when the pair between them is removed (``fused_tensor``).
    ``fused_op``: the op type fused after this node (Relu/Clip/LeakyRelu/PRelu, or the ``Mul`` of
    the DPU simulation); ``next_op``: op type of the single consumer of the (fused) output, if any
    (the shift_bias rule needs to know whether a LeakyRelu follows).
    """

    name: str
    op_type: str
    inputs: tuple[str | None, ...]
    output: str | None
    weight: str | None = None
    bias: str | None = None
    fused_tensor: str | None = None
    fused_op: str | None = None
    next_op: str | None = None

    @property
    def before_leaky_relu(self) -> bool:
        """A LeakyRelu follows the output (fused into this node, or its single consumer)."""
        return "LeakyRelu" in (self.fused_op, self.next_op)

    @property
    def activation_inputs(self) -> tuple[str, ...]:
        """Planned input tensors other than the weight and bias slots."""
        return tuple(
            t for t in self.inputs if t is not None and t != self.weight and t != self.bias
        )


@dataclass(frozen=True)
class FloatNode:
    """A node left in float, with the reason."""

    name: str
    op_type: str
    reason: str


@dataclass(frozen=True)
class Equality:
    """Tensors that must share one position (switched by ``option`` when not None)."""

    node: str
    op_type: str
    tensors: tuple[str, ...]
    option: str | None


@dataclass(frozen=True)
class FusedPair:
    """``producer`` feeds ``activation`` through ``tensor``, which gets no Q/DQ pair."""

    producer: str
    activation: str
    activation_op: str
    tensor: str
    output: str


@dataclass
class QuantPlan:
    """The per-tensor quantization decisions for one model (see the module docstring)."""

    tensors: dict[str, TensorSpec]
    nodes: list[PlannedNode]
    float_nodes: list[FloatNode]
    equalities: list[Equality]
    fused: list[FusedPair]
    range_caps: dict[str, float]
    options: ExtraOptions = field(default_factory=ExtraOptions)

    def names_of(self, kind: TensorKind) -> list[str]:
        return [n for n, s in self.tensors.items() if s.kind is kind]

    def activation_names(self) -> list[str]:
        """Activation tensors to calibrate, in graph order."""
        return self.names_of(TensorKind.ACTIVATION)

    def weight_names(self) -> list[str]:
        return self.names_of(TensorKind.WEIGHT)

    def bias_names(self) -> list[str]:
        return self.names_of(TensorKind.BIAS)

    def active_equalities(self, options: ExtraOptions | None = None) -> list[Equality]:
        """Equalities whose ``Align*`` switch is on in ``options`` (default: the plan's options)."""
        opts = options or self.options
        return [e for e in self.equalities if e.option is None or getattr(opts, e.option)]

    def groups(self, options: ExtraOptions | None = None) -> list[tuple[str, ...]]:
        """Shared-position groups (size >= 2) from the active equalities, by union-find.

        Each group lists its tensors in plan order; groups are ordered by their first tensor.
        """
        order = {name: i for i, name in enumerate(self.tensors)}
        uf = UnionFind()
        for eq in self.active_equalities(options):
            for t in eq.tensors[1:]:
                uf.union(eq.tensors[0], t)
        members: dict[str, list[str]] = {}
        for name in uf.items():
            members.setdefault(uf.find(name), []).append(name)
        out = [
            tuple(sorted(m, key=lambda n: order.get(n, len(order))))
            for m in members.values()
            if len(m) > 1
        ]
        return sorted(out, key=lambda g: order.get(g[0], len(order)))

    def summary(self) -> dict[str, object]:
        """Counts for reports and logs."""
        return {
            "quantized_nodes": len(self.nodes),
            "float_nodes": len(self.float_nodes),
            "activations": len(self.activation_names()),
            "weights": len(self.weight_names()),
            "biases": len(self.bias_names()),
            "groups": len(self.groups()),
            "fused_pairs": len(self.fused),
            "range_caps": len(self.range_caps),
        }


class UnionFind:
    """Disjoint sets over strings (path halving, union by size); deterministic representatives."""

    def __init__(self) -> None:
        self._parent: dict[str, str] = {}
        self._size: dict[str, int] = {}

    def add(self, x: str) -> None:
        if x not in self._parent:
            self._parent[x] = x
            self._size[x] = 1

    def find(self, x: str) -> str:
        self.add(x)
        while self._parent[x] != x:
            self._parent[x] = self._parent[self._parent[x]]
            x = self._parent[x]
        return x

    def union(self, a: str, b: str) -> str:
        ra, rb = self.find(a), self.find(b)
        if ra == rb:
            return ra
        if self._size[ra] < self._size[rb]:
            ra, rb = rb, ra
        self._parent[rb] = ra
        self._size[ra] += self._size[rb]
        return ra

    def items(self) -> list[str]:
        return list(self._parent)


def node_label(node: ir.Node, index: int) -> str:
    """A node's name, or ``<op_type>_<index>`` for an unnamed node (stable for a given graph)."""
    return node.name or f"{node.op_type}_{index}"


def _is_float(value: ir.Value) -> bool:
    dtype = value.dtype
    return dtype is None or dtype in _FLOAT_TYPES


def _is_constant(value: ir.Value) -> bool:
    if value.const_value is not None:
        return True
    producer = value.producer()
    return (
        producer is not None
        and producer.op_type == "Constant"
        and producer.domain in ("", "ai.onnx")
    )


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
    if other is None or other is value or not _is_constant(other):
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
        v is None or _is_constant(v) for v in consumer.inputs[1:]
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


def build_plan(
    model: ir.Model, qconfig: QuantizationConfig, options: ExtraOptions | None = None
) -> QuantPlan:
    """Decide, per tensor of ``model``'s top-level graph, how it is quantized.

    Args:
        model: the prepared float model (shapes inferred; DPU simulation already applied).
        qconfig: activation/weight types, node and op-type selections, ``enable_npu_cnn``.
        options: the resolved extra options (default: ``qconfig.resolved_options()``).
    """
    opts = options if options is not None else qconfig.resolved_options()
    graph = model.graph
    power_of_two = qconfig.enable_npu_cnn or isinstance(qconfig.calibrate_method, PowerOfTwoMethod)
    per_channel = bool(qconfig.per_channel) and not qconfig.enable_npu_cnn
    bias_type = QuantType.QInt32 if opts.Int32Bias else QuantType.QInt8

    nodes = list(graph)
    labels = {id(n): node_label(n, i) for i, n in enumerate(nodes)}
    policies: dict[int, OpPolicy] = {}
    float_nodes: list[FloatNode] = []
    for node in nodes:
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
            continue  # data, not computation: read as weights by the nodes that use it
        policy = policy_for(node.op_type, node.domain)
        reason = _float_reason(node, labels[id(node)], policy, qconfig)
        if reason is None and policy is not None:
            policies[id(node)] = policy
        else:
            float_nodes.append(FloatNode(labels[id(node)], node.op_type, reason or ""))
    for node in _subgraph_nodes(graph):
        float_nodes.append(FloatNode(node.name or node.op_type, node.op_type, "inside a subgraph"))

    # fused producer -> activation pairs (decided before any tensor is registered)
    fused_by_value: dict[int, FusedPair] = {}
    fused_act_output: dict[int, ir.Value] = {}
    for node in nodes:
        policy = policies.get(id(node))
        if policy is None or not node.outputs:
            continue
        out = node.outputs[0]
        consumer = single_consumer(out)
        if consumer is None or id(consumer) not in policies or not consumer.outputs:
            continue
        if policy.dpu_scale_mul and _is_scalar_mul(consumer, out):
            pass  # the hardware factor is part of the pool/HardSigmoid: no pair between them
        elif not (policy.fusable_producer and _fuses(consumer, out, policies[id(consumer)], opts)):
            continue
        fused_by_value[id(out)] = FusedPair(
            producer=labels[id(node)],
            activation=labels[id(consumer)],
            activation_op=consumer.op_type,
            tensor=out.name or "",
            output=consumer.outputs[0].name or "",
        )
        fused_act_output[id(out)] = consumer.outputs[0]

    tensors: dict[str, TensorSpec] = {}
    range_caps: dict[str, float] = {}

    def register(value: ir.Value, kind: TensorKind, qtype: QuantType) -> str | None:
        name = value.name
        if not name or not _is_float(value) or id(value) in fused_by_value:
            return None
        existing = tensors.get(name)
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
            range_caps[name] = cap
        tensors[name] = TensorSpec(
            name=name,
            kind=kind,
            qtype=qtype,
            symmetric=(
                opts.ActivationSymmetric if kind is TensorKind.ACTIVATION else opts.WeightSymmetric
            ),
            per_channel=per_channel and kind is TensorKind.WEIGHT,
            power_of_two=power_of_two,
            range_max=cap,
            is_graph_input=value.is_graph_input(),
            is_graph_output=value.is_graph_output(),
        )
        return name

    planned: list[PlannedNode] = []
    equalities: list[Equality] = []
    for node in nodes:
        policy = policies.get(id(node))
        if policy is None:
            continue
        label = labels[id(node)]
        slots: list[str | None] = [None] * len(node.inputs)
        weight = bias = None
        for slot in policy.quantized_slots(len(node.inputs)):
            value = node.inputs[slot]
            if value is None:
                continue
            if slot == policy.bias_input:
                if not opts.QuantizeBias:
                    continue
                if not _is_constant(value) or weight is None:
                    logger.info(
                        "node %s: bias %r left float (bias and weight must both be constant)",
                        label,
                        value.name,
                    )
                    continue
                slots[slot] = bias = register(value, TensorKind.BIAS, bias_type)
            elif _is_constant(value):
                slots[slot] = register(value, TensorKind.WEIGHT, qconfig.weight_type)
                if slot == policy.weight_input:
                    weight = slots[slot]
            else:
                slots[slot] = register(value, TensorKind.ACTIVATION, qconfig.activation_type)
        output = fused_tensor = next_op = fused_op = None
        if node.outputs:
            out = node.outputs[0]
            consumer = single_consumer(out)
            next_op = consumer.op_type if consumer is not None else None
            if id(out) in fused_by_value:
                fused_tensor = out.name
                fused_op = fused_by_value[id(out)].activation_op
                act_out = fused_act_output[id(out)]
                output = act_out.name if _is_float(act_out) else None
                act_consumer = single_consumer(act_out)
                next_op = act_consumer.op_type if act_consumer is not None else None
            else:
                output = register(out, TensorKind.ACTIVATION, qconfig.activation_type)
        planned.append(
            PlannedNode(
                name=label,
                op_type=node.op_type,
                inputs=tuple(slots),
                output=output,
                weight=weight,
                bias=bias,
                fused_tensor=fused_tensor,
                fused_op=fused_op,
                next_op=next_op,
            )
        )
        if policy.share is not Share.NONE and output is not None:
            if policy.share is Share.PASS:
                members = [slots[0]] if slots and slots[0] is not None else []
            else:
                members = [t for t in slots if t is not None]
            if members:
                equalities.append(
                    Equality(label, node.op_type, (*members, output), policy.align_option)
                )

    plan = QuantPlan(
        tensors=tensors,
        nodes=planned,
        float_nodes=float_nodes,
        equalities=equalities,
        fused=list(fused_by_value.values()),
        range_caps=range_caps,
        options=opts,
    )
    for fnode in float_nodes:
        logger.info("node %s (%s) stays float: %s", fnode.name, fnode.op_type, fnode.reason)
    logger.debug("quantization plan: %s", plan.summary())
    return plan


def replace_options(plan: QuantPlan, **changes: object) -> QuantPlan:
    """A copy of ``plan`` whose stored options have ``changes`` applied (for re-solving)."""
    return dataclasses.replace(plan, options=dataclasses.replace(plan.options, **changes))
