"""The YOLOv8-style test detector: valid ONNX, the export's layout, realistic detections, and an
unsimplified build that holds int64 shape arithmetic yet computes the same outputs."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from detectors.detections import decode_yolov8
from detectors.yolov8_like import build_yolov8_like, synthetic_images

SIZE = 160
ANCHORS = (SIZE // 8) ** 2 + (SIZE // 16) ** 2 + (SIZE // 32) ** 2  # 400 + 100 + 25


def _run(model: onnx.ModelProto, images: np.ndarray) -> np.ndarray:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(model.SerializeToString(), options, ["CPUExecutionProvider"])
    return np.concatenate([session.run(None, {"images": x[None]})[0] for x in images])


@pytest.fixture(scope="module")
def simplified() -> onnx.ModelProto:
    return build_yolov8_like()


@pytest.fixture(scope="module")
def unsimplified() -> onnx.ModelProto:
    return build_yolov8_like(unsimplified=True)


@pytest.fixture(scope="module")
def images() -> np.ndarray:
    return synthetic_images(16, SIZE, 2)


@pytest.fixture(scope="module")
def outputs(simplified, images) -> np.ndarray:
    return _run(simplified, images)


def test_synthetic_images():
    x = synthetic_images(4, 64, 5)
    assert x.shape == (4, 3, 64, 64) and x.dtype == np.float32
    assert x.min() >= 0.0 and x.max() <= 1.0
    np.testing.assert_array_equal(x, synthetic_images(4, 64, 5))  # seeded
    assert not np.array_equal(x, synthetic_images(4, 64, 6))


def test_checker_and_interface(simplified):
    onnx.checker.check_model(simplified, full_check=True)
    assert simplified.opset_import[0].version == 17
    (inp,) = simplified.graph.input
    (out,) = simplified.graph.output
    assert inp.name == "images" and out.name == "output0"
    assert [d.dim_value for d in inp.type.tensor_type.shape.dim] == [1, 3, SIZE, SIZE]
    ops = {n.op_type for n in simplified.graph.node}
    # the export's pieces: unfused BN, SiLU as x * Sigmoid(x), C2f Split, SPPF, FPN, DFL
    assert {"BatchNormalization", "Sigmoid", "Mul", "Split", "MaxPool", "Resize", "Softmax"} <= ops
    assert not {"Shape", "Gather"} & ops


def test_output_layout(outputs):
    assert outputs.shape == (16, 4 + 80, ANCHORS)
    assert np.isfinite(outputs).all()
    scores = outputs[:, 4:]
    assert scores.min() >= 0.0 and scores.max() <= 1.0
    assert (outputs[:, 2:4] > 0).all()  # widths and heights


def test_boxes_mostly_inside_the_image(outputs):
    dets = decode_yolov8(outputs)
    boxes = np.concatenate([b for b, _, _ in dets])
    centres = (boxes[:, :2] + boxes[:, 2:]) / 2
    assert ((centres >= 0) & (centres <= SIZE)).all(axis=1).mean() > 0.9
    inside = np.clip(boxes, 0, SIZE)
    share = np.prod(inside[:, 2:] - inside[:, :2], 1) / np.prod(boxes[:, 2:] - boxes[:, :2], 1)
    assert share.mean() > 0.8  # most of each box lies in the image
    sizes = np.maximum(boxes[:, 2] - boxes[:, 0], boxes[:, 3] - boxes[:, 1])
    assert np.percentile(sizes, 90) > 1.5 * np.percentile(sizes, 10)  # varied sizes


def test_realistic_detection_count(outputs):
    dets = decode_yolov8(outputs)
    counts = np.array([len(b) for b, _, _ in dets])
    assert 2 <= counts.mean() <= 60, counts
    assert np.median(counts) >= 2, counts
    classes = np.concatenate([c for _, _, c in dets])
    assert len(np.unique(classes)) >= 10  # the argmax class varies
    scores = np.concatenate([s for _, s, _ in dets])
    assert scores.max() > 0.6  # confident detections as well as borderline ones


def test_seed_changes_weights():
    a = {t.name: onnx.numpy_helper.to_array(t) for t in build_yolov8_like(seed=1).graph.initializer}
    b = {t.name: onnx.numpy_helper.to_array(t) for t in build_yolov8_like(seed=0).graph.initializer}
    assert a.keys() == b.keys()
    assert not np.array_equal(a["/model.0.conv.weight"], b["/model.0.conv.weight"])


def test_unsimplified_holds_shape_arithmetic(unsimplified):
    onnx.checker.check_model(unsimplified, full_check=True)
    ops = [n.op_type for n in unsimplified.graph.node]
    for op in ("Shape", "Gather", "Unsqueeze", "Range", "ConstantOfShape", "Constant"):
        assert op in ops, op
    inferred = onnx.shape_inference.infer_shapes(unsimplified)
    types = {v.name: v.type.tensor_type.elem_type for v in inferred.graph.value_info}
    gathers = [n.output[0] for n in unsimplified.graph.node if n.op_type == "Gather"]
    assert all(types[g] == onnx.TensorProto.INT64 for g in gathers)
    # a float tensor that only feeds shapes: the upsample sizes computed through Cast(float)
    float_casts = [
        n.output[0]
        for n in unsimplified.graph.node
        if n.op_type == "Cast" and n.attribute[0].i == onnx.TensorProto.FLOAT
    ]
    assert float_casts


def test_unsimplified_computes_the_same(unsimplified, images, outputs):
    np.testing.assert_allclose(_run(unsimplified, images), outputs, rtol=0, atol=1e-5)
