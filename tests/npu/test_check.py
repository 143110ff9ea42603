"""The Vitis AI readiness checker and the NPU rule functions.

Each test builds a tiny QDQ graph in the form quark_onnx writes (two explicit-attribute Convs, batch
1, static shapes, power-of-two scales) with one chosen violation, and asserts that exactly that rule
is reported; the same graph with in-range positions must give no finding.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from conftest import make_model, run_ort, shared_path
from onnx import TensorProto, helper

from quark_onnx.errors import ModelLoadError
from quark_onnx.npu import op_sets as R
from quark_onnx.npu.findings import CheckResult, Finding
from quark_onnx.npu.readiness import check
from quark_onnx.npu.rules import (
    MAX_CONV_KERNEL_SIDE,
    MUL_SHIFT_RANGE,
    SHIFT_CUT_RANGE,
    SHIFT_READ_MAX,
    SHIFT_WRITE_RANGE,
    hard_sigmoid_shift,
    hard_sigmoid_violations,
    in_range,
    mul_shift,
    position_of_scale,
    scale_of_position,
    shift_bias,
    shift_bias_range,
    shift_cut,
    shift_read,
    shift_write,
)

SHAPE = [1, 4, 8, 8]
CONV_ATTRS = {"kernel_shape": [3, 3], "strides": [1, 1], "pads": [1, 1, 1, 1], "dilations": [1, 1]}


class QDQGraph:
    """Builds small QDQ graphs with chosen power-of-two positions (scale = 2**-p)."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self.rng = np.random.default_rng(0)
        self._n = 0

    def _fresh(self, base: str) -> str:
        self._n += 1
        return f"{base}_{self._n}"

    def _init(self, name: str, array: np.ndarray) -> str:
        self.inits.append(onnx.numpy_helper.from_array(np.asarray(array), name))
        return name

    def qparams(self, tensor: str, pos: int | None, zp=0, zp_dtype=np.int8, scale=None):
        scale = np.float32(2.0**-pos) if scale is None else np.asarray(scale, np.float32)
        s = self._init(f"{tensor}_scale", np.asarray(scale, np.float32))
        z = self._init(f"{tensor}_zero_point", np.asarray(zp, zp_dtype))
        return s, z

    def qdq(self, tensor: str, pos: int | None, **kw) -> str:
        """tensor -> QuantizeLinear -> DequantizeLinear; returns the DQ output."""
        s, z = self.qparams(tensor, pos, **kw)
        q, dq = f"{tensor}_QuantizeLinear_Output", f"{tensor}_DequantizeLinear_Output"
        self.nodes.append(helper.make_node("QuantizeLinear", [tensor, s, z], [q], f"{tensor}_Q"))
        self.nodes.append(helper.make_node("DequantizeLinear", [q, s, z], [dq], f"{tensor}_DQ"))
        return dq

    def input(self, name: str, pos: int, shape=SHAPE, **kw) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, shape))
        return self.qdq(name, pos, **kw)

    def output(self, tensor: str, pos: int | None, shape=SHAPE) -> None:
        """Quantize ``tensor`` and expose the DQ output as a graph output."""
        name = tensor if pos is None else self.qdq(tensor, pos)
        self.outputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, shape))

    def weight(self, name: str, shape, pos: int, scale=None, zp=0) -> str:
        """int8 initializer -> DequantizeLinear (no QuantizeLinear on weights)."""
        q = self._init(f"{name}_quantized", self.rng.integers(-64, 64, shape).astype(np.int8))
        s, z = self.qparams(name, pos, zp=zp, scale=scale)
        out = f"{name}_DequantizeLinear_Output"
        self.nodes.append(helper.make_node("DequantizeLinear", [q, s, z], [out], f"{name}_DQ"))
        return out

    def op(self, op_type: str, inputs, name: str | None = None, **attrs) -> str:
        name = name or self._fresh(op_type.lower())
        out = f"{name}_out"
        self.nodes.append(helper.make_node(op_type, list(inputs), [out], name, **attrs))
        return out

    def conv(self, x, p_w, p_out, p_b=None, act=None, name=None, attrs=CONV_ATTRS, q=True):
        """Conv (explicit attributes) with int8 weight/bias, optional fused activation."""
        name = name or self._fresh("conv")
        ins = [x, self.weight(f"{name}_w", [4, 4, 3, 3], p_w)]
        if p_b is not None:
            ins.append(self.weight(f"{name}_b", [4], p_b))
        y = self.op("Conv", ins, name, **attrs, group=1) if attrs else self.op("Conv", ins, name)
        if act is not None:
            extra = {"alpha": 26 / 256} if act == "LeakyRelu" else {}
            y = self.op(act, [y], f"{name}_{act}", **extra)
        return self.qdq(y, p_out) if q else y

    def model(self, opset: int = 17) -> onnx.ModelProto:
        return make_model(self.nodes, self.inputs, self.outputs, self.inits, opset=opset)


