"""The power-of-two quantization noise CLE predicts for a pair's weights and activations.

What the gates of :class:`~quark_onnx.passes.CrossLayerEqualization` compare before and after a
scaling: the rounding noise of one per-tensor power-of-two int8 scale (the NPU's grid) on each
weight at its MinMSE position, and on an activation, as the readers' outputs see it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from quark_onnx.graph.channels import ChannelStats, _grouped_view


def activation_noise(stats: ChannelStats, scale: np.ndarray, reads: np.ndarray) -> float:
    """Rounding noise of one per-tensor power-of-two int8 activation, relative, as its readers'
    outputs see it.

    ``stats`` were measured before equalization; ``scale[c]`` is the factor channel ``c`` has
    been divided by since (``y_c / s_c``); ``reads[c] = sum_k ||W_k[:, c]||^2`` over the readers
    at their current weights. With the step ``D = 2^ceil(log2(max_c A_c / s_c / 127))`` (the
    smallest power of two that holds the widest channel) and ``rho_c`` the share of non-zero
    values::

        N_act = D^2 / 12 * sum_c rho_c reads_c / sum_c E[y_c^2] / s_c^2 * reads_c

    The denominator does not change with the scaling (``reads_c`` grows by ``s_c^2``); the
    numerator is what CLE trades: a channel made wider sets a coarser step for all the others.
    """
    peak = float(np.max(stats.max_abs / scale, initial=0.0))
    signal = float(np.sum(stats.mean_square / np.square(scale) * reads))
    if peak <= 0.0 or signal <= 0.0:
        return 0.0
    step = 2.0 ** math.ceil(math.log2(peak / 127.0))
    return step * step / 12.0 * float(np.sum(stats.nonzero * reads)) / signal


def pof2_noise_ratio(weight: np.ndarray) -> float:
    """``||Q(W) - W||^2 / ||W||^2`` with ``Q`` the per-tensor power-of-two int8 quantizer at the
    MinMSE position (what the XINT8 weights get); 0.0 for an all-zero weight.

    Energy-weighted: a narrow channel the grid rounds to zero barely moves it, which is why the
    gate uses :func:`propagated_noise` instead.
    """
    from quark_onnx.params import pof2

    energy = float(np.sum(np.square(weight, dtype=np.float64)))
    if energy == 0.0:
        return 0.0
    return pof2.sse(weight, pof2.minmse_position(weight)) / energy


def quant_error(weight: np.ndarray) -> np.ndarray:
    """``Q(W) - W`` in float64, ``Q`` the per-tensor power-of-two int8 quantizer at the MinMSE
    position."""
    from quark_onnx.params import pof2

    w64 = weight.astype(np.float64)
    if not np.any(w64):
        return np.zeros_like(w64)
    p = pof2.minmse_position(weight)
    return pof2.fake_quant(w64, p).astype(np.float64) - w64


def column_energy(weight: np.ndarray, group: int) -> np.ndarray:
    """``||W[:, i]||^2`` per input channel ``i`` of a (grouped) conv weight ``C_out x C_in/g x
    k...`` (float64, length ``C_in``)."""
    view = _grouped_view(np.square(weight.astype(np.float64)), group)
    return view.sum(axis=(1, 3)).reshape(-1)


def propagated_noise(
    first: np.ndarray,
    readers: Sequence[tuple[np.ndarray, int, np.ndarray]],
    errors: dict[int, np.ndarray] | None = None,
) -> list[float]:
    """Each layer's power-of-two rounding noise as the readers' outputs see it, relative.

    ``first``: the producer's weight (channel ``i`` = row ``i``); ``readers``: ``(weight, group,
    idx)`` per reader, reading channel ``i`` as its input channel ``idx[i]``. With ``E`` the
    rounding error of a whole tensor at its MinMSE position, ``a_i^2 = ||W1[i]||^2`` and
    ``g_i^2 = sum_k ||W_k[:, idx_k[i]]||^2``::

        N1   = sum_i ||E1[i]||^2 g_i^2 / sum_i ||W1[i]||^2 g_i^2
        N2_k = sum_i ||E_k[:, idx_k[i]]||^2 a_i^2 / sum_i ||W_k[:, idx_k[i]]||^2 a_i^2

    A channel's error counts as much as the signal it carries to the readers' outputs, so a
    channel the per-tensor grid rounds to nothing counts even if its weights are tiny (a plain
    ``||E||^2 / ||W||^2`` would ignore it). Rescaling a channel (``W1[i] / s``, ``W_k[:, i] *
    s``) leaves every weight ``||W1[i]||^2 g_i^2`` unchanged: only what the grid does to the
    rescaled weights moves these numbers. Returns ``[N1, N2_1, ...]`` (one per distinct reader
    weight, in order of first appearance). ``errors``: rounding errors already computed, by
    ``id`` of the weight array (filled here; for callers that judge several pairs sharing
    layers whose weights do not change meanwhile).
    """

    def error(weight: np.ndarray) -> np.ndarray:
        if errors is None:
            return quant_error(weight)
        if id(weight) not in errors:
            errors[id(weight)] = quant_error(weight)
        return errors[id(weight)]

    def columns(weight: np.ndarray, group: int, idx: np.ndarray) -> np.ndarray:
        return column_energy(weight, group)[idx]

    e1 = error(first)
    row_w = np.square(first.astype(np.float64)).reshape(first.shape[0], -1).sum(axis=1)
    row_e = np.square(e1).reshape(first.shape[0], -1).sum(axis=1)
    reads = np.zeros(first.shape[0])
    per_reader: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    for weight, group, idx in readers:
        w64 = weight.astype(np.float64)
        col_w = columns(w64, group, idx)
        reads += col_w
        if id(weight) not in per_reader:
            per_reader[id(weight)] = (np.zeros_like(row_w), np.zeros_like(row_w))
        total_w, total_e = per_reader[id(weight)]
        total_w += col_w
        total_e += columns(error(weight), group, idx)

    def ratio(err: np.ndarray, sig: np.ndarray, weights: np.ndarray) -> float:
        den = float(np.sum(sig * weights))
        return float(np.sum(err * weights)) / den if den > 0 else 0.0

    noise = [ratio(row_e, row_w, reads)]
    noise += [ratio(e, w, row_w) for w, e in per_reader.values()]
    return noise
