"""Write stress variants of a float ONNX CNN: same float outputs, hostile weight ranges.

Run from the repository root::

    python benchmarks/make_stress_variants.py MODEL --kind rescale|deadconst|both --seed 0 -o OUT

Each variant computes what the original computes (checked on real inputs, see below), but its
weights and activations have the per-channel range spreads that per-tensor power-of-two
quantization must survive on real models it has never seen:

``rescale``
    Every Conv output channel ``c`` that only reaches other Convs through positively homogeneous
    operators is multiplied by ``s_c = exp(U(ln 1/100, ln 100))`` (log-uniform in [1/100, 100]):
    the producer's weight row and bias (or, for Conv -> BatchNormalization, the BN's scale and
    shift) times ``s_c``, and every consuming Conv's weights reading that channel divided by
    ``s_c``. Exact because ``f(s x) = s f(x)`` for ``s > 0`` and ``f`` in {Relu, LeakyRelu,
    PRelu, Clip(0, +inf), MaxPool, Concat on channels, Dropout (inference)}; zero padding reads 0
    either way. A consumer with groups divides the weight column of the channel's group
    (``W[g*Co/G : (g+1)*Co/G, c mod Ci/G]``), so depthwise consumers are handled. PRelu slopes
    stay valid (the sign of ``s x`` is the sign of ``x``). Clip(0, 6) (ReLU6) is not homogeneous,
    so a channel that reaches one is left alone; so is one that reaches an Add, a Mul, a pool
    that averages, a Gemm/MatMul or a graph output.

``deadconst``
    New output channels are added to a Conv (group 1): weights ``1e-7 * N(0, 1)`` and a bias,
    negative before an activation that zeroes negatives (Relu, Clip(0, x)) for *dead* channels
    (exactly 0 after it), positive for *constant* ones (the activation of the bias, up to the
    ``1e-7`` weights). Every consuming Conv reads them with weights ``100 * median|W|`` (random
    signs, x U(0.5, 1.5)), and its bias is lowered by ``sum(W_new) * act(bias)`` so its output is
    unchanged. A constant channel is exact only where the consumer has no zero padding (padding
    reads 0, not the constant), so padded consumers get dead channels only. A depthwise consumer
    gets a new group (its new output channel reads the dead channel, so it equals its own new
    bias) and the Conv after it reads that channel the same way: this is the first-layer ->
    depthwise pattern of MobileNetV1-family models.

``both``
    ``deadconst`` then ``rescale`` on its output.

``streams``
    Every residual stream (values joined by Adds, each written by a Conv with constant weights
    or by such an Add, read only by such Adds and by Convs as their data input) has its channel
    ``c`` multiplied by ``s_c`` (log-uniform in [1/100, 100] as above): every writer's weight row
    and bias times ``s_c``, every reader's weights for the channel divided by it. Exact because an
    Add is linear. A stream with any other writer or reader (a graph output, a Relu, a pool) is
    left alone. Not part of ``both``.

Seeded and deterministic: the same model, kind and seed give the same bytes.

Check: onnxruntime (graph optimisations off) runs the original and the variant on real inputs
(the model's calibration images for the shared models, ``--inputs`` otherwise; random normal
inputs only when neither is available) and prints, per graph output, ``max|variant - original| /
max|original|``; the script fails (exit 1, nothing written) above ``--tolerance`` (1e-4).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

BENCH = Path(__file__).resolve().parent
KINDS = ("rescale", "deadconst", "both", "streams")
TOLERANCE = 1e-4
# Log-uniform range of the per-channel rescaling factors.
SCALE_LOW, SCALE_HIGH = 1.0 / 100.0, 100.0
# Producer weights of a new dead/constant channel, and consumer weights relative to the median.
TINY_WEIGHT = 1e-7
CONSUMER_GAIN = 100.0
# Shared models -> key of their data in bench_accuracy (calibration images).
SHARED_DATA = {
    "digits_cnn.onnx": "digits",
    "squeezenet1.1.onnx": "squeezenet",
    "mobilenetv2_rebuilt.onnx": "mobilenetv2",
}
ACTIVATIONS = ("Relu", "LeakyRelu", "PRelu", "Clip")


class _Graph:
    """Use-def index of a model's graph, and read/write access to its initializers."""

    def __init__(self, model: onnx.ModelProto) -> None:
        self.model = model
        g = model.graph
        self.producer: dict[str, onnx.NodeProto] = {}
        self.consumers: dict[str, list[onnx.NodeProto]] = {}
        self.uses: dict[str, int] = {}
        for node in g.node:
            for out in node.output:
                self.producer[out] = node
            for name in node.input:
                if name:
                    self.consumers.setdefault(name, []).append(node)
                    self.uses[name] = self.uses.get(name, 0) + 1
        self.outputs = {o.name for o in g.output}
        self.inits = {t.name: t for t in g.initializer}
        self._names = {n for node in g.node for n in (*node.input, *node.output)} | set(self.inits)
        self.widened: set[str] = set()  # tensors that gained channels (stale value_info)
        self.channels: dict[str, int] = {}
        inferred = onnx.shape_inference.infer_shapes(model)
        for vi in (*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output):
            dims = vi.type.tensor_type.shape.dim
            if len(dims) >= 2 and dims[1].HasField("dim_value"):
                self.channels[vi.name] = dims[1].dim_value

    def array(self, name: str) -> np.ndarray:
        return numpy_helper.to_array(self.inits[name]).copy()

    def set_array(self, name: str, value: np.ndarray) -> None:
        old = self.inits[name]
        new = numpy_helper.from_array(value.astype(numpy_helper.to_array(old).dtype), name)
        old.CopyFrom(new)

    def add_array(self, base: str, value: np.ndarray) -> str:
        name, i = base, 0
        while name in self._names:
            i += 1
            name = f"{base}_{i}"
        self._names.add(name)
        tensor = numpy_helper.from_array(value, name)
        self.model.graph.initializer.append(tensor)
        self.inits[name] = self.model.graph.initializer[-1]
        return name

    def constant(self, name: str) -> np.ndarray | None:
        """Value of an initializer or a Constant node's output; None when absent or computed."""
        if not name:
            return None
        if name in self.inits:
            return numpy_helper.to_array(self.inits[name])
        node = self.producer.get(name)
        if node is not None and node.op_type == "Constant":
            for attr in node.attribute:
                if attr.name == "value":
                    return numpy_helper.to_array(attr.t)
        return None

    def single_consumer(self, tensor: str) -> onnx.NodeProto | None:
        users = self.consumers.get(tensor, [])
        if len(users) != 1 or tensor in self.outputs:
            return None
        return users[0]


