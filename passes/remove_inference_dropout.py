"""RemoveInferenceDropout: drop Dropout nodes, which are identities at inference.

A Dropout is removed when its mask output (if any) is unused and it is not in training mode
(``training_mode`` input absent, or a constant false). Its consumers then read its input directly;
when its output is a graph output the node becomes an Identity instead, so output names stay.
Float-preserving: onnxruntime's inference Dropout returns its input unchanged. Exporters leave
such nodes behind (SqueezeNet 1.1 has one) and the NPU has no Dropout, so each one would split
the model into two NPU partitions.
"""

from __future__ import annotations

import onnx_ir as ir

from quark_onnx.graph.ir import constant_array
from quark_onnx.passes.base import QuarkPass


def _removable(node: ir.Node) -> bool:
    if node.op_type != "Dropout" or node.domain not in ("", "ai.onnx"):
        return False
    if len(node.outputs) > 1 and node.outputs[1].uses():
        return False  # the mask is read
    if len(node.outputs) > 1 and node.outputs[1].is_graph_output():
        return False
    if len(node.inputs) > 2 and node.inputs[2] is not None:
        training = constant_array(node.inputs[2])
        if training is None or bool(training):
            return False
    return node.inputs[0] is not None


class RemoveInferenceDropout(QuarkPass):
    """Remove inference-mode Dropout nodes (see the module docstring)."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        modified = False
        for node in [n for n in graph if _removable(n)]:
            out = node.outputs[0]
            if out.is_graph_output():
                identity = ir.node("Identity", [node.inputs[0]], name=node.name)
                graph.insert_before(node, identity)
                out.replace_all_uses_with(identity.outputs[0], replace_graph_outputs=True)
                identity.outputs[0].name = out.name if out.name else identity.outputs[0].name
            else:
                out.replace_all_uses_with(node.inputs[0])
            graph.remove(node, safe=True)
            modified = True
        return ir.passes.PassResult(model, modified=modified)
