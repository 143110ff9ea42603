"""Make power-of-two positions satisfy the NPU compiler's rules (:mod:`quark_onnx.npu.rules`).

:func:`solve_positions` takes the positions chosen per tensor (calibration for activations,
:func:`quark_onnx.params.pof2.weight_position` for weights, optionally the int8 NonOverflow position
of each bias) and returns positions for every planned tensor such that every enabled rule holds, or
reports the violations it cannot remove.

The problem. Variables are integer positions; the rules are linear:

* equalities (``Align*`` options): Concat inputs and output; MaxPool/AveragePool/GlobalAveragePool,
  Pad, Slice input = output; data-movement ops carry their input's position;
* Conv/Gemm/ConvTranspose: ``0 <= p_w + p_in - p_out <= 16`` (shift_cut) and
  ``lo(shift_cut) <= p_w + p_in - p_bias <= 15`` (shift_bias, ``lo = 0`` before a LeakyRelu);
* Add/Sub: ``max p_in - min p_in <= 7``; Add: ``-7 <= min p_in - p_out <= 25``;
* Mul: ``0 <= sum p_in - p_out <= 32``;
* HardSigmoid: ``0 <= p_in <= 15``, ``p_out >= 7``, ``14 + p_in - p_out > 0``.

The method.

1. *Equalities first*: a union-find over the active equalities gives one variable per group. The
   group starts at the position minimising the summed error of its members when ``errors`` gives
   them (searched between the members' lowest and highest positions), else at the members' lowest
   position: lowering a position coarsens the grid but never clips, raising it clips.
2. *Hard lower bounds* (HardSigmoid ``p_in >= 0``, ``p_out >= 7``) raise their variables once and
   become floors the later steps never go below.
3. *Inequalities to a fixed point*: a worklist of nodes; a node with a violated rule picks, among
   the moves that fix it, the cheapest: lowering a shared variable (an activation group), or
   moving a *local* variable (a weight or bias read by that node only) up or down. The cost of a
   move is the increase of the members' quantization error (``errors[tensor](p)``); without
   ``errors`` it is the distance moved, with raising a position (which clips) 1000 times dearer
   than lowering it and local moves preferred on ties (they disturb no other node). Errors are
   compared only when every candidate move has an error function (the units must match);
   otherwise all candidates use the distance cost. When a shared variable is lowered the nodes
   reading it are queued again.

   Termination: shared variables only ever decrease, by at least 1 per move, and never below
   their floor (:data:`~quark_onnx.params.pof2.POSITION_MIN` or a hard bound), so there are at most
   ``sum(p0 - floor)`` shared moves; local variables belong to one node, and a node visit makes at
   most :data:`MAX_LOCAL_STEPS` moves. The worklist is empty after finitely many visits, and then
   no enabled rule is violated except those recorded as unfixable (a violated rule with no
   admissible move).
4. *Bias*: a bias read by one node is a free variable: it is placed, inside its shift_bias window
   ``[p_w + p_in - 15, p_w + p_in - lo]``, at its preferred (int8 NonOverflow) position when that
   lies inside, else at the window's nearest end; above the NonOverflow position the bias values
   saturate in int8, which is reported in :attr:`SolveResult.bias_overflows`. With ``Int32Bias``
   the bias position is ``p_in + p_w``.
5. *Verification*: every enabled rule is recomputed from the final positions by the rules'
   own :meth:`~quark_onnx.npu.rules.Rule.evaluate` (the readiness checker calls the same on a
   written model); every violation is listed in :attr:`SolveResult.unfixable` (node, rule, value,
   limits, tensors). None is dropped.

Which rules a node has comes from its row in :mod:`quark_onnx.npu.ops` (``shift_rules``); the
moves that fix a rule are :data:`_NEEDS`, keyed by rule id.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from quark_onnx.config.options import ExtraOptions
from quark_onnx.errors import QuantizationError
from quark_onnx.npu import ops as npu_ops
from quark_onnx.npu import rules
from quark_onnx.npu.rules import Violation
from quark_onnx.params.pof2 import POSITION_MAX, POSITION_MIN
from quark_onnx.params.verify import verify
from quark_onnx.plan.types import PlannedNode, QuantPlan, TensorKind, UnionFind

logger = logging.getLogger(__name__)

#: Cost factor of raising a position by one (clips) relative to lowering it by one.
RAISE_PENALTY = 1000.0
#: Most moves of local variables in one visit of one node.
MAX_LOCAL_STEPS = 64


@dataclass(frozen=True)
class Adjustment:
    """``tensor``'s position moved from ``old`` to ``new`` to satisfy ``rule`` at ``node``."""

    tensor: str
    old: int
    new: int
    rule: str
    node: str