def _attr(node: onnx.NodeProto, name: str, default):
    for attr in node.attribute:
        if attr.name == name:
            return onnx.helper.get_attribute_value(attr)
    return default


def _set_int_attr(node: onnx.NodeProto, name: str, value: int) -> None:
    for attr in node.attribute:
        if attr.name == name:
            attr.i = value
            return
    node.attribute.append(onnx.helper.make_attribute(name, value))


def _is_conv_reading(g: _Graph, node: onnx.NodeProto, tensor: str) -> bool:
    """``node`` is a Conv with ``tensor`` as data input and a weight used by no other node."""
    return (
        node.op_type == "Conv"
        and node.input[0] == tensor
        and node.input[1] in g.inits
        and g.uses.get(node.input[1], 0) == 1
        and (len(node.input) < 3 or not node.input[2] or g.uses.get(node.input[2], 0) == 1)
    )


def _padded(node: onnx.NodeProto) -> bool:
    """Whether a Conv reads zero padding anywhere (then a constant channel is not constant)."""
    auto_pad = _attr(node, "auto_pad", b"NOTSET")
    auto_pad = auto_pad.decode() if isinstance(auto_pad, bytes) else auto_pad
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        return True
    return any(p != 0 for p in _attr(node, "pads", []))


def _clip_bounds(g: _Graph, node: onnx.NodeProto) -> tuple[float, float] | None:
    """(lo, hi) of a Clip (attributes or constant inputs); None when a bound is computed."""
    lo, hi = _attr(node, "min", -np.inf), _attr(node, "max", np.inf)
    for idx in (1, 2):
        if len(node.input) > idx and node.input[idx]:
            value = g.constant(node.input[idx])
            if value is None:
                return None
            if idx == 1:
                lo = float(value)
            else:
                hi = float(value)
    return float(lo), float(hi)