def two_convs(p_w=7, p_out=4, p_b=9, act=None, p_in=5) -> QDQGraph:
    """x(p_in) -> Conv1 (clean) -> Conv2 (chosen positions) -> output.

    Clean defaults: shift_cut = 7 + 5 - 4 = 8, shift_bias = 7 + 5 - 9 = 3.
    """
    g = QDQGraph()
    x = g.input("x", p_in)
    y1 = g.conv(x, 7, p_in, p_b=9, name="conv1")  # shift_cut 7, shift_bias 3
    y2 = g.conv(y1, p_w, p_out, p_b=p_b, act=act, name="conv2")
    g.outputs.append(helper.make_tensor_value_info(y2, TensorProto.FLOAT, SHAPE))
    return g


def side_graph() -> tuple[QDQGraph, str, str]:
    """The clean two-Conv graph plus a second input ``z`` for side ops; returns (g, z, conv)."""
    g = two_convs()
    z = g.input("z", 5)
    return g, z, g.outputs[0].name


def rules_of(model) -> set[str]:
    return check(model).rules()


# ------------------------------------------------------------------------- clean graphs
def test_clean_graph_is_ready_and_runs():
    model = two_convs().model()
    result = check(model)
    assert result.ready, result.summary()
    assert result.findings == []
    assert result.summary() == "Vitis AI ready"
    x = np.random.default_rng(1).uniform(-1, 1, SHAPE).astype(np.float32)
    (y,) = run_ort(model, {"x": x})  # the test form is a valid, runnable QDQ graph
    assert y.shape == tuple(SHAPE)


def test_fused_activations_are_clean():
    for act in ("Relu", "LeakyRelu", "Clip"):
        assert check(two_convs(act=act).model()).ready, act


def test_graph_output_renamed_form_is_read():
    """Producer output T_QuantizeLinear_Input -> Q -> DQ writes the graph output T."""
    g = QDQGraph()
    x = g.input("x", 5)
    y1 = g.conv(x, 7, 5, name="conv1")
    raw = g.op("Conv", [y1, g.weight("w2", [4, 4, 3, 3], 7)], "conv2", **CONV_ATTRS, group=1)
    s, z = g.qparams("y", -5)  # shift_cut = 7 + 5 + 5 = 17
    g.nodes.append(helper.make_node("QuantizeLinear", [raw, s, z], ["yq"], "y_Q"))
    g.nodes.append(helper.make_node("DequantizeLinear", ["yq", s, z], ["y"], "y_DQ"))
    g.outputs.append(helper.make_tensor_value_info("y", TensorProto.FLOAT, SHAPE))
    result = check(g.model())
    assert result.rules() == {"shift_cut"}
    assert result.findings[0].node == "conv2"


# ------------------------------------------------------------------------- Conv rules
@pytest.mark.parametrize(
    ("p_out", "ok"),
    [(-4, True), (-5, False), (12, True), (13, False)],  # shift_cut 16, 17, 0, -1
)
def test_shift_cut_boundaries(p_out, ok):
    result = check(two_convs(p_out=p_out).model())
    if ok:
        assert result.ready, result.summary()
    else:
        assert result.rules() == {"shift_cut"}
        (f,) = result.findings
        assert f.node == "conv2"
        assert f"= {7 + 5 - p_out}" in f.message and "0..16" in f.message


def test_shift_cut_read_after_fused_relu():
    assert check(two_convs(p_out=-5, act="Relu").model()).rules() == {"shift_cut"}


@pytest.mark.parametrize(
    ("p_b", "ok"),
    [(-3, True), (-4, False), (20, True), (21, False)],  # shift_bias 15, 16, -8, -9
)
def test_shift_bias_boundaries(p_b, ok):
    # shift_cut = 8 -> allowed shift_bias min(0, -(24 - 16)) = -8 .. 15
    result = check(two_convs(p_b=p_b).model())
    assert result.ready if ok else result.rules() == {"shift_bias"}, result.summary()
    if not ok:
        assert "-8..15" in result.findings[0].message


