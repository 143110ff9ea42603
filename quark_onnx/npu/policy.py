"""Per-op quantization policy: the planner's view of the op table :mod:`quark_onnx.npu.ops`.

A policy is the row of its op type (:class:`OpSpec` is :class:`~quark_onnx.npu.ops.OpSpec`;
its fields are documented there). Ops whose row is not ``quantized``, and ops without a row, have
no policy: they stay float (the plan reports them). Adding an op is one row in that table.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from quark_onnx.npu.ops import OPS, OpSpec

__all__ = [
    "FUSABLE_ACTIVATIONS",
    "POLICIES",
    "policy_for",
    "quantizable_op_types",
]

#: Read-only view of the quantized rows (op type -> policy).
POLICIES: Mapping[str, OpSpec] = MappingProxyType(
    {op: spec for op, spec in OPS.items() if spec.quantized}
)

#: Activation op type -> the RemoveQDQ* option that fuses it.
FUSABLE_ACTIVATIONS: Mapping[str, str] = MappingProxyType(
    {op: p.fuse_option for op, p in POLICIES.items() if p.fuse_option}
)


def policy_for(op_type: str, domain: str = "", *, power_of_two: bool = False) -> OpSpec | None:
    """The policy of a standard-domain op type, or None (the node stays float).

    With ``power_of_two`` (the XINT8 flow), ops marked ``float_scale_only`` have no policy.
    """
    if domain not in ("", "ai.onnx"):
        return None
    policy = OPS.get(op_type)
    if policy is None or not policy.quantized:
        return None
    if policy.float_scale_only and power_of_two:
        return None
    return policy


def quantizable_op_types() -> list[str]:
    """Every op type with a policy, sorted."""
    return sorted(POLICIES)