def _homogeneous(g: _Graph, node: onnx.NodeProto) -> bool:
    """``f(s x) = s f(x)`` per channel for every ``s > 0`` (output channel = input channel)."""
    op = node.op_type
    if op in ("Relu", "LeakyRelu", "MaxPool"):
        return True
    if op == "PRelu":
        return g.constant(node.input[1]) is not None
    if op == "Clip":
        bounds = _clip_bounds(g, node)
        return bounds is not None and bounds[0] == 0.0 and bounds[1] == np.inf
    if op == "Dropout":
        return len(node.output) == 1 or not node.output[1] or not g.consumers.get(node.output[1])
    if op == "Concat":
        return _attr(node, "axis", 1) == 1
    return False


# -- rescale ------------------------------------------------------------------------------------


def _rescale_start(g: _Graph, conv: onnx.NodeProto) -> tuple[str, onnx.NodeProto | None] | None:
    """The tensor a producer's scale appears on, and the BatchNormalization that carries it."""
    if conv.input[1] not in g.inits or g.uses.get(conv.input[1], 0) != 1:
        return None
    if len(conv.input) > 2 and conv.input[2] and g.uses.get(conv.input[2], 0) != 1:
        return None
    out = conv.output[0]
    bn = g.single_consumer(out)
    if bn is not None and bn.op_type == "BatchNormalization":
        if all(n in g.inits and g.uses.get(n, 0) == 1 for n in bn.input[1:3]):
            return bn.output[0], bn
        return None
    return out, None


def _reaches_only_convs(g: _Graph, start: str) -> bool:
    """Every path from ``start`` passes homogeneous operators and ends at a Conv's data input."""
    stack, seen, ends = [start], set(), 0
    while stack:
        tensor = stack.pop()
        if tensor in seen:
            continue
        seen.add(tensor)
        users = g.consumers.get(tensor, [])
        if tensor in g.outputs or not users:
            return False
        for node in users:
            if _is_conv_reading(g, node, tensor):
                ends += 1
            elif (node.op_type == "Concat" or node.input[0] == tensor) and _homogeneous(g, node):
                stack.append(node.output[0])
            else:
                return False
    return ends > 0


def rescale(model: onnx.ModelProto, rng: np.random.Generator) -> dict[str, int]:
    """Per-channel log-uniform rescaling through every exact Conv -> ... -> Conv path."""
    g = _Graph(model)
    scales: dict[str, np.ndarray] = {}  # tensor -> per-channel factor it now carries
    carriers: list[tuple[onnx.NodeProto, onnx.NodeProto | None, np.ndarray]] = []
    for node in model.graph.node:
        if node.op_type != "Conv":
            continue
        start = _rescale_start(g, node)
        if start is None or not _reaches_only_convs(g, start[0]):
            continue
        channels = g.inits[node.input[1]].dims[0]
        s = np.exp(rng.uniform(np.log(SCALE_LOW), np.log(SCALE_HIGH), channels))
        scales[start[0]] = s
        carriers.append((node, start[1], s))
    # Propagate the factors forward (the graph is topologically sorted) and undo them in the
    # consuming Convs' weight columns.
    columns = 0
    for node in model.graph.node:
        scaled_inputs = [t for t in node.input if t in scales]
        if not scaled_inputs:
            continue
        if node.op_type == "Concat":
            parts = []
            for t in node.input:
                if t in scales:
                    parts.append(scales[t])
                else:
                    parts.append(np.ones(g.channels[t]))
            scales[node.output[0]] = np.concatenate(parts)
        elif node.op_type == "Conv" and node.input[0] in scales:
            _divide_columns(g, node, scales[node.input[0]])
            columns += 1
        else:
            scales[node.output[0]] = scales[node.input[0]]
    for conv, bn, s in carriers:
        if bn is not None:
            for name in bn.input[1:3]:  # scale and shift: BN(x) * s
                g.set_array(name, g.array(name).astype(np.float64) * s)
        else:
            _multiply_rows(g, conv, s)
    return {"rescaled_convs": len(carriers), "compensated_convs": columns}


def _multiply_rows(g: _Graph, conv: onnx.NodeProto, s: np.ndarray) -> None:
    """Multiply output channel ``c`` of ``conv`` (weight row and bias) by ``s_c``."""
    w = g.array(conv.input[1]).astype(np.float64)
    g.set_array(conv.input[1], w * s.reshape(-1, *([1] * (w.ndim - 1))))
    if len(conv.input) > 2 and conv.input[2]:
        g.set_array(conv.input[2], g.array(conv.input[2]).astype(np.float64) * s)


