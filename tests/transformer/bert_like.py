"""A BERT-style sentence encoder built with onnx.helper, shaped like PyTorch's export of one.

``input_ids``, ``attention_mask`` (int64 ``[N, S]``) -> word embedding ``Gather`` (a constant
table of ``vocab`` rows) + position and token-type embeddings -> LayerNormalization -> ``layers``
post-LN encoder layers (MatMul+Add projections, Reshape/Transpose to heads, MatMul Q K^T, Div by
sqrt(d_head), ``Add`` of the additive attention mask, Softmax, MatMul V, output projection,
residual Add, LayerNormalization, feed-forward MatMul+Add, Erf-form Gelu, MatMul+Add, residual
Add, LayerNormalization) -> ``last_hidden_state [N, S, H]``.

The additive mask is written the way ``torch.onnx.export`` writes Hugging Face's
``get_extended_attention_mask``: ``Unsqueeze`` to ``[N, 1, 1, S]``, ``Cast`` to float, then
``mask_style="mul"``: ``Mul(Sub(1, m), finfo(float32).min)``, or ``mask_style="where"``:
``Where(Cast(m, bool), 0, finfo(float32).min)`` (newer exports). Padded key positions get
``-3.4e38``, which is what breaks a quantizer that calibrates it like any activation.

Weights are seeded random, scaled like a trained small BERT's: embeddings with standard
deviation 0.05, projections 0.04 to 0.08 (queries and keys a little larger so that attention is
peaked, not uniform), LayerNormalization gains near 1 with two outlier hidden dimensions (gain 4,
as trained encoders have) and small biases.

Outlier channels (:func:`with_outliers`; ``benchmarks/bench_transformer.py`` measures this
encoder). Trained encoders carry a few hidden dimensions whose LayerNormalization outputs are
10-100x wider than the median one: the LayerNorm's gain is large on them and the weights of the
layers reading them are small there, so the layers compute ordinary values from them. Built
here the same way: every LayerNorm but the last gives ``len(outlier_dims)`` dimensions a gain of
``outlier_scale`` times 0.5 ... 1.5 (20 to 60 for the outlier encoder, where the two gain-4
dimensions above are left out), and every linear layer reading that LayerNorm divides its weight
rows of those dimensions by the same gains. The residual Add also reads the LayerNorm's output,
so the outliers reach the next LayerNorm's input: that one gives them gain ``1 / gain`` (the
same dimensions again would compound their gain from LayerNorm to LayerNorm until they take the
whole variance and the other channels vanish) and puts its own outliers on dimensions moved by
``OUTLIER_STRIDE``. The last LayerNorm only damps: otherwise the four dimensions dominate the
sentence embedding and every quantizer's cosine is ~1 on those alone. Measured (hidden 256):
the widest channel of each LayerNorm output is 45 to 104 times the median channel's maximum;
A8W8 without MigrateActivationOutliers gives a mean embedding cosine of 0.948 and A16W8 0.9987
on 128 held-out sentences (``benchmarks/results/transformer.md``; a real 6-layer sentence
encoder: 0.951 and 0.9986).

:func:`encoder_inputs` makes sentences of random length (padded with token 0, mask 0) with a
Zipf-like token distribution; :func:`mean_pooled` is the sentence embedding (mask-weighted mean of
the last hidden state) and :func:`cosines` its per-sentence cosine against a reference.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

FLOAT_MIN = float(np.finfo(np.float32).min)


@dataclass(frozen=True)
class EncoderShape:
    """Sizes of the encoder (defaults: 4 layers, hidden 256, a 30522-row vocabulary)."""

    layers: int = 4
    hidden: int = 256
    heads: int = 4
    ffn: int = 1024
    vocab: int = 30522
    seq: int = 64
    max_positions: int = 512
    #: LayerNormalization gain of the two outlier hidden dimensions
    outlier_gain: float = 4.0
    #: hidden dimensions given a large, compensated LayerNormalization gain (module docstring,
    #: "Outlier channels"); empty: none
    outlier_dims: tuple[int, ...] = ()
    #: gain of the outlier dimensions: each gets ``outlier_scale`` times a factor 0.5 ... 1.5
    outlier_scale: float = 1.0


#: The outlier dimensions of the first LayerNorm; each later one moves them by OUTLIER_STRIDE.
OUTLIER_DIMS = (13, 77, 150, 211)
OUTLIER_STRIDE = 37
#: The outlier encoder's gain scale: gains 20 ... 60 on the outlier dimensions.
OUTLIER_SCALE = 40.0


def with_outliers(shape: EncoderShape = EncoderShape()) -> EncoderShape:
    """``shape`` with the outlier channels of trained encoders (module docstring)."""
    return dataclasses.replace(
        shape, outlier_dims=OUTLIER_DIMS, outlier_scale=OUTLIER_SCALE, outlier_gain=1.0
    )


def build_encoder(
    shape: EncoderShape = EncoderShape(), *, seed: int = 0, mask_style: str = "mul"
) -> onnx.ModelProto:
    """The encoder as a checked opset-17 ModelProto (see the module docstring)."""
    if mask_style not in ("mul", "where"):
        raise ValueError(f"mask_style must be 'mul' or 'where', not {mask_style!r}")
    rng = np.random.default_rng(seed)
    h, heads, s = shape.hidden, shape.heads, shape.seq
    dh = h // heads
    inits: dict[str, np.ndarray] = {}
    nodes: list[onnx.NodeProto] = []

    def const(name: str, value: np.ndarray | float, dtype=np.float32) -> str:
        inits[name] = np.asarray(value, dtype=dtype)
        return name

    def node(op: str, inputs: list[str], output: str, **attrs) -> str:
        nodes.append(helper.make_node(op, inputs, [output], name=output, **attrs))
        return output

    def normal(shape_: tuple[int, ...], std: float) -> np.ndarray:
        return (std * rng.standard_normal(shape_)).astype(np.float32)

    dims = np.array([d for d in shape.outlier_dims if d < h], dtype=np.int64)
    # the outlier gains (module docstring, "Outlier channels")
    big = shape.outlier_scale * np.linspace(0.5, 1.5, len(dims))
    outliers_of: list[np.ndarray] = []  # the outlier dimensions of each LayerNorm so far
    # LayerNorm output -> what the linear layers reading it multiply their row d by
    compensation: dict[str, np.ndarray] = {}

    def layer_norm(x: str, name: str, last: bool = False) -> str:
        gain = 1.0 + normal((h,), 0.05)
        gain[[7, h // 2 + 3]] = shape.outlier_gain  # outlier dimensions, as trained encoders have
        if len(dims):
            if outliers_of:  # damp what the residual stream brings from the previous LayerNorm
                gain[outliers_of[-1]] = 1.0 / big
            here = dims[:0] if last else (dims + OUTLIER_STRIDE * len(outliers_of)) % h
            gain[here] = big[: len(here)]
            outliers_of.append(here)
            compensation[name] = np.ones(h, dtype=np.float32)
            compensation[name][here] = 1.0 / big[: len(here)]
        const(name + ".weight", gain)
        const(name + ".bias", normal((h,), 0.02))
        return node(
            "LayerNormalization",
            [x, name + ".weight", name + ".bias"],
            name,
            axis=-1,
            epsilon=1e-12,
        )

    def linear(x: str, name: str, k: int, n: int, std: float) -> str:
        w = normal((k, n), std)
        if x in compensation:  # the layer reads a LayerNorm's outliers with a smaller weight
            w *= compensation[x][:, None]
        const(name + ".weight", w)
        const(name + ".bias", normal((n,), 0.02))
        mm = node("MatMul", [x, name + ".weight"], name + "/MatMul")
        return node("Add", [name + ".bias", mm], name + "/Add")

    # embeddings
    const("word_embeddings.weight", normal((shape.vocab, h), 0.05))
    const("position_embeddings.weight", normal((shape.max_positions, h), 0.02))
    const("token_type_embeddings.weight", normal((2, h), 0.02))
    const("position_ids", np.arange(s, dtype=np.int64)[None, :], np.int64)
    const("token_type_ids", np.zeros((1, s), dtype=np.int64), np.int64)
    words = node("Gather", ["word_embeddings.weight", "input_ids"], "embeddings/word/Gather")
    pos = node(
        "Gather", ["position_embeddings.weight", "position_ids"], "embeddings/position/Gather"
    )
    tok = node(
        "Gather", ["token_type_embeddings.weight", "token_type_ids"], "embeddings/type/Gather"
    )
    e1 = node("Add", [words, tok], "embeddings/Add")
    e2 = node("Add", [e1, pos], "embeddings/Add_1")
    x = layer_norm(e2, "embeddings/LayerNorm")

    # additive attention mask [N, 1, 1, S], as exported
    const("axes_1", np.array([1], dtype=np.int64), np.int64)
    const("axes_2", np.array([2], dtype=np.int64), np.int64)
    u1 = node("Unsqueeze", ["attention_mask", "axes_1"], "mask/Unsqueeze")
    u2 = node("Unsqueeze", [u1, "axes_2"], "mask/Unsqueeze_1")
    if mask_style == "mul":
        m = node("Cast", [u2], "mask/Cast", to=TensorProto.FLOAT)
        inv = node("Sub", [const("mask/one", 1.0), m], "mask/Sub")
        mask = node("Mul", [inv, const("mask/min", FLOAT_MIN)], "mask/Mul")
    else:
        b = node("Cast", [u2], "mask/Cast", to=TensorProto.BOOL)
        mask = node(
            "Where", [b, const("mask/zero", 0.0), const("mask/min", FLOAT_MIN)], "mask/Where"
        )

    const("heads_shape", np.array([0, -1, heads, dh], dtype=np.int64), np.int64)
    const("model_shape", np.array([0, -1, h], dtype=np.int64), np.int64)
    const("sqrt_dh", np.sqrt(dh))
    const("sqrt2", np.sqrt(2.0))
    const("one", 1.0)
    const("half", 0.5)
    for i in range(shape.layers):
        p = f"encoder/layer.{i}"

        def split_heads(t: str, name: str, perm: list[int], p: str = p) -> str:
            r = node("Reshape", [t, "heads_shape"], f"{p}/{name}/Reshape")
            return node("Transpose", [r], f"{p}/{name}/Transpose", perm=perm)

        q = split_heads(linear(x, f"{p}/attention/query", h, h, 0.08), "q", [0, 2, 1, 3])
        k = split_heads(linear(x, f"{p}/attention/key", h, h, 0.08), "k", [0, 2, 3, 1])
        v = split_heads(linear(x, f"{p}/attention/value", h, h, 0.05), "v", [0, 2, 1, 3])
        scores = node("MatMul", [q, k], f"{p}/attention/MatMul")
        scaled = node("Div", [scores, "sqrt_dh"], f"{p}/attention/Div")
        masked = node("Add", [scaled, mask], f"{p}/attention/Add")
        probs = node("Softmax", [masked], f"{p}/attention/Softmax", axis=-1)
        ctx = node("MatMul", [probs, v], f"{p}/attention/MatMul_1")
        ctx_t = node("Transpose", [ctx], f"{p}/attention/Transpose", perm=[0, 2, 1, 3])
        merged = node("Reshape", [ctx_t, "model_shape"], f"{p}/attention/Reshape")
        attn = linear(merged, f"{p}/attention/output/dense", h, h, 0.04)
        r1 = node("Add", [attn, x], f"{p}/attention/output/Add")
        x1 = layer_norm(r1, f"{p}/attention/output/LayerNorm")
        inner = linear(x1, f"{p}/intermediate/dense", h, shape.ffn, 0.05)
        d = node("Div", [inner, "sqrt2"], f"{p}/intermediate/Div")
        erf = node("Erf", [d], f"{p}/intermediate/Erf")
        a = node("Add", [erf, "one"], f"{p}/intermediate/Add")
        m1 = node("Mul", [inner, a], f"{p}/intermediate/Mul")
        g = node("Mul", [m1, "half"], f"{p}/intermediate/Mul_1")
        out = linear(g, f"{p}/output/dense", shape.ffn, h, 0.03)
        r2 = node("Add", [out, x1], f"{p}/output/Add")
        x = layer_norm(r2, f"{p}/output/LayerNorm", last=i == shape.layers - 1)
    nodes.append(helper.make_node("Identity", [x], ["last_hidden_state"], name="output"))

    graph = helper.make_graph(
        nodes,
        "bert_like_encoder",
        [
            helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", s]),
            helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", s]),
        ],
        [helper.make_tensor_value_info("last_hidden_state", TensorProto.FLOAT, ["batch", s, h])],
        [numpy_helper.from_array(v, k) for k, v in inits.items()],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="pytorch"
    )
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model


def encoder_inputs(
    n: int, seed: int, shape: EncoderShape = EncoderShape()
) -> dict[str, np.ndarray]:
    """``n`` padded sentences: ``input_ids`` (Zipf-like tokens after a [CLS]=101) and
    ``attention_mask`` (1 on the first ``length`` positions, ``length`` uniform in [6, seq])."""
    rng = np.random.default_rng(seed)
    ids = np.zeros((n, shape.seq), dtype=np.int64)
    mask = np.zeros((n, shape.seq), dtype=np.int64)
    for i in range(n):
        length = int(rng.integers(6, shape.seq + 1))
        tokens = np.minimum(rng.zipf(1.3, length) + 998, shape.vocab - 1)
        tokens[0] = 101
        ids[i, :length] = tokens
        mask[i, :length] = 1
    return {"input_ids": ids, "attention_mask": mask}


def mean_pooled(hidden: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Sentence embeddings: the mask-weighted mean of ``hidden [N, S, H]`` over positions."""
    w = mask.astype(np.float64)[..., None]
    return (hidden.astype(np.float64) * w).sum(axis=1) / np.maximum(w.sum(axis=1), 1.0)


def cosines(reference: np.ndarray, other: np.ndarray) -> np.ndarray:
    """Per-row cosine similarity of two ``[N, H]`` embedding matrices."""
    dot = np.sum(reference * other, axis=1)
    norms = np.linalg.norm(reference, axis=1) * np.linalg.norm(other, axis=1)
    return dot / np.maximum(norms, 1e-300)
