"""Quantize one benchmark model with quark_onnx (this project), the XINT8 preset as shipped.

Runs in the project environment (``/work/venv`` or whichever interpreter has ``quark_onnx``
installed). Uses only the public API::

    qc = get_default_config("XINT8")   # bias correction on, CLE off, AdaRound off
    ModelQuantizer(Config(global_quant_config=qc)).quantize_model(float_path, out_path, reader)

with ``reader = ArrayDataReader({input_name: calib_NCHW_float32}, batch_size=1)``.

Timing: ``quant_s`` from just before ``quantize_model`` (which loads the model) until the output
file exists; imports and reading the cached calibration arrays are outside it.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common


def prepare(args, spec, imported):
    from quark_onnx import ArrayDataReader, Config, ModelQuantizer, get_default_config

    imported()
    import numpy as np

    reader = ArrayDataReader({spec.input_name: np.load(spec.calib_path)}, batch_size=1)
    qc = get_default_config("XINT8")  # as shipped: bias correction on, CLE and AdaRound off
    quantizer = ModelQuantizer(Config(global_quant_config=qc))
    return lambda: quantizer.quantize_model(str(spec.float_path), str(args.out), reader)


def main() -> int:
    return common.run_tool("quark_onnx", "quark_onnx (XINT8)", prepare)


if __name__ == "__main__":
    sys.exit(main())
