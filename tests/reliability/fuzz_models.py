"""Tiny valid models, a quantizer on random data, and the mutations the fuzz test applies.

The seed models are small enough (8x8 images, 4 channels) that one quantization takes tens of
milliseconds, yet cover the op families of the XINT8 policy: Conv (explicit attributes), Relu,
Add, Concat, MaxPool, GlobalAveragePool, Gemm, Reshape, LeakyRelu, Clip.

Mutations come in three families, each a plain function of a ``random.Random`` so that a failing
case can be replayed from its seed outside hypothesis:

* :func:`mutate_bytes` -- flips, truncations, insertions, deletions and duplications of the
  serialized model (most end at load, some parse into a different valid message);
* :func:`mutate_structure` -- edits of the ModelProto that keep it parseable (attributes, shapes,
  dtypes, opsets, dangling inputs, removed or duplicated nodes, custom-domain ops, subgraphs),
  aimed at the checker, shape inference, calibration and QDQ insertion;
* :func:`mutate_feeds` -- calibration feeds with wrong shapes, dtypes, names, NaN/Inf, zero-size
  arrays or non-array values.
"""

from __future__ import annotations

import copy
import os
import random
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto
from onnx import helper as h

from quark_onnx import Config, ModelQuantizer, get_default_config

IMAGE = [1, 3, 8, 8]


def _conv(name: str, x: str, w: str, out: str, k: int = 3, b: str | None = None, group: int = 1):
    pad = k // 2
    inputs = [x, w] + ([b] if b else [])
    return h.make_node(
        "Conv",
        inputs,
        [out],
        name=name,
        kernel_shape=[k, k],
        pads=[pad] * 4,
        strides=[1, 1],
        dilations=[1, 1],
        group=group,
    )


def _model(nodes, inputs, outputs, inits, opset: int = 17) -> onnx.ModelProto:
    graph = h.make_graph(nodes, "fuzz", inputs, outputs, inits)
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", opset)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def _init(name: str, shape: list[int], rng: np.random.Generator) -> TensorProto:
    return onnx.numpy_helper.from_array((rng.standard_normal(shape) * 0.3).astype(np.float32), name)


def conv_chain(seed: int = 0) -> onnx.ModelProto:
    """x -> Conv -> Relu -> Conv(1x1, bias) -> y: the smallest model the NPU check accepts."""
    rng = np.random.default_rng(seed)
    nodes = [
        _conv("conv0", "x", "w0", "c0"),
        h.make_node("Relu", ["c0"], ["r0"], name="relu0"),
        _conv("conv1", "r0", "w1", "y", k=1, b="b1"),
    ]
    inits = [_init("w0", [4, 3, 3, 3], rng), _init("w1", [4, 4, 1, 1], rng), _init("b1", [4], rng)]
    return _model(
        nodes,
        [h.make_tensor_value_info("x", TensorProto.FLOAT, IMAGE)],
        [h.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])],
        inits,
    )


def residual(seed: int = 0) -> onnx.ModelProto:
    """Conv -> Relu -> {Conv, identity} -> Add -> Concat -> MaxPool -> GAP -> Gemm."""
    rng = np.random.default_rng(seed)
    nodes = [
        _conv("conv0", "x", "w0", "c0", b="b0"),
        h.make_node("Relu", ["c0"], ["r0"], name="relu0"),
        _conv("conv1", "r0", "w1", "c1"),
        h.make_node("Add", ["c1", "r0"], ["a"], name="add"),
        h.make_node("LeakyRelu", ["a"], ["l"], name="leaky", alpha=0.1),
        h.make_node("Concat", ["l", "r0"], ["cat"], name="concat", axis=1),
        h.make_node("MaxPool", ["cat"], ["mp"], name="pool", kernel_shape=[2, 2], strides=[2, 2]),
        h.make_node("GlobalAveragePool", ["mp"], ["gap"], name="gap"),
        h.make_node("Reshape", ["gap", "shape"], ["flat"], name="reshape"),
        h.make_node("Gemm", ["flat", "wg", "bg"], ["y"], name="fc", transB=1),
    ]
    inits = [
        _init("w0", [4, 3, 3, 3], rng),
        _init("b0", [4], rng),
        _init("w1", [4, 4, 3, 3], rng),
        onnx.numpy_helper.from_array(np.array([1, 8], np.int64), "shape"),
        _init("wg", [5, 8], rng),
        _init("bg", [5], rng),
    ]
    return _model(
        nodes,
        [h.make_tensor_value_info("x", TensorProto.FLOAT, IMAGE)],
        [h.make_tensor_value_info("y", TensorProto.FLOAT, [1, 5])],
        inits,
    )


