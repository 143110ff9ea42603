"""The solver's verification and the readiness check agree, rule for rule, on every rule op.

For random positions on a graph holding every op with an NPU position rule or fact
(:mod:`graphs`), the violations :func:`quark_onnx.params.solver.verify` reports from the plan and
positions are exactly the position findings :func:`quark_onnx.check` reports on the model written
with those positions (same rule, same node, same count). Then the same after solving.
"""

from __future__ import annotations

import collections

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from graphs import build
from hypothesis import given, settings
from hypothesis import strategies as st

from quark_onnx.config.enums import QuantType
from quark_onnx.config.quantization import QuantizationConfig
from quark_onnx.npu import rules
from quark_onnx.npu.readiness import check
from quark_onnx.params.solver import solve_positions, verify
from quark_onnx.passes import InsertQDQ
from quark_onnx.plan.build import build_plan
from quark_onnx.plan.types import TensorKind

FUSE = {
    "RemoveQDQConvRelu": True,
    "RemoveQDQConvClip": True,
    "RemoveQDQConvLeakyRelu": True,
    "RemoveQDQConvPRelu": True,
}


def config(**extra: object) -> QuantizationConfig:
    qc = QuantizationConfig()
    qc.calibrate_method = "NonOverflow"
    qc.enable_npu_cnn = True
    qc.activation_type = QuantType.QInt8
    qc.extra_options.update(FUSE)
    qc.extra_options.update(extra)
    return qc


def plan_of(proto: onnx.ModelProto, qc: QuantizationConfig):
    model = ir.serde.deserialize_model(onnx.shape_inference.infer_shapes(proto))
    return model, build_plan(model, qc)


def written_findings(proto, qc, positions) -> collections.Counter:
    model, plan = plan_of(proto, qc)
    out = ir.serde.serialize_model(InsertQDQ(plan, positions)(model).model)
    return collections.Counter(
        (f.rule, f.node) for f in check(out).findings if f.rule in rules.RULES
    )


def random_positions(plan, rng: np.random.Generator) -> dict[str, int]:
    # wide enough that every rule is broken on some draws and holds on others
    return {t: int(rng.integers(-4, 22)) for t in plan.tensors}


@pytest.fixture(scope="module")
def every_rule_op():
    return build()


def test_graph_holds_every_rule_op(every_rule_op):
    """The graph is what the property below is about: every rule has a site in its plan."""
    _, plan = plan_of(every_rule_op, config())
    planned = {n.op_type for n in plan.nodes}
    for rule in rules.RULES.values():
        assert rule.ops & planned, rule.id
    fused = {(pair.producer, pair.activation_op) for pair in plan.fused}
    assert fused == {
        ("conv1", "Relu"),
        ("conv2", "LeakyRelu"),
        ("conv3", "PRelu"),
        ("conv5", "Relu"),
        ("hsig1", "Mul"),
        ("avgpool", "Mul"),
        ("gap", "Mul"),
    }


@settings(max_examples=40, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**32 - 1))
def test_verify_equals_readiness_on_random_positions(every_rule_op, seed):
    qc = config()
    _, plan = plan_of(every_rule_op, qc)
    positions = random_positions(plan, np.random.default_rng(seed))
    expected = collections.Counter((v.rule, v.node) for v in verify(plan, positions, plan.options))
    assert written_findings(every_rule_op, qc, positions) == expected


def test_random_positions_break_every_rule(every_rule_op):
    """The draws of the property above reach every rule (else it could pass vacuously)."""
    qc = config()
    _, plan = plan_of(every_rule_op, qc)
    seen = set()
    for seed in range(40):
        positions = random_positions(plan, np.random.default_rng(seed))
        seen |= {v.rule for v in verify(plan, positions, plan.options)}
    assert seen == set(rules.RULES)


@pytest.mark.parametrize("seed", range(6))
def test_solved_positions_are_ready(every_rule_op, seed):
    """After solving, the unfixable list is what the checker finds on the written model."""
    qc = config()
    _, plan = plan_of(every_rule_op, qc)
    rng = np.random.default_rng(seed)
    positions = {
        t: int(rng.integers(-4, 22))
        for t, spec in plan.tensors.items()
        if spec.kind is not TensorKind.BIAS
    }
    result = solve_positions(plan, positions)
    expected = collections.Counter((v.rule, v.node) for v in result.unfixable)
    assert written_findings(every_rule_op, qc, result.positions) == expected
