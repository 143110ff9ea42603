"""One table, one row per ONNX op type: how it is quantized and what the NPU does with it.

Every other list of op types in the package (the planner's policies, the readiness checker's
NPU op list, its position look-through and fusion pairs, the solver's rule dispatch, the
calibration collector's value-preserving ops) is a view of :data:`OPS`. Adding or changing an op is
one row here.

A row (:class:`OpSpec`) holds:

*Quantization policy* (read by :func:`quark_onnx.plan.build.build_plan` through
:func:`quark_onnx.npu.policy.policy_for`; ``quantized=False``: the op stays float):

* ``activation_inputs``: the input slots quantized with a Q/DQ pair (``None``: every input). A slot
  whose value is a constant (initializer or ``Constant`` output) is quantized as a *weight*
  instead (int8, per tensor, own position), e.g. the constant operand of ``Add``/``Mul``.
* ``weight_input``: the slot holding the layer weight (Conv/ConvTranspose/Gemm ``W``, PRelu
  slope). Quantized as a weight when constant, as an activation otherwise.
* ``bias_input``: the slot holding the bias (Conv/ConvTranspose input 2, Gemm ``C``).
* ``share``: how positions relate across the node: :attr:`Share.NONE` (own output position),
  :attr:`Share.PASS` (the output keeps input 0's position: data movement), :attr:`Share.ALL`
  (every quantized input and the output share one position: Concat, average pools).
* ``align_option``: the ``Align*`` option that switches the shared position (the NPU's
  ``shared_scale`` rule); ``None`` with ``Share.PASS``: always shared (reshaping never changes
  values, so one position costs nothing).
* ``fusable_producer``: a Conv/Gemm/MatMul/Add/pool whose single-consumer output may feed a fused
  activation (no Q/DQ between them).
* ``fuse_option``: on an activation, the ``RemoveQDQConv*`` option that fuses it into a fusable
  producer.
* ``dpu_scale_mul``: an average pool or HardSigmoid whose output feeds only a ``Mul`` by a scalar
  constant (the hardware factor written by the DPU simulation passes): the Mul is part of the op
  on the NPU, so no Q/DQ sits between them and the output position is read after the Mul.
* ``linear`` (Conv, ConvTranspose, Gemm, MatMul): weight-only and dynamic quantization quantize
  exactly these; per-channel and per-group scales apply to their weights only.
* ``embedding`` (Gather on a constant table): the table per row in every float-scale strategy
  (per tensor, power-of-two, in XINT8).
* ``quantize_output``: the static flow quantizes the node's output (False: ``Gather``).
* ``float_scale_only``: planned only with float scales; the power-of-two (XINT8) flow leaves
  these transformer ops float.

*NPU facts* (XINT8):

* ``placement``: :attr:`Placement.NPU` (compiled for the NPU), :attr:`Placement.CPU` (the graph is
  split there and the op runs on the CPU; ``cpu_hint`` says what to do about it, and
  ``cpu_fix_pass`` names the graph pass that hint proposes, so that the check does not propose a
  pass the run measured and undid), or
  :attr:`Placement.FUSED` (on the NPU only as an activation fused into the producer before it).
* ``shift_rules``: the ids of the :mod:`quark_onnx.npu.rules` shift rules that limit the positions
  around the node (``shared_scale`` is not listed: it follows from ``share``/``align_option``).
* ``same_values``: every output value is an input value (pure data movement; the calibration
  collector reuses the input's statistics). Resize is not: it interpolates.

Where the sources disagree the decision is written on the row. The sources are the XINT8 column of
the Ryzen AI 1.5 operator table (``docs/ops_support.rst`` of github.com/amd/ryzen-ai-documentation)
and AMD Quark's XINT8 flow (its "DPU/NPU hardware adaptation" stage: the DPU simulation passes and
the position refinement ``quark/onnx/refine.py``), as collected in the project guide (GUIDE §3).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType


class Share(enum.Enum):
    """How a node's output position relates to its inputs' positions."""

    NONE = "none"
    PASS = "pass"
    ALL = "all"


class Placement(enum.Enum):
    """Where the Vitis AI EP runs an op of an XINT8 model."""

    NPU = "npu"
    CPU = "cpu"
    #: on the NPU only as an activation fused into its producer (no Q/DQ between them)
    FUSED = "fused"


@dataclass(frozen=True)
class OpSpec:
    """Quantization policy and NPU facts of one op type (see the module docstring)."""

    quantized: bool = True
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
    placement: Placement = Placement.NPU
    cpu_hint: str | None = None
    cpu_fix_pass: str | None = None
    shift_rules: tuple[str, ...] = ()
    same_values: bool = False

    @property
    def passes_scale(self) -> bool:
        """The output carries input 0's position through (data movement)."""
        return self.share is Share.PASS

    @property
    def requires_shared_scale(self) -> bool:
        """Inputs/output must share one position (an NPU rule switched by ``align_option``)."""
        return self.align_option is not None

    @property
    def carries_position(self) -> bool:
        """A single-input op whose output, when not requantized, has its input's position."""
        return self.share is Share.PASS or (
            self.share is Share.ALL and self.activation_inputs == (0,)
        )

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