def clip_depthwise(seed: int = 0) -> onnx.ModelProto:
    """Conv -> Clip(0, 6) -> depthwise Conv -> Sigmoid-gated Mul (float ops on the side)."""
    rng = np.random.default_rng(seed)
    nodes = [
        _conv("conv0", "x", "w0", "c0"),
        h.make_node("Clip", ["c0", "lo", "hi"], ["r0"], name="clip0"),
        _conv("dw", "r0", "wd", "d", group=4),
        h.make_node("Sigmoid", ["d"], ["s"], name="sig"),
        h.make_node("Mul", ["d", "s"], ["y"], name="mul"),
    ]
    inits = [
        _init("w0", [4, 3, 3, 3], rng),
        _init("wd", [4, 1, 3, 3], rng),
        onnx.numpy_helper.from_array(np.array(0.0, np.float32), "lo"),
        onnx.numpy_helper.from_array(np.array(6.0, np.float32), "hi"),
    ]
    return _model(
        nodes,
        [h.make_tensor_value_info("x", TensorProto.FLOAT, IMAGE)],
        [h.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])],
        inits,
    )


SEEDS: dict[str, Callable[[int], onnx.ModelProto]] = {
    "conv_chain": conv_chain,
    "residual": residual,
    "clip_depthwise": clip_depthwise,
}


def quantizer(samples: int = 1, optimize: bool = False, **extra: object) -> ModelQuantizer:
    """An XINT8 quantizer calibrating on ``samples`` random feeds (or on given feeds)."""
    qc = get_default_config("XINT8")
    qc.optimize_model = optimize
    qc.extra_options.update(UseRandomData=True, RandomDataSamples=samples)
    qc.extra_options.update(extra)
    return ModelQuantizer(Config(global_quant_config=qc))


# --- mutations -------------------------------------------------------------------------------


def mutate_bytes(data: bytes, rnd: random.Random, steps: int = 1) -> bytes:
    """Apply ``steps`` random byte-level edits to a serialized model."""
    buf = bytearray(data)
    for _ in range(steps):
        kind = rnd.choice(["flip", "set", "truncate", "insert", "delete", "duplicate"])
        if not buf:
            buf = bytearray(rnd.randbytes(rnd.randint(1, 16)))
            continue
        i = rnd.randrange(len(buf))
        if kind == "flip":
            buf[i] ^= 1 << rnd.randrange(8)
        elif kind == "set":
            buf[i] = rnd.choice([0, 1, 0x7F, 0x80, 0xFF, rnd.randrange(256)])
        elif kind == "truncate":
            del buf[i:]
        elif kind == "insert":
            buf[i:i] = rnd.randbytes(rnd.randint(1, 8))
        elif kind == "delete":
            del buf[i : i + rnd.randint(1, 8)]
        else:
            j = min(len(buf), i + rnd.randint(1, 32))
            buf[j:j] = buf[i:j]
    return bytes(buf)


def _int_values(rnd: random.Random) -> int:
    return rnd.choice([-(2**31), -3, -1, 0, 1, 2, 3, 5, 9, 2**31 - 1, 2**40])


def _mutate_attribute(model: onnx.ModelProto, rnd: random.Random) -> None:
    nodes = [n for n in model.graph.node if n.attribute]
    if not nodes:
        return
    node = rnd.choice(nodes)
    attr = rnd.choice(node.attribute)
    if attr.type == onnx.AttributeProto.INTS and attr.ints:
        idx = rnd.randrange(len(attr.ints))
        attr.ints[idx] = _int_values(rnd)
        if rnd.random() < 0.3:
            attr.ints.append(rnd.randint(0, 4))
    elif attr.type == onnx.AttributeProto.INT:
        attr.i = _int_values(rnd)
    elif attr.type == onnx.AttributeProto.FLOAT:
        attr.f = rnd.choice([0.0, -1.0, 1e30, float("nan"), float("inf"), 0.5])
    elif rnd.random() < 0.5:
        node.attribute.remove(attr)