def _divide_columns(g: _Graph, conv: onnx.NodeProto, s: np.ndarray) -> None:
    """Divide the weights of ``conv`` reading input channel ``c`` by ``s_c`` (grouped layout)."""
    w = g.array(conv.input[1]).astype(np.float64)
    group = _attr(conv, "group", 1)
    cin_g, cout_g = w.shape[1], w.shape[0] // group
    for c in range(len(s)):
        grp, j = divmod(c, cin_g)
        w[grp * cout_g : (grp + 1) * cout_g, j] /= s[c]
    g.set_array(conv.input[1], w)


def _stream(g: _Graph, add: onnx.NodeProto) -> tuple[set, list, list] | None:
    """(values, writer Convs, reader Convs) of the residual stream through ``add``, or None."""
    values: set[str] = set()
    writers: dict[str, onnx.NodeProto] = {}
    readers: dict[str, onnx.NodeProto] = {}
    todo = [add.output[0]]
    while todo:
        value = todo.pop()
        if value in values:
            continue
        if value in g.outputs or value not in g.producer:
            return None
        values.add(value)
        node = g.producer[value]
        if node.op_type == "Add":
            todo.extend(node.input)
        elif (
            node.op_type == "Conv"
            and node.input[1] in g.inits
            and (len(node.input) < 3 or not node.input[2] or node.input[2] in g.inits)
        ):
            writers[node.name or value] = node
        else:
            return None
        for user in g.consumers.get(value, []):
            if user.op_type == "Add":
                todo.append(user.output[0])
                todo.extend(user.input)
            elif user.op_type == "Conv" and user.input[0] == value and user.input[1] in g.inits:
                readers[user.name or user.output[0]] = user
            else:
                return None
    if set(writers) & set(readers):
        return None
    return values, list(writers.values()), list(readers.values())


def rescale_streams(model: onnx.ModelProto, rng: np.random.Generator) -> dict[str, int]:
    """Per-channel log-uniform rescaling of every residual stream (module doc)."""
    g = _Graph(model)
    seen: set[str] = set()
    count = 0
    for node in model.graph.node:
        if node.op_type != "Add" or node.output[0] in seen:
            continue
        found = _stream(g, node)
        if found is None:
            continue
        values, writers, readers = found
        seen |= values
        channels = g.inits[writers[0].input[1]].dims[0]
        s = np.exp(rng.uniform(np.log(SCALE_LOW), np.log(SCALE_HIGH), channels))
        for conv in writers:
            _multiply_rows(g, conv, s)
        for conv in readers:
            _divide_columns(g, conv, s)
        count += 1
    return {"rescaled_streams": count}


# -- dead and constant channels -------------------------------------------------------------------


@dataclass
class _Chain:
    """A Conv, its optional BatchNormalization and activation, and the Convs reading the result."""

    conv: onnx.NodeProto
    bn: onnx.NodeProto | None
    act: onnx.NodeProto | None
    readers: list[onnx.NodeProto]
    depthwise: dict[str, _Chain] = field(default_factory=dict)  # reader name -> its own chain


def _chain(g: _Graph, conv: onnx.NodeProto) -> _Chain | None:
    tensor = conv.output[0]
    bn = act = None
    nxt = g.single_consumer(tensor)
    if nxt is not None and nxt.op_type == "BatchNormalization":
        if not all(n in g.inits and g.uses.get(n, 0) == 1 for n in nxt.input[1:5]):
            return None
        bn, tensor = nxt, nxt.output[0]
        nxt = g.single_consumer(tensor)
    if nxt is not None and nxt.op_type in ACTIVATIONS:
        if nxt.op_type == "Clip" and _clip_bounds(g, nxt) is None:
            return None
        if nxt.op_type == "PRelu" and g.constant(nxt.input[1]) is None:
            return None
        act, tensor = nxt, nxt.output[0]
    readers = g.consumers.get(tensor, [])
    if tensor in g.outputs or not readers:
        return None
    if not all(_is_conv_reading(g, r, tensor) for r in readers):
        return None
    return _Chain(conv, bn, act, readers)


def _is_depthwise(g: _Graph, conv: onnx.NodeProto) -> bool:
    w = g.inits[conv.input[1]]
    group = _attr(conv, "group", 1)
    return group > 1 and w.dims[1] == 1 and w.dims[0] == group


