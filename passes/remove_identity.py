"""RemoveIdentity: drop Identity nodes, which pass their input through unchanged.

Exporters leave them between layers (paddle2onnx: one after most Convs and activations; the
PP-OCRv5 text detector has 192). Simplification (``optimize_model``) removes them; without it
every pass that follows a layer's output to its readers stops at the Identity (a Conv read by an
Identity is not a Conv read by its activation). A graph output keeps its name: the value before
the Identity takes it, unless that value is a graph input too (then the node stays). Wraps
onnx_ir's ``IdentityEliminationPass``. The outputs are the same bits.
"""

from __future__ import annotations

import onnx_ir as ir
from onnx_ir.passes.common import IdentityEliminationPass

from quark_onnx.passes.base import QuarkPass


class RemoveIdentity(QuarkPass):
    """Remove Identity nodes (see the module docstring)."""

    #: Every remaining node computes what it did from the same inputs.
    preserves_outputs = True

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        return IdentityEliminationPass()(model)
