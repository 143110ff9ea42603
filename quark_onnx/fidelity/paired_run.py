"""Run a model as it was before a graph pass and as it is after, in one onnxruntime session.

Measuring a numerics-changing pass needs the float outputs on the same samples before and after
it. A pass usually rewrites a few nodes (ConvertAvgPoolToDPUVersion: one pooling node near the
end), so two full runs compute the unchanged part of the graph twice. :func:`run_before_after`
builds one graph holding the model before the pass plus, under new names, only the nodes and
tensors of the model after it that differ or read something that differs; one run per sample
gives both sets of outputs. Every node computes exactly what it computes in its own model (the
same kernel on the same input values), so the values are those of two separate runs, bit for bit
(``tests/fidelity/test_paired_run.py`` compares them).

The combined graph is not built (:func:`run_before_after` returns None, and the caller runs the
two models separately) when the models cannot be paired simply: different inputs, opsets,
local functions or sparse initializers, a node holding a subgraph (whose outer-scope reads carry
no names to follow), or a graph longer than ``runtime.SEGMENT_NODES`` (run in pieces to bound a
session's memory).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import onnx
import onnx_ir as ir

Feeds = dict[str, np.ndarray]

#: Suffix of the names the after-pass copies of changed tensors take in the combined graph.
SUFFIX = "__after_pass"


def _has_subgraph(graph: onnx.GraphProto) -> bool:
    return any(
        a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
        for node in graph.node
        for a in node.attribute
    )


def _all_names(graph: onnx.GraphProto) -> set[str]:
    names = {i.name for i in graph.input} | {t.name for t in graph.initializer}
    for node in graph.node:
        names.update(node.input)
        names.update(node.output)
    return names


def combine(before: onnx.ModelProto, after: onnx.ModelProto) -> tuple[onnx.ModelProto, list[str]]:
    """``before`` with the changed part of ``after`` added; the combined graph's names of
    ``after``'s outputs, in their order. ``before`` is extended in place and returned.

    Raises:
        ValueError: the two models cannot be combined simply (see the module docstring).
    """
    bg, ag = before.graph, after.graph
    if (
        [(o.domain, o.version) for o in before.opset_import]
        != [(o.domain, o.version) for o in after.opset_import]
        or before.functions
        or after.functions
        or bg.sparse_initializer
        or ag.sparse_initializer
        or [i.SerializeToString() for i in bg.input] != [i.SerializeToString() for i in ag.input]
        or _has_subgraph(bg)
        or _has_subgraph(ag)
    ):
        raise ValueError("the models before and after the pass cannot be paired")
    taken = _all_names(bg) | _all_names(ag)
    if any(name + SUFFIX in taken for name in taken if name):
        raise ValueError("a tensor name already ends with the pairing suffix")
    renamed: dict[str, str] = {}  # after-model name -> combined name, for changed values
    old_tensors = {t.name: t for t in bg.initializer}
    for tensor in ag.initializer:
        old = old_tensors.get(tensor.name)
        if old is None or old.SerializeToString() != tensor.SerializeToString():
            renamed[tensor.name] = tensor.name + SUFFIX
            copy = bg.initializer.add()
            copy.CopyFrom(tensor)
            copy.name = renamed[tensor.name]
    old_nodes = {node.SerializeToString() for node in bg.node}
    for node in ag.node:
        # a node is shared when it is a node of the model before, reading nothing changed
        if not any(name in renamed for name in node.input) and (
            node.SerializeToString() in old_nodes
        ):
            continue
        copy = bg.node.add()
        copy.CopyFrom(node)
        if copy.name:
            copy.name += SUFFIX
        for i, name in enumerate(copy.input):
            copy.input[i] = renamed.get(name, name)
        for i, name in enumerate(copy.output):
            if name:
                renamed[name] = name + SUFFIX
                copy.output[i] = renamed[name]
    for info in ag.value_info:
        if info.name in renamed:
            copy = bg.value_info.add()
            copy.CopyFrom(info)
            copy.name = renamed[info.name]
    outputs = []
    existing = {o.name for o in bg.output}
    for info in ag.output:
        name = renamed.get(info.name, info.name)
        outputs.append(name)
        if name not in existing:
            copy = bg.output.add()
            copy.CopyFrom(info)
            copy.name = name
            existing.add(name)
    return before, outputs


class _Unpaired(Exception):
    """The models cannot be combined (raised through the session's build, caught here)."""


def run_before_after(
    before: ir.Model,
    after: ir.Model,
    feeds: Sequence[Feeds],
    edit: Callable[[onnx.ModelProto], None] | None = None,
) -> tuple[list[dict[str, np.ndarray]], list[dict[str, np.ndarray]]] | None:
    """The outputs of ``before`` and of ``after`` on each feed (two lists of ``{output: value}``),
    from one session. ``edit`` changes each model's proto before they are combined, as
    :func:`quark_onnx.runtime.sessions.create_session`'s ``edit`` would for a session of its own.
    None when the two models cannot be paired (run them separately then). onnxruntime's exceptions
    propagate.
    """
    from quark_onnx.model_files.load import serialize_ir
    from quark_onnx.runtime import sessions

    if len(before.graph) + len(after.graph) > sessions.SEGMENT_NODES:
        return None
    names: dict[str, list[str]] = {}

    def build(proto: onnx.ModelProto) -> None:
        # ``proto`` is the session's private copy of ``before``: it becomes the combined model
        other = serialize_ir(after)
        if edit is not None:
            edit(proto)
            edit(other)
        names["before"] = [o.name for o in proto.graph.output]
        names["after"] = [o.name for o in other.graph.output]
        try:
            names["combined"] = combine(proto, other)[1]
        except ValueError as exc:
            raise _Unpaired from exc

    try:
        session = sessions.create_session(before, purpose="run_model", edit=build)
    except _Unpaired:
        return None
    before_names, after_names = names["before"], names["after"]
    fetch = list(dict.fromkeys([*before_names, *names["combined"]]))
    runs_before, runs_after = [], []
    for feed in feeds:
        values = dict(zip(fetch, session.run(fetch, feed), strict=True))
        runs_before.append({name: values[name] for name in before_names})
        runs_after.append(
            {name: values[key] for name, key in zip(after_names, names["combined"], strict=True)}
        )
    return runs_before, runs_after
