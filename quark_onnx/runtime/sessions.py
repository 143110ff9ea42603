"""Every onnxruntime session the quantizer builds: one set of options, one constructor, counters.

A session costs far more than its model's bytes: onnxruntime's graph, kernels and initializer
copies take about 6-7 KB per node (measured: a 5,000-node Add chain 32 MB, its 20,000-node XINT8
form 138 MB, CPU provider), so a session is built only where data runs, and each is built the same
lean way (:func:`create_session`):

* a ``ModelProto`` is serialized here and the caller's proto is not copied;
* the Python ``InferenceSession`` keeps the model bytes only to rebuild itself on
  ``set_providers``, which the CPU provider never needs: they are dropped once the session holds
  the model;
* with ``external_data_dir`` the weights stay in the model's data files (onnxruntime maps them
  read-only) and pre-packing, which would copy every Gemm/MatMul weight, is off.

A graph longer than :data:`SEGMENT_NODES` is run by :func:`run_segments` (:func:`run_outputs`
collects its values) piece by piece, one piece's session at a time, so the memory of a run is
bounded by the piece, not by the graph (the fidelity guard of a 200,000-node quantized graph: one
session over it would take ~1.3 GB).

:func:`session_options` is the one place ``SessionOptions`` are made; its keywords name what the
callers differ in (optimisation level, arena, spinning, memory pattern, Q/DQ simulation).

:data:`COUNTS` counts the sessions built and the full-model serialisations (``ir.Model`` to
``ModelProto`` in :func:`quark_onnx.model_files.load.to_proto`, a ``ModelProto`` to bytes here or on
save), so a test can hold the pipeline to a budget.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir

from quark_onnx.counters import COUNTS, Counts

__all__ = [
    "COUNTS",
    "CPU",
    "SEGMENT_NODES",
    "Counts",
    "add_outputs",
    "create_session",
    "node_count",
    "run_outputs",
    "run_segments",
    "serialize",
    "session_options",
]

#: The execution providers of every session (the quantizer runs float and Q/DQ models on CPU).
CPU = ("CPUExecutionProvider",)

_LEVELS = {
    "none": "ORT_DISABLE_ALL",
    "basic": "ORT_ENABLE_BASIC",
    "extended": "ORT_ENABLE_EXTENDED",
    "all": "ORT_ENABLE_ALL",
}


def session_options(
    *,
    optimize: str = "none",
    arena: bool = True,
    spinning: bool = True,
    mem_pattern: bool = True,
    simulate_qdq: bool = False,
    config: Mapping[str, str] | None = None,
) -> Any:  # -> onnxruntime.SessionOptions
    """The ``SessionOptions`` of a session (warnings off).

    Args:
        optimize: graph optimisation level: ``"none"`` (the model's arithmetic as the ONNX
            specification states it: the Q/DQ simulation of a quantized model), ``"basic"``,
            ``"extended"`` or ``"all"``.
        arena: onnxruntime's CPU memory arena (it keeps the buffers of the largest run for the
            session's lifetime).
        spinning: intra-op threads spin between kernels (off where Python works beside the
            session, or several sessions live at once).
        mem_pattern: plan each run's buffers into one block after the first run.
        simulate_qdq: never fuse Q/DQ pairs into int8 kernels, even when optimising.
        config: further ``add_session_config_entry`` pairs.
    """
    import onnxruntime as ort

    if optimize not in _LEVELS:
        raise ValueError(f"optimize={optimize!r}: expected one of {sorted(_LEVELS)}")
    so = ort.SessionOptions()
    so.graph_optimization_level = getattr(ort.GraphOptimizationLevel, _LEVELS[optimize])
    so.log_severity_level = 3
    so.enable_cpu_mem_arena = arena
    so.enable_mem_pattern = mem_pattern
    if not spinning:
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if simulate_qdq:
        so.add_session_config_entry("session.disable_quant_qdq", "1")
    for key, value in (config or {}).items():
        so.add_session_config_entry(key, value)
    return so


def serialize(model: onnx.ModelProto) -> bytes:
    """``model``'s bytes (one counted full-model serialisation)."""
    COUNTS.serialisations += 1
    return model.SerializeToString()


