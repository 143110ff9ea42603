"""Which side of the NPU/CPU boundary a node runs on, beyond its op's row.

A node runs where its op's row places it (:mod:`quark_onnx.npu.ops`), with one exception decided
here, in one place for the planner and the readiness checker: element-wise arithmetic on one
computed tensor and a constant (``Mul``, ``Add``, ``Sub``, ``Div``), whose result is read only by
ops the NPU does not run (``Placement.CPU``), runs on the CPU with its readers. The graph is split
before those readers anyway; computing the arithmetic on the NPU would only requantize its
result to int8 on the way. The case that matters: the gate input ``x * s`` that
EqualizeGatedActivations writes before a SiLU's ``Sigmoid`` (a CPU op in XINT8) rescales each
channel by its own power of two, which one per-tensor int8 position cannot hold for every
channel; read in float from ``x``'s int8 codes it is exact.
"""

from __future__ import annotations

import onnx_ir as ir

from quark_onnx.npu import ops as npu_ops
from quark_onnx.plan_patterns import is_constant

_STANDARD = ("", "ai.onnx")
_CONSTANT_ARITHMETIC = frozenset({"Mul", "Add", "Sub", "Div"})


def _runs_on_cpu(node: ir.Node) -> bool:
    row = npu_ops.spec(node.op_type) if node.domain in _STANDARD else None
    return row is not None and row.placement is npu_ops.Placement.CPU


def cpu_side_arithmetic(node: ir.Node) -> bool:
    """``node`` is constant arithmetic read only by CPU ops, so it runs on the CPU with them."""
    if node.op_type not in _CONSTANT_ARITHMETIC or node.domain not in _STANDARD:
        return False
    if len(node.inputs) != 2 or any(v is None for v in node.inputs):
        return False
    if sum(1 for v in node.inputs if not is_constant(v)) != 1 or len(node.outputs) != 1:
        return False
    out = node.outputs[0]
    uses = list(out.uses())
    if out.is_graph_output() or not uses:
        return False
    return all(_runs_on_cpu(use.node) for use in uses)