def _mutate_initializer(model: onnx.ModelProto, rnd: random.Random) -> None:
    inits = list(model.graph.initializer)
    if not inits:
        return
    t = rnd.choice(inits)
    kind = rnd.choice(["dims", "dtype", "values", "raw_length", "empty"])
    if kind == "dims" and t.dims:
        t.dims[rnd.randrange(len(t.dims))] = rnd.choice([0, 1, 2, 5, 7])
    elif kind == "dtype":
        t.data_type = rnd.choice(
            [TensorProto.FLOAT16, TensorProto.DOUBLE, TensorProto.INT8, TensorProto.INT64]
        )
    elif kind == "values" and t.data_type == TensorProto.FLOAT:
        try:
            arr = onnx.numpy_helper.to_array(t).copy()
        except ValueError:  # an earlier mutation already broke its length
            return
        if arr.size:
            arr.flat[rnd.randrange(arr.size)] = rnd.choice(
                [np.nan, np.inf, -np.inf, 0.0, 1e30, -1e-30]
            )
        if rnd.random() < 0.3:
            arr[...] = rnd.choice([0.0, 1e30, np.nan])
        t.CopyFrom(onnx.numpy_helper.from_array(arr, t.name))
    elif kind == "raw_length" and t.raw_data:
        t.raw_data = t.raw_data[: rnd.randrange(len(t.raw_data))]
    else:
        t.CopyFrom(onnx.numpy_helper.from_array(np.zeros([0], np.float32), t.name))


def _mutate_value_info(model: onnx.ModelProto, rnd: random.Random) -> None:
    g = model.graph
    vi = rnd.choice(list(g.input) + list(g.output))
    tt = vi.type.tensor_type
    kind = rnd.choice(["dim", "symbol", "rank", "dtype", "noshape"])
    dims = tt.shape.dim
    if kind == "dim" and dims:
        dims[rnd.randrange(len(dims))].dim_value = rnd.choice([0, 1, 2, 3, 16, 64])
    elif kind == "symbol" and dims:
        dims[rnd.randrange(len(dims))].dim_param = rnd.choice(["N", "H", "batch", "?"])
    elif kind == "rank" and dims:
        if rnd.random() < 0.5:
            del dims[-1]
        else:
            dims.add().dim_value = 1
    elif kind == "dtype":
        tt.elem_type = rnd.choice(
            [TensorProto.FLOAT16, TensorProto.DOUBLE, TensorProto.INT32, TensorProto.UINT8]
        )
    else:
        tt.ClearField("shape")


