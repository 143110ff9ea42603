"""The verdict's measurement, sample by sample: the same numbers as sums over float64 copies,
with one float64 buffer per sample, and the reference outputs spilled to files beyond a size.

Oracles: the accumulator's sums against ``np.sum`` over float64 copies, compared with ``==``
(the buffer holds the same values in the same layout, so numpy's pairwise summation gives the
same bits); a quantization whose reference is spilled against one that keeps it in memory
(the whole fidelity report, every output and part, compared with ``==``).
"""

from __future__ import annotations

import math

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from quark_onnx import Config, ModelQuantizer, get_default_config
from quark_onnx.fidelity.compare import ErrorAccumulator, sqnr_db
from quark_onnx.fidelity.verdict import compare_runs
from quark_onnx.pipeline import guard

RNG = np.random.default_rng(5)


def _float64_sums(pairs: list[tuple[np.ndarray, np.ndarray]]) -> dict[str, float]:
    """The accumulator's statistics as sums over float64 copies (what it computed before it
    wrote its products into one buffer)."""
    signal = noise = dot = qenergy = max_abs = 0.0
    for f, q in pairs:
        f64, q64 = np.asarray(f, np.float64), np.asarray(q, np.float64)
        diff = f64 - q64
        signal += float(np.sum(f64 * f64))
        noise += float(np.sum(diff * diff))
        dot += float(np.sum(f64 * q64))
        qenergy += float(np.sum(q64 * q64))
        if diff.size:
            max_abs = max(max_abs, float(np.max(np.abs(diff))))
    return {"signal": signal, "noise": noise, "dot": dot, "qenergy": qenergy, "max": max_abs}


@pytest.mark.parametrize(
    "make",
    [
        lambda: RNG.normal(size=(1, 16, 37, 29)).astype(np.float32),  # a dense map
        lambda: RNG.normal(size=(1, 84, 400)).astype(np.float32)[:, 4:84],  # a sliced part
        lambda: RNG.normal(size=(3, 10)).astype(np.float16),
        lambda: RNG.integers(-5, 5, size=(2, 7)).astype(np.int64),
        lambda: np.float32(RNG.normal()),  # a scalar output
    ],
)
def test_accumulator_sums_are_the_float64_sums_bit_for_bit(make):
    pairs = []
    for _ in range(3):
        f = make()
        noise = RNG.normal(scale=0.2, size=np.shape(f))
        q = (np.asarray(f, np.float64) + noise).astype(np.asarray(f).dtype)
        pairs.append((f, q))
    acc = ErrorAccumulator()
    for f, q in pairs:
        acc.update(f, q, top1=True)
    want = _float64_sums(pairs)
    got = {
        "signal": acc.signal,
        "noise": acc.noise,
        "dot": acc.dot,
        "qenergy": acc.qenergy,
        "max": acc.max_abs,
    }
    assert got == want
    assert acc.result("y", "y").sqnr_db == sqnr_db(want["signal"], want["noise"])


def test_a_nan_output_still_gives_a_nan_sqnr():
    f = np.ones((2, 3), np.float32)
    q = f.copy()
    q[0, 1] = np.nan
    acc = ErrorAccumulator()
    acc.update(f, q, top1=True)
    assert math.isnan(acc.result("y", "y").sqnr_db)


def test_argmax_of_a_float32_output_counts_as_of_its_float64_copy():
    f = np.array([[0.1, 0.3, 0.3], [np.nan, 0.0, 1.0]], np.float32)  # a tie, a NaN
    q = np.array([[0.3, 0.3, 0.1], [0.0, np.nan, 1.0]], np.float32)
    acc = ErrorAccumulator()
    acc.update(f, q, top1=True)
    want = np.argmax(f.astype(np.float64), 1) == np.argmax(q.astype(np.float64), 1)
    assert acc.agree == int(np.sum(want)) and acc.rows == 2


def test_compare_runs_reads_runs_one_at_a_time():
    """The quantized runs may be a generator: it is advanced once per reference run."""
    before = [{"y": RNG.normal(size=(1, 4, 5, 5)).astype(np.float32)} for _ in range(4)]
    seen = []

    def after():
        for i, run in enumerate(before):
            seen.append(i)
            yield {"y": run["y"] * np.float32(1.01)}

    listed = compare_runs(before, [{"y": r["y"] * np.float32(1.01)} for r in before])
    streamed = compare_runs(before, after())
    assert seen == [0, 1, 2, 3]
    assert [o.to_dict() for o in streamed] == [o.to_dict() for o in listed]


def test_run_store_spills_beyond_its_size_and_gives_the_same_arrays():
    runs = [{"a": RNG.normal(size=(2, 3)).astype(np.float32), "b": np.arange(4)} for _ in range(3)]
    size = sum(v.nbytes for v in runs[0].values())
    kept = guard.RunStore(memory_bytes=1 << 20)
    spilled = guard.RunStore(memory_bytes=0)
    later = guard.RunStore(memory_bytes=2 * size)  # the first two held, then all three spilled
    for run in runs:
        kept.append(run)
        spilled.append(run)
        later.append(run)
    assert kept._folder is None  # must-not-fire: small runs stay in memory
    for store in (spilled, later):
        assert store._folder is not None
        assert not any(isinstance(r, dict) for r in store._runs)
    for store in (kept, spilled, spilled[1:], later):
        offset = 1 if len(store) == 2 else 0
        assert len(store) == len(runs) - offset
        for i, run in enumerate(store):
            want = runs[i + offset]
            assert run.keys() == want.keys()
            for name in want:
                assert run[name].dtype == want[name].dtype
                np.testing.assert_array_equal(run[name], want[name])