def test_shift_bias_lower_bound_zero_before_leaky_relu():
    # shift_bias = 7 + 5 - 13 = -1: fine before Relu, not before LeakyRelu
    assert check(two_convs(p_b=13, act="Relu").model()).ready
    result = check(two_convs(p_b=13, act="LeakyRelu").model())
    assert result.rules() == {"shift_bias"}
    assert "before LeakyRelu" in result.findings[0].message
    assert check(two_convs(p_b=12, act="LeakyRelu").model()).ready  # shift_bias 0


def test_int32_bias_form_is_clean():
    g = QDQGraph()
    x = g.input("x", 5)
    y1 = g.conv(x, 7, 5, name="conv1")
    w = g.weight("w2", [4, 4, 3, 3], 7)
    s, z = g.qparams("b2", 12, zp_dtype=np.int32)  # bias at p_in + p_w
    g._init("b2_quantized", np.arange(4, dtype=np.int32))
    g.nodes.append(helper.make_node("DequantizeLinear", ["b2_quantized", s, z], ["b2"], "b_DQ"))
    y2 = g.qdq(g.op("Conv", [y1, w, "b2"], "conv2", **CONV_ATTRS, group=1), 4)
    g.output(y2, None)
    assert check(g.model()).ready


def test_int32_outside_bias_is_reported():
    g, z, _ = side_graph()
    s, zp = g.qparams("a", 5, zp_dtype=np.int32)
    g.nodes.append(helper.make_node("QuantizeLinear", [z, s, zp], ["aq"], "a_Q"))
    g.nodes.append(helper.make_node("DequantizeLinear", ["aq", s, zp], ["adq"], "a_DQ"))
    g.output(g.op("Relu", ["adq"], "relu"), 5)
    assert check(g.model()).rules() == {"quant_dtype"}


def test_gemm_reads_input_through_flatten():
    """Flatten carries its input's position: Gemm's p_in comes from the DQ before Flatten."""

    def build(p_out: int) -> onnx.ModelProto:
        g, _, conv = side_graph()
        flat = g.op("Flatten", [conv], "flatten", axis=1)  # conv output p_out = 4
        w = g.weight("gw", [10, 256], 7)
        y = g.op("Gemm", [flat, w], "gemm", transB=1)
        g.output(y, p_out, shape=[1, 10])
        return g.model()

    assert check(build(0)).ready  # 7 + 4 - 0 = 11
    result = check(build(-6))  # 7 + 4 + 6 = 17
    assert result.rules() == {"shift_cut"} and result.findings[0].node == "gemm"


# ------------------------------------------------------------------------- Add / Sub / Mul
def _binary(op: str, p_a: int, p_b: int, p_out: int, const_b: bool = False) -> onnx.ModelProto:
    g, _z, _ = side_graph()
    a = g.input("a", p_a)
    b = g.weight("k", SHAPE, p_b) if const_b else g.input("b", p_b)
    g.output(g.op(op, [a, b], op.lower()), p_out)
    return g.model()


@pytest.mark.parametrize(("p_b", "ok"), [(12, True), (13, False), (-2, True), (-3, False)])
def test_shift_read(p_b, ok):
    result = check(_binary("Add", 5, p_b, 5 - 5))  # shift_write stays inside -7..25
    assert result.ready if ok else result.rules() == {"shift_read"}, result.summary()


def test_shift_read_applies_to_sub_and_shift_write_does_not():
    assert check(_binary("Sub", 5, 13, 5)).rules() == {"shift_read"}
    assert check(_binary("Sub", 5, 5, 40)).ready  # shift_write is an Add rule only


@pytest.mark.parametrize(
    ("p_out", "ok"), [(12, True), (13, False), (-20, True), (-21, False)]
)  # shift_write -7, -8, 25, 26
def test_shift_write(p_out, ok):
    result = check(_binary("Add", 5, 6, p_out))
    assert result.ready if ok else result.rules() == {"shift_write"}, result.summary()


@pytest.mark.parametrize(
    ("p_out", "ok"), [(-22, True), (-23, False), (10, True), (11, False)]
)  # sum p_in - p_out = 32, 33, 0, -1
def test_mul_shift(p_out, ok):
    result = check(_binary("Mul", 5, 5, p_out, const_b=True))
    assert result.ready if ok else result.rules() == {"mul_shift"}, result.summary()


