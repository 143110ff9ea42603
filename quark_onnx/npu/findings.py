"""What the readiness check reports: :class:`Finding` and :class:`CheckResult`."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any

import onnx_ir as ir

#: Rules that do not stop a model from compiling for the NPU: the op runs on the CPU between NPU
#: partitions (it costs speed, not correctness). Reported as warnings; every other rule is an
#: error and makes the model not ready.
ADVISORY_RULES = frozenset({"unsupported_op"})


@dataclass(frozen=True)
class Finding:
    """One reason a model is not Vitis AI-ready (or, for advisory rules, runs partly on the CPU).

    Attributes:
        rule: short id (``"shift_cut"``, ``"non_pof2_scale"``, ``"unsupported_op"`` ...).
        node: the node's name, or the tensor's name for tensor findings; None for the model.
        message: names the node/tensor, the values, the allowed range and the fix.
        op_type: for a finding that says the same of every node of one op type (an op on the
            CPU, a float node): that op type; such findings are shown as one line per op type
            (:func:`group_lines`).
        detail: the text such a line says of all those nodes (``message`` without the node).
    """

    rule: str
    node: str | None
    message: str
    op_type: str | None = None
    detail: str | None = None

    @property
    def severity(self) -> str:
        """``"warning"`` for :data:`ADVISORY_RULES`, else ``"error"``."""
        return "warning" if self.rule in ADVISORY_RULES else "error"

    def to_dict(self) -> dict[str, Any]:
        data = {
            "rule": self.rule,
            "severity": self.severity,
            "node": self.node,
            "message": self.message,
        }
        if self.op_type is not None:
            data.update(op_type=self.op_type, detail=self.detail)
        return data


@dataclass
class CheckResult:
    """Every :class:`Finding` of one model; ready when none of them is an error."""

    findings: list[Finding] = field(default_factory=list)
    model: str | None = None
    #: what the float nodes of a mixed-precision model's promotion record would have been
    #: reported as: intended, not findings (:func:`quark_onnx.npu.readiness.check`)
    expected: list[Finding] = field(default_factory=list)

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "error"]

    @property
    def warnings(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "warning"]

    @property
    def ready(self) -> bool:
        return not self.errors

    def by_rule(self, rule: str) -> list[Finding]:
        """The findings of one rule id."""
        return [f for f in self.findings if f.rule == rule]

    def rules(self) -> set[str]:
        """The distinct rule ids found."""
        return {f.rule for f in self.findings}

    def summary(self) -> str:
        """``Vitis AI ready`` or ``NOT Vitis AI ready``, then the findings, errors first, one
        line per rule and op type where many nodes of one type have the same finding
        (:func:`group_lines`)."""
        head = (
            "Vitis AI ready" if self.ready else f"NOT Vitis AI ready ({len(self.errors)} error(s))"
        )
        if self.warnings:
            head += f", {len(self.warnings)} warning(s)"
        lines = [head]
        lines += [f"  {line}" for line in group_lines([f.to_dict() for f in self.findings])]
        if self.expected:
            nodes = sorted({f.node for f in self.expected if f.node})
            lines.append(
                f"  mixed precision: {len(nodes)} node(s) kept float on the CPU as the model's "
                "promotion record says (intended, not findings)"
            )
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able: ``ready``, ``model``, ``counts`` per rule, the ``findings`` (every node)
        and their ``groups`` (:func:`group_findings`)."""
        counts = collections.Counter(f.rule for f in self.findings)
        findings = [f.to_dict() for f in self.findings]
        return {
            "ready": self.ready,
            "model": self.model,
            "counts": dict(sorted(counts.items())),
            "findings": findings,
            "groups": group_findings(findings),
            "expected": [f.to_dict() for f in self.expected],
        }


#: Node names a grouped line shows before "and N more" (every name is in the JSON report).
SHOWN_NODES = 3


def group_findings(findings: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The findings (``Finding.to_dict()``) with one entry per rule and op type: those of one
    rule whose ``op_type`` is the same say the same of every node (``detail``) and become one
    group holding their ``count`` and ``nodes``; any other finding is a group of its own.
    Errors first, then in the order found."""
    groups: dict[Any, dict[str, Any]] = {}
    for i, f in enumerate(findings):
        key = (f["rule"], f["op_type"], f["detail"]) if f.get("op_type") else i
        group = groups.setdefault(
            key,
            {
                "rule": f["rule"],
                "severity": f["severity"],
                "op_type": f.get("op_type"),
                "count": 0,
                "nodes": [],
                "message": f["message"],
            },
        )
        group["count"] += 1
        group["nodes"].append(f["node"])
        if group["count"] > 1:
            shown = ", ".join(repr(n) for n in group["nodes"][:SHOWN_NODES])
            more = group["count"] - SHOWN_NODES
            names = shown + (f" and {more} more" if more > 0 else "")
            group["message"] = f"{group['count']} {f['op_type']} nodes ({names}): {f['detail']}"
    return sorted(groups.values(), key=lambda g: g["severity"] != "error")


def group_lines(findings: list[dict[str, Any]]) -> list[str]:
    """``SEVERITY RULE: MESSAGE`` per group of :func:`group_findings`."""
    return [f"{g['severity']} {g['rule']}: {g['message']}" for g in group_findings(findings)]


def node_label(node: ir.Node) -> str:
    """The node's name, else its first output's name, else ``<unnamed OP>``."""
    if node.name:
        return node.name
    out = node.outputs[0].name if node.outputs else None
    return out or f"<unnamed {node.op_type}>"
