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
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common


def main() -> int:
    args = common.runner_args("AMD Quark 0.13 (XINT8)")
    spec = common.MODELS[args.model]
    result: dict = {"tool": "quark", "model": args.model, "ok": False}
    try:
        t0 = time.perf_counter()
        from onnxruntime.quantization.quant_utils import QuantType
        from quark.onnx import CalibrationDataReader, ModelQuantizer
        from quark.onnx.quantization.config.config import Config
        from quark.onnx.quantization.config.custom_config import get_default_config

        result["import_s"] = time.perf_counter() - t0

        class Reader(common.ListReader, CalibrationDataReader):
            pass

        reader = Reader(common.calibration_batches(args.model))
        qc = get_default_config("XINT8")
        qc.activation_type = QuantType.QInt8
        qc.optimize_model = False
        qc.extra_options.update(common.XINT8_EXTRA_OPTIONS)
        quantizer = ModelQuantizer(Config(global_quant_config=qc))
        args.out.parent.mkdir(parents=True, exist_ok=True)
        result["rss_before_quant_mb"] = common.peak_rss_mb()
        t1, c1 = time.perf_counter(), time.process_time()
        quantizer.quantize_model(str(spec.float_path), str(args.out), reader)
        if not args.out.exists():
            raise RuntimeError(f"Quark returned without writing {args.out}")
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