# ------------------------------------------------------------------------- shared scales
@pytest.mark.parametrize(("p_b", "p_out", "ok"), [(5, 5, True), (5, 4, False), (6, 5, False)])
def test_concat_shared_scale(p_b, p_out, ok):
    g, _, _ = side_graph()
    a, b = g.input("a", 5), g.input("b", p_b)
    g.output(g.op("Concat", [a, b], "concat", axis=1), p_out, shape=[1, 8, 8, 8])
    result = check(g.model())
    assert result.ready if ok else result.rules() == {"shared_scale"}, result.summary()


@pytest.mark.parametrize("op", ["MaxPool", "AveragePool", "Pad", "Slice"])
def test_single_input_shared_scale(op):
    def build(p_out: int) -> onnx.ModelProto:
        g, z, _ = side_graph()
        if op in ("MaxPool", "AveragePool"):
            y = g.op(op, [z], "pool", kernel_shape=[2, 2], strides=[2, 2])
            shape = [1, 4, 4, 4]
        elif op == "Pad":
            pads = g._init("pads", np.array([0, 0, 1, 1, 0, 0, 1, 1], np.int64))
            y, shape = g.op("Pad", [z, pads], "pad"), [1, 4, 10, 10]
        else:
            starts = g._init("starts", np.array([0], np.int64))
            ends = g._init("ends", np.array([2], np.int64))
            axes = g._init("axes", np.array([1], np.int64))
            y, shape = g.op("Slice", [z, starts, ends, axes], "slice"), [1, 2, 8, 8]
        g.output(y, p_out, shape=shape)
        return g.model()

    assert check(build(5)).ready
    result = check(build(4))
    assert result.rules() == {"shared_scale"}
    assert "'z': 5" in result.findings[0].message


def test_requantized_data_movement_keeps_position():
    def build(p_out: int) -> onnx.ModelProto:
        g, z, _ = side_graph()
        g.output(g.op("Flatten", [z], "flatten", axis=1), p_out, shape=[1, 256])
        return g.model()

    assert check(build(5)).ready
    result = check(build(6))
    assert result.rules() == {"shared_scale"} and result.findings[0].node == "flatten"


def test_maxpool_without_requantize_carries_position_to_conv():
    g = QDQGraph()
    x = g.input("x", 5)
    y1 = g.conv(x, 7, 5, name="conv1")
    pooled = g.op("MaxPool", [y1], "pool", kernel_shape=[2, 2], strides=[2, 2])
    w = g.weight("w2", [4, 4, 3, 3], 7)
    y2 = g.qdq(g.op("Conv", [pooled, w], "conv2", **CONV_ATTRS, group=1), -5)  # 7 + 5 + 5
    g.output(y2, None, shape=[1, 4, 4, 4])
    result = check(g.model())
    assert result.rules() == {"shift_cut"} and result.findings[0].node == "conv2"


def test_dpu_average_pool_mul_form():
    """GlobalAveragePool -> Mul(x, c) -> Q/DQ: the pool's output position is read after Mul."""

    def build(p_out: int) -> onnx.ModelProto:
        g, z, _ = side_graph()
        pooled = g.op("GlobalAveragePool", [z], "gap")
        c = g.weight("c", [], 7)
        g.output(g.op("Mul", [pooled, c], "gap_mul"), p_out, shape=[1, 4, 1, 1])
        return g.model()

    assert check(build(5)).ready  # Mul: 5 + 7 - 5 = 7
    result = check(build(4))
    assert result.rules() == {"shared_scale"} and result.findings[0].node == "gap"


# ------------------------------------------------------------------------- HardSigmoid
@pytest.mark.parametrize(
    ("p_in", "p_out", "ok"),
    [(0, 13, True), (15, 7, True), (-1, 7, False), (16, 7, False), (5, 6, False), (0, 14, False)],
)
def test_hard_sigmoid(p_in, p_out, ok):
    g, _, _ = side_graph()
    a = g.input("a", p_in)
    g.output(g.op("HardSigmoid", [a], "hsig", alpha=2731 / 16384, beta=0.5), p_out)
    found = check(g.model()).rules()
    # HardSigmoid is computed by the NPU (quark_onnx.npu.ops): its position rule is the finding
    assert found == (set() if ok else {"hard_sigmoid"})


