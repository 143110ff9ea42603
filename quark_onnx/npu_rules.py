"""The XINT8 rules of AMD's Ryzen AI / Vitis AI NPU compiler, as data and pure functions.

Shared by the readiness checker (:mod:`quark_onnx.check`) and the constraint solver that moves
power-of-two positions until every rule holds. Nothing here touches a graph.

Positions. An XINT8 scale is an exact power of two, ``s = 2**-p``; the integer ``p`` is the
tensor's *position* (its number of fractional bits). The NPU rescales between layers with bit
shifts, so each rule below limits a sum or difference of positions:

================  =====================================  ========================================
rule              ops                                    limit
================  =====================================  ========================================
shared scale      Concat (all inputs and the output);    equal positions
                  MaxPool, AveragePool,
                  GlobalAveragePool, Pad, Slice
                  (input = output)
shift_cut         Conv, Gemm, ConvTranspose              ``p_w + p_in - p_out`` in 0 … 16
shift_bias        Conv, Gemm, ConvTranspose              ``p_w + p_in - p_bias`` in
                                                         ``min(0, -(24 - (8 + shift_cut)))`` … 15;
                                                         lower bound 0 before a LeakyRelu
shift_read        Add, Sub                               ``max p_in - min p_in`` <= 7
shift_write       Add                                    ``min p_in - p_out`` in -7 … 25
Mul shift         Mul                                    ``sum p_in - p_out`` in 0 … 32
HardSigmoid       HardSigmoid                            ``p_in`` in 0 … 15, ``p_out`` >= 7,
                                                         ``14 + p_in - p_out`` > 0
================  =====================================  ========================================

Sources: the limits are those of AMD Quark's ONNX position refinement (``quark/onnx/refine.py``:
``adjust_shift_cut``, ``adjust_shift_bias``, ``adjust_shift_read``, ``adjust_shift_write``,
``adjust_hard_sigmoid``, ``align_concat``, ``align_pool``, ``align_pad``, ``align_slice``), as
collected in the project guide (GUIDE §3), which is the specification where sources differ (for
HardSigmoid Quark's docstring allows ``14 + p_in - p_out`` up to 31 and its code requires > 0; both
hold once ``p_in <= 15`` and ``p_out >= 7``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

#: Op types the NPU runs in XINT8: the "XINT8" column of the operator table of the Ryzen AI
#: documentation (``docs/ops_support.rst`` in github.com/amd/ryzen-ai-documentation, Ryzen AI
#: 1.5), plus ``QuantizeLinear`` (the QDQ boundary itself). Every other op falls back to the CPU;
#: in particular Sigmoid, HardSigmoid, Split, ConvTranspose, Gather and PRelu (GUIDE §3).
XINT8_OPS: frozenset[str] = frozenset(
    {
        "Abs",
        "Add",
        "And",
        "ArgMax",
        "ArgMin",
        "AveragePool",
        "BatchNormalization",
        "BitShift",
        "BitwiseAnd",
        "BitwiseNot",
        "BitwiseOr",
        "BitwiseXor",
        "Cast",
        "Ceil",
        "Celu",
        "Clip",
        "Concat",
        "Constant",
        "ConstantOfShape",
        "Conv",
        "CumSum",
        "DepthToSpace",
        "DequantizeLinear",
        "Div",
        "Elu",
        "Equal",
        "Erf",
        "Expand",
        "Flatten",
        "Floor",
        "Gelu",
        "Gemm",
        "GlobalAveragePool",
        "GlobalMaxPool",
        "Greater",
        "GreaterOrEqual",
        "GroupNormalization",
        "HardSwish",
        "Identity",
        "InstanceNormalization",
        "LayerNormalization",
        "LeakyRelu",
        "Less",
        "LessOrEqual",
        "Log",
        "MatMul",
        "Max",
        "MaxPool",
        "Min",
        "Mish",
        "Mul",
        "Neg",
        "Or",
        "Pad",
        "Pow",
        "QuantizeLinear",
        "Range",
        "Reciprocal",
        "ReduceMax",
        "ReduceMean",
        "ReduceMin",
        "ReduceSum",
        "Relu",
        "Reshape",
        "Resize",
        "Round",
        "STFT",
        "Shape",
        "Shrink",
        "Sign",
        "Slice",
        "Softmax",
        "Softsign",
        "Sqrt",
        "Squeeze",
        "Sub",
        "Tanh",
        "ThresholdedRelu",
        "Tile",
        "TopK",
        "Transpose",
        "Unsqueeze",
        "Upsample",
        "Where",
    }
)

#: Ops whose (first) input and output must share one position; Concat: all inputs and output.
SHARED_SCALE_OPS: frozenset[str] = frozenset(
    {"Concat", "MaxPool", "AveragePool", "GlobalAveragePool", "Pad", "Slice"}
)

#: Data-movement ops that carry their input's position to their output unchanged (no requantize).
SCALE_PASSING_OPS: frozenset[str] = frozenset(
    {"Reshape", "Flatten", "Transpose", "Squeeze", "Unsqueeze", "Resize", "Identity"}
)

#: Activations fused into the producer before them (no Q/DQ in between; options RemoveQDQConv*).
FUSED_ACTIVATIONS: frozenset[str] = frozenset({"Relu", "Clip", "LeakyRelu", "PRelu"})

#: Producers an activation of :data:`FUSED_ACTIVATIONS` can be fused into.
FUSING_PRODUCERS: frozenset[str] = frozenset(
    {
        "Conv",
        "ConvTranspose",
        "Gemm",
        "MatMul",
        "Add",
        "MaxPool",
        "AveragePool",
        "GlobalAveragePool",
    }
)

#: Ops whose shift_cut / shift_bias are limited (weight input 1, bias input 2).
SHIFT_CUT_OPS: frozenset[str] = frozenset({"Conv", "Gemm", "ConvTranspose"})

#: Model-level: the Vitis AI EP invokes its NPU compiler only for models with at least this many
#: Conv nodes (its setting XLNX_MINIMUM_NUM_OF_CONV, default 2).
MIN_CONV_NODES = 2

SHIFT_CUT_RANGE: tuple[int, int] = (0, 16)
SHIFT_BIAS_MAX = 15
SHIFT_READ_MAX = 7
SHIFT_WRITE_RANGE: tuple[int, int] = (-7, 25)
MUL_SHIFT_RANGE: tuple[int, int] = (0, 32)
HARD_SIGMOID_INPUT_RANGE: tuple[int, int] = (0, 15)
HARD_SIGMOID_OUTPUT_MIN = 7


def in_range(value: int, bounds: tuple[int, int]) -> bool:
    """``bounds[0] <= value <= bounds[1]`` (both ends allowed)."""
    return bounds[0] <= value <= bounds[1]


def position_of_scale(scale: float) -> int | None:
    """The integer ``p`` with ``scale == 2**-p`` exactly, or None (not a power of two).

    Exact: ``frexp`` splits a finite positive float into ``m * 2**e`` with ``m`` in [0.5, 1); the
    scale is a power of two iff ``m == 0.5``, and then ``p = 1 - e``. Works for any float32 scale
    (subnormal ones included) read into a Python float.
    """
    s = float(scale)
    if not math.isfinite(s) or s <= 0.0:
        return None
    mantissa, exponent = math.frexp(s)
    if mantissa != 0.5:
        return None
    return 1 - exponent


def scale_of_position(p: int) -> float:
    """``2**-p`` (exact in float32 for -126 <= p <= 149)."""
    return math.ldexp(1.0, -int(p))


def shift_cut(p_w: int, p_in: int, p_out: int) -> int:
    """Right shift of the Conv/Gemm accumulator to the output: ``p_w + p_in - p_out`` (0 … 16)."""
    return p_w + p_in - p_out


def shift_bias(p_w: int, p_in: int, p_bias: int) -> int:
    """Left shift aligning the bias to the accumulator: ``p_w + p_in - p_bias``."""
    return p_w + p_in - p_bias


def shift_bias_range(shift_cut: int, before_leaky_relu: bool) -> tuple[int, int]:
    """Allowed shift_bias: ``min(0, -(24 - (8 + shift_cut)))`` … 15; lower bound 0 before LeakyRelu.

    With shift_cut = 16 the lower bound is 0; with shift_cut = 0 it is -16.
    """
    low = 0 if before_leaky_relu else min(0, -(24 - (8 + shift_cut)))
    return (low, SHIFT_BIAS_MAX)


def shift_read(p_ins: Sequence[int]) -> int:
    """Add/Sub: spread of the input positions, ``max p_in - min p_in`` (<= 7)."""
    return max(p_ins) - min(p_ins)


def shift_write(p_ins: Sequence[int], p_out: int) -> int:
    """Add: ``min p_in - p_out`` (-7 … 25)."""
    return min(p_ins) - p_out


def mul_shift(p_ins: Sequence[int], p_out: int) -> int:
    """Mul: ``sum p_in - p_out`` (0 … 32)."""
    return sum(p_ins) - p_out


def hard_sigmoid_shift(p_in: int, p_out: int) -> int:
    """HardSigmoid: ``14 + p_in - p_out`` (must be > 0)."""
    return 14 + p_in - p_out


def hard_sigmoid_violations(p_in: int, p_out: int) -> list[str]:
    """The HardSigmoid conditions that ``(p_in, p_out)`` breaks, as short texts (empty: ok)."""
    problems = []
    if not in_range(p_in, HARD_SIGMOID_INPUT_RANGE):
        lo, hi = HARD_SIGMOID_INPUT_RANGE
        problems.append(f"input position {p_in} not in {lo}..{hi}")
    if p_out < HARD_SIGMOID_OUTPUT_MIN:
        problems.append(f"output position {p_out} < {HARD_SIGMOID_OUTPUT_MIN}")
    if hard_sigmoid_shift(p_in, p_out) <= 0:
        problems.append(f"14 + p_in - p_out = {hard_sigmoid_shift(p_in, p_out)} is not > 0")
    return problems