def add_outputs(proto: onnx.ModelProto, names: Sequence[str]) -> int:
    """Make the named tensors graph outputs of ``proto`` (those not already outputs, once each),
    so that a session returns them; the number added (a caller that edits a user's proto
    removes them again from the end)."""
    present = {o.name for o in proto.graph.output}
    added = [n for n in dict.fromkeys(names) if n not in present]
    proto.graph.output.extend(onnx.ValueInfoProto(name=n) for n in added)
    return len(added)


def create_session(
    model: ir.Model | onnx.ModelProto | bytes | str | os.PathLike,
    options: Any = None,
    *,
    external_data_dir: str | os.PathLike | None = None,
    providers: Sequence[str] = CPU,
    purpose: str = "",
    edit: Callable[[onnx.ModelProto], None] | None = None,
) -> Any:  # -> onnxruntime.InferenceSession
    """An onnxruntime session over ``model`` (an IR model, a proto, its bytes, or a model file).

    ``options`` defaults to :func:`session_options` (no optimisation). With
    ``external_data_dir`` the model's external tensors are read from that folder. An IR model is
    serialized here, its memory-mapped weights left as references to their files (which become
    ``external_data_dir``), then ``edit`` (if given) changes that private proto before it is
    handed over. onnxruntime's own exceptions propagate: callers
    turn them into errors that name their model.
    """
    import onnxruntime as ort

    if isinstance(model, ir.Model):
        from quark_onnx.model_files.external import external_data_dir as mapped_folder
        from quark_onnx.model_files.load import serialize_ir

        # weights still memory-mapped from the model's data files stay there: onnxruntime maps
        # them too, instead of getting them read into the proto, then into its bytes, then
        # into its own copy (a 100 MB weight: 300 MB at once)
        if external_data_dir is None:
            external_data_dir = mapped_folder(model)
        proto = serialize_ir(model, keep_external=external_data_dir is not None)
        if edit is not None:
            edit(proto)
        model = proto.SerializeToString()
        del proto  # onnxruntime parses the bytes: the proto need not live beside its session
    elif edit is not None:
        raise ValueError("edit is only applied to an ir.Model")
    if options is None:
        options = session_options()
    if external_data_dir is not None:
        _set_entries(
            options,
            {
                "session.model_external_initializers_file_folder_path": str(external_data_dir),
                "session.disable_prepacking": "1",
            },
        )
    if isinstance(model, onnx.ModelProto):
        model = serialize(model)
    elif isinstance(model, Path):
        model = str(model)
    session = ort.InferenceSession(model, options, providers=list(providers))
    COUNTS.sessions += 1
    COUNTS.purposes.append(purpose)
    # The Python session keeps the bytes only to rebuild itself after a provider fallback,
    # which the CPU provider never needs (14 MB for MobileNetV2 for the session's lifetime).
    # A private attribute: touched only when it is exactly the bytes given.
    if isinstance(model, bytes) and getattr(session, "_model_bytes", None) is model:
        session._model_bytes = None
    return session


def _set_entries(options: Any, entries: Mapping[str, str]) -> None:
    """Add config entries to ``options`` unless already set to that value (the pieces of
    :func:`run_segments` share one ``options``; onnxruntime warns on every re-set key)."""
    for key, value in entries.items():
        try:
            present = options.get_session_config_entry(key)
        except Exception:  # not set yet: onnxruntime raises rather than returning a default
            present = None
        if present != value:
            options.add_session_config_entry(key, value)


#: Most nodes one session of :func:`run_segments` holds (a session costs ~6.5 KB per node, so
#: ~27 MB), whatever the size of the graph it runs.
SEGMENT_NODES = 4096