def _detector(path) -> None:
    """Joined boxes and sigmoid scores ``[1, 7, 64]``, a dense map, and a logits vector."""
    rng = np.random.default_rng(0)
    inits, nodes = [], []

    def conv(name: str, x: str, cin: int, cout: int, k: int = 1) -> str:
        w = rng.normal(size=(cout, cin, k, k)) * math.sqrt(2 / (cin * k * k))
        inits.append(numpy_helper.from_array(w.astype(np.float32), name + "_w"))
        inits.append(
            numpy_helper.from_array(rng.normal(size=cout).astype(np.float32) * 0.1, name + "_b")
        )
        nodes.append(
            helper.make_node(
                "Conv",
                [x, name + "_w", name + "_b"],
                [name],
                kernel_shape=[k, k],
                pads=[k // 2] * 4,
            )
        )
        return name

    conv("c1", "x", 3, 8, 3)
    nodes.append(helper.make_node("Relu", ["c1"], ["r1"]))
    conv("cls", "r1", 8, 3)
    conv("reg", "r1", 8, 4)
    conv("seg", "r1", 8, 4)
    inits += [
        numpy_helper.from_array(np.array([1, 3, 64], np.int64), "s3"),
        numpy_helper.from_array(np.array([1, 4, 64], np.int64), "s4"),
        numpy_helper.from_array(np.array(8.0, np.float32), "eight"),
        numpy_helper.from_array(rng.normal(size=(10, 8)).astype(np.float32), "fc_w"),
        numpy_helper.from_array(np.zeros(10, np.float32), "fc_b"),
    ]
    nodes += [
        helper.make_node("Reshape", ["cls", "s3"], ["clsf"]),
        helper.make_node("Sigmoid", ["clsf"], ["scores"]),
        helper.make_node("Reshape", ["reg", "s4"], ["regf"]),
        helper.make_node("Mul", ["regf", "eight"], ["boxes"]),
        helper.make_node("Concat", ["boxes", "scores"], ["output0"], axis=1),
        helper.make_node("GlobalAveragePool", ["r1"], ["gap"]),
        helper.make_node("Flatten", ["gap"], ["flat"]),
        helper.make_node("Gemm", ["flat", "fc_w", "fc_b"], ["logits"], transB=1),
    ]
    graph = helper.make_graph(
        nodes,
        "detector",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [
            helper.make_tensor_value_info(n, TensorProto.FLOAT, None)
            for n in ("output0", "seg", "logits")
        ],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(onnx.shape_inference.infer_shapes(model), str(path))


class _Reader:
    def __init__(self, count: int) -> None:
        self.index, self.count = 0, count

    def get_next(self) -> dict[str, np.ndarray] | None:
        if self.index >= self.count:
            return None
        self.index += 1
        rng = np.random.default_rng(self.index)
        return {"x": rng.normal(size=(1, 3, 8, 8)).astype(np.float32)}


def test_a_spilled_reference_gives_the_same_fidelity_report(tmp_path, monkeypatch):
    path = tmp_path / "detector.onnx"
    _detector(path)

    def fidelity() -> tuple[dict, list]:
        quantizer = ModelQuantizer(Config(global_quant_config=get_default_config("XINT8")))
        quantizer.quantize_model(str(path), str(tmp_path / "out.onnx"), _Reader(40))
        report = quantizer.report
        return report.fidelity, [p["fidelity"] for p in report.passes]

    in_memory = fidelity()
    spills = []
    spill = guard.RunStore._spill
    # a few runs held, then every run written (the ones held first too)
    monkeypatch.setattr(guard, "REFERENCE_MEMORY_BYTES", 8000)
    monkeypatch.setattr(
        guard.RunStore, "_spill", lambda s, r, i: spills.append(i) or spill(s, r, i)
    )
    spilled = fidelity()
    assert spills[:3] == [0, 1, 2]  # the runs held first were written too
    parts = [p["measure"] for o in in_memory[0]["outputs"] for p in o["parts"]]
    assert parts == ["sqnr", "decisions", "argmax", "top1"]  # every kind of part is compared
    assert spilled == in_memory


@pytest.mark.parametrize("layers", [[], ["a layer"]])
def test_the_accuracy_stages_read_external_weights_only_for_a_layer_to_replay(
    tmp_path, monkeypatch, layers
):
    from quark_onnx.accuracy import layers as layers_module

    weight = numpy_helper.from_array(np.ones((64, 64), np.float32), "W")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["y"])],
        "mm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64])],
        [weight],
    )
    onnx.save(
        helper.make_model(graph),
        str(tmp_path / "m.onnx"),
        save_as_external_data=True,
        size_threshold=0,
        location="m.data",
    )
    prepared = onnx.load(str(tmp_path / "m.onnx"), load_external_data=False)
    monkeypatch.setattr(layers_module, "find_layers", lambda model: (layers, []))
    guard.materialize(prepared, tmp_path, quantized=object())
    read = prepared.graph.initializer[0].data_location == TensorProto.DEFAULT
    assert read == bool(layers)
    guard.materialize(prepared, tmp_path)  # every other caller: always read
    assert prepared.graph.initializer[0].data_location == TensorProto.DEFAULT
