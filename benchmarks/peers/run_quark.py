"""Quantize one benchmark model with AMD Quark 0.13, XINT8, as AMD's Vitis AI docs prescribe.

Runs in ``benchmarks/.envs/quark``. The configuration is the one in the Vitis AI
documentation (shared/seeds/004): ``get_default_config("XINT8")``, ``activation_type =
QInt8``, ``optimize_model = False`` and the mandatory extra options
(``common.XINT8_EXTRA_OPTIONS``), with real calibration data instead of random data.
Quark's defaults stay as they are otherwise (it runs CLE implicitly: ``include_cle=True``).

Timing: ``quant_s`` runs from just before ``quantize_model`` (which loads the model) until the
output file exists; imports and reading the cached calibration arrays are outside it and
reported separately.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common


def prepare(args, spec, imported):
    from onnxruntime.quantization.quant_utils import QuantType
    from quark.onnx import CalibrationDataReader, ModelQuantizer
    from quark.onnx.quantization.config.config import Config
    from quark.onnx.quantization.config.custom_config import get_default_config

    imported()

    class Reader(common.ListReader, CalibrationDataReader):
        pass

    reader = Reader(common.calibration_batches(args.model))
    qc = get_default_config("XINT8")
    qc.activation_type = QuantType.QInt8
    qc.optimize_model = False
    qc.extra_options.update(common.XINT8_EXTRA_OPTIONS)
    quantizer = ModelQuantizer(Config(global_quant_config=qc))
    return lambda: quantizer.quantize_model(str(spec.float_path), str(args.out), reader)


def main() -> int:
    return common.run_tool("quark", "AMD Quark 0.13 (XINT8)", prepare)


if __name__ == "__main__":
    sys.exit(main())