def _zeroes_negatives(g: _Graph, act: onnx.NodeProto | None) -> bool:
    if act is None:
        return False
    if act.op_type == "Relu":
        return True
    return act.op_type == "Clip" and _clip_bounds(g, act)[0] == 0.0


def _activate(g: _Graph, chain: _Chain, pre: np.float32) -> np.float32:
    """The chain's BN (identity statistics) and activation applied to a new channel's value."""
    x = np.float32(pre)
    if chain.bn is not None:
        eps = np.float32(_attr(chain.bn, "epsilon", 1e-5))
        x = np.float32(x / np.sqrt(np.float32(1.0) + eps))
    act = chain.act
    if act is None:
        return x
    if act.op_type == "Relu":
        return np.float32(max(x, 0.0))
    if act.op_type == "LeakyRelu":
        return x if x >= 0 else np.float32(np.float32(_attr(act, "alpha", 0.01)) * x)
    if act.op_type == "PRelu":
        return x if x >= 0 else np.float32(np.float32(0.25) * x)
    lo, hi = _clip_bounds(g, act)
    return np.float32(min(max(x, lo), hi))


def _plan_deadconst(g: _Graph, conv: onnx.NodeProto) -> _Chain | None:
    """The chain where new channels can be added to ``conv`` exactly, or None."""
    if conv.op_type != "Conv" or _attr(conv, "group", 1) != 1:
        return None
    if g.uses.get(conv.input[1], 0) != 1 or conv.input[1] not in g.inits:
        return None
    chain = _chain(g, conv)
    if chain is None:
        return None
    for reader in chain.readers:
        if _attr(reader, "group", 1) == 1:
            continue
        if not _is_depthwise(g, reader):
            return None
        # The depthwise reader's new group reads a dead channel: needs one to be possible.
        if not _zeroes_negatives(g, chain.act):
            return None
        sub = _chain(g, reader)
        if sub is None or not all(_attr(r, "group", 1) == 1 for r in sub.readers):
            return None
        if any(_padded(r) for r in sub.readers) and not _zeroes_negatives(g, sub.act):
            return None
        chain.depthwise[reader.name or reader.output[0]] = sub
    return chain


def _extend(g: _Graph, name: str, values: np.ndarray) -> None:
    g.set_array(name, np.concatenate([g.array(name), values.astype(g.array(name).dtype)]))


def _bias_name(g: _Graph, conv: onnx.NodeProto, channels: int) -> str:
    """The Conv's bias initializer, added (zeros) when it has none."""
    if len(conv.input) > 2 and conv.input[2]:
        return conv.input[2]
    dtype = numpy_helper.to_array(g.inits[conv.input[1]]).dtype
    name = g.add_array(f"{conv.input[1]}_bias", np.zeros(channels, dtype=dtype))
    while len(conv.input) < 3:
        conv.input.append("")
    conv.input[2] = name
    g.uses[name] = 1
    return name


def _add_out_channels(g: _Graph, chain: _Chain, w_rows: np.ndarray, biases: np.ndarray) -> None:
    """Append output channels (weight rows, biases) to the chain's Conv, BN and PRelu."""
    conv = chain.conv
    w = g.array(conv.input[1])
    n = len(biases)
    g.widened.update(node.output[0] for node in (conv, chain.bn, chain.act) if node is not None)
    g.set_array(conv.input[1], np.concatenate([w, w_rows.astype(w.dtype)]))
    _extend(g, _bias_name(g, conv, w.shape[0]), biases)
    if _attr(conv, "group", 1) > 1:  # depthwise: one more group
        _set_int_attr(conv, "group", _attr(conv, "group", 1) + n)
    if chain.bn is not None:  # identity statistics: BN(x) = x / sqrt(1 + eps)
        scale, shift, mean, var = chain.bn.input[1:5]
        for name, value in ((scale, 1.0), (shift, 0.0), (mean, 0.0), (var, 1.0)):
            _extend(g, name, np.full(n, value))
    if chain.act is not None and chain.act.op_type == "PRelu":
        slope = g.constant(chain.act.input[1])
        if slope.ndim >= 1 and slope.shape[0] == w.shape[0] and slope.size > 1:
            new = np.concatenate([slope, np.full((n, *slope.shape[1:]), 0.25, slope.dtype)])
            chain.act.input[1] = g.add_array(f"{chain.act.input[1]}_stress", new)