@dataclass
class SolveResult:
    """Positions of every planned tensor, what was moved, and what could not be fixed."""

    positions: dict[str, int]
    adjustments: list[Adjustment] = field(default_factory=list)
    unfixable: list[Violation] = field(default_factory=list)
    bias_overflows: list[Violation] = field(default_factory=list)
    visits: int = 0

    @property
    def ok(self) -> bool:
        return not self.unfixable


@dataclass(frozen=True)
class _Move:
    var: str
    new: int
    rule: str


class _Solver:
    def __init__(
        self,
        plan: QuantPlan,
        positions: dict[str, int],
        options: ExtraOptions,
        errors: dict[str, Callable[[int], float]] | None,
        ceilings: dict[str, int] | None = None,
    ) -> None:
        self.plan = plan
        self.opts = options
        self.errors = errors or {}
        self.ceilings = ceilings or {}
        self.adjustments: list[Adjustment] = []
        self.visits = 0
        self.uf = UnionFind()
        for name in plan.tensors:
            self.uf.add(name)
        for eq in plan.active_equalities(options):
            for t in eq.tensors[1:]:
                self.uf.union(eq.tensors[0], t)
        self.members: dict[str, list[str]] = {}
        for name in plan.tensors:
            self.members.setdefault(self.uf.find(name), []).append(name)
        self.given = {k: int(v) for k, v in positions.items()}
        self.floor: dict[str, int] = {}
        self.value: dict[str, int] = {}
        self.preferred_bias: dict[str, int | None] = {}
        # which nodes read each variable; local = weight/bias variable read by exactly one node
        readers: dict[str, list[int]] = {}
        for i, node in enumerate(plan.nodes):
            touched = dict.fromkeys([*node.inputs, node.output])  # ordered: deterministic
            for t in touched:
                if t is not None and t in plan.tensors:
                    var_readers = readers.setdefault(self.var(t), [])
                    if not var_readers or var_readers[-1] != i:
                        var_readers.append(i)
        self.readers = readers
        self.local = {
            v
            for v, members in self.members.items()
            if len(members) == 1
            and plan.tensors[members[0]].kind is not TensorKind.ACTIVATION
            and len(readers.get(v, ())) == 1
        }

    # --- variables ---------------------------------------------------------------------------
    def var(self, tensor: str) -> str:
        return self.uf.find(tensor)

    def pos(self, tensor: str) -> int:
        return self.value[self.var(tensor)]

    def is_bias_var(self, v: str) -> bool:
        return self.plan.tensors[self.members[v][0]].kind is TensorKind.BIAS

    def group_cost(self, v: str, p: int) -> float | None:
        fns = [self.errors[m] for m in self.members[v] if m in self.errors]
        return sum(f(p) for f in fns) if fns else None

    def move_cost(self, v: str, new: int, exact: bool) -> float:
        """Cost of moving ``v`` to ``new``: its error increase when ``exact``, else the distance
        (raising, which clips, :data:`RAISE_PENALTY` times dearer than lowering)."""
        cur = self.value[v]
        if exact:
            base = (self.group_cost(v, new) or 0.0) - (self.group_cost(v, cur) or 0.0)
        else:
            d = new - cur
            base = -d if d < 0 else d * RAISE_PENALTY
        # ties: a local move disturbs no other node
        return base + (0.0 if v in self.local else 1e-9 * abs(new - cur))

    def set(self, v: str, new: int, rule: str, node: str) -> None:
        old = self.value[v]
        if new == old:
            return
        self.value[v] = new
        for m in self.members[v]:
            self.adjustments.append(Adjustment(m, old, new, rule, node))

    # --- initial values ----------------------------------------------------------------------
    def initialise(self) -> None:
        for v, members in self.members.items():
            if self.is_bias_var(v):
                continue
            known = [self.given[m] for m in members if m in self.given]
            if not known:
                missing = ", ".join(members)
                raise QuantizationError(
                    f"no position given for tensor(s) {missing}; pass a position for every "
                    "activation and weight of the plan (calibration / pof2.weight_position)"
                )
            start = min(known)
            if len(members) > 1 and any(m in self.errors for m in members):
                candidates = range(min(known), max(known) + 1)
                start = min(candidates, key=lambda p: (self.group_cost(v, p), -p))
            ceiling = min((self.ceilings[m] for m in members if m in self.ceilings), default=None)
            if ceiling is not None and start > ceiling:
                # a member that must not be clipped far below its range (a graph output)
                for m in members:
                    self.adjustments.append(Adjustment(m, start, ceiling, "range_ceiling", "group"))
                start = ceiling
            self.value[v] = start
            self.floor[v] = POSITION_MIN
            for m in members:
                if m in self.given and self.given[m] != start:
                    self.adjustments.append(
                        Adjustment(m, self.given[m], start, "shared_scale", "group")
                    )
        for v, members in self.members.items():
            if not self.is_bias_var(v):
                continue
            b = members[0]
            self.preferred_bias[v] = self.given.get(b)
            self.floor[v] = POSITION_MIN
            preferred = self.given.get(b)
            # without a preferred position the bias starts at the top of its window (finest)
            self.value[v] = preferred if preferred is not None else POSITION_MAX
        if self.opts.AdjustHardSigmoid:
            low_in = rules.HARD_SIGMOID_INPUT_RANGE[0]
            hard_sigmoid_ops = npu_ops.rule_ops("hard_sigmoid")
            for node in self.plan.nodes:
                if (
                    node.op_type not in hard_sigmoid_ops
                    or node.inputs[0] is None
                    or not node.output
                ):
                    continue
                for tensor, low in (
                    (node.inputs[0], low_in),
                    (node.output, rules.HARD_SIGMOID_OUTPUT_MIN),
                ):
                    v = self.var(tensor)
                    self.floor[v] = max(self.floor[v], low)
                    if self.value[v] < low:
                        self.set(v, low, "hard_sigmoid", node.name)

    # --- rules -------------------------------------------------------------------------------
    def needs(self, node: PlannedNode) -> list[tuple[str, list[_Move]]]:
        """The first violated rule of ``node`` (in its row's rule order) with the candidate moves
        that fix it; the next rule is looked at once this one holds."""
        row = npu_ops.spec(node.op_type)
        for rule_id in row.shift_rules if row is not None else ():
            option = rules.RULES[rule_id].option
            if option is not None and not getattr(self.opts, option):
                continue
            found = _NEEDS[rule_id](self, node)
            if found:
                return found
        return []

    def _cut_needs(self, node: PlannedNode) -> list[tuple[str, list[_Move]]]:
        if not (node.weight and node.output and node.inputs[0]):
            return []
        i, w, o = self.var(node.inputs[0]), self.var(node.weight), self.var(node.output)
        sc = rules.shift_cut(self.value[w], self.value[i], self.value[o])
        lo, hi = rules.SHIFT_CUT_RANGE
        if sc < lo:
            d = lo - sc
            moves = [
                _Move(o, self.value[o] - d, "shift_cut"),
                _Move(w, self.value[w] + d, "shift_cut"),
            ]
            return [("shift_cut", moves)]
        if sc > hi:
            d = sc - hi
            moves = [
                _Move(w, self.value[w] - d, "shift_cut"),
                _Move(i, self.value[i] - d, "shift_cut"),
                _Move(o, self.value[o] + d, "shift_cut"),
            ]
            return [("shift_cut", moves)]
        return []

    def bias_window(self, node: PlannedNode) -> tuple[int, int]:
        """Bias positions allowed by shift_bias: ``[p_w + p_in - 15, p_w + p_in - lo]``."""
        acc = self.pos(node.weight) + self.pos(node.inputs[0])
        sc = acc - self.pos(node.output)
        lo, hi = rules.shift_bias_range(sc, node.before_leaky_relu)
        return acc - hi, acc - lo

    def _bias_needs(self, node: PlannedNode) -> list[tuple[str, list[_Move]]]:
        if not (node.weight and node.output and node.inputs[0]):
            return []
        if not node.bias or self.opts.Int32Bias:
            return []
        b = self.var(node.bias)
        low, high = self.bias_window(node)
        cur = self.value[b]
        if b in self.local:
            target = self.best_bias(b, low, high)
            return [] if target == cur else [("shift_bias", [_Move(b, target, "shift_bias")])]
        i, w = self.var(node.inputs[0]), self.var(node.weight)
        if cur > high:
            return [("shift_bias", [_Move(b, high, "shift_bias")])]
        if cur < low:
            d = low - cur
            return [
                (
                    "shift_bias",
                    [
                        _Move(w, self.value[w] - d, "shift_bias"),
                        _Move(i, self.value[i] - d, "shift_bias"),
                    ],
                )
            ]
        return []

    def best_bias(self, b: str, low: int, high: int) -> int:
        """Bias position in ``[low, high]``: least error, else nearest the preferred position."""
        tensor = self.members[b][0]
        if tensor in self.errors:
            return min(range(low, high + 1), key=lambda p: (self.errors[tensor](p), -p))
        preferred = self.preferred_bias.get(b)
        if preferred is None:
            return high
        return min(max(preferred, low), high)

    def _add_inputs(self, node: PlannedNode) -> tuple[list[str], list[int]] | None:
        ins = [self.var(t) for t in node.activation_inputs]
        if len(ins) < 2:
            return None
        return ins, [self.value[v] for v in ins]

    def _read_needs(self, node: PlannedNode) -> list[tuple[str, list[_Move]]]:
        found = self._add_inputs(node)
        if found is None:
            return []
        ins, vals = found
        lo_v = ins[vals.index(min(vals))]
        hi_v = ins[vals.index(max(vals))]
        spread = rules.shift_read(vals)
        if spread <= rules.SHIFT_READ_MAX:
            return []
        d = spread - rules.SHIFT_READ_MAX
        moves = [
            _Move(hi_v, self.value[hi_v] - d, "shift_read"),
            _Move(lo_v, self.value[lo_v] + d, "shift_read"),
        ]
        return [("shift_read", moves)]

    def _write_needs(self, node: PlannedNode) -> list[tuple[str, list[_Move]]]:
        found = self._add_inputs(node)
        if found is None or not node.output:
            return []
        ins, vals = found
        lo_v = ins[vals.index(min(vals))]
        o = self.var(node.output)
        sw = rules.shift_write(vals, self.value[o])
        lo, hi = rules.SHIFT_WRITE_RANGE
        if sw < lo:
            d = lo - sw
            moves = [
                _Move(o, self.value[o] - d, "shift_write"),
                _Move(lo_v, self.value[lo_v] + d, "shift_write"),
            ]
            return [("shift_write", moves)]
        if sw > hi:
            d = sw - hi
            moves = [
                _Move(lo_v, self.value[lo_v] - d, "shift_write"),
                _Move(o, self.value[o] + d, "shift_write"),
            ]
            return [("shift_write", moves)]
        return []

    def _mul_needs(self, node: PlannedNode) -> list[tuple[str, list[_Move]]]:
        if not node.output:
            return []
        ins = [self.var(t) for t in node.activation_inputs]
        if len(ins) < 2:
            return []
        o = self.var(node.output)
        s = rules.mul_shift([self.value[v] for v in ins], self.value[o])
        lo, hi = rules.MUL_SHIFT_RANGE
        count = {v: ins.count(v) for v in ins}
        if s < lo:
            d = lo - s
            moves = [_Move(o, self.value[o] - d, "mul_shift")]
            moves += [
                _Move(v, self.value[v] + math.ceil(d / c), "mul_shift") for v, c in count.items()
            ]
            return [("mul_shift", moves)]
        if s > hi:
            d = s - hi
            moves = [
                _Move(v, self.value[v] - math.ceil(d / c), "mul_shift") for v, c in count.items()
            ]
            moves.append(_Move(o, self.value[o] + d, "mul_shift"))
            return [("mul_shift", moves)]
        return []

    def _hard_sigmoid_needs(self, node: PlannedNode) -> list[tuple[str, list[_Move]]]:
        if not (node.output and node.inputs[0]):
            return []
        i, o = self.var(node.inputs[0]), self.var(node.output)
        hi_in = rules.HARD_SIGMOID_INPUT_RANGE[1]
        if self.value[i] > hi_in:
            return [("hard_sigmoid", [_Move(i, hi_in, "hard_sigmoid")])]
        if rules.hard_sigmoid_shift(self.value[i], self.value[o]) <= 0:
            target = self.value[i] + 13
            return [
                (
                    "hard_sigmoid",
                    [
                        _Move(o, target, "hard_sigmoid"),
                        _Move(i, self.value[o] - 13, "hard_sigmoid"),
                    ],
                )
            ]
        return []

    # --- the fixed point ---------------------------------------------------------------------
    def admissible(self, move: _Move) -> bool:
        cur = self.value[move.var]
        if move.new == cur:
            return False
        if move.new < cur:
            return move.new >= self.floor[move.var]
        return move.var in self.local and move.new <= POSITION_MAX

    def run(self) -> set[tuple[int, str]]:
        """Fix every node's rules; return (node index, rule) pairs given up as unfixable."""
        nodes = self.plan.nodes
        queue = deque(range(len(nodes)))
        queued = set(queue)
        given_up: set[tuple[int, str]] = set()
        while queue:
            idx = queue.popleft()
            queued.discard(idx)
            self.visits += 1
            node = nodes[idx]
            for _ in range(MAX_LOCAL_STEPS):
                needs = [(r, m) for r, m in self.needs(node) if (idx, r) not in given_up]
                if not needs:
                    break
                rule, moves = needs[0]
                options = [m for m in moves if self.admissible(m)]
                if not options:
                    given_up.add((idx, rule))
                    continue
                # errors are compared only when every candidate has them (same units)
                exact = all(self.group_cost(m.var, m.new) is not None for m in options)
                best = min(options, key=lambda m: self.move_cost(m.var, m.new, exact))
                self.set(best.var, best.new, rule, node.name)
                if best.var not in self.local:
                    for reader in self.readers.get(best.var, ()):
                        if reader != idx and reader not in queued:
                            queue.append(reader)
                            queued.add(reader)
                            given_up = {g for g in given_up if g[0] != reader}
            else:
                logger.warning(
                    "node %s: rules still moving after %d steps", node.name, MAX_LOCAL_STEPS
                )
        return given_up

    # --- results -----------------------------------------------------------------------------
    def finish(self) -> SolveResult:
        positions: dict[str, int] = {}
        overflows: list[Violation] = []
        for name in self.plan.tensors:
            positions[name] = self.value[self.var(name)]
        for node in self.plan.nodes:
            if not (node.bias and node.weight and node.inputs[0]):
                continue
            if self.opts.Int32Bias:
                positions[node.bias] = self.pos(node.weight) + self.pos(node.inputs[0])
                continue
            b = self.var(node.bias)
            preferred = self.preferred_bias.get(b)
            chosen = b in self.local and self.opts.AdjustShiftBias and node.output is not None
            if not chosen and preferred is None:
                raise QuantizationError(
                    f"bias {node.bias} of {node.op_type} {node.name}: no position given; pass "
                    "its int8 position (pof2.bias_position) or enable AdjustShiftBias"
                )
            if preferred is not None and positions[node.bias] > preferred:
                overflows.append(
                    Violation(
                        rule="bias_range",
                        node=node.name,
                        op_type=node.op_type,
                        value=positions[node.bias],
                        limits=f"<= {preferred} (int8 NonOverflow position of the bias)",
                        tensors=(node.bias,),
                        message=(
                            f"{node.op_type} {node.name}: bias {node.bias} needs position "
                            f"{positions[node.bias]} for shift_bias <= 15 but its values only "
                            f"fit int8 up to position {preferred}; they saturate (use "
                            "Int32Bias, or lower the weight/input positions)"
                        ),
                    )
                )
        for name, spec in self.plan.tensors.items():
            if spec.kind is TensorKind.BIAS and name not in positions:
                raise QuantizationError(f"bias {name}: no position given and no rule sets one")
        unfixable = verify(self.plan, positions, self.opts)
        for v in unfixable:
            logger.warning("NPU rule not satisfiable: %s", v.message)
        return SolveResult(
            positions=positions,
            adjustments=self.adjustments,
            unfixable=unfixable,
            bias_overflows=overflows,
            visits=self.visits,
        )


