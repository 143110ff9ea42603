"""The quantization plan: what gets quantized, how, and which positions are tied together.

:func:`build_plan` walks the top-level graph once (in node order, so the plan is deterministic)
and asks the per-op :mod:`~quark_onnx.policy` registry what each node needs. The result,
:class:`QuantPlan`, is plain data that names tensors and nodes only; it never runs the model:

* ``tensors``: name -> :class:`TensorSpec` (kind activation / weight / bias, quant type,
  symmetric, per-tensor, power-of-two or float scale, optional range cap);
* ``nodes``: the quantized nodes with, per input slot, the planned tensor read there and the tensor
  whose position is the node's output position (after a fused activation);
* ``equalities``: position equalities (Concat inputs+output, pools/Pad/Slice in = out, data
  movement in = out), each with the ``Align*`` option that switches it, and, for power-of-two
  plans, a Relu/Clip with a Q/DQ kept before it in = out (:data:`ACTIVATION_EQUALITY_OPS`);
  :meth:`QuantPlan.groups` merges them with a union-find;
* ``fused``: producer/activation pairs with no Q/DQ between them (``RemoveQDQConv*`` options; and
  an average pool or HardSigmoid with the hardware-factor ``Mul`` of the DPU simulation after it);
* ``float_nodes``: every node left in float and why (no policy, excluded by ``nodes_to_exclude``,
  not in ``op_types_to_quantize``/``nodes_to_quantize``, custom domain, inside a subgraph);
* ``range_caps``: tensors whose range is capped by the value metadata ``quark_onnx.range_max``
  (a decimal string written by ConvertClipToRelu on a Relu output): their position is chosen from
  ``min(range, cap)``;
* ``bias_sources``: bias -> (input activation, weight) of its layer, for a bias quantized at
  ``s_in * s_w`` (Conv/ConvTranspose/Gemm input 2; the constant of an ``Add`` right after a
  ``MatMul`` with a constant weight, float scales only).

The strategy (:class:`~quark_onnx.config.QuantStrategy`) decides what is planned:

* static: every quantizable node's inputs and outputs (as above);
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

Mask-like tensors (:mod:`quark_onnx.masks`: an additive attention mask built from a fill such as
``finfo.min``, and the scores it is added to) are never planned, and the nodes producing them stay
float; ``saturating`` lists them with the reason.

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

from quark_onnx.config import QuantizationConfig, QuantStrategy, quant_strategy
from quark_onnx.enums import PowerOfTwoMethod, QuantType
from quark_onnx.masks import find_saturating
from quark_onnx.options import ExtraOptions
from quark_onnx.passes._graph import constant_array, is_standard, single_consumer
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
    always False under ``enable_npu_cnn`` (the NPU takes one scale per tensor). ``axis`` and
    ``block_size`` give a weight's granularity as in :class:`~quark_onnx.qparams.QuantParams`
    (per channel: ``axis``; per group: ``axis`` is the blocked axis and ``block_size`` is set).
    ``dynamic``: an activation whose scale is computed at run time.
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
    axis: int | None = None
    block_size: int | None = None
    dynamic: bool = False


@dataclass(frozen=True)
class PlannedNode:
    """A quantized node.

    ``inputs[i]`` is the planned tensor read at input slot ``i`` (None: that slot stays float).
    ``output`` is the tensor whose position is this node's output position: the node's own output,
    or the fused activation's output when the pair between them is removed (``fused_tensor``).
    ``fused_op``: the op type fused after this node (Relu/Clip/LeakyRelu/PRelu, or the ``Mul`` of
    the DPU simulation); ``readers``: the op types reading the node's own output (the shift_bias
    rule needs to know whether a LeakyRelu reads it, fused or not, as the DPU compiler does).
    """

    name: str
    op_type: str
    inputs: tuple[str | None, ...]
    output: str | None
    weight: str | None = None
    bias: str | None = None
    fused_tensor: str | None = None
    fused_op: str | None = None
    readers: tuple[str, ...] = ()

    @property
    def before_leaky_relu(self) -> bool:
        """A LeakyRelu reads the node's own output (fused into it or not; not after a fused
        Relu: the constraint is on the layer whose output the LeakyRelu takes)."""
        return "LeakyRelu" in self.readers

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


#: Activations whose input (when quantized and read by them only) takes their output's position:
#: ``Relu`` and ``Clip`` map values on a power-of-two grid to values on the same grid, so sharing
#: the output's position adds no error, and the pre-activation's values that the activation
#: discards (negatives, values above the bound) do not widen its range. The output's statistics
#: choose the shared position (:func:`quark_onnx.quantizer` drops the input's error curve).
ACTIVATION_EQUALITY_OPS = frozenset({"Relu", "Clip"})


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
    strategy: QuantStrategy = QuantStrategy.STATIC
    bias_sources: dict[str, tuple[str | None, str]] = field(default_factory=dict)
    #: mask-like tensor -> why (:mod:`quark_onnx.masks`): never quantized, producers float
    saturating: dict[str, str] = field(default_factory=dict)

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
            "strategy": self.strategy.value,
            "quantized_nodes": len(self.nodes),
            "float_nodes": len(self.float_nodes),
            "activations": len(self.activation_names()),
            "weights": len(self.weight_names()),
            "biases": len(self.bias_names()),
            "groups": len(self.groups()),
            "fused_pairs": len(self.fused),
            "range_caps": len(self.range_caps),
            "mask_like": len(self.saturating),
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


_SQRT2 = 1.4142135623730951
#: The policy of the last node of an Erf-based Gelu: nothing read is quantized, the output is.
_GELU_TAIL = OpPolicy(activation_inputs=())


def _scalar(value: ir.Value | None) -> float | None:
    """The value of a one-element constant, else None."""
    if value is None or not _is_constant(value):
        return None
    array = constant_array(value)
    if array is None or array.size != 1 or array.dtype.kind != "f":
        return None
    return float(array.reshape(()))


def _close(value: float | None, target: float) -> bool:
    return value is not None and abs(value - target) <= 1e-3 * abs(target)


def _other(node: ir.Node, value: ir.Value) -> ir.Value | None:
    """The other input of a two-input node that reads ``value``."""
    if len(node.inputs) != 2:
        return None
    if node.inputs[0] is value:
        return node.inputs[1]
    return node.inputs[0] if node.inputs[1] is value else None


def _erf_gelu(erf: ir.Node) -> tuple[ir.Value, list[ir.Node], ir.Node] | None:
    """Match ``x * 0.5 * (1 + Erf(x / sqrt 2))`` around ``erf``: (x, inner nodes, last node).

    Accepted arrangements: the Erf input is ``Div(x, sqrt 2)`` or ``Mul(x, 1/sqrt 2)``; then
    ``Add(., 1)``; then ``Mul(x, .)`` followed by ``Mul(., 0.5)``, or ``Mul(Mul(x, 0.5), .)``,
    or ``Mul(., 0.5)`` followed by ``Mul(x, .)``. Every intermediate has a single consumer.
    """
    if not erf.inputs or erf.inputs[0] is None or not erf.outputs:
        return None
    scaled = erf.inputs[0].producer()
    if scaled is None or len(scaled.inputs) != 2 or single_consumer(scaled.outputs[0]) is not erf:
        return None
    x = scaled.inputs[0]
    if x is None:
        return None
    c = _scalar(scaled.inputs[1])
    if not (
        (is_standard(scaled, "Div") and _close(c, _SQRT2))
        or (is_standard(scaled, "Mul") and _close(c, 1 / _SQRT2))
    ):
        return None
    add = single_consumer(erf.outputs[0])
    if not is_standard(add, "Add") or not _close(_scalar(_other(add, erf.outputs[0])), 1.0):
        return None
    m1 = single_consumer(add.outputs[0])
    if not is_standard(m1, "Mul"):
        return None
    t = _other(m1, add.outputs[0])
    if t is None:
        return None
    inner = [scaled, erf, add]
    if t is x:  # Mul(x, 1 + erf) then Mul(., 0.5)
        m2 = single_consumer(m1.outputs[0])
        if not is_standard(m2, "Mul") or not _close(_scalar(_other(m2, m1.outputs[0])), 0.5):
            return None
        return x, [*inner, m1], m2
    if _close(_scalar(t), 0.5):  # Mul(1 + erf, 0.5) then Mul(x, .)
        m2 = single_consumer(m1.outputs[0])
        if not is_standard(m2, "Mul") or _other(m2, m1.outputs[0]) is not x:
            return None
        return x, [*inner, m1], m2
    half = t.producer()  # Mul(Mul(x, 0.5), 1 + erf)
    if (
        is_standard(half, "Mul")
        and _other(half, x) is not None
        and _close(_scalar(_other(half, x)), 0.5)
        and single_consumer(t) is m1
    ):
        return x, [*inner, half], m1
    return None


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
    opts = options if options is not None else qconfig.resolved_options()
    graph = model.graph
    power_of_two = qconfig.enable_npu_cnn or isinstance(qconfig.calibrate_method, PowerOfTwoMethod)
    strategy = quant_strategy(qconfig, opts)
    static = strategy is QuantStrategy.STATIC
    per_channel = bool(qconfig.per_channel) and not qconfig.enable_npu_cnn
    block_size = opts.WeightBlockSize or None
    bias_type = QuantType.QInt32 if opts.Int32Bias else QuantType.QInt8
    if qconfig.weight_type in (QuantType.QFloat16, QuantType.QBFloat16):
        bias_type = qconfig.weight_type  # Cast types: the bias is stored like the weights

    nodes = list(graph)
    labels = {id(n): node_label(n, i) for i, n in enumerate(nodes)}

    # Erf-based Gelu (float scales, static): inner nodes float, the last node quantizes its output
    gelu_inner: set[int] = set()
    gelu_tail: dict[int, ir.Value] = {}
    if static and not power_of_two:
        for node in nodes:
            if is_standard(node, "Erf"):
                match = _erf_gelu(node)
                if match is not None:
                    x, inner, tail = match
                    gelu_inner.update(id(n) for n in inner)
                    gelu_tail[id(tail)] = x

    # masks and other fill-dominated tensors never set a scale (quark_onnx.masks)
    saturating = find_saturating(graph)

    policies: dict[int, OpPolicy] = {}
    float_nodes: list[FloatNode] = []
    for node in nodes:
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
            continue  # data, not computation: read as weights by the nodes that use it
        policy = policy_for(node.op_type, node.domain, power_of_two=power_of_two)
        reason = _float_reason(node, labels[id(node)], policy, qconfig)
        if reason is None and node.outputs and node.outputs[0].name in saturating:
            why = saturating[node.outputs[0].name]
            reason = f"its output is mask-like ({why}); masks stay float"
        if reason is None and id(node) in gelu_inner:
            reason = "inside an Erf-based Gelu (quantized at its input and output)"
        if reason is None and policy is not None and policy.embedding:
            reason = _embedding_float_reason(node, qconfig)
        if (
            reason is None
            and not static
            and policy is not None
            and not (policy.linear or policy.embedding)
        ):
            reason = (
                f"{strategy.value} quantization: only Conv/ConvTranspose/Gemm/MatMul layers "
                "and Gather tables"
            )
        if (
            reason is None
            and strategy is QuantStrategy.DYNAMIC
            and policy is not None
            and policy.linear
            and not _has_constant_weight(node, policy)
        ):
            # two run-time operands (attention): no integer kernel takes them, and a float
            # MatMul between run-time Q/DQ pairs is slower than the float MatMul alone
            reason = "dynamic quantization: a layer without a constant weight stays float"
        if reason is None and policy is not None:
            policies[id(node)] = _GELU_TAIL if id(node) in gelu_tail else policy
        else:
            float_nodes.append(FloatNode(labels[id(node)], node.op_type, reason or ""))
    for node in _subgraph_nodes(graph):
        float_nodes.append(FloatNode(node.name or node.op_type, node.op_type, "inside a subgraph"))

    # fused producer -> activation pairs (decided before any tensor is registered)
    fused_by_value: dict[int, FusedPair] = {}
    fused_act_output: dict[int, ir.Value] = {}
    for node in nodes if static else ():
        policy = policies.get(id(node))
        if policy is None or not node.outputs:
            continue
        out = node.outputs[0]
        consumer = single_consumer(out)
        if consumer is None or id(consumer) not in policies or not consumer.outputs:
            continue
        if power_of_two and policy.dpu_scale_mul and _is_scalar_mul(consumer, out):
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
    bias_sources: dict[str, tuple[str | None, str]] = {}
    # float8: no QuantizeLinear right after Relu/Clip (onnxruntime's ClipQuantFusion drops the
    # Relu/Clip before a float8 QuantizeLinear, or fails, as if float8 saturated at zero). Relu
    # keeps its input's float8 grid exactly, so its output needs no requantization.
    unquantized: set[int] = set()
    if static and qconfig.activation_type is QuantType.QFLOAT8E4M3FN:
        unquantized = {
            id(node.outputs[0])
            for node in nodes
            if (is_standard(node, "Relu") or is_standard(node, "Clip")) and node.outputs
        }

    def register(
        value: ir.Value,
        kind: TensorKind,
        qtype: QuantType,
        *,
        axis: int | None = None,
        block: int | None = None,
    ) -> str | None:
        name = value.name
        if not name or not _is_float(value) or id(value) in fused_by_value:
            return None
        if id(value) in unquantized or name in saturating:
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
            per_channel=axis is not None
            if not power_of_two
            else per_channel and kind is TensorKind.WEIGHT,
            power_of_two=power_of_two,
            range_max=cap,
            is_graph_input=value.is_graph_input(),
            is_graph_output=value.is_graph_output(),
            axis=axis,
            block_size=block if axis is not None else None,
            dynamic=kind is TensorKind.ACTIVATION and strategy is QuantStrategy.DYNAMIC,
        )
        return name

    planned: list[PlannedNode] = []
    planned_by_output: dict[int, PlannedNode] = {}
    equalities: list[Equality] = []
    for node in nodes:
        policy = policies.get(id(node))
        if policy is None:
            continue
        label = labels[id(node)]
        slots: list[str | None] = [None] * len(node.inputs)
        weight = bias = None
        matmul_bias = (
            _matmul_bias_slot(node, planned_by_output) if static and not power_of_two else None
        )
        if id(node) in gelu_tail:
            register(gelu_tail[id(node)], TensorKind.ACTIVATION, qconfig.activation_type)
        for slot in policy.quantized_slots(len(node.inputs)):
            value = node.inputs[slot]
            if value is None:
                continue
            if matmul_bias is not None and slot == matmul_bias[0]:
                if opts.QuantizeBias:
                    layer = matmul_bias[1]
                    slots[slot] = bias = register(value, TensorKind.BIAS, bias_type)
                    if bias is not None and layer.weight is not None:
                        bias_sources[bias] = (layer.inputs[0], layer.weight)
                continue
            if slot == policy.bias_input:
                if not static or not opts.QuantizeBias:
                    continue
                if not _is_constant(value) or weight is None:
                    logger.info(
                        "node %s: bias %r left float (bias and weight must both be constant)",
                        label,
                        value.name,
                    )
                    continue
                slots[slot] = bias = register(value, TensorKind.BIAS, bias_type)
                if bias is not None:
                    bias_sources[bias] = (slots[0] if slots else None, weight)
            elif _is_constant(value):
                is_layer_weight = (policy.linear or policy.embedding) and (
                    slot == policy.weight_input
                )
                if not static and not is_layer_weight:
                    continue
                if policy.embedding:
                    axis, block = 0, None  # one scale per row of the table
                elif is_layer_weight and not power_of_two:
                    axis, block = _weight_granularity(node, value, per_channel, block_size)
                else:
                    axis, block = None, None
                slots[slot] = register(
                    value, TensorKind.WEIGHT, qconfig.weight_type, axis=axis, block=block
                )
                if slot == policy.weight_input:
                    weight = slots[slot]
            elif strategy is not QuantStrategy.WEIGHT_ONLY:
                slots[slot] = register(value, TensorKind.ACTIVATION, qconfig.activation_type)
        output = fused_tensor = fused_op = None
        readers: tuple[str, ...] = ()
        if node.outputs:
            out = node.outputs[0]
            readers = tuple(sorted({use.node.op_type for use in out.uses()}))
            if id(out) in fused_by_value:
                fused_tensor = out.name
                fused_op = fused_by_value[id(out)].activation_op
                act_out = fused_act_output[id(out)]
                output = act_out.name if _is_float(act_out) else None
            elif static and policy.quantize_output:
                output = register(out, TensorKind.ACTIVATION, qconfig.activation_type)
        if not static and not any(slots):
            continue  # weight-only: a layer whose weight is not a constant (attention MatMul)
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
        planned.append(planned_node)
        if node.outputs:
            planned_by_output[id(node.outputs[0])] = planned_node
        if policy.share is not Share.NONE and output is not None:
            if policy.share is Share.PASS:
                members = [slots[0]] if slots and slots[0] is not None else []
            else:
                members = [t for t in slots if t is not None]
            if members:
                equalities.append(
                    Equality(label, node.op_type, (*members, output), policy.align_option)
                )
        elif (
            power_of_two
            and node.op_type in ACTIVATION_EQUALITY_OPS
            and output is not None
            and slots
            and slots[0] is not None
            and single_consumer(node.inputs[0]) is node
        ):
            # A Q/DQ kept between a layer and its Relu/Clip (RemoveQDQConv* off): one position on
            # both sides is exact (the activation maps grid values to grid values), while a
            # position chosen for the pre-activation alone spends range on values it discards.
            equalities.append(Equality(label, node.op_type, (slots[0], output), None))

    plan = QuantPlan(
        tensors=tensors,
        nodes=planned,
        float_nodes=float_nodes,
        equalities=equalities,
        fused=list(fused_by_value.values()),
        range_caps=range_caps,
        options=opts,
        strategy=strategy,
        bias_sources=bias_sources,
        saturating=saturating,
    )
    for fnode in float_nodes:
        logger.info("node %s (%s) stays float: %s", fnode.name, fnode.op_type, fnode.reason)
    logger.debug("quantization plan: %s", plan.summary())
    return plan


def _has_constant_weight(node: ir.Node, policy: OpPolicy) -> bool:
    slot = policy.weight_input
    if slot is None or slot >= len(node.inputs) or node.inputs[slot] is None:
        return False
    return _is_constant(node.inputs[slot])


def _embedding_float_reason(node: ir.Node, qconfig: QuantizationConfig) -> str | None:
    """Why a Gather's table stays float, or None: it is quantized per row."""
    table = node.inputs[0] if node.inputs else None
    if table is None or not _is_constant(table):
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
        if value is None or other is None or not _is_constant(value) or _is_constant(other):
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
