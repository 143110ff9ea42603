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
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common


def main() -> int:
    args = common.runner_args("quark_onnx (XINT8)")
    spec = common.MODELS[args.model]
    result: dict = {"tool": "quark_onnx", "model": args.model, "ok": False}
    try:
        t0 = time.perf_counter()
        from quark_onnx import ArrayDataReader, Config, ModelQuantizer, get_default_config

        result["import_s"] = time.perf_counter() - t0
        import numpy as np

        reader = ArrayDataReader({spec.input_name: np.load(spec.calib_path)}, batch_size=1)
        qc = get_default_config("XINT8")  # as shipped: bias correction on, CLE and AdaRound off
        quantizer = ModelQuantizer(Config(global_quant_config=qc))
        args.out.parent.mkdir(parents=True, exist_ok=True)
        result["rss_before_quant_mb"] = common.peak_rss_mb()
        t1, c1 = time.perf_counter(), time.process_time()
        quantizer.quantize_model(str(spec.float_path), str(args.out), reader)
        if not args.out.exists():
            raise RuntimeError(f"quark_onnx returned without writing {args.out}")
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