_CPU = Placement.CPU
_CONV_RULES = ("shift_cut", "shift_bias")
_LAYER = OpSpec(
    activation_inputs=(0,),
    weight_input=1,
    bias_input=2,
    fusable_producer=True,
    linear=True,
    shift_rules=_CONV_RULES,
)
_MOVE = OpSpec(share=Share.PASS)
_FLOAT_SCALE_UNARY = OpSpec(float_scale_only=True)
#: on the NPU, not quantized by the planner (integer, shape or reduction ops: no position rule)
_NPU_ONLY = OpSpec(quantized=False)

_OPS: dict[str, OpSpec] = {
    # --- layers with weights (and bias) ------------------------------------------------------
    "Conv": _LAYER,
    "Gemm": _LAYER,
    # Not XINT8 on the NPU (Ryzen AI 1.5 table: BF16/A16W8/A8W8 only), so it runs on the CPU.
    # Still quantized with power-of-two scales and held to shift_cut/shift_bias, as Quark's
    # refinement does: its neighbours stay on the NPU, and the positions stay those a compiler
    # taking it would need.
    "ConvTranspose": replace(
        _LAYER,
        placement=_CPU,
        cpu_hint="it runs on the CPU in XINT8 (A8W8/A16W8 presets support it)",
    ),
    # MatMul: B (slot 1) is the weight when it is a constant, an activation otherwise (attention)
    "MatMul": OpSpec(weight_input=1, fusable_producer=True, linear=True),
    # --- element-wise arithmetic -------------------------------------------------------------
    "Add": OpSpec(
        activation_inputs=(0, 1), fusable_producer=True, shift_rules=("shift_read", "shift_write")
    ),
    "Sub": OpSpec(activation_inputs=(0, 1), shift_rules=("shift_read",)),
    "Mul": OpSpec(activation_inputs=(0, 1), shift_rules=("mul_shift",)),
    "Div": OpSpec(activation_inputs=(0, 1), float_scale_only=True),
    # --- transformer ops (float scales only): LayerNormalization's Scale and B stay float ----
    "LayerNormalization": _FLOAT_SCALE_UNARY,
    "Gelu": _FLOAT_SCALE_UNARY,
    # --- shared-position ops -----------------------------------------------------------------
    "Concat": OpSpec(activation_inputs=None, share=Share.ALL, align_option="AlignConcat"),
    "MaxPool": OpSpec(share=Share.PASS, align_option="AlignPool", fusable_producer=True),
    "AveragePool": OpSpec(
        share=Share.ALL, align_option="AlignPool", fusable_producer=True, dpu_scale_mul=True
    ),
    # ConvertGlobalAvgPoolToDepthwiseConv makes one a depthwise Conv (a layer: own output position)
    "GlobalAveragePool": OpSpec(
        share=Share.ALL, align_option="AlignPool", fusable_producer=True, dpu_scale_mul=True
    ),
    "Pad": OpSpec(share=Share.PASS, align_option="AlignPad"),
    "Slice": OpSpec(share=Share.PASS, align_option="AlignSlice"),
    # --- activations (fusable into a preceding Conv/Gemm/MatMul/Add/pool) ---------------------
    "Relu": OpSpec(fuse_option="RemoveQDQConvRelu"),
    "Clip": OpSpec(fuse_option="RemoveQDQConvClip"),
    "LeakyRelu": OpSpec(fuse_option="RemoveQDQConvLeakyRelu"),
    # The Ryzen AI 1.5 table has no PRelu row; Quark's XINT8 flow fuses it into the producer
    # (RemoveQDQConvPRelu, on in the XINT8 preset), where the DPU applies the slope at the output.
    # Decided: on the NPU when fused, on the CPU alone.
    "PRelu": OpSpec(
        activation_inputs=(0,),
        weight_input=1,
        fuse_option="RemoveQDQConvPRelu",
        placement=Placement.FUSED,
        cpu_hint=(
            "a PRelu is computed by the NPU only fused into the Conv/Gemm/Add/pool before it "
            "(RemoveQDQConvPRelu); one with one slope value can be replaced by LeakyRelu"
        ),
    ),
    # Decided: computed by the NPU. The Ryzen AI 1.5 table marks HardSigmoid for A8W8 only, but
    # XINT8 is Quark's DPU flow, whose hardware adaptation replaces Sigmoid by HardSigmoid
    # *because* the DPU computes it (ConvertSigmoidToHardSigmoid), simulates the DPU's 2731/16384
    # for 1/6 (ConvertHardSigmoidToDPUVersion) and limits its positions (adjust_hard_sigmoid,
    # the rule below): limits that only exist for an op the hardware computes.
    "HardSigmoid": OpSpec(dpu_scale_mul=True, shift_rules=("hard_sigmoid",)),
    "HardSwish": OpSpec(),
    # In the XINT8 column of the Ryzen AI 1.5 table. Quantized at its input and output like the
    # other activations it computes: in GELU (``x * (Erf(x / sqrt 2) + 1) / 2``) it reads a Div,
    # which XINT8 leaves float, so unquantized it would read a tensor nothing quantizes.
    "Erf": OpSpec(),
    "Softmax": OpSpec(),
    # --- embedding lookups: the table per row with float scales; in XINT8 per tensor with a ----
    # power-of-two scale like every XINT8 weight (the Gather runs on the CPU there, but a float
    # table would be most of the file)
    "Gather": OpSpec(
        weight_input=0,
        embedding=True,
        quantize_output=False,
        placement=_CPU,
        cpu_hint="fold constant-index Gathers with onnxsim; otherwise it runs on the CPU",
    ),
    # --- data movement: the output keeps the input's position ---------------------------------
    "Resize": _MOVE,
    "Reshape": replace(_MOVE, same_values=True),
    "Flatten": replace(_MOVE, same_values=True),
    "Transpose": replace(_MOVE, same_values=True),
    "Squeeze": replace(_MOVE, same_values=True),
    "Unsqueeze": replace(_MOVE, same_values=True),
    # not quantized (onnxruntime folds it), but positions are read through it
    "Identity": replace(_MOVE, quantized=False, same_values=True),
    # --- the Q/DQ boundary --------------------------------------------------------------------
    "QuantizeLinear": _NPU_ONLY,
    "DequantizeLinear": _NPU_ONLY,
    # --- CPU fallbacks with a known fix --------------------------------------------------------
    "Sigmoid": OpSpec(
        quantized=False,
        placement=_CPU,
        cpu_hint=(
            "it runs on the CPU between the NPU parts; ConvertSigmoidToHardSigmoid replaces it "
            "by the HardSigmoid the NPU computes"
        ),
        cpu_fix_pass="ConvertSigmoidToHardSigmoid",
    ),
    "Split": OpSpec(
        quantized=False,
        placement=_CPU,
        cpu_hint="convert it to Slice nodes (option ConvertSplitToSlice)",
        cpu_fix_pass="ConvertSplitToSlice",
    ),
    "LSTM": OpSpec(
        quantized=False,
        placement=_CPU,
        cpu_hint="the Vitis AI EP was measured to crash on LSTM; keep it on the CPU provider",
    ),
    "Dropout": OpSpec(
        quantized=False,
        placement=_CPU,
        cpu_hint="an inference Dropout is an identity: remove it (onnxsim does)",
    ),
    "Sum": OpSpec(
        quantized=False, placement=_CPU, cpu_hint="a two-input Sum is an Add: rewrite it as Add"
    ),
}

