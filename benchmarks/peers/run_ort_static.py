"""Quantize one benchmark model with onnxruntime's ``quantize_static`` (the float-scale reference).

Runs in ``benchmarks/.envs/bench`` (onnxruntime 1.31.1). QDQ format, MinMax calibration,
per-channel int8 weights, onnxruntime's default activation type (uint8, asymmetric) and
float (not power-of-two) scales: the accuracy a general-purpose int8 flow reaches, not an
NPU-deployable model. No ``quant_pre_process`` step (the model is quantized as given).

Timing: ``quant_s`` from just before ``quantize_static`` (which loads the model) until the
output file exists; imports and reading the cached calibration arrays are outside it.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common


def prepare(args, spec, imported):
    from onnxruntime.quantization import (
        CalibrationDataReader,
        CalibrationMethod,
        QuantFormat,
        QuantType,
        quantize_static,
    )

    imported()

    class Reader(common.ListReader, CalibrationDataReader):
        pass

    reader = Reader(common.calibration_batches(args.model))
    return lambda: quantize_static(
        str(spec.float_path),
        str(args.out),
        reader,
        quant_format=QuantFormat.QDQ,
        per_channel=True,
        activation_type=QuantType.QUInt8,
        weight_type=QuantType.QInt8,
        calibrate_method=CalibrationMethod.MinMax,
    )


def main() -> int:
    return common.run_tool(
        "ort_static", "onnxruntime quantize_static (QDQ, MinMax, per-channel)", prepare
    )


if __name__ == "__main__":
    sys.exit(main())