class _Graph:
    """The top-level graph of an IR model or a proto as :func:`run_segments` reads it: nodes in
    order (ONNX requires a topological one), the names each reads and writes, where each value
    is produced and last read, and how to serialize a piece of it."""

    def __init__(self, model: ir.Model | onnx.ModelProto) -> None:
        self.model = model
        if isinstance(model, ir.Model):
            graph = model.graph
            self.nodes: list[Any] = list(graph)
            self.initializers: dict[str, Any] = dict(graph.initializers)
            self.graph_inputs = [v.name for v in graph.inputs if v.name not in self.initializers]
            self.outputs = [v.name for v in graph.outputs]
            reads = [[v.name if v is not None else "" for v in n.inputs] for n in self.nodes]
            writes = [[v.name or "" for v in n.outputs] for n in self.nodes]
            nested = [
                i
                for i, n in enumerate(self.nodes)
                if any(
                    a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS)
                    for a in n.attributes.values()
                )
            ]
            protos = {i: ir.serde.serialize_node(self.nodes[i]) for i in nested}
        else:
            graph = model.graph
            self.nodes = list(graph.node)
            self.initializers = {t.name: t for t in graph.initializer}
            self.graph_inputs = [v.name for v in graph.input if v.name not in self.initializers]
            self.outputs = [v.name for v in graph.output]
            reads = [list(n.input) for n in self.nodes]
            writes = [list(n.output) for n in self.nodes]
            protos = dict(enumerate(self.nodes))
        for i, proto in protos.items():
            # a subgraph reads outer values by name: they are inputs of its node here
            reads[i] = reads[i] + sorted(subgraph_reads(proto))
        self.reads, self.writes = reads, writes
        self.producer: dict[str, int] = {}
        self.last_use: dict[str, int] = {}
        constant = set(self.initializers)
        crossings = [0] * (len(self.nodes) + 2)  # constant-only values crossing each boundary
        for i, (r, w) in enumerate(zip(reads, writes, strict=True)):
            for x in r:
                if x:
                    self.last_use[x] = i
            for o in w:
                if o:
                    self.producer[o] = i
            if all(not x or x in constant for x in r):
                constant.update(o for o in w if o)
        for name in constant:
            p = self.producer.get(name)
            if p is not None and name in self.last_use and self.last_use[name] > p:
                crossings[p + 1] += 1
                crossings[self.last_use[name] + 1] -= 1
        self.crossed = list(itertools.accumulate(crossings))

    def cuts(self, max_nodes: int, cross: Collection[str] | None = None) -> list[tuple[int, int]]:
        """``[start, end)`` pieces of at most ``max_nodes`` nodes where possible, cut only where
        no value computed from constants alone (a dequantized weight) crosses: such a value
        would reach the next piece as an input instead of a constant.

        ``cross``: also cut only where every computed value that crosses is one of these names.
        When they are the outputs a whole-graph session would return, no optimisation of that
        session can reach across a cut either (onnxruntime never fuses away a graph output), so
        an optimised piece computes what the optimised whole graph does."""
        crossed = self.crossed if cross is None else self._crossed_except(set(cross))
        n = len(self.nodes)
        pieces, start = [], 0
        while start < n:
            end = min(start + max_nodes, n)
            b = end
            while start < b < n and crossed[b]:
                b -= 1
            if b == start:
                b = end
                while b < n and crossed[b]:
                    b += 1
            pieces.append((start, b))
            start = b
        return pieces

    def _crossed_except(self, free: set[str]) -> list[int]:
        """:attr:`crossed` plus, at each boundary, the computed values not in ``free`` that
        cross it."""
        crossings = [0] * (len(self.nodes) + 2)
        for name, p in self.producer.items():
            last = self.last_use.get(name, -1)
            if name not in free and last > p:
                crossings[p + 1] += 1
                crossings[last + 1] -= 1
        extra = itertools.accumulate(crossings)
        return [c + e for c, e in zip(self.crossed, extra, strict=True)]

    def segment_bytes(
        self, start: int, end: int, inputs: Sequence[str], outputs: Sequence[str], types: Mapping
    ) -> bytes:
        """The model of nodes ``[start, end)``: ``inputs`` typed as given (``types``: name ->
        a value of it), ``outputs`` declared by name (onnxruntime infers their types)."""
        original = set(self.graph_inputs)
        model = self.model
        if isinstance(model, ir.Model):
            nodes = [ir.serde.serialize_node(n) for n in self.nodes[start:end]]
            by_name = {v.name: v for v in model.graph.inputs}
            declared = {x: ir.serde.serialize_value(by_name[x]) for x in inputs if x in original}
            opsets = [onnx.helper.make_opsetid(d, v) for d, v in model.opset_imports.items()]
            functions = [ir.serde.serialize_function(f) for f in model.functions.values()]
            ir_version = model.ir_version
        else:
            nodes = self.nodes[start:end]
            declared = {v.name: v for v in model.graph.input if v.name in inputs}
            opsets = list(model.opset_import)
            functions = list(model.functions)
            ir_version = model.ir_version
        used = dict.fromkeys(x for r in self.reads[start:end] for x in r if x in self.initializers)
        tensors = []
        for name in used:
            t = self.initializers[name]
            tensors.append(
                ir.serde.serialize_tensor(t.const_value) if isinstance(t, ir.Value) else t
            )
        graph = onnx.GraphProto(name=f"segment_{start}_{end}")
        graph.node.extend(nodes)
        graph.initializer.extend(tensors)
        for x in inputs:
            if x in declared:
                graph.input.append(declared[x])
            else:
                dtype = onnx.helper.np_dtype_to_tensor_dtype(np.asarray(types[x]).dtype)
                graph.input.append(onnx.helper.make_tensor_value_info(x, dtype, None))
        graph.output.extend(onnx.ValueInfoProto(name=o) for o in outputs)
        proto = onnx.ModelProto(ir_version=ir_version, graph=graph)
        proto.opset_import.extend(opsets)
        proto.functions.extend(functions)
        if isinstance(model, ir.Model):
            # memory-mapped weights read in, as create_session does for a whole IR model
            from quark_onnx.model_files.external import _external_tensors, _read_external_data
            from quark_onnx.model_files.load import external_data_dir

            external = _external_tensors(proto)
            if external:
                folder = external_data_dir(model)
                _read_external_data(external, folder if folder is not None else Path.cwd())
        # a piece, not a full-model serialisation (not counted)
        return proto.SerializeToString()


