"""Calibration of a graph run piece by piece: the statistics of one session, bit for bit."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import make_model
from onnx import TensorProto, helper

from quark_onnx.calibration import ArrayDataReader
from quark_onnx.calibration.collector import Collector
from quark_onnx.calibration.session import SEGMENT_RUNS
from quark_onnx.config.enums import CalibrationMethod, PowerOfTwoMethod
from quark_onnx.config.options import ExtraOptions
from quark_onnx.errors import CalibrationError
from quark_onnx.runtime import sessions as runtime

OPTS = ExtraOptions()


def _graph(batch: str | int = "N") -> onnx.ModelProto:
    """x[N,8] -> Conv(1x1) -> Add(bias) -> Relu -> Tanh ... a dozen nodes with a branch, a Concat,
    a value not calibrated between a Conv and its Add (which an optimising session may fuse), and a
    Reshape whose shape input is an initializer."""
    rng = np.random.default_rng(7)
    conv = {"kernel_shape": [1, 1], "pads": [0, 0, 0, 0], "strides": [1, 1], "dilations": [1, 1]}
    nodes = [
        helper.make_node("Reshape", ["x", "s4"], ["x4"]),
        helper.make_node("Conv", ["x4", "W1"], ["c1"], **conv),
        helper.make_node("Add", ["c1", "b1"], ["a1"]),
        helper.make_node("Relu", ["a1"], ["r1"]),
        helper.make_node("Conv", ["r1", "W2"], ["c2"], **conv),
        helper.make_node("Tanh", ["c2"], ["t2"]),
        helper.make_node("Mul", ["t2", "r1"], ["m2"]),
        helper.make_node("Sigmoid", ["a1"], ["g"]),
        helper.make_node("Concat", ["m2", "g"], ["cat"], axis=1),
        helper.make_node("Conv", ["cat", "W3"], ["c3"], **conv),
        helper.make_node("Add", ["c3", "a1"], ["a3"]),
        helper.make_node("Reshape", ["a3", "s2"], ["y"]),
    ]
    inits = {
        "s4": np.array([-1, 8, 1, 1], np.int64),
        "s2": np.array([-1, 8], np.int64),
        "W1": rng.standard_normal((8, 8, 1, 1)).astype(np.float32),
        "b1": rng.standard_normal((1, 8, 1, 1)).astype(np.float32),
        "W2": rng.standard_normal((8, 8, 1, 1)).astype(np.float32),
        "W3": rng.standard_normal((8, 16, 1, 1)).astype(np.float32),
    }
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 8])
    return make_model(nodes, [x], [y], inits)


# c1 (the Conv before the bias Add) is not calibrated
NAMES = ["x", "x4", "a1", "r1", "c2", "t2", "m2", "g", "cat", "c3", "a3", "y", "W1"]


def _feeds(n: int) -> np.ndarray:
    return (np.random.default_rng(3).standard_t(3, (n, 8)) * 2).astype(np.float32)


@pytest.mark.parametrize("method", [PowerOfTwoMethod.MinMSE, CalibrationMethod.MinMax])
@pytest.mark.parametrize(("batch", "batch_size"), [("N", 3), (1, 1)])
def test_pieces_give_the_statistics_of_one_session(method, batch, batch_size):
    data = _feeds(2 * SEGMENT_RUNS * 3 + 5)  # several groups of runs, the last one partial
    results, sessions = [], []
    for segment_nodes in (10**6, 2, 3):
        before = runtime.COUNTS.sessions
        c = Collector(
            _graph(batch), NAMES, method=method, options=OPTS, segment_nodes=segment_nodes
        )
        assert c.runner.segmented == (segment_nodes < 10**6)
        reader = ArrayDataReader({"x": data}, batch_size=batch_size)
        results.append(c.run(reader, progress=False).to_dict())
        sessions.append(runtime.COUNTS.sessions - before)
    assert results[1] == results[0]
    assert results[2] == results[0]
    groups = -(-len(data) // (batch_size * (8 // batch_size if batch == "N" else 1)))
    groups = -(-groups // SEGMENT_RUNS)
    assert sessions[0] == 1
    # really piece by piece: every group of runs through each piece
    assert sessions[1] >= 3 * groups and sessions[2] >= 2 * groups


def test_the_session_options_of_the_whole_graph_and_no_cut_inside_a_fusable_pair():
    """Each piece gets the whole graph's options, so a cut must not fall where the whole graph's
    optimiser could fuse across: between c1 (not read) and its bias Add."""
    proto = _graph()
    c = Collector(proto, NAMES, method=CalibrationMethod.MinMax, options=OPTS, segment_nodes=1)
    graph = runtime._Graph(c.runner.copy)
    pieces = graph.cuts(1, c.fetch)
    nodes = [n.op_type + ":" + n.output[0] for n in c.runner.copy.graph.node]
    conv = nodes.index("Conv:c1")
    assert (conv, conv + 1) not in pieces  # c1 would cross the cut
    assert any(start <= conv and conv + 1 < end for start, end in pieces)
    # without the read names, every node is its own piece (Reshape shapes are initializers)
    assert len(graph.cuts(1)) == len(nodes)


def test_a_failing_piece_names_the_feeds():
    nodes = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Tanh", ["r"], ["y"])]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])
    model = make_model(nodes, [x], [y])
    c = Collector(model, ["r", "y"], method=CalibrationMethod.MinMax, options=OPTS, segment_nodes=1)
    bad = onnx.helper.make_node("NoSuchOp", ["r"], ["y"], domain="nowhere.example")
    del c.runner.copy.graph.node[1:]
    c.runner.copy.graph.node.append(bad)
    with pytest.raises(
        CalibrationError,
        match=r"1 run\(s\) from calibration feed #0 on \(the model run piece by piece\)",
    ):
        c.run(ArrayDataReader({"x": _feeds(2)[:, :4]}, batch_size=1), progress=False)
