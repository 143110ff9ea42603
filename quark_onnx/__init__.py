"""quark_onnx: ONNX-first post-training quantizer for AMD Vitis AI / Ryzen AI NPUs.

The public API is shaped like AMD Quark's ``quark.onnx``::

    from quark_onnx import ModelQuantizer, Config, get_default_config, QuantType

    qc = get_default_config("XINT8")
    quantizer = ModelQuantizer(Config(global_quant_config=qc))
    quantizer.quantize_model("model.onnx", "model.quant.onnx", calibration_data_reader)

Heavy modules (onnx, onnxruntime, numpy) load on first use, so ``import quark_onnx`` stays fast.
"""

from __future__ import annotations

import importlib
from typing import Any

from quark_onnx.config.enums import CalibrationMethod, PowerOfTwoMethod, QuantFormat, QuantType
from quark_onnx.config.quantization import Config, QuantizationConfig, get_default_config
from quark_onnx.errors import (
    CalibrationError,
    ConfigError,
    ModelLoadError,
    ModelSaveError,
    PassError,
    QuantizationError,
    QuarkOnnxError,
    UnsafePathError,
)

__version__ = "0.1.0"

# name -> module that defines it; imported on first attribute access.
_LAZY = {
    "ModelQuantizer": "quark_onnx.pipeline.quantizer",
    "check": "quark_onnx.npu.readiness",
    "CalibrationDataReader": "quark_onnx.calibration.readers",
    "NpzDataReader": "quark_onnx.calibration.readers",
    "ArrayDataReader": "quark_onnx.calibration.readers",
    "RandomDataReader": "quark_onnx.calibration.readers",
    "ImageFolderDataReader": "quark_onnx.calibration.image_reader",
    "PreprocessSpec": "quark_onnx.calibration.image_spec",
    "CalibrationResult": "quark_onnx.calibration.result",
    "QuantParams": "quark_onnx.params.qparams",
    "save_recipe": "quark_onnx.formats.recipe",
    "load_recipe": "quark_onnx.formats.recipe",
    "import_recipe": "quark_onnx.formats.recipe",
    "read_qdq": "quark_onnx.formats.importer",
    "export_gguf": "quark_onnx.formats.gguf_export",
    "export_matmul_nbits": "quark_onnx.formats.nbits_export",
}

__all__ = [
    "CalibrationError",
    "CalibrationMethod",
    "Config",
    "ConfigError",
    "ModelLoadError",
    "ModelSaveError",
    "PassError",
    "PowerOfTwoMethod",
    "QuantFormat",
    "QuantType",
    "QuantizationConfig",
    "QuantizationError",
    "QuarkOnnxError",
    "UnsafePathError",
    "__version__",
    "get_default_config",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module = importlib.import_module(_LAZY[name])
        value = getattr(module, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'quark_onnx' has no attribute {name!r}")
