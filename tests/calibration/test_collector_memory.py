"""What the collector does to hold less memory, and that none of it changes a statistic."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import make_model
from onnx import TensorProto, helper

from quark_onnx.calibration import ArrayDataReader
from quark_onnx.calibration import tensors as tensors_module
from quark_onnx.calibration.collector import Collector
from quark_onnx.calibration.session import session_options
from quark_onnx.calibration.tensors import inference_copy
from quark_onnx.config.enums import CalibrationMethod, PowerOfTwoMethod
from quark_onnx.config.options import ExtraOptions

OPTS = ExtraOptions()


def _shape_model() -> onnx.ModelProto:
    """Conv with a large weight, then ops whose output shapes shape inference reads from
    initializer values: Reshape (int64 shape), Resize (float scales), Range (float scalars)."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 16, 3, 3)).astype(np.float32)  # 9216 values: stripped
    nodes = [
        helper.make_node("Conv", ["x", "W"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("Reshape", ["c", "shape"], ["r"]),
        helper.make_node("Resize", ["r", "", "scales"], ["z"], mode="nearest"),
        helper.make_node("Range", ["start", "limit", "delta"], ["q"]),
        helper.make_node("Add", ["z", "q"], ["y"]),
    ]
    inits = {
        "W": w,
        "shape": np.array([1, 32, 16, 8], np.int64),
        "scales": np.array([1.0, 1.0, 2.0, 0.5], np.float32),
        "start": np.array(0.0, np.float32),
        "limit": np.array(2.0, np.float32),
        "delta": np.array(0.5, np.float32),
    }
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16, 8, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 32, 32, 4])
    return make_model(nodes, [x], [y], inits)


def _inferred(model: onnx.ModelProto) -> dict[str, bytes]:
    graph = onnx.shape_inference.infer_shapes(model).graph
    return {
        v.name: v.type.SerializeToString()
        for v in list(graph.input) + list(graph.value_info) + list(graph.output)
    }


def test_inference_copy_infers_what_the_whole_model_infers():
    model = _shape_model()
    before = model.SerializeToString()
    light = inference_copy(model)
    assert model.SerializeToString() == before  # the model is not touched
    stripped = {t.name: t for t in light.graph.initializer}
    assert not stripped["W"].raw_data and not stripped["W"].float_data  # the weight's bytes stay
    assert list(stripped["W"].dims) == [64, 16, 3, 3]
    assert stripped["W"].data_type == TensorProto.FLOAT
    assert light.ByteSize() < model.ByteSize() // 10
    assert light.opset_import == model.opset_import and light.ir_version == model.ir_version

    full = _inferred(model)
    assert _inferred(light) == full
    # the oracle is sensitive: shapes Reshape, Resize and Range take from values are known ...
    for name, shape in (("r", [1, 32, 16, 8]), ("z", [1, 32, 32, 4]), ("q", [4])):
        t = onnx.TypeProto.FromString(full[name]).tensor_type
        assert [d.dim_value for d in t.shape.dim] == shape, name

    collector = Collector(model, ["c", "r", "z", "y"], method=PowerOfTwoMethod.MinMSE, options=OPTS)
    assert {n: t.SerializeToString() for n, t in collector._shapes.items()} == full
    assert collector.types["W"] == TensorProto.FLOAT


def test_inference_copy_keeps_the_values_shape_inference_reads(monkeypatch):
    """Stripping every initializer (the bound at 0) loses the shapes read from values: the
    bound is what keeps them."""
    model = _shape_model()
    monkeypatch.setattr(tensors_module, "INFERENCE_KEEPS_VALUES", 0)
    light = _inferred(inference_copy(model))
    assert light != _inferred(model)


def test_session_holds_neither_the_copy_bytes_nor_a_memory_pattern():
    model = _shape_model()
    collector = Collector(model, ["c", "y"], method=CalibrationMethod.MinMax, options=OPTS)
    assert getattr(collector.session, "_model_bytes", None) is None
    assert not session_options().enable_mem_pattern
    data = np.random.default_rng(1).standard_normal((3, 1, 16, 8, 8)).astype(np.float32)
    result = collector.run(ArrayDataReader({"x": data.reshape(3, 16, 8, 8)}, batch_size=1))
    assert result.observer("y").count == 3 * 32 * 32 * 4


def _chain(batch: str | int = "N") -> onnx.ModelProto:
    """x[N,4] -> MatMul -> h[N,8] -> Tanh -> s -> Mul(s, h) -> y: three outputs of 8 values."""
    rng = np.random.default_rng(3)
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["h"]),
        helper.make_node("Tanh", ["h"], ["s"]),
        helper.make_node("Mul", ["s", "h"], ["y"]),
    ]
    return make_model(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 8])],
        {"W": rng.standard_normal((4, 8)).astype(np.float32)},
    )


