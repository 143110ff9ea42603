"""quark_onnx.runtime.sessions: one place builds the sessions; the XINT8 pipeline's budget of
model forms."""

from __future__ import annotations

import collections

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from conftest import shared_path
from onnx import TensorProto, helper

from quark_onnx import Config, ModelQuantizer, get_default_config
from quark_onnx.runtime import sessions


def _add_model() -> onnx.ModelProto:
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "c"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
        [onnx.numpy_helper.from_array(np.array([1.5, -2.0], np.float32), "c")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_session_options_carry_each_setting() -> None:
    so = sessions.session_options(optimize="basic", arena=False, mem_pattern=False)
    assert so.graph_optimization_level == ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    assert not so.enable_cpu_mem_arena and not so.enable_mem_pattern
    assert so.log_severity_level == 3
    so = sessions.session_options(spinning=False, simulate_qdq=True)
    assert so.graph_optimization_level == ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    assert so.get_session_config_entry("session.intra_op.allow_spinning") == "0"
    assert so.get_session_config_entry("session.disable_quant_qdq") == "1"
    with pytest.raises(ValueError, match="optimize='fast'"):
        sessions.session_options(optimize="fast")


@pytest.mark.parametrize("form", ["proto", "bytes", "ir"])
def test_create_session_runs_every_form_and_counts(form: str) -> None:
    proto = _add_model()
    model = {
        "proto": proto,
        "bytes": proto.SerializeToString(),
        "ir": ir.serde.deserialize_model(proto),
    }[form]
    sessions.COUNTS.reset()
    session = sessions.create_session(model, purpose="test")
    (y,) = session.run(None, {"x": np.array([1.0, 2.0], np.float32)})
    np.testing.assert_array_equal(y, np.array([2.5, 0.0], np.float32))
    assert sessions.COUNTS.sessions == 1 and sessions.COUNTS.purposes == ["test"]
    # a proto is serialized once (counted); bytes are not; an IR model is serialized as part
    # of its session, not as a form the pipeline keeps
    assert sessions.COUNTS.serialisations == (1 if form == "proto" else 0)
    assert getattr(session, "_model_bytes", None) is None  # the bytes are not kept


def test_create_session_edit_changes_only_the_private_proto() -> None:
    model = ir.serde.deserialize_model(_add_model())

    def extra_output(proto: onnx.ModelProto) -> None:
        proto.graph.output.append(onnx.ValueInfoProto(name="x"))

    session = sessions.create_session(model, edit=extra_output)
    assert [o.name for o in session.get_outputs()] == ["y", "x"]
    assert [v.name for v in model.graph.outputs] == ["y"]
    with pytest.raises(ValueError, match="ir.Model"):
        sessions.create_session(_add_model(), edit=extra_output)


def _count_serialisations(monkeypatch) -> list[str]:
    """Count every full-model IR -> proto conversion at onnx_ir's own entry points (whoever calls
    them: ``model_io.to_proto``, ``ir.to_proto``, ``ir.serde.serialize_model``, onnx_ir's own
    passes); each is labelled ``session`` when it builds an onnxruntime session (which takes
    only bytes: every session over a graph in memory serializes it once) and otherwise with the
    function that asked for it."""
    import sys

    found: list[str] = []
    depth = [0]

    def labelled(original):
        def counting(*args, **kwargs):
            if depth[0] == 0:  # a graph serialized as part of a model is not counted again
                frame, caller = sys._getframe(1), None
                while frame is not None:
                    name = frame.f_code.co_name
                    path = frame.f_code.co_filename
                    if name == "create_session":
                        caller = "session"
                        break
                    # the first caller outside onnx_ir and the model_io helpers
                    inside = "onnx_ir" in path or "model_files" in path
                    if caller is None and not inside:
                        caller = name
                    frame = frame.f_back
                found.append(caller or "?")
            depth[0] += 1
            try:
                return original(*args, **kwargs)
            finally:
                depth[0] -= 1

        return counting

    for entry in ("serialize_model_into", "serialize_graph_into"):
        monkeypatch.setattr(ir.serde, entry, labelled(getattr(ir.serde, entry)))
    return found


def test_the_serialisation_count_sees_every_entry_point(monkeypatch) -> None:
    found = _count_serialisations(monkeypatch)
    model = ir.serde.deserialize_model(_add_model())
    ir.to_proto(model)
    ir.serde.serialize_model(model)
    ir.serde.serialize_graph(model.graph)
    sessions.create_session(model)
    assert found == [
        "test_the_serialisation_count_sees_every_entry_point",
        "test_the_serialisation_count_sees_every_entry_point",
        "test_the_serialisation_count_sees_every_entry_point",
        "session",
    ]


@pytest.mark.real_model
def test_xint8_digits_serialisations_and_sessions_only_to_run_data(tmp_path, monkeypatch) -> None:
    """XINT8 on digits_cnn: every IR -> proto conversion, counted at onnx_ir's entry points.

    Outside session building, the working model becomes a proto three times: onnxsim's input,
    the float copy calibration and the accuracy stages read, and the written model. Bias
    correction replays the working model itself (each segment serialized as its session is
    built), and FixShapes runs no shape inference on a model its fixed batch already makes all
    static. Every other conversion builds an onnxruntime session that runs data (one per graph
    state measured), and every session the process builds runs data."""
    created: list[int] = []
    ran: collections.Counter[int] = collections.Counter()
    init, run = ort.InferenceSession.__init__, ort.InferenceSession.run

    def counting_init(self, *args, **kwargs):
        created.append(id(self))
        return init(self, *args, **kwargs)

    def counting_run(self, *args, **kwargs):
        ran[id(self)] += 1
        return run(self, *args, **kwargs)

    monkeypatch.setattr(ort.InferenceSession, "__init__", counting_init)
    monkeypatch.setattr(ort.InferenceSession, "run", counting_run)
    serialised = _count_serialisations(monkeypatch)
    quantizer = ModelQuantizer(Config(global_quant_config=get_default_config("XINT8")))
    sessions.COUNTS.reset()
    quantizer.quantize_model(
        shared_path("models", "digits_cnn.onnx"),
        tmp_path / "q.onnx",
        calibration_data_path=shared_path("models", "digits_calib.npz"),
        progress=False,
    )
    forms = [s for s in serialised if s != "session"]
    assert forms == ["call", "parameters", "finalize"], serialised
    # bias correction's replay builds one session per segment of the working model, each from
    # its own segment proto (not a conversion of the IR)
    purposes = collections.Counter(sessions.COUNTS.purposes)
    segments = purposes.pop("replay segment", 0)
    assert segments > 0
    # one serialisation per session built from the IR, two for the one that runs the models
    # before and after a measured pass (quark_onnx.fidelity.paired_run); calibration's session reads
    # the float copy's proto (serialized to bytes, not converted again)
    assert serialised.count("session") == sessions.COUNTS.sessions - segments - 1 + 1
    assert created and all(ran[s] > 0 for s in created), "a session was built that ran no data"
    # the stages that run data: the float reference, the measured passes, the channel ranges
    # of FoldConstantChannels and of CLE's gate, the residual stream's values for its gate
    # (EqualizeResidualStreams: the digits CNN has one), calibration, the fidelity runs of the
    # quantized model (the samples choices are made on, the held-out verdict's), one run for
    # the shapes of the output anatomy
    assert purposes == {
        "run_model": 5,
        "anatomy": 1,
        "channel_statistics": 2,
        "residual_streams": 1,
        "calibration": 1,
    }
