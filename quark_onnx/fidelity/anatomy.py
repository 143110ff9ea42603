"""Output anatomy: which parts of each graph output are scores, regressions or dense maps.

A detector's output often joins box coordinates (hundreds of pixels) and class scores in [0, 1]
in one tensor (``Concat[4 box, 80 scores]`` in YOLOv8, ``[x, y, w, h, objectness, class]`` rows
in YOLOX). One SQNR over such a tensor measures the coordinates only: a model whose every score
was rounded to 0 still measures 27 dB. So the verdict judges each *part* of an output by what it
is, and the parts are found from the graph, not guessed from shapes:

* :func:`trace_parts` walks back from a graph output through the ops that only move or join
  values (``Concat``, ``Transpose``, ``Reshape``, ``Flatten``, ``Squeeze``, ``Unsqueeze``,
  ``Identity``) to the nodes that compute each slice of it (the *leaves*). A ``Concat`` splits the
  output along its axis; when every input of a ``Concat`` is itself split the same way along
  another axis (YOLOX: three scales joined along the anchors, each a join of box, objectness and
  class channels), the parts follow that inner axis. Axes are carried through ``Transpose`` by
  its permutation and through the reshapes by the real shapes of one run (an axis survives a
  reshape when its size and the product of the axes before it are unchanged).
* a leaf is a **score** when it is a probability: a ``Sigmoid``, ``HardSigmoid`` or ``Softmax``
  output, or the product of two of them (objectness times class). Any other leaf is a value: a
  **regression** (boxes, offsets, embeddings), judged by SQNR, unless the whole output is a
  per-sample score vector or a dense map (:mod:`quark_onnx.fidelity` decides those from the
  data's shape and the class axis found here).
* the **class axis** of a leaf is the axis its channels lie on: axis 1 of a ``Conv`` or
  ``BatchNormalization``, the last axis of a ``MatMul``/``Gemm``, a ``Softmax``'s own axis,
  carried to the output through the same layout ops. An NHWC segmentation output (a ``Transpose``
  after the last ``Conv``) therefore has its classes on the last axis.

The anatomy is read from the model the user gave, before any pass rewrites it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import onnx_ir as ir

logger = logging.getLogger(__name__)

__all__ = ["OutputPart", "anatomy", "tail_values", "trace_parts", "whole_output"]

#: Ops that move or join values without computing them (the walk goes through them).
_LAYOUT = frozenset({"Concat", "Transpose", "Reshape", "Flatten", "Squeeze", "Unsqueeze"})
_PASS_THROUGH = frozenset({"Identity", "Cast"})
#: Ops whose output is a probability.
_PROBABILITY = frozenset({"Sigmoid", "HardSigmoid", "Softmax"})
#: Ops that keep every axis where it is (elementwise, normalisation, spatial resampling).
_AXIS_KEEPING = frozenset(
    {
        "Relu", "LeakyRelu", "PRelu", "Clip", "Sigmoid", "HardSigmoid", "HardSwish", "Tanh",
        "Elu", "Selu", "Exp", "Log", "Abs", "Neg", "Sqrt", "Erf", "Add", "Sub", "Mul", "Div",
        "Pow", "Max", "Min", "Resize", "Upsample", "Pad", "MaxPool", "AveragePool",
        "GlobalAveragePool", "GlobalMaxPool", "Identity", "Cast", "Dropout", "Softplus",
        "InstanceNormalization", "LayerNormalization",
    }
)  # fmt: skip
_CHANNELS_FIRST = frozenset({"Conv", "ConvTranspose", "BatchNormalization"})
_CHANNELS_LAST = frozenset({"MatMul", "Gemm"})
_MAX_DEPTH = 64


@dataclass(frozen=True)
class OutputPart:
    """One slice of a graph output and what computes it.

    Attributes:
        output: the graph output's name.
        axis: the output axis along which this part is a slice (None: the whole output).
        start, stop: the slice along ``axis`` (0 and -1 for the whole output).
        kind: ``"score"`` (a probability) or ``"value"`` (anything else).
        class_axis: the output axis the part's classes (channels) lie on, None when unknown.
        softmax: the part is a distribution over ``class_axis`` (one class wins per position).
        producer: the name of the node that computes it (the first one for a joined part).
        op_type: that node's op type.
    """

    output: str
    axis: int | None
    start: int
    stop: int
    kind: str
    class_axis: int | None
    softmax: bool
    producer: str
    op_type: str

    @property
    def label(self) -> str:
        """``output0[4:84]`` (the slice on its axis; the output's name for the whole output)."""
        if self.axis is None:
            return self.output
        index = [":"] * (self.axis + 1)
        index[self.axis] = f"{self.start}:{self.stop}"
        return f"{self.output}[{', '.join(index)}]"

    def take(self, array: np.ndarray) -> np.ndarray:
        """This part of one run's value of the output."""
        if self.axis is None:
            return array
        index = [slice(None)] * array.ndim
        index[self.axis] = slice(self.start, self.stop)
        return array[tuple(index)]

    def to_dict(self) -> dict[str, Any]:
        return {
            "part": self.label,
            "axis": self.axis,
            "start": self.start,
            "stop": self.stop,
            "kind": self.kind,
            "class_axis": self.class_axis,
            "softmax": self.softmax,
            "producer": self.producer,
            "op_type": self.op_type,
        }


def whole_output(name: str) -> OutputPart:
    """An output judged as one part whose producer is not known."""
    return OutputPart(name, None, 0, -1, "value", None, False, "", "")


@dataclass(frozen=True)
class _Leaf:
    """A part of the tensor the walk stands on: its slice (``axis`` None: whole) and its leaf."""

    axis: int | None
    start: int
    stop: int
    node: ir.Node | None
    class_axis: int | None


def trace_parts(
    model: ir.Model, shapes: Mapping[str, tuple[int, ...]]
) -> dict[str, list[OutputPart]]:
    """Every graph output's parts (see the module docstring); ``shapes`` are the real shapes of
    the values :func:`tail_values` names (one run of the model)."""
    result: dict[str, list[OutputPart]] = {}
    for output in model.graph.outputs:
        if output.name not in shapes:
            continue
        try:
            leaves = _parts(output, shapes, 0)
        except _Unknown:
            leaves = [_Leaf(None, 0, -1, output.producer(), None)]
        result[output.name] = [_as_part(output.name, leaf) for leaf in leaves]
    return result


def tail_values(model: ir.Model) -> list[str]:
    """The names of the values the walk may need shapes of: the graph outputs and every value
    behind them through the layout ops (and the inputs of the first non-layout node)."""
    names: list[str] = []
    seen: set[int] = set()
    stack: list[tuple[ir.Value, int]] = [(v, 0) for v in model.graph.outputs]
    while stack:
        value, depth = stack.pop()
        if id(value) in seen or depth > _MAX_DEPTH or not value.name:
            continue
        seen.add(id(value))
        names.append(value.name)
        node = value.producer()
        if node is None or node.domain not in ("", "ai.onnx"):
            continue
        if node.op_type in _LAYOUT | _PASS_THROUGH | _AXIS_KEEPING:
            stack.extend((v, depth + 1) for v in node.inputs[:1] if v is not None)
            if node.op_type in ("Concat", "Mul"):
                stack.extend((v, depth + 1) for v in node.inputs[1:] if v is not None)
    return names


def anatomy(
    model: ir.Model, run: Callable[[list[str]], Mapping[str, np.ndarray]]
) -> dict[str, list[OutputPart]]:
    """:func:`trace_parts` with the shapes of one run: ``run(names)`` returns those values for
    one sample (the float model's). Empty when the run fails (the verdict then judges whole
    outputs)."""
    constants = set(model.graph.initializers)
    names = [n for n in tail_values(model) if n not in constants]
    try:
        values = run(names)
    except Exception as exc:  # onnxruntime raises its own types; the anatomy is optional
        logger.info("output anatomy not traced: %s", str(exc).strip().splitlines()[:1])
        return {}
    shapes = {name: tuple(int(d) for d in np.shape(v)) for name, v in values.items()}
    return trace_parts(model, shapes)


class _Unknown(Exception):
    """The walk cannot follow an axis (a reshape that merges or splits it, a missing shape)."""


def _as_part(output: str, leaf: _Leaf) -> OutputPart:
    node = leaf.node
    kind, softmax = _leaf_kind(node)
    return OutputPart(
        output=output,
        axis=leaf.axis,
        start=leaf.start,
        stop=leaf.stop,
        kind=kind,
        class_axis=leaf.class_axis,
        softmax=softmax,
        producer=(node.name or "") if node is not None else "",
        op_type=node.op_type if node is not None else "",
    )


def _leaf_kind(node: ir.Node | None, depth: int = 0) -> tuple[str, bool]:
    """``("score", softmax)`` for a probability, ``("value", False)`` otherwise."""
    if node is None or depth > 4:
        return "value", False
    if node.op_type in _PROBABILITY:
        return "score", node.op_type == "Softmax"
    if node.op_type in _PASS_THROUGH:
        inner = node.inputs[0].producer() if node.inputs[0] is not None else None
        return _leaf_kind(inner, depth + 1)
    if node.op_type == "Mul" and len(node.inputs) == 2:
        # objectness x class score: a product of two probabilities is one
        kinds = [
            _leaf_kind(v.producer(), depth + 1)[0] if v is not None else "value"
            for v in node.inputs
        ]
        if kinds == ["score", "score"]:
            return "score", False
    return "value", False


def _shape(value: ir.Value, shapes: Mapping[str, tuple[int, ...]]) -> tuple[int, ...]:
    shape = shapes.get(value.name or "")
    if shape is None:
        raise _Unknown(value.name)
    return shape


def _parts(value: ir.Value, shapes: Mapping[str, tuple[int, ...]], depth: int) -> list[_Leaf]:
    """The parts of ``value`` (axes are ``value``'s own)."""
    shape = _shape(value, shapes)
    node = value.producer()
    if node is None or depth > _MAX_DEPTH or node.domain not in ("", "ai.onnx"):
        return [_Leaf(None, 0, -1, node, _channel_axis(value, shapes, depth))]
    op = node.op_type
    if op in _PASS_THROUGH:
        return _parts(node.inputs[0], shapes, depth + 1)
    if op == "Concat":
        return _concat_parts(node, value, shapes, depth)
    if op == "Transpose":
        source = node.inputs[0]
        rank = len(_shape(source, shapes))
        perm_attr = node.attributes.get("perm")
        perm = list(perm_attr.as_ints()) if perm_attr is not None else list(range(rank))[::-1]
        return [_moved(p, lambda a: perm.index(a)) for p in _parts(source, shapes, depth + 1)]
    if op in ("Reshape", "Flatten", "Squeeze", "Unsqueeze"):
        source = node.inputs[0]
        before = _shape(source, shapes)
        inner = _parts(source, shapes, depth + 1)
        return [_moved(p, lambda a: _reshaped_axis(a, before, shape)) for p in inner]
    return [_Leaf(None, 0, -1, node, _channel_axis(value, shapes, depth))]


def _moved(leaf: _Leaf, move: Callable[[int], int | None]) -> _Leaf:
    """``leaf`` with its axes carried through a layout op (``move`` raises or returns None when
    an axis does not survive)."""
    axis = leaf.axis
    if axis is not None:
        axis = move(axis)
        if axis is None:
            raise _Unknown("split axis")
    class_axis = move(leaf.class_axis) if leaf.class_axis is not None else None
    return replace(leaf, axis=axis, class_axis=class_axis)


def _reshaped_axis(axis: int, before: tuple[int, ...], after: tuple[int, ...]) -> int | None:
    """The axis of ``after`` that ``axis`` of ``before`` becomes (same size, same product of the
    axes before it), or None when the reshape merges or splits it."""
    prefix = int(np.prod(before[:axis], dtype=np.int64))
    for candidate, size in enumerate(after):
        if size == before[axis] and int(np.prod(after[:candidate], dtype=np.int64)) == prefix:
            return candidate
    return None


def _concat_parts(
    node: ir.Node, value: ir.Value, shapes: Mapping[str, tuple[int, ...]], depth: int
) -> list[_Leaf]:
    rank = len(_shape(value, shapes))
    axis_attr = node.attributes.get("axis")
    axis = (axis_attr.as_int() if axis_attr is not None else 0) % max(rank, 1)
    inputs = [v for v in node.inputs if v is not None]
    inner = [_parts(v, shapes, depth + 1) for v in inputs]
    split = [p for p in inner if len(p) > 1]
    if split and len(split) == len(inner):
        # every input is a join along the same other axis, slice for slice (YOLOX's scales):
        # the parts follow that axis
        layout = [(p.axis, p.start, p.stop) for p in split[0]]
        same = all([(q.axis, q.start, q.stop) for q in p] == layout for p in split)
        if same and layout[0][0] != axis:
            return split[0]
    leaves = []
    offset = 0
    for source, parts in zip(inputs, inner, strict=True):
        size = _shape(source, shapes)[axis]
        whole = parts[0] if len(parts) == 1 else _Leaf(None, 0, -1, source.producer(), None)
        leaves.append(_Leaf(axis, offset, offset + size, whole.node, whole.class_axis))
        offset += size
    return _merge_alike(leaves, axis)


def _merge_alike(leaves: list[_Leaf], axis: int) -> list[_Leaf]:
    """Neighbouring slices computed alike (same op type, kind and class axis) as one part when
    the join is along positions, not classes: a detector's three scales of class scores joined
    along the anchors are one score part; objectness and class scores joined along the
    channels stay two."""
    merged: list[_Leaf] = []
    for leaf in leaves:
        last = merged[-1] if merged else None
        if (
            last is not None
            and last.class_axis != axis
            and last.stop == leaf.start
            and _leaf_kind(last.node) == _leaf_kind(leaf.node)
            and (last.node.op_type if last.node else "") == (leaf.node.op_type if leaf.node else "")
            and last.class_axis == leaf.class_axis
        ):
            merged[-1] = replace(last, stop=leaf.stop)
        else:
            merged.append(leaf)
    if len(merged) == 1:
        return [replace(merged[0], axis=None, start=0, stop=-1)]
    return merged


def _channel_axis(
    value: ir.Value, shapes: Mapping[str, tuple[int, ...]], depth: int = 0
) -> int | None:
    """The axis of ``value`` its channels lie on (module docstring), None when unknown."""
    node = value.producer()
    if node is None or depth > _MAX_DEPTH:
        return None
    op = node.op_type
    rank = len(shapes[value.name]) if value.name in shapes else None
    if op in _CHANNELS_FIRST:
        return 1
    if op in _CHANNELS_LAST:
        return rank - 1 if rank else None
    if op in ("Softmax", "LogSoftmax"):
        axis_attr = node.attributes.get("axis")
        axis = axis_attr.as_int() if axis_attr is not None else -1
        return axis % rank if rank else None
    if op == "Transpose":
        inner = _channel_axis(node.inputs[0], shapes, depth + 1)
        perm_attr = node.attributes.get("perm")
        if inner is None or perm_attr is None:
            return None
        return list(perm_attr.as_ints()).index(inner)
    if op in ("Reshape", "Flatten", "Squeeze", "Unsqueeze"):
        source = node.inputs[0]
        inner = _channel_axis(source, shapes, depth + 1)
        if inner is None or source.name not in shapes or value.name not in shapes:
            return None
        return _reshaped_axis(inner, shapes[source.name], shapes[value.name])
    if op in _AXIS_KEEPING or op == "Concat":
        # the input of the same rank carries the layout (a broadcast constant does not)
        for source in node.inputs:
            if source is None or source.const_value is not None:
                continue
            if source.name in shapes and rank is not None and len(shapes[source.name]) != rank:
                continue
            found = _channel_axis(source, shapes, depth + 1)
            if found is not None:
                return found
    return None
