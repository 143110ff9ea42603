"""Which tensors calibration reads, and from where: :func:`plan_reads`.

Every calibrated tensor is one of four kinds (:class:`ReadPlan`):

* read from the session (``sources``): intermediate values and graph outputs become extra outputs
  of the calibration session;
* fed (``fed``): graph inputs, observed from the feeds themselves;
* constant (``constants``): initializers, observed once from their values;
* derived (``derived``): tensors whose statistics follow exactly from other calibrated tensors,
  not read at all: ``Relu(x)`` from ``x`` (positive part, the rest counted as zeros), ``Concat``
  from its inputs (merged observers), and the outputs of ops whose row in the NPU op table says
  they pass their input's values (``Identity``/``Reshape``/``Flatten``/``Squeeze``/``Unsqueeze``/
  ``Transpose``...) and inference ``Dropout`` from their input. With a moving average only the
  last kind derives (batch-wise averages do not commute with Relu or Concat).

The element types come from shape inference on :func:`inference_copy` (the weights' names,
types and dims but not their bytes): inferring on the model itself copies every weight four times
(Python to C++ and back), ~45 MB transient on MobileNetV2, which the heap then keeps.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
from collections.abc import Sequence

import numpy as np
import onnx

from quark_onnx.calibration.observers import Observer
from quark_onnx.calibration.readers import InputSpec
from quark_onnx.config.options import closest_name
from quark_onnx.errors import CalibrationError
from quark_onnx.model_files.external import copy_fields, fits_in_protobuf
from quark_onnx.npu.ops import spec

logger = logging.getLogger(__name__)

_FLOAT_TYPES = {
    onnx.TensorProto.FLOAT,
    onnx.TensorProto.FLOAT16,
    onnx.TensorProto.DOUBLE,
    onnx.TensorProto.BFLOAT16,
}

#: Initializers up to this many elements keep their values in the shape-inference copy: the
#: inputs whose values shape inference reads (Reshape/Expand/ConstantOfShape shapes, Slice/Pad/
#: Tile/Resize/Range/TopK/Split/reduction parameters) have at most a few per axis.
INFERENCE_KEEPS_VALUES = 4096


def inference_copy(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` for shape inference: every field copied but the values of large initializers.

    A large initializer keeps its name, type and dims (all that shape inference takes from a tensor
    it does not read), so the inferred types and shapes are those of the whole model.
    """
    light = onnx.ModelProto()
    copy_fields(model, light, {"graph"})
    copy_fields(model.graph, light.graph, {"initializer"})
    for t in model.graph.initializer:
        if math.prod(t.dims) <= INFERENCE_KEEPS_VALUES:
            light.graph.initializer.add().CopyFrom(t)
        else:
            light.graph.initializer.add(name=t.name, data_type=t.data_type, dims=t.dims)
    return light


@dataclasses.dataclass
class ReadPlan:
    """Where each calibrated tensor's statistics come from (module doc)."""

    #: element type of every value whose type is known (inputs, inferred values, initializers)
    types: dict[str, int]
    #: the inferred type of every value (shape included), for the batching decision
    shapes: dict[str, onnx.TypeProto]
    sources: list[str]
    fed: list[str]
    constants: dict[str, np.ndarray]
    #: ``(name, rule, sources)`` in graph order; rule is "same", "relu" or "merge"
    derived: list[tuple[str, str, list[str]]]


