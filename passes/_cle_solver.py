"""The CLE sweeps: float64 working copies of the layers, one equalization step of a pair (with
its gate), the groups of pairs that share layers, and the over-relaxation of their chains.

See :mod:`quark_onnx.passes.cross_layer_equalization` for the maths; this module only computes
the scales and applies them to the working copies (the pass writes them back).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import numpy as np
import onnx_ir as ir

from quark_onnx.graph.channels import (
    ChannelStats,
    _grouped_view,
    input_channel_ranges,
    output_channel_ranges,
)
from quark_onnx.passes._cle_noise import activation_noise, propagated_noise
from quark_onnx.passes._cle_pairs import _label

#: A channel whose weight product ``r1_i * r2_i`` is at most this times the pair's largest is ~0
#: (dead or constant; :class:`~quark_onnx.passes.FoldConstantChannels` removes such channels
#: exactly) and is never equalized: it keeps ``s = 1``. Balanced, its range would be 1e-2 of the
#: widest channel's in both layers, about one int8 code.
NEGLIGIBLE_RANGE = 1e-4

#: Powers of a pair's proposed scaling the gate tries, in order (full step, then damped steps).
GATE_DAMPING = (1.0, 0.5, 0.25)


@dataclasses.dataclass
class _Layer:
    """Float64 working copy of one conv's weight and bias, and whether it was rescaled."""

    node: ir.Node
    weight: np.ndarray
    bias: np.ndarray | None
    group: int
    original: np.ndarray
    changed: bool = False
    original_bias: np.ndarray | None = None

    #: Pending scaling of the ungated sweeps, applied by :meth:`materialize`: output channel
    #: ``o`` divided by ``out_scale[o]``, input channel ``c`` multiplied by ``in_scale[c]``.
    #: The sweeps need only channel ranges, and ``max |W[o, j, k] * in_j / out_o|`` over the
    #: kernel is ``peak[o, j] * in_j / out_o``: the kernel-free maxima (``peak``) are enough,
    #: and no weight is copied per step.
    out_scale: np.ndarray | None = None
    in_scale: np.ndarray | None = None
    peak: np.ndarray | None = None

    def restore(self) -> None:
        """Back to the weights the pass found."""
        self.weight = self.original.astype(np.float64)
        self.bias = None if self.original_bias is None else self.original_bias.astype(np.float64)
        self.changed = False
        self.out_scale = self.in_scale = self.peak = None

    def _start_pending(self) -> None:
        """The kernel-free peaks and unit pending scales, on first use."""
        if self.peak is None:
            c_out, cpg = self.weight.shape[:2]
            self.peak = np.abs(self.weight.reshape(c_out, cpg, -1)).max(axis=2)
            self.out_scale = np.ones(c_out)
            self.in_scale = np.ones(cpg * self.group)

    def _current_peaks(self) -> np.ndarray:
        """``max_k |W[o, j, k]|`` at the pending scaling, viewed ``(g, C_out/g, cpg)``."""
        c_out, cpg = self.weight.shape[:2]
        self._start_pending()
        assert self.peak is not None
        assert self.out_scale is not None and self.in_scale is not None
        g = self.group
        peaks = self.peak.reshape(g, c_out // g, cpg) * self.in_scale.reshape(g, 1, cpg)
        # in place: a second temporary of a large layer's size costs more than the division
        peaks /= self.out_scale.reshape(g, c_out // g, 1)
        return peaks

    def lazy_output_ranges(self) -> np.ndarray:
        """:func:`output_channel_ranges` of the weight at the pending scaling.

        ``max_j (peak[o, j] * in_j) / out_o``: dividing by the row's ``out_o`` after the max
        is the same float (a correctly rounded division by a positive number is monotonic)
        and costs one division per row instead of one per weight peak.
        """
        self._start_pending()
        assert self.peak is not None and self.in_scale is not None
        assert self.out_scale is not None
        c_out, cpg = self.peak.shape
        g = self.group
        rows = (self.peak.reshape(g, c_out // g, cpg) * self.in_scale.reshape(g, 1, cpg)).max(
            axis=2
        )
        return (rows / self.out_scale.reshape(g, c_out // g)).reshape(-1)

    def lazy_input_ranges(self) -> np.ndarray:
        """:func:`input_channel_ranges` of the weight at the pending scaling."""
        return self._current_peaks().max(axis=1).reshape(-1)

    def lazy_bias(self) -> np.ndarray | None:
        if self.bias is None or self.out_scale is None:
            return self.bias
        return self.bias / self.out_scale

    def materialize(self) -> None:
        """Apply the pending scaling to the weight and bias."""
        if self.out_scale is None or self.in_scale is None:
            return
        c_out, cpg = self.weight.shape[:2]
        g = self.group
        view = _grouped_view(self.weight, g)
        view = view / self.out_scale.reshape(g, c_out // g, 1, 1)
        view = view * self.in_scale.reshape(g, 1, cpg, 1)
        self.weight = view.reshape(self.weight.shape)
        if self.bias is not None:
            self.bias = self.bias / self.out_scale
        self.out_scale = self.in_scale = self.peak = None


@dataclasses.dataclass
class _Pair:
    """A conv and every conv reading its channels: ``readers`` holds each reader's layer and,
    per channel ``i`` of the first conv, the reader's input channel (``i`` plus a Concat
    offset)."""

    first: _Layer
    readers: list[tuple[_Layer, np.ndarray]]
    through: tuple[str, ...]
    cumulative: np.ndarray  # product of all s applied at this channel boundary
    rejected: bool = False  # the gate refused this pair's last proposed scaling
    #: exponent of the ungated sweeps' step ``s^relax`` (:func:`over_relaxation`)
    relax: float = 1.0

    @property
    def reader_layers(self) -> list[_Layer]:
        """The distinct reader layers, in discovery order."""
        seen: dict[int, _Layer] = {}
        for layer, _ in self.readers:
            seen.setdefault(id(layer), layer)
        return list(seen.values())

    @property
    def second(self) -> str:
        """The readers' labels, comma-separated."""
        return ", ".join(_label(layer.node) for layer in self.reader_layers)


def _negligible(r1: np.ndarray, r2: np.ndarray) -> np.ndarray:
    """Channels whose weight product ``r1_i * r2_i`` is at most :data:`NEGLIGIBLE_RANGE` times
    the largest (invariant under a per-channel rescaling of the pair)."""
    product = r1 * r2
    top = float(np.max(product)) if product.size else 0.0
    return product <= NEGLIGIBLE_RANGE * top


def _rescaled(
    first: _Layer, readers: Sequence[tuple[_Layer, np.ndarray]], scale: np.ndarray
) -> tuple[np.ndarray, dict[int, np.ndarray]]:
    """``W1[i] / s_i`` and, for each reader reading channel ``i`` as its input channel
    ``idx[i]``, ``W2[:, idx[i]] * s_i`` (grouped layout); new arrays (readers by ``id``)."""
    shape = (-1,) + (1,) * (first.weight.ndim - 1)
    new_first = first.weight / scale.reshape(shape)
    new: dict[int, np.ndarray] = {}
    for layer, idx in readers:
        weight = new.get(id(layer), layer.weight)
        factors = np.ones(weight.shape[1] * layer.group)
        factors[idx] = scale
        view = _grouped_view(weight, layer.group)
        cpg = view.shape[2]
        new[id(layer)] = (view * factors.reshape(layer.group, 1, cpg, 1)).reshape(weight.shape)
    return new_first, new


def _components(pairs: Sequence[_Pair]) -> list[list[_Pair]]:
    """The pairs grouped by shared layers (a chain such as ``conv -> dw -> conv`` or SqueezeNet's
    fire modules is one group), each group in the pairs' order."""
    parent = list(range(len(pairs)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    owner: dict[int, int] = {}
    for i, pair in enumerate(pairs):
        for layer in (pair.first, *pair.reader_layers):
            j = owner.setdefault(id(layer), i)
            parent[root(i)] = root(j)
    groups: dict[int, list[_Pair]] = {}
    for i, pair in enumerate(pairs):
        groups.setdefault(root(i), []).append(pair)
    return list(groups.values())


def _place_negligible(
    scale: np.ndarray, r1: np.ndarray, r2: np.ndarray, negligible: np.ndarray, live: np.ndarray
) -> np.ndarray:
    """Set ``scale`` of the ~0 channels that can sit inside both layers' typical ranges; returns
    which were set.

    A ~0 channel is not balanced with its partner (:data:`NEGLIGIBLE_RANGE`), but leaving it at
    ``s = 1`` keeps whatever factor the model happens to carry on it: a network whose channels
    were rescaled (same function) keeps a near-dead channel 100x wider than the rest and sets
    the per-tensor range of a whole layer with it, so the equalized point depends on the input
    scaling. Instead, with ``m1, m2`` the median ranges of the live channels, the channel gets
    ``s = sqrt((r1 / m1) / (r2 / m2))``, which makes its normalised ranges equal:
    ``r1 / s / m1 = r2 * s / m2 = sqrt(r1 r2 / (m1 m2))``. Where that is at most 1 the channel
    is inside the typical range of both layers, and ``s`` follows any rescaling of the channel
    (``r1 -> a r1``, ``r2 -> r2 / a`` give ``s -> a s``), so the equalized weights no longer
    depend on it. A channel with ``r1 r2 > m1 m2`` (a constant channel: a large bias read by
    wide weights, FoldConstantChannels' case) keeps ``s = 1``.
    """
    if not negligible.any():
        return negligible  # nothing to place (the medians are most of a sweep step's time)
    m1, m2 = float(np.median(r1[live])), float(np.median(r2[live]))
    placed = negligible & (r1 * r2 <= m1 * m2)
    scale[placed] = np.sqrt((r1[placed] / m1) / (r2[placed] / m2))
    return placed


def over_relaxation(length: int) -> float:
    """The step exponent ``omega = 2 / (1 + sin(pi / (length + 1)))`` for a chain of ``length``
    pairs (1.0 for a pair alone).

    In log scale a balancing step sets a boundary's ``log s`` to the mean of what its two
    neighbouring layers ask for, so a chain's sweeps are Gauss-Seidel sweeps on a 1-D Laplacian;
    successive over-relaxation with this classical optimum (Young) needs ``O(length)`` sweeps
    instead of ``O(length^2)``. The max in the ranges makes the real map only piecewise linear,
    so this is the optimum of the linear model, not a guarantee.
    """
    return 2.0 / (1.0 + math.sin(math.pi / (max(length, 1) + 1)))


def _chain_length(component: Sequence[_Pair]) -> int:
    """The most pairs on one path through ``component`` (pairs in graph order; a pair follows
    another when its first conv is one of the other's readers)."""
    depth: dict[int, int] = {}
    for pair in component:
        depth[id(pair.first)] = max(depth.get(id(pair.first), 0), 1)
        for layer in pair.reader_layers:
            depth[id(layer)] = max(depth.get(id(layer), 0), depth[id(pair.first)] + 1)
    return max(depth.values(), default=1) - 1


def _equalize(
    pair: _Pair, gate: str | None, scale_append_bias: bool, max_scale: float | None
) -> float:
    """One equalization of ``pair`` in place; returns ``mean_i |s_i - 1|``."""
    first = pair.first
    gated = gate in ("sum", "per_layer")
    if gated:
        r1w = output_channel_ranges(first.weight)
        bias = first.bias
        r2 = np.max(
            [input_channel_ranges(lay.weight, lay.group)[idx] for lay, idx in pair.readers],
            axis=0,
        )
    else:  # ungated sweeps: ranges of the pending scaling, applied once at the end
        r1w = first.lazy_output_ranges()
        bias = first.lazy_bias()
        # the channel-wise max over the readers (exact in any order; no stacked copy)
        r2 = functools.reduce(
            np.maximum, [lay.lazy_input_ranges()[idx] for lay, idx in pair.readers]
        )
    r1 = r1w
    if scale_append_bias and bias is not None:
        r1 = np.maximum(r1, np.abs(bias))
    scale = np.ones_like(r1)
    ok = (r1 > 0) & (r2 > 0) & np.isfinite(r1) & np.isfinite(r2)
    # a channel carrying ~0 is dead or constant, not narrow: equalizing with it would only
    # carry its ~0 range over to the partner (the weight ranges alone decide, a large bias
    # does not make a constant channel a partner)
    negligible = _negligible(r1w, r2)
    live = ok & ~negligible
    scale[live] = np.sqrt(r1[live] / r2[live])
    if not gated and np.any(live):
        # the ungated sweeps place a ~0 channel instead of leaving it where the model put it
        live |= _place_negligible(scale, r1, r2, ok & negligible, live)
    ok = live
    if not gated and pair.relax != 1.0:
        scale[ok] = scale[ok] ** pair.relax
    if max_scale is not None:
        total = np.clip(pair.cumulative * scale, 1.0 / max_scale, max_scale)
        scale = total / pair.cumulative
    if np.all(scale == 1.0):
        return 0.0
    if not gated:
        assert first.out_scale is not None
        first.out_scale = first.out_scale * scale
        first.changed = True
        for layer, idx in pair.readers:
            assert layer.in_scale is not None
            layer.in_scale[idx] *= scale
            layer.changed = True
        pair.cumulative = pair.cumulative * scale
        return float(np.mean(np.abs(scale - 1.0)))
    proposal = _gated(pair, scale, gate == "per_layer")
    pair.rejected = proposal is None
    if proposal is None:
        return 0.0
    scale, new_first, new_readers = proposal
    pair.cumulative = pair.cumulative * scale
    first.weight = new_first
    if first.bias is not None:
        first.bias = first.bias / scale
    first.changed = True
    for layer in pair.reader_layers:
        layer.weight = new_readers[id(layer)]
        layer.changed = True
    return float(np.mean(np.abs(scale - 1.0)))


def _gated(
    pair: _Pair, scale: np.ndarray, per_layer: bool
) -> tuple[np.ndarray, np.ndarray, dict[int, np.ndarray]] | None:
    """The first of ``scale``, ``scale^(1/2)``, ``scale^(1/4)`` that lowers the pair's
    power-of-two weight noise at the readers (and, ``per_layer``, raises no layer's), with
    the rescaled weights; or None.

    The damped steps because the power-of-two grid makes the noise jagged in ``s``: a full
    step can put one layer just past a grid point where half a step does not.
    """
    before = propagated_noise(
        pair.first.weight, [(lay.weight, lay.group, idx) for lay, idx in pair.readers]
    )
    for power in GATE_DAMPING:
        trial = scale**power
        new_first, new_readers = _rescaled(pair.first, pair.readers, trial)
        after = propagated_noise(
            new_first, [(new_readers[id(lay)], lay.group, idx) for lay, idx in pair.readers]
        )
        no_layer_worse = all(a <= b for a, b in zip(after, before, strict=True))
        if sum(after) < sum(before) and (no_layer_worse or not per_layer):
            return trial, new_first, new_readers
    return None


def _component_noise(component: Sequence[_Pair], stats: dict[str, ChannelStats]) -> float:
    """Predicted relative quantization noise of a group of pairs at their current weights:
    each pair's :func:`propagated_noise` (both layers' per-tensor power-of-two weights) plus
    the :func:`activation_noise` of every tensor their readers read (when measured).

    Both terms are noise over signal at the readers' outputs and neither changes when a
    channel is rescaled unless the power-of-two grids see it differently, so the sum is
    the same for a model and any per-channel rescaling of it at the same equalized point.
    """
    total = 0.0
    tensors: dict[str, tuple[dict[int, tuple[_Pair, np.ndarray]], dict[int, _Layer]]] = {}
    errors: dict[int, np.ndarray] = {}  # a layer is the first of one pair and a reader of another
    for pair in component:
        readers = [(layer.weight, layer.group, idx) for layer, idx in pair.readers]
        total += sum(propagated_noise(pair.first.weight, readers, errors))
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
            energy = _grouped_view(np.square(layer.weight), layer.group).sum(axis=(1, 3))
            if energy.size != width:
                break
            reads += energy.reshape(-1)
        else:
            total += activation_noise(stat, scale, reads)
    return total