# The rest of the XINT8 column of the Ryzen AI 1.5 operator table: compiled for the NPU, not
# quantized by the planner (no position rule applies to them).
_NPU_ONLY_OPS = (
    "Abs",
    "And",
    "ArgMax",
    "ArgMin",
    "BatchNormalization",
    "BitShift",
    "BitwiseAnd",
    "BitwiseNot",
    "BitwiseOr",
    "BitwiseXor",
    "Cast",
    "Ceil",
    "Celu",
    "Constant",
    "ConstantOfShape",
    "CumSum",
    "DepthToSpace",
    "Elu",
    "Equal",
    "Expand",
    "Floor",
    "GlobalMaxPool",
    "Greater",
    "GreaterOrEqual",
    "GroupNormalization",
    "InstanceNormalization",
    "Less",
    "LessOrEqual",
    "Log",
    "Max",
    "Min",
    "Mish",
    "Neg",
    "Or",
    "Pow",
    "Range",
    "Reciprocal",
    "ReduceMax",
    "ReduceMean",
    "ReduceMin",
    "ReduceSum",
    "Round",
    "STFT",
    "Shape",
    "Shrink",
    "Sign",
    "Softsign",
    "Sqrt",
    "Tanh",
    "ThresholdedRelu",
    "Tile",
    "TopK",
    "Upsample",
    "Where",
)
for _op in _NPU_ONLY_OPS:
    _OPS.setdefault(_op, _NPU_ONLY)
#: Read-only view of the table (op type -> spec).
OPS: Mapping[str, OpSpec] = MappingProxyType(_OPS)

#: Text used for an op without a row (it runs on the CPU).
DEFAULT_CPU_HINT = "it runs on the CPU"


def spec(op_type: str) -> OpSpec | None:
    """The row of a standard-domain op type, or None."""
    return OPS.get(op_type)


def ops_where(predicate: Callable[[OpSpec], bool]) -> frozenset[str]:
    """Op types whose row satisfies ``predicate(spec)``."""
    return frozenset(op for op, s in OPS.items() if predicate(s))


def npu_ops() -> frozenset[str]:
    """Op types the NPU runs in XINT8 by themselves (placement NPU)."""
    return ops_where(lambda s: s.placement is Placement.NPU)


def rule_ops(rule_id: str) -> frozenset[str]:
    """Op types a shift rule (``shift_cut``, ``hard_sigmoid`` ...) applies to."""
    return ops_where(lambda s: rule_id in s.shift_rules)