def _add_in_channels(
    g: _Graph, reader: onnx.NodeProto, values: np.ndarray, rng: np.random.Generator
) -> None:
    """Append input channels holding constants ``values`` to a group-1 Conv, output unchanged."""
    w = g.array(reader.input[1])
    typical = float(np.median(np.abs(w[w != 0]))) if np.any(w) else 1.0
    shape = (w.shape[0], len(values), *w.shape[2:])
    signs = rng.choice([-1.0, 1.0], size=shape)
    cols = (CONSUMER_GAIN * typical * signs * rng.uniform(0.5, 1.5, size=shape)).astype(w.dtype)
    bias = _bias_name(g, reader, w.shape[0])
    # sum over the kernel of W_new * act(bias): what the new channels add everywhere.
    kernel_sums = cols.astype(np.float64).reshape(shape[0], shape[1], -1).sum(axis=2)
    shift = kernel_sums @ values.astype(np.float64)
    g.set_array(bias, g.array(bias).astype(np.float64) - shift)
    g.set_array(reader.input[1], np.concatenate([w, cols], axis=1))


def _new_biases(
    g: _Graph, chain: _Chain, n: int, allow_const: bool, rng: np.random.Generator
) -> np.ndarray:
    """Biases of ``n`` new channels: negative (dead) or positive (constant), as allowed."""
    dead_ok = _zeroes_negatives(g, chain.act)
    out = []
    for _ in range(n):
        dead = dead_ok and (not allow_const or rng.random() < 0.5)
        magnitude = rng.uniform(0.5, 3.0)
        out.append(-magnitude if dead else magnitude)
    return np.array(out, dtype=np.float32)


def deadconst(model: onnx.ModelProto, rng: np.random.Generator) -> dict[str, int]:
    """Add dead and constant output channels wherever the float output stays exact."""
    g = _Graph(model)
    plans = [c for c in (_plan_deadconst(g, n) for n in list(model.graph.node)) if c is not None]
    dead = const = 0
    for chain in plans:
        direct_padded = any(_padded(r) for r in chain.readers)
        has_depthwise = bool(chain.depthwise)
        n = int(rng.integers(1, 4))
        biases = _new_biases(g, chain, n, not (direct_padded or has_depthwise), rng)
        w = g.array(chain.conv.input[1])
        rows = TINY_WEIGHT * rng.standard_normal((n, *w.shape[1:]))
        _add_out_channels(g, chain, rows, biases)
        values = np.array([_activate(g, chain, b) for b in biases], dtype=np.float32)
        dead += int(np.sum(values == 0))
        const += int(np.sum(values != 0))
        for reader in chain.readers:
            sub = chain.depthwise.get(reader.name or reader.output[0])
            if sub is None:
                _add_in_channels(g, reader, values, rng)
                continue
            # Depthwise reader: one new group per new channel; it reads a dead channel (all 0,
            # padding too), so its output is its bias, made dead or constant in turn.
            wd = g.array(reader.input[1])
            typical = float(np.median(np.abs(wd[wd != 0]))) if np.any(wd) else 1.0
            shape = (n, *wd.shape[1:])
            dw_rows = CONSUMER_GAIN * typical * rng.choice([-1.0, 1.0], size=shape)
            padded = any(_padded(r) for r in sub.readers)
            dw_biases = _new_biases(g, sub, n, not padded, rng)
            _add_out_channels(g, sub, dw_rows, dw_biases)
            dw_values = np.array([_activate(g, sub, b) for b in dw_biases], dtype=np.float32)
            dead += int(np.sum(dw_values == 0))
            const += int(np.sum(dw_values != 0))
            for sub_reader in sub.readers:
                _add_in_channels(g, sub_reader, dw_values, rng)
    # The widened tensors' recorded shapes are stale: drop them (shape inference redoes them);
    # every other tensor keeps its recorded type and shape, as in the original.
    kept = [vi for vi in model.graph.value_info if vi.name not in g.widened]
    del model.graph.value_info[:]
    model.graph.value_info.extend(kept)
    return {"sites": len(plans), "dead_channels": dead, "constant_channels": const}


# -- checking and writing ---------------------------------------------------------------------


