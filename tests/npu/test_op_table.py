"""Every row and every fact of the NPU op table is read by something a test observes.

For each row of :data:`quark_onnx.npu.ops.OPS`, and for each fact of a row that differs from
the default row, the table is patched (the row removed, or that one fact reset) and an oracle is
recomputed: the readiness findings on a one-node model of the op, the XINT8, float-scale and
weight-only plans of the graph holding every rule op (:mod:`graphs`) and of a transformer-op
graph, the solver's verification and the checker's findings on the written XINT8 model at fixed
positions, and the calibration collector's value derivation. The oracle must change: a row or
fact that changes nothing would be a list nobody reads.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from graphs import build
from onnx import TensorProto, helper

from quark_onnx.calibration import tensors
from quark_onnx.config.enums import QuantType
from quark_onnx.config.quantization import QuantizationConfig
from quark_onnx.npu import ops as npu_ops
from quark_onnx.npu import rules
from quark_onnx.npu.readiness import check
from quark_onnx.params.solver import verify
from quark_onnx.passes import InsertQDQ
from quark_onnx.plan.build import build_plan

FUSE = {
    "RemoveQDQConvRelu": True,
    "RemoveQDQConvClip": True,
    "RemoveQDQConvLeakyRelu": True,
    "RemoveQDQConvPRelu": True,
}
DEFAULT = npu_ops.OpSpec()
#: Random-position seeds; 38 breaks every rule on the graph (asserted below), the rest vary it.
SEEDS = (38, 0, 1, 2, 3)


def xint8(**extra: object) -> QuantizationConfig:
    qc = QuantizationConfig()
    qc.calibrate_method = "NonOverflow"
    qc.enable_npu_cnn = True
    qc.activation_type = QuantType.QInt8
    qc.extra_options.update(FUSE)
    qc.extra_options.update(extra)
    return qc


def float_scale(**extra: object) -> QuantizationConfig:
    qc = QuantizationConfig()
    qc.per_channel = True
    qc.extra_options.update(extra)
    return qc


def transformer_ops() -> onnx.ModelProto:
    """Gather on a constant table, Add, LayerNormalization, Gelu, Div: the float-scale-only rows."""
    rng = np.random.default_rng(1)
    inits = {
        "table": rng.standard_normal((16, 8)).astype(np.float32),
        "gamma": np.ones(8, np.float32),
        "beta": np.zeros(8, np.float32),
        "two": np.array(2.0, np.float32),
    }
    nodes = [
        helper.make_node("Gather", ["table", "ids"], ["e"], name="gather"),
        helper.make_node("Add", ["e", "x"], ["a"], name="add"),
        helper.make_node("LayerNormalization", ["a", "gamma", "beta"], ["n"], name="ln", axis=-1),
        helper.make_node("Gelu", ["n"], ["g"], name="gelu"),
        helper.make_node("Div", ["g", "two"], ["y"], name="div"),
    ]
    graph = helper.make_graph(
        nodes,
        "transformer_ops",
        [
            helper.make_tensor_value_info("ids", TensorProto.INT64, [1, 4]),
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 8]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8])],
        [onnx.numpy_helper.from_array(v, k) for k, v in inits.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    model.ir_version = 9
    return model


def single_node(op_type: str) -> onnx.ModelProto:
    """``Conv -> op -> Relu`` on float tensors (the op's own inputs beyond the first omitted):
    the op as a fused activation and as a fusing producer; not shape-inferred."""
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["x"], ["c"], name="pre"),
            helper.make_node(op_type, ["c"], ["y"], name="n"),
            helper.make_node("Relu", ["y"], ["z"], name="post"),
        ],
        "one",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, [1, 4])],
        value_info=[
            helper.make_tensor_value_info(v, TensorProto.FLOAT, [1, 4]) for v in ("c", "y")
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def qdq_chain(op_type: str) -> onnx.ModelProto:
    """``DQ(x) -> op -> Conv(DQ(w)) -> Q/DQ``: the checker reads the Conv's input position through
    the op only if the op carries positions (p_w 20 + p_in 3 - p_out 5 = 18 breaks shift_cut)."""
    scale = {p: np.array(2.0**-p, np.float32) for p in (3, 5, 20)}
    inits = [onnx.numpy_helper.from_array(v, f"s{p}") for p, v in scale.items()]
    inits += [
        onnx.numpy_helper.from_array(np.array(0, np.int8), "zp"),
        onnx.numpy_helper.from_array(np.ones((4, 4, 1, 1), np.int8), "wq"),
    ]
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "s3", "zp"], ["xq"], name="qx"),
        helper.make_node("DequantizeLinear", ["xq", "s3", "zp"], ["xd"], name="dqx"),
        helper.make_node(op_type, ["xd"], ["y"], name="n"),
        helper.make_node("DequantizeLinear", ["wq", "s20", "zp"], ["wd"], name="dqw"),
        helper.make_node("Conv", ["y", "wd"], ["c"], name="conv", kernel_shape=[1, 1]),
        helper.make_node("QuantizeLinear", ["c", "s5", "zp"], ["cq"], name="qc"),
        helper.make_node("DequantizeLinear", ["cq", "s5", "zp"], ["z"], name="dqc"),
    ]
    graph = helper.make_graph(
        nodes,
        "chain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 2, 2])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, [1, 4, 2, 2])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def plan_view(proto: onnx.ModelProto, qc: QuantizationConfig, infer: bool = True) -> tuple:
    if infer:
        proto = onnx.shape_inference.infer_shapes(proto, strict_mode=True)
    model = ir.serde.deserialize_model(proto)
    plan = build_plan(model, qc)
    return (
        tuple((n.name, n.op_type, n.inputs, n.output, n.weight, n.bias) for n in plan.nodes),
        tuple((t, s.kind, s.axis) for t, s in plan.tensors.items()),
        tuple(plan.equalities),
        tuple(plan.fused),
    )


def rule_view(proto: onnx.ModelProto) -> tuple:
    """Violations and written-model findings at fixed positions that break every rule."""
    model = ir.serde.deserialize_model(onnx.shape_inference.infer_shapes(proto))
    plan = build_plan(model, xint8())
    out = []
    for seed in SEEDS:
        rng = np.random.default_rng(seed)
        positions = {t: int(rng.integers(-4, 22)) for t in plan.tensors}
        out.append(tuple(verify(plan, positions, plan.options)))
        if seed in SEEDS[:2]:
            written = ir.serde.serialize_model(
                InsertQDQ(plan, positions)(ir.serde.deserialize_model(proto)).model
            )
            out.append(tuple(check(written).findings))
    return tuple(out)


def collector_view() -> tuple:
    """The collector's value derivation for a node of each row's op reading a calibrated tensor."""
    out = []
    for op in [*sorted(npu_ops.OPS), "NotAnOp"]:
        node = helper.make_node(op, ["a"], ["b"])
        out.append(tensors._derivation(node, "b", {"a"}, False))
    return tuple(out)


def oracle(op: str) -> tuple:
    every, transformer = build(), transformer_ops()
    return (
        tuple((f.rule, f.message) for f in check(single_node(op)).findings),
        tuple((f.rule, f.message) for f in check(qdq_chain(op)).findings),
        # a row's fix pass, when the run undid it, is not proposed (cpu_fix_pass)
        tuple(f.message for f in check(single_node(op), reverted_passes=REVERTED).findings),
        plan_view(single_node(op), xint8(), infer=False),
        plan_view(single_node(op), float_scale(), infer=False),
        plan_view(every, xint8()),
        plan_view(every, float_scale()),
        plan_view(every, float_scale(WeightsOnly=True)),
        plan_view(transformer, float_scale()),
        plan_view(transformer, xint8()),
        rule_view(every),
        collector_view(),
    )


#: Every pass a row proposes, as if a run had measured and undone it (read before any test
#: changes the table).
REVERTED = {r.cpu_fix_pass: "undone" for r in npu_ops.OPS.values() if r.cpu_fix_pass}

#: Facts no code path can read, with the reason.
MOOT = {
    ("Constant", "quantized"): "build_plan reads Constant nodes as data before any row",
    ("Shape", "quantized"): (
        "build_plan leaves shape arithmetic float before any row "
        "(quark_onnx.graph.shape_arithmetic): a Shape output is int64, and the checker skips its "
        "node for the same reason"
    ),
}


def _cases() -> list[tuple[str, str | None]]:
    cases: list[tuple[str, str | None]] = []
    for op, row in npu_ops.OPS.items():
        cases.append((op, None))
        for f in dataclasses.fields(row):
            moot = (op, f.name) in MOOT
            if getattr(row, f.name) != getattr(DEFAULT, f.name) and not moot:
                cases.append((op, f.name))
    return cases


def test_first_seed_breaks_every_rule():
    model = ir.serde.deserialize_model(onnx.shape_inference.infer_shapes(build()))
    plan = build_plan(model, xint8())
    rng = np.random.default_rng(SEEDS[0])
    positions = {t: int(rng.integers(-4, 22)) for t in plan.tensors}
    assert {v.rule for v in verify(plan, positions, plan.options)} == set(rules.RULES)


@pytest.fixture(scope="module")
def baselines() -> dict[str, tuple]:
    return {}


@pytest.mark.slow
@pytest.mark.parametrize(("op", "fact"), _cases(), ids=lambda v: str(v))
def test_removing_a_row_or_fact_changes_the_oracle(op, fact, baselines, monkeypatch):
    if op not in baselines:
        baselines[op] = oracle(op)
    row = npu_ops.OPS[op]
    if fact is None:
        monkeypatch.delitem(npu_ops._OPS, op)
    else:
        reset = dataclasses.replace(row, **{fact: getattr(DEFAULT, fact)})
        monkeypatch.setitem(npu_ops._OPS, op, reset)
    assert oracle(op) != baselines[op], f"{op}: {fact or 'row'} is read by nothing observed"
