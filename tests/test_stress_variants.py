"""benchmarks/make_stress_variants.py: variants keep every float output and do stress the ranges."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import make_model, run_ort, shared_path
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import make_stress_variants as msv


def _tiny() -> onnx.ModelProto:
    """Conv3x3 -> Relu -> {Conv1x1, Conv3x3(pad)} ; Conv1x1 -> PRelu -> depthwise -> Relu ->
    Conv1x1 -> LeakyRelu -> Conv1x1; the padded branch -> Relu -> Conv1x1; added at the end."""
    rng = np.random.default_rng(1)

    def w(*shape):
        return (rng.standard_normal(shape) * 0.3).astype(np.float32)

    inits = {
        "w0": w(4, 3, 3, 3), "b0": w(4),
        "w1": w(6, 4, 1, 1), "b1": w(6),
        "slope": np.full((6, 1, 1), 0.2, np.float32),
        "wd": w(6, 1, 3, 3), "bd": w(6),
        "w2": w(5, 6, 1, 1), "b2": w(5),
        "w3": w(5, 5, 1, 1),
        "wp": w(5, 4, 3, 3), "bp": w(5),
        "wq": w(5, 5, 1, 1), "bq": w(5),
    }  # fmt: skip
    nodes = [
        helper.make_node("Conv", ["x", "w0", "b0"], ["c0"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c0"], ["r0"]),
        helper.make_node("Conv", ["r0", "w1", "b1"], ["c1"]),
        helper.make_node("PRelu", ["c1", "slope"], ["p1"]),
        helper.make_node("Conv", ["p1", "wd", "bd"], ["cd"], group=6, pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["cd"], ["rd"]),
        helper.make_node("Conv", ["rd", "w2", "b2"], ["c2"]),
        helper.make_node("LeakyRelu", ["c2"], ["l2"], alpha=0.1),
        helper.make_node("Conv", ["l2", "w3"], ["c3"]),
        helper.make_node("Conv", ["r0", "wp", "bp"], ["cp"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["cp"], ["rp"]),
        helper.make_node("Conv", ["rp", "wq", "bq"], ["cq"]),
        helper.make_node("Add", ["c3", "cq"], ["y"]),
    ]
    return make_model(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 5, 8, 8])],
        inits,
    )


def _weights(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)) / np.max(np.abs(a)))


@pytest.fixture
def tiny_inputs() -> np.ndarray:
    return np.random.default_rng(2).standard_normal((6, 1, 3, 8, 8)).astype(np.float32) * 2


@pytest.mark.parametrize("kind", msv.KINDS)
def test_tiny_variant_keeps_outputs(kind, tiny_inputs):
    model = _tiny()
    variant, stats = msv.make_variant(model, kind, seed=0)
    for x in tiny_inputs:
        (ref,) = run_ort(model, {"x": x})
        (out,) = run_ort(variant, {"x": x})
        assert _rel(ref, out) <= 1e-5
    assert variant.SerializeToString() == msv.make_variant(model, kind, 0)[0].SerializeToString()
    assert model.SerializeToString() == _tiny().SerializeToString()  # input untouched
    if kind == "streams":
        # the tiny model's Add is a graph output: no stream can be rescaled
        assert stats == {"rescaled_streams": 0}
    elif kind != "deadconst":
        # w0 -> Relu -> {w1, wp}, w1 -> PRelu -> depthwise, wd -> Relu -> w2, w2 -> LeakyRelu
        # -> w3, wp -> Relu -> wq: five producers rescaled, six consumers compensated (w1, wp,
        # wd, w2, w3, wq); w3 and wq end at the Add, so they are not rescaled.
        assert stats["rescaled_convs"] == 5 and stats["compensated_convs"] == 6
        w0 = _weights(variant)["w0"]
        rows = np.abs(w0[:4]).reshape(4, -1).max(axis=1)
        ref_rows = np.abs(_weights(model)["w0"]).reshape(4, -1).max(axis=1)
        factors = rows / ref_rows
        assert np.all((factors >= 1 / 100 - 1e-6) & (factors <= 100 + 1e-4))
        assert factors.max() / factors.min() > 3  # the rows were really spread
    else:
        assert "rescaled_convs" not in stats


def test_tiny_deadconst_layout():
    model = _tiny()
    variant, stats = msv.make_variant(model, "deadconst", seed=0)
    w = _weights(variant)
    ref = _weights(model)
    # w0 feeds a padded 3x3 Conv: its new channels must be dead (negative bias before Relu).
    n0 = w["w0"].shape[0] - 4
    assert n0 >= 1 and np.all(w["b0"][4:] < 0) and np.all(np.abs(w["w0"][4:]) < 1e-5)
    # ... and both readers got the new input channels with ~100x their median weight.
    for name, cin in (("w1", 4), ("wp", 4)):
        assert w[name].shape[1] == cin + n0
        assert np.median(np.abs(w[name][:, cin:])) > 30 * np.median(np.abs(ref[name]))
    # w1 -> PRelu -> depthwise: one more group per new channel, slope extended.
    n1 = w["w1"].shape[0] - 6
    assert w["wd"].shape[0] == 6 + n1
    conv_d = next(n for n in variant.graph.node if n.output[0] == "cd")
    assert msv._attr(conv_d, "group", 1) == 6 + n1
    assert stats["sites"] >= 3 and stats["dead_channels"] >= n0


def test_refuses_to_overwrite_input(tmp_path):
    path = tmp_path / "m.onnx"
    onnx.save(_tiny(), str(path))
    before = path.read_bytes()
    with pytest.raises(SystemExit, match="overwrite"):
        msv.build(path, "rescale", 0, path)
    assert path.read_bytes() == before


def test_fails_when_output_changes(tmp_path, monkeypatch):
    """The check can fail: a variant off by 1 % in one weight is caught, nothing written."""
    path = tmp_path / "m.onnx"
    onnx.save(_tiny(), str(path))
    make = msv.make_variant

    def broken(model, kind, seed):
        variant, stats = make(model, kind, seed)
        w3 = next(t for t in variant.graph.initializer if t.name == "w3")
        w3.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(w3) * 1.01, "w3"))
        return variant, stats

    monkeypatch.setattr(msv, "make_variant", broken)
    with pytest.raises(SystemExit, match="changes a float output"):
        msv.build(path, "rescale", 0, tmp_path / "out.onnx")
    assert not (tmp_path / "out.onnx").exists()


@pytest.mark.real_model
@pytest.mark.slow
@pytest.mark.parametrize(
    "name", ["digits_cnn.onnx", "squeezenet1.1.onnx", "mobilenetv2_rebuilt.onnx"]
)
@pytest.mark.parametrize("kind", msv.KINDS)
def test_shared_models(name, kind, tmp_path):
    path = shared_path("models", name)
    out = tmp_path / f"{kind}.onnx"
    result = msv.build(path, kind, 0, out, samples=4)
    assert out.exists()
    assert max(result["max_rel_diff"].values()) <= msv.TOLERANCE
    stats = result["stats"]
    # Tensors the variant does not widen keep their recorded types (int64 shape arithmetic in
    # particular), as in the original.
    original, variant = onnx.load(str(path)), onnx.load(str(out))
    kept = {vi.name: vi.type for vi in variant.graph.value_info}
    for vi in original.graph.value_info:
        if vi.type.tensor_type.elem_type != TensorProto.FLOAT:
            assert kept.get(vi.name) == vi.type, vi.name
    if kind in ("deadconst", "both"):
        assert stats["dead_channels"] > 0
    if kind in ("rescale", "both"):
        assert stats["rescaled_convs"] > 0
    if kind == "streams":  # MobileNetV2's five stages with skip connections
        assert stats["rescaled_streams"] == (5 if name == "mobilenetv2_rebuilt.onnx" else 0)
