"""The solver's verification: every enabled NPU rule recomputed from a plan and its positions.

The sites are built from the plan (:class:`~quark_onnx.plan.types.PlannedNode` roles) and evaluated
by the rules of :mod:`quark_onnx.npu.rules`, the objects the readiness checker evaluates on a
written model's Q/DQ positions.
"""

from __future__ import annotations

from quark_onnx.config.options import ExtraOptions
from quark_onnx.npu import ops as npu_ops
from quark_onnx.npu import rules
from quark_onnx.npu.rules import Pos, Site, Violation
from quark_onnx.plan.types import QuantPlan


def sites(plan: QuantPlan, positions: dict[str, int]) -> list[Site]:
    """The rule sites of ``plan`` at ``positions``: one per planned node with shift rules.

    A role whose tensor has no position is left out (its rule is then not evaluated), as the
    readiness checker leaves out a tensor without a power-of-two Q/DQ.
    """

    def at(tensor: str | None) -> Pos | None:
        if tensor is None or positions.get(tensor) is None:
            return None
        return Pos(tensor, int(positions[tensor]))

    out = []
    for node in plan.nodes:
        row = npu_ops.spec(node.op_type)
        if row is None or not row.shift_rules:
            continue
        if "shift_cut" in row.shift_rules:  # a layer: the data input, weight and bias by role
            ins: list[Pos | None] = [at(node.inputs[0]) if node.inputs else None]
        else:
            ins = [at(t) for t in node.activation_inputs]
        if any(q is None for q in ins):
            continue
        out.append(
            Site(
                node=node.name,
                op_type=node.op_type,
                inputs=tuple(q for q in ins if q is not None),
                output=at(node.output),
                weight=at(node.weight),
                bias=at(node.bias),
                before_leaky_relu=node.before_leaky_relu,
            )
        )
    return out


def verify(plan: QuantPlan, positions: dict[str, int], options: ExtraOptions) -> list[Violation]:
    """Every enabled NPU rule that ``positions`` violate (recomputed from scratch).

    The shared-position rule is checked on the equalities of ops whose row shares a scale (an
    equality the planner adds for its own reasons, a Relu in = out, is not an NPU rule).
    """
    out: list[Violation] = []
    shared = rules.RULES["shared_scale"]
    for eq in plan.active_equalities(options):
        row = npu_ops.spec(eq.op_type)
        if row is None or row.share is npu_ops.Share.NONE:
            continue
        members = [Pos(t, int(positions[t])) for t in eq.tensors if positions.get(t) is not None]
        if len(members) < len(eq.tensors):
            continue
        violation = shared.evaluate(
            Site(eq.node, eq.op_type, inputs=tuple(members[:-1]), output=members[-1])
        )
        if violation is not None:
            out.append(violation)
    for site in sites(plan, positions):
        enabled = [
            r.id
            for r in rules.rules_of(site.op_type)
            if r.option is None or getattr(options, r.option)
        ]
        out += rules.evaluate(site, enabled)
    return out
