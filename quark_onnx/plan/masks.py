"""Mask-like (saturating) tensors: ranges set by a constant fill, not by the data.

An additive attention mask is ``(1 - mask) * finfo(float32).min`` (or ``Where(mask, 0, min)``,
or ``* -10000`` in older exports): its values are 0 and a fill of ``-3.4e38``. Calibrated like
any activation it gets a scale near ``3.4e38 / qmax``; every quantized tensor downstream of it --
the attention scores plus the mask, the Softmax input -- then holds only the fill and 0, and
every unmasked score becomes 0. Clipping the fill to the scores' range is no better: Softmax of a
clipped ``-10`` still weighs the padded keys. Such tensors must never set a scale.

:func:`find_saturating` recognises them from the graph alone (no data), in one pass over the
nodes in topological order:

* a *fill constant*: a float constant holding a value with ``|x| >= FILL_MAGNITUDE`` (1e4) or an
  infinity;
* a *mask*: the output of ``Mul`` by a fill constant, of ``Where`` with a fill-constant
  branch, of ``Add``/``Sub``/``Min``/``Max`` with a fill constant, of a data-movement op
  (``Expand``, ``Reshape`` ...) of a fill constant (a precomputed causal mask), or of a
  ``ConstantOfShape`` whose value is a fill;
* anything computed from a mask by data movement (Reshape, Unsqueeze, Squeeze, Expand, Tile,
  Transpose, Slice, Gather, Concat, Cast, Identity) or by ``Add``/``Sub``/``Min``/``Max``/
  ``Where`` with another tensor (the scores plus the mask), or by ``Mul``/``Div``: the Softmax
  input.

Policy (every preset, static, dynamic and Cast-pair alike): mask-like tensors and fill
constants are not quantized, and a node whose output is mask-like stays float (the plan lists it
with the reason). So the mask arithmetic, the masked score ``Add`` and the Softmax *input* stay
float32; the Softmax *output* (probabilities in [0, 1]) is quantized as the preset says. The
cost is one float Add per attention layer; the gain is that padded keys keep weight exactly 0.

Bound. No calibrated activation may be quantized with ``max(|lo|, |hi|) > MAX_ACTIVATION_ABS``
(1e6, i.e. a scale above ``1e6 / qmax``): a range that wide is a fill the graph rules did not
recognise (or an overflow), and quantizing it would zero every ordinary value.
:func:`check_range` raises :class:`~quark_onnx.errors.QuantizationError` naming the tensor and
the fix (``nodes_to_exclude``) instead of writing such a model. The largest real activations of
trained transformers (outlier dimensions of LLM residual streams) are below 1e4.
"""

from __future__ import annotations

import logging
import math

import numpy as np
import onnx_ir as ir

from quark_onnx.errors import QuantizationError
from quark_onnx.graph.ir import constant_array

logger = logging.getLogger(__name__)

#: A float constant holding a value at least this large in magnitude is a mask fill.
FILL_MAGNITUDE = 1e4
#: Constants with more elements than this are not inspected (weights, embedding tables).
_MAX_READ = 1 << 24
#: The widest calibrated range (max |x|) a quantized activation may have.
MAX_ACTIVATION_ABS = 1e6

_MOVE_OPS = frozenset(
    {
        "Reshape",
        "Unsqueeze",
        "Squeeze",
        "Expand",
        "Tile",
        "Transpose",
        "Slice",
        "Gather",
        "Concat",
        "Cast",
        "Identity",
    }
)
_COMBINE_OPS = frozenset({"Add", "Sub", "Min", "Max", "Where"})
#: A fill constant makes a mask only where it sets the values: Mul (Div by 1e4 shrinks them)
_SCALE_OPS = frozenset({"Mul"})


def is_fill_constant(value: ir.Value | None) -> bool:
    """``value`` is a float constant holding a value with ``|x| >= FILL_MAGNITUDE`` or an inf."""
    shape = value.shape if value is not None else None
    if shape is not None and shape.is_static() and math.prod(int(d) for d in shape) > _MAX_READ:
        return False  # a weight, not a fill: never read big tensors here
    try:
        array = constant_array(value)
    except ValueError:  # a malformed tensor: the checker or the stage that needs it reports it
        return False
    if array is None or array.dtype.kind != "f" or array.size == 0:
        return False
    finite = array[np.isfinite(array)]
    if finite.size < array.size and not np.isnan(array).all():
        return True
    return bool(finite.size) and float(np.max(np.abs(finite))) >= FILL_MAGNITUDE


def _fill_attribute(node: ir.Node) -> float | None:
    """The fill value of a ``ConstantOfShape`` whose ``value`` is a mask fill, else None."""
    attr = node.attributes.get("value")
    if attr is None:
        return None
    try:
        array = attr.as_tensor().numpy()
    except (ValueError, AttributeError):
        return None
    if array.dtype.kind != "f" or array.size != 1:
        return None
    value = float(array.reshape(()))
    return value if not abs(value) < FILL_MAGNITUDE else None


def find_saturating(graph: ir.Graph) -> dict[str, str]:
    """Mask-like tensor name -> why, for the top-level ``graph`` (see the module docstring).

    Fill constants read by a mask-making node are included (they must not be quantized as
    weights either).
    """
    found: dict[str, str] = {}
    for node in graph:
        if node.domain not in ("", "ai.onnx") or not node.outputs:
            continue
        op = node.op_type
        inputs = [v for v in node.inputs if v is not None]
        # only the ops that can apply a fill read their constants (weights are never read here)
        fills = (
            [v for v in inputs if is_fill_constant(v)]
            if op in _SCALE_OPS | _COMBINE_OPS | _MOVE_OPS and op != "Gather"
            else []
        )
        masked = [v for v in inputs if v.name in found]
        reason = None
        if op == "ConstantOfShape" and _fill_attribute(node) is not None:
            reason = f"ConstantOfShape node {node.name!r} fills with {_fill_attribute(node):g}"
        elif fills and op in _SCALE_OPS | _COMBINE_OPS | _MOVE_OPS:
            fill = constant_array(fills[0])
            shown = float(fill.reshape(-1)[np.argmax(np.abs(np.nan_to_num(fill.reshape(-1))))])
            reason = f"{op} node {node.name!r} with the fill constant {fills[0].name!r} ({shown:g})"
            for v in fills:
                found.setdefault(v.name or "", "a mask fill constant")
        elif masked and (op in _MOVE_OPS or op in _COMBINE_OPS or op in ("Mul", "Div")):
            reason = f"{op} node {node.name!r} reads the mask-like {masked[0].name!r}"
        if reason is None:
            continue
        for out in node.outputs:
            if out.name and out.dtype in (None, ir.DataType.FLOAT, ir.DataType.FLOAT16):
                found[out.name] = reason
    for name in found:
        logger.debug("mask-like tensor %s: %s", name, found[name])
    return found


def check_range(name: str, lo: float, hi: float) -> None:
    """Refuse to quantize an activation whose calibrated range exceeds ``MAX_ACTIVATION_ABS``."""
    amax = max(abs(float(lo)), abs(float(hi)))
    if not amax <= MAX_ACTIVATION_ABS:
        raise QuantizationError(
            f"activation {name!r}: calibrated range [{lo:g}, {hi:g}] exceeds the bound "
            f"|x| <= {MAX_ACTIVATION_ABS:g} for a quantized tensor; it looks like a mask or "
            "fill value (e.g. finfo.min) that the graph rules did not recognise. Keep the nodes "
            "that produce and read it float with nodes_to_exclude"
        )
