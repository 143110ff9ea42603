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
    """

    rule: str
    node: str | None
    message: str

    @property
    def severity(self) -> str:
        """``"warning"`` for :data:`ADVISORY_RULES`, else ``"error"``."""
        return "warning" if self.rule in ADVISORY_RULES else "error"

    def to_dict(self) -> dict[str, Any]:
        return {
            "rule": self.rule,
            "severity": self.severity,
            "node": self.node,
            "message": self.message,
        }


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
        """``Vitis AI ready`` or ``NOT Vitis AI ready``, then one line per finding, errors first."""
        head = (
            "Vitis AI ready" if self.ready else f"NOT Vitis AI ready ({len(self.errors)} error(s))"
        )
        if self.warnings:
            head += f", {len(self.warnings)} warning(s)"
        lines = [head]
        lines += [f"  error {f.rule}: {f.message}" for f in self.errors]
        lines += [f"  warning {f.rule}: {f.message}" for f in self.warnings]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able: ``ready``, ``model``, ``counts`` per rule and the ``findings``."""
        counts = collections.Counter(f.rule for f in self.findings)
        return {
            "ready": self.ready,
            "model": self.model,
            "counts": dict(sorted(counts.items())),
            "findings": [f.to_dict() for f in self.findings],
            "expected": [f.to_dict() for f in self.expected],
        }


def node_label(node: ir.Node) -> str:
    """The node's name, else its first output's name, else ``<unnamed OP>``."""
    if node.name:
        return node.name
    out = node.outputs[0].name if node.outputs else None
    return out or f"<unnamed {node.op_type}>"