def plan_reads(
    model: onnx.ModelProto,
    names: Sequence[str],
    specs: Sequence[InputSpec],
    moving_average: bool,
) -> ReadPlan:
    """The :class:`ReadPlan` of ``names`` (each once) in ``model``.

    Raises:
        CalibrationError: a name that is not a graph input, initializer or node output of the
            main graph, or a tensor that is not float.
    """
    graph = model.graph
    producers = {out for node in graph.node for out in node.output if out}
    inits = {t.name: t for t in graph.initializer}
    input_names = {s.name for s in specs}
    known = producers | set(inits) | input_names
    missing = [n for n in names if n not in known]
    if missing:
        close = closest_name(missing[0], known)
        hint = f" (did you mean {close!r}?)" if close else ""
        raise CalibrationError(
            f"tensor {missing[0]!r}{hint} is not a graph input, initializer or node output of "
            f"the model's main graph" + (f"; {len(missing)} such names" if len(missing) > 1 else "")
        )
    types, shapes = _value_types(model)
    for name in names:
        elem = types.get(name)
        if elem is not None and elem not in _FLOAT_TYPES:
            raise CalibrationError(
                f"tensor {name!r} has type {onnx.TensorProto.DataType.Name(elem)}; only float "
                "tensors can be calibrated"
            )
    wanted = set(names)
    plan = ReadPlan(types, shapes, [], [], {}, [])
    derived_names: set[str] = set()
    for node in graph.node:  # topological order
        for out in node.output:
            if out not in wanted:
                continue
            rule = _derivation(node, out, wanted, moving_average)
            if rule is not None:
                plan.derived.append(
                    (out, rule, list(node.input[:1] if rule != "merge" else node.input))
                )
                derived_names.add(out)
    for name in names:
        if name in derived_names:
            continue
        if name in input_names:
            plan.fed.append(name)
        elif name in inits:
            plan.constants[name] = onnx.numpy_helper.to_array(inits[name])
        else:
            plan.sources.append(name)
    return plan


def _same_values(op_type: str) -> bool:
    """The op's output values are input values (its row in the NPU op table says so)."""
    row = spec(op_type)
    return row is not None and row.same_values


def _derivation(
    node: onnx.NodeProto, out: str, wanted: set[str], moving_average: bool
) -> str | None:
    """How ``out`` follows from other calibrated tensors, or None."""
    if out != node.output[0] or not node.input:
        return None
    src = node.input[0]
    if moving_average:
        # batch-wise averages do not commute with Relu or Concat; identical data still is
        return "same" if _same_values(node.op_type) and src in wanted else None
    if node.domain not in ("", "ai.onnx"):
        return None
    if node.op_type == "Relu" and src in wanted:
        return "relu"
    if _same_values(node.op_type) and src in wanted:
        return "same"
    if node.op_type == "Dropout" and len(node.input) < 3 and src in wanted:
        return "same"
    if node.op_type == "Concat" and all(i in wanted for i in node.input if i) and all(node.input):
        return "merge"
    return None


def _value_types(model: onnx.ModelProto) -> tuple[dict[str, int], dict[str, onnx.TypeProto]]:
    """Element type of every value (graph inputs, outputs, inferred intermediates), and the
    inferred type of those with a tensor type."""
    types: dict[str, int] = {}
    try:
        if fits_in_protobuf(model):
            model = onnx.shape_inference.infer_shapes(inference_copy(model))
    except Exception as exc:  # inference is a help, not a requirement
        logger.debug("shape inference failed (%s); types unknown", exc)
    shapes: dict[str, onnx.TypeProto] = {}
    graph = model.graph
    for vi in list(graph.input) + list(graph.value_info) + list(graph.output):
        if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type:
            types[vi.name] = vi.type.tensor_type.elem_type
            shapes[vi.name] = vi.type
    for t in graph.initializer:
        types[t.name] = t.data_type
    return types, shapes


def can_combine(plan: ReadPlan, specs: Sequence[InputSpec], moving_average: bool) -> bool:
    """Feeds may be concatenated when axis 0 is one named dynamic batch dimension of every input
    and of every tensor read."""
    if moving_average or not specs:
        return False
    symbols = {s.dims[0] if s.dims else None for s in specs}
    if len(symbols) != 1:
        return False
    symbol = symbols.pop()
    if not isinstance(symbol, str):
        return False
    for name in plan.sources:
        t = plan.shapes.get(name)
        if t is None or not t.tensor_type.HasField("shape"):
            return False
        dims = t.tensor_type.shape.dim
        if not dims or dims[0].dim_param != symbol:
            return False
    return True


def derive_observers(
    observers: dict[str, Observer], derived: Sequence[tuple[str, str, list[str]]]
) -> None:
    """Add the observers of the derived tensors (``(name, rule, sources)``, in graph order)."""
    for name, rule, srcs in derived:
        if rule == "same":
            observers[name] = copy.deepcopy(observers[srcs[0]])
        elif rule == "relu":
            observers[name] = observers[srcs[0]].relu()
        else:
            merged = observers[srcs[0]]
            for s in srcs[1:]:
                merged = merged.merge(observers[s])
            observers[name] = merged
