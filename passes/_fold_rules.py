"""How a constant channel travels to the layers that read it: FoldConstantChannels' per-op rules.

A :class:`_Path` holds, per producer channel, where the channel is in a value, its constant, an
interval of its values and the Lipschitz factor so far; :func:`_step` maps it through one reader
node (see the pass's module docstring for each op's rule), stops at a consumer layer, or says
why the channel cannot pass.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import numpy as np
import onnx_ir as ir

from quark_onnx.passes._fold_layers import _STANDARD, _const, _label, _Layer


@dataclasses.dataclass
class _Path:
    """Where the producer's channels are on a value: per producer channel (vectors of length C).

    ``idx``: channel index in the value; ``const``: the value there if the producer's weights
    were zero (NaN where it would not be constant); ``lo``/``hi``: an interval holding the
    channel's values for the inputs considered (a point where the ops clamp it flat);
    ``lam``: Lipschitz factor accumulated so far; ``dws``: depthwise convs passed, each with the
    channel index at its input and its output constant.
    """

    idx: np.ndarray
    const: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    lam: np.ndarray
    dws: tuple[tuple[ir.Node, np.ndarray, np.ndarray], ...] = ()
    spatial_one: bool = False  # H = W = 1 is known (after a global pool)


@dataclasses.dataclass
class _Leaf:
    node: ir.Node | None  # the consumer Conv/Gemm, None when blocked
    path: _Path
    reason: str = ""  # why blocked (node is None)


def _per_channel(array: np.ndarray | None, idx: np.ndarray) -> np.ndarray | None:
    """A scalar or per-channel (``[C]``, ``[C,1,1]``, ``[1,C,1,1]``) parameter picked at ``idx``."""
    if array is None:
        return None
    a = np.asarray(array, dtype=np.float64)
    if a.size == 1:
        return np.full(idx.shape, float(a.reshape(())))
    squeezed = a.reshape(-1)
    # a per-channel parameter on axis 1 of N x C x ... broadcasts as [C, 1, 1] or [1, C, 1, 1]
    dims = [d for d in a.shape if d != 1]
    if len(dims) != 1:
        return None
    if np.max(idx, initial=-1) >= squeezed.size:
        return None
    return squeezed[idx]


def _map(path: _Path, f, lam: np.ndarray | float = 1.0) -> _Path:
    """``path`` through the per-channel continuous piecewise-linear ``f`` (kinks at most at 0 and
    at monotone clamps): the interval's image is spanned by ``f(lo)``, ``f(hi)`` and, when the
    interval straddles 0, ``f(0)``."""
    with np.errstate(invalid="ignore"):
        a, b = f(path.lo), f(path.hi)
        lo, hi = np.minimum(a, b), np.maximum(a, b)
        straddle = (path.lo < 0) & (path.hi > 0)
        zero = f(np.zeros_like(path.lo))
        lo = np.where(straddle, np.minimum(lo, zero), lo)
        hi = np.where(straddle, np.maximum(hi, zero), hi)
        const = f(path.const)
    return dataclasses.replace(path, const=const, lo=lo, hi=hi, lam=path.lam * lam)


def _zero_padded(path: _Path) -> _Path:
    """``path`` through an op that also reads zero padding: only a 0 constant stays constant."""
    return dataclasses.replace(
        path,
        const=np.where(path.const == 0, 0.0, np.nan),
        lo=np.minimum(path.lo, 0.0),
        hi=np.maximum(path.hi, 0.0),
    )


def _clip_bounds(node: ir.Node) -> tuple[float, float] | None:
    lo, hi = -math.inf, math.inf
    if "min" in node.attributes or "max" in node.attributes:
        return node.attributes.get_float("min", lo), node.attributes.get_float("max", hi)
    for i, default in ((1, lo), (2, hi)):
        if len(node.inputs) > i and node.inputs[i] is not None:
            arr = _const(node.inputs[i])
            if arr is None or arr.size != 1:
                return None
            bound = float(arr.reshape(()))
        else:
            bound = default
        if i == 1:
            lo = bound
        else:
            hi = bound
    return lo, hi


def _value_channels(value: ir.Value) -> int | None:
    shape = value.shape
    if shape is None or len(shape) < 2 or not isinstance(shape[1], int):
        return None
    return shape[1]


def _step(
    node: ir.Node, index: int, path: _Path, layer_of: Callable[[ir.Node], _Layer | None]
) -> _Path | str | None:
    """The path after ``node`` (which reads the value at ``index``); None if ``node`` is a
    consumer layer to fold into; a reason string if the path is blocked there. ``layer_of`` gives
    a Conv/Gemm node's working copy (None without constant float weights)."""
    op = node.op_type
    where = f"{op} {_label(node)!r}"
    if node.domain not in _STANDARD:
        return f"{where} is not a per-channel op"
    if any(out.uses() or out.is_graph_output() for out in node.outputs[1:]):
        return f"{where} has a second output in use"
    if op == "Concat":
        if node.attributes.get_int("axis", 0) not in (1,):
            return f"{where} does not concatenate channels (axis 1)"
        offset = 0
        for i in range(index):
            ch = _value_channels(node.inputs[i]) if node.inputs[i] is not None else None
            if ch is None:
                return f"{where}: channel count of input {i} unknown"
            offset += ch
        return dataclasses.replace(path, idx=path.idx + offset, spatial_one=path.spatial_one)
    if index != 0:
        return f"{where} reads the channel as input {index}"
    if op in ("Conv", "Gemm"):
        layer = layer_of(node)
        if layer is None:
            return f"{where} has no constant float weights"
        if op == "Conv" and _is_depthwise(layer):
            return _through_depthwise(layer, path)
        return None
    if op == "Identity" or op == "Dropout":
        return path
    if op == "Relu":
        return _map(path, lambda v: np.maximum(v, 0.0))
    if op == "Clip":
        bounds = _clip_bounds(node)
        if bounds is None:
            return f"{where} has non-constant bounds"
        return _map(path, lambda v: np.clip(v, *bounds))
    if op == "LeakyRelu":
        alpha = node.attributes.get_float("alpha", 0.01)
        return _map(path, lambda v: np.where(v >= 0, v, alpha * v), max(1.0, abs(alpha)))
    if op == "PRelu":
        slope = _per_channel(_const(node.inputs[1]), path.idx)
        if slope is None:
            return f"{where} slope is not a constant scalar or per-channel vector"
        return _map(path, lambda v: np.where(v >= 0, v, slope * v), np.maximum(1.0, np.abs(slope)))
    if op == "BatchNormalization":
        if node.attributes.get_int("training_mode", 0):
            return f"{where} is in training mode"
        params = [_per_channel(_const(v), path.idx) for v in node.inputs[1:5]]
        if any(p is None for p in params):
            return f"{where} parameters are not constant per-channel vectors"
        gamma, beta, mean, var = params
        m = gamma / np.sqrt(var + node.attributes.get_float("epsilon", 1e-5))
        return _map(path, lambda v: m * (v - mean) + beta, np.abs(m))
    if op in ("MaxPool", "GlobalMaxPool", "GlobalAveragePool"):
        return dataclasses.replace(path, spatial_one=op.startswith("Global"))
    if op == "AveragePool":
        counts_pad = node.attributes.get_int("count_include_pad", 0)
        pads = node.attributes.get_ints("pads", ()) or ()
        auto = node.attributes.get_string("auto_pad", "NOTSET")
        if counts_pad and (any(pads) or auto.startswith("SAME")):
            return _zero_padded(path)
        return path
    if op == "Pad":
        mode = node.attributes.get_string("mode", "constant")
        if mode == "constant":
            value = _const(node.inputs[2]) if len(node.inputs) > 2 and node.inputs[2] else None
            if value is not None and np.any(value != 0):
                return f"{where} pads with a non-zero value"
            return _zero_padded(path)
        return path
    if op in ("Flatten", "Reshape"):
        return _through_flatten(node, path, where)
    return f"{where} is not a per-channel op the constant can pass"


