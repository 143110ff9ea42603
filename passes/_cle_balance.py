"""The balanced point of CLE's ungated sweeps, solved directly, so that the sweeps needed do not
grow with a chain's length (the solves it takes grow slowly: :data:`MAX_SOLVES`).

Why. In log scale (``x = log s``, the cumulative factor at a channel boundary) one sweep step
sets a live channel to::

    x_i = 1/2 max_a (c_a + x_a) + 1/2 min_b (x_b - c_b)

The max is the first conv's output range ``r1_i``: over the input channels ``a`` it reads
(``c_a = log |peak weight|``, ``x_a`` the previous boundary's factor on that channel, 0 when no
pair scales it) and its bias (a constant). The min is minus the readers' read range ``r2_i``:
over their output channels ``b`` (``x_b`` the next boundary's factor when that reader is the
first conv of a pair, else a constant). A sweep is a Gauss-Seidel sweep of that map, which is a
graph Laplacian where the maxima do not change hands: a change crosses a chain in
``O(length^2)`` sweeps, over-relaxed ``O(length)``, each ``O(length)`` work, so the pass grew
with the square of the depth (a 400-Conv chain: 1600 over-relaxed sweeps; 2000 Convs did not
converge in the 2000 sweeps allowed).

What. The map is the value of a game with a maximizing and a minimizing player, each choosing
which channel sets its range, and a fair coin between them. For fixed choices it is linear, and
its fixed point solves a sparse system: one block of unknowns per pair, coupled only along the
pairs' graph (a chain is block-tridiagonal), eliminated in graph order in ``O(pairs)`` block
operations. Choosing both sides anew after each solve (Newton) can cycle, as it does on a
1000-Conv chain; Hoffman and Karp's policy iteration does not: it keeps the maximizing choices
while the minimizing ones are improved to their optimum (monotone, finitely many solves), then
improves the maximizing choices and repeats (monotone again). The result is the sweeps' own fixed
point; the sweeps still run after it with the same stopping rule and settle what it leaves out:
~0 channels (placed against the live channels' medians), channels at the ``max_scale`` bound that
their residual pushes further out, and ties.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from quark_onnx.passes._cle_solver import NEGLIGIBLE_RANGE, _Layer, _Pair

#: Solves allowed per :func:`balance` (each ``O(pairs)``). Measured on the scaling benchmark's
#: chains of 4-channel Convs: 54 (100 Convs), 111 (1000), 136 (2000), 139 (4000); a chain of
#: 20000 was still solving after 23 CPU minutes (some 200 solves of ~6 s) and was stopped. Past
#: the bound the sweeps go on from where the policy iteration stopped, so the bound caps the
#: cost, not the result.
MAX_SOLVES = 200


@dataclasses.dataclass
class _Choices:
    """Per pair and channel: the input channel setting ``r1`` (-1: the bias), the reader and
    output channel setting ``r2``, and which channels are unknowns."""

    source: list[np.ndarray]
    reader: list[np.ndarray]
    channel: list[np.ndarray]
    free: list[np.ndarray]


class _Game:
    """The pairs' balance in log scale, with its couplings (see the module doc).

    The factors live in one flat vector ``x`` (pair ``b``'s channels at ``offset[b]:``, plus a
    trailing 0 for channels no pair scales); each layer maps its input and output channels
    into it, so the log ranges are ``log |w| + x[in] - x[out]`` with no product that can
    overflow while a poor choice of channels is being evaluated.
    """

    def __init__(self, pairs: Sequence[_Pair], bias_counts: bool, max_scale: float | None):
        self.pairs = pairs
        self.max_scale = max_scale
        sizes = [p.cumulative.size for p in pairs]
        self.offset = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.x = np.concatenate([np.log(p.cumulative) for p in pairs] + [np.zeros(1)])
        zero = int(self.offset[-1])
        layers: dict[int, _Layer] = {}
        for pair in pairs:
            for layer in (pair.first, *pair.reader_layers):
                layers.setdefault(id(layer), layer)
        self.in_map: dict[int, np.ndarray] = {}
        self.out_map: dict[int, np.ndarray] = {}
        self.log_peak: dict[int, np.ndarray] = {}
        self.log_bias: dict[int, np.ndarray | None] = {}
        for key, layer in layers.items():
            c_out, cpg = layer.weight.shape[:2]
            peak = np.abs(layer.weight.reshape(c_out, cpg, -1)).max(axis=2)
            with np.errstate(divide="ignore"):
                self.log_peak[key] = np.log(peak)
                bias = layer.bias
                self.log_bias[key] = (
                    np.log(np.abs(bias)) if bias_counts and bias is not None else None
                )
            self.in_map[key] = np.full(cpg * layer.group, zero)
            self.out_map[key] = np.full(c_out, zero)
        for b, pair in enumerate(pairs):
            start = int(self.offset[b])
            self.out_map[id(pair.first)] = start + np.arange(pair.cumulative.size)
            for layer, idx in pair.readers:
                self.in_map[id(layer)][idx] = start + np.arange(idx.size)
        self.bound = np.log(max_scale) * (1 - 1e-12) if max_scale is not None else np.inf
        self.floor = np.log(NEGLIGIBLE_RANGE)

    def _rows(self, layer: _Layer) -> np.ndarray:
        """``log r`` of every weight peak ``[o, j]`` at the factors ``x``, ``(C_out, cpg)``."""
        key = id(layer)
        c_out, cpg = self.log_peak[key].shape
        g = layer.group
        into = self.x[self.in_map[key]].reshape(g, 1, cpg)
        out = self.x[self.out_map[key]].reshape(g, c_out // g, 1)
        return (self.log_peak[key].reshape(g, c_out // g, cpg) + into - out).reshape(c_out, cpg)

    def evaluate(self, keep: _Choices | None, keep_max: bool) -> tuple[_Choices, list[np.ndarray]]:
        """The best choices at ``x`` and the residuals ``f = log r1 - log r2``; with ``keep``
        and ``keep_max``, ``r1`` is that of the kept maximizing choices (and the free channels
        are kept)."""
        out = _Choices([], [], [], [])
        residuals = []
        for b, pair in enumerate(self.pairs):
            first = pair.first
            rows = self._rows(first)
            n, cpg = rows.shape
            base = (np.arange(n) // (n // first.group)) * cpg
            local = rows.argmax(axis=1)
            r1w = rows[np.arange(n), local]
            source = local + base
            r1 = r1w
            log_bias = self.log_bias[id(first)]
            if log_bias is not None:
                by_bias = log_bias - self.x[self.out_map[id(first)]]
                source = np.where(by_bias > r1w, -1, source)
                r1 = np.maximum(r1w, by_bias)
            if keep is not None and keep_max:
                source = keep.source[b]
                r1 = rows[np.arange(n), np.clip(source - base, 0, None)]
                if log_bias is not None:
                    r1 = np.where(source < 0, by_bias, r1)
            r2 = np.full(n, -np.inf)
            reader = np.zeros(n, dtype=np.int64)
            channel = np.zeros(n, dtype=np.int64)
            for k, (layer, idx) in enumerate(pair.readers):
                values = self._rows(layer)  # (C_out, cpg)
                c_out, lcpg = values.shape
                per_group = c_out // layer.group
                group, column = np.divmod(idx, lcpg)
                columns = values.reshape(layer.group, per_group, lcpg)[group, :, column]
                best = columns.argmax(axis=1)
                top = columns[np.arange(idx.size), best]
                wins = top > r2
                r2 = np.where(wins, top, r2)
                reader = np.where(wins, k, reader)
                channel = np.where(wins, group * per_group + best, channel)
            ok = np.isfinite(r1w) & np.isfinite(r2) & np.isfinite(r1)
            product = np.where(ok, r1w + r2, -np.inf)
            live = ok & (product > self.floor + (product.max() if ok.any() else 0.0))
            with np.errstate(invalid="ignore"):  # -inf - -inf where a weight is all zero
                f = np.where(live, r1 - r2, 0.0)
            if keep is not None:
                free = keep.free[b]
            else:
                x = self.x[self.offset[b] : self.offset[b + 1]]
                outward = ((x >= self.bound) & (f > 0)) | ((x <= -self.bound) & (f < 0))
                free = live & ~outward
            out.source.append(source)
            out.reader.append(reader)
            out.channel.append(channel)
            out.free.append(free)
            residuals.append(np.where(free, f, 0.0))
        return out, residuals

    def solve(self, choices: _Choices, residuals: list[np.ndarray]) -> bool:
        """Move the free channels of ``x`` to the fixed point of the map linear at
        ``choices`` (one Newton step, exact for those choices); False if singular."""
        zero = int(self.offset[-1])
        place = np.full(zero + 1, -1)  # flat channel -> (its index among its pair's free ones)
        owner = np.full(zero + 1, -1)  # flat channel -> its pair
        for b, free in enumerate(choices.free):
            start = int(self.offset[b])
            owner[start : start + free.size] = b
            place[start + np.flatnonzero(free)] = np.arange(int(free.sum()))
        blocks: list[dict[int, np.ndarray]] = []
        rhs: list[np.ndarray] = []
        for b, pair in enumerate(self.pairs):
            free = choices.free[b]
            size = int(free.sum())
            row: dict[int, np.ndarray] = {b: 2.0 * np.eye(size)}
            rows = np.flatnonzero(free)
            source = choices.source[b][rows]
            before = np.where(
                source >= 0, self.in_map[id(pair.first)][np.clip(source, 0, None)], zero
            )
            readers = [pair.readers[k][0] for k in choices.reader[b][rows].tolist()]
            after = (
                np.array(
                    [
                        self.out_map[id(layer)][o]
                        for layer, o in zip(readers, choices.channel[b][rows].tolist(), strict=True)
                    ],
                    dtype=np.int64,
                )
                if size
                else np.zeros(0, dtype=np.int64)
            )
            for links in (before, after):
                coupled = place[links] >= 0
                for i, flat in zip(
                    np.flatnonzero(coupled).tolist(), links[coupled].tolist(), strict=True
                ):
                    c = int(owner[flat])
                    block = row.setdefault(c, np.zeros((size, int(choices.free[c].sum()))))
                    block[i, place[flat]] -= 1.0
            blocks.append(row)
            rhs.append(residuals[b][free])
        step = _solve(blocks, rhs)
        if step is None:
            return False
        for b, (free, d) in enumerate(zip(choices.free, step, strict=True)):
            start = int(self.offset[b])
            self.x[start + np.flatnonzero(free)] += d
        return True

    def write(self) -> None:
        """Every pair's cumulative factor ``exp(x)`` (within ``max_scale``), and its layers'
        pending scales with it (its first conv's output channels and its readers' input
        channels carry exactly the pair's cumulative factor)."""
        for b, pair in enumerate(self.pairs):
            total = np.exp(self.x[self.offset[b] : self.offset[b + 1]])
            if self.max_scale is not None:
                total = np.clip(total, 1.0 / self.max_scale, self.max_scale)
            if np.array_equal(total, pair.cumulative):
                continue
            pair.cumulative = total
            pair.first._start_pending()
            pair.first.out_scale = total.copy()
            pair.first.changed = True
            for layer, idx in pair.readers:
                layer._start_pending()
                assert layer.in_scale is not None
                layer.in_scale[idx] = total
                layer.changed = True


def _same(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


def balance(pairs: Sequence[_Pair], bias_counts: bool, max_scale: float | None) -> int:
    """Set the pairs' scales to the balanced point by Hoffman-Karp policy iteration (module
    doc); returns the number of linear solves (0 if already balanced or singular)."""
    game = _Game(pairs, bias_counts, max_scale)
    best, residuals = game.evaluate(None, keep_max=False)
    if not any(np.any(f) for f in residuals):
        return 0
    solves = 0
    while solves < MAX_SOLVES:
        # the minimizing choices to their optimum under the kept maximizing ones
        choices = best
        while solves < MAX_SOLVES:
            if not game.solve(choices, residuals):
                return solves
            solves += 1
            improved, residuals = game.evaluate(choices, keep_max=True)
            if _same(improved.reader, choices.reader) and _same(improved.channel, choices.channel):
                break
            choices = dataclasses.replace(choices, reader=improved.reader, channel=improved.channel)
        best, residuals = game.evaluate(choices, keep_max=False)
        best.free = choices.free
        if _same(best.source, choices.source):
            break
    game.write()
    return solves


def _solve(blocks: list[dict[int, np.ndarray]], rhs: list[np.ndarray]) -> list[np.ndarray] | None:
    """``sum_c blocks[b][c] @ x_c = rhs_b`` by block elimination in pair order (the graph's
    order: a chain stays block-tridiagonal); None if a pivot block is singular or the result
    is not finite. The system is row diagonally dominant and elimination keeps it so: no
    pivoting."""
    n = len(blocks)
    blocks = [dict(row) for row in blocks]
    rhs = [v.astype(np.float64) for v in rhs]
    below: list[set[int]] = [set() for _ in range(n)]  # rows r > c with a block in column c
    for r, row in enumerate(blocks):
        for c in row:
            if c < r:
                below[c].add(r)
    x: list[np.ndarray] = [np.zeros(0)] * n
    try:
        for k in range(n):
            pivot = blocks[k][k]
            if pivot.size == 0:
                continue
            for r in sorted(below[k]):
                row = blocks[r]
                factor = np.linalg.solve(pivot.T, row.pop(k).T).T
                for c, v in blocks[k].items():
                    if c == k:
                        continue
                    if c not in row:
                        if c < r:
                            below[c].add(r)
                        row[c] = -(factor @ v)
                    else:
                        row[c] = row[c] - factor @ v
                rhs[r] = rhs[r] - factor @ rhs[k]
        for k in range(n - 1, -1, -1):
            total = rhs[k].copy()
            for c, v in blocks[k].items():
                if c > k:
                    total -= v @ x[c]
            x[k] = np.linalg.solve(blocks[k][k], total) if total.size else total
    except np.linalg.LinAlgError:
        return None
    if not all(np.all(np.isfinite(v)) for v in x):
        return None
    return x
