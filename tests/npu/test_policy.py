"""The per-op policy registry."""

from __future__ import annotations

import dataclasses

import pytest

from quark_onnx.config.options import ExtraOptions
from quark_onnx.npu import policy
from quark_onnx.npu.ops import OpSpec, Share
from quark_onnx.npu.policy import policy_for

REQUIRED = [
    "Conv",
    "ConvTranspose",
    "Gemm",
    "MatMul",
    "Add",
    "Sub",
    "Mul",
    "Concat",
    "MaxPool",
    "AveragePool",
    "GlobalAveragePool",
    "Relu",
    "Clip",
    "LeakyRelu",
    "PRelu",
    "HardSigmoid",
    "HardSwish",
    "Softmax",
    "Resize",
    "Reshape",
    "Flatten",
    "Transpose",
    "Squeeze",
    "Unsqueeze",
    "Slice",
    "Pad",
]


@pytest.mark.parametrize("op", REQUIRED)
def test_required_ops_have_a_policy(op):
    assert policy_for(op) is not None


def test_unknown_and_custom_domain_ops_have_none():
    assert policy_for("Sigmoid") is None
    assert policy_for("NonMaxSuppression") is None
    assert policy_for("Conv", "com.example") is None


def test_layer_slots():
    conv = policy_for("Conv")
    assert (conv.activation_inputs, conv.weight_input, conv.bias_input) == ((0,), 1, 2)
    assert conv.quantized_slots(3) == [0, 1, 2]
    assert conv.quantized_slots(2) == [0, 1]
    assert policy_for("Gemm").bias_input == 2
    assert policy_for("PRelu").weight_input == 1
    assert policy_for("Reshape").quantized_slots(2) == [0]  # the shape input stays int64
    assert policy_for("Concat").quantized_slots(4) == [0, 1, 2, 3]


def test_scale_passing_and_shared_ops():
    passing = {op for op in REQUIRED if policy_for(op).passes_scale}
    assert passing == {
        "MaxPool", "Pad", "Slice", "Resize", "Reshape", "Flatten", "Transpose", "Squeeze",
        "Unsqueeze",
    }  # fmt: skip
    assert policy_for("Concat").share is Share.ALL
    assert policy_for("AveragePool").share is Share.ALL
    shared = {op: policy_for(op).align_option for op in REQUIRED if policy_for(op).align_option}
    assert shared == {
        "Concat": "AlignConcat",
        "MaxPool": "AlignPool",
        "AveragePool": "AlignPool",
        "GlobalAveragePool": "AlignPool",
        "Pad": "AlignPad",
        "Slice": "AlignSlice",
    }


def test_fusion_entries_name_real_options():
    fields = {f.name for f in dataclasses.fields(ExtraOptions)}
    assert dict(policy.FUSABLE_ACTIVATIONS) == {
        "Relu": "RemoveQDQConvRelu",
        "Clip": "RemoveQDQConvClip",
        "LeakyRelu": "RemoveQDQConvLeakyRelu",
        "PRelu": "RemoveQDQConvPRelu",
    }
    for op in policy.quantizable_op_types():
        p = policy_for(op)
        for name in (p.align_option, p.fuse_option):
            assert name is None or name in fields
    producers = {op for op in REQUIRED if policy_for(op).fusable_producer}
    assert {"Conv", "Gemm", "Add", "MaxPool", "AveragePool", "GlobalAveragePool"} <= producers
    assert "Mul" not in producers


def test_registry_is_read_only():
    with pytest.raises(TypeError):
        policy.POLICIES["Sigmoid"] = OpSpec()  # type: ignore[index]
