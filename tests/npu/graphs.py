"""A float model holding every op of the NPU op table that has a rule or a position fact.

Conv (+ fused Relu), Conv (+ fused LeakyRelu: shift_bias lower bound 0), Add, Sub, Mul,
HardSigmoid with its DPU-simulation Mul, Conv (+ fused PRelu) then Clip, Concat, MaxPool,
AveragePool with its DPU-simulation Mul, Pad, Slice, Resize, ConvTranspose, GlobalAveragePool
with its DPU-simulation Mul, Flatten, Gemm, Unsqueeze, Transpose, Squeeze, MatMul, Reshape,
HardSwish, Softmax.
"""

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def build(seed: int = 0) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    init = {}

    def w(name, shape, scale=0.3):
        init[name] = (rng.standard_normal(shape) * scale).astype(np.float32)
        return name

    def c(name, arr):
        init[name] = np.asarray(arr)
        return name

    n = []
    n.append(
        helper.make_node(
            "Conv",
            ["x", w("w1", (8, 3, 3, 3)), w("b1", (8,), 0.1)],
            ["c1"],
            name="conv1",
            kernel_shape=[3, 3],
            pads=[1, 1, 1, 1],
            strides=[1, 1],
            dilations=[1, 1],
            group=1,
        )
    )
    n.append(helper.make_node("Relu", ["c1"], ["r1"], name="relu1"))
    n.append(
        helper.make_node(
            "Conv",
            ["r1", w("w2", (8, 8, 3, 3)), w("b2", (8,), 0.1)],
            ["c2"],
            name="conv2",
            kernel_shape=[3, 3],
            pads=[1, 1, 1, 1],
            strides=[1, 1],
            dilations=[1, 1],
            group=1,
        )
    )
    n.append(helper.make_node("LeakyRelu", ["c2"], ["l2"], name="leaky2", alpha=0.1))
    n.append(helper.make_node("Add", ["r1", "l2"], ["a1"], name="add1"))
    n.append(helper.make_node("Sub", ["a1", "r1"], ["s1"], name="sub1"))
    n.append(helper.make_node("Mul", ["s1", "a1"], ["m1"], name="mul1"))
    n.append(helper.make_node("HardSigmoid", ["m1"], ["h1"], name="hsig1", alpha=1 / 6, beta=0.5))
    n.append(
        helper.make_node(
            "Mul", ["h1", c("k1", np.array(1.0006, np.float32))], ["hm"], name="hsig_mul"
        )
    )
    n.append(
        helper.make_node(
            "Conv",
            ["hm", w("w3", (8, 8, 1, 1)), w("b3", (8,), 0.1)],
            ["c3"],
            name="conv3",
            kernel_shape=[1, 1],
            pads=[0, 0, 0, 0],
            strides=[1, 1],
            dilations=[1, 1],
            group=1,
        )
    )
    n.append(helper.make_node("PRelu", ["c3", w("slope", (8, 1, 1), 0.2)], ["p3"], name="prelu3"))
    n.append(
        helper.make_node(
            "Clip",
            ["p3", c("lo", np.array(0.0, np.float32)), c("hi", np.array(6.0, np.float32))],
            ["k3"],
            name="clip3",
        )
    )
    # shift_bias "before LeakyRelu": a Conv read by a LeakyRelu and by an Add (not only by the
    # LeakyRelu), and a Conv whose fused Relu feeds a LeakyRelu
    n.extend(
        [
            helper.make_node(
                "Conv",
                ["r1", w("w4", (8, 8, 1, 1)), w("b4", (8,), 0.1)],
                ["c4"],
                name="conv4",
                kernel_shape=[1, 1],
                pads=[0, 0, 0, 0],
                strides=[1, 1],
                dilations=[1, 1],
                group=1,
            ),
            helper.make_node("LeakyRelu", ["c4"], ["l4"], name="leaky4", alpha=0.1),
            helper.make_node("Add", ["c4", "l4"], ["a4"], name="add4"),
            helper.make_node(
                "Conv",
                ["a4", w("w5", (8, 8, 1, 1)), w("b5", (8,), 0.1)],
                ["c5"],
                name="conv5",
                kernel_shape=[1, 1],
                pads=[0, 0, 0, 0],
                strides=[1, 1],
                dilations=[1, 1],
                group=1,
            ),
            helper.make_node("Relu", ["c5"], ["r5"], name="relu5"),
            helper.make_node("LeakyRelu", ["r5"], ["l5"], name="leaky5", alpha=0.1),
        ]
    )
    n.append(helper.make_node("Concat", ["k3", "a1", "l5"], ["cat"], name="concat", axis=1))
    n.append(
        helper.make_node(
            "MaxPool", ["cat"], ["mp"], name="maxpool", kernel_shape=[2, 2], strides=[2, 2]
        )
    )
    n.append(
        helper.make_node(
            "AveragePool",
            ["mp"],
            ["ap"],
            name="avgpool",
            kernel_shape=[3, 3],
            strides=[1, 1],
            pads=[1, 1, 1, 1],
        )
    )
    n.append(
        helper.make_node(
            "Mul", ["ap", c("k2", np.array(0.984375, np.float32))], ["apm"], name="avgpool_mul"
        )
    )
    n.append(
        helper.make_node(
            "Pad",
            ["apm", c("pads", np.array([0, 0, 1, 1, 0, 0, 1, 1], np.int64))],
            ["pd"],
            name="pad",
        )
    )
    n.append(
        helper.make_node(
            "Slice",
            [
                "pd",
                c("st", np.array([1, 1], np.int64)),
                c("en", np.array([9, 9], np.int64)),
                c("ax", np.array([2, 3], np.int64)),
            ],
            ["sl"],
            name="slice",
        )
    )
    n.append(
        helper.make_node(
            "Resize",
            ["sl", "", c("scales", np.array([1, 1, 2, 2], np.float32))],
            ["rs"],
            name="resize",
            mode="nearest",
        )
    )
    n.append(
        helper.make_node(
            "ConvTranspose",
            ["rs", w("wt", (24, 4, 2, 2)), w("bt", (4,), 0.1)],
            ["ct"],
            name="convT",
            kernel_shape=[2, 2],
            strides=[2, 2],
        )
    )
    n.append(helper.make_node("GlobalAveragePool", ["ct"], ["gp"], name="gap"))
    n.append(
        helper.make_node(
            "Mul", ["gp", c("k4", np.array(1.015625, np.float32))], ["gap"], name="gap_mul"
        )
    )
    n.append(helper.make_node("Flatten", ["gap"], ["fl"], name="flatten", axis=1))
    n.append(
        helper.make_node(
            "Gemm", ["fl", w("wg", (6, 4)), w("bg", (6,), 0.1)], ["g"], name="gemm", transB=1
        )
    )
    n.append(
        helper.make_node(
            "Unsqueeze", ["g", c("ax0", np.array([1], np.int64))], ["u"], name="unsqueeze"
        )
    )
    n.append(helper.make_node("Transpose", ["u"], ["t"], name="transpose", perm=[1, 0, 2]))
    n.append(
        helper.make_node(
            "Squeeze", ["t", c("ax1", np.array([0], np.int64))], ["sq"], name="squeeze"
        )
    )
    n.append(helper.make_node("MatMul", ["sq", w("wm", (6, 5))], ["mm"], name="matmul"))
    n.append(
        helper.make_node(
            "Reshape", ["mm", c("shape", np.array([1, 5], np.int64))], ["rsh"], name="reshape"
        )
    )
    n.append(helper.make_node("HardSwish", ["rsh"], ["hsw"], name="hardswish"))
    n.append(helper.make_node("Softmax", ["hsw"], ["y"], name="softmax", axis=-1))
    inits = [numpy_helper.from_array(v, k) for k, v in init.items()]
    graph = helper.make_graph(
        n,
        "every_rule_op",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 16, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 5])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model