def _mutate_graph(model: onnx.ModelProto, rnd: random.Random) -> None:
    g = model.graph
    kind = rnd.choice(
        ["remove", "duplicate", "rewire", "dangling", "swap", "output", "custom", "if", "optype"]
    )
    nodes = list(g.node)
    if kind == "remove" and nodes:
        g.node.remove(rnd.choice(nodes))
    elif kind == "duplicate" and nodes:
        g.node.append(copy.deepcopy(rnd.choice(nodes)))
    elif kind == "rewire" and nodes:
        node = rnd.choice(nodes)
        values = [i.name for i in g.input] + [o for n in nodes for o in n.output]
        values += [t.name for t in g.initializer]
        if node.input:
            node.input[rnd.randrange(len(node.input))] = rnd.choice(values)
    elif kind == "dangling" and nodes:
        node = rnd.choice(nodes)
        if node.input:
            node.input[rnd.randrange(len(node.input))] = rnd.choice(["", "nowhere"])
    elif kind == "swap" and len(nodes) > 1:
        i, j = rnd.sample(range(len(nodes)), 2)
        a, b = copy.deepcopy(nodes[i]), copy.deepcopy(nodes[j])
        g.node[i].CopyFrom(b)
        g.node[j].CopyFrom(a)
    elif kind == "output" and nodes:
        out = rnd.choice([o for n in nodes for o in n.output])
        g.output.append(h.make_tensor_value_info(out, TensorProto.FLOAT, None))
    elif kind == "custom" and nodes:
        node = rnd.choice(nodes)
        node.domain = rnd.choice(["com.example", "ai.onnx.contrib", "com.microsoft"])
        if not any(o.domain == node.domain for o in model.opset_import):
            model.opset_import.append(h.make_opsetid(node.domain, 1))
    elif kind == "if" and nodes:
        # wrap the last node's output in an If whose branches pass it on (or negate it)
        last = g.node[-1].output[0]
        g.node[-1].output[0] = last + "_pre"
        then_g = h.make_graph(
            [h.make_node("Identity", [last + "_pre"], ["t"])],
            "then",
            [],
            [h.make_tensor_value_info("t", TensorProto.FLOAT, None)],
        )
        else_g = h.make_graph(
            [h.make_node("Neg", [last + "_pre"], ["e"])],
            "else",
            [],
            [h.make_tensor_value_info("e", TensorProto.FLOAT, None)],
        )
        g.initializer.append(onnx.numpy_helper.from_array(np.array(rnd.random() < 0.5), "cond"))
        g.node.append(h.make_node("If", ["cond"], [last], then_branch=then_g, else_branch=else_g))
    elif kind == "optype" and nodes:
        node = rnd.choice(nodes)
        node.op_type = rnd.choice(["Relu", "Conv", "Add", "Identity", "Gemm", "NoSuchOp", "Mul"])


def _mutate_opset(model: onnx.ModelProto, rnd: random.Random) -> None:
    for imp in model.opset_import:
        if imp.domain in ("", "ai.onnx"):
            imp.version = rnd.choice([1, 6, 7, 9, 10, 11, 12, 13, 14, 18, 21, 30])
    if rnd.random() < 0.2:
        model.ir_version = rnd.choice([0, 3, 7, 9, 10, 99])


STRUCTURE_MUTATIONS = (
    _mutate_attribute,
    _mutate_initializer,
    _mutate_value_info,
    _mutate_graph,
    _mutate_opset,
)


def mutate_structure(model: onnx.ModelProto, rnd: random.Random, steps: int = 1) -> None:
    """Apply ``steps`` random structural edits to ``model`` in place."""
    for _ in range(steps):
        rnd.choice(STRUCTURE_MUTATIONS)(model, rnd)


def mutate_feeds(rnd: random.Random, samples: int = 2) -> list[dict[str, object]]:
    """Calibration feeds for an input ``x`` of shape 1x3x8x8, with one or more faults."""
    feeds: list[dict[str, object]] = []
    for _ in range(samples):
        x: object = np.random.default_rng(rnd.randrange(2**32)).random(IMAGE, dtype=np.float32)
        kind = rnd.choice(
            ["ok", "shape", "rank", "dtype", "nan", "inf", "empty", "name", "extra", "list", "none"]
        )
        feed: dict[str, object] = {"x": x}
        if kind == "shape":
            feed["x"] = np.zeros([1, 3, rnd.choice([0, 1, 7, 9]), 8], np.float32)
        elif kind == "rank":
            feed["x"] = np.zeros([3, 8, 8], np.float32)
        elif kind == "dtype":
            feed["x"] = np.asarray(x).astype(rnd.choice([np.float64, np.int32, np.uint8, bool]))
        elif kind == "nan":
            feed["x"] = np.full(IMAGE, np.nan, np.float32)
        elif kind == "inf":
            arr = np.asarray(x).copy()
            arr.flat[0] = np.inf
            feed["x"] = arr
        elif kind == "empty":
            feed["x"] = np.zeros([0, 3, 8, 8], np.float32)
        elif kind == "name":
            feed = {"image": x}
        elif kind == "extra":
            feed["other"] = x
        elif kind == "list":
            feed["x"] = np.asarray(x).tolist()
        elif kind == "none":
            feed["x"] = None
        feeds.append(feed)
    return feeds


class ListReader:
    """A calibration reader over a list of feeds (``get_next`` protocol)."""

    def __init__(self, feeds: list[dict[str, object]]) -> None:
        self._feeds = iter(feeds)

    def get_next(self) -> dict[str, object] | None:
        return next(self._feeds, None)


