"""FixInputShapes: give graph inputs (and what follows from them) static shapes.

The NPU compiles static shapes only, and the Vitis AI flow expects batch 1. Two ways to say it:

* ``shapes``: input name -> full shape, e.g. parsed from AMD Quark's ``FixShapes`` option string
  ``"input_1:[1,224,224,3];input_2:[1,96,96,3]"`` (:func:`parse_fix_shapes`). A given shape must
  keep the input's rank and agree with its fixed dimensions.
* ``batch``: every input whose first dimension is symbolic or unknown gets that size (``0``: off).
* ``keep_batch``: a symbolic first dimension stays symbolic where ``shapes`` gives one (the
  quantizer fixes the other dimensions before the prepare passes, which need spatial sizes to
  legalize and simulate pools, and the batch after calibration, which may batch samples).

The symbolic dimensions of outputs and intermediate values that carry an input's symbol take its
size; where a value is still not static (or has no type), shapes are inferred again (onnx shape
inference), so the whole graph becomes static where the inputs determine it. When every value is
static already, inference has nothing to add and is not run (it serializes the whole graph).
Either way the initializers end in the same order (:func:`_small_initializers_first`). Models
whose inputs are already static are left unchanged (``modified=False``).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence

import onnx_ir as ir
from onnx_ir.passes.common._c_api_utils import _BIG_TENSOR_SIZE_LIMIT

from quark_onnx.errors import ConfigError, PassError
from quark_onnx.graph.ir import infer_shapes
from quark_onnx.passes.base import QuarkPass

logger = logging.getLogger(__name__)

_ENTRY = re.compile(r"^\s*([^:\s][^:]*?)\s*:\s*\[\s*([0-9,\s]*)\]\s*$")


def parse_fix_shapes(text: str) -> dict[str, list[int]]:
    """Parse ``"name:[d0,d1,...];name2:[...]"`` (AMD Quark's FixShapes format)."""
    shapes: dict[str, list[int]] = {}
    for part in filter(None, (p.strip() for p in text.split(";"))):
        match = _ENTRY.match(part)
        if not match or not match.group(2).strip():
            raise ConfigError(
                f"FixShapes entry {part!r} is not of the form 'input_name:[1,3,224,224]'"
            )
        dims = [int(d) for d in match.group(2).split(",") if d.strip()]
        if any(not 0 < d < 2**31 for d in dims):  # (above int64 nothing downstream can hold it)
            raise ConfigError(
                f"FixShapes entry {part!r}: dimensions must be positive (and below 2^31)"
            )
        shapes[match.group(1)] = dims
    return shapes


def _is_static(shape: ir.Shape | None) -> bool:
    return shape is not None and all(isinstance(d, int) for d in shape)


def _all_values(graph: ir.Graph) -> list[ir.Value]:
    values = list(graph.inputs)
    for node in graph:
        values.extend(node.outputs)
    return values


def _inference_has_work(model: ir.Model) -> bool:
    """Whether onnx shape inference could change a value of ``model``: some input or node output
    of some graph has no type or a shape that is not static (inference keeps a static shape it
    agrees with and leaves the model unchanged when it disagrees)."""
    for graph in model.graphs():
        for value in _all_values(graph):
            if value.dtype is None or not _is_static(value.shape):
                return True
    return False


def _small_initializers_first(graph: ir.Graph) -> None:
    """The initializer order onnx_ir's shape inference leaves (its round trip lifts the tensors
    above ``_BIG_TENSOR_SIZE_LIMIT`` bytes out of the graph and registers them again, after the
    small ones; it also gives every initializer its tensor's shape and type). Applied when the
    inference is not needed, so that the written model does not depend on whether it ran."""
    large = []
    for value in list(graph.initializers.values()):
        tensor = value.const_value
        if tensor is None:
            continue
        if value.shape is None:
            value.shape = tensor.shape  # type: ignore[assignment]
        if value.dtype is None:
            value.dtype = tensor.dtype
        if tensor.nbytes > _BIG_TENSOR_SIZE_LIMIT:
            large.append(graph.initializers.pop(value.name))
    for value in large:
        graph.register_initializer(value)


class FixInputShapes(QuarkPass):
    """Make graph input shapes static (see the module docstring)."""

    def __init__(
        self,
        shapes: Mapping[str, Sequence[int]] | None = None,
        batch: int = 0,
        keep_batch: bool = False,
    ) -> None:
        super().__init__()
        if not isinstance(batch, int) or batch < 0:
            raise ConfigError(f"FixInputShapes batch={batch!r}: use 0 (off) or a positive size")
        self.shapes = {k: [int(d) for d in v] for k, v in (shapes or {}).items()}
        self.batch = batch
        self.keep_batch = keep_batch

    def _new_shape(self, value: ir.Value) -> list[int | ir.SymbolicDim] | None:
        shape = value.shape
        if value.name in self.shapes:
            wanted: list[int | ir.SymbolicDim] = list(self.shapes[value.name])
            if shape is not None:
                if len(shape) != len(wanted):
                    raise PassError(
                        f"FixShapes: input {value.name!r} has rank {len(shape)} "
                        f"({list(shape)}), the given shape {wanted} has rank {len(wanted)}"
                    )
                for i, (have, want) in enumerate(zip(shape, wanted, strict=True)):
                    if isinstance(have, int) and have != want:
                        raise PassError(
                            f"FixShapes: input {value.name!r} has fixed size {have} at axis {i}, "
                            f"the given shape {wanted} says {want}"
                        )
                if self.keep_batch and wanted and not isinstance(shape[0], int):
                    wanted[0] = shape[0]  # the batch stays free (calibration may batch samples)
            return wanted
        if self.batch and shape is not None and len(shape) >= 1 and not isinstance(shape[0], int):
            return [self.batch, *shape[1:]]
        return None

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        names = {v.name for v in graph.inputs}
        unknown = sorted(set(self.shapes) - names)
        if unknown:
            raise PassError(
                f"FixShapes names {unknown} which are not graph inputs (inputs: {sorted(names)})"
            )
        changed = False
        symbols: dict[str, int] = {}  # symbolic dim name -> the size it now has
        for value in graph.inputs:
            new = self._new_shape(value)
            if new is None or (value.shape is not None and list(value.shape) == new):
                continue
            if value.shape is not None:
                for have, want in zip(value.shape, new, strict=True):
                    if isinstance(have, ir.SymbolicDim) and have.value is not None:
                        symbols[have.value] = want
            value.shape = ir.Shape(new)
            changed = True
        if not changed:
            return ir.passes.PassResult(model, modified=False)
        # Every other value that carries one of those symbols (the batch dimension of outputs and
        # intermediates) gets the same size; then shape inference fills in what it can.
        for value in _all_values(graph):
            if value.shape is None or not symbols:
                continue
            dims = [
                symbols.get(d.value, d) if isinstance(d, ir.SymbolicDim) else d for d in value.shape
            ]
            if dims != list(value.shape):
                value.shape = ir.Shape(dims)
        if _inference_has_work(model):
            try:
                infer_shapes(model, type(self).__name__, strict=True)
            except Exception as exc:  # onnx shape inference raises its own error types
                logger.warning("shape inference after fixing input shapes failed: %s", exc)
        else:
            _small_initializers_first(graph)
        for out in graph.outputs:
            if out.shape is not None and not _is_static(out.shape):
                logger.warning("output %r still has a non-static shape %s", out.name, out.shape)
        return ir.passes.PassResult(model, modified=True)