# ------------------------------------------------------------------------- Q/DQ parameters
def test_non_power_of_two_scale():
    g, _z, _ = side_graph()
    a = g.input("a", 0, scale=0.1)
    g.output(g.op("Relu", [a], "relu"), 5)
    result = check(g.model())
    assert result.rules() == {"non_pof2_scale"}
    (f,) = result.findings
    assert f.node == "a" and "0.1" in f.message and "2^-3" in f.message


def test_per_axis_scale():
    g = two_convs()
    w = g.weight("pc", [4, 4, 3, 3], 0, scale=np.array([2**-6, 2**-7, 2**-7, 2**-8]))
    g.nodes[-1].attribute.append(helper.make_attribute("axis", 0))
    y = g.op("Conv", [g.outputs[0].name, w], "conv3", **CONV_ATTRS, group=1)
    g.outputs[:] = []
    g.output(y, 4)
    result = check(g.model())
    assert result.rules() == {"per_axis_scale"}
    assert result.findings[0].node == "pc_quantized"


@pytest.mark.parametrize(
    ("zp", "dtype", "ok"),
    [(0, np.int8, True), (3, np.int8, False), (128, np.uint8, True), (0, np.uint8, False)],
)
def test_zero_points(zp, dtype, ok):
    g, _z, _ = side_graph()
    a = g.input("a", 5, zp=zp, zp_dtype=dtype)
    g.output(g.op("Relu", [a], "relu"), 5)
    result = check(g.model())
    assert result.ready if ok else result.rules() == {"nonzero_zero_point"}, result.summary()


def test_int16_activation_is_not_xint8():
    g, _z, _ = side_graph()
    a = g.input("a", 5, zp_dtype=np.int16)
    g.output(g.op("Relu", [a], "relu"), 5)
    assert check(g.model()).rules() == {"quant_dtype"}


# ------------------------------------------------------------------------- ops and coverage
def test_unsupported_op_between_qdq():
    g, z, _ = side_graph()
    g.output(g.op("Sigmoid", [z], "sig"), 7)
    result = check(g.model())
    assert result.rules() == {"unsupported_op"}
    assert result.findings[0].node == "sig" and "Sigmoid" in result.findings[0].message
    # A CPU-fallback op is advisory: the model still compiles, partitioned around it.
    assert result.ready and result.findings[0].severity == "warning"
    assert result.summary().startswith("Vitis AI ready, 1 warning(s)")


def test_float_model_is_not_quantized():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, SHAPE)
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, SHAPE)
    w = np.zeros([4, 4, 3, 3], np.float32)
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["h"], "c1", **CONV_ATTRS, group=1),
        helper.make_node("Conv", ["h", "w"], ["y"], "c2", **CONV_ATTRS, group=1),
    ]
    result = check(make_model(nodes, [x], [y], {"w": w}))
    assert result.rules() == {"not_quantized"}
    assert len(result.findings) == 1 and result.findings[0].node is None


def test_float_node_in_quantized_model():
    g, _, _ = side_graph()
    g.inputs.append(helper.make_tensor_value_info("f", TensorProto.FLOAT, SHAPE))
    g.outputs.append(
        helper.make_tensor_value_info(g.op("Relu", ["f"], "float_relu"), TensorProto.FLOAT, SHAPE)
    )
    result = check(g.model())
    assert result.rules() == {"not_quantized"}
    assert result.findings[0].node == "float_relu"


def test_missing_output_qdq():
    g = two_convs()
    w = g.weight("w3", [4, 4, 3, 3], 7)
    y = g.op("Conv", [g.outputs[0].name, w], "conv3", **CONV_ATTRS, group=1)
    g.outputs[:] = [helper.make_tensor_value_info(y, TensorProto.FLOAT, SHAPE)]
    result = check(g.model())
    assert result.rules() == {"missing_qdq"}
    assert result.findings[0].node == "conv3" and "output" in result.findings[0].message


# ------------------------------------------------------------------------- model structure
def test_dynamic_shape():
    g = QDQGraph()
    x = g.input("x", 5, shape=["N", 4, 8, 8])
    y1 = g.conv(x, 7, 5, name="conv1")
    g.output(g.conv(y1, 7, 4, name="conv2"), None, shape=["N", 4, 8, 8])
    result = check(g.model())
    assert result.rules() == {"dynamic_shape"}
    assert result.findings[0].node == "x" and "N" in result.findings[0].message


