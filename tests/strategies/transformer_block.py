"""A small transformer encoder block built with onnx.helper (random weights, fixed seed).

``x [N, T, D] -> multi-head self-attention (MatMul+Add projections, Reshape/Transpose to heads,
MatMul Q K^T, Div by sqrt(d_head), Softmax, MatMul V, back to [N, T, D], output projection) ->
residual Add -> LayerNormalization -> feed-forward (MatMul+Add, Gelu, MatMul+Add) -> residual Add
-> LayerNormalization -> y [N, T, D]``.

``gelu="op"`` uses the ONNX Gelu op (opset 20); ``gelu="erf"`` writes the Erf form
``x * 0.5 * (1 + Erf(x / sqrt 2))`` (opset 17), the pattern exporters emit.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

T, D, HEADS, FFN = 16, 64, 2, 128
DH = D // HEADS


def build_block(*, gelu: str = "op", seed: int = 0) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    inits: dict[str, np.ndarray] = {}

    def weight(name: str, k: int, n: int) -> str:
        inits[name] = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)
        inits[name + "_b"] = (0.1 * rng.standard_normal(n)).astype(np.float32)
        return name

    def const(name: str, value: np.ndarray) -> str:
        inits[name] = np.asarray(value)
        return name

    nodes: list[onnx.NodeProto] = []

    def node(op: str, inputs: list[str], output: str, **attrs) -> str:
        nodes.append(helper.make_node(op, inputs, [output], name=output, **attrs))
        return output

    def linear(x: str, w: str, out: str) -> str:
        mm = node("MatMul", [x, w], out + "_mm")
        return node("Add", [mm, w + "_b"], out)

    for w in ("wq", "wk", "wv", "wo"):
        weight(w, D, D)
    weight("w1", D, FFN)
    weight("w2", FFN, D)
    for ln in ("ln1", "ln2"):
        inits[ln + "_scale"] = (1 + 0.1 * rng.standard_normal(D)).astype(np.float32)
        inits[ln + "_bias"] = (0.1 * rng.standard_normal(D)).astype(np.float32)
    const("heads_shape", np.array([0, T, HEADS, DH], dtype=np.int64))
    const("model_shape", np.array([0, T, D], dtype=np.int64))
    const("sqrt_dh", np.array(np.sqrt(DH), dtype=np.float32))

    def heads(x: str, out: str, perm: list[int]) -> str:
        r = node("Reshape", [x, "heads_shape"], out + "_r")
        return node("Transpose", [r], out, perm=perm)

    q = heads(linear("x", "wq", "q"), "qh", [0, 2, 1, 3])
    k = heads(linear("x", "wk", "k"), "kt", [0, 2, 3, 1])
    v = heads(linear("x", "wv", "v"), "vh", [0, 2, 1, 3])
    scores = node("MatMul", [q, k], "scores")
    scaled = node("Div", [scores, "sqrt_dh"], "scaled")
    probs = node("Softmax", [scaled], "probs", axis=-1)
    ctx = node("MatMul", [probs, v], "ctx")
    ctx_t = node("Transpose", [ctx], "ctx_t", perm=[0, 2, 1, 3])
    merged = node("Reshape", [ctx_t, "model_shape"], "merged")
    attn = linear(merged, "wo", "attn")
    res1 = node("Add", ["x", attn], "res1")
    ln1 = node("LayerNormalization", [res1, "ln1_scale", "ln1_bias"], "ln1", axis=-1)
    h = linear(ln1, "w1", "h")
    if gelu == "op":
        g = node("Gelu", [h], "gelu")
        opset = 20
    else:
        const("sqrt2", np.array(np.sqrt(2.0), dtype=np.float32))
        const("one", np.array(1.0, dtype=np.float32))
        const("half", np.array(0.5, dtype=np.float32))
        d = node("Div", [h, "sqrt2"], "gelu_div")
        e = node("Erf", [d], "gelu_erf")
        a = node("Add", [e, "one"], "gelu_add")
        m = node("Mul", [h, a], "gelu_mul")
        g = node("Mul", [m, "half"], "gelu")
        opset = 17
    f = linear(g, "w2", "f")
    res2 = node("Add", [ln1, f], "res2")
    node("LayerNormalization", [res2, "ln2_scale", "ln2_bias"], "y", axis=-1)

    graph = helper.make_graph(
        nodes,
        "encoder_block",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", T, D])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", T, D])],
        [onnx.numpy_helper.from_array(v, k) for k, v in inits.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 10 if opset >= 20 else 8
    onnx.checker.check_model(model, full_check=True)
    return model


def block_inputs(n: int, seed: int) -> np.ndarray:
    """``n`` samples of ``x`` (standard normal), stacked: shape ``[n, T, D]``."""
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, T, D)).astype(np.float32)
