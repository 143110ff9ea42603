"""Compatibility name of :mod:`quark_onnx.npu.solver` (the NPU position solver)."""

from __future__ import annotations

from quark_onnx.npu.rules import Violation
from quark_onnx.npu.solver import (
    MAX_LOCAL_STEPS,
    RAISE_PENALTY,
    Adjustment,
    SolveResult,
    solve_positions,
    verify,
)

__all__ = [
    "MAX_LOCAL_STEPS",
    "RAISE_PENALTY",
    "Adjustment",
    "SolveResult",
    "Violation",
    "solve_positions",
    "verify",
]
