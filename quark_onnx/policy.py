"""Per-op quantization policy: one registry entry per ONNX op type (adding an op is one entry).

An :class:`OpPolicy` says, for one op type:

* ``activation_inputs``: the input slots quantized with a Q/DQ pair (``None``: every input). A slot
  whose value is a constant (initializer or ``Constant`` output) is quantized as a *weight*
  instead (int8, per tensor, own position), e.g. the constant operand of ``Add``/``Mul``.
* ``weight_input``: the slot holding the layer weight (Conv/ConvTranspose/Gemm ``W``/``B``,
  PRelu slope). Quantized as a weight when constant, as an activation otherwise.
* ``bias_input``: the slot holding the bias (Conv/ConvTranspose input 2, Gemm ``C``).
* ``share``: how positions relate across the node:

  - :attr:`Share.NONE`: the output has its own position;
  - :attr:`Share.PASS`: the output keeps input 0's position (pure data movement: MaxPool,
    Reshape, Flatten, Transpose, Squeeze, Unsqueeze, Slice, Pad, Resize);
  - :attr:`Share.ALL`: every quantized input and the output share one position (Concat;
    average pools, whose in = out rule is an NPU requirement).

* ``align_option``: the :class:`~quark_onnx.options.ExtraOptions` flag that switches the shared
  position (``AlignConcat``, ``AlignPool``, ``AlignPad``, ``AlignSlice``). ``None`` with
  ``Share.PASS``: always shared (reshaping never changes values).
* ``fusable_producer``: a Conv/Gemm/MatMul/Add/pool whose single-consumer output may feed a fused
  activation (no Q/DQ between them).
* ``fuse_option``: on Relu/Clip/LeakyRelu/PRelu, the ``RemoveQDQConv*`` option that fuses it into
  a fusable producer.
* ``dpu_scale_mul``: an average pool or HardSigmoid whose output feeds only a ``Mul`` by a scalar
  constant (the hardware factor written by the DPU simulation passes): the Mul is part of the op
  on the NPU, so no Q/DQ sits between them (the output position is read after the Mul); the
  factor itself is quantized like any constant Mul operand (an int8 weight with its own position).
* ``linear``: a layer whose ``weight_input`` is a kernel or matrix (Conv, ConvTranspose, Gemm,
  MatMul). Weight-only and dynamic quantization quantize exactly these layers; per-channel and
  per-group scales apply to their weights only (other constants are per tensor).
* ``embedding``: a lookup whose ``weight_input`` is a constant table (``Gather`` data, slot 0):
  the table is quantized per row (axis 0, one scale per row, so a rare token's small row keeps
  its precision) in every float-scale strategy, static, dynamic and weight-only, when the weight
  type has 8 bits or more (4-bit tables stay float); the indices are never quantized and the
  output is not requantized (it is exactly a dequantized row).
* ``quantize_output``: the static flow quantizes the node's output (False: ``Gather``).
* ``float_scale_only``: planned only with float scales (A8W8, A16W8, FP8, ... presets). The
  power-of-two (XINT8) flow leaves these ops float, as it always has: they are transformer ops
  (Div, LayerNormalization, Gelu) that the NPU's XINT8 CNN flow does not take.

Ops without an entry stay float (the plan reports them).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType


class Share(enum.Enum):
    """How a node's output position relates to its inputs' positions."""

    NONE = "none"
    PASS = "pass"
    ALL = "all"


@dataclass(frozen=True)
class OpPolicy:
    """How one op type is quantized (see the module docstring)."""

    activation_inputs: tuple[int, ...] | None = (0,)
    weight_input: int | None = None
    bias_input: int | None = None
    share: Share = Share.NONE
    align_option: str | None = None
    fusable_producer: bool = False
    fuse_option: str | None = None
    dpu_scale_mul: bool = False
    linear: bool = False
    embedding: bool = False
    quantize_output: bool = True
    float_scale_only: bool = False

    @property
    def passes_scale(self) -> bool:
        """The output carries input 0's position through (data movement)."""
        return self.share is Share.PASS

    @property
    def requires_shared_scale(self) -> bool:
        """Inputs/output must share one position (an NPU rule switched by ``align_option``)."""
        return self.align_option is not None

    def quantized_slots(self, num_inputs: int) -> list[int]:
        """Input slots (activation, weight and bias) this policy quantizes, in slot order."""
        slots = (
            list(range(num_inputs))
            if self.activation_inputs is None
            else [i for i in self.activation_inputs if i < num_inputs]
        )
        for extra in (self.weight_input, self.bias_input):
            if extra is not None and extra < num_inputs and extra not in slots:
                slots.append(extra)
        return sorted(slots)


