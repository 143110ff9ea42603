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
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common


def main() -> int:
    args = common.runner_args("onnxruntime quantize_static (QDQ, MinMax, per-channel)")
    spec = common.MODELS[args.model]
    result: dict = {"tool": "ort_static", "model": args.model, "ok": False}
    try:
        t0 = time.perf_counter()
        from onnxruntime.quantization import (
            CalibrationDataReader,
            CalibrationMethod,
            QuantFormat,
            QuantType,
            quantize_static,
        )

        result["import_s"] = time.perf_counter() - t0

        class Reader(common.ListReader, CalibrationDataReader):
            pass

        reader = Reader(common.calibration_batches(args.model))
        args.out.parent.mkdir(parents=True, exist_ok=True)
        result["rss_before_quant_mb"] = common.peak_rss_mb()
        t1, c1 = time.perf_counter(), time.process_time()
        quantize_static(
            str(spec.float_path),
            str(args.out),
            reader,
            quant_format=QuantFormat.QDQ,
            per_channel=True,
            activation_type=QuantType.QUInt8,
            weight_type=QuantType.QInt8,
            calibrate_method=CalibrationMethod.MinMax,
        )
        if not args.out.exists():
            raise RuntimeError(f"quantize_static returned without writing {args.out}")
        result["quant_s"] = time.perf_counter() - t1
        result["quant_cpu_s"] = time.process_time() - c1
        result["vmhwm_mb"] = common.peak_rss_mb()
        result["ok"] = True
    except BaseException as exc:  # recorded, the driver reports it
        result["error"] = common.error_text(exc)
    common.write_result(args.result, result)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
