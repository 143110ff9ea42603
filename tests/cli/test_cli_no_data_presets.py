"""``quark-onnx quantize`` asks for calibration data only when the preset reads it."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import make_model
from onnx import TensorProto, helper

from quark_onnx.cli import main
from quark_onnx.config.presets import preset_names
from quark_onnx.config.quantization import get_default_config


def _conv_model(path) -> None:
    rng = np.random.default_rng(0)
    model = make_model(
        [helper.make_node("Conv", ["x", "W"], ["y"], pads=[1, 1, 1, 1])],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 32, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])],
        {"W": rng.standard_normal((4, 32, 3, 3)).astype(np.float32)},
    )
    onnx.save(model, path)


@pytest.mark.parametrize("preset", preset_names())
def test_data_is_required_exactly_when_the_preset_reads_it(tmp_path, capsys, preset) -> None:
    src = tmp_path / "m.onnx"
    _conv_model(src)
    needs = get_default_config(preset).needs_calibration_data()
    code = main(["quantize", str(src), "-o", str(tmp_path / "out"), "--preset", preset, "-q"])
    if needs:
        assert code == 2
        assert "no calibration data" in capsys.readouterr().err
        assert not (tmp_path / "out" / "m.onnx").exists()
    else:
        assert code == 0, capsys.readouterr().err
        assert (tmp_path / "out" / "m.onnx").exists()


def test_which_presets_need_data() -> None:
    needing = {name for name in preset_names() if get_default_config(name).needs_calibration_data()}
    assert needing == {"XINT8", "A8W8", "A16W8", "U8S8", "FP8_E4M3"}
