"""What the NPU rules' forced position moves cost each activation, in its own SQNR.

The NPU gives one power-of-two position to every tensor of a shared-scale group (a Concat's
inputs and output, a pool's input and output) and bounds the shifts between a layer's tensors
(:mod:`quark_onnx.params.solver`). When the tensors of a group have ranges several bits apart, the
group position clips the large ones or coarsens the small ones: a detector head concatenating
box offsets (``|x| <= 3``) with sigmoid scores (``<= 1``) stores the scores with 2 bits fewer; a
squeeze-excite block's GlobalAveragePool output (a channel mean) keeps its input's position, 3 to
4 bits coarser than its own range needs.

For every activation whose solved position differs from the one calibration chose, the cost is
the tensor's quantization SQNR at both positions, from the exact histogram error curve of the
calibration values (:meth:`quark_onnx.calibration.result.CalibrationResult.error_function`)::

    SQNR(p) = 10 log10( mean(x^2) / MSE(p) )        cost = SQNR(chosen) - SQNR(solved)

This is the tensor's own loss, not the model output's (what it does downstream depends on the
layers after it); it names the tensors where the rules, not the data, set the resolution.
Tensors calibrated with min/max only (no error curve) are skipped.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

#: A forced move losing at least this much of a tensor's own SQNR (dB; 6.02 dB per bit) is
#: logged as a warning. One bit is what a ``2x`` range mismatch costs; below it the rules' cost
#: is within MinMSE's own choice between neighbouring positions.
COST_WARN_DB = 6.0


def _sqnr_db(power: float, mse: float) -> float:
    if mse <= 0.0:
        return math.inf
    if power <= 0.0:
        return -math.inf
    return 10.0 * math.log10(power / mse)


def forced_position_costs(
    chosen: Mapping[str, int],
    solved: Mapping[str, int],
    errors: Mapping[str, Callable[[int], float]],
    mean_squares: Mapping[str, float],
    adjustments: Iterable[Any] = (),
) -> list[dict[str, Any]]:
    """One entry per activation in ``errors`` whose ``solved`` position differs from ``chosen``.

    ``errors[t](p)``: mean squared quantization error of ``t`` at position ``p``;
    ``mean_squares[t]``: ``mean(x^2)`` of its calibration values; ``adjustments``: the solver's
    :class:`~quark_onnx.params.solver.Adjustment` records (objects or their dicts), whose rules are
    named in the entry. Entries are sorted by cost, largest first (ties by name: deterministic).
    """
    rules: dict[str, list[str]] = {}
    for adj in adjustments:
        a = adj if isinstance(adj, Mapping) else vars(adj)
        seen = rules.setdefault(a["tensor"], [])
        if a["rule"] not in seen:
            seen.append(a["rule"])
    out = []
    for name in sorted(errors):
        if name not in chosen or name not in solved or name not in mean_squares:
            continue
        before, after = int(chosen[name]), int(solved[name])
        if before == after:
            continue
        power = float(mean_squares[name])
        sqnr_before = _sqnr_db(power, errors[name](before))
        sqnr_after = _sqnr_db(power, errors[name](after))
        if not (math.isfinite(sqnr_before) and math.isfinite(sqnr_after)):
            continue
        out.append(
            {
                "tensor": name,
                "chosen_position": before,
                "solved_position": after,
                "rules": rules.get(name, []),
                "sqnr_chosen_db": round(sqnr_before, 2),
                "sqnr_solved_db": round(sqnr_after, 2),
                "cost_db": round(sqnr_before - sqnr_after, 2),
            }
        )
    out.sort(key=lambda e: (-e["cost_db"], e["tensor"]))
    return out


def cost_message(entry: Mapping[str, Any]) -> str:
    """One line naming the tensor, the move, the rule and its cost."""
    rules = ", ".join(entry["rules"]) or "NPU rules"
    return (
        f"tensor {entry['tensor']!r}: position {entry['chosen_position']} -> "
        f"{entry['solved_position']} ({rules}) costs {entry['cost_db']:.1f} dB of its own SQNR "
        f"({entry['sqnr_chosen_db']:.1f} -> {entry['sqnr_solved_db']:.1f} dB)"
    )


def activation_mean_squares(plan: Any, result: Any) -> dict[str, float]:
    """``mean(x^2)`` of every planned activation calibrated with a histogram (its exact
    ``square_sums`` over the count); activations observed by min/max only are left out."""
    out: dict[str, float] = {}
    if result is None:
        return out
    for name in plan.activation_names():
        observer = result.observer(name)
        squares = getattr(observer, "square_sums", None)
        if squares is not None and observer.count:
            out[name] = float(sum(squares)) / observer.count
    return out