# --- generators of the second reliability round: external data, readers, output paths --------


def write_external(model: onnx.ModelProto, folder: Path, rnd: random.Random) -> list[Path]:
    """Write ``model`` as ``folder/m.onnx`` with every initializer in ``folder/w.bin``; with
    probability 3/4 one reference is corrupted: a length that disagrees with the dims (by a few
    bytes or by a declared size of up to 2^62), no length, or an offset past the end; the data
    file is sometimes extended (sparse) so the declared range exists. Returns the input files."""
    blob = bytearray()
    tensors = list(model.graph.initializer)
    for tensor in tensors:
        data = tensor.raw_data or onnx.numpy_helper.to_array(tensor).tobytes()
        tensor.ClearField("raw_data")
        del tensor.float_data[:]
        tensor.data_location = onnx.TensorProto.EXTERNAL
        for key, value in (("location", "w.bin"), ("offset", len(blob)), ("length", len(data))):
            entry = tensor.external_data.add()
            entry.key, entry.value = key, str(value)
        blob += data
    extend = 0
    if tensors and rnd.random() < 0.75:
        victim = rnd.choice(tensors)
        info = {e.key: e for e in victim.external_data}
        kind = rnd.choice(["delta", "bomb", "no_length", "offset"])
        if kind == "delta":
            info["length"].value = str(
                max(0, int(info["length"].value) + rnd.choice([-4, -1, 1, 8]))
            )
        elif kind == "bomb":
            declared = 1 << rnd.randint(20, 62)
            info["length"].value = str(declared)
            if declared <= 1 << 34 and rnd.random() < 0.5:
                extend = int(info["offset"].value) + declared
        elif kind == "no_length":
            victim.external_data.remove(info["length"])
        else:
            info["offset"].value = str(len(blob) + rnd.randint(1, 1 << 40))
    folder.mkdir(parents=True, exist_ok=True)
    data_path = folder / "w.bin"
    data_path.write_bytes(bytes(blob))
    if extend > len(blob):
        with open(data_path, "r+b") as f:
            f.truncate(extend)  # sparse: the declared bytes exist but take no disk
    path = folder / "m.onnx"
    path.write_bytes(model.SerializeToString())
    return [path, data_path]


class WrongReader:
    """A reader whose feeds go wrong in one of the ways users' readers do: a list, an array, a
    string, an int instead of a dict, an exception from ``get_next``, or (1 in 4) nothing wrong."""

    KINDS = ("ok", "list", "array", "str", "int", "raise", "dict_of_lists", "wrong_dtype")

    def __init__(self, rnd: random.Random, samples: int) -> None:
        self.kind = rnd.choice(self.KINDS)
        self.left = samples
        self.rnd = rnd

    def get_next(self) -> object:
        if self.left <= 0:
            return None
        self.left -= 1
        x = np.asarray(self.rnd.random(), np.float32) * np.ones(IMAGE, np.float32)
        return {
            "ok": {"x": x},
            "list": [x],
            "array": x,
            "str": "x",
            "int": 7,
            "dict_of_lists": {"x": x.tolist()},
            "wrong_dtype": {"x": x.astype(np.float64)},
        }.get(self.kind) or self._raise()

    def _raise(self) -> None:
        raise RuntimeError("the user's reader broke")


def output_spelling(path: Path, data: Path, rnd: random.Random) -> Path:
    """A path naming one of the inputs (model or its data file) in another spelling, or a FIFO."""
    folder = path.parent
    target = rnd.choice([path, data])
    kind = rnd.choice(["same", "dotdot", "dot", "symlink", "hardlink", "fifo"])
    if kind == "same":
        return target
    if kind == "dotdot":
        (folder / "sub").mkdir(exist_ok=True)
        return folder / "sub" / ".." / target.name
    if kind == "dot":
        return folder / "." / target.name
    link = folder / f"{kind}.{rnd.randrange(1 << 30)}.onnx"
    if kind == "symlink":
        link.symlink_to(target.name)
    elif kind == "hardlink":
        os.link(target, link)
    else:
        os.mkfifo(link)
    return link
