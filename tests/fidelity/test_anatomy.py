"""Output anatomy (quark_onnx.fidelity.anatomy) and the per-part verdict
(quark_onnx.fidelity).

The graphs are the tails of real model families: a YOLOv8 head (boxes and class scores joined on
the channel axis), a YOLOX head (per scale a join of box, objectness and class channels, the
scales joined along the anchors, then transposed to rows), an NHWC segmenter and a box regression
head with as many rows as anchors. Oracles: the slices are the ones the graph writes, and every
agreement is recomputed with numpy.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from quark_onnx.fidelity.anatomy import OutputPart
from quark_onnx.fidelity.verdict import compare_runs
from quark_onnx.pipeline.guard import output_anatomy


def _model(nodes, inputs, outputs, inits=()) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "tail", inputs, outputs, list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return onnx.shape_inference.infer_shapes(model)


def _conv(name: str, x: str, cin: int, cout: int, rng: np.random.Generator) -> tuple:
    w = numpy_helper.from_array(rng.normal(size=(cout, cin, 1, 1)).astype(np.float32), name + "_w")
    node = helper.make_node("Conv", [x, w.name], [name], name=name, kernel_shape=[1, 1])
    return node, w


def _run(model: onnx.ModelProto, feed: dict) -> dict:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, feed), strict=True))


def _parts(model: onnx.ModelProto, feed: dict) -> dict[str, list[OutputPart]]:
    return output_anatomy(ir.serde.deserialize_model(model), feed)


def yolov8_tail(classes: int = 3, anchors: int = 6) -> onnx.ModelProto:
    """boxes = dist * 8 (pixels), scores = Sigmoid(Reshape(Conv)); output Concat(axis 1)."""
    rng = np.random.default_rng(0)
    conv, w = _conv("cls_conv", "feat", 4, classes, rng)
    shape = numpy_helper.from_array(np.array([1, classes, anchors], np.int64), "shape")
    eight = numpy_helper.from_array(np.array(8.0, np.float32), "eight")
    nodes = [
        conv,
        helper.make_node("Reshape", ["cls_conv", "shape"], ["cls_flat"], name="reshape"),
        helper.make_node("Sigmoid", ["cls_flat"], ["scores"], name="sigmoid"),
        helper.make_node("Mul", ["dist", "eight"], ["boxes"], name="box_mul"),
        helper.make_node("Concat", ["boxes", "scores"], ["output0"], name="join", axis=1),
    ]
    inputs = [
        helper.make_tensor_value_info("feat", TensorProto.FLOAT, [1, 4, 2, 3]),
        helper.make_tensor_value_info("dist", TensorProto.FLOAT, [1, 4, anchors]),
    ]
    outputs = [helper.make_tensor_value_info("output0", TensorProto.FLOAT, None)]
    return _model(nodes, inputs, outputs, [w, shape, eight])


def test_yolov8_tail_parts_boxes_and_scores_on_the_channel_axis():
    model = yolov8_tail()
    feed = {"feat": np.ones((1, 4, 2, 3), np.float32), "dist": np.ones((1, 4, 6), np.float32)}
    (box, scores) = _parts(model, feed)["output0"]
    assert (box.axis, box.start, box.stop, box.kind, box.op_type) == (1, 0, 4, "value", "Mul")
    assert (scores.axis, scores.start, scores.stop, scores.kind) == (1, 4, 7, "score")
    assert scores.class_axis == 1 and scores.label == "output0[:, 4:7]"


def yolox_tail(scales=((2, 2), (1, 2))) -> onnx.ModelProto:
    """Per scale Concat[box Conv, Sigmoid(obj Conv), Sigmoid(cls Conv)] on channels, flattened
    to [1, 6, HW]; the scales joined along the anchors; Transpose to [1, A, 6]."""
    rng = np.random.default_rng(1)
    nodes, inits, inputs, joined = [], [], [], []
    shape = numpy_helper.from_array(np.array([1, 6, -1], np.int64), "flat")
    inits.append(shape)
    for i, (h, w) in enumerate(scales):
        x = f"f{i}"
        inputs.append(helper.make_tensor_value_info(x, TensorProto.FLOAT, [1, 4, h, w]))
        for name, cout in (("reg", 4), ("obj", 1), ("cls", 1)):
            node, weight = _conv(f"{name}{i}", x, 4, cout, rng)
            nodes.append(node)
            inits.append(weight)
        nodes += [
            helper.make_node("Sigmoid", [f"obj{i}"], [f"obj_s{i}"], name=f"obj_sig{i}"),
            helper.make_node("Sigmoid", [f"cls{i}"], [f"cls_s{i}"], name=f"cls_sig{i}"),
            helper.make_node("Concat", [f"reg{i}", f"obj_s{i}", f"cls_s{i}"], [f"head{i}"], axis=1),
            helper.make_node("Reshape", [f"head{i}", "flat"], [f"rows{i}"]),
        ]
        joined.append(f"rows{i}")
    nodes += [
        helper.make_node("Concat", joined, ["all"], axis=2),
        helper.make_node("Transpose", ["all"], ["output"], perm=[0, 2, 1]),
    ]
    outputs = [helper.make_tensor_value_info("output", TensorProto.FLOAT, None)]
    return _model(nodes, inputs, outputs, inits)


def test_yolox_tail_parts_follow_the_channel_join_through_scales_and_transpose():
    model = yolox_tail()
    feed = {"f0": np.ones((1, 4, 2, 2), np.float32), "f1": np.ones((1, 4, 1, 2), np.float32)}
    parts = _parts(model, feed)["output"]
    assert [(p.axis, p.start, p.stop, p.kind) for p in parts] == [
        (2, 0, 4, "value"),
        (2, 4, 5, "score"),
        (2, 5, 6, "score"),
    ]
    assert all(p.class_axis == 2 for p in parts)


def test_scores_rounded_to_zero_fail_their_part_while_the_whole_output_sqnr_is_high():
    rng = np.random.default_rng(2)
    small = yolov8_tail(classes=3, anchors=6)
    feed = {"feat": np.ones((1, 4, 2, 3), np.float32), "dist": np.ones((1, 4, 6), np.float32)}
    parts = _parts(small, feed)
    reference = []
    for _ in range(4):
        boxes = rng.uniform(50, 300, size=(1, 4, 6))
        scores = rng.uniform(0, 1, size=(1, 3, 6)) ** 3
        reference.append({"output0": np.concatenate([boxes, scores], axis=1)})
    broken = []
    for ref in reference:
        q = ref["output0"].copy()
        q[:, 4:] = 0.0  # every score rounded to 0 by a position shared with the boxes
        broken.append({"output0": q})
    (out,) = compare_runs(reference, broken, parts=parts, batches=[1] * 4)
    assert out.sqnr_db > 20 and not out.faithful
    box, score = out.parts
    assert box.faithful and box.measure == "sqnr"
    assert score.measure == "decisions" and score.kept == 0.0 and score.agreement == 0.0
    # numpy: the float decisions at 0.25 (class = argmax over axis 1, kept if its max >= 0.25)
    expected = sum(int(np.sum(r["output0"][0, 4:].max(axis=0) >= 0.25)) for r in reference)
    assert score.decisions == expected
    assert "output0[:, 4:7]" in score.describe()
    (same,) = compare_runs(reference, reference, parts=parts, batches=[1] * 4)
    assert same.faithful and same.parts[1].agreement == 1.0


def test_decision_agreement_is_the_f1_of_the_positive_decisions():
    part = OutputPart("s", None, 0, -1, "score", 1, False, "sig", "Sigmoid")
    f = np.array([[[0.9, 0.1, 0.3, 0.0], [0.0, 0.8, 0.0, 0.1]]])  # [1, 2 classes, 4 anchors]
    q = np.array([[[0.9, 0.1, 0.1, 0.4], [0.0, 0.1, 0.0, 0.1]]])
    # float decisions: a0 class 0, a1 class 1, a2 class 0; quantized: a0 class 0, a3 class 0
    (out,) = compare_runs([{"s": f}], [{"s": q}], parts={"s": [part]}, batches=[1])
    (p,) = out.parts
    assert p.decisions == 3 and p.kept == 1 / 3
    assert p.agreement == 2 * 1 / (3 + 2)


def test_nhwc_segmentation_agreement_is_argmax_over_the_last_axis():
    rng = np.random.default_rng(3)
    conv, w = _conv("logits", "x", 3, 5, rng)
    nodes = [conv, helper.make_node("Transpose", ["logits"], ["seg"], perm=[0, 2, 3, 1])]
    model = _model(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 4, 6])],
        [helper.make_tensor_value_info("seg", TensorProto.FLOAT, None)],
        [w],
    )
    feeds = [{"x": rng.normal(size=(1, 3, 4, 6)).astype(np.float32)} for _ in range(3)]
    parts = _parts(model, feeds[0])
    (part,) = parts["seg"]
    assert part.axis is None and part.class_axis == 3
    reference = [_run(model, feed) for feed in feeds]
    noisy = [{"seg": r["seg"] + rng.normal(scale=0.7, size=r["seg"].shape)} for r in reference]
    (out,) = compare_runs(reference, noisy, parts=parts, batches=[1] * 3)
    (judged,) = out.parts
    f = np.stack([r["seg"] for r in reference])
    q = np.stack([n["seg"] for n in noisy])
    expected = float(np.mean(np.argmax(f, axis=-1) == np.argmax(q, axis=-1)))
    assert judged.measure == "argmax" and judged.agreement == expected
    assert expected != float(np.mean(np.argmax(f, axis=2) == np.argmax(q, axis=2)))


def test_a_regression_output_with_a_row_per_anchor_has_no_top1():
    rng = np.random.default_rng(4)
    conv, w = _conv("loc_conv", "x", 3, 14, rng)
    shape = numpy_helper.from_array(np.array([-1, 14], np.int64), "rows")
    nodes = [
        conv,
        helper.make_node("Transpose", ["loc_conv"], ["nhwc"], perm=[0, 2, 3, 1]),
        helper.make_node("Reshape", ["nhwc", "rows"], ["loc"]),
    ]
    model = _model(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 4, 5])],
        [helper.make_tensor_value_info("loc", TensorProto.FLOAT, None)],
        [w, shape],
    )
    feed = {"x": rng.normal(size=(1, 3, 4, 5)).astype(np.float32)}
    parts = _parts(model, feed)
    reference = [_run(model, feed)]
    noisy = [{"loc": reference[0]["loc"] * 1.01}]
    (out,) = compare_runs(reference, noisy, parts=parts, batches=[1])
    (judged,) = out.parts
    assert judged.measure == "sqnr" and judged.agreement is None
    assert "top-1" not in out.describe()


def test_a_per_sample_score_vector_keeps_its_top1():
    f = [{"logits": np.array([[1.0, 3.0, 2.0]])}, {"logits": np.array([[5.0, 1.0, 0.0]])}]
    q = [{"logits": np.array([[1.0, 2.0, 3.0]])}, {"logits": np.array([[4.0, 1.0, 0.0]])}]
    (out,) = compare_runs(f, q, parts={}, batches=[1, 1])
    (judged,) = out.parts
    assert judged.measure == "top1" and judged.agreement == 0.5
