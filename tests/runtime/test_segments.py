"""runtime.run_segments: a graph run piece by piece gives the values of one whole-graph session."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper

from quark_onnx.model_files.external import external_data_dir
from quark_onnx.model_files.load import load_ir
from quark_onnx.runtime import sessions
from quark_onnx.runtime.sessions import _Graph


def _branchy(n: int = 12) -> onnx.ModelProto:
    """x[1,4,5,5] -> Conv/Relu/Add chain with skip connections reaching over several nodes,
    a second input read late, a graph output in the middle and an If whose branches read an
    outer value."""
    rng = np.random.default_rng(3)
    nodes, inits = [], []
    prev, skip = "x", "x"
    for i in range(n):
        w = rng.standard_normal((4, 4, 3, 3)).astype(np.float32) * 0.3
        inits.append(onnx.numpy_helper.from_array(w, f"w{i}"))
        nodes.append(helper.make_node("Conv", [prev, f"w{i}"], [f"c{i}"], pads=[1, 1, 1, 1]))
        nodes.append(helper.make_node("Relu", [f"c{i}"], [f"r{i}"]))
        if i % 3 == 2:
            nodes.append(helper.make_node("Add", [f"r{i}", skip], [f"a{i}"]))
            prev = skip = f"a{i}"
        else:
            prev = f"r{i}"
    nodes.append(helper.make_node("Mul", [prev, "y"], ["m"]))
    outer = prev
    then_g = helper.make_graph(
        [helper.make_node("Add", ["m", outer], ["t"])],
        "then",
        [],
        [helper.make_tensor_value_info("t", TensorProto.FLOAT, [1, 4, 5, 5])],
    )
    else_g = helper.make_graph(
        [helper.make_node("Sub", ["m", outer], ["e"])],
        "else",
        [],
        [helper.make_tensor_value_info("e", TensorProto.FLOAT, [1, 4, 5, 5])],
    )
    nodes.append(helper.make_node("ReduceSum", ["m"], ["s"], keepdims=0))
    nodes.append(helper.make_node("Greater", ["s", "zero"], ["g"]))
    nodes.append(helper.make_node("If", ["g"], ["out"], then_branch=then_g, else_branch=else_g))
    inits.append(onnx.numpy_helper.from_array(np.array(0.0, np.float32), "zero"))
    graph = helper.make_graph(
        nodes,
        "branchy",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 5, 5]),
            helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 5, 5]),
        ],
        [
            helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, 4, 5, 5]),
            helper.make_tensor_value_info("r4", TensorProto.FLOAT, [1, 4, 5, 5]),
        ],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _feeds(k: int = 3) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(7)
    return [
        {
            "x": rng.standard_normal((1, 4, 5, 5)).astype(np.float32),
            "y": rng.standard_normal((1, 4, 5, 5)).astype(np.float32),
        }
        for _ in range(k)
    ]


def _every_tensor(model: onnx.ModelProto) -> list[str]:
    return [o for n in model.graph.node for o in n.output]


@pytest.mark.parametrize("max_nodes", [1, 2, 3, 5, 7])
@pytest.mark.parametrize("form", ["proto", "ir"])
def test_segments_give_the_whole_sessions_values(max_nodes: int, form: str) -> None:
    proto = _branchy()
    names = ["x", *_every_tensor(proto)]
    feeds = _feeds()
    whole = sessions.run_outputs(proto, feeds, names, max_nodes=10**6)
    model = proto if form == "proto" else ir.serde.deserialize_model(proto)
    before = sessions.COUNTS.sessions
    pieces = sessions.run_outputs(model, feeds, names, max_nodes=max_nodes)
    n = len(proto.graph.node)
    assert sessions.COUNTS.sessions - before >= -(-n // max_nodes) > 1
    for w, p in zip(whole, pieces, strict=True):
        assert list(p) == names
        for name in names:
            assert p[name].dtype == w[name].dtype
            np.testing.assert_array_equal(p[name], w[name], err_msg=name)
    # the oracle of the oracle: onnxruntime on the unmodified model (no graph optimisation, as
    # every quantizer session) gives its graph outputs
    import onnxruntime as ort

    session = ort.InferenceSession(
        proto.SerializeToString(), sessions.session_options(), providers=["CPUExecutionProvider"]
    )
    for feed, p in zip(feeds, pieces, strict=True):
        out, r4 = session.run(["out", "r4"], feed)
        np.testing.assert_array_equal(p["out"], out)
        np.testing.assert_array_equal(p["r4"], r4)


def test_default_outputs_are_the_graph_outputs_and_the_proto_is_unchanged() -> None:
    proto = _branchy()
    before = proto.SerializeToString()
    got = sessions.run_outputs(proto, _feeds(2), max_nodes=4)
    assert [list(g) for g in got] == [["out", "r4"]] * 2
    assert proto.SerializeToString() == before


def test_each_value_is_yielded_once_as_soon_as_its_piece_ran() -> None:
    proto = _branchy()
    names = _every_tensor(proto)
    seen: list[str] = []
    for first, got in sessions.run_segments(proto, _feeds(2), names, max_nodes=4):
        assert first == 0
        assert all(len(values) == 2 for values in got.values())
        seen.extend(got)
    assert sorted(seen) == sorted(names)
    assert len(seen) == len(set(seen))


def test_cuts_keep_dequantized_constants_with_their_readers() -> None:
    """A value computed from initializers alone (a weight's DequantizeLinear) never crosses a
    cut: it would reach the next piece as an input instead of a constant."""
    w = onnx.numpy_helper.from_array(np.ones((4, 4, 1, 1), np.int8), "wq")
    s = onnx.numpy_helper.from_array(np.array(0.5, np.float32), "s")
    nodes = [
        helper.make_node("DequantizeLinear", ["wq", "s"], ["w"]),
        helper.make_node("Relu", ["x"], ["r0"]),
        helper.make_node("Relu", ["r0"], ["r1"]),
        helper.make_node("Conv", ["r1", "w"], ["y"]),
    ]
    model = helper.make_model(
        helper.make_graph(
            nodes,
            "g",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 2, 2])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
            [w, s],
        ),
        opset_imports=[helper.make_opsetid("", 17)],
    )
    pieces = _Graph(model).cuts(2)
    assert pieces == [(0, 4)]
    assert _Graph(model).cuts(5) == [(0, 4)]


def test_a_missing_feed_is_named() -> None:
    proto = _branchy()
    feeds = [{"x": _feeds(1)[0]["x"]}]
    with pytest.raises(ValueError, match="'y'"):
        sessions.run_outputs(proto, feeds, max_nodes=3)


def test_quantizer_with_pieces_writes_the_same_model_and_fidelity(tmp_path, monkeypatch) -> None:
    """The quantizer's runs of the whole model (pass costs, fidelity guard, error analysis) in
    pieces of 5 nodes: the written bytes and every reported number are those of single sessions."""
    import sys
    from pathlib import Path

    from quark_onnx import Config, ModelQuantizer, get_default_config

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from bench_scaling import build_chain

    build_chain("conv", 12, tmp_path / "chain.onnx")

    def quantize(out: str) -> tuple[bytes, dict]:
        qc = get_default_config("XINT8")
        qc.optimize_model = False
        qc.extra_options.update(
            UseRandomData=True, RandomDataSamples=3, LayerErrorAnalysis=True, FidelityMinSQNR=90.0
        )
        quantizer = ModelQuantizer(Config(global_quant_config=qc))
        quantizer.quantize_model(tmp_path / "chain.onnx", tmp_path / out, progress=False)
        report = quantizer.report
        return (tmp_path / out).read_bytes(), {
            "fidelity": report.fidelity,
            "layer_errors": report.layer_errors,
            "passes": [{k: v for k, v in p.items() if k != "seconds"} for p in report.passes],
        }

    whole = quantize("whole.onnx")
    before = sessions.COUNTS.sessions
    quantize("probe.onnx")
    sessions_whole = sessions.COUNTS.sessions - before
    monkeypatch.setattr(sessions, "SEGMENT_NODES", 5)
    before = sessions.COUNTS.sessions
    pieces = quantize("pieces.onnx")
    assert sessions.COUNTS.sessions - before > sessions_whole  # it did run in pieces
    assert pieces[0] == whole[0]
    assert whole[1]["fidelity"]["faithful"] is False  # the guard ran its per-layer analysis
    assert whole[1]["fidelity"]["worst_layers"]
    assert pieces[1] == whole[1]


def test_pieces_of_a_model_with_external_weights(tmp_path, monkeypatch) -> None:
    """Weights left in the model's data file (memory-mapped by load_ir) are read into each piece."""
    from quark_onnx.model_files import external

    monkeypatch.setattr(external, "SMALL_TENSOR_BYTES", 0)  # every weight stays in the file

    proto = _branchy()
    feeds = _feeds(2)
    names = _every_tensor(proto)
    whole = sessions.run_outputs(proto, feeds, names, max_nodes=10**6)
    path = tmp_path / "m.onnx"
    # (onnx.save turns the proto's own tensors into references)
    onnx.save(proto, path, save_as_external_data=True, location="m.data", size_threshold=0)
    model = load_ir(path)
    assert external_data_dir(model) is not None
    for max_nodes in (3, 10**6):
        got = sessions.run_outputs(model, feeds, names, max_nodes=max_nodes)
        for w, p in zip(whole, got, strict=True):
            for name in names:
                np.testing.assert_array_equal(p[name], w[name], err_msg=name)
