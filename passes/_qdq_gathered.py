"""Embedding tables in the gathered-rows form: when InsertQDQ writes a table that way, and how a
reader of the QDQ model gets the standard DequantizeLinear form back.

A 2-D table read only by ``Gather`` (axis 0), quantized per row with zero points 0 (or to a Cast
type), is written as ``Gather(codes)``, ``Gather(row scales)``, ``Cast * scales``
(:meth:`~quark_onnx.passes._qdq_writer.QDQWriter._gathered_table`); the Cast carries
``_GATHERED_MARK`` + the table's name so that :func:`restore_gathered_tables` can undo it.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from quark_onnx.config.enums import QuantType
from quark_onnx.graph.ir import NameGenerator, add_initializer, constant_array, is_standard
from quark_onnx.params.qparams import QuantParams

#: doc_string prefix of the Cast of a gathered embedding table, followed by the table's name
_GATHERED_MARK = "quark_onnx:gathered:"


def restore_gathered_tables(graph: ir.Graph) -> int:
    """Undo the gathered-rows form of embedding tables (``QDQWriter._gathered_table``): each
    table's codes get the DequantizeLinear (or Cast) form back, read by the original ``Gather``,
    so a reader of QDQ models sees the standard pattern with the same parameters (per row, zero
    points 0). Returns the number of Gather nodes restored."""
    names = NameGenerator(graph)
    tables: dict[str, ir.Value] = {}
    row_scales: list[ir.Value] = []
    restored = 0
    for cast in list(graph):
        if cast.op_type != "Cast" or not (cast.doc_string or "").startswith(_GATHERED_MARK):
            continue
        table = cast.doc_string[len(_GATHERED_MARK) :]
        codes_gather = cast.inputs[0].producer()
        codes, indices = codes_gather.inputs[0], codes_gather.inputs[1]
        uses = list(cast.outputs[0].uses())
        mul = uses[0].node if len(uses) == 1 and uses[0].node.op_type == "Mul" else None
        final = (mul or cast).outputs[0]
        if table not in tables:
            f32 = ir.TensorType(ir.DataType.FLOAT)
            if mul is not None:
                scale_rows = mul.inputs[1].producer().inputs[0]
                row_scales.append(scale_rows)
                rows = constant_array(scale_rows).reshape(-1).astype(np.float32)
                code_dtype = constant_array(codes).dtype
                scale = add_initializer(graph, names(f"{table}_scale"), rows)
                zero = add_initializer(
                    graph, names(f"{table}_zero_point"), np.zeros(rows.shape, code_dtype)
                )
                out = ir.Value(name=names(f"{table}_DequantizeLinear_Output"), type=f32)
                node = ir.Node(
                    "",
                    "DequantizeLinear",
                    [codes, scale, zero],
                    attributes=[ir.AttrInt64("axis", 0)],
                    outputs=[out],
                    name=names(f"{table}_DequantizeLinear"),
                )
            else:
                out = ir.Value(name=names(f"{table}_CastFloat_Output"), type=f32)
                node = ir.node(
                    "Cast",
                    [codes],
                    {"to": ir.DataType.FLOAT},
                    outputs=[out],
                    name=names(f"{table}_CastFloat"),
                )
            graph.insert_before(codes_gather, node)
            tables[table] = out
        base = (codes_gather.name or "Gather").removesuffix("_QuantizedGather")
        new_out = ir.Value(name=names(f"{base}_restored"), shape=final.shape)
        gather = ir.node(
            "Gather", [tables[table], indices], {"axis": 0}, outputs=[new_out], name=base
        )
        graph.insert_before(codes_gather, gather)
        old_name = final.name
        final.replace_all_uses_with(new_out, replace_graph_outputs=True)
        scale_gather = mul.inputs[1].producer() if mul is not None else None
        for dead in (mul, scale_gather, cast, codes_gather):
            if dead is not None and not any(o.uses() for o in dead.outputs):
                graph.remove(dead, safe=True)
        new_out.name = old_name
        restored += 1
    for value in row_scales:  # the [V, 1] row scales of the gathered form
        if not value.uses() and value.name in graph.initializers and not value.is_graph_input():
            graph.initializers.pop(value.name)
    return restored


def _gathers_rows(value: ir.Value, array: np.ndarray, params: QuantParams) -> bool:
    """``value`` is a 2-D table read only by ``Gather`` (axis 0, slot 0), quantized per row
    with zero points 0 (or a Cast type): its rows can be dequantized after the lookup."""
    if array.ndim != 2 or value.is_graph_output() or params.block_size is not None:
        return False
    if params.qtype is QuantType.QFLOAT8E4M3FN:
        return False  # Gather takes no float8 (onnx 1.23 schema): DequantizeLinear of the table
    if not params.is_cast:
        if params.axis not in (0, -2) or params.zero_point is None:
            return False
        if np.any(np.asarray(params.zero_point).astype(np.float32) != 0):
            return False
    uses = list(value.uses())
    return bool(uses) and all(
        is_standard(use.node, "Gather")
        and use.idx == 0
        and use.node.attributes.get_int("axis", 0) == 0
        for use in uses
    )
