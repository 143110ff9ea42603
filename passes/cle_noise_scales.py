"""Channel scales that minimise power-of-two quantization noise, from CLE's equalized point.

Cross-layer equalization (:mod:`~quark_onnx.passes.cross_layer_equalization`) balances each
channel's weight ranges, ``r1_i / s_i = r2_i s_i``. That maximises the product of the two
layers' per-channel precisions, which is the right target for per-channel scales; XINT8 has one
power-of-two step per tensor. With steps ``D1 = max_i r1_i / s_i / 127`` and ``D2 = max_i r2_i
s_i / 127`` (and ``D_T = max_c A_c / s_c / 127`` for the activation ``T`` between them, ``A_c``
its channel peaks), every weight and activation value gets rounding noise ``D^2 / 12`` whatever
its own range, and the readers' outputs see (the terms of
:func:`~quark_onnx.passes.cross_layer_equalization.propagated_noise` and
:func:`~quark_onnx.passes.cross_layer_equalization.activation_noise`, with the uniform-rounding
model instead of the grid)::

    F(s) = D1^2 (n1 sum_i G_i s_i^2 / P1) + sum_k Dk^2 (m_k sum_i a_i^2 / s_i^2 / P2_k)
           + sum_T D_T^2 (sum_i rho_i G_i s_i^2 / S_T) + (the layers' terms in other pairs)

``a_i^2 = ||W1[i]||^2``, ``G_i = sum_k ||W_k[:, i]||^2``, ``n1``/``m_k`` the weights per row /
column, ``rho_i`` the share of non-zero activation values, ``P1, P2_k, S_T`` the signal (none
changes under ``s``). For steps held at budgets ``B``, each channel's term ``c_i s_i^2 + d_i /
s_i^2`` is smallest at ``s_i = (d_i / c_i)^(1/4)``, and the budgets are feasible while every
channel stays inside them: ``s_i`` in ``[max(r1_i / B1, A_i / B_T), min_k B_k / r2k_i]``. The
equalized point is where the product of the budgets is smallest; it need not be where ``F`` is.
:func:`refine_component` therefore tries, per pair, the budgets ``2^(j/4)`` times the current
steps on each side (``j`` in ``-4..4``), takes each channel's optimum clipped to the budgets, and
keeps the scales with the lowest ``F`` at the steps they really give. The weights' positions
are known exactly (MinMSE on the weights themselves), so the pair's whole scaling is then moved
by ``2^(k/8)``, ``|k| <= 8``, to where the weights' exact power-of-two noise plus the
activations' grid-averaged noise (:func:`expected_noise`) is lowest: an activation's position
comes from calibration data the pass does not see, so for it only the expectation over where
its grid falls is known (``E[D^2] = (peak / 127)^2 * 3 / ln 4``). Gauss-Seidel sweeps repeat
this over a group's pairs (:data:`SWEEPS`). All of it is in rescaling-invariant quantities and
starts from the equalized point, so a model and any per-channel rescaling of it end on the same
weights (ties, which the power-of-two grids make exact, go to the candidate nearest the start:
:data:`MARGIN`).

:class:`~quark_onnx.passes.cross_layer_equalization.CrossLayerEqualization` calls
:func:`refine_component` only for a group its component gate equalizes (a real range
problem); it keeps the refined weights when the gate's own prediction falls, else the equalized
ones. A model whose ranges the gate leaves alone is not touched. The int8 bias's own step is
not modelled (measured: modelling it lowered PaddleOCR, benchmarks/results/cle_noise_scales.md).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

# The groups are CrossLayerEqualization's own pairs (first layer, readers with the channel each
# reads, cumulative scale) and its per-tensor channel statistics; this module does not import
# that one (it is imported by it), so they are typed loosely here.
_Pair = Any
_Layer = Any
ChannelStats = Any
#: ``propagated_noise(first_weight, [(reader_weight, group, idx), ...]) -> [N1, N2_1, ...]``
WeightNoise = Callable[[np.ndarray, Sequence[tuple[np.ndarray, int, np.ndarray]]], list[float]]

#: Budget factors tried on each side, relative to the current steps: ``2^(j/4)``, ``j = -4..4``.
BUDGETS = tuple(2.0 ** (j / 4.0) for j in range(-4, 5))

#: A candidate must beat the current one by this relative margin. Multiplying a whole pair's
#: scaling by 2 moves every power-of-two step by exactly one position, so candidates tie
#: exactly in the model and differ only by float rounding: without a margin the rounding (and
#: with it how the model's channels happened to be scaled) would pick among them. With it the
#: candidate nearest the equalized point wins, which is the same for any rescaling.
MARGIN = 1e-9

#: Gauss-Seidel sweeps over a component's pairs (each pair's optimum moves its neighbours').
SWEEPS = 3


def _grouped(weight: np.ndarray, group: int) -> np.ndarray:
    """An ONNX Conv weight ``C_out x C_in/g x k...`` viewed ``(g, C_out/g, C_in/g, K)``: input
    channel ``i`` is the slice ``[i // (C_in/g), :, i % (C_in/g), :]``."""
    return weight.reshape(group, weight.shape[0] // group, weight.shape[1], -1)


def _columns(weight: np.ndarray, group: int, reduce: Callable) -> np.ndarray:
    """``reduce`` of every input column of a (grouped) conv weight, length ``C_in``."""
    return reduce(_grouped(weight, group), axis=(1, 3)).reshape(-1)


def _layer_terms(component: Sequence[_Pair]) -> dict[tuple[int, int], float]:
    """Per (pair, layer): the layer's noise coefficient in that pair (``F``'s bracket, per unit
    step squared)."""
    terms: dict[tuple[int, int], float] = {}
    for pair in component:
        first = pair.first.weight
        rows = np.square(first).reshape(first.shape[0], -1).sum(axis=1)
        reads = np.zeros_like(rows)
        cols: dict[int, tuple[_Layer, np.ndarray]] = {}
        for layer, idx in pair.readers:
            col = _columns(np.square(layer.weight), layer.group, np.sum)[idx]
            reads += col
            prev = cols.get(id(layer))
            cols[id(layer)] = (layer, col if prev is None else prev[1] + col)
        p1 = float(np.sum(rows * reads))
        n1 = first[0].size
        terms[(id(pair), id(pair.first))] = n1 * float(np.sum(reads)) / p1 if p1 > 0 else 0.0
        for key, (layer, col) in cols.items():
            p2 = float(np.sum(col * rows))
            m = layer.weight.shape[0] // layer.group * layer.weight[0, 0].size
            terms[(id(pair), key)] = m * float(np.sum(rows)) / p2 if p2 > 0 else 0.0
    return terms


def _reader_terms(pair: _Pair, rows: np.ndarray) -> dict[int, dict]:
    """Per distinct reader of ``pair``: its column energies and peaks at the pair's channels,
    the peak of its other columns, and its weights per column."""
    readers: dict[int, dict] = {}
    for layer, idx in pair.readers:
        entry = readers.setdefault(
            id(layer), {"layer": layer, "idx": [], "col": np.zeros_like(rows), "r2": None}
        )
        entry["idx"].append(idx)
        entry["col"] += _columns(np.square(layer.weight), layer.group, np.sum)[idx]
        peaks = _columns(np.abs(layer.weight), layer.group, np.max)
        r2 = peaks[idx]
        entry["r2"] = r2 if entry["r2"] is None else np.maximum(entry["r2"], r2)
        rest = np.ones(peaks.size, dtype=bool)
        for i in entry["idx"]:
            rest[i] = False
        entry["rest"] = float(np.max(peaks[rest], initial=0.0))
        entry["m"] = layer.weight.shape[0] // layer.group * layer.weight[0, 0].size
    return readers


def _activation_terms(
    pair: _Pair,
    component: Sequence[_Pair],
    stats: Mapping[str, ChannelStats],
    tensor_scales: Callable[[str], np.ndarray | None],
    reads: np.ndarray,
) -> list[dict]:
    """Per activation the readers read: this pair's channels' peaks and noise weights in it,
    and the other channels' fixed part."""
    acts = []
    for name in {layer.node.inputs[0].name for layer, _ in pair.readers}:
        stat = stats.get(name)
        scale = tensor_scales(name)
        if stat is None or scale is None:
            continue
        idx = next(i for layer, i in pair.readers if layer.node.inputs[0].name == name)
        width = stat.max_abs.size
        all_reads = np.zeros(width)
        seen: set[int] = set()
        for other_pair in component:
            for layer, _ in other_pair.readers:
                if layer.node.inputs[0].name == name and id(layer) not in seen:
                    seen.add(id(layer))
                    all_reads += _columns(np.square(layer.weight), layer.group, np.sum)
        peak = stat.max_abs / scale
        signal = float(np.sum(stat.mean_square / np.square(scale) * all_reads))
        if signal <= 0:
            continue
        mask = np.ones(width, dtype=bool)
        mask[idx] = False
        coef = stat.nonzero[idx] * reads / signal
        acts.append(
            {
                "A": peak[idx],
                "rest": float(np.max(peak[mask], initial=0.0)),
                "coef": coef,
                "fixed": float(np.sum(stat.nonzero[mask] * all_reads[mask])) / signal,
            }
        )
    return acts


def refine_pair(
    pair: _Pair,
    component: Sequence[_Pair],
    stats: Mapping[str, ChannelStats],
    tensor_scales: Callable[[str], np.ndarray | None],
    exact: Callable[[], float] | None = None,
) -> bool:
    """Rescale ``pair``'s channels to the lowest ``F`` (module doc) among the budgets tried;
    returns whether it changed. Negligible channels (no signal on one side) stay where they
    are."""
    first = pair.first
    w1 = first.weight
    rows = np.square(w1).reshape(w1.shape[0], -1).sum(axis=1)
    r1 = np.abs(w1).reshape(w1.shape[0], -1).max(axis=1)
    n1 = w1[0].size
    terms = _layer_terms(component)
    other = {}  # each layer's coefficient in the component's other pairs
    for (pid, lid), value in terms.items():
        if pid != id(pair):
            other[lid] = other.get(lid, 0.0) + value

    readers = _reader_terms(pair, rows)
    reads = sum(e["col"] for e in readers.values())
    p1 = float(np.sum(rows * reads))
    if p1 <= 0:
        return False
    for e in readers.values():
        e["p2"] = float(np.sum(e["col"] * rows))

    acts = _activation_terms(pair, component, stats, tensor_scales, reads)

    def surrogate(s: np.ndarray) -> float:
        d1 = float(np.max(r1 / s))
        total = d1 * d1 * (n1 * float(np.sum(reads * s * s)) / p1 + other.get(id(first), 0.0))
        for key, e in readers.items():
            dk = max(float(np.max(e["r2"] * s)), e["rest"])
            own = e["m"] * float(np.sum(rows / (s * s))) / e["p2"] if e["p2"] > 0 else 0.0
            total += dk * dk * (own + other.get(key, 0.0))
        for a in acts:
            dt = max(float(np.max(a["A"] / s)), a["rest"])
            total += dt * dt * (float(np.sum(a["coef"] * s * s)) + a["fixed"])
        return total

    live = (rows > 0) & (reads > 0)
    if not np.any(live):
        return False
    d1_now = float(np.max(r1))
    dk_now = {k: max(float(np.max(e["r2"])), e["rest"]) for k, e in readers.items()}
    dt_now = [max(float(np.max(a["A"])), a["rest"]) for a in acts]
    best = np.ones_like(r1)
    best_f = surrogate(best)
    # nearest budgets first, so that of tied candidates the one nearest the start is kept
    for u, v in sorted(
        ((u, v) for u in BUDGETS for v in BUDGETS),
        key=lambda uv: (abs(math.log2(uv[0])) + abs(math.log2(uv[1])), uv),
    ):
        lo = r1 / (u * d1_now)
        c = (u * d1_now) ** 2 * n1 * reads / p1
        for a, dt in zip(acts, dt_now, strict=True):
            lo = np.maximum(lo, a["A"] / (u * dt))
            c = c + (u * dt) ** 2 * a["coef"]
        hi = np.full_like(r1, np.inf)
        d = np.zeros_like(r1)
        for k, e in readers.items():
            budget = v * dk_now[k]
            with np.errstate(divide="ignore"):
                hi = np.minimum(hi, np.where(e["r2"] > 0, budget / e["r2"], np.inf))
            if e["p2"] > 0:
                d = d + budget**2 * e["m"] * rows / e["p2"]
        if np.any(lo[live] > hi[live]):
            continue
        s = np.ones_like(r1)
        s[live] = np.clip((d[live] / c[live]) ** 0.25, lo[live], hi[live])
        f = surrogate(s)
        if f < best_f * (1.0 - MARGIN):
            best, best_f = s, f
    if np.all(best == 1.0):
        return False
    _apply(pair, best)
    if exact is None:
        return True
    _grid_step(pair, exact)
    return True


def _grid_step(pair: _Pair, exact: Callable[[], float]) -> None:
    """Move ``pair``'s whole scaling by the ``2^(k/8)``, ``|k| <= 8``, of lowest ``exact``
    noise (nearest first: of tied factors the nearest is kept)."""
    # the weights' power-of-two grids make the noise a step function of where their steps
    # fall: move the pair's whole scaling by 2^(k/8) (one side's steps down, the other's up)
    noise_at, chosen, applied = exact(), 1.0, 1.0
    for k in (k * sign for k in range(1, 9) for sign in (1, -1)):
        factor = 2.0 ** (k / 8.0)
        _apply(pair, np.full_like(pair.cumulative, factor / applied))
        applied = factor
        trial = exact()
        if trial < noise_at * (1.0 - MARGIN):
            noise_at, chosen = trial, factor
    _apply(pair, np.full_like(pair.cumulative, chosen / applied))


def _apply(pair: _Pair, scale: np.ndarray) -> None:
    """Divide ``pair``'s channels by ``scale`` in the first layer and multiply them in the
    readers (the float function is unchanged), and record the factor."""
    first = pair.first
    first.weight = first.weight / scale.reshape((-1,) + (1,) * (first.weight.ndim - 1))
    if first.bias is not None:
        first.bias = first.bias / scale
    first.changed = True
    for layer, idx in pair.readers:
        factors = np.ones(layer.weight.shape[1] * layer.group)
        factors[idx] = scale
        view = _grouped(layer.weight, layer.group) * factors.reshape(layer.group, 1, -1, 1)
        layer.weight = view.reshape(layer.weight.shape)
        layer.changed = True
    pair.cumulative = pair.cumulative * scale


def refine_component(
    component: Sequence[_Pair],
    stats: Mapping[str, ChannelStats],
    noise: Callable[[Sequence[_Pair], Mapping[str, ChannelStats]], float],
    before: float,
    weight_noise: WeightNoise,
) -> float:
    """Move an equalized ``component`` (predicted ``noise`` ``before``) to the scales of lowest
    modelled noise (module doc) when its predicted noise falls; returns the noise it keeps."""
    saved = [
        (
            p,
            p.cumulative.copy(),
            p.first.weight,
            p.first.bias,
            [(lay, lay.weight) for lay in p.reader_layers],
        )
        for p in component
    ]

    def tensor_scales(name: str) -> np.ndarray | None:
        stat = stats.get(name)
        if stat is None:
            return None
        scale = np.ones(stat.max_abs.size)
        for p in component:
            for layer, idx in p.readers:
                if layer.node.inputs[0].name == name:
                    scale[idx] = p.cumulative
        return scale

    def local(pair: _Pair) -> Callable[[], float]:
        # the pair and the pairs sharing an activation with it (their channels' scales)
        names = {layer.node.inputs[0].name for layer, _ in pair.readers}
        sub = [
            p
            for p in component
            if p is pair or names & {layer.node.inputs[0].name for layer, _ in p.readers}
        ]
        return lambda: expected_noise(sub, stats, weight_noise)

    for _ in range(SWEEPS):
        changed = [refine_pair(p, component, stats, tensor_scales, local(p)) for p in component]
        if not any(changed):
            break
    after = noise(component, stats)
    if after < before:
        return after
    for pair, cumulative, weight, bias, readers in saved:
        pair.cumulative = cumulative
        pair.first.weight, pair.first.bias = weight, bias
        for layer, w in readers:
            layer.weight = w
    return before


def expected_noise(
    component: Sequence[_Pair], stats: Mapping[str, ChannelStats], weight_noise: WeightNoise
) -> float:
    """The component's predicted noise with the weights' exact power-of-two rounding
    (``weight_noise``, CLE's ``propagated_noise``) and each activation's rounding averaged over
    where its grid falls."""

    total = 0.0
    tensors: dict[str, tuple[dict, dict]] = {}
    for pair in component:
        readers = [(layer.weight, layer.group, idx) for layer, idx in pair.readers]
        total += sum(weight_noise(pair.first.weight, readers))
        for layer, idx in pair.readers:
            owners, layers = tensors.setdefault(layer.node.inputs[0].name, ({}, {}))
            owners.setdefault(id(pair), (pair, idx))
            layers.setdefault(id(layer), layer)
    for name, (owners, layers) in tensors.items():
        stat = stats.get(name)
        if stat is None:
            continue
        width = stat.max_abs.size
        scale = np.ones(width)
        reads = np.zeros(width)
        for pair, idx in owners.values():
            scale[idx] = pair.cumulative
        for layer in layers.values():
            energy = _grouped(np.square(layer.weight), layer.group).sum(axis=(1, 3))
            if energy.size != width:
                break
            reads += energy.reshape(-1)
        else:
            peak = float(np.max(stat.max_abs / scale, initial=0.0))
            signal = float(np.sum(stat.mean_square / np.square(scale) * reads))
            if peak > 0 and signal > 0:
                # E[4^u] = 3 / ln 4 for a grid offset u uniform in [0, 1)
                step2 = (peak / 127.0) ** 2 * 3.0 / np.log(4.0)
                total += step2 / 12.0 * float(np.sum(stat.nonzero * reads)) / signal
    return total