def _on_chain(cls: type[Collector] = Collector, names=("h", "s", "y"), **kwargs) -> Collector:
    """A MinMSE collector of ``names`` on :func:`_chain`, one sample per run unless told."""
    kwargs.setdefault("max_batch", 1)
    return cls(_chain(), list(names), method=PowerOfTwoMethod.MinMSE, options=OPTS, **kwargs)


class _Scripted(Collector):
    """A collector whose run time and fold rate are fixed, logging folds and run starts."""

    run_time = 0.0
    rate = 1.0

    def __init__(self, *args, **kwargs) -> None:
        self.events: list[tuple[str, int]] = []
        self._measured = False
        super().__init__(*args, **kwargs)

    @property
    def _run_seconds(self) -> float:
        return self.run_time

    @_run_seconds.setter
    def _run_seconds(self, value: float) -> None:
        pass

    @property
    def _fold_seconds_per_value(self) -> float | None:
        return self.rate if self._measured else None

    @_fold_seconds_per_value.setter
    def _fold_seconds_per_value(self, value: float | None) -> None:
        self._measured = self._measured or value is not None

    def _observe(self, feed, first, outputs, start_next=None):
        def logged() -> None:
            self.events.append(("start", first + 1))
            start_next()

        self.events.append(("observe", first))
        super()._observe(feed, first, outputs, logged if start_next is not None else None)

    def _fold(self, outputs, indices):
        self.events.extend(("fold", i) for i in indices)
        super()._fold(outputs, indices)


def _events_of_batch(events: list[tuple[str, int]], batch: int) -> list[tuple[str, int]]:
    begin = events.index(("observe", batch))
    end = events.index(("observe", batch + 1)) if ("observe", batch + 1) in events else None
    return events[begin + 1 : end]


# values left before output 0, 1, 2 (one sample per run): 24, 16, 8; fold rate 1 s per value
@pytest.mark.parametrize(
    ("run_time", "start_before"),
    [(100.0, 0), (24.0, 0), (16.0, 1), (8.5, 2), (1.0, None)],
)
def test_next_run_starts_when_what_is_left_to_fold_takes_one_run(run_time, start_before):
    data = np.random.default_rng(4).standard_normal((6, 4)).astype(np.float32)
    serial = _on_chain(pipeline=False).run(
        ArrayDataReader({"x": data}, batch_size=1), progress=False
    )

    c = _on_chain(_Scripted)
    c.run_time = run_time
    result = c.run(ArrayDataReader({"x": data}, batch_size=1), progress=False)
    assert result.to_dict() == serial.to_dict()  # same statistics wherever the run starts

    folds = [("fold", 0), ("fold", 1), ("fold", 2)]
    # the first fold has no measure yet: the next run starts after it
    assert _events_of_batch(c.events, 0) == [*folds, ("start", 1)]
    for batch in range(1, 5):
        expected = list(folds)
        expected.insert(len(folds) if start_before is None else start_before, ("start", batch + 1))
        assert _events_of_batch(c.events, batch) == expected, batch
    assert _events_of_batch(c.events, 5) == folds  # nothing left to start
    assert sum(1 for e in c.events if e[0] == "start") == 5


def test_fast_folds_start_the_next_run_at_once_and_parallel_folds_too():
    data = np.random.default_rng(5).standard_normal((4, 4)).astype(np.float32)
    for parallel in (False, True):
        c = _on_chain(_Scripted, parallel=parallel)
        c.run_time, c.rate = 1.0, 0.0  # folding costs nothing next to a run
        c.run(ArrayDataReader({"x": data}, batch_size=1), progress=False)
        for batch in (1, 2):
            events = _events_of_batch(c.events, batch)
            assert events[0] == ("start", batch + 1), (parallel, events)
            assert sorted(events[1:]) == [("fold", 0), ("fold", 1), ("fold", 2)]


def test_pipelined_results_equal_serial_ones_with_batches_of_changing_size():
    """Feeds of 1..4 rows on a dynamic batch axis, grouped into runs of up to 3 rows."""
    rng = np.random.default_rng(6)
    feeds = [rng.standard_normal((k, 4)).astype(np.float32) for k in (1, 3, 2, 4, 1, 1, 2)]

    class Feeds:
        def __init__(self) -> None:
            self.it = iter(feeds)

        def get_next(self):
            x = next(self.it, None)
            return None if x is None else {"x": x}

    results = []
    for pipeline in (True, False):
        c = _on_chain(names=("x", "h", "s", "y"), max_batch=3, pipeline=pipeline)
        assert c.combine
        results.append(c.run(Feeds(), progress=False).to_dict())
    assert results[0] == results[1]
    assert results[0]["num_samples"] == 14