def test_batch_size():
    g = QDQGraph()
    x = g.input("x", 5, shape=[2, 4, 8, 8])
    y1 = g.conv(x, 7, 5, name="conv1")
    g.output(g.conv(y1, 7, 4, name="conv2"), None, shape=[2, 4, 8, 8])
    result = check(g.model())
    assert result.rules() == {"batch_size"}
    assert "batch size 2" in result.findings[0].message


def test_too_few_conv():
    g = QDQGraph()
    x = g.input("x", 5)
    g.output(g.conv(x, 7, 4, name="only_conv"), None)
    result = check(g.model())
    assert result.rules() == {"too_few_conv"}
    assert "1 Conv" in result.findings[0].message


def test_conv_default_attributes_agrees_with_onnxsim():
    import onnxsim

    g = QDQGraph()
    x = g.input("x", 5, shape=[1, 4, 10, 10])
    y1 = g.conv(x, 7, 5, name="bare", attrs={})  # 10x10 -> 8x8 with default attributes
    g.output(g.conv(y1, 7, 4, name="conv2"), None)
    model = g.model()
    result = check(model)
    assert result.rules() == {"conv_default_attributes"}
    ours = [f.node for f in result.findings]
    theirs = onnxsim.check_vitisai_support(model)
    assert ours == ["bare"]
    assert len(theirs) == 1 and "'bare'" in theirs[0]
    # and both agree that the explicit-attribute form is fine
    assert onnxsim.check_vitisai_support(two_convs().model()) == []
    assert "conv_default_attributes" not in rules_of(two_convs().model())


def _depthwise_mean(side: int) -> onnx.ModelProto:
    """Two clean Convs, then a depthwise ``side x side`` Conv over the whole map (a global mean,
    as ConvertGlobalAvgPoolToDepthwiseConv writes it)."""
    g = two_convs()
    y = g.outputs.pop().name
    w = g.weight("mean_w", [4, 1, side, side], 14)
    attrs = {"kernel_shape": [side, side], "strides": [1, 1], "pads": [0, 0, 0, 0]}
    mean = g.op("Conv", [y, w], "mean", **attrs, dilations=[1, 1], group=4)
    g.output(mean, 6, shape=[1, 4, 1, 1])
    g.inputs[0] = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, side, side])
    return g.model()


def test_conv_kernel_size_limit_holds_for_depthwise_convs():
    limit = MAX_CONV_KERNEL_SIDE
    assert rules_of(_depthwise_mean(limit)) == set()  # 4 + 5 - 6 = shift_cut 3: clean
    result = check(_depthwise_mean(limit + 1))
    assert result.rules() == {"conv_kernel_size"}
    (finding,) = result.findings
    assert finding.node == "mean"
    assert f"{limit + 1}x{limit + 1}" in finding.message and "depthwise" in finding.message


def test_control_flow():
    g, z, _ = side_graph()
    cond = g._init("cond", np.array(True))
    branch = helper.make_graph(
        [helper.make_node("Identity", [z], ["b_out"])],
        "branch",
        [],
        [helper.make_tensor_value_info("b_out", TensorProto.FLOAT, SHAPE)],
    )
    g.nodes.append(
        helper.make_node("If", [cond], ["if_out"], "if", then_branch=branch, else_branch=branch)
    )
    g.output("if_out", 5)
    result = check(g.model())
    assert "control_flow" in result.rules()
    assert result.rules() <= {"control_flow", "unsupported_op"}
    assert [f.node for f in result.by_rule("control_flow")] == ["if"]


# ------------------------------------------------------------------------- API and real model
def test_result_api(tmp_path):
    result = check(two_convs(p_out=-5, p_b=30).model())
    assert not result.ready
    assert result.rules() == {"shift_cut", "shift_bias"}
    lines = result.summary().splitlines()
    assert lines[0] == "NOT Vitis AI ready (2 error(s))"
    assert len(lines) - 1 == len(result.findings) == 2
    data = json.loads(json.dumps(result.to_dict()))
    assert data["ready"] is False and data["counts"] == {"shift_bias": 1, "shift_cut": 1}
    assert data["findings"][0] == {
        "rule": "shift_cut",
        "severity": "error",
        "node": "conv2",
        "message": result.findings[0].message,
    }
    assert isinstance(result.findings[0], Finding) and isinstance(result, CheckResult)
    path = tmp_path / "m.onnx"
    onnx.save(two_convs().model(), path)
    assert check(path).ready and check(str(path)).model == str(path)
    with pytest.raises(ModelLoadError):
        check(tmp_path / "missing.onnx")


