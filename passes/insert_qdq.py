"""InsertQDQ: write tensors' quantization parameters into the graph in standard ONNX ops.

Two calls, one writer:

* ``InsertQDQ(params)`` with an ordered mapping tensor name -> :class:`~quark_onnx.params.qparams.
  QuantParams` writes any data type and granularity (see below);
* ``InsertQDQ(plan, positions)`` (the XINT8 flow) converts every planned tensor to
  ``qparams.from_position(positions[t], spec.qtype)`` (scale ``2^-p``, symmetric zero point) and
  writes those; its output is byte-identical to what the power-of-two-only writer produced.

The arithmetic written is ONNX ``QuantizeLinear``/``DequantizeLinear``
(:mod:`quark_onnx.params.qparams` is its numpy reference)::

    integer:  q = saturate(round_half_even(x / scale) + zero_point)
    float8:   q = float8_e4m3fn(clip(x / scale, -448, 448))
    x' = (q - zero_point) * scale

The forms written, for a tensor ``T`` (names are made unique by one
:class:`~quark_onnx.graph.ir.NameGenerator`; a suffix ``_1``, ``_2`` ... on a clash):

* activation (graph input or node output), static::

      T -> QuantizeLinear(T, T_scale, T_zero_point) -> T_QuantizeLinear_Output
        -> DequantizeLinear(..., T_scale, T_zero_point) -> T_DequantizeLinear_Output -> consumers

  ``axis``/``block_size`` become attributes of both nodes (per channel: scale of shape ``(C,)``;
  per group: the block shape, opset 21). When ``T`` is a graph output its producer now writes
  ``T_QuantizeLinear_Input`` and the DequantizeLinear writes ``T``, so output names do not change
  (the same renaming, with ``T_Cast_Input``, for a Cast pair).
* constant (initializer or ``Constant`` output) ``W``: its codes -- ``params.codes`` when given,
  else ``qparams.quantize(W)`` -- as the initializer ``W_quantized`` ->
  ``DequantizeLinear(W_quantized, W_scale, W_zero_point)`` -> ``W_DequantizeLinear_Output``. No
  QuantizeLinear. The float constant is removed when nothing else reads it.
* float16/bfloat16 (``qparams.CAST_TYPES``, no scale): an activation goes through
  ``T -> Cast(to=type) -> T_Cast_Output -> Cast(to=float) -> T_CastFloat_Output``; a constant is
  stored in the type as ``W_quantized`` -> ``Cast(to=float)`` -> ``W_CastFloat_Output``.
* dynamic activation (``params.dynamic``; the scale is computed at run time from ``T``, equal to
  :func:`quark_onnx.params.qparams.dynamic_params` on the same values):

  - uint8 asymmetric: ``DynamicQuantizeLinear(T) -> (T_QuantizeLinear_Output, T_scale,
    T_zero_point) -> DequantizeLinear``. ONNX defines ``scale = (max(0, max T) - min(0, min T)) /
    255`` and ``zero_point = saturate(round(-min(0, min T) / scale))``.
  - symmetric integer types: ``T_amax = ReduceMax(Abs(T))`` (all axes, keepdims 0),
    ``T_scale = Where(Greater(T_amax, 0), Div(T_amax, qmax), 1)`` (an all-zero input gets scale
    1), then ``QuantizeLinear/DequantizeLinear`` with that runtime scale and the constant zero
    point (0 for signed types, ``2^(bits-1)`` for unsigned). ``max|T|`` and one float32 division
    are exact IEEE operations, so the runtime scale equals the numpy reference bit for bit.

  A dynamic constant is simply quantized ahead of time with ``dynamic_params`` of its values.
  After the pairs are written, a MatMul reading a uint8 dynamic activation and a constant 2-D
  weight becomes ``MatMulInteger`` + ``Cast`` + ``Mul`` by the product of the scales
  (:class:`~quark_onnx.passes.dynamic_matmul_integer.DynamicMatMulInteger`), which onnxruntime
  runs with integer kernels.
* an embedding table read only by ``Gather`` (axis 0), quantized per row with zero points 0 (or
  a Cast type): ``Gather(W_quantized, ids)`` and ``Gather(W_scale[:, None], ids)``, then
  ``Cast(rows, float) * row_scales`` -- DequantizeLinear's arithmetic applied to the gathered
  rows only (float8 tables, which Gather does not take, get the DequantizeLinear form).

Opset. Each written node needs a default-domain opset: QuantizeLinear/DequantizeLinear 10 (13
with ``axis``), DynamicQuantizeLinear 11, Cast to bfloat16 13, float8 e4m3fn 19, int16/uint16/
int4/uint4 and ``block_size`` 21. When the model's opset is lower than the highest need, the whole
model is first converted with ``onnx.version_converter`` (its adapters rewrite the nodes whose
schema changed, e.g. ``Reduce*`` axes becoming an input at 18) and checked with
``onnx.checker``; the model's graph is replaced by the converted one (value objects held from
before the pass are stale). If conversion fails, :class:`~quark_onnx.errors.PassError` names the
tensor, its type and the opset it needs. The IR version is raised to what the opset and types
need (float8: 9, int4: 10), never lowered; nothing changes when no need exceeds the model's.

Every parameter set is checked with ``QuantParams.validate(shape, name)`` before anything is
written; a name not in the graph, codes on an activation, codes of the wrong type or shape, an
int32 activation or an asymmetric dynamic type other than uint8 are a ``PassError`` naming the
tensor. Tensors are processed in the mapping's order and every pair is placed right after its
producer (constants: right before their first consumer), so the output is byte-identical for the
same input. The value index is built once: the pass costs O(number of tensors + nodes).

Code. This module is the pass: the parameters' checks and the order of the work. The forms above
are written by :class:`~quark_onnx.passes._qdq_writer.QDQWriter`; the gathered-rows form of
embedding tables and its inverse are in :mod:`._qdq_gathered`; the opset and IR version needs
and the conversion in :mod:`._qdq_opset`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from quark_onnx.config.enums import QuantType
from quark_onnx.errors import PassError, QuantizationError
from quark_onnx.graph.ir import constant_array
from quark_onnx.params import qparams
from quark_onnx.params.qparams import QuantParams
from quark_onnx.passes._qdq_gathered import restore_gathered_tables
from quark_onnx.passes._qdq_opset import _raise_ir_version, _raise_opset, required_opset
from quark_onnx.passes._qdq_writer import QDQWriter
from quark_onnx.passes.base import QuarkPass
from quark_onnx.plan.types import QuantPlan, TensorKind

# required_opset and restore_gathered_tables live with the code they belong to and are imported
# from here (the pass's public module) by the importer and the tests
__all__ = ["InsertQDQ", "params_from_positions", "required_opset", "restore_gathered_tables"]

logger = logging.getLogger(__name__)


def params_from_positions(plan: QuantPlan, positions: Mapping[str, int]) -> dict[str, QuantParams]:
    """The power-of-two parameters of every planned tensor, in plan order (XINT8).

    Raises:
        PassError: a planned tensor has no position, or is planned with a float scale.
    """
    missing = [n for n in plan.tensors if n not in positions]
    if missing:
        raise PassError(
            f"InsertQDQ: no position for {len(missing)} planned tensor(s) "
            f"({', '.join(missing[:5])}); pass the solver's positions for every tensor"
        )
    for name, spec in plan.tensors.items():
        if not spec.power_of_two:
            raise PassError(
                f"InsertQDQ: tensor {name} is planned with a float scale; pass its QuantParams "
                "(InsertQDQ(params)) instead of a position"
            )
    return {
        name: qparams.from_position(positions[name], spec.qtype)
        for name, spec in plan.tensors.items()
    }


@dataclass(frozen=True)
class _Entry:
    """One tensor to write: its value, parameters, and its data when it is a constant."""

    name: str
    value: ir.Value
    params: QuantParams
    array: np.ndarray | None


class InsertQDQ(QuarkPass):
    """Write quantization parameters into the graph (see the module docstring for the forms).

    Args:
        params: tensor name -> :class:`~quark_onnx.params.qparams.QuantParams`, written in
            this order; or, for the XINT8 flow, a :class:`~quark_onnx.plan.types.QuantPlan` from
            :func:`quark_onnx.plan.build.build_plan` on this model, with ``positions``.
        positions: with a plan: tensor -> power-of-two position (``SolveResult.positions``), one
            per planned tensor.
    """

    changes_numerics = True

    def __init__(
        self,
        params: Mapping[str, QuantParams] | QuantPlan,
        positions: Mapping[str, int] | None = None,
    ) -> None:
        super().__init__()
        #: constant -> the initializer of its codes (stages after this one may rewrite them)
        self.quantized: dict[str, ir.Value] = {}
        #: with a plan: tensor -> "is a weight/bias" (the plan decides); else found in the graph
        self._plan_constants: dict[str, bool] | None = None
        if isinstance(params, QuantPlan):
            if positions is None:
                raise TypeError("InsertQDQ(plan, positions): the positions are required")
            self.params = params_from_positions(params, positions)
            self._plan_constants = {
                n: s.kind is not TensorKind.ACTIVATION for n, s in params.tensors.items()
            }
        else:
            if positions is not None:
                raise TypeError("InsertQDQ(params): positions are only taken with a QuantPlan")
            self.params = dict(params)

    # -- the pass -------------------------------------------------------------------------------

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        if not self.params:
            return ir.passes.PassResult(model, False)
        entries = self._entries(model.graph)
        for entry in entries:
            self._validate(entry)
        if _raise_opset(model, [(e.name, e.params) for e in entries]):
            entries = self._entries(model.graph)  # the converted graph holds new values
        _raise_ir_version(model, [e.params for e in entries])

        graph = model.graph
        writer = QDQWriter(graph, self.quantized)
        for entry in entries:
            value, params = writer.moved.get(id(entry.value), entry.value), entry.params
            if entry.array is not None:
                if params.dynamic:  # a constant's own range is known now
                    params = qparams.dynamic_params(entry.array, params.qtype, params.symmetric)
                writer.constant(graph, value, entry.array, params)
            elif params.is_cast:
                writer.cast_activation(graph, value, params)
            elif params.dynamic:
                writer.dynamic_activation(graph, value, params)
            else:
                writer.activation(graph, value, params)
        logger.info("InsertQDQ: %d tensor(s) quantized", len(entries))
        if any(e.params.dynamic and not e.params.symmetric for e in entries):
            # uint8 dynamic activations into MatMul layers: integer kernels, not float QDQ
            from quark_onnx.passes.dynamic_matmul_integer import DynamicMatMulInteger

            DynamicMatMulInteger()(model)
        return ir.passes.PassResult(model, True)

    def _entries(self, graph: ir.Graph) -> list[_Entry]:
        """The tensors to write, in the mapping's order, with a constant's value."""
        values = _value_index(graph)
        entries = []
        for name, params in self.params.items():
            value = values.get(name)
            if value is None:
                raise PassError(
                    f"InsertQDQ: tensor {name} is not in graph {graph.name!r}; "
                    "the parameters must be computed for this model"
                )
            entries.append(_Entry(name, value, params, self._constant_value(value)))
        return entries

    # -- checks ---------------------------------------------------------------------------------

    def _constant_value(self, value: ir.Value) -> np.ndarray | None:
        """A constant's value (written as codes + DequantizeLinear); None for an activation."""
        name = value.name or ""
        if self._plan_constants is not None:
            if not self._plan_constants[name]:
                return None
            array = constant_array(value)
            if array is None:
                raise PassError(f"InsertQDQ: weight/bias {name} is not a constant")
            return array
        if value.is_graph_input():
            return None  # an initializer that is also a graph input can be fed at run time
        return constant_array(value)

    def _validate(self, entry: _Entry) -> None:
        name, value, params = entry.name, entry.value, entry.params
        qtype = params.qtype
        if value.dtype is not None and value.dtype != ir.DataType.FLOAT:
            raise PassError(
                f"InsertQDQ: tensor {name} is {value.dtype.name}; only float32 tensors are "
                "quantized (convert the model to float32 first)"
            )
        if entry.array is not None:
            shape: tuple[int, ...] | None = tuple(entry.array.shape)
        else:
            shape = _static_shape(value)
            if params.codes is not None:
                raise PassError(
                    f"InsertQDQ: activation {name} carries codes; only constants have codes"
                )
            if qtype is QuantType.QInt32:
                raise PassError(
                    f"InsertQDQ: activation {name}: QuantizeLinear has no int32 output; use "
                    "int32 for biases (constants) only"
                )
            if params.dynamic and not params.is_cast:
                if not qtype.is_integer:
                    raise PassError(
                        f"InsertQDQ: dynamic activation {name}: {qtype.name} has no run-time "
                        "scale rule; dynamic quantization takes integer types"
                    )
                if not params.symmetric and qtype is not QuantType.QUInt8:
                    raise PassError(
                        f"InsertQDQ: dynamic activation {name}: asymmetric dynamic quantization "
                        f"is uint8 (DynamicQuantizeLinear), not {qtype.name}"
                    )
        try:
            params.validate(shape, name)
        except QuantizationError as error:
            raise PassError(f"InsertQDQ: {error}") from error
        if params.codes is not None:
            expected = qparams.numpy_dtype(qtype)
            if params.codes.dtype != expected:
                raise PassError(
                    f"InsertQDQ: constant {name}: codes dtype {params.codes.dtype} is not "
                    f"{expected} ({qtype.name})"
                )
            if shape is not None and tuple(params.codes.shape) != shape:
                raise PassError(
                    f"InsertQDQ: constant {name}: codes shape {tuple(params.codes.shape)} != "
                    f"tensor shape {shape}"
                )


def _value_index(graph: ir.Graph) -> dict[str, ir.Value]:
    """Name -> value over the top-level graph: inputs, initializers, node outputs."""
    values: dict[str, ir.Value] = {}
    for v in graph.inputs:
        values[v.name or ""] = v
    for name, v in graph.initializers.items():
        values.setdefault(name, v)
    for node in graph:
        for out in node.outputs:
            if out.name:
                values[out.name] = out
    return values


def _static_shape(value: ir.Value) -> tuple[int, ...] | None:
    shape = value.shape
    if shape is None or not all(isinstance(d, int) for d in shape):
        return None
    return tuple(int(d) for d in shape)
