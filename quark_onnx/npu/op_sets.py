"""The XINT8 rules of the NPU compiler as op sets and functions: views of :mod:`quark_onnx.npu`.

The rules, their limits and arithmetic live in :mod:`quark_onnx.npu.rules`; the op facts in the
table :mod:`quark_onnx.npu.ops`. The sets here are derived from that table.
"""

from __future__ import annotations

from quark_onnx.npu import ops as _ops

#: Op types the NPU runs in XINT8 by themselves (placement NPU in the table).
XINT8_OPS: frozenset[str] = _ops.npu_ops()

#: Ops whose inputs and output must share one position when their ``Align*`` option is on.
SHARED_SCALE_OPS: frozenset[str] = _ops.ops_where(lambda s: s.align_option is not None)

#: Data-movement ops that carry their input's position to their output unchanged.
SCALE_PASSING_OPS: frozenset[str] = _ops.ops_where(
    lambda s: s.passes_scale and s.align_option is None
)

#: Activations fused into the producer before them (options RemoveQDQConv*).
FUSED_ACTIVATIONS: frozenset[str] = _ops.ops_where(lambda s: s.fuse_option is not None)

#: Producers an activation of :data:`FUSED_ACTIVATIONS` can be fused into.
FUSING_PRODUCERS: frozenset[str] = _ops.ops_where(lambda s: s.fusable_producer)

#: Ops whose shift_cut / shift_bias are limited (weight input 1, bias input 2).
SHIFT_CUT_OPS: frozenset[str] = _ops.rule_ops("shift_cut")

__all__ = [
    "FUSED_ACTIVATIONS",
    "FUSING_PRODUCERS",
    "SCALE_PASSING_OPS",
    "SHARED_SCALE_OPS",
    "SHIFT_CUT_OPS",
    "XINT8_OPS",
]
