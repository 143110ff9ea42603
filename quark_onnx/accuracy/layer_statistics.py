"""Per-layer statistics of the rounding stages: ``G = X X^T``, ``C = X (T - b)^T`` and
``sum ||T - b||^2`` of a Conv (any group, stride, dilation, padding; im2col columns in ONNX order)
or Gemm layer, accumulated one sample at a time (:class:`_Statistics`), optionally on every k-th
output position only (gathered directly, :func:`im2col`). The loss they define and the rounding
that minimises it are in :mod:`~quark_onnx.accuracy.adaround`.

Targets (``target``), ``Xq`` the layer's input in the quantized model:

- ``"float"``: ``T`` the float model's output of the layer; the fit ``V* = C^T G^-1`` is then
  the least-squares (conditional-mean) estimate of the float output from the quantized input,
  which shrinks the response where the input is noisy (errors in variables).
- ``"weights"``: ``T - b = W Xq``, the layer's float weights on its quantized input (classic
  GPTQ): ``V* = W``; ``C = G W^T`` and ``sum ||T - b||^2 = tr(W G W^T)`` follow from ``G``
  alone (only ``G`` is accumulated).
- ``"debiased"``: the ``"float"`` fit with each output channel's gain raised so that the fitted
  output regressed on the float output has slope 1 (``var(t) / cov(V* xq, t)``, centred): the
  least-squares fit's attenuation undone per channel; ``C = G V*^T`` and ``sum ||T - b||^2``
  replaced by ``tr(V* G V*^T)``.

With ``Xq`` equal to the float input and ``T = W Xq + b`` the three are the same statistics
(``V* = W``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx_ir as ir

from quark_onnx.accuracy.layers import Layer

#: What the layer's output is fitted to (module doc).
TARGETS = ("float", "weights", "debiased")
#: Ridge of the debiased target's least-squares fit, relative to the mean diagonal of ``G``
#: (the rounding's own damping, :data:`~quark_onnx.accuracy.adaround.DAMPING`).
TARGET_DAMPING = 0.01


@dataclass
class _Geometry:
    groups: int
    kernel: tuple[int, int]
    strides: tuple[int, int]
    dilations: tuple[int, int]
    pads: tuple[int, int, int, int]


def _conv_geometry(node: ir.Node, weight_shape: tuple[int, ...]) -> _Geometry | None:
    if len(weight_shape) != 4:
        return None
    attrs = node.attributes
    if attrs.get_string("auto_pad", "NOTSET") not in ("NOTSET", "VALID"):
        return None
    pads = tuple(attrs.get_ints("pads", (0, 0, 0, 0)) or (0, 0, 0, 0))
    return _Geometry(
        groups=attrs.get_int("group", 1),
        kernel=(weight_shape[2], weight_shape[3]),
        strides=tuple(attrs.get_ints("strides", (1, 1)) or (1, 1)),  # type: ignore[arg-type]
        dilations=tuple(attrs.get_ints("dilations", (1, 1)) or (1, 1)),  # type: ignore[arg-type]
        pads=pads,  # type: ignore[arg-type]
    )


def _output_size(shape: tuple[int, ...], geo: _Geometry) -> tuple[int, int]:
    """(OH, OW) of a convolution with ``geo`` on an input of ``shape`` (N, C, H, W)."""
    kh, kw = geo.kernel
    top, left, bottom, right = geo.pads
    oh = (shape[2] + top + bottom - geo.dilations[0] * (kh - 1) - 1) // geo.strides[0] + 1
    ow = (shape[3] + left + right - geo.dilations[1] * (kw - 1) - 1) // geo.strides[1] + 1
    return oh, ow


def im2col(x: np.ndarray, geo: _Geometry, every: int = 1) -> np.ndarray:
    """Columns of a (N, C, H, W) input: (groups, C/groups * kh * kw, N * P), ONNX order.

    ``every`` > 1: only every ``every``-th output position of each sample (flat ``OH * OW``
    order, from the first), ``P = ceil(OH * OW / every)``; gathered directly, so the cost is
    that of the positions kept, not of all of them.
    """
    n, c, _, _ = x.shape
    kh, kw = geo.kernel
    sh, sw = geo.strides
    dh, dw = geo.dilations
    top, left, bottom, right = geo.pads
    xp = np.pad(x, ((0, 0), (0, 0), (top, bottom), (left, right))) if any(geo.pads) else x
    oh, ow = _output_size(x.shape, geo)
    if every > 1:
        flat = np.arange(0, oh * ow, every)
        ys, xs = (flat // ow) * sh, (flat % ow) * sw
        cols = np.empty((n, c, kh, kw, flat.size), dtype=x.dtype)
        for i in range(kh):
            for j in range(kw):
                cols[:, :, i, j] = xp[:, :, ys + i * dh, xs + j * dw]
        p = flat.size
    else:
        cols = np.empty((n, c, kh, kw, oh, ow), dtype=x.dtype)
        for i in range(kh):
            for j in range(kw):
                cols[:, :, i, j] = xp[
                    :,
                    :,
                    i * dh : i * dh + sh * (oh - 1) + 1 : sh,
                    j * dw : j * dw + sw * (ow - 1) + 1 : sw,
                ]
        p = oh * ow
    g = geo.groups
    cols = cols.reshape(n, g, (c // g) * kh * kw, p)
    return np.ascontiguousarray(np.transpose(cols, (1, 2, 0, 3))).reshape(g, -1, n * p)


class _Statistics:
    """``G``, ``C`` and ``sum ||T - b||^2`` of one layer, accumulated one sample at a time.

    ``columns`` > 0: at most that many output positions per sample (every k-th, so reruns are
    identical), multiplied in float32 and accumulated in float64 -- the cheap statistics
    second-order rounding uses; 0: every position in float64 (AdaRound). ``form`` is None for a
    layer form the rounding does not support. ``target``: module doc.
    """

    def __init__(
        self, layer: Layer, w_float: np.ndarray, bias: np.ndarray, columns: int = 0,
        target: str = "float",
    ):  # fmt: skip
        if target not in TARGETS:
            raise ValueError(f"unknown rounding target {target!r}; known: {', '.join(TARGETS)}")
        self.target = target
        self.columns = columns
        self.dtype = np.float32 if columns else np.float64
        self.bias = bias
        self.const = 0.0
        self.rows = 0  # positions accumulated (per group)
        self.available = 0  # positions the samples had before subsampling
        self.valid = True
        self.geo: _Geometry | None = None
        self.form: Any = None
        node = layer.node
        if layer.op_type == "Conv":
            geo = _conv_geometry(node, w_float.shape)
            if geo is None or w_float.shape[0] % geo.groups:
                return
            g, cout = geo.groups, w_float.shape[0]
            self.geo = geo
            self.wg = w_float.reshape(g, cout // g, -1).astype(np.float64)
            self.form = w_float.shape
        elif layer.op_type == "Gemm":
            attrs = node.attributes
            if (
                attrs.get_float("alpha", 1.0) != 1.0
                or attrs.get_float("beta", 1.0) != 1.0
                or attrs.get_int("transA", 0)
            ):
                return
            trans_b = attrs.get_int("transB", 0)
            wm = w_float if trans_b else w_float.T  # (M, K)
            self.wg = wm[None].astype(np.float64)
            self.form = ("gemm", trans_b, w_float.shape)
        else:
            return
        g, o, k = self.wg.shape
        self.gram = np.zeros((g, k, k))
        self.cross = np.zeros((g, k, o))
        # debiased target: sums over positions of the inputs, of T - b and of its square
        self.sums = (np.zeros((g, k)), np.zeros((g, o)), np.zeros((g, o)))

    @property
    def supported(self) -> bool:
        return self.form is not None and self.valid

    def add(self, x: np.ndarray, t: np.ndarray) -> None:
        """Accumulate one sample: the layer's input ``x`` (quantized model) and target ``t``."""
        if not self.supported:
            return
        if self.geo is None:  # Gemm
            k = self.wg.shape[2]
            a = np.asarray(x, dtype=np.float64).reshape(-1, k)
            self.gram[0] += a.T @ a
            self.rows += a.shape[0]
            self.available += a.shape[0]
            if self.target == "weights":
                return
            tt = np.asarray(t, dtype=np.float64).reshape(a.shape[0], -1) - self.bias.reshape(1, -1)
            self.cross[0] += a.T @ tt
            self.const += float(np.sum(tt * tt))
            if self.target == "debiased":
                self._add_sums(a.T[None], tt.T[None])
            return
        dtype, geo = self.dtype, self.geo
        g, o = self.wg.shape[:2]
        x = np.asarray(x, dtype=dtype)
        t = np.asarray(t)
        oh, ow = _output_size(x.shape, geo)
        if t.ndim != 4 or t.shape[0] != x.shape[0] or t.shape[2:] != (oh, ow):
            self.valid = False
            return
        self.available += x.shape[0] * oh * ow
        every = -(-(oh * ow) // self.columns) if self.columns and oh * ow > self.columns else 1
        # every k-th output position of each sample, gathered before anything is copied whole
        cols = im2col(x, geo, every)
        if g == 1:  # c @ c.T of a 2-D array is one symmetric rank-k update (half the products)
            c = cols[0]
            self.gram[0] += c @ c.T
        else:
            self.gram += np.matmul(cols, np.swapaxes(cols, 1, 2))
        self.rows += cols.shape[2]
        if self.target == "weights":
            return
        tt = t.reshape(t.shape[0], t.shape[1], -1)[:, :, ::every].astype(dtype)
        tt -= self.bias.reshape(1, -1, 1).astype(dtype)
        tg = np.ascontiguousarray(
            np.transpose(tt.reshape(tt.shape[0], g, o, -1), (1, 2, 0, 3)).reshape(g, o, -1)
        )
        self.cross += np.matmul(cols, np.swapaxes(tg, 1, 2))
        self.const += float(np.sum(np.square(tg, dtype=np.float64)))
        if self.target == "debiased":
            self._add_sums(cols, tg)

    def _add_sums(self, cols: np.ndarray, tg: np.ndarray) -> None:
        """Sums over positions of (g, K, P) input columns and (g, O, P) targets ``T - b``."""
        self.sums[0][:] += np.sum(cols, axis=2, dtype=np.float64)
        self.sums[1][:] += np.sum(tg, axis=2, dtype=np.float64)
        self.sums[2][:] += np.sum(np.square(tg, dtype=np.float64), axis=2)

    def result(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, float, Any] | None:
        """Grouped float weights, G, C, sum||T - b||^2 and how to ungroup; None: unsupported.
        For the ``"weights"`` and ``"debiased"`` targets ``C = G V*^T`` and the constant is
        ``tr(V* G V*^T)``, ``V*`` the target weights (module doc)."""
        if not self.supported:
            return None
        if self.target == "float":
            return self.wg, self.gram, self.cross, self.const, self.form
        wt = np.swapaxes(self.wg, 1, 2)  # (g, K, O)
        if self.target == "debiased":
            wt = self._debiased(wt)
        cross = np.matmul(self.gram, wt)
        return self.wg, self.gram, cross, float(np.sum(wt * cross)), self.form

    def _debiased(self, wt: np.ndarray) -> np.ndarray:
        """``V*^T`` of the debiased target: the damped least-squares fit ``(G + mu I)^-1
        (C + mu W^T)``, each output channel ``c`` then multiplied by ``var(t_c) / cov(v_c,
        t_c)`` (centered over positions), so that the fitted output regressed on the float one
        has slope 1; a channel whose fitted output does not covary with its target keeps the
        fit."""
        diag = np.diagonal(self.gram, axis1=1, axis2=2)
        mu = TARGET_DAMPING * np.maximum(np.mean(diag, axis=1), 1e-12)
        eye = np.eye(self.gram.shape[1])[None]
        try:
            fit = np.linalg.solve(self.gram + mu[:, None, None] * eye,
                                  self.cross + mu[:, None, None] * wt)  # fmt: skip
        except np.linalg.LinAlgError:
            return wt
        n = max(self.rows, 1)
        sum_x, sum_t, sum_t2 = self.sums
        centred = self.cross - np.einsum("gk,go->gko", sum_x, sum_t) / n
        cov = np.sum(fit * centred, axis=1)  # (g, O)
        var = sum_t2 - sum_t * sum_t / n
        ok = (cov > 0) & (var > 0)
        gain = np.where(ok, var / np.where(ok, cov, 1.0), 1.0)
        return fit * gain[:, None, :]


def _statistics(
    layer: Layer,
    w_float: np.ndarray,
    bias: np.ndarray,
    xs: Sequence[np.ndarray],
    ts: Sequence[np.ndarray],
    columns: int = 0,
    target: str = "float",
) -> tuple[np.ndarray, np.ndarray, np.ndarray, float, Any] | None:
    """:class:`_Statistics` over the samples ``xs``/``ts``; None for an unsupported layer."""
    stats = _Statistics(layer, w_float, bias, columns, target)
    for x, t in zip(xs, ts, strict=True):
        stats.add(x, t)
    return stats.result()


def _ungroup(codes: np.ndarray, how: Any) -> np.ndarray:
    if isinstance(how, tuple) and how and how[0] == "gemm":
        _, trans_b, shape = how
        m = codes[0]
        return m if trans_b else m.T.reshape(shape)
    return codes.reshape(how)