def _constant(value: Any) -> np.ndarray:
    if isinstance(value, ir.Value):
        return value.const_value.numpy()
    return onnx.numpy_helper.to_array(value)


def subgraph_reads(node: onnx.NodeProto) -> set[str]:
    """Names the subgraphs of ``node`` read from outside themselves."""
    names: set[str] = set()
    for attr in node.attribute:
        for g in [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs):
            defined = {v.name for v in g.input} | {t.name for t in g.initializer}
            for n in g.node:
                defined.update(n.output)
            for n in g.node:
                names.update(x for x in n.input if x and x not in defined)
                names.update(x for x in subgraph_reads(n) if x not in defined)
    return names


def node_count(model: ir.Model | onnx.ModelProto) -> int:
    """Nodes of the top-level graph."""
    return len(model.graph) if isinstance(model, ir.Model) else len(model.graph.node)


def run_segments(
    model: ir.Model | onnx.ModelProto,
    feeds: Sequence[Mapping[str, np.ndarray]],
    outputs: Sequence[str],
    *,
    max_nodes: int | None = None,
    whole: bool | None = None,
    options: Any = None,
    external_data_dir: str | os.PathLike | None = None,
    purpose: str = "",
    cross: Collection[str] | None = None,
) -> Iterator[tuple[int, dict[str, list[np.ndarray]]]]:
    """Run ``model`` on every feed; yields ``(first, values)`` as values are computed:
    ``values[name][j]`` is ``name`` on feed ``first + j`` (every name once per feed).

    ``whole`` (default: when the graph has at most ``max_nodes`` nodes, default
    :data:`SEGMENT_NODES`): one session over the
    model as it is, run feed by feed, one feed's ``outputs`` at a time (``first`` = the feed).
    Otherwise the graph runs in pieces of at most ``max_nodes`` nodes (:meth:`_Graph.cuts`),
    piece by piece (``first`` = 0, every feed): each piece is built as its own session, run on
    every feed and dropped before the next one is built; between pieces only the values a later
    node reads (and the feeds' graph inputs) are kept. Memory is then bounded by the piece, not
    the graph, and the values are those of one session: each node runs the same kernel on the
    same inputs (the tests compare both, bit for bit, with the default options: no graph
    optimisation; with an optimising ``options``, ``cross`` = the names the whole-graph session
    returns keeps each cut where that session's optimisations cannot reach across,
    :meth:`_Graph.cuts`).
    """
    wanted = list(dict.fromkeys(outputs))
    if max_nodes is None:
        max_nodes = SEGMENT_NODES
    if whole is None:
        whole = node_count(model) <= max_nodes
    if whole:
        yield from _run_whole(model, feeds, wanted, options, external_data_dir, purpose)
        return
    graph = _Graph(model)
    inputs = set(graph.graph_inputs)
    first = {n: [np.asarray(f[n]) for f in feeds] for n in wanted if n in inputs}
    for n in wanted:  # a graph output that is an initializer
        if n in graph.initializers and n not in inputs:
            first[n] = [_constant(graph.initializers[n])] * len(feeds)
    if first:
        yield 0, first
    asked = set(wanted)
    states = [{k: v for k, v in f.items() if k in inputs} for f in feeds]
    for start, end in graph.cuts(max_nodes, cross):
        produced: dict[str, None] = {}
        reads: dict[str, None] = {}
        for r, w in zip(graph.reads[start:end], graph.writes[start:end], strict=True):
            reads.update((x, None) for x in r if x and x not in produced)
            produced.update((o, None) for o in w if o)
        needed = [x for x in reads if x not in graph.initializers and x not in produced]
        out = [o for o in produced if o in asked or graph.last_use.get(o, -1) >= end]
        if not out:
            continue
        data = graph.segment_bytes(start, end, needed, out, states[0] if states else {})
        session = create_session(
            data, options, external_data_dir=external_data_dir, purpose=purpose
        )
        del data
        for state in states:
            missing = [x for x in needed if x not in state]
            if missing:
                raise ValueError(f"a feed has no value for input {missing[0]!r}")
            values = session.run(out, {x: state[x] for x in needed})
            state.update(zip(out, values, strict=True))
        del session
        got = {o: [s[o] for s in states] for o in out if o in asked}
        for state in states:
            for name in [k for k in state if k not in inputs and graph.last_use.get(k, -1) < end]:
                del state[name]
        if got:
            yield 0, got


