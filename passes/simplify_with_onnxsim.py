"""SimplifyWithOnnxsim: constant folding and graph clean-up by onnxsim (``optimize_model``).

onnxsim folds every subgraph whose inputs are constants (``Shape``/``Gather``/``Concat`` chains,
``ConstantOfShape``, weight transposes), runs onnx's shape inference, and applies onnxoptimizer's
float-exact fusions (for example BatchNormalization into the preceding Conv, identity and dropout
elimination). It then checks the simplified model against the original on random inputs
(``check_n`` runs) and reports ``check_ok``.

The simplification runs on a serialized copy. Only when onnxsim returns and says ``check_ok``
does the model take the simplified graph (in place: the same ``ir.Model`` object receives the new
graph, functions and IR version). When onnxsim raises or its check fails, a warning names the
model and onnxsim's reason and the model is returned unchanged (``modified=False``): a failed
simplification never stops quantization.

Size limit: onnxsim works on the whole serialized model and holds several full copies of it at
once (measured: peak RSS about 5x the model). A model whose tensors add up to more than
``max_model_bytes`` (default :data:`MAX_MODEL_BYTES`, 1 GiB; external weights count, without
being read) is not simplified: a warning names the model, its size and the limit, and the pass
reports ``modified=False``. Below the limit, weights memory-mapped from external data are read
into the copy given to onnxsim, except the large ones (:data:`HOLD_BYTES`) that no
constant-foldable node reads (a MatMul or Conv weight applied to the model's input): onnxsim
could not fold anything through them, yet would copy them several times (a 100 MB MatMul
weight peaked at 620 MB here). They are handed to onnxsim as graph inputs of the same type and
shape and become initializers again afterwards, holding the original (memory-mapped) tensors;
onnxsim's fusions that need a weight's values (BatchNormalization into Conv) are then left to
the quantizer's own ConvertBNToConv.

``onnxsim`` is imported inside the pass, so importing :mod:`quark_onnx.passes` does not load it.
"""

from __future__ import annotations

import logging
from typing import Any

import onnx
import onnx_ir as ir

from quark_onnx.model_files.external import model_bytes
from quark_onnx.model_files.load import to_proto
from quark_onnx.passes.base import QuarkPass

logger = logging.getLogger(__name__)

#: Models whose tensors exceed this many bytes are not given to onnxsim.
MAX_MODEL_BYTES = 1 << 30
#: Initializers of at least this many bytes that no constant-foldable node reads are kept out of
#: onnxsim's copy (see the module docstring).
HOLD_BYTES = 16 << 20
_GIB = float(1 << 30)


def _structure(graph: onnx.GraphProto) -> tuple:
    """What the graph computes, ignoring node names and value_info (onnxsim adds both)."""
    nodes = tuple(
        (
            n.op_type,
            n.domain,
            tuple(n.input),
            tuple(n.output),
            tuple(a.SerializeToString(deterministic=True) for a in n.attribute),
        )
        for n in graph.node
    )
    initializers = tuple(sorted((t.name, tuple(t.dims), t.data_type) for t in graph.initializer))
    return (
        nodes,
        initializers,
        tuple(i.name for i in graph.input),
        tuple(o.name for o in graph.output),
    )


def _op_domains(graph: onnx.GraphProto) -> set[str]:
    """The operator domains used by the nodes of ``graph`` ('' for the standard domain)."""
    return {"" if n.domain == "ai.onnx" else n.domain for n in graph.node}


def _all_constant(node: ir.Node, constant: set[str]) -> bool:
    return all(v is None or v.name in constant for v in node.inputs)


def _held_initializers(graph: ir.Graph) -> list[ir.Value]:
    """The initializers of at least :data:`HOLD_BYTES` that onnxsim cannot fold through: every
    node reading them has an input that is not constant (computed from the graph's inputs)."""
    constant = set(graph.initializers)
    for node in graph:
        if _all_constant(node, constant):
            constant.update(o.name for o in node.outputs if o.name)
    held = []
    for value in graph.initializers.values():
        tensor = value.const_value
        if tensor is None or tensor.nbytes < HOLD_BYTES:
            continue
        if value.is_graph_input() or value.is_graph_output():
            continue
        uses = [node for node, _ in value.uses()]
        if uses and all(
            node.graph is graph
            and any(v is not None and v.name not in constant for v in node.inputs)
            for node in uses
        ):
            held.append(value)
    return held


def _proto_without(model: ir.Model, held: list[ir.Value]) -> onnx.ModelProto:
    """``model`` serialized (external weights read in) with ``held`` as graph inputs, their
    bytes neither read nor copied; ``model`` is left as it was."""
    graph = model.graph
    for value in held:
        graph.initializers.pop(value.name)
    try:
        proto = to_proto(model)
    finally:
        for value in held:
            graph.register_initializer(value)
    for value in held:
        proto.graph.input.append(ir.serde.serialize_value(value))
    return proto


