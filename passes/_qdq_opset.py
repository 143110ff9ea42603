"""The opset and IR version InsertQDQ's nodes need, and the conversion that raises a model to them.

See "Opset" in :mod:`quark_onnx.passes.insert_qdq`: each written node needs a default-domain
opset; a model below the highest need is converted with ``onnx.version_converter`` (refused for
ops whose meaning changes with no safe adapter), and the IR version is raised for the types.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

import onnx
import onnx_ir as ir

from quark_onnx.config.enums import QuantType
from quark_onnx.errors import PassError
from quark_onnx.params.qparams import QuantParams

# the pass's logger: these are InsertQDQ's messages, and the CLI prints the logger's name
logger = logging.getLogger("quark_onnx.passes.insert_qdq")

_OPSET_21_TYPES = frozenset(
    {QuantType.QInt16, QuantType.QUInt16, QuantType.QInt4, QuantType.QUInt4}
)
_IR_FOR_TYPE = {QuantType.QFLOAT8E4M3FN: 9, QuantType.QInt4: 10, QuantType.QUInt4: 10}
_DEFAULT_DOMAINS = ("", "ai.onnx")
#: (op type, opset) whose meaning changed with no ``onnx.version_converter`` adapter that keeps
#: it: converting a model that uses the op across that opset would silently change the model.
#: GroupNormalization-21 takes per-channel scale/bias where 18 took per-group ones (measured with
#: onnx 1.23: the converted model fails in onnxruntime).
_UNSAFE_UPGRADES = {("GroupNormalization", 21)}


def required_opset(params: QuantParams) -> int:
    """The lowest default-domain opset in which the nodes written for ``params`` exist."""
    qtype = params.qtype
    need = 10
    if params.axis is not None:
        need = 13
    if params.is_cast:
        need = 13 if qtype is QuantType.QBFloat16 else need
    elif params.dynamic and not params.symmetric:
        need = max(need, 11)
    if qtype is QuantType.QFLOAT8E4M3FN:
        need = max(need, 19)
    if qtype in _OPSET_21_TYPES or params.block_size is not None:
        need = max(need, 21)
    return need


def _raise_opset(model: ir.Model, tensors: Sequence[tuple[str, QuantParams]]) -> bool:
    """Convert the model to the opset the written nodes need; True when it was converted."""
    current = model.opset_imports.get("", model.opset_imports.get("ai.onnx"))
    needs = [(required_opset(params), name, params) for name, params in tensors]
    need, tensor, params = max(needs, key=lambda t: t[0])
    if current is None:
        model.opset_imports[""] = need
        return False
    if current >= need:
        return False
    blocker = _unsafe_upgrade(model, current, need)
    if blocker is not None:
        raise PassError(
            f"InsertQDQ: tensor {tensor} ({params.qtype.name}, {params.granularity}) needs "
            f"opset {need}, but the model is opset {current} and its {blocker} node(s) change "
            f"meaning at opset {need} with no safe conversion. Upgrade the model's opset "
            "first, or choose a type the opset supports"
        )
    logger.info(
        "InsertQDQ: converting the model from opset %d to %d (tensor %s is %s)",
        current,
        need,
        tensor,
        params.qtype.name,
    )
    try:
        proto = ir.serde.serialize_model(model)
        external = _external_as_inputs(proto)
        converted = onnx.version_converter.convert_version(proto, need)
        converted.ir_version = max(converted.ir_version, _min_ir_version(need))
        onnx.checker.check_model(converted)
        new = ir.serde.deserialize_model(converted)
        _restore_initializers(new.graph, model.graph, external)
    except Exception as error:  # the converter raises plain RuntimeError/ValidationError
        raise PassError(
            f"InsertQDQ: tensor {tensor} ({params.qtype.name}, {params.granularity}) needs "
            f"opset {need}, but the model (opset {current}) could not be converted: {error}. "
            "Upgrade the model's opset first, or choose a type the opset supports"
        ) from error
    model.graph = new.graph
    model.ir_version = new.ir_version
    model.functions.clear()
    model.functions.update(new.functions)
    return True


def _external_as_inputs(proto: onnx.ModelProto) -> dict[str, bool]:
    """Turn the main graph's initializers kept in external files into graph inputs of the same
    type; return their names (-> whether each was a graph input already).

    Why: the converter and the checker look for an external file relative to the working
    directory (a proto has no folder), and the conversion rewrites nodes, never weights, so the
    weights stay where they are, as the loaded model's tensors (:func:`_restore_initializers`).
    """
    inputs = {value.name for value in proto.graph.input}
    external: dict[str, bool] = {}
    kept = []
    for tensor in proto.graph.initializer:
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            kept.append(tensor)
            continue
        external[tensor.name] = tensor.name in inputs
        if tensor.name not in inputs:
            proto.graph.input.append(
                onnx.helper.make_tensor_value_info(tensor.name, tensor.data_type, tensor.dims)
            )
    if external:
        del proto.graph.initializer[:]
        proto.graph.initializer.extend(kept)
    return external


def _restore_initializers(graph: ir.Graph, original: ir.Graph, external: dict[str, bool]) -> None:
    """Give the converted ``graph`` back the initializers :func:`_external_as_inputs` made
    inputs: the same tensors as in ``original`` (still mapped from their files)."""
    if not external:
        return
    values = {value.name: value for value in graph.inputs}
    for name, was_input in external.items():
        value = values[name]
        if not was_input:
            graph.inputs.remove(value)
        value.const_value = original.initializers[name].const_value
        graph.register_initializer(value)


def _raise_ir_version(model: ir.Model, params: Iterable[QuantParams]) -> None:
    need = max((_IR_FOR_TYPE.get(p.qtype, 0) for p in params), default=0)
    if need > model.ir_version:
        model.ir_version = need


def _unsafe_upgrade(model: ir.Model, current: int, target: int) -> str | None:
    """The first op type of ``model`` that would change meaning between the two opsets."""
    ops = {
        node.op_type
        for node in ir.traversal.RecursiveGraphIterator(model.graph)
        if node.domain in _DEFAULT_DOMAINS
    }
    for op, version in sorted(_UNSAFE_UPGRADES):
        if op in ops and current < version <= target:
            return op
    return None


def _min_ir_version(opset: int) -> int:
    return int(onnx.helper.find_min_ir_version_for([onnx.helper.make_opsetid("", opset)]))