def make_variant(model: onnx.ModelProto, kind: str, seed: int) -> tuple[onnx.ModelProto, dict]:
    """A stress variant of ``model`` (a modified copy) and counts of what was changed."""
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; use one of {', '.join(KINDS)}")
    variant = onnx.ModelProto()
    variant.CopyFrom(model)
    rng = np.random.default_rng(seed)
    stats: dict[str, int] = {}
    if kind in ("deadconst", "both"):
        stats.update(deadconst(variant, rng))
    if kind in ("rescale", "both"):
        stats.update(rescale(variant, rng))
    if kind == "streams":
        stats.update(rescale_streams(variant, rng))
    onnx.checker.check_model(variant)
    return variant, stats


def real_inputs(model_path: Path, inputs: Path | None, count: int) -> tuple[np.ndarray, str]:
    """Inputs to compare the two models on, and where they came from."""
    if inputs is not None:
        data = np.load(inputs)
        x = data["x"] if isinstance(data, np.lib.npyio.NpzFile) else data
        return np.asarray(x[:count], dtype=np.float32), str(inputs)
    key = SHARED_DATA.get(model_path.name)
    if key is not None:
        sys.path.insert(0, str(BENCH))
        import bench_accuracy

        if key == "digits":
            calib = np.load(bench_accuracy.SHARED / "models" / "digits_calib.npz")["x"]
        else:
            calib, _ = bench_accuracy.image_arrays(key, "calib")
        step = max(1, len(calib) // count)
        return calib[::step][:count], f"{key} calibration images"
    return np.empty((0,)), "random"


def _session(model: onnx.ModelProto):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3
    return ort.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )


def compare(a: onnx.ModelProto, b: onnx.ModelProto, x: np.ndarray, seed: int) -> dict[str, float]:
    """Per graph output, ``max|b - a| / max|a|`` over every sample (batch 1 each)."""
    sa, sb = _session(a), _session(b)
    inp = sa.get_inputs()[0]
    if x.size == 0:
        shape = [d if isinstance(d, int) else 1 for d in inp.shape]
        x = np.random.default_rng(seed).standard_normal((4, *shape[1:])).astype(np.float32)
    names = [o.name for o in sa.get_outputs()]
    worst_diff = dict.fromkeys(names, 0.0)
    peak = dict.fromkeys(names, 0.0)
    for i in range(len(x)):
        feed = {inp.name: x[i : i + 1]}
        for name, ra, rb in zip(names, sa.run(names, feed), sb.run(names, feed), strict=True):
            ra, rb = ra.astype(np.float64), rb.astype(np.float64)
            worst_diff[name] = max(worst_diff[name], float(np.max(np.abs(rb - ra))))
            peak[name] = max(peak[name], float(np.max(np.abs(ra))))
    return {n: worst_diff[n] / peak[n] if peak[n] > 0 else worst_diff[n] for n in names}


def write_atomic(model: onnx.ModelProto, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", dir=out.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(model.SerializeToString())
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; the variant is an ordinary model file
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def build(
    model_path: Path,
    kind: str,
    seed: int,
    out: Path,
    inputs: Path | None = None,
    samples: int = 8,
    tolerance: float = TOLERANCE,
) -> dict:
    """Make, check and write one variant; raise SystemExit when it changes a float output."""
    if out.resolve() == model_path.resolve():
        raise SystemExit(f"refusing to overwrite the input model {model_path}; choose another -o")
    model = onnx.load(str(model_path))
    variant, stats = make_variant(model, kind, seed)
    x, source = real_inputs(model_path, inputs, samples)
    rel = compare(model, variant, x, seed)
    worst = max(rel.values())
    for name, value in rel.items():
        print(f"{model_path.name} {kind} seed {seed}: output {name!r} max rel diff {value:.3g}")
    print(f"  changed: {stats}; compared on {source}")
    if not worst <= tolerance:
        raise SystemExit(
            f"{model_path.name} {kind}: the variant changes a float output by {worst:.3g} "
            f"(relative) > {tolerance}; not written"
        )
    write_atomic(variant, out)
    return {"stats": stats, "max_rel_diff": rel, "inputs": source}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", type=Path)
    p.add_argument("--kind", choices=KINDS, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("-o", "--out", type=Path, required=True)
    p.add_argument("--inputs", type=Path, help=".npy or .npz (key x) of N x ... float inputs")
    p.add_argument("--samples", type=int, default=8, help="inputs compared (default 8)")
    p.add_argument("--tolerance", type=float, default=TOLERANCE)
    args = p.parse_args(argv)
    build(args.model, args.kind, args.seed, args.out, args.inputs, args.samples, args.tolerance)
    return 0


if __name__ == "__main__":
    sys.exit(main())