_LAYER = OpPolicy(
    activation_inputs=(0,), weight_input=1, bias_input=2, fusable_producer=True, linear=True
)
_BINARY = OpPolicy(activation_inputs=(0, 1))
_UNARY = OpPolicy()
_MOVE = OpPolicy(share=Share.PASS)
_FLOAT_SCALE_UNARY = OpPolicy(float_scale_only=True)

_POLICIES: dict[str, OpPolicy] = {
    # layers with weights (and bias)
    "Conv": _LAYER,
    "ConvTranspose": _LAYER,
    "Gemm": _LAYER,
    # MatMul: B (slot 1) is the weight when it is a constant, an activation otherwise (attention)
    "MatMul": OpPolicy(
        activation_inputs=(0, 1), weight_input=1, fusable_producer=True, linear=True
    ),
    # element-wise arithmetic
    "Add": OpPolicy(activation_inputs=(0, 1), fusable_producer=True),
    "Sub": _BINARY,
    "Mul": _BINARY,
    "Div": OpPolicy(activation_inputs=(0, 1), float_scale_only=True),
    # transformer ops (float scales only): LayerNormalization's Scale and B stay float
    "LayerNormalization": _FLOAT_SCALE_UNARY,
    "Gelu": _FLOAT_SCALE_UNARY,
    # shared-position ops
    "Concat": OpPolicy(activation_inputs=None, share=Share.ALL, align_option="AlignConcat"),
    "MaxPool": OpPolicy(share=Share.PASS, align_option="AlignPool", fusable_producer=True),
    "AveragePool": OpPolicy(
        share=Share.ALL, align_option="AlignPool", fusable_producer=True, dpu_scale_mul=True
    ),
    "GlobalAveragePool": OpPolicy(
        share=Share.ALL, align_option="AlignPool", fusable_producer=True, dpu_scale_mul=True
    ),
    "Pad": OpPolicy(share=Share.PASS, align_option="AlignPad"),
    "Slice": OpPolicy(share=Share.PASS, align_option="AlignSlice"),
    # activations (the first four can be fused into a preceding Conv/Gemm/Add/pool)
    "Relu": OpPolicy(fuse_option="RemoveQDQConvRelu"),
    "Clip": OpPolicy(fuse_option="RemoveQDQConvClip"),
    "LeakyRelu": OpPolicy(fuse_option="RemoveQDQConvLeakyRelu"),
    "PRelu": OpPolicy(activation_inputs=(0,), weight_input=1, fuse_option="RemoveQDQConvPRelu"),
    "HardSigmoid": OpPolicy(dpu_scale_mul=True),
    "HardSwish": _UNARY,
    "Softmax": _UNARY,
    # embedding lookups (Gather on a constant table): the table per row with float scales; in
    # the XINT8 flow per tensor with a power-of-two scale like every XINT8 weight (the Gather
    # runs on the CPU there, but a float table would be most of the file)
    "Gather": OpPolicy(
        activation_inputs=(),
        weight_input=0,
        embedding=True,
        quantize_output=False,
    ),
    # data movement: the output keeps the input's position
    "Resize": _MOVE,
    "Reshape": _MOVE,
    "Flatten": _MOVE,
    "Transpose": _MOVE,
    "Squeeze": _MOVE,
    "Unsqueeze": _MOVE,
}

#: Read-only view of the registry (op type -> policy).
POLICIES: Mapping[str, OpPolicy] = MappingProxyType(_POLICIES)

#: Activation op type -> the RemoveQDQ* option that fuses it.
FUSABLE_ACTIVATIONS: Mapping[str, str] = MappingProxyType(
    {op: p.fuse_option for op, p in _POLICIES.items() if p.fuse_option}
)


def policy_for(op_type: str, domain: str = "", *, power_of_two: bool = False) -> OpPolicy | None:
    """The policy of a standard-domain op type, or None (the node stays float).

    With ``power_of_two`` (the XINT8 flow), ops marked ``float_scale_only`` have no policy.
    """
    if domain not in ("", "ai.onnx"):
        return None
    policy = _POLICIES.get(op_type)
    if policy is not None and policy.float_scale_only and power_of_two:
        return None
    return policy


def quantizable_op_types() -> list[str]:
    """Every op type with a policy, sorted."""
    return sorted(_POLICIES)