def test_check_does_not_modify_the_model():
    model = two_convs(p_out=-5).model()
    before = model.SerializeToString()
    check(model)
    assert model.SerializeToString() == before


@pytest.mark.real_model
def test_digits_float_model_not_ready():
    result = check(shared_path("models", "digits_cnn.onnx"))
    assert not result.ready
    assert {"not_quantized", "dynamic_shape", "unsupported_op"} <= result.rules()
    assert len(result.by_rule("not_quantized")) == 1
    unsupported = {f.node for f in result.by_rule("unsupported_op")}
    assert unsupported == {"/b3/se/Sigmoid", "/b4/se/Sigmoid", "/right/right.1/PRelu"}
    assert "conv_default_attributes" not in result.rules()  # its Convs are explicit
    assert "too_few_conv" not in result.rules()


# ------------------------------------------------------------------------- npu_rules
def test_position_of_scale_is_exact():
    assert position_of_scale(2.0**-7) == 7
    assert position_of_scale(np.float32(2.0**-7)) == 7
    assert position_of_scale(1.0) == 0
    assert position_of_scale(4.0) == -2
    assert position_of_scale(float(np.float32(2.0**-149))) == 149  # float32 subnormal
    assert position_of_scale(np.float32(2.0**-7) * np.float32(1 + 2**-23)) is None
    for bad in (0.1, 1 / 3, 0.0, -0.5, float("inf"), float("nan"), 3.0):
        assert position_of_scale(bad) is None, bad
    for p in range(-20, 40):
        assert position_of_scale(scale_of_position(p)) == p


def test_shift_cut_rule():
    assert shift_cut(p_w=7, p_in=5, p_out=4) == 8
    assert in_range(16, SHIFT_CUT_RANGE) and not in_range(17, SHIFT_CUT_RANGE)
    assert in_range(0, SHIFT_CUT_RANGE) and not in_range(-1, SHIFT_CUT_RANGE)


def test_shift_bias_rule():
    assert shift_bias(p_w=7, p_in=5, p_bias=9) == 3
    assert shift_bias_range(16, False) == (0, 15)
    assert shift_bias_range(15, False) == (-1, 15)
    assert shift_bias_range(8, False) == (-8, 15)
    assert shift_bias_range(0, False) == (-16, 15)
    assert shift_bias_range(20, False) == (0, 15)  # min(0, ...) caps at 0
    assert shift_bias_range(0, True) == (0, 15)


def test_add_mul_rules():
    assert shift_read([5, 12]) == 7 <= SHIFT_READ_MAX
    assert shift_read([5, 13]) == 8 > SHIFT_READ_MAX
    assert shift_write([5, 9], 12) == -7 and in_range(-7, SHIFT_WRITE_RANGE)
    assert not in_range(-8, SHIFT_WRITE_RANGE) and not in_range(26, SHIFT_WRITE_RANGE)
    assert in_range(25, SHIFT_WRITE_RANGE)
    assert mul_shift([5, 7], -20) == 32 and in_range(32, MUL_SHIFT_RANGE)
    assert not in_range(33, MUL_SHIFT_RANGE) and not in_range(-1, MUL_SHIFT_RANGE)


def test_hard_sigmoid_rule():
    assert hard_sigmoid_violations(0, 13) == []
    assert hard_sigmoid_violations(15, 7) == []
    assert len(hard_sigmoid_violations(16, 7)) == 1
    assert len(hard_sigmoid_violations(-1, 7)) == 1
    assert len(hard_sigmoid_violations(5, 6)) == 1
    assert hard_sigmoid_shift(0, 14) == 0 and len(hard_sigmoid_violations(0, 14)) == 1


def test_op_sets():
    # PRelu is on the NPU only fused into its producer (quark_onnx.npu.ops: Placement.FUSED)
    for op in ("Sigmoid", "Split", "ConvTranspose", "Gather", "PRelu"):
        assert op not in R.XINT8_OPS
    for op in ("Conv", "Gemm", "Add", "Mul", "Concat", "MaxPool", "QuantizeLinear", "HardSigmoid"):
        assert op in R.XINT8_OPS
    assert "DequantizeLinear" in R.XINT8_OPS
    assert {"Concat", "MaxPool", "AveragePool", "GlobalAveragePool", "Pad", "Slice"} == set(
        R.SHARED_SCALE_OPS
    )