def solve_positions(
    plan: QuantPlan,
    positions: dict[str, int],
    options: ExtraOptions | None = None,
    errors: dict[str, Callable[[int], float]] | None = None,
    ceilings: dict[str, int] | None = None,
) -> SolveResult:
    """Adjust ``positions`` so that every NPU rule enabled in ``options`` holds (see module doc).

    Args:
        plan: from :func:`quark_onnx.plan.build.build_plan`.
        positions: tensor -> position for every activation and weight of the plan (biases are
            optional: their int8 NonOverflow position, used as the preferred position).
        options: the ``Align*``/``Adjust*``/``Int32Bias`` switches (default: the plan's).
        errors: optional tensor -> (position -> quantization MSE); moves then minimise the summed
            error instead of the distance moved.
        ceilings: optional tensor -> highest position its group may start at (a graph output's
            range must not be clipped far: the quantizer passes its NonOverflow position + 1).
            Later moves only lower shared positions, so only a hard floor can exceed a ceiling.

    Raises:
        QuantizationError: an activation or weight of the plan has no position.
    """
    opts = options if options is not None else plan.options
    solver = _Solver(plan, positions, opts, errors, ceilings)
    solver.initialise()
    solver.run()
    result = solver.finish()
    logger.info(
        "NPU constraints: %d position change(s), %d unfixable, %d node visit(s)",
        len(result.adjustments),
        len(result.unfixable),
        result.visits,
    )
    return result


#: Rule id -> the moves that fix it at a node (empty: the rule holds there).
_NEEDS: dict[str, Callable[[_Solver, PlannedNode], list[tuple[str, list[_Move]]]]] = {
    "shift_cut": _Solver._cut_needs,
    "shift_bias": _Solver._bias_needs,
    "shift_read": _Solver._read_needs,
    "shift_write": _Solver._write_needs,
    "mul_shift": _Solver._mul_needs,
    "hard_sigmoid": _Solver._hard_sigmoid_needs,
}
