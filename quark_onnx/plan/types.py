"""The quantization plan's data (:func:`quark_onnx.plan.build.build_plan` decides it): per tensor a
:class:`TensorSpec`, the quantized nodes, the nodes left float and why, the position equalities
and fused pairs, gathered in :class:`QuantPlan`. Plain data naming tensors and nodes only:

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
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from quark_onnx.config.enums import QuantType
from quark_onnx.config.options import ExtraOptions
from quark_onnx.config.quantization import QuantStrategy

__all__ = [
    "ACTIVATION_EQUALITY_OPS",
    "Equality",
    "FloatNode",
    "FusedPair",
    "PlannedNode",
    "QuantPlan",
    "TensorKind",
    "TensorSpec",
    "UnionFind",
]


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
    ``block_size`` give a weight's granularity as in :class:`~quark_onnx.params.qparams.QuantParams`
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
#: choose the shared position (:func:`quark_onnx.pipeline.quantizer` drops the input's error curve).
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
    #: mask-like tensor -> why (:mod:`quark_onnx.plan.masks`): never quantized, producers float
    saturating: dict[str, str] = field(default_factory=dict)
    #: promoted activation (``MixedPrecisionTensors``) -> the nodes kept float around it in a
    #: power-of-two plan (empty in a float-scale plan, where the tensor takes 16 bits instead)
    promoted: dict[str, tuple[str, ...]] = field(default_factory=dict)

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