def _naive_xint8(model: onnx.ModelProto, p_act: int = 4, p_w: int = 7) -> onnx.ModelProto:
    """Every float activation at position ``p_act``, Conv/Gemm/PRelu constants int8 at ``p_w``.

    A stand-in for the quantizer's output form (no calibration): the positions are chosen so
    every shift rule holds, so only the model's structural findings may remain.
    """
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    consts = {o for n in graph.node if n.op_type == "Constant" for o in n.output}
    outputs = {o.name for o in graph.output}
    nodes: list[onnx.NodeProto] = []
    new_inits: list[onnx.TensorProto] = []

    def params(name: str, pos: int) -> tuple[str, str]:
        new_inits.append(onnx.numpy_helper.from_array(np.float32(2.0**-pos), f"{name}_scale"))
        new_inits.append(onnx.numpy_helper.from_array(np.int8(0), f"{name}_zero_point"))
        return f"{name}_scale", f"{name}_zero_point"

    def qdq(src: str, dst: str, name: str) -> None:
        s, z = params(name, p_act)
        nodes.append(helper.make_node("QuantizeLinear", [src, s, z], [f"{name}_q"], f"{name}_Q"))
        nodes.append(helper.make_node("DequantizeLinear", [f"{name}_q", s, z], [dst], f"{name}_D"))

    for x in graph.input:
        qdq(x.name, f"{x.name}_dq", x.name)
    renamed = {x.name: f"{x.name}_dq" for x in graph.input}
    for node in graph.node:
        for i, name in enumerate(node.input):
            if name in renamed:
                node.input[i] = renamed[name]
            elif name in inits and (
                (node.op_type in ("Conv", "Gemm") and i in (1, 2))
                or (node.op_type == "PRelu" and i == 1)
            ):
                w = onnx.numpy_helper.to_array(inits[name])
                q = np.clip(np.round(w * 2.0**p_w), -128, 127).astype(np.int8)
                new_inits.append(onnx.numpy_helper.from_array(q, f"{name}_quantized"))
                s, z = params(name, p_w)
                nodes.append(
                    helper.make_node(
                        "DequantizeLinear", [f"{name}_quantized", s, z], [f"{name}_w"], name
                    )
                )
                node.input[i] = f"{name}_w"
        nodes.append(node)
        if node.op_type == "Constant":
            continue
        for j, out in enumerate(node.output):
            if out in consts:
                continue
            if out in outputs:
                node.output[j] = f"{out}_QuantizeLinear_Input"
                qdq(node.output[j], out, out)
            else:
                qdq(out, f"{out}_dq", out)
                renamed[out] = f"{out}_dq"
    del graph.node[:]
    graph.node.extend(nodes)
    graph.initializer.extend(new_inits)
    onnx.checker.check_model(model)
    return model


@pytest.mark.real_model
def test_digits_in_qdq_form_has_only_structural_findings():
    """No false positives on a whole real network in the QDQ form: only the model's own issues."""
    path = shared_path("models", "digits_cnn.onnx")
    result = check(_naive_xint8(onnx.load(path)))
    assert result.rules() == {"dynamic_shape", "unsupported_op"}, result.summary()
    x = np.random.default_rng(0).uniform(0, 1, [1, 1, 32, 32]).astype(np.float32)
    (logits,) = run_ort(_naive_xint8(onnx.load(path)), {"image": x})
    assert logits.shape == (1, 10)
    # the same network with weight positions 20: shift_cut = 20 + 4 - 4 on every Conv and Gemm
    bad = check(_naive_xint8(onnx.load(path), p_w=20))
    n_matmul = sum(n.op_type in ("Conv", "Gemm") for n in onnx.load(path).graph.node)
    assert len(bad.by_rule("shift_cut")) == n_matmul == 20
    assert bad.rules() == {"dynamic_shape", "unsupported_op", "shift_cut"}


def test_package_level_check_is_the_readiness_function():
    import quark_onnx
    from quark_onnx.npu import readiness

    assert quark_onnx.check is readiness.check
    assert quark_onnx.check(two_convs().model()).ready
    assert quark_onnx.check(two_convs(p_out=-5).model()).rules() == {"shift_cut"}
