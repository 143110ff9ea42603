"""InsertQDQ: write tensors' quantization parameters into the graph in standard ONNX ops.

Two calls, one writer:

* ``InsertQDQ(params)`` with an ordered mapping tensor name -> :class:`~quark_onnx.qparams.
  QuantParams` writes any data type and granularity (see below);
* ``InsertQDQ(plan, positions)`` (the XINT8 flow) converts every planned tensor to
  ``qparams.from_position(positions[t], spec.qtype)`` (scale ``2^-p``, symmetric zero point) and
  writes those; its output is byte-identical to what the power-of-two-only writer produced.

The arithmetic written is ONNX ``QuantizeLinear``/``DequantizeLinear`` (:mod:`quark_onnx.qparams`
is its numpy reference)::

    integer:  q = saturate(round_half_even(x / scale) + zero_point)
    float8:   q = float8_e4m3fn(clip(x / scale, -448, 448))
    x' = (q - zero_point) * scale

The forms written, for a tensor ``T`` (names are made unique by one
:class:`~quark_onnx.passes._graph.NameGenerator`; a suffix ``_1``, ``_2`` ... on a clash):

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
  :func:`quark_onnx.qparams.dynamic_params` on the same values):

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
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import onnx
import onnx_ir as ir

from quark_onnx import qparams
from quark_onnx.enums import QuantType
from quark_onnx.errors import PassError, QuantizationError
from quark_onnx.passes._graph import NameGenerator, add_initializer, constant_array
from quark_onnx.passes.base import QuarkPass
from quark_onnx.plan import QuantPlan, TensorKind
from quark_onnx.qparams import QuantParams

logger = logging.getLogger(__name__)

_OPSET_21_TYPES = frozenset(
    {QuantType.QInt16, QuantType.QUInt16, QuantType.QInt4, QuantType.QUInt4}
)
_IR_FOR_TYPE = {QuantType.QFLOAT8E4M3FN: 9, QuantType.QInt4: 10, QuantType.QUInt4: 10}
_DEFAULT_DOMAINS = ("", "ai.onnx")
#: doc_string prefix of the Cast of a gathered embedding table, followed by the table's name
_GATHERED_MARK = "quark_onnx:gathered:"
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


def _replace_node_uses(value: ir.Value, out: ir.Value) -> None:
    """Point every node input reading ``value`` at ``out``; a graph output that is ``value``
    itself (a graph input or initializer listed as an output) keeps reading the float value
    (onnx_ir's ``replace_all_uses_with`` refuses graph outputs)."""
    for use in list(value.uses()):
        use.node.replace_input_with(use.idx, out)


class InsertQDQ(QuarkPass):
    """Write quantization parameters into the graph (see the module docstring for the forms).

    Args:
        params: tensor name -> :class:`~quark_onnx.qparams.QuantParams`, written in this order;
            or, for the XINT8 flow, a :class:`~quark_onnx.plan.QuantPlan` from
            :func:`quark_onnx.plan.build_plan` on this model, with ``positions``.
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
        if self._raise_opset(model, entries):
            entries = self._entries(model.graph)  # the converted graph holds new values
        self._raise_ir_version(model, entries)

        graph = model.graph
        self._names = NameGenerator(graph)
        self._first = next(iter(graph), None)
        self._order = {id(node): i for i, node in enumerate(graph)}
        #: value -> the value that took its place (a Gather output rebuilt by _gathered_table)
        self._moved: dict[int, ir.Value] = {}
        for entry in entries:
            value, params = self._moved.get(id(entry.value), entry.value), entry.params
            if entry.array is not None:
                if params.dynamic:  # a constant's own range is known now
                    params = qparams.dynamic_params(entry.array, params.qtype, params.symmetric)
                self._constant(graph, value, entry.array, params)
            elif params.is_cast:
                self._cast_activation(graph, value, params)
            elif params.dynamic:
                self._dynamic_activation(graph, value, params)
            else:
                self._activation(graph, value, params)
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

    # -- opset and IR version ---------------------------------------------------------------------

    def _raise_opset(self, model: ir.Model, entries: list[_Entry]) -> bool:
        """Convert the model to the opset the written nodes need; True when it was converted."""
        current = model.opset_imports.get("", model.opset_imports.get("ai.onnx"))
        needs = [(required_opset(e.params), e.name, e.params) for e in entries]
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
            converted = onnx.version_converter.convert_version(proto, need)
            converted.ir_version = max(converted.ir_version, _min_ir_version(need))
            onnx.checker.check_model(converted)
            new = ir.serde.deserialize_model(converted)
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

    def _raise_ir_version(self, model: ir.Model, entries: list[_Entry]) -> None:
        need = max((_IR_FOR_TYPE.get(e.params.qtype, 0) for e in entries), default=0)
        if need > model.ir_version:
            model.ir_version = need

    # -- writers --------------------------------------------------------------------------------

    def _parameters(
        self, graph: ir.Graph, base: str, params: QuantParams
    ) -> tuple[ir.Value, ir.Value]:
        assert params.scale is not None and params.zero_point is not None
        scale = add_initializer(
            graph, self._names(f"{base}_scale"), np.asarray(params.scale, dtype=np.float32)
        )
        zero_point = add_initializer(
            graph, self._names(f"{base}_zero_point"), np.asarray(params.zero_point)
        )
        return scale, zero_point

    def _output_value(self, value: ir.Value, suffix: str, input_suffix: str) -> ir.Value:
        """The value that replaces ``value`` for its consumers (and keeps a graph output's name).

        Must be called before the intermediate names are drawn (the legacy naming order).
        """
        name = value.name or ""
        if value.is_graph_output() and value.is_graph_input():
            logger.warning(
                "tensor %s is both a graph input and output; the output stays float", name
            )
        if value.is_graph_output() and not value.is_graph_input():
            value.name = self._names(f"{name}_{input_suffix}")
            return ir.Value(name=name, shape=value.shape, type=value.type)
        return ir.Value(name=self._names(f"{name}_{suffix}"), shape=value.shape, type=value.type)

    def _rewire(self, value: ir.Value, out: ir.Value) -> None:
        as_output = value.is_graph_output() and not value.is_graph_input()
        if value.is_graph_output() and not as_output:
            _replace_node_uses(value, out)
            return
        value.replace_all_uses_with(out, replace_graph_outputs=as_output)

    def _place_after(self, graph: ir.Graph, value: ir.Value, nodes: list[ir.Node]) -> None:
        producer = value.producer()
        if producer is not None and producer.graph is graph:
            graph.insert_after(producer, nodes)
        elif self._first is not None:
            graph.insert_before(self._first, nodes)
        else:
            graph.extend(nodes)

    def _qdq_nodes(
        self,
        value: ir.Value,
        name: str,
        params: QuantParams,
        scale: ir.Value,
        zero_point: ir.Value,
        dq_out: ir.Value,
    ) -> list[ir.Node]:
        q_out = ir.Value(
            name=self._names(f"{name}_QuantizeLinear_Output"),
            shape=value.shape,
            type=ir.TensorType(_ir_dtype(params.qtype)),
        )
        attrs = _granularity_attributes(params)
        q = ir.Node(
            "",
            "QuantizeLinear",
            [value, scale, zero_point],
            attributes=attrs,
            outputs=[q_out],
            name=self._names(f"{name}_QuantizeLinear"),
        )
        dq = ir.Node(
            "",
            "DequantizeLinear",
            [q_out, scale, zero_point],
            attributes=_granularity_attributes(params),
            outputs=[dq_out],
            name=self._names(f"{name}_DequantizeLinear"),
        )
        return [q, dq]

    def _activation(self, graph: ir.Graph, value: ir.Value, params: QuantParams) -> None:
        name = value.name or ""
        scale, zero_point = self._parameters(graph, name, params)
        dq_out = self._output_value(value, "DequantizeLinear_Output", "QuantizeLinear_Input")
        self._rewire(value, dq_out)
        nodes = self._qdq_nodes(value, name, params, scale, zero_point, dq_out)
        self._place_after(graph, value, nodes)

    def _dynamic_activation(self, graph: ir.Graph, value: ir.Value, params: QuantParams) -> None:
        name = value.name or ""
        qtype = params.qtype
        dq_out = self._output_value(value, "DequantizeLinear_Output", "QuantizeLinear_Input")
        self._rewire(value, dq_out)
        scalar = ir.Shape([])
        f32 = ir.TensorType(ir.DataType.FLOAT)
        if not params.symmetric:  # uint8: DynamicQuantizeLinear
            q_out = ir.Value(
                name=self._names(f"{name}_QuantizeLinear_Output"),
                shape=value.shape,
                type=ir.TensorType(ir.DataType.UINT8),
            )
            scale = ir.Value(name=self._names(f"{name}_scale"), shape=scalar, type=f32)
            zero_point = ir.Value(
                name=self._names(f"{name}_zero_point"),
                shape=scalar,
                type=ir.TensorType(ir.DataType.UINT8),
            )
            dyn = ir.Node(
                "",
                "DynamicQuantizeLinear",
                [value],
                outputs=[q_out, scale, zero_point],
                name=self._names(f"{name}_DynamicQuantizeLinear"),
            )
            dq = ir.Node(
                "",
                "DequantizeLinear",
                [q_out, scale, zero_point],
                outputs=[dq_out],
                name=self._names(f"{name}_DequantizeLinear"),
            )
            self._place_after(graph, value, [dyn, dq])
            return
        # symmetric codes span qmax - zero_code on each side (uint8: 127 around 128)
        zero_code = qtype.symmetric_zero_point
        qmax = add_initializer(
            graph,
            self._names(f"{name}_qmax"),
            np.array(qtype.qmax - zero_code, dtype=np.float32),
        )
        zero = add_initializer(graph, self._names(f"{name}_zero"), np.array(0, dtype=np.float32))
        one = add_initializer(graph, self._names(f"{name}_one"), np.array(1, dtype=np.float32))
        zero_point = add_initializer(
            graph,
            self._names(f"{name}_zero_point"),
            np.array(zero_code, dtype=qparams.numpy_dtype(qtype)),
        )

        def step(
            op: str,
            inputs: list[ir.Value],
            out: str,
            dtype: ir.DataType = ir.DataType.FLOAT,
            shape: ir.Shape = scalar,
            **attrs: int,
        ) -> tuple[ir.Node, ir.Value]:
            result = ir.Value(name=self._names(out), shape=shape, type=ir.TensorType(dtype))
            node = ir.node(
                op, inputs, attrs or None, outputs=[result], name=self._names(f"{name}_{op}")
            )
            return node, result

        abs_node, abs_out = step("Abs", [value], f"{name}_abs", shape=value.shape)
        max_node, amax = step("ReduceMax", [abs_out], f"{name}_amax", keepdims=0)
        div_node, ratio = step("Div", [amax, qmax], f"{name}_amax_over_qmax")
        gt_node, positive = step("Greater", [amax, zero], f"{name}_amax_positive", ir.DataType.BOOL)
        where_node, scale = step("Where", [positive, ratio, one], f"{name}_scale")
        nodes = [abs_node, max_node, div_node, gt_node, where_node]
        nodes += self._qdq_nodes(value, name, params, scale, zero_point, dq_out)
        self._place_after(graph, value, nodes)

    def _cast_activation(self, graph: ir.Graph, value: ir.Value, params: QuantParams) -> None:
        name = value.name or ""
        out = self._output_value(value, "CastFloat_Output", "Cast_Input")
        self._rewire(value, out)
        low = _ir_dtype(params.qtype)
        cast_out = ir.Value(
            name=self._names(f"{name}_Cast_Output"), shape=value.shape, type=ir.TensorType(low)
        )
        cast = ir.node(
            "Cast", [value], {"to": low}, outputs=[cast_out], name=self._names(f"{name}_Cast")
        )
        back = ir.node(
            "Cast",
            [cast_out],
            {"to": ir.DataType.FLOAT},
            outputs=[out],
            name=self._names(f"{name}_CastFloat"),
        )
        self._place_after(graph, value, [cast, back])

    def _constant(
        self, graph: ir.Graph, value: ir.Value, array: np.ndarray, params: QuantParams
    ) -> None:
        name = value.name or ""
        codes = params.codes if params.codes is not None else qparams.quantize(array, params)
        if _gathers_rows(value, array, params):
            self._gathered_table(graph, value, codes, params)
            return
        quantized = add_initializer(graph, self._names(f"{name}_quantized"), codes)
        self.quantized[name] = quantized
        if params.is_cast:
            out = ir.Value(
                name=self._names(f"{name}_CastFloat_Output"),
                shape=ir.Shape(array.shape),
                type=ir.TensorType(ir.DataType.FLOAT),
            )
            node = ir.node(
                "Cast",
                [quantized],
                {"to": ir.DataType.FLOAT},
                outputs=[out],
                name=self._names(f"{name}_CastFloat"),
            )
        else:
            scale, zero_point = self._parameters(graph, name, params)
            saturated = int(
                np.count_nonzero((codes == params.qtype.qmin) | (codes == params.qtype.qmax))
                if params.qtype.is_integer
                else 0
            )
            if saturated:
                logger.debug("constant %s: %d code(s) at the type's limits", name, saturated)
            out = ir.Value(
                name=self._names(f"{name}_DequantizeLinear_Output"),
                shape=ir.Shape(array.shape),
                type=ir.TensorType(ir.DataType.FLOAT),
            )
            node = ir.Node(
                "",
                "DequantizeLinear",
                [quantized, scale, zero_point],
                attributes=_granularity_attributes(params),
                outputs=[out],
                name=self._names(f"{name}_DequantizeLinear"),
            )
        consumers = [use.node for use in value.uses()]
        _replace_node_uses(value, out)  # an initializer that is also a graph output stays float
        local = [c for c in consumers if id(c) in self._order]
        anchor = min(local, key=lambda c: self._order[id(c)]) if local else self._first
        if anchor is not None:
            graph.insert_before(anchor, node)
        else:
            graph.append(node)
        if self._first is anchor and anchor is not None:
            self._first = node
        self._drop_if_unused(graph, value)

    def _gathered_table(
        self, graph: ir.Graph, value: ir.Value, codes: np.ndarray, params: QuantParams
    ) -> None:
        """An embedding table read only by ``Gather`` (axis 0): gather the rows' codes (and
        their scales), then dequantize only the gathered rows. ``Cast(q) * scale`` is what
        DequantizeLinear computes for a zero point of 0, so the values are the same as a
        DequantizeLinear of the whole table followed by the Gather, without dequantizing the
        whole table on every run."""
        name = value.name or ""
        quantized = add_initializer(graph, self._names(f"{name}_quantized"), codes)
        self.quantized[name] = quantized
        scale = None
        if not params.is_cast:
            assert params.scale is not None
            rows = np.asarray(params.scale, dtype=np.float32).reshape(-1, 1)
            scale = add_initializer(graph, self._names(f"{name}_scale"), rows)
        for use in list(value.uses()):
            gather = use.node
            indices = gather.inputs[1]
            out = gather.outputs[0]
            base = gather.name or name
            q_rows = ir.Value(name=self._names(f"{base}_quantized_rows"))
            new_gather = ir.node(
                "Gather",
                [quantized, indices],
                {"axis": 0},
                outputs=[q_rows],
                name=self._names(f"{base}_QuantizedGather"),
            )
            f32 = ir.TensorType(ir.DataType.FLOAT)
            rows = ir.Value(name=self._names(f"{base}_rows"), type=f32)
            cast = ir.node(
                "Cast",
                [q_rows],
                {"to": ir.DataType.FLOAT},
                outputs=[rows],
                name=self._names(f"{base}_Cast"),
            )
            cast.doc_string = _GATHERED_MARK + name  # restore_gathered_tables reads it back
            nodes = [new_gather, cast]
            if scale is not None:
                s_rows = ir.Value(name=self._names(f"{base}_row_scales"), type=f32)
                scale_gather = ir.node(
                    "Gather",
                    [scale, indices],
                    {"axis": 0},
                    outputs=[s_rows],
                    name=self._names(f"{base}_ScaleGather"),
                )
                values = ir.Value(name=self._names(f"{base}_dequantized"), type=f32)
                mul = ir.node(
                    "Mul",
                    [rows, s_rows],
                    outputs=[values],
                    name=self._names(f"{base}_Dequantize"),
                )
                nodes += [scale_gather, mul]
            last = nodes[-1]
            graph.insert_after(gather, nodes)
            if self._first is gather:
                self._first = new_gather
            # the last node takes over the Gather's output value (name, shape, consumers)
            out_name = out.name
            replacement = last.outputs[0]
            out.replace_all_uses_with(replacement, replace_graph_outputs=True)
            graph.remove(gather, safe=True)
            replacement.name = out_name
            replacement.shape = out.shape
            self._moved[id(out)] = replacement
        self._drop_if_unused(graph, value)

    def _drop_if_unused(self, graph: ir.Graph, value: ir.Value) -> None:
        if value.uses() or value.is_graph_output() or value.is_graph_input():
            return
        if value.is_initializer() and value.name in graph.initializers:
            graph.initializers.pop(value.name)
            return
        producer = value.producer()
        if producer is not None and producer.op_type == "Constant" and producer.graph is graph:
            if producer is self._first:
                nodes = list(graph)
                self._first = nodes[1] if len(nodes) > 1 else None
            graph.remove(producer, safe=True)


# -- helpers -----------------------------------------------------------------------------------


def restore_gathered_tables(graph: ir.Graph) -> int:
    """Undo the gathered-rows form of embedding tables (``InsertQDQ._gathered_table``): each
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
        use.node.op_type == "Gather"
        and use.node.domain in _DEFAULT_DOMAINS
        and use.idx == 0
        and use.node.attributes.get_int("axis", 0) == 0
        for use in uses
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


def _ir_dtype(qtype: QuantType) -> ir.DataType:
    return ir.DataType.from_numpy(qparams.numpy_dtype(qtype))


def _granularity_attributes(params: QuantParams) -> dict[str, ir.Attr]:
    attrs: dict[str, ir.Attr] = {}
    if params.axis is not None:
        attrs["axis"] = ir.AttrInt64("axis", int(params.axis))
    if params.block_size is not None:
        attrs["block_size"] = ir.AttrInt64("block_size", int(params.block_size))
    return attrs


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