def _run_whole(
    model: ir.Model | onnx.ModelProto,
    feeds: Sequence[Mapping[str, np.ndarray]],
    names: list[str],
    options: Any,
    external_data_dir: str | os.PathLike | None,
    purpose: str,
) -> Iterator[tuple[int, dict[str, list[np.ndarray]]]]:
    """One session over the whole model with ``names`` added as outputs (the model not copied:
    a proto gets them only while it is serialized), feed by feed."""
    if isinstance(model, ir.Model):
        session = create_session(
            model,
            options,
            external_data_dir=external_data_dir,
            purpose=purpose,
            edit=lambda p: add_outputs(p, names),
        )
    else:
        added = add_outputs(model, names)
        try:
            data = serialize(model)
        finally:
            del model.graph.output[len(model.graph.output) - added :]
        session = create_session(
            data, options, external_data_dir=external_data_dir, purpose=purpose
        )
    accepted = {i.name for i in session.get_inputs()}
    for i, feed in enumerate(feeds):
        values = session.run(names, {k: v for k, v in feed.items() if k in accepted})
        yield i, {n: [v] for n, v in zip(names, values, strict=True)}


def run_outputs(
    model: ir.Model | onnx.ModelProto,
    feeds: Sequence[Mapping[str, np.ndarray]],
    outputs: Sequence[str] | None = None,
    **kwargs: Any,
) -> list[dict[str, np.ndarray]]:
    """:func:`run_segments` collected: per feed, ``{name: value}`` of ``outputs`` (default: the
    graph outputs, in their order)."""
    names = list(dict.fromkeys(outputs)) if outputs is not None else _output_names(model)
    runs: list[dict[str, np.ndarray]] = [{} for _ in feeds]
    for first, got in run_segments(model, feeds, names, **kwargs):
        for name, values in got.items():
            for j, v in enumerate(values):
                runs[first + j][name] = v
    return [{n: run[n] for n in names} for run in runs]


def _output_names(model: ir.Model | onnx.ModelProto) -> list[str]:
    if isinstance(model, ir.Model):
        return [v.name for v in model.graph.outputs]
    return [v.name for v in model.graph.output]