def _restore(new: ir.Model, held: list[ir.Value]) -> None:
    """Turn the graph inputs standing for ``held`` back into initializers holding the original
    tensors (an input onnxsim removed, its weight no longer read, is left out)."""
    inputs = {v.name: v for v in new.graph.inputs}
    for value in held:
        stand_in = inputs.get(value.name)
        if stand_in is None:
            continue
        new.graph.inputs.remove(stand_in)
        stand_in.const_value = value.const_value
        new.graph.register_initializer(stand_in)


def _model_label(model: ir.Model) -> str:
    name = model.graph.name or "<unnamed graph>"
    producer = model.producer_name
    return f"{name!r} (producer {producer!r})" if producer else repr(name)


class SimplifyWithOnnxsim(QuarkPass):
    """Simplify the model with ``onnxsim.simplify``; keep the original if that fails.

    Args:
        check_n: random-input checks onnxsim runs against the original (0: structural check
            only).
        skip_fuse_bn: do not let onnxsim fold BatchNormalization into Conv.
        skipped_optimizers: onnxoptimizer pass names onnxsim must not run.
        max_model_bytes: models with more bytes of tensors are left as they are (None:
            :data:`MAX_MODEL_BYTES`).
    """

    def __init__(
        self,
        check_n: int = 0,
        skip_fuse_bn: bool = False,
        skipped_optimizers: tuple[str, ...] = (),
        max_model_bytes: int | None = None,
    ) -> None:
        super().__init__()
        self.check_n = int(check_n)
        self.skip_fuse_bn = skip_fuse_bn
        self.skipped_optimizers = tuple(skipped_optimizers)
        self.max_model_bytes = max_model_bytes

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        label = _model_label(model)
        limit = MAX_MODEL_BYTES if self.max_model_bytes is None else self.max_model_bytes
        size = model_bytes(model)
        if size > limit:
            logger.warning(
                "optimize_model: model %s holds %.2f GiB of tensors, above the %.2f GiB limit "
                "for onnxsim (which holds several serialized copies of the whole model); not "
                "simplified",
                label,
                size / _GIB,
                limit / _GIB,
            )
            return ir.passes.PassResult(model, modified=False)
        try:
            import onnxsim
        except ImportError as exc:
            logger.warning(
                "optimize_model: onnxsim not importable (%s); model %s not simplified", exc, label
            )
            return ir.passes.PassResult(model, modified=False)
        held = _held_initializers(model.graph)
        # external weights read in (onnxsim needs the values), but for the held ones
        proto = _proto_without(model, held) if held else to_proto(model)
        before = _structure(proto.graph)
        try:
            simplified, check_ok = self._simplify(onnxsim, proto, optimize=True)
            added = _op_domains(simplified.graph) - _op_domains(proto.graph)
            if added:
                # onnxsim's fusions can emit runtime-specific ops (com.microsoft Attention, ...)
                # that no quantizer policy covers and the NPU flow cannot take: keep standard ops,
                # folding constants and inferring shapes only
                logger.info(
                    "optimize_model: onnxsim's fusions on model %s produce ops of domain(s) %s; "
                    "simplifying without fusions instead",
                    label,
                    ", ".join(sorted(added)),
                )
                simplified, check_ok = self._simplify(onnxsim, proto, optimize=False)
        except Exception as exc:  # onnxsim raises bare RuntimeErrors from C++
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            logger.warning(
                "optimize_model: onnxsim failed on model %s (%s: %s); continuing with the "
                "unsimplified model",
                label,
                type(exc).__name__,
                reason,
            )
            return ir.passes.PassResult(model, modified=False)
        if not check_ok:
            logger.warning(
                "optimize_model: onnxsim's check failed on model %s (the simplified model's "
                "outputs differ from the original); continuing with the unsimplified model",
                label,
            )
            return ir.passes.PassResult(model, modified=False)
        if _structure(simplified.graph) == before:
            return ir.passes.PassResult(model, modified=False)
        new = ir.serde.deserialize_model(simplified)
        if held:
            _restore(new, held)
        nodes_before = len(proto.graph.node)
        model.graph = new.graph
        model.ir_version = new.ir_version
        model.functions.clear()
        model.functions.update(new.functions)
        logger.info(
            "optimize_model: onnxsim simplified %s: %d -> %d nodes",
            label,
            nodes_before,
            len(simplified.graph.node),
        )
        return ir.passes.PassResult(model, modified=True)

    def _simplify(
        self, onnxsim: Any, proto: onnx.ModelProto, *, optimize: bool
    ) -> tuple[onnx.ModelProto, bool]:
        return onnxsim.simplify(
            proto,
            check_n=self.check_n,
            perform_optimization=optimize,
            skip_fuse_bn=self.skip_fuse_bn,
            skipped_optimizers=list(self.skipped_optimizers) or None,
        )