def _is_depthwise(layer: _Layer) -> bool:
    c_out = layer.weight.shape[0]
    return layer.group == c_out and layer.weight.shape[1] == 1 and c_out > 1


def _through_depthwise(layer: _Layer, path: _Path) -> _Path:
    rows = layer.weight.reshape(layer.weight.shape[0], -1)[path.idx]
    bias = layer.effective_bias()[path.idx]
    if layer.padded:  # the border windows read zeros too
        path = _zero_padded(path)
    l1 = np.abs(rows).sum(axis=1)
    with np.errstate(invalid="ignore"):
        const = path.const * rows.sum(axis=1) + bias
        center = (path.lo + path.hi) / 2 * rows.sum(axis=1) + bias
        radius = np.where(path.hi > path.lo, (path.hi - path.lo) / 2 * l1, 0.0)
        lo, hi = center - radius, center + radius
    unbounded = ~(np.isfinite(lo) & np.isfinite(hi))
    return _Path(
        idx=path.idx,
        const=const,
        lo=np.where(unbounded, -np.inf, lo),
        hi=np.where(unbounded, np.inf, hi),
        lam=path.lam * l1,
        dws=(*path.dws, (layer.node, path.idx, const)),
    )


def _through_flatten(node: ir.Node, path: _Path, where: str) -> _Path | str:
    shape = node.inputs[0].shape
    spatial_one = path.spatial_one or (
        shape is not None
        and len(shape) >= 2
        and all(isinstance(d, int) and d == 1 for d in list(shape)[2:])
    )
    if not spatial_one:
        return f"{where} flattens spatial positions (only N x C x 1 x 1 is followed)"
    if node.op_type == "Flatten":
        if node.attributes.get_int("axis", 1) != 1:
            return f"{where} does not flatten at axis 1"
        return path
    # Reshape N x C x 1 x 1 -> N x C: target [N | 0 | 1, -1 | 0 | C] or [-1, C]
    target = _const(node.inputs[1]) if len(node.inputs) > 1 else None
    channels = _value_channels(node.inputs[0])
    batch = shape[0] if shape is not None and len(shape) else None
    if target is not None and target.ndim == 1 and target.size == 2:
        first, second = (int(t) for t in target)
        if second in (0, channels) and first in (-1, 0, batch):
            return path
        if second == -1 and first in (0, batch) and first != -1:
            return path
    return f"{where} does not reshape N x C x 1 x 1 into N x C"


# ------------------------------------------------------------------------------- folding
