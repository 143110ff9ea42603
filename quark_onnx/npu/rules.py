"""The XINT8 position rules of AMD's Ryzen AI / Vitis AI NPU compiler: one :class:`Rule` per id.

Positions. An XINT8 scale is an exact power of two, ``s = 2**-p``; the integer ``p`` is the
tensor's *position* (its number of fractional bits). The NPU rescales between layers with bit
shifts, so each rule limits a sum or difference of positions around one node:

================  =====================================  ========================================
rule              ops (:mod:`quark_onnx.npu.ops`)        limit
================  =====================================  ========================================
shared_scale      ``share``/``align_option`` rows:       equal positions
                  Concat (all inputs and the output);
                  pools, Pad, Slice, data movement
                  (input = output)
shift_cut         Conv, Gemm, ConvTranspose              ``p_w + p_in - p_out`` in 0 … 16
shift_bias        Conv, Gemm, ConvTranspose              ``p_w + p_in - p_bias`` in
                                                         ``min(0, -(24 - (8 + shift_cut)))`` … 15;
                                                         lower bound 0 before a LeakyRelu
shift_read        Add, Sub                               ``max p_in - min p_in`` <= 7
shift_write       Add                                    ``min p_in - p_out`` in -7 … 25
mul_shift         Mul                                    ``sum p_in - p_out`` in 0 … 32
hard_sigmoid      HardSigmoid                            ``p_in`` in 0 … 15, ``p_out`` >= 7,
                                                         ``14 + p_in - p_out`` > 0
================  =====================================  ========================================

Sources: the limits are those of AMD Quark's ONNX position refinement (``quark/onnx/refine.py``:
``adjust_shift_cut``, ``adjust_shift_bias``, ``adjust_shift_read``, ``adjust_shift_write``,
``adjust_hard_sigmoid``, ``align_concat``, ``align_pool``, ``align_pad``, ``align_slice``), as
collected in the project guide (GUIDE §3), which is the specification where sources differ (for
HardSigmoid Quark's docstring allows ``14 + p_in - p_out`` up to 31 and its code requires > 0; both
hold once ``p_in <= 15`` and ``p_out >= 7``).

A rule is evaluated on a :class:`Site`: the positions around one node, by role. The solver
(:mod:`quark_onnx.params.solver`) builds sites from the plan and its positions, the readiness
checker (:mod:`quark_onnx.npu.readiness`) from the Q/DQ scales of a written model; both call
:meth:`Rule.evaluate`, so a rule's arithmetic, limits and message exist once.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from quark_onnx.npu import ops as _ops

#: Model-level: the Vitis AI EP invokes its NPU compiler only for models with at least this many
#: Conv nodes (its setting XLNX_MINIMUM_NUM_OF_CONV, default 2).
MIN_CONV_NODES = 2

#: Largest Conv kernel side (height and width) the NPU compiles, depthwise included: the conv2d
#: kernel range ``w, h: [1, 16]`` common to every DPU generation of the Vitis AI operator table
#: (UG1414 3.0, "Currently Supported Operators"; PG367, PG389, PG403 list the same for their
#: convolution engine). Depthwise engines that take only 3x3/5x5 (DPUCVDX8H, PG403) are stricter;
#: the Ryzen AI NPU's documentation gives no kernel limit, so the conv2d one is used.
MAX_CONV_KERNEL_SIDE = 16

SHIFT_CUT_RANGE: tuple[int, int] = (0, 16)
SHIFT_BIAS_MAX = 15
SHIFT_READ_MAX = 7
SHIFT_WRITE_RANGE: tuple[int, int] = (-7, 25)
MUL_SHIFT_RANGE: tuple[int, int] = (0, 32)
HARD_SIGMOID_INPUT_RANGE: tuple[int, int] = (0, 15)
HARD_SIGMOID_OUTPUT_MIN = 7


# --- arithmetic --------------------------------------------------------------------------------
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


def _clamp(value: int, bounds: tuple[int, int]) -> int:
    return min(max(value, bounds[0]), bounds[1])


def _span(bounds: tuple[int, int]) -> str:
    return f"{bounds[0]}..{bounds[1]}"


# --- sites and violations ----------------------------------------------------------------------
@dataclass(frozen=True)
class Pos:
    """A tensor and its position."""

    tensor: str
    p: int


@dataclass(frozen=True)
class Site:
    """The positions around one node, by role (a role without a position is None / absent).

    ``inputs``: the activation inputs (Conv/Gemm: the data input only; shared_scale: every member
    of the group but the output); ``before_leaky_relu``: a LeakyRelu follows the output (the
    shift_bias lower bound is then 0).
    """

    node: str
    op_type: str
    inputs: tuple[Pos, ...] = ()
    output: Pos | None = None
    weight: Pos | None = None
    bias: Pos | None = None
    before_leaky_relu: bool = False


@dataclass(frozen=True)
class Violation:
    """A rule that does not hold (``value`` outside ``limits``) at ``node``; ``message`` names the
    node, the tensors and their positions, the limits and the fix."""

    rule: str
    node: str
    op_type: str
    value: int
    limits: str
    tensors: tuple[str, ...]
    message: str


def _shown(positions: Sequence[Pos]) -> str:
    return ", ".join(f"{q.tensor!r}: {q.p}" for q in positions)


def _eval_shared(site: Site) -> Violation | None:
    group = [*site.inputs, *([site.output] if site.output is not None else [])]
    values = [q.p for q in group]
    if len(group) < 2 or len(set(values)) == 1:
        return None
    what = "all inputs and the output" if site.op_type == "Concat" else "input and output"
    return Violation(
        "shared_scale",
        site.node,
        site.op_type,
        max(values) - min(values),
        "equal positions",
        tuple(q.tensor for q in group),
        f"{site.op_type} {site.node!r}: {what} must share one position, found {_shown(group)}; "
        f"give them all the same position (e.g. the smallest, {min(values)})",
    )


def _eval_shift_cut(site: Site) -> Violation | None:
    if site.weight is None or site.output is None or not site.inputs:
        return None
    w, x, out = site.weight, site.inputs[0], site.output
    sc = shift_cut(w.p, x.p, out.p)
    if in_range(sc, SHIFT_CUT_RANGE):
        return None
    target = _clamp(sc, SHIFT_CUT_RANGE)
    return Violation(
        "shift_cut",
        site.node,
        site.op_type,
        sc,
        _span(SHIFT_CUT_RANGE),
        (w.tensor, x.tensor, out.tensor),
        f"{site.op_type} {site.node!r}: shift_cut = p_w + p_in - p_out = {w.p} + {x.p} - "
        f"{out.p} = {sc} is outside {_span(SHIFT_CUT_RANGE)} (weight {w.tensor!r}, input "
        f"{x.tensor!r}, output {out.tensor!r}); set the weight position to "
        f"{target + out.p - x.p} (or move the output position) so shift_cut = {target}",
    )


def _eval_shift_bias(site: Site) -> Violation | None:
    if site.weight is None or site.output is None or site.bias is None or not site.inputs:
        return None
    w, x, b = site.weight, site.inputs[0], site.bias
    sc = shift_cut(w.p, x.p, site.output.p)
    sb = shift_bias(w.p, x.p, b.p)
    bounds = shift_bias_range(sc, site.before_leaky_relu)
    if in_range(sb, bounds):
        return None
    target = _clamp(sb, bounds)
    leaky = ", before LeakyRelu" if site.before_leaky_relu else ""
    return Violation(
        "shift_bias",
        site.node,
        site.op_type,
        sb,
        _span(bounds),
        (w.tensor, x.tensor, b.tensor),
        f"{site.op_type} {site.node!r}: shift_bias = p_w + p_in - p_bias = {w.p} + {x.p} - "
        f"{b.p} = {sb} is outside {_span(bounds)} (shift_cut {sc}{leaky}; bias {b.tensor!r}); "
        f"set the bias position to {w.p + x.p - target}",
    )


def _eval_shift_read(site: Site) -> Violation | None:
    if len(site.inputs) < 2:
        return None
    values = [q.p for q in site.inputs]
    sr = shift_read(values)
    if sr <= SHIFT_READ_MAX:
        return None
    return Violation(
        "shift_read",
        site.node,
        site.op_type,
        sr,
        f"<= {SHIFT_READ_MAX}",
        tuple(q.tensor for q in site.inputs),
        f"{site.op_type} {site.node!r}: shift_read = max p_in - min p_in = {max(values)} - "
        f"{min(values)} = {sr} > {SHIFT_READ_MAX} (inputs {_shown(site.inputs)}); lower the "
        f"largest input position to {min(values) + SHIFT_READ_MAX}",
    )


def _eval_shift_write(site: Site) -> Violation | None:
    if len(site.inputs) < 2 or site.output is None:
        return None
    values = [q.p for q in site.inputs]
    out = site.output
    sw = shift_write(values, out.p)
    if in_range(sw, SHIFT_WRITE_RANGE):
        return None
    target = _clamp(sw, SHIFT_WRITE_RANGE)
    return Violation(
        "shift_write",
        site.node,
        site.op_type,
        sw,
        _span(SHIFT_WRITE_RANGE),
        (*(q.tensor for q in site.inputs), out.tensor),
        f"{site.op_type} {site.node!r}: shift_write = min p_in - p_out = {min(values)} - "
        f"{out.p} = {sw} is outside {_span(SHIFT_WRITE_RANGE)} (inputs {_shown(site.inputs)}; "
        f"output {out.tensor!r}); set the output position to {min(values) - target}",
    )


def _eval_mul_shift(site: Site) -> Violation | None:
    if len(site.inputs) < 2 or site.output is None:
        return None
    values = [q.p for q in site.inputs]
    out = site.output
    s = mul_shift(values, out.p)
    if in_range(s, MUL_SHIFT_RANGE):
        return None
    target = _clamp(s, MUL_SHIFT_RANGE)
    return Violation(
        "mul_shift",
        site.node,
        site.op_type,
        s,
        _span(MUL_SHIFT_RANGE),
        (*(q.tensor for q in site.inputs), out.tensor),
        f"{site.op_type} {site.node!r}: sum p_in - p_out = {sum(values)} - {out.p} = {s} is "
        f"outside {_span(MUL_SHIFT_RANGE)} (inputs {_shown(site.inputs)}; output "
        f"{out.tensor!r}); set the output position to {sum(values) - target}",
    )


def _eval_hard_sigmoid(site: Site) -> Violation | None:
    if not site.inputs or site.output is None:
        return None
    x, out = site.inputs[0], site.output
    problems = hard_sigmoid_violations(x.p, out.p)
    if not problems:
        return None
    lo, hi = HARD_SIGMOID_INPUT_RANGE
    return Violation(
        "hard_sigmoid",
        site.node,
        site.op_type,
        hard_sigmoid_shift(x.p, out.p),
        f"p_in {lo}..{hi}, p_out >= {HARD_SIGMOID_OUTPUT_MIN}, 14 + p_in - p_out > 0",
        (x.tensor, out.tensor),
        f"{site.op_type} {site.node!r} (input {x.tensor!r} p_in = {x.p}, output "
        f"{out.tensor!r} p_out = {out.p}): {'; '.join(problems)}; the NPU needs p_in in "
        f"{lo}..{hi}, p_out >= {HARD_SIGMOID_OUTPUT_MIN} and 14 + p_in - p_out > 0",
    )


@dataclass(frozen=True)
class Rule:
    """One NPU rule: its id, the option that enforces it, its limits and its check.

    ``option``: the :class:`~quark_onnx.config.options.ExtraOptions` flag under which the solver
    enforces it (``shared_scale``: per op, the row's ``align_option``; None there means always).
    ``check``: the site -> violation function (None: the rule holds).
    """

    id: str
    option: str | None
    limits: str
    check: Callable[[Site], Violation | None]

    @property
    def ops(self) -> frozenset[str]:
        """Op types the rule applies to, from :data:`quark_onnx.npu.ops.OPS`."""
        if self.id == "shared_scale":
            return _ops.ops_where(lambda s: s.share is not _ops.Share.NONE)
        return _ops.rule_ops(self.id)

    def evaluate(self, site: Site) -> Violation | None:
        """The violation of this rule at ``site``, or None (holds, or positions missing)."""
        return self.check(site)


_RULES = (
    Rule("shared_scale", None, "equal positions", _eval_shared),
    Rule("shift_cut", "AdjustShiftCut", _span(SHIFT_CUT_RANGE), _eval_shift_cut),
    Rule(
        "shift_bias",
        "AdjustShiftBias",
        f"min(0, -(24 - (8 + shift_cut)))..{SHIFT_BIAS_MAX}; 0.. before LeakyRelu",
        _eval_shift_bias,
    ),
    Rule("shift_read", "AdjustShiftRead", f"<= {SHIFT_READ_MAX}", _eval_shift_read),
    Rule("shift_write", "AdjustShiftWrite", _span(SHIFT_WRITE_RANGE), _eval_shift_write),
    Rule("mul_shift", "AdjustShiftMul", _span(MUL_SHIFT_RANGE), _eval_mul_shift),
    Rule(
        "hard_sigmoid",
        "AdjustHardSigmoid",
        "p_in 0..15, p_out >= 7, 14 + p_in - p_out > 0",
        _eval_hard_sigmoid,
    ),
)

#: Rule id -> rule.
RULES: Mapping[str, Rule] = MappingProxyType({r.id: r for r in _RULES})

#: The position rules of a node, in the order they are checked and fixed.
SHIFT_RULE_IDS: tuple[str, ...] = tuple(r.id for r in _RULES if r.id != "shared_scale")


def rules_of(op_type: str) -> tuple[Rule, ...]:
    """The shift rules that apply to ``op_type`` (in :data:`SHIFT_RULE_IDS` order)."""
    row = _ops.spec(op_type)
    if row is None:
        return ()
    return tuple(RULES[r] for r in row.shift_rules)


def evaluate(site: Site, rule_ids: Sequence[str] | None = None) -> list[Violation]:
    """Every violated rule of ``site``'s op (or of ``rule_ids``), in rule order."""
    chosen = rules_of(site.op_type) if rule_ids is None else [RULES[r] for r in rule_ids]
    return [v for v in (r.evaluate(site) for r in chosen) if v is not None]
